"""Who writes a rollout's actions: the policy (`SampledActions`, over the sampler) or a script
(`ScriptedActions`: demonstrations, through the same path so their records have the layout of sampled ones).

An `Actor` owns the sampler's rows of a rollout: the scheduler (jaxagent/rollout/scheduler.py) feeds it prompts
and observation frames and asks it to decode; `SampledActions.run_program` is the callback transport's one
jitted program per rollout.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from jaxagent import multihost
from jaxagent.rollout.sampler import Feed, Finish, Sampler, bucket

# A continuous host_loop decode chunk also ends once this fraction of the rows it began with have finished: their
# envs start now instead of at the chunk's end, and the rest go on in the next call. Measured on a `make run`
# rollout round (64 slots, calculator; means of 8 rounds from a BC checkpoint): 0.54 s per round without (1.0: a
# chunk runs its steps unless every row finishes), 0.49 s at 0.5, 0.45 s at 0.25, 0.49 s at 0.1. The callback
# program's chunks run their steps: each of its exchanges feeds every row at the full width, and more of them
# cost more than the early hand-off gains (bench/rollout.py, zero latency: 0.79x lockstep with the rule, 0.99x
# without).
CHUNK_UNTIL_FINISHED = 0.25
# Router replay reads each episode's routes from the sampler state as the episode ends, between device calls.
ROUTES_NEED_HOST_LOOP = ("router replay reads each episode's recorded experts as it ends, which the callback "
                         "program keeps on the device: use rollout.env_transport: host_loop, or "
                         "model.moe.router_replay: false")


@dataclasses.dataclass(frozen=True)
class RowAction:
  """One row's action: its tokens, their behavior log-probs, the truncation thresholds they were sampled under
  (NaN: none; `sampler.truncation_threshold`), why it ended, and the policy version that sampled each token
  (None: the rollout's one version)."""
  tokens: list[int]
  logprobs: list[float]
  finish: Finish
  thresholds: list[float] | None = None
  versions: list[int] | None = None


def finished_actions(running, finish, n, tokens, logprobs, thresholds) -> dict[int, RowAction]:
  """The actions of the `running` rows that have finished (`SamplerState` fields as numpy arrays)."""
  finish, n, tokens, logprobs, thresholds = map(np.asarray, (finish, n, tokens, logprobs, thresholds))
  return {int(i): RowAction(tokens[i, :n[i]].tolist(), logprobs[i, :n[i]].tolist(), Finish(int(finish[i])),
                            thresholds[i, :n[i]].tolist())
          for i in np.flatnonzero(running) if finish[i] != Finish.NONE}


class Actor(abc.ABC):
  """The side of a rollout that produces actions: slots that are fed tokens and decode actions.

  Rows are this process's slots. `feed` and `decode` are collective across processes (every process calls
  them in the same order, possibly with nothing to do for its own rows).
  """

  width: int = 0         # tokens per row per feed call (longer chunks are cut into pieces)
  decode_s: float = 0.0  # time in decode calls (device time for a policy)
  extend_s: float = 0.0  # time in feed calls

  @abc.abstractmethod
  def begin(self, slots: int, first_episode: int = 0) -> None:
    """Empties `slots` rows for a new rollout. Feeds name this process's episodes 0, 1, ...; globally they are
    `first_episode` + those (sampling keys derive from the global index)."""

  @abc.abstractmethod
  def feed(self, f: Feed) -> np.ndarray:
    """Applies a host `Feed` to this process's rows; returns ok bool[slots] (False: the chunk did not fit)."""

  @abc.abstractmethod
  def decode(self, running: np.ndarray, lockstep: bool) -> dict[int, RowAction | None]:
    """Decodes the running rows for a chunk (lockstep: until each has finished its action); returns the
    actions finished in it (None: the source has no more actions for that row)."""

  def width_for(self, longest: int) -> int:
    """The feed width for a call whose longest piece has `longest` tokens."""
    return self.width

  def feed_decode(self, f: Feed, lockstep: bool) -> tuple[np.ndarray, Callable[[np.ndarray], dict]]:
    """`feed` then `decode` (a policy does both in one device call). Returns (ok, actions), where
    `actions(running)` gives `decode`'s answer for the rows running after the feed."""
    ok = self.feed(f)
    return ok, lambda running: self.decode(running, lockstep)

  def episode_routes(self, slot: int, stream: Sequence[int]) -> np.ndarray | None:
    """Router replay: the experts every token of the episode in `slot` (its token `stream`) used when the actor
    computed it, int16[len(stream), M, k] (-1: not computed there); None when the actor records none."""
    return None


class SampledActions(Actor):
  """The policy's actions through the jitted sampler.

  Args:
    sampler: the compiled sampler (its `max_new_tokens` is the per-turn budget; its largest extend bucket is
      the feed width: prompts longer than that are fed in pieces).
    params: the policy's parameters in the rollout layout.
    rng: the rollout's key; episode e samples with `fold_in(rng, e)`.
    decode_chunk: decode steps per `decode` call in the continuous schedule (finished rows are handed to their
      envs, and newly fed rows join, at chunk boundaries).
  """

  def __init__(self, sampler: Sampler, params, rng: jax.Array, decode_chunk: int = 8, *, version: int = 0,
               track_cache: bool = False):
    if decode_chunk < 1:
      raise ValueError(f"decode_chunk={decode_chunk}: must be >= 1")
    self.sampler, self.params, self.rng, self.chunk = sampler, params, rng, decode_chunk
    self.width = max(sampler.extend_buckets)
    self.state = None
    self.decode_s = self.extend_s = 0.0
    self.version = version          # of `params`; `set_params` changes both
    # Keep each row's cached tokens on the host (`set_params(refill=True)`; router replay: which prefix of an
    # episode's stream its row's recorded routes belong to).
    self.track_cache = track_cache or sampler.records_routes

  def width_for(self, longest: int) -> int:
    if jax.process_count() > 1:  # feeds are collective: one width everywhere, with no agreement needed
      return self.width
    return bucket(min(max(longest, 1), self.width), self.sampler.extend_buckets)

  def begin(self, slots, first_episode=0):
    self.slots, self.first_episode = slots, first_episode
    self.state = self.sampler.warm(self.params, self.sampler.init(slots * jax.process_count(), self.rng))
    # Which version computed each row's next-token logits (the next token is drawn from them) and its prompt's
    # (a fork starts from those); the current action's token count and per-token versions; the cached tokens.
    self._logits_version = np.full(slots, self.version, np.int64)
    self._prompt_version = np.full(slots, self.version, np.int64)
    self._n = np.zeros(slots, np.int64)
    self._versions: list[list[int]] = [[] for _ in range(slots)]
    self._cached: list[list[int]] = [[] for _ in range(slots)]
    self._prompt_length = np.zeros(slots, np.int64)

  def _fed(self, f: Feed, ok: np.ndarray) -> None:
    """Host bookkeeping of a feed (the device's order: reset, append, prompt done, fork, start)."""
    ok = np.asarray(ok, bool)
    for r in np.flatnonzero(f.reset):
      self._cached[r], self._prompt_length[r] = [], 0
    appended = (np.asarray(f.lengths) > 0) & ok
    self._logits_version[appended] = self.version
    if self.track_cache:
      for r in np.flatnonzero(appended):
        self._cached[r] += np.asarray(f.tokens[r, :f.lengths[r]]).tolist()
    done = np.asarray(f.prompt_done, bool) & ok
    self._prompt_version[done] = self.version
    for r in np.flatnonzero(done):
      self._prompt_length[r] = len(self._cached[r])
    for r in np.flatnonzero((np.asarray(f.fork) >= 0) & ok):
      src = int(f.fork[r])
      self._logits_version[r] = self._prompt_version[r] = self._prompt_version[src]
      self._prompt_length[r] = self._prompt_length[src]
      self._cached[r] = self._cached[src][:self._prompt_length[src]]
    for r in np.flatnonzero(np.asarray(f.start, bool) & ok):
      self._n[r], self._versions[r] = 0, []

  def _decoded(self, n: np.ndarray, tokens: np.ndarray) -> None:
    """Host bookkeeping of a decode: a row's first new token came from the logits it held (their version), the
    rest from logits this call computed (the current version)."""
    for r in np.flatnonzero(n > self._n):
      k = int(n[r] - self._n[r])
      self._versions[r] += [int(self._logits_version[r])] + [self.version] * (k - 1)
      if self.track_cache:
        self._cached[r] += tokens[r, self._n[r]:n[r]].tolist()
      self._logits_version[r], self._n[r] = self.version, n[r]

  def set_params(self, params, version: int, *, refill: bool = False) -> dict[str, float]:
    """Switches the rows to `params` (policy version `version`) between two device calls: episodes in flight
    go on under them. `refill=False` keeps every row's KV cache and the next-token logits the old weights
    computed (the next token of a running action is still the old version's); `refill=True` recomputes both
    from the row's cached tokens under the new weights (needs `track_cache`). Returns the refill's metrics:
    rows refilled and the mean KL(old ‖ new) of their next-token distributions (the gap keeping would leave)."""
    self.params, self.version = params, int(version)
    if not refill:
      return {}
    if not self.track_cache:
      raise ValueError("set_params(refill=True) needs SampledActions(track_cache=True)")
    rows = [r for r in range(self.slots) if self._cached[r]]
    if not rows:
      return {"refill_rows": 0.0, "refill_kl": 0.0}
    t0 = time.perf_counter()
    tokens = np.full((self.slots, self.sampler.cache_size), self.sampler.pad_id, np.int32)
    lengths = np.zeros(self.slots, np.int32)
    for r in rows:
      tokens[r, :len(self._cached[r])] = self._cached[r]
      lengths[r] = len(self._cached[r])
    self.state, kl = self.sampler.refill(params, self.state, tokens, lengths, self._prompt_length.astype(np.int32))
    kl = np.asarray(self.sampler.to_host(kl))
    self._logits_version[rows] = self.version
    self._prompt_version[[r for r in rows if self._prompt_length[r]]] = self.version
    self.extend_s += time.perf_counter() - t0
    return {"refill_rows": float(len(rows)), "refill_kl": float(kl[rows].mean())}

  def episode_routes(self, slot, stream):
    """The routes the row recorded for the longest prefix of `stream` its cache holds: every token the sampler
    fed or sampled for the episode. The rest of the stream (tokens never fed, such as a last observation after
    the episode ended) keeps -1: the learner routes those itself. Read when the episode ends, before its row is
    reset."""
    if not self.sampler.records_routes:
      return None
    cached, stream = self._cached[slot], list(stream)
    n = 0
    limit = min(len(cached), len(stream))
    while n < limit and cached[n] == stream[n]:
      n += 1
    recorded = self.sampler.routes(self.state, [slot], [n])[0]
    out = np.full((len(stream),) + recorded.shape[1:], -1, recorded.dtype)
    out[:n] = recorded
    return out

  def global_ids(self, f: Feed) -> Feed:
    """Forks and episodes name this process's rows and episodes: make them global."""
    offset = jax.process_index() * self.slots
    return f.replace(fork=np.where(f.fork >= 0, f.fork + offset, -1).astype(np.int32),
                     episode=(f.episode + self.first_episode).astype(np.int32))

  def feed(self, f):
    t0 = time.perf_counter()
    self.state, ok = self.sampler.feed(self.params, self.state, self.global_ids(f))
    ok = multihost.local_rows(ok)
    self._fed(f, ok)
    self.extend_s += time.perf_counter() - t0
    return ok

  def decode(self, running, lockstep):
    t0 = time.perf_counter()
    self.state = self.sampler.decode(self.params, self.state, self._steps(lockstep), self._until(lockstep))
    actions = self._actions(running)
    self.decode_s += time.perf_counter() - t0
    return actions

  def feed_decode(self, f, lockstep):
    t0 = time.perf_counter()
    self.state, ok = self.sampler.step(self.params, self.state, self.global_ids(f), self._steps(lockstep),
                                       self._until(lockstep))
    ok = multihost.local_rows(ok)
    self._fed(f, ok)
    self.decode_s += time.perf_counter() - t0
    return ok, self._actions

  def _steps(self, lockstep: bool) -> int:
    return self.sampler.config.max_new_tokens if lockstep else self.chunk

  def _until(self, lockstep: bool) -> float:
    return 1.0 if lockstep else CHUNK_UNTIL_FINISHED

  def _actions(self, running):
    st = self.state
    finish, n, tokens, logprobs, thresholds = self.sampler.to_host((st.finish, st.n, st.tokens, st.logprobs,
                                                                    st.thresholds))
    self._decoded(n, tokens)
    done = finished_actions(running, finish, n, tokens, logprobs, thresholds)
    return {r: dataclasses.replace(a, versions=self._versions[r][:len(a.tokens)]) for r, a in done.items()}

  # -- the callback transport

  def run_program(self, exchange: Callable) -> None:
    """Runs the rollout as one jitted program (`Sampler.run_callback_program`) whose host side is `exchange`
    (all of this process's rows at once; `_BlockExchange` gathers the program's per-block calls for it)."""
    if self.sampler.records_routes:
      raise ValueError(ROUTES_NEED_HOST_LOOP)
    rows = self.slots * jax.process_count()
    _, blocks = self.sampler.batch_shards(rows)
    per_block = rows // blocks
    if self.slots % per_block:
      raise ValueError(f"rollout.env_transport=callback: this process's {self.slots} rows are not whole blocks of "
                       f"the batch's {blocks} shards ({per_block} rows each)")
    # The exchange adds the device's share (time between exchanges) to decode_s.
    self.state = self.sampler.run_callback_program(
        self.params, self.state, _BlockExchange(exchange, self.slots // per_block, per_block,
                                                first=jax.process_index() * self.slots // per_block),
        self.width, self.chunk)  # chunks run their steps: every exchange feeds every row at the full width


class _BlockExchange:
  """The callback program's host side in one process: the program calls once per row block this process holds
  (on as many threads as it has devices: `multihost.per_shard_callback`); the scheduler exchanges once for all of
  the process's rows. The last block to arrive runs the exchange; the others wait for its answer.

  Args:
    exchange: `Scheduler.exchange` (this process's rows in, this process's next feed and `stop` out).
    blocks: row blocks held here; rows: rows per block; first: the global index of this process's first block.
  """

  def __init__(self, exchange: Callable, blocks: int, rows: int, first: int, timeout_s: float = 3600.0):
    self.exchange, self.blocks, self.rows, self.first, self.timeout_s = exchange, blocks, rows, first, timeout_s
    self.cond = threading.Condition()
    self.arrived: dict[int, tuple] = {}
    self.round = 0
    self.answers: dict[int, tuple] = {}

  def __call__(self, block, *rows):
    k = int(np.asarray(block).reshape(-1)[0]) - self.first
    if not 0 <= k < self.blocks:
      raise RuntimeError(f"the rollout program called for row block {k + self.first}; this process holds blocks "
                         f"{self.first}..{self.first + self.blocks - 1}")
    if self.blocks == 1:  # nothing to wait for
      *fields, stop = self.exchange(*rows)
      return tuple(fields) + (np.asarray(stop, bool).reshape(1),)
    with self.cond:
      mine = self.round
      self.arrived[k] = rows
      if len(self.arrived) == self.blocks:
        inputs = [np.concatenate([np.asarray(self.arrived[i][j]) for i in range(self.blocks)])
                  for j in range(len(rows))]
        self.arrived = {}
        try:
          self.answers[mine] = self.exchange(*inputs)
        except BaseException as e:  # every waiting block raises it too (no block is left waiting)
          self.answers[mine] = e
        self.answers.pop(mine - 1, None)
        self.round += 1
        self.cond.notify_all()
      elif not self.cond.wait_for(lambda: self.round > mine, timeout=self.timeout_s):
        raise RuntimeError(f"row block {k + self.first} waited {self.timeout_s:.0f} s for this process's other "
                           "blocks to reach the host exchange")
      answer = self.answers[mine]
    if isinstance(answer, BaseException):
      raise answer
    *fields, stop = answer
    cut = slice(k * self.rows, (k + 1) * self.rows)
    return tuple(np.asarray(x)[cut] for x in fields) + (np.asarray(stop, bool).reshape(1),)


class ScriptedActions(Actor):
  """Scripted actions (behavior-cloning demonstrations): episode e takes `scripts[e]` in order.

  The script puts probability 1 on its action: behavior log-prob 0. An episode whose script ends before it
  does is cancelled. `max_context` bounds each row's stream as the sampler's cache would.
  """

  def __init__(self, scripts: Sequence[Sequence[Sequence[int]]], max_context: int):
    self.scripts = [list(map(list, s)) for s in scripts]
    self.max_context = max_context
    self.width = max_context  # a prompt or frame is taken whole
    self.decode_s = self.extend_s = 0.0

  def width_for(self, longest):
    return max(longest, 1)

  def begin(self, slots, first_episode=0):
    self.length = [0] * slots
    self.prompt_length = [0] * slots
    self.episode = [-1] * slots
    self.turn = [0] * slots

  def feed(self, f):
    ok = np.ones(len(self.length), bool)
    for i in range(len(self.length)):
      if f.reset[i]:
        self.length[i], self.prompt_length[i], self.episode[i], self.turn[i] = 0, 0, int(f.episode[i]), 0
      n = int(f.lengths[i])
      if self.length[i] + n > self.max_context:
        ok[i] = False
        continue
      self.length[i] += n
      if f.prompt_done[i]:
        self.prompt_length[i] = self.length[i]
    for i in np.flatnonzero(f.fork >= 0):
      src = f.fork[i]
      if not ok[src] or not self.prompt_length[src]:  # the source's prompt did not fit: nothing to copy
        ok[i] = False
        continue
      self.length[i] = self.prompt_length[i] = self.prompt_length[src]
    return ok

  def decode(self, running, lockstep):
    out = {}
    for i in np.flatnonzero(running):
      script = self.scripts[self.episode[i]]
      if self.turn[i] >= len(script):
        out[int(i)] = None
        continue
      tokens = script[self.turn[i]]
      room = self.max_context - self.length[i]
      finish = Finish.STOP if len(tokens) <= room else Finish.CONTEXT_FULL
      tokens = tokens[:max(room, 0)]
      self.length[i] += len(tokens)
      self.turn[i] += 1
      out[int(i)] = RowAction(tokens, [0.0] * len(tokens), finish)
    return out
