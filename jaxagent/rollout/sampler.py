"""Jitted multi-turn sampler: prefill, decode in `lax.while_loop`, extend with observations, prefix reuse.

The sampler keeps one `SamplerState` per batch of trajectories across turns:

    state = sampler.prefill(params, prompts, rng)          # prompts: list of token lists (bucketed)
    state = sampler.repeat(state, G)                       # G samples share one prefill of each prompt
    state, turn = sampler.generate(params, state, active)  # decode one action per active row
    state, ok = sampler.extend(params, state, observations, rows)  # append observations, keep the cache

Every sampled token is fed into the cache (stop tokens too), so the cache always holds exactly the
trajectory's token stream. Rows that are not decoding write padding slots (segment 0) that no query ever
sees: a finished row costs nothing observable. Shapes are static: prompts and observations are padded to
length buckets, the cache has a fixed size, and the per-turn output buffer has `max_new_tokens` slots.

Log-probs: `logprobs` are under the distribution actually sampled from (after temperature, top-k, top-p;
0 for greedy, a point mass) — the behavior log-probs for importance ratios. `raw_logprobs` are the model's
untempered `log_softmax` at the sampled token.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import models
from jaxagent import multihost

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# Observations are short and every slot they take is a slot of the shared cache: finer buckets.
DEFAULT_EXTEND_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class Finish(enum.IntEnum):
  """Why a row stopped decoding in a turn."""

  NONE = 0          # the row was not decoding this turn
  STOP = 1          # sampled a stop token or completed a stop sequence
  BUDGET = 2        # reached the per-turn token budget (max_new_tokens)
  CONTEXT_FULL = 3  # the cache has no free slot left


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Static sampling parameters (part of the compiled program).

  Attributes:
    temperature: 0 = greedy.
    top_k: keep the k most likely tokens (0 = off).
    top_p: nucleus sampling: keep the smallest set with cumulative probability >= top_p (1 = off);
      applied after top-k, over the renormalized remainder (as transformers' logits warpers do).
    max_new_tokens: per-turn token budget.
    stop_sequences: token-id sequences that end a turn (a stop token id is a sequence of length 1).
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 64
  stop_sequences: tuple[tuple[int, ...], ...] = ()

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if any(len(s) == 0 for s in self.stop_sequences):
      raise ValueError("stop_sequences must not contain an empty sequence")


@flax.struct.dataclass
class SamplerState:
  """What carries over between turns.

  Attributes:
    cache: the KV cache (all rows share the write index).
    next_logits: float32[B, V] logits for each row's next token.
    next_position: int32[B] RoPE position of each row's next token (= tokens in its stream so far).
    rng: the key the next turn's samples derive from.
  """

  cache: models.KVCache
  next_logits: jax.Array
  next_position: jax.Array
  rng: jax.Array


@flax.struct.dataclass
class TurnOutput:
  """One turn of decoding. Slots at and beyond `lengths[b]` hold `pad_id` / 0."""

  tokens: jax.Array        # int32[B, M]
  lengths: jax.Array       # int32[B]
  logprobs: jax.Array      # float32[B, M] under the sampled distribution
  raw_logprobs: jax.Array  # float32[B, M] untempered model log-prob
  finish: jax.Array        # int32[B] Finish codes


def bucket(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
  """The smallest bucket >= length."""
  for b in buckets:
    if b >= length:
      return b
  raise ValueError(f"length {length} exceeds the largest bucket {max(buckets)}")


def pad_left(seqs: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token lists to `length`: (tokens int32[B, length], segment_ids int32[B, length])."""
  tokens = np.full((len(seqs), length), pad_id, np.int32)
  segments = np.zeros((len(seqs), length), np.int32)
  for i, seq in enumerate(seqs):
    if len(seq) > length:
      raise ValueError(f"row {i}: {len(seq)} tokens do not fit in {length}")
    if len(seq):
      tokens[i, length - len(seq):] = seq
      segments[i, length - len(seq):] = 1
  return tokens, segments


def pad_right(seqs: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token lists to `length`: (tokens int32[B, length], lengths int32[B])."""
  tokens = np.full((len(seqs), length), pad_id, np.int32)
  lengths = np.zeros((len(seqs),), np.int32)
  for i, seq in enumerate(seqs):
    if len(seq) > length:
      raise ValueError(f"row {i}: {len(seq)} tokens do not fit in {length}")
    tokens[i, :len(seq)] = seq
    lengths[i] = len(seq)
  return tokens, lengths


# ------------------------------------------------------------------------------------------------
# Pure functions (usable inside a larger jitted program).


def sample_logits(logits_bv: jax.Array, key: jax.Array, config: SamplingConfig):
  """Samples one token per row; `key` draws one uniform per row (see `sample_with_uniform`).

  Returns (tokens int32[B], logprobs float32[B], raw_logprobs float32[B]).
  """
  return sample_with_uniform(logits_bv, jax.random.uniform(key, logits_bv.shape[:1]), config)


def sample_with_uniform(logits_bv: jax.Array, uniform_b: jax.Array, config: SamplingConfig):
  """Samples one token per row by inverting the CDF of the (tempered, truncated) distribution at `uniform_b`.

  One uniform per row, not one Gumbel variate per vocabulary entry: `generate` draws every step's uniforms
  before its decode loop, so no random bits are generated inside it (a per-step [B, V] Gumbel draw was the
  costliest op of a CPU decode step). The token is the first one of positive probability whose cumulative
  probability reaches x = (1 - u) * total, x in (0, total]: a truncated token (probability 0) is never
  taken, however the cumulative sum rounds (if rounding leaves no such token, the likeliest one is taken).

  Returns (tokens int32[B], logprobs float32[B], raw_logprobs float32[B]).
  """
  logits_bv = logits_bv.astype(jnp.float32)
  raw_logp_bv = jax.nn.log_softmax(logits_bv, axis=-1)
  take = lambda x, tokens_b: jnp.take_along_axis(x, tokens_b[:, None], axis=-1)[:, 0]
  if config.temperature == 0:
    tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    raw_b = take(raw_logp_bv, tokens_b)
    return tokens_b, jnp.zeros_like(raw_b), raw_b
  scaled_bv = logits_bv if config.temperature == 1.0 else logits_bv / config.temperature
  neg_inf = jnp.finfo(jnp.float32).min
  if config.top_k and config.top_k < logits_bv.shape[-1]:
    kth_b = jax.lax.top_k(scaled_bv, config.top_k)[0][:, -1:]
    scaled_bv = jnp.where(scaled_bv < kth_b, neg_inf, scaled_bv)
  if config.top_p < 1.0:
    sorted_bv = jnp.sort(scaled_bv, axis=-1)[:, ::-1]
    probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
    before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv  # mass strictly before each sorted token
    keep_bv = before_bv < config.top_p
    cutoff_b = jnp.min(jnp.where(keep_bv, sorted_bv, jnp.inf), axis=-1, keepdims=True)
    scaled_bv = jnp.where(scaled_bv < cutoff_b, neg_inf, scaled_bv)
  # Untempered and untruncated: the sampled distribution is the model's, one log_softmax serves both.
  logp_bv = raw_logp_bv if scaled_bv is logits_bv else jax.nn.log_softmax(scaled_bv, axis=-1)
  probs_bv = jnp.exp(logp_bv)
  cdf_bv = jnp.cumsum(probs_bv, axis=-1)
  x_b = (1.0 - uniform_b.astype(jnp.float32)) * cdf_bv[:, -1]
  hit_bv = (cdf_bv >= x_b[:, None]) & (probs_bv > 0)
  tokens_b = jnp.argmax(hit_bv, axis=-1).astype(jnp.int32)
  tokens_b = jnp.where(take(hit_bv, tokens_b), tokens_b, jnp.argmax(probs_bv, axis=-1).astype(jnp.int32))
  return tokens_b, take(logp_bv, tokens_b), take(raw_logp_bv, tokens_b)


def _stop_table(config: SamplingConfig) -> tuple[np.ndarray, int]:
  """Stop sequences right-aligned in a [num, L] table; -1 marks 'any token' on the left."""
  longest = max((len(s) for s in config.stop_sequences), default=1)
  table = np.full((max(len(config.stop_sequences), 1), longest), -1, np.int32)
  for i, seq in enumerate(config.stop_sequences):
    table[i, longest - len(seq):] = seq
  if not config.stop_sequences:
    table[:] = -3  # matches nothing
  return table, longest


def _last_valid(segment_ids_bt: jax.Array) -> jax.Array:
  t = segment_ids_bt.shape[1]
  return t - 1 - jnp.argmax((segment_ids_bt != 0)[:, ::-1], axis=1)


def _constrain_cache(cache: models.KVCache, mesh: Mesh | None, rules: models.Rules) -> models.KVCache:
  if mesh is None:
    return cache
  con = lambda x, axes: jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, models.logical_to_spec(axes, x.shape, mesh, rules)))
  return cache.replace(k=tuple(con(k, models.KVCache.K_AXES) for k in cache.k),
                       v=tuple(con(v, models.KVCache.V_AXES) for v in cache.v),
                       segment_ids=con(cache.segment_ids, ("batch", "length")))


def _constrain_state(state: SamplerState, mesh: Mesh | None, rules: models.Rules) -> SamplerState:
  """Pins every field's layout so consecutive calls see identical input shardings (no recompilation)."""
  if mesh is None:
    return state
  con = lambda x, axes: jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, models.logical_to_spec(axes, x.shape, mesh, rules)))
  return state.replace(cache=_constrain_cache(state.cache, mesh, rules),
                       next_logits=con(state.next_logits, ("batch", None)),
                       next_position=con(state.next_position, ("batch",)),
                       rng=jax.lax.with_sharding_constraint(state.rng, NamedSharding(mesh, jax.sharding.PartitionSpec())))


def prefill(model: models.Transformer, tokens_bt: jax.Array, segment_ids_bt: jax.Array, rng: jax.Array,
            cache_size: int, *, mesh: Mesh | None = None, rules: models.Rules = (), attention: str = "einsum"
            ) -> SamplerState:
  """Runs left-padded prompts through the model into a fresh cache."""
  b, _ = tokens_bt.shape
  cache = _constrain_cache(models.KVCache.init(model.config, b, cache_size, model.dtype), mesh, rules)
  positions_bt = jnp.maximum(jnp.cumsum(segment_ids_bt != 0, axis=1) - 1, 0).astype(jnp.int32)
  logits_btv, cache = model(tokens_bt, positions_bt=positions_bt, segment_ids_bt=segment_ids_bt, cache=cache,
                            attention=attention)
  last_b = _last_valid(segment_ids_bt)
  rows = jnp.arange(b)
  return _constrain_state(SamplerState(cache=cache, next_logits=logits_btv[rows, last_b],
                                      next_position=positions_bt[rows, last_b] + 1, rng=rng), mesh, rules)


def extend(model: models.Transformer, state: SamplerState, tokens_bt: jax.Array, lengths_b: jax.Array,
           *, mesh: Mesh | None = None, rules: models.Rules = (), attention: str = "einsum"
           ) -> tuple[SamplerState, jax.Array]:
  """Appends right-padded chunks (row b: its first `lengths_b[b]` tokens) to the cache; no recomputation.

  Rows with length 0 are untouched. Returns (state, ok); ok is False (and the state unchanged) when the chunk
  does not fit in the cache; the caller then ends those trajectories as context-exhausted.
  """
  b, t = tokens_bt.shape
  segment_ids_bt = (jnp.arange(t)[None, :] < lengths_b[:, None]).astype(jnp.int32)
  positions_bt = state.next_position[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  ok = state.cache.index + t <= state.cache.size

  def run(state):
    logits_btv, cache = model(tokens_bt, positions_bt=positions_bt, segment_ids_bt=segment_ids_bt,
                              cache=state.cache, attention=attention)
    last_logits = logits_btv[jnp.arange(b), jnp.maximum(lengths_b - 1, 0)]
    has = lengths_b > 0
    return state.replace(cache=_constrain_cache(cache, mesh, rules),
                         next_logits=jnp.where(has[:, None], last_logits, state.next_logits),
                         next_position=state.next_position + lengths_b)

  return _constrain_state(jax.lax.cond(ok, run, lambda s: s, state), mesh, rules), ok


def generate(model: models.Transformer, state: SamplerState, active_b: jax.Array, config: SamplingConfig,
             pad_id: int, *, mesh: Mesh | None = None, rules: models.Rules = ()
             ) -> tuple[SamplerState, TurnOutput]:
  """Decodes one turn for the rows in `active_b` in a `lax.while_loop`."""
  b = active_b.shape[0]
  m = config.max_new_tokens
  table_np, window = _stop_table(config)
  table = jnp.asarray(table_np)
  rng, turn_key = jax.random.split(state.rng)
  # Every step's uniforms, drawn before the loop: the loop itself generates no random bits.
  uniforms_mb = jax.random.uniform(turn_key, (m, b))

  init = dict(
      state=state.replace(rng=rng), step=jnp.zeros((), jnp.int32), done=~active_b,
      n=jnp.zeros((b,), jnp.int32), finish=jnp.zeros((b,), jnp.int32),
      recent=jnp.full((b, window), -2, jnp.int32),
      tokens=jnp.full((b, m), pad_id, jnp.int32), logprobs=jnp.zeros((b, m), jnp.float32),
      raw=jnp.zeros((b, m), jnp.float32))

  def cond(c):
    return (c["step"] < m) & jnp.any(~c["done"]) & (c["state"].cache.index < c["state"].cache.size)

  def body(c):
    st = c["state"]
    running = ~c["done"]
    token, logp, raw = sample_with_uniform(st.next_logits, uniforms_mb[c["step"]], config)
    # A running row has produced exactly `step` tokens this turn (rows start together and never restart),
    # so every row writes column `step`: one in-place column update instead of a per-row scatter.
    put = lambda buf, x, fill: jax.lax.dynamic_update_slice(
        buf, jnp.where(running, x, fill).astype(buf.dtype)[:, None], (0, c["step"]))
    tokens, logprobs = put(c["tokens"], token, pad_id), put(c["logprobs"], logp, 0.0)
    raws = put(c["raw"], raw, 0.0)
    n = c["n"] + running
    recent = jnp.where(running[:, None], jnp.concatenate([c["recent"][:, 1:], token[:, None]], 1), c["recent"])
    match = ((recent[:, None, :] == table[None]) | (table[None] == -1)).all(-1).any(-1)
    stopped = running & match
    budget = running & ~stopped & (n >= m)
    logits, cache = model(token[:, None], positions_bt=st.next_position[:, None],
                          segment_ids_bt=running.astype(jnp.int32)[:, None], cache=st.cache)
    st = st.replace(cache=_constrain_cache(cache, mesh, rules),
                    next_logits=jnp.where(running[:, None], logits[:, 0], st.next_logits),
                    next_position=st.next_position + running)
    finish = jnp.where(stopped, Finish.STOP, jnp.where(budget, Finish.BUDGET, c["finish"]))
    return dict(state=st, step=c["step"] + 1, done=c["done"] | stopped | budget, n=n, finish=finish,
                recent=recent, tokens=tokens, logprobs=logprobs, raw=raws)

  c = jax.lax.while_loop(cond, body, init)
  finish = jnp.where(active_b & ~c["done"], Finish.CONTEXT_FULL, c["finish"]).astype(jnp.int32)
  return _constrain_state(c["state"], mesh, rules), TurnOutput(tokens=c["tokens"], lengths=c["n"],
                                                                logprobs=c["logprobs"],
                                raw_logprobs=c["raw"], finish=finish)


def repeat(state: SamplerState, times: int) -> SamplerState:
  """Each row repeated `times` times (rows of one prompt contiguous): prefix reuse for G samples."""
  rep = lambda x: jnp.repeat(x, times, axis=0)
  cache = state.cache
  return state.replace(
      cache=cache.replace(k=tuple(map(rep, cache.k)), v=tuple(map(rep, cache.v)),
                          segment_ids=rep(cache.segment_ids)),
      next_logits=rep(state.next_logits), next_position=rep(state.next_position))


# ------------------------------------------------------------------------------------------------
# The jitted front end.


class Sampler:
  """Compiled prefill / generate / extend for one model graph, cache size and sampling config.

  Args:
    model: the policy; its graph is fixed, its parameters are passed to each call (they change in training).
    cache_size: KV-cache slots per row (prompt + every action and observation of a trajectory).
    config: sampling parameters.
    pad_id: token written to unused output slots.
    mesh, rules: generation layout; the cache is constrained to `KVCache.K_AXES` / `V_AXES` (batch over
      data, kv heads over tensor).
    buckets: allowed prompt lengths (static shapes).
    extend_buckets: allowed lengths of appended chunks (observations).
  """

  def __init__(self, model: models.Transformer, *, cache_size: int, config: SamplingConfig, pad_id: int,
               mesh: Mesh | None = None, rules: models.Rules = (),
               buckets: Sequence[int] = DEFAULT_BUCKETS,
               extend_buckets: Sequence[int] = DEFAULT_EXTEND_BUCKETS, attention: str = "einsum"):
    self.graphdef, _ = nnx.split(model)
    self.cache_size = cache_size
    self.config = config
    self.pad_id = pad_id
    self.buckets = tuple(buckets)
    self.extend_buckets = tuple(extend_buckets)
    self.mesh = mesh
    self.rules = rules
    shard = dict(mesh=mesh, rules=rules)
    merge = lambda params: nnx.merge(self.graphdef, params)
    self._prefill = jax.jit(lambda p, t, s, r: prefill(merge(p), t, s, r, cache_size, attention=attention, **shard))
    self._generate = jax.jit(lambda p, st, a: generate(merge(p), st, a, config, pad_id, **shard),
                             donate_argnums=1)
    self._extend = jax.jit(lambda p, st, t, n: extend(merge(p), st, t, n, attention=attention, **shard),
                           donate_argnums=1)
    self._repeat = jax.jit(lambda st, times: _constrain_state(repeat(st, times), mesh, rules), static_argnums=1)

  def _put_batch(self, x: np.ndarray) -> jax.Array:
    """This process's rows -> the global batch array (rows of process p follow those of p - 1)."""
    return multihost.to_global(x, self.mesh, self.rules)

  @staticmethod
  def _bucket(lengths: Sequence[int], buckets: Sequence[int]) -> int:
    """The bucket of the longest length over every process: all of them must pick the same one (one global
    shape). With a single bucket there is nothing to agree on, and no collective (the trainer's extend)."""
    n = max(lengths, default=0)
    if len(buckets) > 1:
      n = int(multihost.host_max(np.asarray(n, np.int32)))
    return bucket(n, buckets)

  def to_host(self, tree: Any) -> Any:
    """Numpy copies of this process's rows of batch-leading arrays (all rows in a single process)."""
    return jax.tree.map(multihost.local_rows, tree)

  def prefill(self, params: nnx.State, prompts: Sequence[Sequence[int]], rng: jax.Array) -> SamplerState:
    """Prefills token lists (left-padded to a bucket)."""
    length = self._bucket([len(p) for p in prompts], self.buckets)
    if length > self.cache_size:
      raise ValueError(f"prompts need {length} slots (bucketed), the cache has {self.cache_size}")
    tokens, segments = pad_left(prompts, length, self.pad_id)
    return self._prefill(params, self._put_batch(tokens), self._put_batch(segments), rng)

  def repeat(self, state: SamplerState, times: int) -> SamplerState:
    return self._repeat(state, times)

  def generate(self, params: nnx.State, state: SamplerState, active: np.ndarray | jax.Array | None = None
               ) -> tuple[SamplerState, TurnOutput]:
    """Decodes one turn for `active` rows (default: all). The input state is donated."""
    b = state.next_position.shape[0] // jax.process_count()
    active = np.ones((b,), bool) if active is None else np.asarray(active, bool)
    return self._generate(params, state, self._put_batch(active))

  def extend(self, params: nnx.State, state: SamplerState, chunks: Sequence[Sequence[int]]
             ) -> tuple[SamplerState, jax.Array]:
    """Appends one token list per row (empty: untouched), right-padded to a bucket. State is donated."""
    length = self._bucket([max(1, len(c)) for c in chunks], self.extend_buckets)
    tokens, lengths = pad_right(chunks, length, self.pad_id)
    return self._extend(params, state, self._put_batch(tokens), self._put_batch(lengths))
