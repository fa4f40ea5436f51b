"""`train.freshness` one_step_off and async: the learner trains on batches a rollout stream keeps producing.

Where rollouts run and how fresh their policy is are two choices (docs/design.md §2.10); this module is the
freshness one, colocated (the stream and the learner share the devices; `jaxagent.rollout.engine.RolloutStream`
samples from a copy of the policy, `Layout.rollout_snapshot`, while the learner steps in a thread).

  sync          (jaxagent/train/rl.py) roll out a batch, update on it.
  one_step_off  round k+1 (B groups) rolls out with the policy before update k while update k runs; every batch
                is trained exactly one version late (round 0: on-policy).
  async         groups run continuously under admission control; complete groups queue; the learner takes the
                next B as soon as it is free; each update's weights reach the episodes in flight between two
                decode chunks (`rollout.on_weight_update`: keep_cache or refill).

Bounded staleness (`train.max_staleness` = η; AReaL's capacity rule): a group is submitted only while the
groups admitted so far (dropped ones not counted) are fewer than (u + η + 1)·B, u the updates done; complete
groups are taken oldest first (by their oldest token), and a group taken for the update from version V must
have every token's version ≥ V − η, else it is dropped (stored,
counted, `metadata.dropped = "stale"`) and its slot rolled out again. So every trained token's version v
satisfies V − η ≤ v ≤ V.

Slots: draw d of the task supply gives slots d·B … d·B + B − 1 (the tasks and env seeds of a sync run's
iteration d); slot s's episodes are s·G … s·G + G − 1, sampled with `fold_in(stream key, episode)`. A checkpoint
stores the next draw, the slots drawn but not submitted, the slots in flight (re-submitted on resume: their
episodes start again under the restored policy), the complete groups not yet trained (written to
`queue/<iteration>/`, restored as they were), and the admission counters. Every slot below the next draw's
first is trained exactly once, in flight, queued or not yet submitted: nothing is lost or trained twice.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

import envs
from jaxagent import seeds
from jaxagent import trajectory as tr
from jaxagent import trajectory_store
from jaxagent.rollout.actors import SampledActions
from jaxagent.rollout.engine import RolloutStream
from jaxagent.train import learner
from jaxagent.train import metrics as metrics_lib
from jaxagent.train.records import IterationRecord, policy_metrics, rollout_times
from jaxagent.train.rollouts import episode_counts, record_outcomes
from jaxagent.train.run import Run
from jaxagent.train.state import RunState

QUEUE_DIR = "queue"  # under the run directory: the complete, untrained groups of each checkpoint


@dataclasses.dataclass(frozen=True)
class Slot:
  """A task slot: one task, its group's env seeds; its id fixes its episodes' sampling keys."""
  id: int
  task: envs.Task
  seeds: tuple[int, ...]

  def to_meta(self) -> dict[str, Any]:
    return {"id": self.id, "task": self.task.to_wire(), "seeds": list(self.seeds)}

  @classmethod
  def from_meta(cls, d: Mapping[str, Any]) -> "Slot":
    return cls(int(d["id"]), envs.Task.from_wire(d["task"]), tuple(int(s) for s in d["seeds"]))


def oldest_version(t: tr.Trajectory) -> int:
  """The oldest policy version among the trajectory's sampled tokens (its admission version if it has none)."""
  v = t.behavior_versions[t.behavior_versions >= 0]
  return int(v.min()) if v.size else int(t.policy_version)


class Freshness:
  """The stream, the learner thread, admission and staleness of one rl stage (see the module docstring).

  `iteration(run_state)` is the sync `rl.iteration`'s counterpart: it returns after one update,
  with the learner idle (checkpoints and evals run between iterations as in sync mode). `pause()` lets the
  episodes in flight finish (an eval needs the env pool); `checkpoint(iteration)` is what the run state saves.
  """

  def __init__(self, run: Run, run_state: RunState):
    """The stream of `run_state`'s rl stage, continuing from its saved stream (a resumed run) if it has one."""
    cfg = run.config
    self.run, self.cfg = run, cfg
    self.mode, self.eta = cfg.train.freshness, cfg.train.max_staleness
    self.B, self.G = cfg.train.tasks_per_iteration, cfg.train.group_size
    self.refill = cfg.rollout.on_weight_update == "refill"
    self.supply = run_state.supply
    state = run_state.train
    self.version = int(state.policy_version)  # the actor's
    actor = SampledActions(run.rollout.sampler, run.policy.layout.rollout_snapshot(state.params),
                           run.policy.layout.rollout_key(run.rollout.key(state.rng, np.int32(-1), np.int32(0))),
                           decode_chunk=cfg.rollout.decode_chunk, version=self.version, track_cache=self.refill)
    self.stream = RolloutStream(run.rollout.engine, actor, group_size=self.G)
    self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxagent-learner")
    restored = dict(run_state.saved_stream or {})
    self.next_draw = int(restored.get("next_draw", 0))
    self.drawn = [Slot.from_meta(d) for d in restored.get("drawn", [])]  # drawn, not yet submitted
    self.admitted = int(restored.get("admitted", 0))    # groups submitted, dropped ones not counted
    self.updates = int(restored.get("updates", 0))      # updates done by this stream's learner
    self.dropped = int(restored.get("dropped", 0))      # groups dropped as too stale, in total
    self.slots: dict[int, Slot] = {}                    # submitted, not yet trained or dropped
    for d in restored.get("pending", []):
      self._submit(Slot.from_meta(d), count=False)
    queue = restored.get("queue")
    if queue:
      self._restore_queue(run.run_dir / queue, [Slot.from_meta(d) for d in restored.get("queued", [])])

  # -- admission

  def _capacity(self) -> int:
    """Groups that may have been admitted by now: (u + η + 1)·B with u the updates done (async); (u + 1)·B
    with u the updates started (one_step_off: the round being trained and the next one)."""
    return (self.updates + (0 if self.mode == "one_step_off" else self.eta) + 1) * self.B

  def _draw(self) -> Slot:
    if not self.drawn:
      d, cfg = self.next_draw, self.cfg
      tasks = self.supply.draw(d, 0)
      env_seeds = seeds.episodes(cfg.run.seed, d, self.run.rows.local, jax.process_index())
      self.drawn = [Slot(d * self.B + j, task, tuple(int(s) for s in env_seeds[j * self.G:(j + 1) * self.G]))
                    for j, task in enumerate(tasks)]
      self.next_draw += 1
    return self.drawn.pop(0)

  def _submit(self, slot: Slot, count: bool = True) -> None:
    self.slots[slot.id] = slot
    self.stream.submit(slot.id, slot.task, slot.seeds)
    self.admitted += count

  def _top_up(self) -> None:
    while self.admitted < self._capacity():
      self._submit(self._draw())

  # -- the learner

  def _learn(self, state, trajectories):
    """The learner thread's work: the batch (advantages; PPO values, decoupled PPO's π_prox from `state`),
    the update, and the rollout copy of the new policy."""
    t0 = time.perf_counter()
    prepared = learner.prepare_batch(self.run, state, trajectories)
    state, m = learner.update(self.run, state, prepared)
    t1 = time.perf_counter()
    snapshot = self.run.policy.layout.rollout_snapshot(state.params) if self.mode == "async" else None
    jax.block_until_ready(snapshot)
    return state, m, prepared, snapshot, t1 - t0, time.perf_counter() - t1

  def _take(self, version: int) -> tuple[list[tuple[int, list[tr.Trajectory]]], list[tr.Trajectory]]:
    """B complete groups fresh enough for an update from `version` (driving the stream until there are);
    returns them and the trajectories of the groups dropped as too stale on the way."""
    taken, dropped = [], []
    while len(taken) < self.B:
      if not self.stream.complete:
        if self.stream.live == 0:
          raise RuntimeError(f"rollout stream stalled: {len(taken)}/{self.B} groups and nothing in flight "
                             f"({self.admitted} admitted, capacity {self._capacity()})")
        need = self.B - len(taken)
        self.stream.run(until=lambda: len(self.stream.complete) >= need)
        continue
      # The oldest group first: a group close to the staleness bound is trained now rather than dropped later.
      ages = [min(map(oldest_version, group)) for _, group in self.stream.complete]
      oldest = int(np.argmin(ages))  # the first of the oldest: completion order among equals
      slot_id, group = self.stream.complete[oldest]
      del self.stream.complete[oldest]
      if ages[oldest] < version - self.eta:
        dropped += [dataclasses.replace(t, metadata={**t.metadata, "trained": False, "dropped": "stale"})
                    for t in group]
        self.dropped += 1
        self.stream.submit(slot_id, self.slots[slot_id].task, self.slots[slot_id].seeds)  # rolled out again
        continue
      taken.append((slot_id, group))
    return taken, dropped

  def iteration(self, run_state: RunState) -> tuple[RunState, IterationRecord]:
    """One update: wait for a fresh batch (the stream runs), start the update in the learner thread, run the
    stream until it is done, switch the episodes to its weights (async)."""
    run = self.run
    state, it = run_state.train, run_state.iteration
    version = int(state.policy_version)
    self._top_up()
    t0 = time.perf_counter()
    taken, dropped = self._take(version)
    wait_s = time.perf_counter() - t0
    if self.mode == "one_step_off":  # the next round samples with the policy this update starts from
      if version != self.version:
        self.stream.set_params(run.policy.layout.rollout_snapshot(state.params), version)
        self.version = version
      self.updates += 1  # counted as started: the next round is admitted now, while the update runs
      self._top_up()
    trajs = [t for _, group in taken for t in group]
    future = self.pool.submit(self._learn, state, trajs)
    self.stream.run(until=future.done)
    state, m, prepared, snapshot, learn_s, transfer_s = future.result()  # the stream ran dry: wait
    refill = {}
    if self.mode == "async":
      self.updates += 1
      self.version = int(state.policy_version)
      refill = self.stream.set_params(snapshot, self.version, refill=self.refill)
      self._top_up()
    stats = self.stream.stats()
    curriculum = record_outcomes(run, self.supply, [self.slots.pop(slot).task for slot, _ in taken], trajs)
    pool = run.rollout.pool
    counts = episode_counts(trajs, replays=pool.replays, replay_divergences=pool.replay_divergences)
    counters = metrics_lib.advance(run_state.counters, env_interactions=stats.env_steps,
                                   action_tokens=stats.action_tokens,
                                   device_s=stats.decode_s + stats.extend_s + learn_s)
    out = {**policy_metrics(run, trajs, prepared, m, counts, grouped=True), **rollout_times(stats),
           **self._freshness_metrics(trajs, version, dropped),
           "time/rollout_wait_s": wait_s, "time/update_s": learn_s, "time/weight_transfer_s": transfer_s,
           **curriculum, **{f"rollout/{k}": v for k, v in refill.items()},
           "env/replays": int(counts["replays"]), "env/replay_divergences": int(counts["replay_divergences"])}
    stored = [learner.stored(t, why, trained_version=version) for t, why in zip(trajs, prepared.excluded)] + dropped
    return (dataclasses.replace(run_state, train=state, iteration=it + 1, counters=counters),
            IterationRecord("rl", out, time.perf_counter() - t0, stored))  # waiting for the batch included

  def _freshness_metrics(self, trajs: list[tr.Trajectory], version: int, dropped: list[tr.Trajectory]
                         ) -> dict[str, float]:
    """How stale the trained tokens are (versions behind the update's `version`: sampled to completed, and
    completed to trained), and the stream's groups dropped, queued and in flight."""
    mask = [t.loss_mask & (t.behavior_versions >= 0) for t in trajs]
    token_v = np.concatenate([t.behavior_versions[k] for t, k in zip(trajs, mask)] or [np.zeros(0, np.int32)])
    done_v = np.concatenate([np.full(int(k.sum()), t.metadata["completed_version"]) for t, k in zip(trajs, mask)]
                            or [np.zeros(0, np.int64)])
    lag = version - token_v
    return {
        "freshness/lag_mean": float(lag.mean()) if lag.size else 0.0,
        "freshness/lag_max": int(lag.max()) if lag.size else 0,
        "freshness/lag_in_flight": float((done_v - token_v).mean()) if lag.size else 0.0,
        "freshness/lag_in_queue": float((version - done_v).mean()) if lag.size else 0.0,
        "freshness/dropped_groups": len(dropped) // self.G, "freshness/dropped_total": self.dropped,
        "freshness/queued_groups": len(self.stream.complete),
        "freshness/in_flight_groups": len(self.slots) - len(self.stream.complete),
        **{f"freshness/tokens_lag_{k}": int((lag == k).sum()) for k in range(self.eta + 1)},
    }

  # -- between iterations

  def pause(self) -> None:
    """Lets every episode in flight finish without admitting more (the env pool is then free for an eval);
    their groups stay queued. The next iteration admits again."""
    self.stream.drain()

  def checkpoint(self, iteration: int) -> dict[str, Any]:
    """What a checkpoint at `iteration` stores of the stream (the complete groups in `queue/<iteration>/`)."""
    queued = [slot for slot, _ in self.stream.complete]
    rel = f"{QUEUE_DIR}/{iteration}"
    directory = self.run.run_dir / rel
    if directory.exists():
      shutil.rmtree(directory)
    with trajectory_store.TrajectoryWriter(directory) as w:
      for _, group in self.stream.complete:
        for t in group:
          w.write(t)
    # The queues of checkpoints the checkpointer no longer keeps go too (one more kept: a save in flight).
    kept = sorted((int(p.name) for p in directory.parent.iterdir() if p.name.isdigit()), reverse=True)
    for old in kept[self.cfg.train.keep_checkpoints + 1:]:
      shutil.rmtree(directory.parent / str(old), ignore_errors=True)
    return {"next_draw": self.next_draw, "drawn": [s.to_meta() for s in self.drawn],
            "pending": [s.to_meta() for i, s in sorted(self.slots.items()) if i not in set(queued)],
            "queued": [self.slots[i].to_meta() for i in queued], "queue": rel,
            "admitted": self.admitted, "updates": self.updates, "dropped": self.dropped}

  def _restore_queue(self, directory: Path, queued: list[Slot]) -> None:
    groups: dict[int, list[tr.Trajectory]] = {}
    for t in trajectory_store.read(directory):
      groups.setdefault(int(t.metadata["slot"]), []).append(t)
    for slot in queued:
      if len(groups.get(slot.id, ())) != self.G:
        raise RuntimeError(f"{directory}: slot {slot.id} has {len(groups.get(slot.id, ()))} of its {self.G} "
                           "trajectories: the checkpoint's queue is damaged")
      self.slots[slot.id] = slot
      self.stream.complete.append((slot.id, groups[slot.id]))

  def close(self) -> None:
    self.pool.shutdown(wait=True)
