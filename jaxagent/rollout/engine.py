"""Multi-turn rollout: B tasks x G samples over <= T turns with an action source and an env pool.

One host loop per turn: ask the action source for every active row's action (the policy through the jitted
sampler, or a scripted demonstration), step all their envs concurrently (`envs.Pool.step_many`), hand the
observation frames back to the source (`Sampler.extend` appends them to the KV cache) and continue.

The trajectory's token stream is built from exactly what the source produced and the frames the chat format
built (`jaxagent.chat`): the same frame object is appended to the cache and to the record, never re-encoded.
Scripted demonstrations run through this same path, so their records have the layout of sampled ones.
"""

from __future__ import annotations

import abc
import dataclasses
import time
import uuid
from typing import Any, Sequence

import jax
import numpy as np

import envs
from jaxagent import multihost
from jaxagent import trajectory as tr
from jaxagent.chat import ChatFormat, Frame
from jaxagent.rollout.sampler import Finish, Sampler

# A step that rejected the action but let the episode go on: its reply is an error observation (Role.ERROR).
_ERROR_REPLIES = (envs.Outcome.PARSER_REJECTED_CONTINUED, envs.Outcome.INVALID_ACTION_CONTINUED)
_INVALID = (envs.Outcome.PARSER_REJECTED, envs.Outcome.INVALID_ACTION) + _ERROR_REPLIES


@dataclasses.dataclass(frozen=True)
class RowAction:
  """One row's action in a turn: its tokens, their behavior log-probs and why it ended."""
  tokens: list[int]
  logprobs: list[float]
  finish: Finish


class ActionSource(abc.ABC):
  """Where a rollout's actions come from. Rows are this process's rows, in order."""

  decode_s: float = 0.0   # time spent producing actions and taking observations (device time for a policy)
  extend_s: float = 0.0

  @abc.abstractmethod
  def start(self, prompts: Sequence[Sequence[int]], group_size: int) -> None:
    """Begins an episode per row with its prompt tokens (rows of one task are contiguous)."""

  @abc.abstractmethod
  def act(self, active: np.ndarray) -> dict[int, RowAction | None]:
    """The next action of every active row (None: the source has no more actions for that row)."""

  @abc.abstractmethod
  def observe(self, frames: Sequence[Sequence[int]]) -> bool:
    """Appends one frame per row (empty: none). False when the context cannot hold them (nothing appended)."""


class SampledActions(ActionSource):
  """The policy's actions: prefill, then per turn one jitted decode and one jitted extend.

  Args:
    sampler: the compiled sampler (its `max_new_tokens` is the per-turn budget).
    params: the policy's parameters in the rollout layout.
    rng: the rollout's key (the sampler folds it per turn).
  """

  def __init__(self, sampler: Sampler, params, rng: jax.Array):
    self.sampler, self.params, self.rng = sampler, params, rng
    self.state = None

  def start(self, prompts, group_size):
    n = len(prompts)
    # Prefix reuse (each distinct prompt prefilled once) only if every process can: prefill's row count is part
    # of the global shape.
    same = all(prompts[i] == prompts[i - i % group_size] for i in range(n))
    t0 = time.perf_counter()
    if group_size > 1 and not multihost.any_process(not same):
      self.state = self.sampler.repeat(self.sampler.prefill(self.params, prompts[::group_size], self.rng),
                                       group_size)
    else:
      self.state = self.sampler.prefill(self.params, prompts, self.rng)
    self.extend_s += time.perf_counter() - t0

  def act(self, active):
    t0 = time.perf_counter()
    self.state, out = self.sampler.generate(self.params, self.state, active)
    out = self.sampler.to_host(out.replace(raw_logprobs=None))  # the record needs no untempered log-probs
    self.decode_s += time.perf_counter() - t0
    return {int(i): RowAction(out.tokens[i, :out.lengths[i]].tolist(), out.logprobs[i, :out.lengths[i]].tolist(),
                              Finish(int(out.finish[i]))) for i in np.flatnonzero(active)}

  def observe(self, frames):
    t0 = time.perf_counter()
    self.state, ok = self.sampler.extend(self.params, self.state, frames)
    ok = bool(np.asarray(ok.addressable_data(0)))  # replicated scalar: every process has it
    self.extend_s += time.perf_counter() - t0
    return ok


class ScriptedActions(ActionSource):
  """Scripted actions (behavior-cloning demonstrations): row i takes `scripts[i]` in order.

  The script puts probability 1 on its action: behavior log-prob 0. A row whose script ends before its episode
  does is cancelled. `max_context` bounds the stream as the sampler's cache would.
  """

  def __init__(self, scripts: Sequence[Sequence[Sequence[int]]], max_context: int):
    self.scripts = [list(map(list, s)) for s in scripts]
    self.max_context = max_context
    self.lengths: list[int] = []

  def start(self, prompts, group_size):
    if len(prompts) != len(self.scripts):
      raise ValueError(f"{len(self.scripts)} scripts for {len(prompts)} rows")
    self.lengths = [len(p) for p in prompts]
    self.turn = 0

  def act(self, active):
    out = {}
    for i in np.flatnonzero(active):
      script = self.scripts[i]
      if self.turn >= len(script):
        out[int(i)] = None
        continue
      tokens = script[self.turn]
      room = self.max_context - self.lengths[i]
      finish = Finish.STOP if len(tokens) <= room else Finish.CONTEXT_FULL
      tokens = tokens[:max(room, 0)]
      self.lengths[i] += len(tokens)
      out[int(i)] = RowAction(tokens, [0.0] * len(tokens), finish)
    self.turn += 1
    return out

  def observe(self, frames):
    if any(n + len(f) > self.max_context for n, f in zip(self.lengths, frames) if f):
      return False
    self.lengths = [n + len(f) for n, f in zip(self.lengths, frames)]
    return True


@dataclasses.dataclass
class _Row:
  """Host-side state of one trajectory during a rollout."""

  task: envs.Task
  seed: int
  stream: tr.TokenStream
  turns: list[tr.Turn] = dataclasses.field(default_factory=list)
  done: bool = False
  termination: envs.Termination | None = None
  verifier: tr.VerifierRecord = tr.VerifierRecord()
  verify_s: float = 0.0
  components: dict[str, float] = dataclasses.field(default_factory=dict)
  frame: Frame | None = None  # the observation frame waiting to be appended
  provenance: dict[str, Any] = dataclasses.field(default_factory=dict)  # process / env worker that ran it


@dataclasses.dataclass(frozen=True)
class RolloutStats:
  reset_s: float
  decode_s: float
  env_s: float
  extend_s: float
  env_steps: int
  action_tokens: int

  def __add__(self, other: "RolloutStats") -> "RolloutStats":
    return RolloutStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


class RolloutEngine:
  """Runs groups of multi-turn episodes.

  Args:
    pool: env pool with at least as many slots as rows.
    env_spec: the environment's registry entry (name, version).
    chat: frames prompts and observations, ends and decodes actions.
    max_turns: hard bound on turns per episode.
    gamma: discount for the recorded return.
    invalid_action_rule: as configured on the pool (recorded on every trajectory).
    train_reasoning: a sampled action's reasoning span (`chat.reasoning_length`) carries loss.
  """

  def __init__(self, pool: envs.pool.Pool, env_spec: envs.EnvSpec, chat: ChatFormat, *, max_turns: int,
               gamma: float = 1.0, invalid_action_rule: str = "error_observation", train_reasoning: bool = True):
    if invalid_action_rule not in envs.INVALID_ACTION_RULES:
      raise ValueError(f"invalid_action_rule={invalid_action_rule!r}: not one of {envs.INVALID_ACTION_RULES}")
    self.pool = pool
    self.env_spec = env_spec
    self.chat = chat
    self.max_turns = max_turns
    self.gamma = gamma
    self.rule = invalid_action_rule
    self.reasoning = tr.Reasoning(kept=chat.has_reasoning, trained=chat.has_reasoning and train_reasoning)
    self.env_version = pool.version or env_spec.version

  def run(self, source: ActionSource, tasks: Sequence[envs.Task], seeds: Sequence[int], *, group_size: int,
          policy_version: int) -> tuple[list[tr.Trajectory], RolloutStats]:
    """Rolls out `group_size` episodes of each task; row `i` is task `i // group_size` with seed `seeds[i]`."""
    n = len(tasks) * group_size
    if len(seeds) != n:
      raise ValueError(f"{len(seeds)} seeds for {n} episodes")
    row_tasks = [t for t in tasks for _ in range(group_size)]
    start = time.perf_counter()
    first = self.pool.reset_many(list(range(n)), row_tasks, list(seeds), return_exceptions=True)
    reset_s = time.perf_counter() - start
    rows = []
    pids = self.pool.worker_pids()
    for slot, (task, seed, obs) in enumerate(zip(row_tasks, seeds, first)):
      worker = self.pool.slots[slot].worker
      provenance = {"process": jax.process_index(), "env_worker": worker, "env_worker_pid": pids[worker]}
      if isinstance(obs, Exception):
        # The env never produced a first observation: the episode ends before any turn, recorded with the
        # fault (no action token, so no loss, no advantage-group member). Its row still takes its slot in the
        # batch (static shapes), holding an empty prompt that is never decoded.
        row = _Row(task=task, seed=int(seed), stream=self.chat.prompt(""), provenance=provenance, done=True,
                   termination=envs.Termination(self.pool.slots[slot].termination))
        row.provenance["reset_error"] = str(obs)
      else:
        row = _Row(task=task, seed=int(seed), stream=self.chat.prompt(obs.text), provenance=provenance)
      rows.append(row)

    source.start([r.stream.tokens(0, len(r.stream)) for r in rows], group_size)
    env_s = 0.0
    env_steps = action_tokens = 0
    # Every turn starts with some row running on some process: turn 0 has all rows, and a later turn is
    # reached only when the collective check after the env step found one.
    for _ in range(self.max_turns):
      active = np.asarray([not r.done for r in rows])
      decode0 = source.decode_s
      actions = source.act(active)
      t_decode = source.decode_s - decode0

      stepping, texts, spans = [], [], {}
      for i, action in actions.items():
        row = rows[i]
        if action is None:  # a script ran out before its episode ended
          row.done, row.termination = True, envs.Termination.CANCELLED
          continue
        span = self._append_action(row.stream, action)
        action_tokens += len(action.tokens)
        text = self.chat.action_text(action.tokens)
        if action.finish == Finish.STOP:
          stepping.append(i)
          texts.append(text)
          spans[i] = (span, text)
          continue
        row.done = True
        row.termination = (envs.Termination.TURN_BUDGET_EXHAUSTED if action.finish == Finish.BUDGET
                           else envs.Termination.CONTEXT_EXHAUSTED)
        # The cut action never reached the env: its outcome is the termination (not "ok").
        row.turns.append(tr.Turn(action=tr.Action(span=span, text=text, valid=False),
                                 policy_version=policy_version, t_decode_s=t_decode, outcome=row.termination.value))

      if stepping:
        t0 = time.perf_counter()
        results = self.pool.step_many(stepping, texts)
        t_env = time.perf_counter() - t0
        env_s += t_env
        env_steps += len(stepping)
        for i, result in zip(stepping, results):
          self._record_step(rows[i], result, *spans[i], actions[i].tokens, policy_version, t_decode, t_env)

      needs = [i for i, r in enumerate(rows) if not r.done]
      if not multihost.any_process(bool(needs)):
        break
      ok = source.observe([rows[i].frame.tokens if not rows[i].done else [] for i in range(n)])
      for i in needs:
        row = rows[i]
        if ok:
          row.stream.extend(row.frame.stream)
        else:  # the observation never reached the policy: it is not part of the trajectory
          row.turns[-1] = dataclasses.replace(row.turns[-1], observation=None)
          row.done = True
          row.termination = envs.Termination.CONTEXT_EXHAUSTED
        row.frame = None
      if not ok:
        break

    for row in rows:
      if not row.done:  # only reachable if the env allows more turns than the engine's bound
        row.done = True
        row.termination = envs.Termination.MAX_TURNS
    # One advantage group per task slot (its G samples), named by the task and the slot's first env seed:
    # two slots that drew the same question stay two groups, in every batch, round and topology.
    trajectories = [self._trajectory(r, policy_version, reset_s / max(n, 1),
                                     group_id=f"{r.task.id}/{seeds[i - i % group_size]}")
                    for i, r in enumerate(rows)]
    return trajectories, RolloutStats(reset_s=reset_s, decode_s=source.decode_s, env_s=env_s,
                                      extend_s=source.extend_s, env_steps=env_steps, action_tokens=action_tokens)

  def _append_action(self, stream: tr.TokenStream, action: RowAction) -> tuple[int, int]:
    """Appends an action as sampled: its reasoning span (role REASONING) first, then the rest (POLICY)."""
    n = self.chat.reasoning_length(action.tokens)
    start = len(stream)
    if n:
      stream.sampled(action.tokens[:n], action.logprobs[:n], role=tr.Role.REASONING, train=self.reasoning.trained)
    stream.sampled(action.tokens[n:], action.logprobs[n:])
    return start, len(stream)

  def _record_step(self, row: _Row, result: envs.StepResult, span, text: str, tokens: Sequence[int],
                   policy_version: int, t_decode: float, t_env: float) -> None:
    for key, value in result.reward_components.items():
      row.components[key] = row.components.get(key, 0.0) + float(value) * self.gamma ** len(row.turns)
    call = None if result.call is None else result.call.to_wire()
    obs = None
    if not result.done:
      role = tr.Role.ERROR if result.outcome in _ERROR_REPLIES else tr.Role.TOOL
      row.frame = self.chat.observation(result.observation.text, role, after=tokens)
      start = len(row.stream)
      obs = tr.ObservationRecord(span=(start + row.frame.body[0], start + row.frame.body[1]),
                                 text=result.observation.text,
                                 truncated=result.observation.truncated or row.frame.truncated,
                                 original_bytes=result.observation.original_size)
    row.turns.append(tr.Turn(action=tr.Action(span=span, text=text, valid=result.outcome not in _INVALID,
                                              parsed=call),
                             observation=obs, reward=result.reward, reward_components=dict(result.reward_components),
                             policy_version=policy_version, t_decode_s=t_decode, t_env_s=t_env,
                             outcome=result.outcome.value))
    if result.verdict is not None:
      v = result.verdict
      row.verifier = tr.VerifierRecord(name=self.env_spec.name, version=str(v.version), passed=bool(v.passed),
                                       evidence=dict(v.evidence))
      row.verify_s = float(v.seconds)
    if result.done:
      row.done = True
      row.termination = envs.Termination(result.termination)

  def _trajectory(self, row: _Row, policy_version: int, reset_s: float, group_id: str) -> tr.Trajectory:
    total = sum(t.reward * self.gamma ** k for k, t in enumerate(row.turns))
    return tr.Trajectory(
        task=tr.TaskRecord(id=row.task.id, split=row.task.split, version=row.task.version),
        env=tr.EnvInfo(name=self.env_spec.name, version=self.env_version, seed=row.seed,
                       network="none" if self.pool.sandboxed else "host",  # cut only inside a sandbox
                       invalid_action_rule=self.rule),
        policy_version=policy_version, termination=row.termination,
        reward=tr.Reward(total=float(total), gamma=self.gamma, components=dict(row.components)),
        turns=tuple(row.turns), id=uuid.uuid4().hex, group_id=group_id,
        timing=tr.Timing(reset_s=reset_s, verify_s=row.verify_s), verifier=row.verifier, reasoning=self.reasoning,
        metadata=row.provenance,
        **row.stream.arrays())
