"""Hugging Face checkpoints: `config.json` + `*.safetensors` (single or sharded with an index) <-> NNX model.

No torch: tensors are read with `safetensors` (numpy, bf16 through ml_dtypes). With a mesh, each tensor is
placed straight onto its sharding (`jax.make_array_from_callback`: every device receives only its slice).

Both directions stream one tensor at a time, so a host never holds the model: loading maps a file only while
it reads one tensor from it (a mapping kept open would keep every page read through it resident), and export
writes each shard as soon as it is full. Peak host memory is a few times the largest tensor (a layer's stacked
experts for a mixture), measured in bench/checkpoint_memory.py.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models._config import ModelConfig
from models._families import config_from_hf, config_to_hf
from models._sharding import Rules, variable_sharding
from models._transformer import Transformer

INDEX_FILE = "model.safetensors.index.json"
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
  """A checkpoint is missing, incomplete, corrupt or does not match its config."""


# ----------------------------------------------------------------------------------------------
# Parameter names: our path -> (HF tensor name, HF->ours, ours->HF).

Transform = Callable[[np.ndarray], np.ndarray]
_ID: Transform = lambda x: x


_EXPERTS = {"w_gate_edf": "gate_proj", "w_up_edf": "up_proj", "w_down_efd": "down_proj"}


def _hf_names(path: tuple[Any, ...], config: ModelConfig) -> tuple[tuple[str, ...], Transform, Transform]:
  """The HF tensors of one parameter: one name, or E names for an expert weight (HF stores one tensor per
  expert; ours stacks them on a leading axis, which `to_ours` / `to_hf` take and give)."""
  if len(path) == 4 and path[0] == "layers" and path[2] == "mlp" and path[3] in _EXPERTS:
    proj = _EXPERTS[path[3]]
    names = tuple(f"model.layers.{path[1]}.mlp.experts.{e}.{proj}.weight" for e in range(config.num_experts))
    swap = lambda x: np.swapaxes(x, 1, 2)
    return names, swap, swap
  name, to_ours, to_hf = _hf_mapping(path, config)
  return (name,), to_ours, to_hf


def _hf_mapping(path: tuple[Any, ...], config: ModelConfig) -> tuple[str, Transform, Transform]:
  n, k, h, d = (config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                config.hidden_size)
  if path == ("embed_vd",):
    return "model.embed_tokens.weight", _ID, _ID
  if path == ("final_norm", "scale"):
    return "model.norm.weight", _ID, _ID
  if path == ("w_unembed_dv",):
    return "lm_head.weight", np.transpose, np.transpose
  if path[0] != "layers":
    raise KeyError(path)
  prefix = f"model.layers.{path[1]}."
  rest = path[2:]
  heads = {"q": n, "k": k, "v": k}
  # Gemma's four norms: HF's post_attention_layernorm normalizes the attention's output there, and
  # pre_feedforward_layernorm is what Llama calls post_attention_layernorm.
  sandwich = config.sandwich_norms
  simple = {
      ("attn_norm", "scale"): ("input_layernorm.weight", _ID, _ID),
      ("mlp_norm", "scale"): ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight",
                              _ID, _ID),
      ("attn_out_norm", "scale"): ("post_attention_layernorm.weight", _ID, _ID),
      ("mlp_out_norm", "scale"): ("post_feedforward_layernorm.weight", _ID, _ID),
      ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", _ID, _ID),
      ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", _ID, _ID),
      ("attn", "b_o_d"): ("self_attn.o_proj.bias", _ID, _ID),
      ("attn", "w_o_nhd"): ("self_attn.o_proj.weight",
                            lambda x: x.reshape(d, n, h).transpose(1, 2, 0),
                            lambda x: x.transpose(2, 0, 1).reshape(d, n * h)),
      ("mlp", "w_gate_df"): ("mlp.gate_proj.weight", np.transpose, np.transpose),
      ("mlp", "w_up_df"): ("mlp.up_proj.weight", np.transpose, np.transpose),
      ("mlp", "w_down_fd"): ("mlp.down_proj.weight", np.transpose, np.transpose),
      ("mlp", "b_gate_f"): ("mlp.gate_proj.bias", _ID, _ID),
      ("mlp", "b_up_f"): ("mlp.up_proj.bias", _ID, _ID),
      ("mlp", "b_down_d"): ("mlp.down_proj.bias", _ID, _ID),
      ("mlp", "w_router_de"): ("mlp.gate.weight", np.transpose, np.transpose),
  }
  if rest in simple:
    name, to_ours, to_hf = simple[rest]
    return prefix + name, to_ours, to_hf
  if rest[0] == "attn" and len(rest) == 2:
    match = re.fullmatch(r"([wb])_([qkv])_\w+", rest[1])
    if match:
      kind, which = match.groups()
      heads_ = heads[which]
      if kind == "w":
        return (prefix + f"self_attn.{which}_proj.weight",
                lambda x, m=heads_: x.reshape(m, h, d).transpose(2, 0, 1),
                lambda x, m=heads_: x.transpose(1, 2, 0).reshape(m * h, d))
      return (prefix + f"self_attn.{which}_proj.bias",
              lambda x, m=heads_: x.reshape(m, h), lambda x, m=heads_: x.reshape(m * h))
  raise KeyError(path)


# ----------------------------------------------------------------------------------------------
# Reading.


def read_config(path: str | os.PathLike) -> ModelConfig:
  """Reads `<path>/config.json` into a `ModelConfig`."""
  file = Path(path) / "config.json"
  if not file.is_file():
    raise CheckpointError(f"{file}: not found (an HF checkpoint directory needs config.json)")
  try:
    hf = json.loads(file.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{file}: invalid JSON: {e}") from None
  return config_from_hf(hf, source=str(file))


class _TensorIndex:
  """Which safetensors file holds each tensor; maps a file only while reading one tensor from it, and names the
  file in every error."""

  def __init__(self, path: Path):
    index = path / INDEX_FILE
    if index.is_file():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
      self.files = {name: path / file for name, file in weight_map.items()}
      for file in sorted(set(self.files.values())):
        if not file.is_file():
          raise CheckpointError(f"{file}: listed in {index} but missing")
    else:
      files = sorted(path.glob("*.safetensors"))
      if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (and no {INDEX_FILE})")
      self.files = {}
      for file in files:
        with self._open(file) as handle:
          for name in handle.keys():
            self.files[name] = file

  def _open(self, file: Path):
    try:
      return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"{file}: cannot read safetensors file (truncated or corrupt?): {e}") from None

  def get(self, name: str) -> np.ndarray:
    if name not in self.files:
      raise CheckpointError(f"tensor {name!r} is missing from the checkpoint "
                            f"(files: {sorted({f.name for f in self.files.values()})})")
    file = self.files[name]
    try:
      with self._open(file) as handle:
        return handle.get_tensor(name)  # a copy: the mapping closes here
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"{file}: cannot read tensor {name!r} (truncated or corrupt?): {e}") from None


def from_pretrained(path: str | os.PathLike, *, dtype: Any = jnp.float32, mesh: Mesh | None = None,
                    rules: Rules = ()) -> Transformer:
  """Loads an HF checkpoint directory into a `Transformer`.

  Args:
    path: directory with `config.json` and `*.safetensors` (optionally sharded with an index file).
    dtype: parameter and compute dtype.
    mesh: when given, each parameter is created directly with its sharding from `rules`.
    rules: logical-axis rules table.

  Returns:
    The model. Raises `CheckpointError` naming the file and tensor on any mismatch.
  """
  path = Path(path)
  config = read_config(path)
  tensors = _TensorIndex(path)
  abstract = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)

  used: set[str] = set()
  values = {}
  for key, variable in nnx.to_flat_state(state):
    try:
      names, to_ours, to_hf = _hf_names(key, config)
    except KeyError:
      raise CheckpointError(f"no HF name for parameter {'.'.join(map(str, key))}") from None
    expected = jax.eval_shape(lambda x, f=to_hf: f(x), jax.ShapeDtypeStruct(variable.shape, jnp.float32)).shape
    expected = expected if len(names) == 1 else expected[1:]
    parts = []
    for name in names:
      raw = tensors.get(name)
      used.add(name)
      if tuple(raw.shape) != tuple(expected):
        raise CheckpointError(
            f"{tensors.files[name]}: tensor {name!r} has shape {tuple(raw.shape)}; "
            f"{path / 'config.json'} implies {tuple(expected)}")
      parts.append(raw)
    array = np.asarray(to_ours(parts[0] if len(names) == 1 else np.stack(parts)))
    del parts
    array = array.astype(dtype, copy=False)
    if mesh is None:
      values[key] = jnp.asarray(array)
    else:
      sharding = variable_sharding(variable, mesh, rules)
      values[key] = jax.make_array_from_callback(array.shape, sharding, lambda idx, a=array: a[idx])
  unexpected = sorted(n for n in tensors.files if n not in used and not _IGNORED.match(n)
                      and not (config.tie_word_embeddings and n == "lm_head.weight"))
  if unexpected:
    raise CheckpointError(f"{path}: tensors not described by config.json: {unexpected[:8]}"
                          f"{' …' if len(unexpected) > 8 else ''}")
  state = nnx.from_flat_state([(key, variable.replace(values[key]))
                               for key, variable in nnx.to_flat_state(state)])
  return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------------------------------
# Writing.


def _host_array(x: jax.Array) -> np.ndarray:
  if not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def _hf_parameters(model: Transformer):
  """Per parameter: its HF names, and a function giving their host arrays (read only when called)."""
  _, state = nnx.split(model)
  for key, variable in nnx.to_flat_state(state):
    names, _, to_hf = _hf_names(key, model.config)

    def arrays(variable=variable, names=names, to_hf=to_hf) -> dict[str, np.ndarray]:
      array = to_hf(_host_array(variable[...]))
      return {name: np.ascontiguousarray(array if len(names) == 1 else array[i]) for i, name in enumerate(names)}

    yield key, variable, names, to_hf, arrays


def hf_tensors(model: Transformer) -> dict[str, np.ndarray]:
  """All parameters of `model` as HF-named host arrays (the whole model on the host: `save_pretrained` streams)."""
  return {name: array for *_, arrays in _hf_parameters(model) for name, array in arrays().items()}


def save_pretrained(model: Transformer, path: str | os.PathLike, *,
                    max_shard_bytes: int = 4 * 2**30) -> Path:
  """Writes `config.json` and safetensors (sharded with an index above `max_shard_bytes`).

  The directory loads with `transformers.AutoModelForCausalLM.from_pretrained`. Files are written to a
  temporary name first and renamed, so a crash never leaves a half-written file under the final name.
  Only process 0 writes in a multi-process run (every process gathers each tensor with it, in the same order).
  Shards are planned from the parameters' shapes and written one at a time: the host holds one shard at most.
  """
  path = Path(path)
  params = list(_hf_parameters(model))
  # Plan the shards from shapes alone (the file names say how many there are).
  sizes: list[int] = []
  plan: list[list[int]] = [[]]  # parameter indices per shard
  for i, (key, variable, names, to_hf, _) in enumerate(params):
    shape = jax.eval_shape(lambda x, f=to_hf: f(x), jax.ShapeDtypeStruct(variable.shape, variable[...].dtype))
    nbytes = shape.size * shape.dtype.itemsize
    if plan[-1] and sum(sizes[j] for j in plan[-1]) + nbytes > max_shard_bytes:
      plan.append([])
    plan[-1].append(i)
    sizes.append(nbytes)
  files = (["model.safetensors"] if len(plan) == 1 else
           [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
  writer = jax.process_index() == 0
  if writer:
    path.mkdir(parents=True, exist_ok=True)
  weight_map, dtype = {}, None
  for file, members in zip(files, plan):
    shard: dict[str, np.ndarray] = {}
    for i in members:
      shard.update(params[i][-1]())  # collective in a multi-process run: every process gathers
    if writer:
      _atomic_write(path / file, lambda tmp, s=shard: save_file(s, tmp, metadata={"format": "pt"}))
    weight_map.update({name: file for name in shard})
    dtype = dtype or str(next(iter(shard.values())).dtype)
    del shard
  if not writer:
    return path
  if len(plan) > 1:
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    _atomic_write(path / INDEX_FILE, lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2)))
  hf_config = config_to_hf(model.config, dtype=dtype)
  _atomic_write(path / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(hf_config, indent=2)))
  return path


def _atomic_write(target: Path, write: Callable[[str], Any]) -> None:
  fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
  os.close(fd)
  try:
    write(tmp)
    os.replace(tmp, target)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
