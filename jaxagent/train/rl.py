"""The synchronous rl iteration (`train.freshness: sync`): roll out a batch with the current policy (with DAPO's
dynamic sampling and branched rollouts when configured), prepare it, update on it.

  iteration(run, state)   -> state, IterationRecord

Its asynchronous counterpart is jaxagent/train/freshness.py; the other paradigms' are jaxagent/train/paradigms.py.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxagent import multihost
from jaxagent import trajectory as tr
from jaxagent.rollout.episodes import RolloutStats
from jaxagent.tasks import supply as task_supply
from jaxagent.train import learner
from jaxagent.train import metrics as metrics_lib
from jaxagent.train.records import IterationRecord, policy_metrics, rollout_times
from jaxagent.train.rollouts import branch_round, episode_counts, sample_round
from jaxagent.train.run import Run
from jaxagent.train.state import RunState, TrainState


@dataclasses.dataclass(frozen=True)
class DynamicSampling:
  """What DAPO's dynamic sampling made of an iteration's first round."""
  state: TrainState
  trained: list[tr.Trajectory]       # the batch: a varied group kept in each slot where one was found
  unused: list[tr.Trajectory]        # sampled but not trained on (stored, marked)
  stats: RolloutStats                # the rollout stats of every round
  metrics: dict[str, float]


def dynamic_sampling(run: Run, state: TrainState, iteration: int, sampled: list[tr.Trajectory], stats,
                     supply: task_supply.TaskSupply) -> DynamicSampling:
  """DAPO dynamic sampling (Yu et al. 2025): a group whose rewards are all equal carries no GRPO signal.

  The batch keeps its B task slots. While some slot (on any process) holds such a flat group, and at most
  `train.dynamic_sampling_rounds` times, a new batch of tasks is rolled out and each flat slot takes the
  group rolled out in its own slot if that one varies. Slot by slot, so the choice does not depend on how
  the slots are spread over processes; rounds are decided collectively, so every process draws the same
  task batches and the data order stays exact across resume and topologies. Slots still flat at the end
  are trained as they are (advantage 0) and counted.
  """
  cfg = run.config
  g = cfg.train.group_size
  chunks = lambda ts: [ts[i * g:(i + 1) * g] for i in range(len(ts) // g)]
  # Only the trajectories the advantages use count: a failed reset or an infrastructure failure is in no group.
  excluded = set(cfg.train.exclude_terminations)
  varied = lambda group: len({t.reward.total for t in group if t.turns and t.termination.value not in excluded}) > 1
  chosen = chunks(sampled)
  flat = [not varied(group) for group in chosen]
  unused, rounds, sampled_groups = [], 0, len(chosen)
  curriculum = {}
  while rounds < cfg.train.dynamic_sampling_rounds and multihost.host_sum(np.asarray(sum(flat))) > 0:
    rounds += 1
    state, refill = sample_round(run, state, supply, iteration, rounds, kind="refill")
    curriculum, stats = refill.curriculum, stats + refill.stats
    for slot, group in enumerate(chunks(refill.trajectories)):
      sampled_groups += 1
      if flat[slot] and varied(group):
        unused += chosen[slot]
        chosen[slot], flat[slot] = group, False
      else:
        unused += group
  metrics = {"dynamic_sampling/rounds": rounds,
             "dynamic_sampling/groups_sampled": int(multihost.host_sum(sampled_groups)),
             "dynamic_sampling/zero_variance_groups_trained": int(multihost.host_sum(sum(flat))),
             **{k: v for k, v in curriculum.items() if k in task_supply.COUNTER_METRICS}}
  return DynamicSampling(state, [t for group in chosen for t in group], unused, stats, metrics)


def iteration(run: Run, run_state: RunState) -> tuple[RunState, IterationRecord]:
  """Rollout (with dynamic sampling and branches), batch preparation and update(s) of one iteration, on the
  tasks of the current curriculum stage. The policy metrics describe the first round's sample (dynamic
  sampling's refills are selected, not sampled; branches start from the sample's states)."""
  cfg = run.config
  it, state = run_state.iteration, run_state.train
  supply = run_state.supply
  timer = metrics_lib.StageTimer()
  wall0 = time.perf_counter()
  extra_steps = extra_tokens = 0
  with timer("rollout"):
    state, first = sample_round(run, state, supply, it)
    sampled, stats, curriculum = first.trajectories, first.stats, first.curriculum
    trajs, unused, extra = sampled, [], {}
    if cfg.train.dynamic_sampling:
      refilled = dynamic_sampling(run, state, it, sampled, stats, supply)
      state, trajs, unused, stats, extra = (refilled.state, refilled.trained, refilled.unused, refilled.stats,
                                            refilled.metrics)
    if cfg.rollout.branch.at:  # continuations from the sampled trajectories' states, trained with them
      t0 = time.perf_counter()
      state, branches, bstats = branch_round(run, state, first, it)
      trajs = sampled + branches
      extra_steps = sum(int(t.metadata["branch"]["turn"]) for t in branches)  # env steps a replay took
      extra = {"branch/trajectories": len(branches), "branch/replayed_steps": extra_steps,
               "branch/diverged": sum(bool(t.metadata["branch"].get("diverged")) for t in branches),
               "time/branch_s": time.perf_counter() - t0}
      extra_steps += bstats.env_steps if bstats else 0
      extra_tokens = bstats.action_tokens if bstats else 0
      if branches:
        extra["branch/success_rate"] = float(np.mean([bool(t.verifier.passed) for t in branches]))
  with timer("advantages"):
    prepared = learner.prepare_batch(run, state, trajs)
  with timer("update"):
    state, m = learner.update(run, state, prepared)
  stage = timer.pop()
  # Env determinism measured too: episodes replayed after a worker restart and how many diverged, since this
  # process started.
  pool = run.rollout.pool
  counts = episode_counts(sampled, replays=pool.replays, replay_divergences=pool.replay_divergences,
                          env_steps=stats.env_steps + extra_steps, action_tokens=stats.action_tokens + extra_tokens)
  counters = metrics_lib.advance(run_state.counters, env_interactions=counts["env_steps"],
                                 action_tokens=counts["action_tokens"],
                                 device_s=stats.decode_s + stats.extend_s + stage.get("time/update_s", 0.0))
  out = {**policy_metrics(run, sampled, prepared, m, counts, grouped=trajs is sampled),
         **rollout_times(stats),
         **({"time/weight_transfer_s": stats.transfer_s} if run.policy.layout.disaggregated else {}),
         **metrics_lib.device_memory(), **stage, **curriculum, **extra,
         "env/replays": int(counts["replays"]), "env/replay_divergences": int(counts["replay_divergences"])}
  stored = [learner.stored(t, why) for t, why in zip(trajs, prepared.excluded)]
  # Sampled by dynamic sampling but not trained on: kept, marked.
  stored += [dataclasses.replace(t, metadata={**t.metadata, "trained": False}) for t in unused]
  return (dataclasses.replace(run_state, train=state, iteration=it + 1, counters=counters),
          IterationRecord("rl", out, time.perf_counter() - wall0, stored))
