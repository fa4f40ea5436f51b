"""Multi-turn rollout: a quota of episodes through a fixed set of decode slots, each paused while its env works.

The unit of scheduling is an episode that pauses between turns (docs/design.md §2.9). The engine owns `slots` rows of
the sampler and as many env-pool slots (slot i of one is slot i of the other). An episode goes through

    admitted (env reset, asynchronous) -> prompt fed (or copied from a resident row of the same prompt) ->
    decoding -> its action handed to the env (asynchronous) -> observation frame fed -> decoding -> ... -> done

and its slot takes the next episode of the quota. While one episode waits on its env, the device decodes the
others: a slow tool holds only its own episode. `schedule="lockstep"` keeps today's barrier instead (admit a
whole wave, every turn waits for every env of the wave) for comparison (`bench/rollout.py`).

Two transports drive the same scheduler (`scheduler.Scheduler`):
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

Where the parts live: the actors (policy or script) in jaxagent/rollout/actors.py, the per-episode state and
the rollout's stats in jaxagent/rollout/episodes.py, the scheduler and its two transports in
jaxagent/rollout/scheduler.py; this module is the engine (records and the quota) and the async stream.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
import uuid
from typing import Callable, Sequence

import jax

import envs
from jaxagent import trajectory as tr
from jaxagent.chat import ChatFormat
from jaxagent.config import SCHEDULES, TRANSPORTS  # the enumerations, written once
from jaxagent.rollout.actors import Actor, RowAction, SampledActions
from jaxagent.rollout.episodes import Branch, Episode, EpisodeState, RolloutStats
from jaxagent.rollout.scheduler import Scheduler

# A step that rejected the action but let the episode go on: its reply is an error observation (Role.ERROR).
_ERROR_REPLIES = (envs.Outcome.PARSER_REJECTED_CONTINUED, envs.Outcome.INVALID_ACTION_CONTINUED)
_INVALID = (envs.Outcome.PARSER_REJECTED, envs.Outcome.INVALID_ACTION) + _ERROR_REPLIES


@dataclasses.dataclass(frozen=True)
class EpisodeRules:
  """How the engine runs and records episodes.

  Attributes:
    max_turns: hard bound on turns per episode.
    gamma: discount for the recorded return.
    invalid_action_rule: as configured on the pool (recorded on every trajectory).
    train_reasoning: a sampled action's reasoning span (`chat.reasoning_length`) carries loss.
    schedule: "continuous" (a slot takes the next episode as soon as its own ends; no turn barrier) or
      "lockstep" (waves of `slots` episodes, every turn waits for the whole wave).
    transport: "host_loop" or "callback" (see the module docstring); scripted actors always use host_loop.
  """
  max_turns: int
  gamma: float = 1.0
  invalid_action_rule: str = "error_observation"
  train_reasoning: bool = True
  schedule: str = "continuous"
  transport: str = "host_loop"

  def __post_init__(self):
    if self.invalid_action_rule not in envs.INVALID_ACTION_RULES:
      raise ValueError(f"invalid_action_rule={self.invalid_action_rule!r}: not one of "
                       f"{envs.INVALID_ACTION_RULES}")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule={self.schedule!r}: not one of {SCHEDULES}")
    if self.transport not in TRANSPORTS:
      raise ValueError(f"transport={self.transport!r}: not one of {TRANSPORTS}")


class RolloutEngine:
  """Runs quotas of multi-turn episodes through the env pool's slots.

  Args:
    pool: env pool; its slots are the decode slots (one env instance per slot, reused by later episodes).
    env_spec: the environment's registry entry (name, version).
    chat: frames prompts and observations, ends and decodes actions.
    rules: turns, discount, the invalid-action rule, reasoning loss, schedule and transport (`EpisodeRules`).
  """

  def __init__(self, pool: envs.pool.Pool, env_spec: envs.EnvSpec, chat: ChatFormat, rules: EpisodeRules):
    max_turns, gamma, train_reasoning = rules.max_turns, rules.gamma, rules.train_reasoning
    invalid_action_rule, schedule, transport = rules.invalid_action_rule, rules.schedule, rules.transport
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
    return self.pool.num_slots

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
    episodes = [Episode(index=i, task=tasks[i // group_size], seed=int(seeds[i]),
                         group_id=f"{tasks[i // group_size].id}/{seeds[i - i % group_size]}") for i in range(n)]
    episodes += [Episode(index=n + j, task=b.task, seed=b.parent.env.seed, branch=b,
                          group_id=f"{b.parent.group_id}/branch-{b.parent.id[:8]}-{b.turn}")
                 for j, b in enumerate(branches)]
    n = len(episodes)
    actor.begin(self.slots, first_episode=jax.process_index() * n)
    sched = Scheduler(self, actor, episodes, policy_version)
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

  def record_step(self, ep: Episode, result: envs.StepResult, span, text: str, tokens: Sequence[int],
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

  def _trajectory(self, ep: Episode, policy_version: int) -> tr.Trajectory:
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
    self.sched = Scheduler(engine, actor, [], actor.version)
    self.sched.on_done = self._done
    self.pending: dict[int, list[Episode]] = {}     # slot id -> its episodes (some still running)
    self.complete: collections.deque[tuple[int, list[tr.Trajectory]]] = collections.deque()
    self._ended: list[Episode] = []                  # since the last `stats`
    self._mark = self._counters()

  def submit(self, slot_id: int, task: envs.Task, seeds: Sequence[int]) -> None:
    if slot_id in self.pending:
      raise ValueError(f"slot {slot_id} is already in the stream")
    if len(seeds) != self.group_size:
      raise ValueError(f"{len(seeds)} seeds for a group of {self.group_size}")
    g = self.group_size
    eps = [Episode(index=slot_id * g + k, task=task, seed=int(seeds[k]), group_id=f"{task.id}/{seeds[0]}")
           for k in range(g)]
    self.pending[slot_id] = eps
    self.sched.add(eps)

  def _done(self, ep: Episode) -> None:
    self._ended.append(ep)
    slot = ep.index // self.group_size
    group = self.pending.get(slot)
    if group is not None and all(e.state == EpisodeState.DONE for e in group):
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
    self.sched.episodes = [e for e in self.sched.episodes if e.state != EpisodeState.DONE]

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
