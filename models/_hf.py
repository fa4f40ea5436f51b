"""Hugging Face checkpoints: `config.json` + `*.safetensors` (single or sharded with an index) <-> NNX model.

No torch: tensors are read with `safetensors` (numpy, bf16 through ml_dtypes). With a mesh, each parameter is
created straight onto its sharding (`jax.make_array_from_callback`), and each device's slice is read from the
checkpoint on its own: since every HF tensor becomes ours by a reshape and a transpose (`_Relayout`), a slice of
ours is a region of the HF tensor, read through `safe_open(...).get_slice`. A host reads what its devices hold
(of a mixture's stacked experts, only its experts' tensors), never a whole tensor it does not hold.

Both directions stream, so a host never holds the model: loading maps a file only while it reads one region from
it (a mapping kept open would keep every page read through it resident), and export writes each shard as soon as
it is full. Peak host memory is measured in bench/checkpoint_memory.py."""

from __future__ import annotations

import dataclasses
import json
import math
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
from models._transformer import Transformer, layer_runs

INDEX_FILE = "model.safetensors.index.json"
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
  """A checkpoint is missing, incomplete, corrupt or does not match its config."""


# ----------------------------------------------------------------------------------------------
# Parameter names: our path -> (HF tensor name, HF->ours, ours->HF).

@dataclasses.dataclass(frozen=True)
class _Relayout:
  """How an HF tensor becomes ours and back: `ours = hf.reshape(cut).transpose(perm)`, where the cut splits HF
  dimension i into `splits[i]` (sizes, outermost first; None: it stays whole). Being a reshape and a transpose
  only, a slice of ours comes from a region of the HF tensor (`read`), so a host reads what its devices hold."""
  splits: tuple[tuple[int, ...] | None, ...] | None = None  # None: every HF dimension stays whole
  perm: tuple[int, ...] | None = None  # None: the identity

  def _cut(self, hf_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    splits = self.splits or (None,) * len(hf_shape)
    return [(n,) if split is None else tuple(split) for n, split in zip(hf_shape, splits)]

  def to_ours(self, x: np.ndarray) -> np.ndarray:
    x = x.reshape([n for c in self._cut(x.shape) for n in c])
    return x if self.perm is None else x.transpose(self.perm)

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    x = x if self.perm is None else x.transpose(np.argsort(self.perm))
    widths = [1 if split is None else len(split) for split in (self.splits or (None,) * x.ndim)]
    bounds = np.cumsum([0] + widths)
    return x.reshape([math.prod(x.shape[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])

  def hf_shape(self, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    return jax.eval_shape(self.to_hf, jax.ShapeDtypeStruct(our_shape, jnp.float32)).shape

  def read(self, tensor: Any, hf_shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """Our slice `index` of the tensor, reading only the HF region that holds it from `tensor` (anything indexed
    by a tuple of slices: a safetensors slice, an array). An HF dimension cut in several of ours is read as one
    range when the slice keeps its inner parts whole (heads are split, a head's width is not), else whole."""
    cut = self._cut(hf_shape)
    perm = self.perm or tuple(range(sum(map(len, cut))))
    cut_index = [slice(None)] * len(perm)
    for ours, sl in zip(perm, index):
      cut_index[ours] = sl
    region, region_cut, rest, j = [], [], [], 0
    for c in cut:
      parts = [cut_index[j + q].indices(n) for q, n in enumerate(c)]
      j += len(c)
      (start, stop, step), inner = parts[0], math.prod(c[1:])
      if step == 1 and all(p == (0, n, 1) for p, n in zip(parts[1:], c[1:])):
        region.append(slice(start * inner, stop * inner))
        region_cut.append((stop - start,) + c[1:])
        rest += [slice(None)] * len(c)
      else:
        region.append(slice(None))
        region_cut.append(c)
        rest += [slice(*p) for p in parts]
    x = np.asarray(tensor[tuple(region)]).reshape([n for c in region_cut for n in c])[tuple(rest)]
    return x if self.perm is None else x.transpose(perm)


_SAME = _Relayout()
_TRANSPOSED = _Relayout(perm=(1, 0))
_EXPERTS = {"w_gate_edf": "gate_proj", "w_up_edf": "up_proj", "w_down_efd": "down_proj"}


def _hf_names(path: tuple[Any, ...], config: ModelConfig) -> tuple[np.ndarray, _Relayout]:
  """The HF tensors of one parameter and how each becomes ours: an array of names, one per index of the
  parameter's leading stacked axes (none for a top-level weight; [L] for a layer stack's weight, one tensor per
  layer; [L, E] for a stack's expert weight, HF storing one tensor per expert), each relaid as the relayout says."""
  if path[0] != "layer_stacks":
    name, relayout = _hf_mapping(path, config)
    return np.array(name, dtype=object), relayout
  layers, rest = layer_runs(config)[path[1]], path[2:]
  if len(rest) == 2 and rest[0] == "mlp" and rest[1] in _EXPERTS:
    names = [[f"model.layers.{i}.mlp.experts.{e}.{_EXPERTS[rest[1]]}.weight" for e in range(config.num_experts)]
             for i in layers]
    return np.array(names, dtype=object), _TRANSPOSED
  mapped = [_hf_mapping(("layers", i) + rest, config) for i in layers]
  return np.array([name for name, _ in mapped], dtype=object), mapped[0][1]


def _hf_mapping(path: tuple[Any, ...], config: ModelConfig) -> tuple[str, _Relayout]:
  n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
  if path == ("embed_vd",):
    return "model.embed_tokens.weight", _SAME
  if path == ("final_norm", "scale"):
    return "model.norm.weight", _SAME
  if path == ("w_unembed_dv",):
    return "lm_head.weight", _TRANSPOSED
  if path[0] != "layers":
    raise KeyError(path)
  prefix = f"model.layers.{path[1]}."
  rest = path[2:]
  heads = {"q": n, "k": k, "v": k}
  # Gemma's four norms: HF's post_attention_layernorm normalizes the attention's output there, and
  # pre_feedforward_layernorm is what Llama calls post_attention_layernorm.
  sandwich = config.sandwich_norms
  simple = {
      ("attn_norm", "scale"): ("input_layernorm.weight", _SAME),
      ("mlp_norm", "scale"): ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight",
                              _SAME),
      ("attn_out_norm", "scale"): ("post_attention_layernorm.weight", _SAME),
      ("mlp_out_norm", "scale"): ("post_feedforward_layernorm.weight", _SAME),
      ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", _SAME),
      ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", _SAME),
      ("attn", "b_o_d"): ("self_attn.o_proj.bias", _SAME),
      ("attn", "w_o_nhd"): ("self_attn.o_proj.weight", _Relayout(splits=(None, (n, h)), perm=(1, 2, 0))),
      ("mlp", "w_gate_df"): ("mlp.gate_proj.weight", _TRANSPOSED),
      ("mlp", "w_up_df"): ("mlp.up_proj.weight", _TRANSPOSED),
      ("mlp", "w_down_fd"): ("mlp.down_proj.weight", _TRANSPOSED),
      ("mlp", "b_gate_f"): ("mlp.gate_proj.bias", _SAME),
      ("mlp", "b_up_f"): ("mlp.up_proj.bias", _SAME),
      ("mlp", "b_down_d"): ("mlp.down_proj.bias", _SAME),
      ("mlp", "w_router_de"): ("mlp.gate.weight", _TRANSPOSED),
  }
  if rest in simple:
    name, relayout = simple[rest]
    return prefix + name, relayout
  if rest[0] == "attn" and len(rest) == 2:
    match = re.fullmatch(r"([wb])_([qkv])_\w+", rest[1])
    if match:
      kind, which = match.groups()
      if kind == "w":  # HF [m*h, d] -> ours [d, m, h]
        return prefix + f"self_attn.{which}_proj.weight", _Relayout(splits=((heads[which], h), None),
                                                                   perm=(2, 0, 1))
      return prefix + f"self_attn.{which}_proj.bias", _Relayout(splits=((heads[which], h),))
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
    self._shapes: dict[str, tuple[int, ...]] = {}
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

  def _file(self, name: str) -> Path:
    if name not in self.files:
      raise CheckpointError(f"tensor {name!r} is missing from the checkpoint "
                            f"(files: {sorted({f.name for f in self.files.values()})})")
    return self.files[name]

  def shape(self, name: str) -> tuple[int, ...]:
    """The tensor's shape, from its file's header (each file's header read once)."""
    file = self._file(name)
    if name not in self._shapes:
      try:
        with self._open(file) as handle:
          self._shapes.update({n: tuple(handle.get_slice(n).get_shape()) for n in handle.keys()})
      except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read tensor {name!r} (truncated or corrupt?): {e}") from None
    return self._shapes[name]

  def read(self, name: str, relayout: _Relayout, index: tuple[slice, ...]) -> np.ndarray:
    """Our slice `index` of the tensor, reading only its HF region (`_Relayout.read`): a copy, the mapping
    closes here."""
    file = self._file(name)
    try:
      with self._open(file) as handle:
        tensor = handle.get_slice(name)
        return relayout.read(tensor, tuple(tensor.get_shape()), index)
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"{file}: cannot read tensor {name!r} (truncated or corrupt?): {e}") from None


class _ParameterReader:
  """`read(index)`: one parameter's slice `index` (our layout, cast to `dtype`) from its HF tensors (`names`, one
  per index of its leading stacked axes: `_hf_names`); a stacked weight reads only the layers and experts the
  slice holds. Slices asked for again (replicas on other devices) are read once."""

  def __init__(self, tensors: _TensorIndex, names: np.ndarray, relayout: _Relayout, dtype: Any):
    self.tensors, self.names, self.relayout, self.dtype = tensors, names, relayout, dtype
    self._read: dict[tuple, np.ndarray] = {}

  def read(self, index: tuple[slice, ...]) -> np.ndarray:
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key not in self._read:
      lead = self.names.ndim
      # The slice's layers (and experts), each read through its own relayout.
      held = np.asarray(self.names[index[:lead]], dtype=object)
      parts = [self.tensors.read(name, self.relayout, index[lead:]) for name in held.flat]
      part = np.stack(parts).reshape(held.shape + parts[0].shape)
      self._read[key] = part.astype(self.dtype, copy=False)
    return self._read[key]


def from_pretrained(path: str | os.PathLike, *, dtype: Any = jnp.float32, mesh: Mesh | None = None,
                    rules: Rules = ()) -> Transformer:
  """Loads an HF checkpoint directory into a `Transformer`.

  Args:
    path: directory with `config.json` and `*.safetensors` (optionally sharded with an index file).
    dtype: parameter and compute dtype.
    mesh: when given, each parameter is created directly with its sharding from `rules`, every device's slice
      read from the checkpoint on its own: a host reads what its devices hold, not the whole tensor.
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
      names, relayout = _hf_names(key, config)
    except KeyError:
      raise CheckpointError(f"no HF name for parameter {'.'.join(map(str, key))}") from None
    expected = relayout.hf_shape(variable.shape[names.ndim:])
    for name in names.flat:
      used.add(name)
      if tensors.shape(name) != tuple(expected):
        raise CheckpointError(f"{tensors.files[name]}: tensor {name!r} has shape {tensors.shape(name)}; "
                              f"{path / 'config.json'} implies {tuple(expected)}")
    reader = _ParameterReader(tensors, names, relayout, dtype)
    if mesh is None:
      values[key] = jnp.asarray(reader.read(tuple(slice(None) for _ in variable.shape)))
    else:
      sharding = variable_sharding(variable, mesh, rules)
      values[key] = jax.make_array_from_callback(variable.shape, sharding, reader.read)
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
    names, relayout = _hf_names(key, model.config)

    def arrays(variable=variable, names=names, relayout=relayout) -> dict[str, np.ndarray]:
      array = _host_array(variable[...])
      return {names[i]: np.ascontiguousarray(relayout.to_hf(array[i])) for i in np.ndindex(names.shape)}

    yield key, variable, names, arrays


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
  for i, (_, variable, _, _) in enumerate(params):
    nbytes = variable.size * variable[...].dtype.itemsize  # relaid out, the same elements
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
