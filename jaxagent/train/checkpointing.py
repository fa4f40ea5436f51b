"""Train checkpoints with Orbax: one composite per step holds everything that decides the next step.

Items of a step: `state` (params, optimizer state, step, policy version, RNG key data), `meta` (iteration,
grain iterator state, versions, env version), `model_config` (HF-style dict) and `config` (the run's config).
Saves are asynchronous and keep the newest N. Restoring takes the latest *complete* step; an unreadable
latest step is skipped with a warning naming it, and an incompatible model is refused with a clear error.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxagent.train.state import TrainState

log = logging.getLogger(__name__)


class IncompatibleCheckpointError(ValueError):
  """The checkpoint was written for a different model or algorithm than the one being resumed."""


def versions() -> dict[str, str]:
  import optax  # pylint: disable=g-import-not-at-top
  return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
          "orbax": ocp.__version__ if hasattr(ocp, "__version__") else "?"}


def _to_saveable(state: TrainState) -> dict[str, Any]:
  out = {"params": state.params, "opt_state": state.opt_state, "step": state.step,
         "policy_version": state.policy_version, "rng": jax.random.key_data(state.rng)}
  if state.ref_params is not None:
    out["ref_params"] = state.ref_params
  return out


class TrainCheckpointer:
  """Async keep-N checkpoints of a run's `checkpoints/` directory."""

  def __init__(self, directory: Path, *, keep: int):
    self.directory = Path(directory).resolve()
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                             enable_async_checkpointing=True))

  def save(self, iteration: int, state: TrainState, meta: dict[str, Any], model_config: dict[str, Any],
           config: dict[str, Any]) -> None:
    meta = {**meta, "has_reference": state.ref_params is not None}  # read back first: the restore target
    self.manager.save(iteration, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_to_saveable(state)), meta=ocp.args.JsonSave(meta),
        model_config=ocp.args.JsonSave(model_config), config=ocp.args.JsonSave(config)))

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()

  def restore_latest(self, abstract_state: TrainState, model_config: dict[str, Any]
                     ) -> tuple[int, TrainState, dict[str, Any]] | None:
    """(iteration, state, meta) of the newest readable step, or None when there is none."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      try:
        stored = self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore(), model_config=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except  (orbax raises many types for a torn step)
        warnings.warn(f"checkpoint {self.directory / str(step)} is unreadable ({type(e).__name__}: {e}); "
                      "trying the previous one", RuntimeWarning, stacklevel=2)
        continue
      _check_compatible(stored["model_config"], model_config, self.directory / str(step))
      target = _to_saveable(abstract_state)
      target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                            target)
      # The target is the state as it was saved: a run may resume with `algo.kl_coef` turned on (the
      # checkpoint has no reference: its policy becomes one) or off (the stored reference is dropped).
      target.pop("ref_params", None)
      if stored["meta"].get("has_reference", False):
        target["ref_params"] = target["params"]["policy"]
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
      except Exception as e:  # pylint: disable=broad-except
        warnings.warn(f"checkpoint {self.directory / str(step)}: state unreadable ({type(e).__name__}: {e}); "
                      "trying the previous one", RuntimeWarning, stacklevel=2)
        continue
      s = restored["state"]
      ref = s.get("ref_params")
      if abstract_state.ref_params is None and ref is not None:
        warnings.warn(f"checkpoint {self.directory / str(step)} has a KL reference policy; algo.kl_coef is 0 now, "
                      "so it is dropped", RuntimeWarning, stacklevel=2)
        ref = None
      elif abstract_state.ref_params is not None and ref is None:
        warnings.warn(f"checkpoint {self.directory / str(step)} has no KL reference policy (saved with "
                      "algo.kl_coef = 0); its policy becomes the reference from here", RuntimeWarning, stacklevel=2)
        ref = jax.tree.map(jnp.copy, s["params"]["policy"])  # its own buffers: the state is donated per step
      state = TrainState(params=s["params"], opt_state=s["opt_state"], step=s["step"],
                         policy_version=s["policy_version"], rng=jax.random.wrap_key_data(s["rng"]),
                         ref_params=ref)
      return step, state, stored["meta"]
    return None


def _check_compatible(stored: dict[str, Any], current: dict[str, Any], where: Path) -> None:
  keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
  diff = {k: (stored.get(k), current.get(k)) for k in keys if stored.get(k) != current.get(k)}
  if diff:
    detail = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
    raise IncompatibleCheckpointError(f"{where}: cannot resume into a different model ({detail})")
