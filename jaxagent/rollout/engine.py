"""Multi-turn rollout: a quota of episodes through a fixed set of decode slots, each paused while its env works.

The unit of scheduling is an episode that pauses between turns (docs/design.md §2.9). The engine owns `slots` rows of
the sampler and as many env-pool slots (slot i of one is slot i of the other). An episode goes through

    admitted (env reset, asynchronous) -> prompt fed (or copied from a resident row of the same prompt) ->
    decoding -> its action handed to the env (asynchronous) -> observation frame fed -> decoding -> ... -> done

and its slot takes the next episode of the quota. While one episode waits on its env, the device decodes the
others: a slow tool holds only its own episode. `schedule="lockstep"` keeps today's barrier instead (admit a
whole wave, every turn waits for every env of the wave) for comparison (`bench/rollout.py`).

Two transports drive the same scheduler (`_Scheduler`):
- `host_loop`: Python calls the jitted `Sampler.feed` and `Sampler.decode` (a chunk of `decode_chunk` steps)
  in turn and polls the env futures between calls;
- `callback`: one jitted program per rollout (`SampledActions.run_program`) loops decode chunk -> host
  exchange (`io_callback`: finished actions out, frames and new episodes in) -> feed, until the quota is done.
Sampling keys belong to episodes (`SamplerState.row_key`), so the same episode samples the same tokens under
either transport, either schedule and any slot count; only which episodes share a step changes.

The trajectory's token stream is built from exactly what the sampler produced and the frames the chat format
built (`jaxagent.chat`): the same frame object is appended to the cache and to the record, never re-encoded.
Scripted demonstrations (`ScriptedActions`) run through this same path, so their records have the layout of
sampled ones.
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures
import dataclasses
import enum
import statistics
import threading
import time
import uuid
from typing import Any, Callable, Sequence

import jax
import numpy as np

import envs
from jaxagent import multihost
from jaxagent import trajectory as tr
from jaxagent.chat import ChatFormat, Frame
from jaxagent.config import SCHEDULES, TRANSPORTS  # the enumerations, written once
from jaxagent.rollout.sampler import Feed, Finish, Sampler, bucket

# A step that rejected the action but let the episode go on: its reply is an error observation (Role.ERROR).
_ERROR_REPLIES = (envs.Outcome.PARSER_REJECTED_CONTINUED, envs.Outcome.INVALID_ACTION_CONTINUED)
_INVALID = (envs.Outcome.PARSER_REJECTED, envs.Outcome.INVALID_ACTION) + _ERROR_REPLIES

# The continuous schedule holds the device back while fewer than this fraction of the live episodes are ready
# (the others about to answer: see `_Scheduler._hold`). Measured with bench/rollout.py: holding until a
# majority (0.5) was ready gave 0.93x lockstep with zero env latency, three quarters 1.06x (3.5x lockstep with
# lognormal latency either way).
HOLD_READY_FRACTION = 0.75
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
    exchange: `_Scheduler.exchange` (this process's rows in, this process's next feed and `stop` out).
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


@dataclasses.dataclass(frozen=True)
class Branch:
  """An episode that continues `parent` from just before its action `turn` (a counterfactual for that step).

  The env is reset with the parent's task and seed and the parent's first `turn` actions are replayed on it
  (a deterministic env is then in the parent's state: `Env.state_key` says whether it is); the token stream
  starts as the parent's first tokens up to that action, fed as one prompt, carrying no loss. The branch is
  recorded with `metadata.branch = {parent, turn, group}` (its parent's id, the turn, the parent's group)."""
  task: envs.Task
  parent: tr.Trajectory
  turn: int

  def __post_init__(self):
    if not 0 <= self.turn < len(self.parent.turns):
      raise ValueError(f"branch at turn {self.turn}: the parent has turns 0..{len(self.parent.turns) - 1}")


class _State(enum.Enum):
  QUEUED = "queued"        # not admitted yet
  RESETTING = "resetting"  # its env's reset is running
  FEEDING = "feeding"      # tokens (prompt pieces, an observation frame) or a prompt copy wait for a feed
  DECODING = "decoding"    # the device is decoding its action
  STEPPING = "stepping"    # its env is running its action
  DONE = "done"


@dataclasses.dataclass
class _Episode:
  """Host-side state of one episode during a rollout."""

  index: int                    # in this process's quota
  task: envs.Task
  seed: int
  group_id: str
  state: _State = _State.QUEUED
  slot: int | None = None
  stream: tr.TokenStream | None = None
  prompt: tuple[int, ...] = ()
  first_text: str = ""          # the env's first observation (TaskRecord.prompt)
  pending: list[int] = dataclasses.field(default_factory=list)  # tokens still to feed
  fed_prompt: bool = False      # the prompt is in the cache
  frame: Frame | None = None    # the observation frame being fed
  future: concurrent.futures.Future | None = None
  action: tuple | None = None   # (span, text, tokens) of the action its env is running
  action_version: int = 0       # the policy version of that action's first token
  version: int = 0              # the policy version when it was admitted (the trajectory's)
  turns: list[tr.Turn] = dataclasses.field(default_factory=list)
  state_key: str | None = None  # the anchor state its next action is taken in (the last observation's)
  branch: Branch | None = None  # continues another trajectory (see `Branch`)
  routes: np.ndarray | None = None  # router replay: the experts its tokens used (`Actor.episode_routes`)
  termination: envs.Termination | None = None
  verifier: tr.VerifierRecord = tr.VerifierRecord()
  verify_s: float = 0.0
  components: dict[str, float] = dataclasses.field(default_factory=dict)
  provenance: dict[str, Any] = dataclasses.field(default_factory=dict)  # process / slot / env worker that ran it
  # Timing: seconds since the rollout began (admitted, ended), per-stage sums, and when the current stage began.
  admitted_s: float = 0.0
  ended_s: float = 0.0
  reset_s: float = 0.0
  decode_s: float = 0.0
  env_s: float = 0.0
  extend_s: float = 0.0
  since: float = 0.0
  answered: float = 0.0        # when its env's last reply arrived
  last_decode_s: float = 0.0    # the current action's decode time


@dataclasses.dataclass(frozen=True)
class RolloutStats:
  """Batch-level stage times of a rollout (seconds).

  Attributes:
    reset_s, env_s: env time summed over episodes (resets; steps): what the envs spent, not wall time.
    decode_s, extend_s: wall time in decode and feed calls (the device's work; a fused feed + decode call,
      and with the callback transport the program's time between host exchanges, count as decode).
    transfer_s: the weights' move to the rollout devices before the rollout (disaggregated placement).
    idle_s: wall time the engine spent waiting on envs with no device call running: every live episode
      waited on its env, or the continuous schedule held a few ready rows back for the many about to arrive
      (`HOLD_READY_FRACTION`), or (several processes) it polled for the others.
    wall_s: the rollout's wall time.
    env_steps, action_tokens: counts.
  """
  reset_s: float
  decode_s: float
  env_s: float
  extend_s: float
  env_steps: int
  action_tokens: int
  idle_s: float = 0.0
  wall_s: float = 0.0
  transfer_s: float = 0.0  # moving the weights to the rollout devices (mesh.placement=disaggregated)

  def __add__(self, other: "RolloutStats") -> "RolloutStats":
    return RolloutStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

  @property
  def device_idle_fraction(self) -> float:
    return self.idle_s / self.wall_s if self.wall_s > 0 else 0.0


class RolloutEngine:
  """Runs quotas of multi-turn episodes through the env pool's slots.

  Args:
    pool: env pool; its slots are the decode slots (one env instance per slot, reused by later episodes).
    env_spec: the environment's registry entry (name, version).
    chat: frames prompts and observations, ends and decodes actions.
    max_turns: hard bound on turns per episode.
    gamma: discount for the recorded return.
    invalid_action_rule: as configured on the pool (recorded on every trajectory).
    train_reasoning: a sampled action's reasoning span (`chat.reasoning_length`) carries loss.
    schedule: "continuous" (a slot takes the next episode as soon as its own ends; no turn barrier) or
      "lockstep" (waves of `slots` episodes, every turn waits for the whole wave).
    transport: "host_loop" or "callback" (see the module docstring); scripted actors always use host_loop.
  """

  def __init__(self, pool: envs.pool.Pool, env_spec: envs.EnvSpec, chat: ChatFormat, *, max_turns: int,
               gamma: float = 1.0, invalid_action_rule: str = "error_observation", train_reasoning: bool = True,
               schedule: str = "continuous", transport: str = "host_loop"):
    if invalid_action_rule not in envs.INVALID_ACTION_RULES:
      raise ValueError(f"invalid_action_rule={invalid_action_rule!r}: not one of {envs.INVALID_ACTION_RULES}")
    if schedule not in SCHEDULES:
      raise ValueError(f"schedule={schedule!r}: not one of {SCHEDULES}")
    if transport not in TRANSPORTS:
      raise ValueError(f"transport={transport!r}: not one of {TRANSPORTS}")
    self.pool = pool
    self.env_spec = env_spec
    self.chat = chat
    self.max_turns = max_turns
    self.gamma = gamma
    self.rule = invalid_action_rule
    self.schedule = schedule
    self.transport = transport
    self.reasoning = tr.Reasoning(kept=chat.has_reasoning, trained=chat.has_reasoning and train_reasoning)
    self.env_version = pool.version or env_spec.version
    self.env_times: collections.deque[float] = collections.deque(maxlen=256)  # recent env replies (seconds)
    self._replies = 0                            # env replies seen
    self._typical: tuple[int, float] = (0, 0.0)  # (replies seen, their median): `typical_env_s`'s memo

  def env_replied(self, seconds: float) -> None:
    """Records how long an env reply took (`typical_env_s`)."""
    self.env_times.append(seconds)
    self._replies += 1

  def typical_env_s(self) -> float:
    """The median time of the recent env replies (resets and steps); 0 before 8 have been seen. Recomputed
    only after new replies (the scheduler asks before every device call)."""
    if self._typical[0] != self._replies:
      self._typical = (self._replies, statistics.median(self.env_times) if len(self.env_times) >= 8 else 0.0)
    return self._typical[1]

  @property
  def slots(self) -> int:
    return len(self.pool.slots)

  def run(self, actor: Actor, tasks: Sequence[envs.Task], seeds: Sequence[int], *, group_size: int,
          policy_version: int, branches: Sequence[Branch] = ()) -> tuple[list[tr.Trajectory], RolloutStats]:
    """Rolls out `group_size` episodes of each task; episode `i` is task `i // group_size` with seed `seeds[i]`;
    then (in the same slots) the `branches`, each in the group of the branches of its parent and turn.

    Returns the trajectories in episode order (whatever order they finished in) and the stage times.
    """
    n = len(tasks) * group_size
    if len(seeds) != n:
      raise ValueError(f"{len(seeds)} seeds for {n} episodes")
    # One advantage group per task slot (its G samples), named by the task and the slot's first env seed: two
    # slots that drew the same question stay two groups, in every batch, round and topology.
    episodes = [_Episode(index=i, task=tasks[i // group_size], seed=int(seeds[i]),
                         group_id=f"{tasks[i // group_size].id}/{seeds[i - i % group_size]}") for i in range(n)]
    episodes += [_Episode(index=n + j, task=b.task, seed=b.parent.env.seed, branch=b,
                          group_id=f"{b.parent.group_id}/branch-{b.parent.id[:8]}-{b.turn}")
                 for j, b in enumerate(branches)]
    n = len(episodes)
    actor.begin(self.slots, first_episode=jax.process_index() * n)
    sched = _Scheduler(self, actor, episodes, policy_version)
    if self.transport == "callback" and isinstance(actor, SampledActions):
      actor.run_program(sched.exchange)
    else:
      sched.host_loop()
    trajectories = [self._trajectory(e, policy_version) for e in episodes]
    return trajectories, sched.stats()

  # Recording: the scheduler (below) records each episode through these two, the engine turns the records
  # into trajectories.

  def append_action(self, stream: tr.TokenStream, action: RowAction) -> tuple[int, int]:
    """Appends an action as sampled: its reasoning span (role REASONING) first, then the rest (POLICY)."""
    n = self.chat.reasoning_length(action.tokens)
    start = len(stream)
    tau, ver = action.thresholds, action.versions
    if n:
      stream.sampled(action.tokens[:n], action.logprobs[:n], role=tr.Role.REASONING, train=self.reasoning.trained,
                     thresholds=None if tau is None else tau[:n], versions=None if ver is None else ver[:n])
    stream.sampled(action.tokens[n:], action.logprobs[n:], thresholds=None if tau is None else tau[n:],
                   versions=None if ver is None else ver[n:])
    return start, len(stream)

  def record_step(self, ep: _Episode, result: envs.StepResult, span, text: str, tokens: Sequence[int],
                  policy_version: int, t_decode: float, t_env: float) -> None:
    for key, value in result.reward_components.items():
      ep.components[key] = ep.components.get(key, 0.0) + float(value) * self.gamma ** len(ep.turns)
    call = None if result.call is None else result.call.to_wire()
    obs = None
    if not result.done:
      role = tr.Role.ERROR if result.outcome in _ERROR_REPLIES else tr.Role.TOOL
      ep.frame = self.chat.observation(result.observation.text, role, after=tokens)
      start = len(ep.stream)
      obs = tr.ObservationRecord(span=(start + ep.frame.body[0], start + ep.frame.body[1]),
                                 text=result.observation.text,
                                 truncated=result.observation.truncated or ep.frame.truncated,
                                 original_bytes=result.observation.original_size)
    ep.turns.append(tr.Turn(action=tr.Action(span=span, text=text, valid=result.outcome not in _INVALID,
                                             parsed=call),
                            observation=obs, reward=result.reward, reward_components=dict(result.reward_components),
                            policy_version=policy_version, t_decode_s=t_decode, t_env_s=t_env,
                            outcome=result.outcome.value, state_key=ep.state_key))
    ep.state_key = result.observation.state_key
    if result.verdict is not None:
      v = result.verdict
      ep.verifier = tr.VerifierRecord(name=self.env_spec.name, version=str(v.version), passed=bool(v.passed),
                                      evidence=dict(v.evidence))
      ep.verify_s = float(v.seconds)
    if result.done:
      ep.termination = envs.Termination(result.termination)

  def _trajectory(self, ep: _Episode, policy_version: int) -> tr.Trajectory:
    total = sum(t.reward * self.gamma ** k for k, t in enumerate(ep.turns))
    return tr.Trajectory(
        task=tr.TaskRecord(id=ep.task.id, split=ep.task.split, version=ep.task.version, prompt=ep.first_text),
        env=tr.EnvInfo(name=self.env_spec.name, version=self.env_version, seed=ep.seed,
                       network="none" if self.pool.sandboxed else "host",  # cut only inside a sandbox
                       invalid_action_rule=self.rule),
        policy_version=policy_version, termination=ep.termination,
        reward=tr.Reward(total=float(total), gamma=self.gamma, components=dict(ep.components)),
        turns=tuple(ep.turns), id=uuid.uuid4().hex, group_id=ep.group_id,
        timing=tr.Timing(reset_s=ep.reset_s, verify_s=ep.verify_s, decode_s=ep.decode_s, env_s=ep.env_s,
                         extend_s=ep.extend_s, admitted_s=ep.admitted_s, ended_s=ep.ended_s),
        verifier=ep.verifier, reasoning=self.reasoning, metadata=ep.provenance, expert_routes=ep.routes,
        **ep.stream.arrays())


class _Scheduler:
  """One rollout's episodes, slots and env futures; both transports drive it (see the module docstring)."""

  def __init__(self, engine: RolloutEngine, actor: Actor, episodes: list[_Episode], policy_version: int):
    self.engine, self.actor, self.episodes = engine, actor, episodes
    self.pool, self.chat = engine.pool, engine.chat
    self.lockstep = engine.schedule == "lockstep"
    self.policy_version = policy_version
    self.queue = list(episodes)
    self.queue.reverse()  # pop() takes the next episode in order
    self.slot_episode: list[_Episode | None] = [None] * engine.slots
    self.resident: dict[tuple[int, ...], int] = {}      # prompt -> a slot whose cache holds it (fork source)
    self.prefilling: dict[tuple[int, ...], _Episode] = {}  # prompt -> the episode feeding it now
    self.live = 0  # admitted, not done
    self.remaining = len(episodes)
    self.env_steps = self.action_tokens = 0
    self.idle_s = 0.0
    self.start = time.perf_counter()
    self.pids = self.pool.worker_pids()
    self.last_feed: list[tuple[_Episode, str, int]] | None = None
    self.device_mark: float | None = None  # callback transport: when the program last left the host
    self.on_done: Callable[[_Episode], None] | None = None  # a stream's: called as each episode ends

  def add(self, episodes: Sequence[_Episode]) -> None:
    """More episodes for the queue, after those already in it (a `RolloutStream`'s submissions)."""
    self.episodes += episodes
    self.queue[:0] = reversed(episodes)
    self.remaining += len(episodes)

  # -- bookkeeping

  def now(self) -> float:
    return time.perf_counter() - self.start

  def _end(self, ep: _Episode, termination: envs.Termination | None = None) -> None:
    if termination is not None:
      ep.termination = termination
    ep.state, ep.ended_s = _State.DONE, self.now()
    if ep.slot is not None and ep.stream is not None:
      ep.routes = self.actor.episode_routes(ep.slot, ep.stream.tokens(0, len(ep.stream)))
    if ep.slot is not None:
      self.slot_episode[ep.slot] = None
      if self.resident.get(ep.prompt) == ep.slot:  # another live row holding the prompt serves forks now
        del self.resident[ep.prompt]
        for other in self.slot_episode:
          if other is not None and other.fed_prompt and other.prompt == ep.prompt:
            self.resident[ep.prompt] = other.slot
            break
    if self.prefilling.get(ep.prompt) is ep:
      del self.prefilling[ep.prompt]
    ep.frame = ep.future = ep.action = None
    self.live -= 1
    self.remaining -= 1
    if self.on_done is not None:
      self.on_done(ep)

  def _admit(self) -> None:
    """Free slots take the next episodes (lockstep: only when the whole previous wave is done)."""
    if self.lockstep and self.live:
      return
    for slot, held in enumerate(self.slot_episode):
      if held is not None or not self.queue:
        continue
      ep = self.queue.pop()
      worker = self.pool.slots[slot].worker
      ep.slot, ep.state, ep.admitted_s, ep.since = slot, _State.RESETTING, self.now(), time.perf_counter()
      ep.version = self.policy_version
      ep.provenance = {"process": jax.process_index(), "slot": slot, "env_worker": worker,
                       "env_worker_pid": self.pids[worker]}
      self.slot_episode[slot] = ep
      self.live += 1
      if ep.branch is None:
        ep.future = self._answered(ep, self.pool.reset_async(slot, ep.task, ep.seed))
      else:
        ep.future = self._answered(ep, self._replay_executor().submit(self._replay, slot, ep.task, ep.seed,
                                                                       ep.branch))

  @staticmethod
  def _answered(ep: _Episode, future: concurrent.futures.Future) -> concurrent.futures.Future:
    """Stamps when the env answered (not when the loop got to it): env times exclude waiting to be collected."""
    future.add_done_callback(lambda _: setattr(ep, "answered", time.perf_counter()))
    return future

  def _collect(self) -> None:
    """Takes every finished env future (resets and steps)."""
    barrier = self.lockstep and any(e.future is not None and not e.future.done()
                                    for e in self.slot_episode if e is not None)
    if barrier:  # lockstep: nothing moves on until the whole wave's envs have answered
      return
    for ep in list(self.slot_episode):
      if ep is None or ep.future is None or not ep.future.done():
        continue
      result, ep.future = ep.future.result(), None
      if ep.answered < ep.since:  # done, but its done-callback has not run yet
        ep.answered = time.perf_counter()
      if ep.state == _State.RESETTING:
        self._on_reset(ep, result)
      else:
        self._on_step(ep, result)

  def _replay_executor(self) -> concurrent.futures.ThreadPoolExecutor:
    if getattr(self, "_replayer", None) is None:
      self._replayer = concurrent.futures.ThreadPoolExecutor(max(1, len(self.slot_episode)),
                                                             thread_name_prefix="branch-replay")
    return self._replayer

  def _replay(self, slot: int, task: envs.Task, seed: int, branch: Branch):
    """A branch's reset: the env reset, then the parent's first `branch.turn` actions replayed. Returns the last
    observation (its state key that of the replayed state), or the exception that ended the episode, or a
    `StepResult` when a replayed step ended it (the env did not do what it did for the parent)."""
    try:
      obs = self.pool.reset(slot, task, seed)
    except Exception as e:  # as reset_async: the fault ends the episode
      return e
    for turn in branch.parent.turns[:branch.turn]:
      result = self.pool.step(slot, turn.action.text)
      if result.done:
        return result
      obs = result.observation
    return obs

  def _on_reset(self, ep: _Episode, obs) -> None:
    ep.reset_s = ep.answered - ep.since
    self.engine.env_replied(ep.reset_s)
    if isinstance(obs, Exception):
      # The env never produced a first observation: the episode ends before any turn, recorded with the fault
      # (no action token, so no loss, no advantage-group member).
      ep.stream = self.chat.prompt("")
      ep.provenance["reset_error"] = str(obs)
      self._end(ep, envs.Termination(self.pool.slots[ep.slot].termination))
      return
    if ep.branch is not None:
      b = ep.branch
      ep.provenance["branch"] = {"parent": b.parent.id, "turn": b.turn, "group": b.parent.group_id}
      if isinstance(obs, envs.StepResult):  # the replay ended early: the env is not the parent's
        ep.stream = self.chat.prompt("")
        ep.provenance["branch"]["diverged"] = True
        self._end(ep, envs.Termination.ENV_ERROR)
        return
      expected = b.parent.turns[b.turn].state_key
      ep.provenance["branch"]["diverged"] = expected is not None and obs.state_key != expected
      # The parent's tokens up to the branch's first action (the chat's assistant header included), no loss.
      ep.stream = tr.TokenStream.prefix_of(b.parent, b.parent.turns[b.turn].action.span[0])
      ep.first_text = b.parent.task.prompt
      ep.turns = list(b.parent.turns[:b.turn])
      for k, turn in enumerate(ep.turns):
        for key, value in turn.reward_components.items():
          ep.components[key] = ep.components.get(key, 0.0) + float(value) * self.engine.gamma ** k
    else:
      ep.stream, ep.first_text = self.chat.prompt(obs.text), obs.text
    ep.state_key = obs.state_key
    ep.prompt = tuple(ep.stream.tokens(0, len(ep.stream)))
    ep.state, ep.since = _State.FEEDING, ep.answered
    if ep.prompt not in self.resident and ep.prompt not in self.prefilling:
      self.prefilling[ep.prompt] = ep
      ep.pending = list(ep.prompt)

  def _on_step(self, ep: _Episode, result: envs.StepResult) -> None:
    span, text, tokens = ep.action
    t_env = ep.answered - ep.since
    self.engine.env_replied(t_env)
    ep.env_s += t_env
    self.env_steps += 1
    self.engine.record_step(ep, result, span, text, tokens, ep.action_version, ep.last_decode_s, t_env)
    ep.action = None
    if ep.termination is not None:
      self._end(ep)
      return
    if len(ep.turns) >= self.engine.max_turns:  # only reachable if the env allows more turns than our bound
      ep.turns[-1] = dataclasses.replace(ep.turns[-1], observation=None)
      self._end(ep, envs.Termination.MAX_TURNS)
      return
    ep.state, ep.since = _State.FEEDING, ep.answered
    ep.pending = list(ep.frame.tokens)

  # -- planning a feed

  def _plan(self) -> tuple[Feed | None, list[tuple[_Episode, str, int]]]:
    """The next feed: prompt pieces, frames, prompt copies and action starts. Lockstep holds back until every
    episode of the wave is ready to be fed (the turn barrier)."""
    feeding = [e for e in self.slot_episode if e is not None and e.state == _State.FEEDING]
    if not feeding or (self.lockstep and any(e.state in (_State.RESETTING, _State.STEPPING)
                                             for e in self.slot_episode if e is not None)):
      return None, []
    for ep in feeding:  # waiting to copy a prompt that no row holds or feeds any more: feed it itself, now
      # (its prefiller ended, e.g. a one-turn episode finished in the same collect that admitted this one;
      # deciding this after the feed is built would leave a call with nothing to feed: a stall).
      if not (ep.pending or ep.fed_prompt) and ep.prompt not in self.resident and ep.prompt not in self.prefilling:
        self.prefilling[ep.prompt] = ep
        ep.pending = list(ep.prompt)
    width = self.actor.width_for(max((min(len(e.pending), self.actor.width) for e in feeding), default=1))
    f = Feed.empty(self.engine.slots, width, self.chat.tokenizer.pad_id)
    plan = []
    completes = {}  # prompt -> slot of the episode that completes it in this call
    for ep in feeding:
      if ep.pending:
        piece = ep.pending[:width]
        f.tokens[ep.slot, :len(piece)] = piece
        f.lengths[ep.slot] = len(piece)
        last = len(piece) == len(ep.pending)
        if not ep.fed_prompt:
          first = len(ep.pending) == len(ep.prompt)
          f.reset[ep.slot] = first
          f.episode[ep.slot] = ep.index
          f.prompt_done[ep.slot] = last
          if last:
            completes[ep.prompt] = ep.slot
        f.start[ep.slot] = last
        plan.append((ep, "prompt" if not ep.fed_prompt else "frame", len(piece)))
    for ep in feeding:
      if ep.pending or ep.fed_prompt:
        continue
      src = self.resident.get(ep.prompt, completes.get(ep.prompt))
      if src is None:  # another row is still feeding the prompt: copy it once that row has it
        continue
      f.reset[ep.slot] = True
      f.episode[ep.slot] = ep.index
      f.fork[ep.slot] = src
      f.start[ep.slot] = True
      plan.append((ep, "fork", 0))
    return (f if plan else None), plan

  def _after_feed(self, plan, ok: np.ndarray, fed: float) -> None:
    """`fed`: when the feed call began (a row it starts decodes from then on, in the same device call when
    fused)."""
    now = fed
    for ep, kind, n in plan:
      if ep.state != _State.FEEDING:
        continue
      if not ok[ep.slot]:
        if kind == "frame":  # the observation never reached the policy: it is not part of the trajectory
          ep.turns[-1] = dataclasses.replace(ep.turns[-1], observation=None)
        else:  # the prompt does not fit: nothing of it is the policy's context
          ep.provenance["prompt_tokens"] = len(ep.prompt)
          ep.stream = self.chat.prompt("")
        self._end(ep, envs.Termination.CONTEXT_EXHAUSTED)
        continue
      del ep.pending[:n]
      if ep.pending:
        continue
      if kind == "frame":
        ep.stream.extend(ep.frame.stream)
        ep.frame = None
      else:
        ep.fed_prompt = True
        self.resident[ep.prompt] = ep.slot
        if self.prefilling.get(ep.prompt) is ep:
          del self.prefilling[ep.prompt]
      ep.extend_s += now - ep.since
      ep.state, ep.since = _State.DECODING, now

  # -- decoding

  def _after_decode(self, actions: dict[int, RowAction | None]) -> None:
    now = time.perf_counter()
    for slot, action in actions.items():
      ep = self.slot_episode[slot]
      t_decode = now - ep.since
      ep.decode_s += t_decode
      ep.last_decode_s = t_decode
      if action is None:  # a script ran out before its episode ended
        self._end(ep, envs.Termination.CANCELLED)
        continue
      span = self.engine.append_action(ep.stream, action)
      self.action_tokens += len(action.tokens)
      text = self.chat.action_text(action.tokens)
      ep.action_version = action.versions[0] if action.versions else self.policy_version
      if action.finish == Finish.STOP:
        ep.action = (span, text, action.tokens)
        ep.state, ep.since = _State.STEPPING, now
        ep.future = self._answered(ep, self.pool.step_async(slot, text))
        continue
      termination = (envs.Termination.TURN_BUDGET_EXHAUSTED if action.finish == Finish.BUDGET
                     else envs.Termination.CONTEXT_EXHAUSTED)
      # The cut action never reached the env: its outcome is the termination (not "ok").
      ep.turns.append(tr.Turn(action=tr.Action(span=span, text=text, valid=False), policy_version=ep.action_version,
                              t_decode_s=t_decode, outcome=termination.value, state_key=ep.state_key))
      self._end(ep, termination)

  def _running(self) -> np.ndarray:
    return np.asarray([e is not None and e.state == _State.DECODING for e in self.slot_episode], bool)

  def _wait(self, timeout: float) -> None:
    """Blocks until some env future of this process completes (or `timeout`)."""
    inflight = [e.future for e in self.slot_episode if e is not None and e.future is not None]
    futures = [f for f in inflight if not f.done()]
    t0 = time.perf_counter()
    # An env answered since the last look (waiting on the others would strand it; lockstep holds answers back
    # on purpose until its wave is complete), or a slot was just freed for the next episode: go on.
    answered = len(futures) < len(inflight) and (not self.lockstep or not futures)
    admittable = bool(self.queue) and None in self.slot_episode and not (self.lockstep and self.live)
    if answered or admittable:
      return
    if futures:
      concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
    elif timeout is None:  # nothing in flight, nothing to feed or decode: no event can ever come
      states = [(e.index, e.state.value, len(e.pending)) for e in self.slot_episode if e is not None]
      raise RuntimeError(f"rollout stalled with {self.remaining} episodes left: (episode, state, pending) {states}")
    else:
      time.sleep(timeout)
    self.idle_s += time.perf_counter() - t0

  # -- transports

  def _decodable(self) -> bool:
    """Some row can decode (lockstep: and no row of the wave still waits for a feed)."""
    live = [e for e in self.slot_episode if e is not None]
    if self.lockstep and any(e.state == _State.FEEDING for e in live):
      return False
    return any(e.state == _State.DECODING for e in live)

  def _hold(self) -> float | None:
    """Continuous schedule: how long to hold the device back for env replies that are about to arrive (None:
    go on). While fewer than `HOLD_READY_FRACTION` of the live rows are ready to feed or decode and the rest
    wait on envs that usually answer within the typical step time tau (the median env time seen so far), a
    feed or decode chunk now would run mostly empty and the rows arriving during it would wait for its end:
    wait up to tau for them instead. Rows waiting longer than tau (heavy-tailed stragglers) hold no one."""
    tau = self.engine.typical_env_s()
    if self.lockstep or not tau:
      return None
    now = time.perf_counter()
    live = [e for e in self.slot_episode if e is not None]
    ready = sum(e.state in (_State.FEEDING, _State.DECODING) for e in live)
    soon = [now - e.since for e in live if e.state in (_State.RESETTING, _State.STEPPING) and now - e.since < tau]
    if not ready or ready >= HOLD_READY_FRACTION * (ready + len(soon)):
      return None
    return tau - max(soon)

  def _poll(self):
    """Admits episodes into free slots and takes the envs' answers (waiting while `_hold` says so); returns
    the next feed and its plan (`_plan`)."""
    while True:
      self._admit()
      self._collect()
      hold = self._hold()
      if hold is None:
        return self._plan()
      self._wait(hold)

  def host_loop(self, until: Callable[[], bool] | None = None, poll_s: float = 0.002) -> None:
    """Drives the rollout until every episode is done, or (a stream) until `until()` holds: then an idle
    engine waits in steps of `poll_s` for an env or for `until`, never for ever."""
    agree = (lambda flags: flags) if jax.process_count() == 1 else multihost.host_max
    while True:
      if until is not None and until():
        break
      f, plan = self._poll()
      # Feed and decode are collective: every process calls them together, with or without rows of its own.
      has_feed, live = agree(np.asarray([f is not None, self.remaining > 0], np.int32))
      if not live:
        break
      if has_feed:
        if f is None:
          f = Feed.empty(self.engine.slots, self.actor.width_for(1), self.chat.tokenizer.pad_id)
        # Rows this feed starts decode in the same device call, except in lockstep while some row of the wave
        # still has prompt pieces to come (the whole wave starts together).
        fed = {id(e): n for e, _, n in plan}
        rest = self.lockstep and any(e is not None and e.state == _State.FEEDING
                                     and (id(e) not in fed or len(e.pending) > fed[id(e)])
                                     for e in self.slot_episode)
        fed = time.perf_counter()
        if not agree(np.asarray([rest], np.int32))[0]:
          ok, actions = self.actor.feed_decode(f, self.lockstep)
          self._after_feed(plan, ok, fed)
          self._after_decode(actions(self._running()))
          continue
        ok = self.actor.feed(f)
        self._after_feed(plan, ok, time.perf_counter())
      if agree(np.asarray([self._decodable()], np.int32))[0]:
        self._after_decode(self.actor.decode(self._running() if self._decodable() else
                                             np.zeros(self.engine.slots, bool), self.lockstep))
      elif not has_feed:
        # Nothing for the device anywhere: wait for an env. Alone, until one answers; with other processes,
        # briefly, then agree again (another process's env may have answered); a stream, briefly, then asks
        # `until` again (the learner may have finished).
        self._wait(poll_s if until is not None else None if jax.process_count() == 1 else 0.005)

  def exchange(self, finish, n, tokens, logprobs, thresholds, ok):
    """The callback transport's host side: takes the program's finished actions and last feed's result,
    returns the next feed (numpy arrays, all rows) and whether the rollout is complete."""
    entered = time.perf_counter()
    if self.device_mark is not None:
      self.actor.decode_s += entered - self.device_mark
    ok = np.asarray(ok)
    if self.last_feed:  # fed (and decoding from) when the program resumed after the last exchange
      self._after_feed(self.last_feed, ok, self.device_mark)
    self._after_decode(finished_actions(self._running(), finish, n, tokens, logprobs, thresholds))
    while True:
      f, plan = self._poll()
      if f is not None or self._running().any() or self.remaining == 0:
        break
      if jax.process_count() > 1:
        # Other processes' rows may have work: waiting here for an env would hold the whole program (and
        # them) at this exchange. Wait briefly, then let the program run a round with nothing of ours in it.
        self._wait(0.005)
        f, plan = self._poll()
        break
      self._wait(None)
    self.last_feed = plan
    if f is None:
      f = Feed.empty(self.engine.slots, self.actor.width, self.chat.tokenizer.pad_id)
    elif f.tokens.shape[1] != self.actor.width:  # the program's feed has one width
      tokens = np.full((self.engine.slots, self.actor.width), self.chat.tokenizer.pad_id, np.int32)
      tokens[:, :f.tokens.shape[1]] = f.tokens
      f = f.replace(tokens=tokens)
    f = self.actor.global_ids(f)
    self.device_mark = time.perf_counter()
    return (f.tokens, f.lengths, f.reset, f.episode, f.prompt_done, f.fork, f.start,
            np.asarray(self.remaining == 0))

  def stats(self) -> RolloutStats:
    eps = self.episodes
    return RolloutStats(reset_s=sum(e.reset_s for e in eps), decode_s=self.actor.decode_s,
                        env_s=sum(e.env_s for e in eps), extend_s=self.actor.extend_s, env_steps=self.env_steps,
                        action_tokens=self.action_tokens, idle_s=self.idle_s,
                        wall_s=time.perf_counter() - self.start)


class RolloutStream:
  """Episodes without a batch barrier (`train.freshness` one_step_off / async): groups are submitted as
  capacity allows, run through the engine's slots as one endless rollout, and come out as they complete;
  the policy can change between two device calls while episodes are in flight (`set_params`).

      stream = RolloutStream(engine, SampledActions(...), group_size=G)
      stream.submit(slot_id, task, seeds)       # G episodes; episode k's sampling key is fold_in(rng, id*G + k)
      stream.run(until=lambda: len(stream.complete) >= B)   # drives the engine until then (or nothing is live)
      slot_id, trajectories = stream.complete.popleft()

  Every token records the version that sampled it (`Trajectory.behavior_versions`): the actor's version
  when its logits were computed. A trajectory's `policy_version` is the version when it was admitted.
  Single process (the engine's collectives would need every process to agree on `until`).
  """

  def __init__(self, engine: RolloutEngine, actor: SampledActions, *, group_size: int):
    if jax.process_count() > 1:
      raise ValueError("a rollout stream runs in one process for now")
    if engine.schedule != "continuous" or engine.transport != "host_loop":
      raise ValueError("a rollout stream needs rollout.schedule=continuous and rollout.env_transport=host_loop")
    self.engine, self.actor, self.group_size = engine, actor, group_size
    actor.begin(engine.slots, first_episode=0)
    self.sched = _Scheduler(engine, actor, [], actor.version)
    self.sched.on_done = self._done
    self.pending: dict[int, list[_Episode]] = {}     # slot id -> its episodes (some still running)
    self.complete: collections.deque[tuple[int, list[tr.Trajectory]]] = collections.deque()
    self._ended: list[_Episode] = []                  # since the last `stats`
    self._mark = self._counters()

  def submit(self, slot_id: int, task: envs.Task, seeds: Sequence[int]) -> None:
    if slot_id in self.pending:
      raise ValueError(f"slot {slot_id} is already in the stream")
    if len(seeds) != self.group_size:
      raise ValueError(f"{len(seeds)} seeds for a group of {self.group_size}")
    g = self.group_size
    eps = [_Episode(index=slot_id * g + k, task=task, seed=int(seeds[k]), group_id=f"{task.id}/{seeds[0]}")
           for k in range(g)]
    self.pending[slot_id] = eps
    self.sched.add(eps)

  def _done(self, ep: _Episode) -> None:
    self._ended.append(ep)
    slot = ep.index // self.group_size
    group = self.pending.get(slot)
    if group is not None and all(e.state == _State.DONE for e in group):
      del self.pending[slot]
      trajs = [self.engine._trajectory(e, e.version) for e in group]
      self.complete.append((slot, [dataclasses.replace(t, metadata={**t.metadata, "slot": slot,
                                                                     "completed_version": self.actor.version})
                                   for t in trajs]))

  @property
  def live(self) -> int:
    """Episodes submitted and not ended (queued or running)."""
    return self.sched.remaining

  def run(self, until: Callable[[], bool], poll_s: float = 0.002) -> None:
    """Drives the engine until `until()` holds or no episode is left to run."""
    self.sched.host_loop(until=until, poll_s=poll_s)
    self.sched.episodes = [e for e in self.sched.episodes if e.state != _State.DONE]

  def drain(self) -> None:
    """Runs the episodes already admitted to a slot to their end; the queued ones wait (not admitted)."""
    sched = self.sched
    held, sched.queue = sched.queue, []
    sched.remaining -= len(held)
    try:
      self.run(until=lambda: sched.remaining == 0)
    finally:
      sched.queue = held + sched.queue
      sched.remaining += len(held)

  def set_params(self, params, version: int, *, refill: bool = False) -> dict[str, float]:
    """The policy from now on (`SampledActions.set_params`); new admissions record `version`."""
    self.sched.policy_version = int(version)
    return self.actor.set_params(params, version, refill=refill)

  def _counters(self) -> tuple[float, ...]:
    s = self.sched
    return (self.actor.decode_s, self.actor.extend_s, s.idle_s, float(s.env_steps), float(s.action_tokens),
            time.perf_counter())

  def stats(self) -> RolloutStats:
    """The stage times since the last call (env times of the episodes that ended since)."""
    now = self._counters()
    d = [a - b for a, b in zip(now, self._mark)]
    self._mark = now
    ended, self._ended = self._ended, []
    return RolloutStats(reset_s=sum(e.reset_s for e in ended), decode_s=d[0], env_s=sum(e.env_s for e in ended),
                        extend_s=d[1], env_steps=int(d[3]), action_tokens=int(d[4]), idle_s=d[2], wall_s=d[5])
