"""What an iteration reports: its typed record, and the one place its metric names are spelled.

  IterationRecord                                  one iteration of any paradigm: its metrics, time, what to store
  policy_metrics(run, sample, prepared, update)    an rl update's metrics (sync and async alike)
  metric_line(run, state, record)                  -> the metrics.jsonl line of an iteration

Every iteration function (`rl.iteration`, `freshness.Freshness.iteration`, `paradigms.iteration`) returns
`(state, IterationRecord)`; the hooks (jaxagent/train/hooks.py) read records, and the logging hook turns each into
its line here, so sync and async runs log the same keys, each written in one place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from jaxagent import multihost
from jaxagent import trajectory as tr
from jaxagent.rollout.episodes import RolloutStats
from jaxagent.train import learner, monitors
from jaxagent.train import metrics as metrics_lib
from jaxagent.train.run import Run
from jaxagent.train.state import RunState


@dataclasses.dataclass(frozen=True)
class IterationRecord:
  """One iteration's outcome, as the hooks see it.

  Attributes:
    paradigm: the stage's paradigm ("rl", "sft", "offline", "rft").
    metrics: the paradigm's own metrics by their names (`metric_line` adds what every iteration logs).
    seconds: the iteration's wall time (an async update: waiting for its batch included).
    stored: trajectories for the run's store, in order, marked as trained or not (the store hook writes them).
    alerts: the training-health monitors' alerts that start at this iteration (the monitors hook sets them).
    promoted: the stage's promotion check passed at this iteration (the promotion hook sets it).
  """
  paradigm: str
  metrics: Mapping[str, Any]
  seconds: float
  stored: Sequence[tr.Trajectory] = ()
  alerts: tuple[monitors.Alert, ...] = ()
  promoted: bool = False


def termination_metrics(terminations: Mapping[str, int]) -> dict[str, int]:
  """`termination/<name>` of every termination that happened."""
  return {f"termination/{n}": int(c) for n, c in terminations.items() if c}


def rollout_times(stats: RolloutStats) -> dict[str, float]:
  """A rollout's stage times (`RolloutStats`)."""
  return {"time/reset_s": stats.reset_s, "time/decode_s": stats.decode_s, "time/env_s": stats.env_s,
          "time/extend_s": stats.extend_s, "time/rollout_idle_s": stats.idle_s}


def policy_metrics(run: Run, sample: Sequence[tr.Trajectory], prepared: learner.Prepared, update: Mapping[str, Any],
                   counts: Mapping[str, Any], *, grouped: bool) -> dict[str, Any]:
  """What an rl update reports of the policy's sample and of the update, in sync and async runs alike.

  `sample`: this process's trajectories the policy sampled (the reward, success, reward components, group
  spread, terminations and task identification describe them); `prepared`, `update`: the batch's statistics and
  the update's metrics; `counts`: `rollouts.episode_counts` of `sample`; `grouped`: `prepared`'s estimate is of exactly
  `sample` (else the group spread is estimated again on `sample`).
  """
  totals = multihost.host_gather(np.asarray([t.reward.total for t in sample], np.float64))
  passed = multihost.host_gather(np.asarray([bool(t.verifier.passed) for t in sample]))
  out = {metrics_lib.REWARD_MEAN: float(totals.mean()), metrics_lib.SUCCESS_RATE: float(passed.mean()),
         # The "echo trap" diagnostic of docs/design.md §2.6, with the estimator's grouping.
         **learner.group_statistics(run, sample, prepared.estimate if grouped else None),
         **prepared.stats, **{k: float(v) for k, v in update.items()},
         **termination_metrics(counts["terminations"])}
  if counts.get("history_rewritten"):
    out[metrics_lib.HISTORY_REWRITTEN] = int(counts["history_rewritten"])
  # Reward components: this process's rows (their names come from the env and may differ between processes,
  # so they are not gathered); the task identification likewise.
  for key in sorted({k for t in sample for k in t.reward.components}):
    out[f"reward/{key}"] = float(np.mean([t.reward.components.get(key, 0.0) for t in sample]))
  ident = monitors.task_identification(sample)
  if ident is not None:
    out[monitors.TASK_IDENTIFICATION] = ident
  return out


def metric_line(run: Run, state: RunState, record: IterationRecord) -> dict[str, Any]:
  """The metrics.jsonl line of the iteration that ended in `state` (before the hooks that may end its stage):
  the record's metrics, the learning rate of its last step, its wall time, the x-axes and (with
  curriculum.stages) the stage."""
  line = {**record.metrics, "learning_rate": float(run.policy.schedule(int(state.train.step) - 1)),
          metrics_lib.ITERATION_SECONDS: record.seconds, **state.counters}
  if run.config.curriculum.stages:
    line["curriculum/stage"] = state.stage
  return line
