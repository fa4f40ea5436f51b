"""Jitted multi-turn sampler: prefill, decode in `lax.while_loop`, extend with observations, prefix reuse.

The API the rollout engine drives is the slot API: a fixed batch of rows ("slots"), each holding one episode
at a time, fed and decoded in place (jaxagent/rollout/engine.py):

    state = sampler.warm(params, sampler.init(rows, rng))  # empty rows; compiles every program a rollout calls
    f = Feed.empty(rows, width, pad_id)                    # host numpy: per row, tokens to append this call
    ...                                                    # (a prompt piece, an observation frame, or a copy
                                                           #  of another row's prompt for a group's samples)
    state, ok = sampler.step(params, state, f, max_steps)  # feed, then at most max_steps decode steps
    state, ok = sampler.feed(params, state, f)             # or the two halves on their own
    state = sampler.decode(params, state, max_steps)

A row decodes until it stops (a stop sequence, max_new_tokens, or its cache is full) and then waits, costing
nothing observable, until a feed appends its next observation. The turns API is a convenience for one-off use
(`jaxagent generate`, tests), a separate set of programs over the same state, not a layer over the slot API:

    state = sampler.prefill(params, prompts, rng)          # prompts: list of token lists (bucketed)
    state = sampler.repeat(state, G)                       # G samples share one prefill of each prompt
    state, turn = sampler.generate(params, state, active)  # decode one action per active row
    state, ok = sampler.extend(params, state, chunks)      # one token list per row (empty: untouched)

Every sampled token is fed into the cache (stop tokens too), so the cache always holds exactly the
trajectory's token stream. Rows that are not decoding write padding slots (segment 0) that no query ever
sees: a finished row costs nothing observable. Shapes are static: prompts and observations are padded to
length buckets, the cache has a fixed size, and the per-turn output buffer has `max_new_tokens` slots.

Log-probs: `logprobs` are under the distribution actually sampled from (after temperature, top-k, top-p;
0 for greedy, a point mass) — the behavior log-probs for importance ratios. `raw_logprobs` are the model's
untempered `log_softmax` at the sampled token. `thresholds` record where top-k / top-p cut each token's
distribution (`truncation_threshold`): the learner scores the token under the same truncated, renormalised
distribution (`algos.next_token_stats(thresholds_bt=...)`), so the on-policy ratio is 1 at any top-k / top-p.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import models
from jaxagent import buckets as buckets_lib
from jaxagent import multihost

DEFAULT_BUCKETS = buckets_lib.PREFILL
# Observations are short and every slot they take is a slot of the shared cache: finer buckets.
DEFAULT_EXTEND_BUCKETS = buckets_lib.EXTEND


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
  """Every row's decoding state; rows are slots that start, pause and restart independently.

  Attributes:
    cache: the KV cache (each row its own write index).
    next_logits: float32[B, V] logits for each row's next token.
    next_position: int32[B] RoPE position of each row's next token (= tokens in its stream so far).
    rng: the rollout's base key; row keys derive from it.
    row_key: uint32[B, *] key data of each row's episode (`fold_in(rng, episode)`). The token at stream
      position p of a row is drawn with `fold_in(row_key, p)`: what an episode samples does not depend on which
      slot it runs in, which rows share its steps, or when its observations arrive.
    prompt_logits, prompt_length: the logits and length at the end of each row's prompt, kept while the row
      holds its episode: another row with the same prompt copies them and the prompt's slots (`Feed.fork`).
    prompt_k, prompt_v: the ring caches of the sliding-window layer stacks (`models.KVCache`) as they stood at the
      end of each row's prompt, in layer order: a ring moves on as the row decodes, so a fork copies these instead.
      Empty without rings.
    running: bool[B], the row is decoding an action.
    n: int32[B] tokens of the current action; tokens / logprobs / raw_logprobs / thresholds: [B, M] its tokens
      so far (thresholds: the truncation each token was drawn under, `truncation_threshold`; NaN: none);
      recent: int32[B, W] its last W tokens (stop-sequence matching); finish: int32[B] `Finish` (NONE while
      running or idle).
  """

  cache: models.KVCache
  next_logits: jax.Array
  next_position: jax.Array
  rng: jax.Array
  row_key: jax.Array
  prompt_logits: jax.Array
  prompt_length: jax.Array
  running: jax.Array
  n: jax.Array
  recent: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  raw_logprobs: jax.Array
  thresholds: jax.Array
  finish: jax.Array
  prompt_k: tuple[jax.Array, ...] = ()
  prompt_v: tuple[jax.Array, ...] = ()


def _rings(cache: models.KVCache) -> list[int]:
  """The layer stacks whose cache is a ring (a sliding window shorter than the cache)."""
  return [i for i, slots in enumerate(cache.stack_slots()) if slots < cache.size]


@flax.struct.dataclass
class Feed:
  """What the host hands the device for every row in one `feed` call (row b's entries; all leading dim B).

  Applied in this order: `reset` (a new episode: the row is emptied and keyed by `episode`), then the
  `tokens[b, :lengths[b]]` appended (a prompt piece or an observation frame; a chunk that does not fit the
  row's remaining slots is not appended and `ok[b]` is False), then `prompt_done` (this row's prompt is
  complete: remember it for forks), then `fork` (copy the prompt of row `fork[b]`, which may have completed
  it in this same call; -1: none), then `start` (the row begins decoding an action).
  """

  tokens: jax.Array       # int32[B, W], right-padded (or [R, W]: the rows named by `rows`)
  lengths: jax.Array      # int32[B] (or [R])
  reset: jax.Array        # bool[B]
  episode: jax.Array      # int32[B] the episode's index in the rollout (its sampling key), with reset
  prompt_done: jax.Array  # bool[B]
  fork: jax.Array         # int32[B]
  start: jax.Array        # bool[B]
  rows: jax.Array | None = None  # int32[R]: `tokens[r]` belongs to row `rows[r]` (B: none); None: row r itself

  def compact(self, rows: int) -> "Feed":
    """Host-side: the same feed with only the rows that append tokens, padded to `rows` entries (the forward
    then costs R rows, not B: a feed of a few observations is cheap)."""
    has = np.flatnonzero(np.asarray(self.lengths) > 0)
    if len(has) > rows:
      raise ValueError(f"{len(has)} rows append tokens, more than {rows}")
    b = len(self.lengths)
    index = np.full((rows,), b, np.int32)
    index[:len(has)] = has
    tokens = np.zeros((rows, self.tokens.shape[1]), np.int32)
    tokens[:len(has)] = self.tokens[has]
    lengths = np.zeros((rows,), np.int32)
    lengths[:len(has)] = self.lengths[has]
    return self.replace(tokens=tokens, lengths=lengths, rows=index)

  @classmethod
  def empty(cls, rows: int, width: int, pad_id: int) -> "Feed":
    """Host-side (numpy) feed that does nothing; fill the rows that need something."""
    return cls(tokens=np.full((rows, width), pad_id, np.int32), lengths=np.zeros((rows,), np.int32),
               reset=np.zeros((rows,), bool), episode=np.zeros((rows,), np.int32),
               prompt_done=np.zeros((rows,), bool), fork=np.full((rows,), -1, np.int32),
               start=np.zeros((rows,), bool))


@flax.struct.dataclass
class TurnOutput:
  """One turn of decoding. Slots at and beyond `lengths[b]` hold `pad_id` / 0."""

  tokens: jax.Array        # int32[B, M]
  lengths: jax.Array       # int32[B]
  logprobs: jax.Array      # float32[B, M] under the sampled distribution
  raw_logprobs: jax.Array  # float32[B, M] untempered model log-prob
  thresholds: jax.Array    # float32[B, M] truncation threshold on the tempered logits (NaN: none cut)
  finish: jax.Array        # int32[B] Finish codes


def bucket(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
  """The smallest bucket >= length (`buckets.fit`)."""
  return buckets_lib.fit(length, buckets)


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

  Returns (tokens int32[B], logprobs float32[B], raw_logprobs float32[B], thresholds float32[B]).
  """
  return sample_with_uniform(logits_bv, jax.random.uniform(key, logits_bv.shape[:1]), config)


def _order_keys(x: jax.Array) -> jax.Array:
  """float32 -> uint32 keys in the same order (negative floats' bits flipped, positive ones' sign bit set)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_keys(keys: jax.Array) -> jax.Array:
  bits = jnp.where(keys >> 31 == 1, keys & jnp.uint32(0x7FFFFFFF), ~keys)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bisect(lo_b: jax.Array, hi_b: jax.Array, true_at: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """The smallest key in (lo, hi] where the monotone predicate `true_at` (false at lo, true at hi, per row)
  holds: 32 halvings cover every uint32 key, so the answer is exact."""

  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    ok = true_at(mid)
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  return jax.lax.fori_loop(0, 32, halve, (lo_b, hi_b))[1]


def truncation_threshold(scaled_bv: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """Per row, the threshold τ on the tempered logits that top-k then top-p truncation keeps: the kept set is
  {v : scaled[v] >= τ}. NaN where nothing is cut (keep every token).

  τ is the midpoint between the lowest kept and the highest dropped logit, not the lowest kept one: a learner
  that recomputes the logits (another kernel, another rounding) and applies τ keeps the same set unless the
  two logits are closer than its rounding error. Tied logits at a boundary are all kept (as top-k and top-p
  keep every token at least as likely as the last one they keep), and ties at the k-th logit count in the
  top-p mass.

  No sort: the k-th largest logit and then the lowest logit whose mass strictly above it is below top_p (of the
  top-k mass) are found by bisection over the logits' float32 order (32 passes of a compare and a sum over the
  vocabulary each). A full sort of V = 49,152 logits cost ~150 ms per decode step at batch 8 on a 2-core CPU,
  ~3x the model's forward; these passes cost a few ms.
  """
  v = scaled_bv.shape[-1]
  k = top_k if top_k and top_k < v else v
  if top_p >= 1.0 and k == v:
    return jnp.full(scaled_bv.shape[:1], jnp.nan, jnp.float32)
  x_bv = scaled_bv.astype(jnp.float32)
  keys_bv = _order_keys(x_bv)
  first_b, top_b = jnp.min(keys_bv, axis=-1), jnp.max(keys_bv, axis=-1)
  if k < v:  # the k-th largest logit: the largest key t with #{keys >= t} >= k (no key above top_b + 1 counts)
    kth_b = _bisect(first_b, top_b + 1, lambda t: jnp.sum(keys_bv >= t[:, None], axis=-1) < k) - 1
  else:
    kth_b = first_b
  last_b = kth_b  # the lowest kept key
  if top_p < 1.0:
    # Over the top-k tokens renormalised (transformers' warpers: top-k, then top-p of the remainder): keep every
    # token whose mass strictly before it (in descending order) is < top_p.
    probs_bv = jnp.where(keys_bv >= kth_b[:, None], jnp.exp(x_bv - jnp.max(x_bv, axis=-1, keepdims=True)), 0.0)
    total_b = jnp.sum(probs_bv, axis=-1)
    above = lambda t: jnp.sum(jnp.where(keys_bv > t[:, None], probs_bv, 0.0), axis=-1)
    # The smallest key with (mass strictly above it) < top_p: false just below the k-th key, true at the top.
    last_b = _bisect(kth_b - 1, top_b, lambda t: above(t) < top_p * total_b)
  below_b = jnp.max(jnp.where(keys_bv < last_b[:, None], x_bv, -jnp.inf), axis=-1)  # the highest dropped logit
  cut_b = last_b > first_b
  return jnp.where(cut_b, 0.5 * (_from_keys(last_b) + below_b), jnp.nan).astype(jnp.float32)


def truncate(scaled_bv: jax.Array, threshold_b: jax.Array) -> jax.Array:
  """Tempered logits with every token below its row's threshold set to float32's lowest (NaN: none cut)."""
  keep_bv = jnp.isnan(threshold_b)[..., None] | (scaled_bv >= threshold_b[..., None])
  return jnp.where(keep_bv, scaled_bv, jnp.finfo(jnp.float32).min)


def sample_with_uniform(logits_bv: jax.Array, uniform_b: jax.Array, config: SamplingConfig):
  """Samples one token per row by inverting the CDF of the (tempered, truncated) distribution at `uniform_b`.

  One uniform per row, not one Gumbel variate per vocabulary entry: `generate` draws every step's uniforms
  before its decode loop, so no random bits are generated inside it (a per-step [B, V] Gumbel draw was the
  costliest op of a CPU decode step). The token is the first one of positive probability whose cumulative
  probability reaches x = (1 - u) * total, x in (0, total]: a truncated token (probability 0) is never
  taken, however the cumulative sum rounds (if rounding leaves no such token, the likeliest one is taken).

  Returns (tokens int32[B], logprobs float32[B], raw_logprobs float32[B], thresholds float32[B]): logprobs
  under the distribution sampled from, raw_logprobs under the untempered model, thresholds the
  `truncation_threshold` that distribution was cut at (NaN: none), which the learner applies to score the
  token under the same distribution.
  """
  logits_bv = logits_bv.astype(jnp.float32)
  raw_logp_bv = jax.nn.log_softmax(logits_bv, axis=-1)
  take = lambda x, tokens_b: jnp.take_along_axis(x, tokens_b[:, None], axis=-1)[:, 0]
  no_threshold_b = jnp.full(logits_bv.shape[:1], jnp.nan, jnp.float32)
  if config.temperature == 0:
    tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    raw_b = take(raw_logp_bv, tokens_b)
    return tokens_b, jnp.zeros_like(raw_b), raw_b, no_threshold_b
  scaled_bv = logits_bv if config.temperature == 1.0 else logits_bv / config.temperature
  threshold_b = no_threshold_b
  if (config.top_k and config.top_k < logits_bv.shape[-1]) or config.top_p < 1.0:
    threshold_b = truncation_threshold(scaled_bv, config.top_k, config.top_p)
    scaled_bv = truncate(scaled_bv, threshold_b)
  # Untempered and untruncated: the sampled distribution is the model's, one log_softmax serves both.
  logp_bv = raw_logp_bv if scaled_bv is logits_bv else jax.nn.log_softmax(scaled_bv, axis=-1)
  probs_bv = jnp.exp(logp_bv)
  cdf_bv = jnp.cumsum(probs_bv, axis=-1)
  x_b = (1.0 - uniform_b.astype(jnp.float32)) * cdf_bv[:, -1]
  hit_bv = (cdf_bv >= x_b[:, None]) & (probs_bv > 0)
  tokens_b = jnp.argmax(hit_bv, axis=-1).astype(jnp.int32)
  tokens_b = jnp.where(take(hit_bv, tokens_b), tokens_b, jnp.argmax(probs_bv, axis=-1).astype(jnp.int32))
  return tokens_b, take(logp_bv, tokens_b), take(raw_logp_bv, tokens_b), threshold_b


def _stop_table(config: SamplingConfig) -> tuple[np.ndarray, int]:
  """Stop sequences right-aligned in a [num, L] table; -1 marks 'any token' on the left."""
  longest = max((len(s) for s in config.stop_sequences), default=1)
  table = np.full((max(len(config.stop_sequences), 1), longest), -1, np.int32)
  for i, seq in enumerate(config.stop_sequences):
    table[i, longest - len(seq):] = seq
  if not config.stop_sequences:
    table[:] = -3  # matches nothing
  return table, longest


_STATE_AXES = dict(next_logits=("batch", None), next_position=("batch",), row_key=("batch", None),
                   prompt_logits=("batch", None), prompt_length=("batch",), running=("batch",), n=("batch",),
                   recent=("batch", None), tokens=("batch", None), logprobs=("batch", None),
                   raw_logprobs=("batch", None), thresholds=("batch", None), finish=("batch",))


def _constrain_cache(cache: models.KVCache, mesh: Mesh | None, rules: models.Rules) -> models.KVCache:
  if mesh is None:
    return cache
  con = lambda x, axes: jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, models.logical_to_spec(axes, x.shape, mesh, rules)))
  return cache.replace(k=tuple(con(k, cache.k_axes) for k in cache.k),
                       v=tuple(con(v, cache.v_axes) for v in cache.v),
                       segment_ids=con(cache.segment_ids, ("batch", "length")), index=con(cache.index, ("batch",)),
                       routes=None if cache.routes is None else con(cache.routes, ("batch", None, None, None)))


def _constrain_state(state: SamplerState, mesh: Mesh | None, rules: models.Rules) -> SamplerState:
  """Pins every field's layout so consecutive calls see identical input shardings (no recompilation)."""
  if mesh is None:
    return state
  con = lambda x, axes: jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, models.logical_to_spec(axes, x.shape, mesh, rules)))
  return state.replace(cache=_constrain_cache(state.cache, mesh, rules),
                       rng=jax.lax.with_sharding_constraint(state.rng, NamedSharding(mesh, PartitionSpec())),
                       prompt_k=tuple(con(k, state.cache.k_axes) for k in state.prompt_k),
                       prompt_v=tuple(con(v, state.cache.v_axes) for v in state.prompt_v),
                       **{name: con(getattr(state, name), axes) for name, axes in _STATE_AXES.items()})


def init_state(model: models.Transformer, rows: int, cache_size: int, config: SamplingConfig, pad_id: int,
               rng: jax.Array, *, routes: bool = False) -> SamplerState:
  """Empty rows: nothing in the cache, nothing running (`routes`: the cache records each token's experts)."""
  m, window = config.max_new_tokens, _stop_table(config)[1]
  v = model.config.vocab_size
  key_data = jax.random.key_data(rng)
  cache = models.KVCache.init(model.config, rows, cache_size, model.dtype, routes=routes)
  rings = _rings(cache)
  return SamplerState(
      cache=cache, prompt_k=tuple(cache.k[i] for i in rings), prompt_v=tuple(cache.v[i] for i in rings),
      next_logits=jnp.zeros((rows, v), jnp.float32), next_position=jnp.zeros((rows,), jnp.int32), rng=rng,
      row_key=jnp.zeros((rows,) + key_data.shape, key_data.dtype),
      prompt_logits=jnp.zeros((rows, v), jnp.float32), prompt_length=jnp.zeros((rows,), jnp.int32),
      running=jnp.zeros((rows,), bool), n=jnp.zeros((rows,), jnp.int32),
      recent=jnp.full((rows, window), -2, jnp.int32), tokens=jnp.full((rows, m), pad_id, jnp.int32),
      logprobs=jnp.zeros((rows, m), jnp.float32), raw_logprobs=jnp.zeros((rows, m), jnp.float32),
      thresholds=jnp.full((rows, m), jnp.nan, jnp.float32),
      finish=jnp.zeros((rows,), jnp.int32))


def _rows_where(mask_b: jax.Array, new: Any, old: Any) -> Any:
  """Per row: `new` where mask_b, else `old` (any leading-B arrays, pytrees alike)."""
  pick = lambda a, b: jnp.where(mask_b.reshape(mask_b.shape + (1,) * (a.ndim - 1)), a, b)
  return jax.tree.map(pick, new, old)


def feed(model: models.Transformer, state: SamplerState, f: Feed, *, pad_id: int, mesh: Mesh | None = None,
         rules: models.Rules = (), attention: str = "einsum") -> tuple[SamplerState, jax.Array]:
  """Applies one `Feed` (see its docstring for the order). Returns (state, ok bool[B]).

  A row whose chunk does not fit its remaining cache slots gets nothing appended and is not started
  (`ok[b]` False): the caller ends that trajectory as context-exhausted. Rows with nothing to append cost no
  model work beyond the call's fixed shape, and when no row appends anything there is no forward at all.
  """
  state = _reset_episodes(state, f)
  state, ok = _append_chunks(model, state, f, attention)
  # 3. Completed prompts are remembered for forks.
  done = f.prompt_done & ok
  state = state.replace(prompt_logits=jnp.where(done[:, None], state.next_logits, state.prompt_logits),
                        prompt_length=jnp.where(done, state.cache.index, state.prompt_length))
  state = _remember_prompt_rings(state, done)
  state, ok = _fork_prompts(state, f, ok)
  # 5. Rows that begin an action.
  start = f.start & ok
  state = state.replace(
      running=state.running | start, n=jnp.where(start, 0, state.n),
      recent=jnp.where(start[:, None], -2, state.recent),
      tokens=jnp.where(start[:, None], pad_id, state.tokens),
      logprobs=jnp.where(start[:, None], 0.0, state.logprobs),
      raw_logprobs=jnp.where(start[:, None], 0.0, state.raw_logprobs),
      thresholds=jnp.where(start[:, None], jnp.nan, state.thresholds),
      finish=jnp.where(start, Finish.NONE, state.finish))
  return _constrain_state(state, mesh, rules), ok


def _reset_episodes(state: SamplerState, f: Feed) -> SamplerState:
  """Feed step 1. New episodes: an empty row keyed by its episode."""
  cache = state.cache
  keys = jax.vmap(lambda e: jax.random.key_data(jax.random.fold_in(state.rng, e)))(f.episode)
  return state.replace(
      cache=cache.replace(segment_ids=jnp.where(f.reset[:, None], 0, cache.segment_ids),
                          index=jnp.where(f.reset, 0, cache.index)),
      next_position=jnp.where(f.reset, 0, state.next_position),
      row_key=_rows_where(f.reset, keys, state.row_key),
      prompt_length=jnp.where(f.reset, 0, state.prompt_length),
      running=state.running & ~f.reset, finish=jnp.where(f.reset, Finish.NONE, state.finish))


def _append_chunks(model: models.Transformer, state: SamplerState, f: Feed, attention: str
                   ) -> tuple[SamplerState, jax.Array]:
  """Feed step 2. Appends each row's chunk where it fits (ok False where it does not). Compact feeds gather the
  appending rows (and their caches) into R rows, run them and scatter them back (index B: a padding entry,
  dropped)."""
  w = f.tokens.shape[1]
  size = state.cache.size
  b = state.next_position.shape[0]
  rows = jnp.arange(b) if f.rows is None else f.rows
  take = jnp.minimum(rows, b - 1)
  fits = state.cache.index[take] + f.lengths <= size
  lengths = jnp.where(fits & (rows < b), f.lengths, 0)
  ok = jnp.ones((b,), bool).at[rows].set(fits | (f.lengths == 0), mode="drop")

  def append(state):
    r = rows.shape[0]
    segment_ids_rt = (jnp.arange(w)[None, :] < lengths[:, None]).astype(jnp.int32)
    positions_rt = state.next_position[take][:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    logits_rtv, cache = model(f.tokens, positions_bt=positions_rt, segment_ids_bt=segment_ids_rt,
                              cache=state.cache, cache_rows=f.rows, attention=attention)
    last = jnp.where((lengths > 0)[:, None], logits_rtv[jnp.arange(r), jnp.maximum(lengths - 1, 0)],
                     state.next_logits[take])
    return state.replace(cache=cache.replace(index=state.cache.index.at[rows].add(lengths, mode="drop")),
                         next_logits=state.next_logits.at[rows].set(last, mode="drop"),
                         next_position=state.next_position.at[rows].add(lengths, mode="drop"))

  return jax.lax.cond(jnp.any(lengths > 0), append, lambda s: s, state), ok


def _fork_prompts(state: SamplerState, f: Feed, ok: jax.Array) -> tuple[SamplerState, jax.Array]:
  """Feed step 4. Forks: the prompt's slots, logits and length of another row (its later slots stay invisible:
  segment 0). A source whose prompt did not fit (or is not complete) has nothing to give: that fork is refused
  (ok False)."""
  size = state.cache.size
  src = jnp.maximum(f.fork, 0)
  valid_fork = (f.fork >= 0) & ok[src] & (state.prompt_length[src] > 0)
  ok = ok & ((f.fork < 0) | valid_fork)

  def fork(state):
    # One row at a time (a while loop over the forking rows): a copy moves one cache row, never the batch.
    dst_list = jnp.nonzero(valid_fork, size=valid_fork.shape[0], fill_value=0)[0]

    def copy(i, st):
      d = dst_list[i]
      s = f.fork[d]
      cache = st.cache
      length = st.prompt_length[s]
      seg = jnp.where(jnp.arange(size) < length, cache.segment_ids[s], 0)
      # A ring copies the source's prompt-time ring (the source's own has moved on if it decoded since).
      ring_k, ring_v = dict(zip(_rings(cache), st.prompt_k)), dict(zip(_rings(cache), st.prompt_v))
      cache = cache.replace(k=tuple(k.at[d].set(ring_k.get(i, k)[s]) for i, k in enumerate(cache.k)),
                            v=tuple(v.at[d].set(ring_v.get(i, v)[s]) for i, v in enumerate(cache.v)),
                            segment_ids=cache.segment_ids.at[d].set(seg), index=cache.index.at[d].set(length),
                            routes=None if cache.routes is None else cache.routes.at[d].set(cache.routes[s]))
      return st.replace(cache=cache, next_position=st.next_position.at[d].set(length),
                        prompt_k=tuple(k.at[d].set(k[s]) for k in st.prompt_k),
                        prompt_v=tuple(v.at[d].set(v[s]) for v in st.prompt_v),
                        next_logits=st.next_logits.at[d].set(st.prompt_logits[s]),
                        prompt_logits=st.prompt_logits.at[d].set(st.prompt_logits[s]),
                        prompt_length=st.prompt_length.at[d].set(length))

    return jax.lax.fori_loop(0, jnp.sum(valid_fork), copy, state)

  return jax.lax.cond(jnp.any(valid_fork), fork, lambda s: s, state), ok


def _remember_prompt_rings(state: SamplerState, done_b: jax.Array) -> SamplerState:
  """The rows of `done_b` keep their rings as they stand now (their prompt's end) for forks."""
  if not state.prompt_k:
    return state
  rings, pick = _rings(state.cache), lambda new, old: _rows_where(done_b, new, old)
  return state.replace(prompt_k=tuple(pick(state.cache.k[i], k) for i, k in zip(rings, state.prompt_k)),
                       prompt_v=tuple(pick(state.cache.v[i], v) for i, v in zip(rings, state.prompt_v)))


def refill(model: models.Transformer, state: SamplerState, tokens_bc: jax.Array, lengths_b: jax.Array,
           prompt_lengths_b: jax.Array, *, mesh: Mesh | None = None, rules: models.Rules = (),
           attention: str = "einsum") -> tuple[SamplerState, jax.Array]:
  """Recomputes the KV cache of the rows with `lengths_b > 0` from their tokens (`tokens_bc[b, :lengths_b[b]]`,
  what the row's cache holds) under `model`, and their next-token and prompt logits; nothing else of a row
  changes (a running action goes on). Returns (state, KL(old ‖ new) of each row's next-token distribution;
  0 for rows not refilled)."""
  b, c = tokens_bc.shape
  mask = lengths_b > 0
  rows = jnp.where(mask, jnp.arange(b), b)  # b: not refilled (dropped by the cache writes)
  cache = state.cache
  cache = cache.replace(segment_ids=jnp.where(mask[:, None], 0, cache.segment_ids),
                        index=jnp.where(mask, 0, cache.index))
  j_bc = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
  has_prompt = mask & (prompt_lengths_b > 0)
  if not state.prompt_k:
    logits_bcv, cache = model(tokens_bc, positions_bt=j_bc, segment_ids_bt=(j_bc < lengths_b[:, None]).astype(
        jnp.int32), cache=cache, cache_rows=rows, attention=attention)
    at = lambda i_b: logits_bcv[jnp.arange(b), jnp.clip(i_b - 1, 0, c - 1)].astype(jnp.float32)
    new_next, new_prompt = at(lengths_b), at(prompt_lengths_b)
  else:
    # Rings: the prompt first, so that its rings can be kept for forks (as a feed keeps them), then the rest.
    split_b = jnp.where(mask, jnp.minimum(prompt_lengths_b, lengths_b), 0)
    first, cache = model(tokens_bc, positions_bt=j_bc, segment_ids_bt=(j_bc < split_b[:, None]).astype(jnp.int32),
                         cache=cache, cache_rows=rows, attention=attention)
    state = _remember_prompt_rings(state.replace(cache=cache), has_prompt)
    rest_bc = jnp.take_along_axis(tokens_bc, jnp.minimum(split_b[:, None] + j_bc, c - 1), axis=1)
    cache = state.cache.replace(index=jnp.where(mask, split_b, state.cache.index))
    second, cache = model(rest_bc, positions_bt=split_b[:, None] + j_bc,
                          segment_ids_bt=(j_bc < (lengths_b - split_b)[:, None]).astype(jnp.int32), cache=cache,
                          cache_rows=rows, attention=attention)
    at = lambda logits, i_b: logits[jnp.arange(b), jnp.clip(i_b - 1, 0, c - 1)].astype(jnp.float32)
    new_next = jnp.where((lengths_b > split_b)[:, None], at(second, lengths_b - split_b), at(first, lengths_b))
    new_prompt = at(first, prompt_lengths_b)
  old_logp = jax.nn.log_softmax(state.next_logits, -1)
  kl = jnp.where(mask, jnp.sum(jnp.exp(old_logp) * (old_logp - jax.nn.log_softmax(new_next, -1)), -1), 0.0)
  state = state.replace(
      cache=cache.replace(index=jnp.where(mask, lengths_b, state.cache.index)),
      next_logits=jnp.where(mask[:, None], new_next, state.next_logits),
      prompt_logits=jnp.where(has_prompt[:, None], new_prompt, state.prompt_logits))
  return _constrain_state(state, mesh, rules), kl


def decode(model: models.Transformer, state: SamplerState, config: SamplingConfig, max_steps: int | jax.Array,
           *, mesh: Mesh | None = None, rules: models.Rules = (), until_finished: float | jax.Array = 1.0
           ) -> SamplerState:
  """Decodes the running rows for at most `max_steps` tokens (`lax.while_loop`; ends early once none runs).

  A row stops when it samples a stop sequence (STOP), reaches `max_new_tokens` (BUDGET) or has no cache slot
  left (CONTEXT_FULL): `running` goes False and `finish` says why; its action is `tokens[b, :n[b]]`. Every
  sampled token is fed into the row's cache, so the cache holds exactly the row's stream. Rows that are not
  running write only padding (segment 0) at their next slot, which nothing sees and the next write replaces.
  """
  m = config.max_new_tokens
  size = state.cache.size
  table_np, _ = _stop_table(config)
  table = jnp.asarray(table_np)
  impl = jax.random.key_impl(state.rng)

  def uniforms(row_key_b, position_b):
    return jax.vmap(lambda k, p: jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(k, impl=impl), p))
                    )(row_key_b, position_b)

  # Ends once `until_finished` of the rows running now have finished (1: all of them), even within max_steps.
  started = state.running
  enough = jnp.maximum(jnp.ceil(until_finished * jnp.sum(started)), 1)

  def cond(c):
    step, st = c
    return (step < max_steps) & jnp.any(st.running) & (jnp.sum(started & ~st.running) < enough)

  def body(c):
    step, st = c
    full = st.cache.index >= size
    running = st.running & ~full
    token, logp, raw, tau = sample_with_uniform(st.next_logits, uniforms(st.row_key, st.next_position), config)
    at = running[:, None] & (jnp.arange(m)[None, :] == st.n[:, None])
    n = st.n + running
    recent = jnp.where(running[:, None], jnp.concatenate([st.recent[:, 1:], token[:, None]], 1), st.recent)
    match = ((recent[:, None, :] == table[None]) | (table[None] == -1)).all(-1).any(-1)
    stopped = running & match
    budget = running & ~stopped & (n >= m)
    logits, cache = model(token[:, None], positions_bt=st.next_position[:, None],
                          segment_ids_bt=running.astype(jnp.int32)[:, None], cache=st.cache)
    finish = jnp.where(stopped, Finish.STOP, jnp.where(budget, Finish.BUDGET,
                                                       jnp.where(st.running & full, Finish.CONTEXT_FULL, st.finish)))
    st = st.replace(cache=_constrain_cache(cache.replace(index=st.cache.index + running), mesh, rules),
                    next_logits=jnp.where(running[:, None], logits[:, 0], st.next_logits),
                    next_position=st.next_position + running,
                    tokens=jnp.where(at, token[:, None], st.tokens),
                    logprobs=jnp.where(at, logp[:, None], st.logprobs),
                    raw_logprobs=jnp.where(at, raw[:, None], st.raw_logprobs),
                    thresholds=jnp.where(at, tau[:, None], st.thresholds),
                    n=n, recent=recent, finish=finish.astype(jnp.int32), running=running & ~stopped & ~budget)
    return step + 1, st

  _, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
  return _constrain_state(state, mesh, rules)


def turn_output(state: SamplerState, active_b: jax.Array, pad_id: int) -> TurnOutput:
  """The action each row of `active_b` decoded (zeros / pad for the others)."""
  keep = active_b[:, None]
  return TurnOutput(tokens=jnp.where(keep, state.tokens, pad_id), lengths=jnp.where(active_b, state.n, 0),
                    logprobs=jnp.where(keep, state.logprobs, 0.0),
                    raw_logprobs=jnp.where(keep, state.raw_logprobs, 0.0),
                    thresholds=jnp.where(keep, state.thresholds, jnp.nan),
                    finish=jnp.where(active_b, state.finish, Finish.NONE).astype(jnp.int32))


def repeat(state: SamplerState, times: int) -> SamplerState:
  """Each row repeated `times` times (rows of one prompt contiguous): prefix reuse for G samples. Row r of the
  result is keyed as episode r, as if the repeated prompts had been prefilled one per row."""
  state = jax.tree.map(lambda x: jnp.repeat(x, times, axis=0) if x.ndim else x, state)
  b = state.next_position.shape[0]
  keys = jax.vmap(lambda e: jax.random.key_data(jax.random.fold_in(state.rng, e)))(jnp.arange(b))
  return state.replace(row_key=keys)


# ------------------------------------------------------------------------------------------------
# The jitted front end.


class Sampler:
  """Compiled feed / decode (and the one-turn conveniences prefill / generate / extend) for one model graph,
  cache size and sampling config.

  Two ways to drive it:
  - slots (the rollout engine): `init`, then any interleaving of `feed` (new episodes, prompt pieces,
    observation frames, forks, action starts) and `decode` (a bounded chunk of steps for the running rows);
  - turns (generation, tests, benchmarks): `prefill` prompts, `generate` one action for active rows, `extend`
    with observations, `repeat` for G samples of one prefill.

  Args:
    model: the policy; its graph is fixed, its parameters are passed to each call (they change in training).
    cache_size: KV-cache slots per row (prompt + every action and observation of a trajectory).
    config: sampling parameters.
    pad_id: token written to unused output slots.
    mesh, rules: generation layout; the cache is constrained to `KVCache.k_axes` / `v_axes` (batch over
      data, kv heads over tensor).
    buckets: allowed prompt widths of `prefill` (static shapes).
    extend_buckets: allowed chunk widths of `extend` and `feed`.
    record_routes: a mixture of experts records the experts every cached token used (`KVCache.routes`; read
      with `routes`), for the learner to replay (router replay).
  """

  def __init__(self, model: models.Transformer, *, cache_size: int, config: SamplingConfig, pad_id: int,
               mesh: Mesh | None = None, rules: models.Rules = (),
               buckets: Sequence[int] = DEFAULT_BUCKETS,
               extend_buckets: Sequence[int] = DEFAULT_EXTEND_BUCKETS, attention: str = "einsum",
               record_routes: bool = False):
    self.graphdef, _ = nnx.split(model)
    self.model_config = model.config
    self.cache_size = cache_size
    self.config = config
    self.pad_id = pad_id
    self.buckets = tuple(buckets)
    self.extend_buckets = tuple(extend_buckets)
    self.mesh = mesh
    self.rules = rules
    self.records_routes = bool(record_routes) and model.config.num_experts > 0
    shard = dict(mesh=mesh, rules=rules)
    merge = lambda params: nnx.merge(self.graphdef, params)
    self.merge, self.attention = merge, attention
    self._programs: dict[tuple, Any] = {}  # compiled callback programs (`run_callback_program`)
    self._warm: set[int] = set()  # batch sizes whose programs `warm` has compiled
    self._exchange: Callable | None = None

    def new_state(rows, rng):
      return _constrain_state(init_state(model, rows, cache_size, config, pad_id, rng, routes=self.records_routes),
                              mesh, rules)

    def prefill_fn(params, tokens, lengths, rng):
      rows = tokens.shape[0]
      f = Feed(tokens=tokens, lengths=lengths, reset=jnp.ones((rows,), bool), episode=jnp.arange(rows),
               prompt_done=jnp.ones((rows,), bool), fork=jnp.full((rows,), -1), start=jnp.zeros((rows,), bool))
      return feed(merge(params), new_state(rows, rng), f, pad_id=pad_id, attention=attention, **shard)[0]

    def generate_fn(params, state, active):
      rows = active.shape[0]
      none = jnp.zeros((rows,), bool)
      start = Feed(tokens=jnp.zeros((rows, 1), jnp.int32), lengths=jnp.zeros((rows,), jnp.int32), reset=none,
                   episode=jnp.zeros((rows,), jnp.int32), prompt_done=none, fork=jnp.full((rows,), -1), start=active)
      state, _ = feed(merge(params), state, start, pad_id=pad_id, attention=attention, **shard)
      state = decode(merge(params), state, config, config.max_new_tokens, **shard)
      return state, turn_output(state, active, pad_id)

    def extend_fn(params, state, tokens, lengths):
      rows = tokens.shape[0]
      none = jnp.zeros((rows,), bool)
      f = Feed(tokens=tokens, lengths=lengths, reset=none, episode=jnp.zeros((rows,), jnp.int32), prompt_done=none,
               fork=jnp.full((rows,), -1), start=none)
      return feed(merge(params), state, f, pad_id=pad_id, attention=attention, **shard)

    # A mixture of experts dispatches each batch shard's tokens on its own devices, to the experts they hold.
    self.expert_placement = multihost.expert_placement(model.config.num_experts, mesh, rules)
    jit = self._jit
    self._init = jit(new_state, static_argnums=0)
    self._prefill = jit(prefill_fn)
    self._generate = jit(generate_fn, donate_argnums=1)
    self._extend = jit(extend_fn, donate_argnums=1)
    self._feed = jit(lambda p, st, f: feed(merge(p), st, f, pad_id=pad_id, attention=attention, **shard),
                     donate_argnums=1)
    self._decode = jit(lambda p, st, steps, until: decode(merge(p), st, config, steps, until_finished=until,
                                                          **shard), donate_argnums=1)

    def step_fn(p, st, f, steps, until):
      st, ok = feed(merge(p), st, f, pad_id=pad_id, attention=attention, **shard)
      return decode(merge(p), st, config, steps, until_finished=until, **shard), ok

    self._step = jit(step_fn, donate_argnums=1)
    self._refill = jit(lambda p, st, tokens, lengths, prompts: refill(
        merge(p), st, tokens, lengths, prompts, attention=attention, **shard), donate_argnums=1)
    self._repeat = jit(lambda st, times: _constrain_state(repeat(st, times), mesh, rules), static_argnums=1)

  def _jit(self, fn: Callable, **kwargs) -> Any:
    """`jax.jit(fn)`, traced with this sampler's expert placement (`models.dispatch_experts_over`)."""
    placement = self.expert_placement

    def traced(*args):
      with models.dispatch_experts_over(placement):
        return fn(*args)

    return jax.jit(traced, **kwargs)

  def batch_shards(self, rows: int) -> tuple[tuple[str, ...], int]:
    """The mesh axes a batch of `rows` (global) is sharded over, and into how many row blocks (1: one block)."""
    if self.mesh is None:
      return (), 1
    return multihost.batch_shards(rows, self.mesh, self.rules)

  def run_callback_program(self, params: nnx.State, state: SamplerState, exchange: Callable, width: int,
                           chunk: int, max_exchanges: int = 1 << 30) -> SamplerState:
    """A whole rollout as one jitted program: decode `chunk` steps -> `exchange` through io_callback -> feed,
    until every row block says stop.

    `exchange(shard, finish, n, tokens, logprobs, thresholds, ok)` is called once per block of rows the batch
    is sharded into (`batch_shards`), on the host that holds the block, with only that block's rows (numpy:
    the running actions' state and the last feed's `ok`; `env_bridge.per_shard_callback`), and returns the
    next `Feed`'s fields for those rows (tokens [rows, width], lengths, reset, episode, prompt_done, fork,
    start; fork and episode global) and `stop` bool[1]: this block is done. One compiled program per (rows,
    width, chunk); the callback is looked up at run time, so the program outlives one rollout's host
    scheduler. The state is donated.
    """
    rows = state.next_position.shape[0]
    key = (rows, width, chunk, max_exchanges)
    if key not in self._programs:
      axes, shards = self.batch_shards(rows)
      b, r = jax.ShapeDtypeStruct, rows // shards
      shapes = (b((r, width), jnp.int32), b((r,), jnp.int32), b((r,), jnp.bool_), b((r,), jnp.int32),
                b((r,), jnp.bool_), b((r,), jnp.int32), b((r,), jnp.bool_), b((1,), jnp.bool_))
      trampoline = lambda *args: self._exchange(*args)
      shard = dict(mesh=self.mesh, rules=self.rules)

      def host_call(*args):
        if shards > 1:  # each block's host gets its own rows (every process calls only its own envs)
          return multihost.per_shard_callback(trampoline, shapes, args, self.mesh, axes)
        return io_callback(trampoline, shapes, jnp.zeros((), jnp.int32), *args, ordered=True)

      def program(params, state):
        model = self.merge(params)

        def body(c):
          state, ok, _, i = c
          state = decode(model, state, self.config, chunk, **shard)
          *fields, stop = host_call(state.finish, state.n, state.tokens, state.logprobs, state.thresholds, ok)
          state, ok = feed(model, state, Feed(*fields), pad_id=self.pad_id, attention=self.attention, **shard)
          return state, ok, jnp.all(stop), i + 1

        init = (state, jnp.ones((rows,), bool), jnp.zeros((), bool), jnp.zeros((), jnp.int32))
        state, _, stop, _ = jax.lax.while_loop(lambda c: ~c[2] & (c[3] < max_exchanges), body, init)
        return state, stop

      self._programs[key] = self._jit(program, donate_argnums=1)
    self._exchange = exchange
    try:
      state, stop = self._programs[key](params, state)
      stop = bool(stop)  # waits for the program: its callbacks look the exchange up until it ends
    finally:
      self._exchange = None
    if not stop:
      raise RuntimeError(f"the rollout program ended after {max_exchanges} exchanges without finishing")
    return state

  def _put_batch(self, x: Any) -> Any:
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
    if jax.process_count() == 1:  # one batched transfer: every copy starts before the first wait
      return jax.tree.map(np.asarray, jax.device_get(tree))
    return jax.tree.map(multihost.local_rows, tree)

  def routes(self, state: SamplerState, rows: Sequence[int], lengths: Sequence[int]) -> list[np.ndarray]:
    """The experts the tokens in slots [0, lengths[i]) of this process's row `rows[i]` used (int16[L, M, k]),
    read from the shards this process holds (no collective: each process asks when its own episodes end)."""
    routes = state.cache.routes
    if routes is None:
      raise ValueError("this sampler records no routes (Sampler(record_routes=True) on a mixture of experts)")
    offset = jax.process_index() * (routes.shape[0] // jax.process_count())
    shards = [(sh.index[0].indices(routes.shape[0]), sh.data) for sh in routes.addressable_shards]
    out = []
    for row, length in zip(rows, lengths):
      g = offset + int(row)
      (start, _, _), data = next(((sl, d) for sl, d in shards if sl[0] <= g < sl[1]))
      out.append(np.asarray(data[g - start, :int(length)]))
    return out

  # -- slots

  def init(self, rows: int, rng: jax.Array) -> SamplerState:
    """`rows` empty rows (global count); `rng` keys every episode fed into them."""
    return self._init(rows, rng)

  def feed(self, params: nnx.State, state: SamplerState, f: Feed) -> tuple[SamplerState, jax.Array]:
    """Applies this process's rows of a host `Feed` (numpy; see `Feed.empty`). The state is donated.

    When the batch lives whole on one device and one process, only the rows that append tokens run, padded
    to the smallest of `row_buckets` that holds them (one compiled feed per bucket, `Feed.compact`)."""
    return self._feed(params, state, self._device_feed(f))

  def step(self, params: nnx.State, state: SamplerState, f: Feed, max_steps: int, until_finished: float = 1.0
           ) -> tuple[SamplerState, jax.Array]:
    """`feed` then `decode` in one call (one dispatch, one wait). The state is donated."""
    return self._step(params, state, self._device_feed(f), np.int32(max_steps), np.float32(until_finished))

  def _device_feed(self, f: Feed) -> Feed:
    """The device's copy of a host feed: compacted to a row bucket when only a few rows append tokens."""
    count = int(np.count_nonzero(f.lengths))
    fitting = [r for r in self.row_buckets(len(f.lengths)) if r >= count]
    if f.rows is None and fitting and self._compactable(len(f.lengths)):
      f = f.compact(fitting[0])
      return self._put_batch(f.replace(rows=None)).replace(rows=jnp.asarray(f.rows))
    return self._put_batch(f)

  @staticmethod
  def row_buckets(rows: int) -> list[int]:
    """Compacted feed sizes for a batch of `rows`: B/8, B/4, B/2 (a bigger feed runs every row). Few sizes, so
    few programs to compile; a feed of one row then costs B/8 rows."""
    return sorted({max(1, rows >> k) for k in (1, 2, 3)} - {rows})

  def warm(self, params: nnx.State, state: SamplerState) -> SamplerState:
    """Compiles what a rollout calls, now: `step` for every row bucket and the whole batch, `feed` and `decode`
    (feeds that append nothing, no decode step). With one extend bucket (the trainer's), a rollout then
    compiles nothing more when its feeds first reach a new size. The state is donated."""
    b = state.next_position.shape[0] // jax.process_count()
    if b in self._warm:
      return state
    width = max(self.extend_buckets)
    empty = Feed.empty(b, width, self.pad_id)
    state, _ = self._step(params, state, self._put_batch(empty), np.int32(0), np.float32(1))
    state, _ = self._feed(params, state, self._put_batch(empty))
    state = self._decode(params, state, np.int32(0), np.float32(1))
    if jax.process_count() == 1 and self._compactable(b):
      for r in self.row_buckets(b):
        f = empty.compact(r)
        state, _ = self._step(params, state, self._put_batch(f.replace(rows=None)).replace(rows=jnp.asarray(f.rows)),
                              np.int32(0), np.float32(1))
    self._warm.add(b)
    return state

  def _compactable(self, rows: int) -> bool:
    if jax.process_count() > 1:
      return False
    return self.batch_shards(rows)[1] == 1

  def refill(self, params: nnx.State, state: SamplerState, tokens: np.ndarray, lengths: np.ndarray,
             prompt_lengths: np.ndarray) -> tuple[SamplerState, jax.Array]:
    """`refill` (module function) of this process's rows: `tokens` [rows, cache_size]. The state is donated."""
    put = self._put_batch
    return self._refill(params, state, put(tokens), put(lengths), put(prompt_lengths))

  def decode(self, params: nnx.State, state: SamplerState, max_steps: int, until_finished: float = 1.0
             ) -> SamplerState:
    """At most `max_steps` decode steps of the running rows, ending once `until_finished` of them have finished
    (1: all; see the module function). The state is donated."""
    return self._decode(params, state, np.int32(max_steps), np.float32(until_finished))

  # -- turns

  def prefill(self, params: nnx.State, prompts: Sequence[Sequence[int]], rng: jax.Array) -> SamplerState:
    """Fresh rows holding the prompts (row r keyed as episode r)."""
    length = self._bucket([len(p) for p in prompts], self.buckets)
    if length > self.cache_size:
      raise ValueError(f"prompts need {length} slots (bucketed), the cache has {self.cache_size}")
    tokens, lengths = pad_right(prompts, length, self.pad_id)
    return self._prefill(params, self._put_batch(tokens), self._put_batch(lengths), rng)

  def repeat(self, state: SamplerState, times: int) -> SamplerState:
    return self._repeat(state, times)

  def generate(self, params: nnx.State, state: SamplerState, active: np.ndarray | jax.Array | None = None
               ) -> tuple[SamplerState, TurnOutput]:
    """Decodes one action for `active` rows (default: all). The input state is donated."""
    b = state.next_position.shape[0] // jax.process_count()
    active = np.ones((b,), bool) if active is None else np.asarray(active, bool)
    return self._generate(params, state, self._put_batch(active))

  def extend(self, params: nnx.State, state: SamplerState, chunks: Sequence[Sequence[int]]
             ) -> tuple[SamplerState, jax.Array]:
    """Appends one token list per row (empty: untouched), right-padded to a bucket. State is donated.
    Returns (state, ok bool[B]): a row whose chunk does not fit its remaining slots gets nothing."""
    length = self._bucket([max(1, len(c)) for c in chunks], self.extend_buckets)
    tokens, lengths = pad_right(chunks, length, self.pad_id)
    return self._extend(params, state, self._put_batch(tokens), self._put_batch(lengths))
