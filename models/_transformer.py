"""Decoder-only transformer in Flax NNX (Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE).

Shape letters: B batch, T new tokens, S cache slots, D embed, N query heads, K kv heads, G = N // K,
H head dim, F mlp, V vocab, L layers, E experts, k experts per token, A token-expert assignments (B*T*k). Every parameter names logical axes only (`out_sharding`);
`models.sharding` maps them to a mesh with one rules table.

Attention masking has one rule for every case (full forward, padded batches, packing, KV cache):
a query in segment s at slot i sees key slot j iff `segment[j] == s`, `segment[j] != 0` and `j <= i`.
Segment 0 marks padding (left, right or in the middle of a cache after a ragged extend).

A tree of segments (shared-prefix packing, no cache) generalises it: segments are numbered in depth-first
preorder and each key also carries the end of its segment's subtree (`segment_ends`, exclusive), so a query in
segment s sees key j iff `segment[j] <= s < segment_end[j]` (its own segment or an ancestor's), `segment[j] != 0`
and `position[j] <= position[i]`; a sliding window also counts positions. With `segment_end = segment + 1` (no
segment has a descendant) and positions that advance with slots within a segment, this is the rule above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from typing import Any, Iterator

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from models._config import LAYER_TYPES, ModelConfig
from models._rope import apply_rope, rope_tables
from models._sharding import Rules, logical_to_spec

# Per-layer rematerialization (`Transformer.features(remat=...)`): what a layer keeps for the backward pass.
# Attention kernels for T > 1 (`features(attention=...)`): einsum + softmax over the whole [T, S] logits,
# jax.nn.dot_product_attention, or "chunked": the einsum path over blocks of ATTENTION_CHUNK queries in a scan whose
# body is rematerialized, so neither pass holds more than one block's [C, S] logits (long-context training).
ATTENTION_IMPLEMENTATIONS = ("einsum", "dot_product", "chunked")
ATTENTION_CHUNK = 512
ROUTE_DTYPE = jnp.int16  # recorded expert ids (router replay): experts per layer stay far below 2^15
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}

_INIT = nnx.initializers.normal(stddev=0.02)

# The logical axis of a layer stack's leading dimension (parameters and caches); the rules never split it.
LAYERS_AXIS = "layers"


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype: Any,
           init=_INIT) -> nnx.Param:
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


def _ones(shape: tuple[int, ...], axes: tuple[str, ...], dtype: Any) -> nnx.Param:
  return nnx.Param(jnp.ones(shape, dtype), out_sharding=axes, eager_sharding=False)


def _zeros(shape: tuple[int, ...], axes: tuple[str, ...], dtype: Any) -> nnx.Param:
  return nnx.Param(jnp.zeros(shape, dtype), out_sharding=axes, eager_sharding=False)


@flax.struct.dataclass
class KVCache:
  """Key/value cache; every row has its own write position (rows fill, stop and restart independently).

  Attributes:
    k: per layer stack (`layer_runs`: consecutive layers of one structure, stored and run as one), keys (RoPE
      already applied) [B, L, K, H, S], slots last; L the stack's layers. With `heads_minor`: [B, L, S, K, H].
    v: per layer stack, values [B, L, K, S, H]; with `heads_minor`: [B, L, S, K, H].
    segment_ids: int32[B, S]; 0 = empty or padding slot.
    index: int32[B], each row's next slot to write. T new tokens of row b go to slots index[b] .. index[b]+T-1;
      slots past S are dropped (callers decide per row whether a chunk fits: the sampler does). The index is
      not advanced here beyond `index + T`: callers that append fewer real tokens than T set it themselves.
    routes: mixture of experts with route recording (`init(routes=True)`): int16[B, S, M, k], the experts each
      cached token used in the M sparse layers (-1: nothing written there); written with the keys and values,
      so every copy of a row's slots carries its routes (router replay). None otherwise.
    heads_minor: the layout (static): slots before heads, on accelerators (`init`'s default off the CPU).

  A stack of sliding-window layers whose window W is shorter than S keeps rings of W slots instead (its k is
  [B, L, K, H, W]): the token of slot p is in ring slot p % W, and a chunk attends to the ring as it was before
  the chunk plus the chunk's own keys (`Attention`), then writes its last W real tokens. Slots, segment ids and the
  index stay those of the whole row.

  Rows lead, so copying a row (forks, refills) moves its every layer at once. The layers' scan writes each
  layer's new slots into the stack in place and reads the layer's slice.

  Two layouts, one per kind of compiler. On the CPU, keys [.., K, H, S] and values [.., K, S, H] let a decode step
  read each cache in place, reducing over an axis that is not the last one (keys over H, values over S), which
  XLA's CPU backend fuses into one pass over the cache. Measured with `jax.profiler` on the tiny config's decode
  (B=64, S=128, CPU): keys as [B, K, S, H] (reduce over the last axis) took 2.5x as long; a [B, S, K, H] cache was
  transposed (copied whole) on every step; dot_generals were slower still. Inside the layers' loop the TPU
  compiler lays a carried cache out with its heads minor ([.., S, K, H]) whatever its stored layout, and copied a
  cache stored otherwise into that layout and back on every call (one more cache per program; the 8B recipe's
  feed peaked 35 GiB higher): stored `heads_minor`, it is used as stored.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  segment_ids: jax.Array
  index: jax.Array
  routes: jax.Array | None = None
  heads_minor: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def k_axes(self) -> tuple[str, ...]:
    """The logical axes of each k array."""
    if self.heads_minor:
      return ("batch", LAYERS_AXIS, "length", "kv_heads", "head_dim")
    return ("batch", LAYERS_AXIS, "kv_heads", "head_dim", "length")

  @property
  def v_axes(self) -> tuple[str, ...]:
    """The logical axes of each v array."""
    if self.heads_minor:
      return self.k_axes
    return ("batch", LAYERS_AXIS, "kv_heads", "length", "head_dim")

  def stack_slots(self) -> list[int]:
    """Each stack's slots: the cache's size, or a ring's window."""
    return [k.shape[2] if self.heads_minor else k.shape[-1] for k in self.k]

  @classmethod
  def init(cls, config: ModelConfig, batch: int, size: int, dtype: Any = jnp.float32, *, routes: bool = False,
           heads_minor: bool | None = None) -> "KVCache":
    """An empty cache; `routes=True` also records each cached token's experts (a model with sparse layers).
    `heads_minor` (default: off on the CPU, on for an accelerator, `target_platform`) picks the layout."""
    k, h, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    sparse = sum(config.is_moe_layer(i) for i in range(layers))
    stacks = [(len(run), ring_size(config, run[0], size) or size) for run in layer_runs(config)]
    heads_minor = target_platform() != "cpu" if heads_minor is None else heads_minor
    k_shape = (lambda n, slots: (batch, n, slots, k, h)) if heads_minor else (lambda n, slots: (batch, n, k, h, slots))
    v_shape = (lambda n, slots: (batch, n, slots, k, h)) if heads_minor else (lambda n, slots: (batch, n, k, slots, h))
    return cls(k=tuple(jnp.zeros(k_shape(n, slots), dtype) for n, slots in stacks),
               v=tuple(jnp.zeros(v_shape(n, slots), dtype) for n, slots in stacks), heads_minor=heads_minor,
               segment_ids=jnp.zeros((batch, size), jnp.int32),
               index=jnp.zeros((batch,), jnp.int32),
               routes=(jnp.full((batch, size, sparse, config.num_experts_per_tok), -1, ROUTE_DTYPE)
                       if routes and sparse else None))

  @property
  def size(self) -> int:
    return self.segment_ids.shape[1]


def layer_runs(config: ModelConfig) -> tuple[tuple[int, ...], ...]:
  """The layers grouped into runs of consecutive layers of one structure (dense or sparse MLP, global or sliding
  attention): each run is stored as one stack of parameters ([L, ...] on `LAYERS_AXIS`) and runs as one scan.
  A uniform model is one run; Gemma 3's five sliding layers to one global layer make runs of 5 and 1."""
  kind = lambda i: (config.is_moe_layer(i), config.is_sliding_layer(i))
  runs: list[list[int]] = []
  for i in range(config.num_hidden_layers):
    if runs and kind(runs[-1][-1]) == kind(i):
      runs[-1].append(i)
    else:
      runs.append([i])
  return tuple(tuple(run) for run in runs)


def ring_size(config: ModelConfig, layer: int, size: int) -> int | None:
  """The ring a sliding-window layer's cache of `size` slots keeps (its window), or None: a full cache."""
  window = config.sliding_window if config.is_sliding_layer(layer) else None
  return window if window is not None and window < size else None


class RMSNorm(nnx.Module):
  """`offset` 0: the normed input cast back, times the weight (Llama); otherwise times (offset + weight) in
  float32, then cast (Gemma, whose weights are stored zero-centred: they start at 0)."""

  def __init__(self, dim: int, eps: float, *, dtype: Any, axes: tuple[str, ...] = ("norm",), offset: float = 0.0):
    self.scale = (_zeros if offset else _ones)((dim,), axes, dtype)
    self.eps = eps
    self.offset = offset

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.offset:
      return (x32 * (self.offset + self.scale[...].astype(jnp.float32))).astype(x.dtype)
    return self.scale[...] * x32.astype(x.dtype)


def _masked_softmax(logits_bkgts, visible_bts, dtype):
  logits_bkgts = jnp.where(visible_bts[:, None, None], logits_bkgts, jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(logits_bkgts, axis=-1).astype(dtype)


_COMPILING_FOR: list[str] = []  # platforms named by `compiling_for`, innermost last


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
  """Programs traced inside take the kernels of `platform` ("tpu", "gpu", "cpu"), not of the process's default
  backend: `jaxagent plan` traces on a CPU host for a TPU topology."""
  _COMPILING_FOR.append(platform)
  try:
    yield
  finally:
    _COMPILING_FOR.pop()


def target_platform() -> str:
  """The platform the programs being traced are for (`compiling_for`, else JAX's default backend)."""
  return _COMPILING_FOR[-1] if _COMPILING_FOR else jax.default_backend()


def _scores_operand(dtype):
  """XLA:CPU has no batched bf16 x bf16 -> f32 dot ("Unsupported element type for DotThunk::Execute", seen at B=8
  prefill of SmolLM2): there the operands are widened first, the same products and f32 accumulation."""
  return jnp.float32 if target_platform() == "cpu" else dtype


_ACTIVATION = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def _visible(key_seg_bs, segment_ids_bt, query_slot_bt, window, key_slot_bs=None, key_end_bs=None):
  """bool[B, T, S]: a query sees the keys of its own segment at or before its slot, and with a sliding `window`
  only those less than `window` slots back. The window counts slots, as transformers counts cache positions: the
  sampler and assembly write a segment's tokens in consecutive slots, where slots and positions advance together
  (a padding hole inside a row would count toward the window). `key_slot_bs`: each key's slot (default: its
  index; a ring's keys say which slot they hold). `key_end_bs`: a tree of segments (the module docstring): a
  query also sees the keys of its ancestors' segments; slots are then positions."""
  s = key_seg_bs.shape[-1]
  slots_s = jnp.arange(s)[None, None, :] if key_slot_bs is None else key_slot_bs[:, None, :]
  key_seg, query_seg = key_seg_bs[:, None, :], segment_ids_bt[:, :, None]
  own = key_seg == query_seg if key_end_bs is None else (key_seg <= query_seg) & (query_seg < key_end_bs[:, None, :])
  visible = own & (key_seg != 0) & (slots_s <= query_slot_bt[:, :, None])
  if window is not None:
    visible &= query_slot_bt[:, :, None] - slots_s < window
  return visible


def _chunked_attention(q_btkgh, keys_bkhs, values_bksh, segment_ids_bt, query_slot_bt, key_seg_bs, dtype,
                       scale, window=None, key_slot_bs=None, key_end_bs=None):
  """The einsum path over blocks of `ATTENTION_CHUNK` queries (the last block padded with invisible queries):
  one block's logits [B, K, G, C, S] at a time, recomputed in the backward pass (`jax.checkpoint` on the scan
  body), so memory grows with T x C instead of T x S. The same masking rule, products and accumulation."""
  b, t, k, g, h = q_btkgh.shape
  chunk = min(ATTENTION_CHUNK, t)
  pad = -t % chunk
  if pad:
    q_btkgh = jnp.pad(q_btkgh, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    segment_ids_bt = jnp.pad(segment_ids_bt, ((0, 0), (0, pad)))
    query_slot_bt = jnp.pad(query_slot_bt, ((0, 0), (0, pad)))
  blocks = (t + pad) // chunk
  operand = _scores_operand(q_btkgh.dtype)
  keys, values = keys_bkhs.astype(operand), values_bksh.astype(dtype)

  @jax.checkpoint
  def block(_, xs):
    q_bckgh, seg_bc, slot_bc = xs
    visible_bcs = _visible(key_seg_bs, seg_bc, slot_bc, window, key_slot_bs, key_end_bs)
    logits_bkgcs = jnp.einsum("bckgh,bkhs->bkgcs", q_bckgh.astype(operand), keys,
                              preferred_element_type=jnp.float32) * scale
    probs_bkgcs = _masked_softmax(logits_bkgcs, visible_bcs, dtype)
    return None, jnp.einsum("bkgcs,bksh->bckgh", probs_bkgcs, values)

  split = lambda x: x.reshape((b, blocks, chunk) + x.shape[2:]).swapaxes(0, 1)
  _, out = jax.lax.scan(block, None, (split(q_btkgh), split(segment_ids_bt), split(query_slot_bt)))
  return out.swapaxes(0, 1).reshape((b, t + pad, k, g, h))[:, :t]


def _cache_write(k_stack, v_stack, rows_b1, layer, slot_bt, k_btkh, v_btkh, heads_minor):
  """Row b's T keys and values into slots slot_bt[b] of layer `layer` of a cache stack, in place (a slot past the
  stack's end: dropped). Indexing [rows, layer, slots] (or [rows, layer, :, :, slots]) puts the broadcast [B, T]
  index dims first: the update is [B, T, K, H] in both layouts."""
  k, v = k_btkh.astype(k_stack.dtype), v_btkh.astype(v_stack.dtype)
  if heads_minor:
    return (k_stack.at[rows_b1, layer, slot_bt].set(k, mode="drop"),
            v_stack.at[rows_b1, layer, slot_bt].set(v, mode="drop"))
  return (k_stack.at[rows_b1, layer, :, :, slot_bt].set(k, mode="drop"),
          v_stack.at[rows_b1, layer, :, slot_bt, :].set(v, mode="drop"))


def _cache_read(k_stack, v_stack, layer, rows, heads_minor):
  """Layer `layer`'s keys [B, K, H, S] and values [B, K, S, H] (all rows, or rows `rows`), from either layout."""
  keys, values = _layer_rows(k_stack, layer, rows), _layer_rows(v_stack, layer, rows)
  if heads_minor:  # [B, S, K, H]
    return keys.transpose(0, 2, 3, 1), values.transpose(0, 2, 1, 3)
  return keys, values


def _layer_rows(stack, layer, rows=None):
  """Layer `layer` of a cache stack [B, L, ...] (all rows, or rows `rows`): [B, ...]. The layer is sliced first, then
  its rows gathered: a gather of (rows, layer) from the stack made the TPU compiler copy the whole stack, which the
  layers' scan carries and writes in place."""
  layer_cache = jax.lax.dynamic_index_in_dim(stack, layer, axis=1, keepdims=False)
  return layer_cache if rows is None else layer_cache[rows]


class Attention(nnx.Module):

  def __init__(self, config: ModelConfig, *, dtype: Any, rngs: nnx.Rngs, layer: int = 0):
    d, n, k, h = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                  config.head_dim)
    self.num_groups = n // k
    self.w_q_dnh = _param(rngs, (d, n, h), ("embed", "q_heads", "head_dim"), dtype)
    self.w_k_dkh = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
    self.w_v_dkh = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
    self.w_o_nhd = _param(rngs, (n, h, d), ("q_heads", "head_dim", "embed"), dtype)
    if config.attention_bias:
      self.b_q_nh = _zeros((n, h), ("q_heads", "head_dim"), dtype)
      self.b_k_kh = _zeros((k, h), ("kv_heads", "head_dim"), dtype)
      self.b_v_kh = _zeros((k, h), ("kv_heads", "head_dim"), dtype)
    if config.attention_out_bias:
      self.b_o_d = _zeros((d,), ("norm",), dtype)
    if config.qk_norm:
      self.q_norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, offset=config.norm_offset)
      self.k_norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, offset=config.norm_offset)
    self.config = config
    sliding = config.is_sliding_layer(layer)
    self.layer_type = LAYER_TYPES[sliding]  # which RoPE table it takes (`rope_tables`)
    self.window = config.sliding_window if sliding else None
    self.scale = float(config.query_pre_attn_scalar or h) ** -0.5

  def __call__(self, x_btd, positions_bt, segment_ids_bt, inv_freq, kv: tuple | None, attention: str = "einsum",
               segment_ends_bt=None):
    """Returns (output [B, T, D], the cache stack's updated (keys, values) or None).

    `segment_ends_bt` (no cache): the segments form a tree (the module docstring's rule).

    `kv`: None (no cache), or (keys, values: this layer's stack of the `KVCache`, `layer`: this layer's index in
    the stack, the cache's segment ids after this call's writes, each row's first new slot [B], cache_rows or None,
    the cache's `heads_minor`).

    `inv_freq`: the model's RoPE tables by layer type (`rope_tables`). `attention` (see
    `ATTENTION_IMPLEMENTATIONS`) picks the kernel for T > 1 (prefill, training); one-token decode always takes
    the multiply-reduce path below.
    """
    cfg = self.config
    inv_freq = inv_freq[self.layer_type]
    q_btnh = jnp.einsum("btd,dnh->btnh", x_btd, self.w_q_dnh[...])
    k_btkh = jnp.einsum("btd,dkh->btkh", x_btd, self.w_k_dkh[...])
    v_btkh = jnp.einsum("btd,dkh->btkh", x_btd, self.w_v_dkh[...])
    if cfg.attention_bias:
      q_btnh += self.b_q_nh[...]
      k_btkh += self.b_k_kh[...]
      v_btkh += self.b_v_kh[...]
    if cfg.qk_norm:
      q_btnh, k_btkh = self.q_norm(q_btnh), self.k_norm(k_btkh)
    q_btnh = apply_rope(q_btnh, positions_bt, inv_freq)
    k_btkh = apply_rope(k_btkh, positions_bt, inv_freq)

    t = x_btd.shape[1]
    if kv is None:
      keys_bkhs, values_bksh = k_btkh.transpose(0, 2, 3, 1), v_btkh.transpose(0, 2, 1, 3)
      key_seg_bs, query_slot_bt = segment_ids_bt, jnp.broadcast_to(jnp.arange(t), segment_ids_bt.shape)
      new_kv = None
      if segment_ends_bt is not None:  # a tree: causality and the window count positions
        visible_bts = _visible(key_seg_bs, segment_ids_bt, positions_bt, self.window, positions_bt, segment_ends_bt)
        return self._attend(q_btnh, keys_bkhs, values_bksh, visible_bts, segment_ids_bt, positions_bt, key_seg_bs,
                            attention, x_btd.dtype, positions_bt, segment_ends_bt), None
    else:
      # Row b's T tokens go to its own slots start[b] .. start[b]+T-1 of this layer (`layer`) of the stack (a
      # scatter, in place; slots past S are dropped: `_cache_write`). With `cache_rows`, the B inputs are rows
      # cache_rows[b] of a larger cache (index past its end: none): only their new slots are written, and their
      # attention reads those rows.
      k_stack, v_stack, layer, key_seg_bs, start_b, cache_rows, heads_minor = kv
      query_slot_bt = start_b[:, None] + jnp.arange(t)[None, :]
      rows_b1 = (jnp.arange(x_btd.shape[0]) if cache_rows is None else cache_rows)[:, None]
      take = None if cache_rows is None else jnp.minimum(cache_rows, k_stack.shape[0] - 1)
      if (k_stack.shape[2] if heads_minor else k_stack.shape[-1]) < key_seg_bs.shape[-1]:  # a ring: see `KVCache`
        return self._ring(q_btnh, k_btkh, v_btkh, segment_ids_bt, query_slot_bt, kv, rows_b1, take, attention,
                          x_btd.dtype)
      new_kv = k_stack, v_stack = _cache_write(k_stack, v_stack, rows_b1, layer, query_slot_bt, k_btkh, v_btkh,
                                               heads_minor)
      keys_bkhs, values_bksh = _cache_read(k_stack, v_stack, layer, take, heads_minor)
      if cache_rows is not None:
        key_seg_bs = key_seg_bs[take]
    visible_bts = _visible(key_seg_bs, segment_ids_bt, query_slot_bt, self.window)
    return self._attend(q_btnh, keys_bkhs, values_bksh, visible_bts, segment_ids_bt, query_slot_bt, key_seg_bs,
                        attention, x_btd.dtype), new_kv

  def _ring(self, q_btnh, k_btkh, v_btkh, segment_ids_bt, query_slot_bt, kv, rows_b1, take, attention, dtype):
    """A sliding layer's ring cache: the chunk attends to the ring as it stands (ring slot r holds the row's
    latest slot p < start with p % W == r; its segment id says whether it is this row's stream and visible) and
    to its own keys, under the window; then its last W real tokens are written (padding never is: a ring slot
    has no room for it)."""
    k_stack, v_stack, layer, key_seg_bs, start_b, _, heads_minor = kv
    w = k_stack.shape[2] if heads_minor else k_stack.shape[-1]
    ring_k, ring_v = _cache_read(k_stack, v_stack, layer, take, heads_minor)
    seg_bs = key_seg_bs if take is None else key_seg_bs[take]
    last_b1 = start_b[:, None] - 1
    held_bw = last_b1 - jnp.mod(last_b1 - jnp.arange(w)[None, :], w)  # the slot each ring slot holds (< 0: none)
    held_seg_bw = jnp.where(held_bw >= 0, jnp.take_along_axis(seg_bs, jnp.maximum(held_bw, 0), axis=1), 0)
    keys_bkhs = jnp.concatenate([ring_k, k_btkh.transpose(0, 2, 3, 1).astype(ring_k.dtype)], axis=-1)
    values_bksh = jnp.concatenate([ring_v, v_btkh.transpose(0, 2, 1, 3).astype(ring_v.dtype)], axis=-2)
    key_slot_bs = jnp.concatenate([held_bw, query_slot_bt], axis=1)
    key_seg = jnp.concatenate([held_seg_bw, segment_ids_bt], axis=1)
    visible_bts = _visible(key_seg, segment_ids_bt, query_slot_bt, self.window, key_slot_bs)
    out = self._attend(q_btnh, keys_bkhs, values_bksh, visible_bts, segment_ids_bt, query_slot_bt, key_seg,
                       attention, dtype, key_slot_bs)
    real_bt = segment_ids_bt != 0
    last_real_b1 = jnp.max(jnp.where(real_bt, query_slot_bt, -1), axis=1, keepdims=True)
    write = real_bt & (query_slot_bt > last_real_b1 - w)  # distinct ring slots: the last W real tokens
    ring_slot_bt = jnp.where(write, jnp.mod(query_slot_bt, w), w)  # w: dropped
    return out, _cache_write(k_stack, v_stack, rows_b1, layer, ring_slot_bt, k_btkh, v_btkh, heads_minor)

  def _attend(self, q_btnh, keys_bkhs, values_bksh, visible_bts, segment_ids_bt, query_slot_bt, key_seg_bs,
              attention, dtype, key_slot_bs=None, key_end_bs=None):
    """Attention of the queries over the given keys and values ([B, K, H, S] / [B, K, S, H]) under the mask."""
    t = q_btnh.shape[1]

    b, _, n, h = q_btnh.shape
    q_btkgh = q_btnh.reshape(b, t, n // self.num_groups, self.num_groups, h)
    f32 = jnp.float32
    if t > 1 and attention == "dot_product":
      # jax.nn.dot_product_attention with its default implementation, which JAX 0.10 resolves to XLA on every
      # backend (its source: "defaults to XLA for now"). The same grouping of query heads over KV heads as the
      # einsum path: head i reads KV head i // num_groups.
      out_btnh = jax.nn.dot_product_attention(
          q_btnh, keys_bkhs.transpose(0, 3, 1, 2).astype(q_btnh.dtype),
          values_bksh.transpose(0, 2, 1, 3).astype(q_btnh.dtype), mask=visible_bts[:, None], scale=self.scale)
      out_btkgh = out_btnh.reshape(b, t, n // self.num_groups, self.num_groups, h).astype(dtype)
    elif t > 1 and attention == "chunked":
      out_btkgh = _chunked_attention(q_btkgh, keys_bkhs, values_bksh, segment_ids_bt, query_slot_bt, key_seg_bs,
                                     dtype, self.scale, self.window, key_slot_bs, key_end_bs)
    elif t == 1 and target_platform() != "cpu":
      # One query per row (decode) on an accelerator: dots on the cache as it is stored (bf16 stays bf16; the
      # products of bf16 values are exact in the float32 accumulator, so only the order of the sums differs from
      # the CPU path). Widening the cache first made XLA for TPU move ~9x the cache and weights per step.
      logits_bkgts = jnp.einsum("bkgh,bkhs->bkgs", q_btkgh[:, 0], keys_bkhs.astype(q_btkgh.dtype),
                                preferred_element_type=f32)[:, :, :, None, :] * self.scale
      probs_bkgts = _masked_softmax(logits_bkgts, visible_bts, dtype)
      out_btkgh = jnp.einsum("bkgs,bksh->bkgh", probs_bkgts[:, :, :, 0], values_bksh.astype(dtype),
                             preferred_element_type=f32)[:, None].astype(dtype)
    elif t == 1:
      # One query per row (decode) on XLA:CPU: multiply-reduces, one fused pass over each cache (see `KVCache`). As
      # dot_generals they are B*K tiny matmuls, measured 2-7x slower on CPU at B=64, S=128.
      logits_bkgts = jnp.sum(q_btkgh[:, 0, :, :, :, None].astype(f32) * keys_bkhs[:, :, None].astype(f32),
                             axis=3)[:, :, :, None, :] * self.scale
      probs_bkgts = _masked_softmax(logits_bkgts, visible_bts, dtype)
      out_btkgh = jnp.sum(probs_bkgts[:, :, :, 0, :, None].astype(f32) * values_bksh[:, :, None].astype(f32),
                          axis=-2)[:, None].astype(dtype)
    else:
      operand = _scores_operand(q_btkgh.dtype)
      logits_bkgts = jnp.einsum("btkgh,bkhs->bkgts", q_btkgh.astype(operand), keys_bkhs.astype(operand),
                                preferred_element_type=f32) * self.scale
      probs_bkgts = _masked_softmax(logits_bkgts, visible_bts, dtype)
      out_btkgh = jnp.einsum("bkgts,bksh->btkgh", probs_bkgts, values_bksh.astype(dtype))
    # Heads flattened first: contracting (n, h) as two axes, XLA transposed w_o (a copy per decode step).
    out_btd = jnp.einsum("btf,fd->btd", out_btkgh.reshape(b, t, n * h),
                         self.w_o_nhd[...].reshape(n * h, self.w_o_nhd.shape[-1]))
    if self.config.attention_out_bias:
      out_btd += self.b_o_d[...]
    return out_btd


class MLP(nnx.Module):

  def __init__(self, config: ModelConfig, *, dtype: Any, rngs: nnx.Rngs):
    d, f = config.hidden_size, config.intermediate_size
    self.w_gate_df = _param(rngs, (d, f), ("embed", "mlp"), dtype)
    self.w_up_df = _param(rngs, (d, f), ("embed", "mlp"), dtype)
    self.w_down_fd = _param(rngs, (f, d), ("mlp", "embed"), dtype)
    self.bias = config.mlp_bias
    self.activation = config.hidden_activation
    if self.bias:
      self.b_gate_f = _zeros((f,), ("mlp",), dtype)
      self.b_up_f = _zeros((f,), ("mlp",), dtype)
      self.b_down_d = _zeros((d,), ("norm",), dtype)

  def __call__(self, x_btd):
    gate_btf = x_btd @ self.w_gate_df[...]
    up_btf = x_btd @ self.w_up_df[...]
    if self.bias:
      gate_btf += self.b_gate_f[...]
      up_btf += self.b_up_f[...]
    out_btd = (_ACTIVATION[self.activation](gate_btf) * up_btf) @ self.w_down_fd[...]
    if self.bias:
      out_btd += self.b_down_d[...]
    return out_btd


class MoE(nnx.Module):
  """Top-k routed expert MLPs, dropless: every token reaches its k experts (no capacity, nothing dropped).

  The router's logits and softmax are float32; the k largest probabilities are the routing weights
  (renormalized to sum to 1 with `norm_topk_prob`). Dispatch is a grouped matmul: the B*T*k (token, expert)
  assignments are sorted by expert and each expert's contiguous group is multiplied by its weights
  (`jax.lax.ragged_dot`), then scattered back, weighted, onto their tokens. Compute and memory follow the k
  experts a token uses, never all E of them; an einsum over every expert would cost E/k times the FLOPs.
  Under `dispatch_experts_over` the experts may be split over devices (expert parallelism, see there).
  """

  # Logical axes of the expert weights (the rules tables map `experts` to the expert-parallel mesh axis). The
  # router's expert axis is small and stays whole on every device: each device routes its own tokens.
  GATE_UP_AXES = ("experts", "embed", "expert_mlp")
  DOWN_AXES = ("experts", "expert_mlp", "embed")

  def __init__(self, config: ModelConfig, *, dtype: Any, rngs: nnx.Rngs):
    e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
    self.w_router_de = _param(rngs, (d, e), ("embed", None), dtype)
    self.w_gate_edf = _param(rngs, (e, d, f), self.GATE_UP_AXES, dtype)
    self.w_up_edf = _param(rngs, (e, d, f), self.GATE_UP_AXES, dtype)
    self.w_down_efd = _param(rngs, (e, f, d), self.DOWN_AXES, dtype)
    self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob

  def route(self, x_btd, replay_btk=None):
    """(expert ids int32[B, T, k], routing weights float32[B, T, k]) of each token.

    `replay_btk` (router replay): int32[B, T, k] expert ids to use instead of the router's top k, for the tokens
    whose ids are all >= 0 (-1: route that token here). A replayed token's weights are the router's current
    probabilities of those experts (renormalized with `norm_topk_prob`), so the router still gets gradient
    through them; only the choice of experts is fixed.
    """
    logits_bte = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), self.w_router_de[...].astype(jnp.float32))
    probs_bte = jax.nn.softmax(logits_bte, axis=-1)
    weights_btk, experts_btk = jax.lax.top_k(probs_bte, self.top_k)
    experts_btk = experts_btk.astype(jnp.int32)
    if replay_btk is not None:
      replayed_bt1 = jnp.all(replay_btk >= 0, axis=-1, keepdims=True)
      experts_btk = jnp.where(replayed_bt1, replay_btk.astype(jnp.int32), experts_btk)
      weights_btk = jnp.take_along_axis(probs_bte, experts_btk, axis=-1)
    if self.norm_topk_prob:
      weights_btk = weights_btk / jnp.sum(weights_btk, axis=-1, keepdims=True)
    return experts_btk, weights_btk

  def router_stats(self, x_btd, experts_btk, mask_bt):
    """float32[2]: the load-balancing loss E · Σ_e f_e · P_e (f_e: the share of the tokens' k assignments that
    went to expert e, P_e: its mean router probability; 1 when both are uniform) and the router z-loss
    mean(logsumexp(logits)²), over the tokens of `mask_bt`."""
    logits_bte = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), self.w_router_de[...].astype(jnp.float32))
    mask = mask_bt.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    e, k = logits_bte.shape[-1], experts_btk.shape[-1]
    counts_e = jnp.sum(jax.nn.one_hot(experts_btk, e, dtype=jnp.float32) * mask[..., None, None], axis=(0, 1, 2))
    probs_e = jnp.sum(jax.nn.softmax(logits_bte, axis=-1) * mask[..., None], axis=(0, 1)) / n
    balance = e * jnp.sum(counts_e / (n * k) * probs_e)
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits_bte, axis=-1)) * mask) / n
    return jnp.stack([balance, z])

  def __call__(self, x_btd, replay_btk=None):
    """(output [B, T, D], the expert ids each token used int32[B, T, k])."""
    experts_btk, weights_btk = self.route(x_btd, replay_btk)
    weights = (self.w_gate_edf[...], self.w_up_edf[...], self.w_down_efd[...])
    stack = _dispatch_stack()
    placement = stack[-1] if stack else None
    if placement is not None:
      layout = placement.layout(x_btd.shape, self.top_k, weights)
      if layout is not None:
        return layout.dispatch(x_btd, experts_btk, weights_btk, *weights), experts_btk
    return _dispatch(x_btd, experts_btk, weights_btk, *weights), experts_btk


def _dispatch(x_btd, experts_btk, weights_btk, w_gate_edf, w_up_edf, w_down_efd):
  """Every token through its k experts, weighted and summed: the assignments sorted by expert, each expert's group
  multiplied by its weights (`jax.lax.ragged_dot`), added back onto their tokens.

  The weights may hold a contiguous block of the experts only (expert parallelism): ids are then relative to the
  block's first expert, and assignments outside [0, block size) are sorted last, outside every group, so
  `ragged_dot` gives them zero rows and they add nothing here (their experts' devices add them)."""
  b, t, d = x_btd.shape
  e, k = w_gate_edf.shape[0], experts_btk.shape[-1]
  flat_expert_a = experts_btk.reshape(-1)  # a = one (token, choice) assignment, b*t*k of them
  held_a = (flat_expert_a >= 0) & (flat_expert_a < e)
  group_a = jnp.where(held_a, flat_expert_a, e)  # group e: experts held elsewhere
  order_a = jnp.argsort(group_a, stable=True)
  token_a = order_a // k
  group_sizes_e = jnp.bincount(group_a, length=e + 1)[:e].astype(jnp.int32)
  x_ad = x_btd.reshape(b * t, d)[token_a]
  gate_af = jax.lax.ragged_dot(x_ad, w_gate_edf, group_sizes_e)
  up_af = jax.lax.ragged_dot(x_ad, w_up_edf, group_sizes_e)
  out_ad = jax.lax.ragged_dot(jax.nn.silu(gate_af) * up_af, w_down_efd, group_sizes_e)
  held_sorted_a = held_a[order_a][:, None]  # rows past every group are zero; held to it whatever the kernel does
  out_ad = jnp.where(held_sorted_a, out_ad * weights_btk.reshape(-1)[order_a][:, None].astype(out_ad.dtype), 0)
  return jnp.zeros((b * t, d), out_ad.dtype).at[token_a].add(out_ad).reshape(b, t, d)


# Expert parallelism sends a call's tokens to the experts when the devices of an expert group together make at
# most this many assignments per expert a device holds (one-token decode steps): a grouped matmul with so few rows
# per expert is bound by reading the expert's weights (v5p: 459 TFLOP/s over 2.76 TB/s is ~166 FLOP per byte), so
# each device reads only its own experts. With more (prefill, the update) the experts come to the tokens instead:
# a layer's experts are gathered whole, as FSDP gathers a layer, and each device computes its own tokens only.
TOKENS_TO_EXPERTS_MAX_PER_EXPERT = 128


@dataclasses.dataclass(frozen=True)
class _ExpertLayout:
  """How one MoE call's dispatch is split over a mesh (`ExpertPlacement.layout`): `jax.shard_map` over the
  mesh, the tokens' rows over `batch_axes`, each expert weight as `weight_specs` says.

  `expert_axes` non-empty: the tokens go to the experts. The experts' axis stays split over `expert_axes`: each
  device holds a contiguous block of experts and computes, for every token of its group, the assignments to its
  own experts; the partial outputs are summed back onto the tokens. Where the tokens are split over an expert
  axis too (the usual case: it is one of the batch's axes), the group's tokens are first all-gathered over it and
  the sum is a reduce-scatter, so each device gets back its own rows; where they are not, the sum is a psum. All
  of it is static in shape and drops nothing: the gathered assignments are sorted with the other devices' experts
  last, outside every group of `ragged_dot`. An all-to-all of each token to its k experts would move about k x a
  device's tokens; the all-gather moves (ep - 1) x, no more where ep <= k (Qwen3-30B-A3B: k = 8), which is why it
  is the mechanism here. Its cost is the sort's buffer, ep x the device's assignments, which is why only calls
  with few tokens (`TOKENS_TO_EXPERTS_MAX_PER_EXPERT`) take this way.

  The weights' `expert_mlp` axis may stay split (tensor parallelism inside each expert): the down projection's
  partial sums are then summed over `contracted_axes`.
  """
  mesh: Mesh
  batch_axes: tuple[str, ...]
  expert_axes: tuple[str, ...]
  contracted_axes: tuple[str, ...]
  weight_specs: tuple[PartitionSpec, PartitionSpec, PartitionSpec]

  def dispatch(self, x_btd, experts_btk, weights_btk, w_gate_edf, w_up_edf, w_down_efd):
    rows = PartitionSpec(self.batch_axes) if self.batch_axes else PartitionSpec()
    gathered = tuple(a for a in self.expert_axes if a in self.batch_axes)
    summed = tuple(a for a in self.expert_axes if a not in self.batch_axes)

    def local(x_btd, experts_btk, weights_btk, w_gate_edf, w_up_edf, w_down_efd):
      if gathered:  # the group's tokens, so that this device's experts see every assignment made to them
        x_btd, experts_btk, weights_btk = (jax.lax.all_gather(v, gathered, axis=0, tiled=True)
                                           for v in (x_btd, experts_btk, weights_btk))
      if summed:  # the same tokens on each device of the group: their gradients must be summed over it. Said
        # explicitly: left implicit, the tokens' gradient through the row gather below came back without the other
        # devices' share (jax 0.10, tested against one device in tests/test_moe.py).
        x_btd, weights_btk = (jax.lax.pcast(v, summed, to="varying") for v in (x_btd, weights_btk))
      if self.expert_axes:
        experts_btk = experts_btk - jax.lax.axis_index(self.expert_axes) * w_gate_edf.shape[0]
      out_btd = _dispatch(x_btd, experts_btk, weights_btk, w_gate_edf, w_up_edf, w_down_efd)
      if gathered:
        out_btd = jax.lax.psum_scatter(out_btd, gathered, scatter_dimension=0, tiled=True)
      if summed + self.contracted_axes:
        out_btd = jax.lax.psum(out_btd, summed + self.contracted_axes)
      return out_btd

    manual = set(self.batch_axes) | set(self.expert_axes) | set(self.contracted_axes)
    return jax.shard_map(local, mesh=self.mesh, in_specs=(rows, rows, rows) + self.weight_specs, out_specs=rows,
                         axis_names=manual)(x_btd, experts_btk, weights_btk, w_gate_edf, w_up_edf, w_down_efd)


def _axes(target) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  return () if target is None else (target,) if isinstance(target, str) else tuple(target)


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
  """Where a program's mixture-of-experts dispatch runs: `mesh`, the mesh axes the batch's rows are split over
  (`batch_axes`), and the `rules` the expert weights were placed with."""
  mesh: Mesh
  batch_axes: tuple[str, ...]
  rules: Rules

  def layout(self, x_shape: tuple[int, ...], top_k: int, weights) -> _ExpertLayout | None:
    """The split of a call on tokens of `x_shape` [B, T, D] with these expert weights; None when there is nothing
    to split (the rows not divisible over the batch's axes, no expert axis): the call dispatches as one array."""
    rows, length = x_shape[0], x_shape[1]
    size = lambda axes: math.prod(self.mesh.shape[a] for a in axes)
    batch_axes = self.batch_axes if self.batch_axes and rows % size(self.batch_axes) == 0 else ()
    gate_up, _, down = weights
    expert_axes = _axes(logical_to_spec(MoE.GATE_UP_AXES, gate_up.shape, self.mesh, self.rules)[0])
    if expert_axes:  # the tokens of one expert group: every device's rows but for the group's own split
      group_tokens = rows // size(tuple(a for a in batch_axes if a not in expert_axes)) * length
      held = gate_up.shape[0] // size(expert_axes)
      if group_tokens * top_k > TOKENS_TO_EXPERTS_MAX_PER_EXPERT * held:
        expert_axes = ()  # the experts come to the tokens
    if not batch_axes and not expert_axes:
      return None

    # Inside the map the rows' axes are the tokens' (even when these rows are too few to split): a weight
    # dimension other than the experts' that is split over one of them (FSDP's `embed`) is gathered whole, as
    # FSDP gathers a layer; so is the experts' own when the experts come to the tokens.
    def spec(axes, shape):
      kept = []
      for i, target in enumerate(logical_to_spec(axes, shape, self.mesh, self.rules)):
        if i == 0:
          names = tuple(a for a in _axes(target) if a in expert_axes)
        else:
          names = tuple(a for a in _axes(target) if a not in self.batch_axes and a not in expert_axes)
        kept.append(None if not names else names[0] if len(names) == 1 else names)
      return PartitionSpec(*kept)

    gate_up_spec, down_spec = spec(MoE.GATE_UP_AXES, gate_up.shape), spec(MoE.DOWN_AXES, down.shape)
    return _ExpertLayout(self.mesh, batch_axes, expert_axes, _axes(down_spec[1]),
                         (gate_up_spec, gate_up_spec, down_spec))


_DISPATCH = threading.local()  # `.stack`: `dispatch_experts_over`'s placements, innermost last, per thread (the
# learner thread of an async run traces its update while the main thread traces the sampler's programs)


def _dispatch_stack() -> list[ExpertPlacement]:
  if not hasattr(_DISPATCH, "stack"):
    _DISPATCH.stack = []
  return _DISPATCH.stack


@contextlib.contextmanager
def dispatch_experts_over(placement: ExpertPlacement | None) -> Iterator[None]:
  """Programs traced inside dispatch each batch shard's tokens on its own devices (None: as one array, as
  outside): the dispatch runs under `shard_map` over `placement.batch_axes` (the mesh axes the batch's rows are
  split over). The expert weights keep the layout `placement.rules` gives them where the map allows it: experts
  split over an expert-parallel axis stay split (`_ExpertLayout`), an `expert_mlp` split stays split; a
  dimension split over one of the rows' axes (FSDP) is gathered whole, as FSDP gathers a layer. Without it, the
  sort of a whole batch's assignments is one array that GSPMD does not split, so every device would dispatch
  every token. A batch whose rows the axes do not divide dispatches its rows whole (still expert-parallel when
  the rules split the experts)."""
  if placement is None:
    yield
    return
  stack = _dispatch_stack()
  stack.append(placement)
  try:
    yield
  finally:
    stack.pop()


class Block(nnx.Module):

  def __init__(self, config: ModelConfig, *, dtype: Any, rngs: nnx.Rngs, layer: int = 0):
    norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, offset=config.norm_offset)
    self.attn_norm = norm()
    self.attn = Attention(config, dtype=dtype, rngs=rngs, layer=layer)
    self.mlp_norm = norm()
    self.mlp = (MoE if config.is_moe_layer(layer) else MLP)(config, dtype=dtype, rngs=rngs)
    if config.sandwich_norms:
      self.attn_out_norm, self.mlp_out_norm = norm(), norm()

  def __call__(self, x_btd, positions_bt, segment_ids_bt, inv_freq, kv, attention: str = "einsum", replay_btk=None,
               router_stats: bool = False, segment_ends_bt=None):
    """(output, the updated cache or None, the expert ids its tokens used [B, T, k] or None for a dense MLP,
    `MoE.router_stats` over the real tokens when asked (None otherwise, and for a dense MLP))."""
    sandwich = hasattr(self, "attn_out_norm")
    attn_btd, new_kv = self.attn(self.attn_norm(x_btd), positions_bt, segment_ids_bt, inv_freq, kv, attention,
                                 segment_ends_bt)
    x_btd = x_btd + (self.attn_out_norm(attn_btd) if sandwich else attn_btd)
    experts_btk = stats = None
    if isinstance(self.mlp, MoE):
      normed_btd = self.mlp_norm(x_btd)
      mlp_btd, experts_btk = self.mlp(normed_btd, replay_btk)
      if router_stats:
        stats = self.mlp.router_stats(normed_btd, experts_btk, segment_ids_bt != 0)
    else:
      mlp_btd = self.mlp(self.mlp_norm(x_btd))
    return x_btd + (self.mlp_out_norm(mlp_btd) if sandwich else mlp_btd), new_kv, experts_btk, stats


def _stacked(blocks: list[Block]) -> Block:
  """One `Block` holding `blocks` (of one structure) stacked: each parameter [L, ...], its logical axes led by
  `LAYERS_AXIS`."""
  state = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(block) for block in blocks])
  state = jax.tree.map(lambda v: v.replace(v[...], out_sharding=(LAYERS_AXIS,) + tuple(v.get_metadata()["out_sharding"])),
                       state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(nnx.graphdef(blocks[0]), state)


class Transformer(nnx.Module):
  """A causal language model. `model(tokens)` -> float32 logits [B, T, V].

  Args (of `__call__`):
    tokens_bt: int32[B, T].
    positions_bt: int32[B, T] RoPE positions; default `0..T-1` (plus each row's `cache.index` with a cache).
      Left-padded rows pass their own positions (e.g. `cumsum(mask) - 1`).
    segment_ids_bt: int32[B, T]; 0 = padding; tokens attend only within their segment. Default all 1.
    segment_ends_bt: (`features`, no cache) int32[B, T]: the segments are a tree in preorder and each token's
      segment's subtree ends before this id: tokens also attend to their ancestors' segments, by position.
    cache: optional `KVCache`; row b's T new tokens are written at `cache.index[b]` and attend to its cache.
    cache_rows: optional int32[B]: the inputs are rows `cache_rows[b]` of a larger cache (an index past its
      end: a padding input that writes nothing). Only those rows' new slots are written.

  Returns:
    logits [B, T, V] in float32, or `(logits, cache)` when a cache was given.
  """

  def __init__(self, config: ModelConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs):
    v, d = config.vocab_size, config.hidden_size
    self.config = config
    self.dtype = dtype
    self.embed_vd = _param(rngs, (v, d), ("vocab", "embed"), dtype)
    # Each layer is made on its own (the initial weights do not depend on how layers are stored), then each run of
    # layers of one structure is stacked: `layer_stacks[r]` is one `Block` whose parameters have a leading
    # [L] axis (`LAYERS_AXIS`), run as one scan.
    blocks = [Block(config, dtype=dtype, rngs=rngs, layer=i) for i in range(config.num_hidden_layers)]
    self.layer_stacks = nnx.List([_stacked([blocks[i] for i in run]) for run in layer_runs(config)])
    self.final_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, offset=config.norm_offset)
    if not config.tie_word_embeddings:
      self.w_unembed_dv = _param(rngs, (d, v), ("embed", "vocab"), dtype)

  def features(self, tokens_bt, *, positions_bt=None, segment_ids_bt=None, cache: KVCache | None = None,
               cache_rows=None, remat: str = "none", attention: str = "einsum", routes=None,
               return_routes: bool = False, router_stats: bool = False, segment_ends_bt=None):
    """Final-normed hidden states [B, T, D] (and the updated cache, or None). `__call__` unembeds them.

    The layers run as one `lax.scan` per layer stack (`layer_runs`): one compiled layer body whatever the depth.
    A cache's stack is carried through the scan and written in place. `remat` (training, no cache): each layer's
    activations are recomputed in the backward pass instead of stored, keeping what the policy saves
    (`REMAT_POLICIES`: "full" saves nothing inside a layer, "dots" its matmul outputs without batch dimensions);
    "none" stores everything. (Under a scan the backward pass keeps only what the policy saves per layer,
    measured with XLA's memory analysis; an unrolled loop of checkpointed layers saved nothing on XLA:CPU, whose
    scheduler recomputes early.)

    Mixture of experts: `routes` int32[B, T, M, k] replays expert ids in the M sparse layers (in layer order;
    a token whose ids are -1 routes itself: `MoE.route`); `return_routes` appends the ids every token used,
    int32[B, T, M, k], to the result: (features, cache, routes). `router_stats` appends the sparse layers' mean
    `MoE.router_stats`, {"load_balance", "router_z"} (float32 scalars), last.
    """
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat={remat!r}: not one of {sorted(REMAT_POLICIES)}")
    if attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"attention={attention!r}: not one of {ATTENTION_IMPLEMENTATIONS}")
    if segment_ends_bt is not None and (cache is not None or positions_bt is None or segment_ids_bt is None):
      raise ValueError("segment_ends_bt (a tree of segments) needs positions_bt and segment_ids_bt, and no cache")
    b, t = tokens_bt.shape
    start_b = jnp.zeros((b,), jnp.int32) if cache is None else cache.index
    if cache_rows is not None:
      start_b = start_b[jnp.minimum(cache_rows, start_b.shape[0] - 1)]
    if positions_bt is None:
      positions_bt = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    if segment_ids_bt is None:
      segment_ids_bt = jnp.ones((b, t), jnp.int32)
    segment_ids_bt = segment_ids_bt.astype(jnp.int32)
    cache_seg_bs = None
    if cache is not None:
      slots_bt = start_b[:, None] + jnp.arange(t)[None, :]
      rows_b1 = (jnp.arange(b) if cache_rows is None else cache_rows)[:, None]
      cache_seg_bs = cache.segment_ids.at[rows_b1, slots_bt].set(segment_ids_bt, mode="drop")

    inv_freq = rope_tables(self.config)  # static: folded into the compiled program
    x_btd = jnp.take(self.embed_vd[...], tokens_bt, axis=0)
    if self.config.embed_scale != 1.0:
      x_btd = x_btd * jnp.asarray(self.config.embed_scale, x_btd.dtype)
    sparse = [i for i in range(self.config.num_hidden_layers) if self.config.is_moe_layer(i)]
    if routes is not None and (not sparse or routes.shape[:3] != (b, t, len(sparse))):
      raise ValueError(f"routes of shape {tuple(routes.shape)}: this model takes [B={b}, T={t}, "
                       f"{len(sparse)} sparse layers, k={self.config.num_experts_per_tok}]"
                       + ("" if sparse else " (it has no sparse layer: no routes)"))
    runs = layer_runs(self.config)
    if cache is not None and [k.shape[1] for k in cache.k] != [len(run) for run in runs]:
      raise ValueError(f"a cache of layer stacks {[k.shape[1] for k in cache.k]} for a model whose stacks hold "
                       f"{[len(run) for run in runs]} layers: make it with KVCache.init(model.config, ...)")
    checkpointed = remat != "none" and cache is None
    new_k, new_v, used, stats = [], [], {}, {}
    for index, (run, stack) in enumerate(zip(runs, self.layer_stacks)):
      graphdef, params = nnx.split(stack)
      replay = None
      if routes is not None and run[0] in sparse:  # a stack's sparse layers are consecutive in `routes`
        first = sparse.index(run[0])
        replay = jnp.moveaxis(routes[:, :, first:first + len(run)], 2, 0)
      k_stack, v_stack = (None, None) if cache is None else (cache.k[index], cache.v[index])

      def body(carry, layer_xs, graphdef=graphdef):
        x_btd, k_stack, v_stack = carry
        layer_params, replay_btk, layer = layer_xs
        kv = None if k_stack is None else (k_stack, v_stack, layer, cache_seg_bs, start_b, cache_rows,
                                           cache.heads_minor)
        x_btd, layer_kv, experts_btk, layer_stats = nnx.merge(graphdef, layer_params)(
            x_btd, positions_bt, segment_ids_bt, inv_freq, kv, attention, replay_btk, router_stats, segment_ends_bt)
        if layer_kv is not None:
          k_stack, v_stack = layer_kv
        return (x_btd, k_stack, v_stack), (experts_btk, layer_stats)

      if checkpointed:  # prevent_cse is moot inside a scan
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
      with jax.named_scope(f"layers_{run[0]}_{run[-1]}"):
        (x_btd, k_stack, v_stack), (experts, run_stats) = jax.lax.scan(
            body, (x_btd, k_stack, v_stack), (params, replay, jnp.arange(len(run))))
      if cache is not None:
        new_k.append(k_stack)
        new_v.append(v_stack)
      used.update({i: None if experts is None else experts[n] for n, i in enumerate(run)})
      stats.update({i: None if run_stats is None else run_stats[n] for n, i in enumerate(run)})
    x_btd = self.final_norm(x_btd)
    out_cache = None
    recorded = sparse and (return_routes or (cache is not None and cache.routes is not None))
    used_btmk = jnp.stack([used[i] for i in sparse], axis=2) if recorded else None
    if cache is not None:
      index = start_b + t if cache_rows is None else cache.index.at[cache_rows].add(t, mode="drop")
      cache_routes = cache.routes
      if cache_routes is not None:
        cache_routes = cache_routes.at[rows_b1, slots_bt].set(used_btmk.astype(ROUTE_DTYPE), mode="drop")
      out_cache = KVCache(k=tuple(new_k), v=tuple(new_v), segment_ids=cache_seg_bs, index=index,
                          routes=cache_routes, heads_minor=cache.heads_minor)
    out = (x_btd, out_cache) + ((used_btmk,) if return_routes else ())
    if router_stats:
      if not sparse:
        raise ValueError("router_stats: this model has no sparse layer")
      mean = jnp.mean(jnp.stack([stats[i] for i in sparse]), axis=0)
      out += ({"load_balance": mean[0], "router_z": mean[1]},)
    return out

  def layer(self, i: int) -> Block:
    """Layer `i` as a `Block` of its own: its parameters sliced out of its stack (copies, for reading)."""
    for run, stack in zip(layer_runs(self.config), self.layer_stacks):
      if i in run:
        graphdef, state = nnx.split(stack)
        state = jax.tree.map(lambda v: v.replace(v[...][run.index(i)], out_sharding=v.get_metadata()["out_sharding"][1:]),
                             state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return nnx.merge(graphdef, state)
    raise IndexError(f"layer {i}: the model has {self.config.num_hidden_layers} layers")

  def unembed_weight(self) -> jax.Array:
    """The [D, V] matrix that maps hidden states to logits (the tied embedding, transposed, or its own)."""
    return self.embed_vd[...].T if self.config.tie_word_embeddings else self.w_unembed_dv[...]

  def unembed(self, x_btd):
    """float32 logits [B, T, V] from hidden states."""
    return jnp.einsum("btd,dv->btv", x_btd, self.unembed_weight(), preferred_element_type=jnp.float32)

  def __call__(self, tokens_bt, *, positions_bt=None, segment_ids_bt=None,
               cache: KVCache | None = None, cache_rows=None, attention: str = "einsum", routes=None):
    x_btd, cache_out = self.features(tokens_bt, positions_bt=positions_bt, segment_ids_bt=segment_ids_bt,
                                     cache=cache, cache_rows=cache_rows, attention=attention, routes=routes)
    logits_btv = self.unembed(x_btd)
    if cache is None:
      return logits_btv
    return logits_btv, cache_out
