"""Rollouts of the current policy through the engine: a training round's episodes, and a fixed task list's
(held-out evaluation, `jaxagent tasks filter --policy`), with the trained-row rule and task-supply feedback.

  collect(run, state, tasks, env_seeds, ...)   -> state, trajectories, stats  (reshard, roll out, reshard back)
  sample_round(run, state, supply, it, round_)  -> SampledRound   one round of a training iteration (rl, dynamic
                                                                  sampling's refills, rft): draw, seed, roll out
  trained_rows(run, trajectories)              -> bool[n]   rows the learner uses (not infrastructure failures)
  record_outcomes(run, supply, tasks, trajs)   -> metrics   the task supply learns each group's passes
  evaluate(run, state, split, episodes)        -> state, EvalResult   (Wilson intervals)
  policy_outcomes(run_dir, tasks, samples)     -> int[len(tasks)]     successes per task, from a checkpoint

`evaluate` and `policy_outcomes` are one rule (`over_tasks`): a task list that every process holds whole, in
calls of the run's rows, the last call padded with its first task (padding never counted), env seeds and
sampling keys a function of (seed, first task of the call) (jaxagent/seeds.py).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

import envs
from jaxagent import config as config_lib
from jaxagent import multihost, seeds
from jaxagent import trajectory as tr
from jaxagent.rollout.actors import SampledActions
from jaxagent.rollout.episodes import Branch, RolloutStats
from jaxagent.tasks import supply as task_supply
from jaxagent.train import metrics as metrics_lib
from jaxagent.train import resume
from jaxagent.train.run import Run, build_run, held_out_tasks
from jaxagent.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class EvalResult:
  split: str
  episodes: int
  successes: int
  ci: tuple[float, float]
  terminations: dict[str, int]
  mean_reward: float
  seconds: float = 0.0                 # wall time of the evaluation

  @property
  def success_rate(self) -> float:
    return self.successes / max(self.episodes, 1)

  def metrics(self) -> dict[str, float]:
    """What a held-out eval line of metrics.jsonl records."""
    return {metrics_lib.EVAL_SUCCESS_RATE: self.success_rate, metrics_lib.EVAL_SECONDS: self.seconds}

  def line(self) -> str:
    lo, hi = self.ci
    return (f"{self.split} success {self.success_rate:.3f} ({self.successes}/{self.episodes}, "
            f"95% CI [{lo:.3f}, {hi:.3f}]), mean reward {self.mean_reward:.3f}")


def collect(run: Run, state: TrainState, tasks: Sequence[envs.Task], env_seeds: Sequence[int], *, group_size: int,
            rng: jax.Array, evaluation: bool = False, branches: Sequence[Branch] = ()
            ) -> tuple[TrainState, list[tr.Trajectory], RolloutStats]:
  """Reshards the policy into the rollout layout, rolls out, reshards back (donating each time)."""
  t0 = time.perf_counter()
  policy = run.policy.layout.to_rollout(state.params)
  transfer_s = time.perf_counter() - t0 if run.policy.layout.disaggregated else 0.0
  try:
    sampler = run.rollout.eval_sampler if evaluation else run.rollout.sampler
    source = SampledActions(sampler, policy, run.policy.layout.rollout_key(rng),
                            decode_chunk=run.config.rollout.decode_chunk, version=int(state.policy_version))
    trajs, stats = run.rollout.engine.run(source, tasks, env_seeds, group_size=group_size,
                                          policy_version=int(state.policy_version), branches=branches)
    stats = dataclasses.replace(stats, transfer_s=transfer_s)
  finally:
    learner_policy = run.policy.layout.to_learner(policy, state.params["policy"])
    state = state.replace(params={**state.params, "policy": learner_policy})
  return state, trajs, stats


# The sampling round of an iteration's branches (`run.rollout.key(rng, iteration, round_)`): apart from any
# dynamic-sampling or rft round.
BRANCH_ROUND = 1 << 20


def branch_points(cfg, tasks: Sequence[envs.Task], trajectories: Sequence[tr.Trajectory]) -> list[Branch]:
  """`rollout.branch`: for each group (task-major, `train.group_size` each) and each turn t in `at`, the first
  `parents` trajectories with more than t turns, `k` branches each."""
  b, g = cfg.rollout.branch, cfg.train.group_size
  out = []
  for i, task in enumerate(tasks):
    group = trajectories[i * g:(i + 1) * g]
    for turn in b.at:
      for parent in [t for t in group if len(t.turns) > turn][:b.parents]:
        out += [Branch(task=task, parent=parent, turn=turn)] * b.k
  return out


def branch_round(run: Run, state: TrainState, first: SampledRound, iteration: int
                 ) -> tuple[TrainState, list[tr.Trajectory], RolloutStats | None]:
  """The branches of an rl iteration's first round (`branch_points`), rolled out with the same policy."""
  if not run.interface.env_spec.deterministic:
    raise config_lib.ConfigError(f"rollout.branch: env {run.interface.env_spec.name!r} is not deterministic (EnvSpec."
                                 "deterministic): replaying the parent's actions would not reach its state")
  points = branch_points(run.config, first.tasks, first.trajectories)
  if not points:
    return state, [], None
  state, trajs, stats = collect(run, state, [], [], group_size=run.config.train.group_size,
                                rng=run.rollout.key(state.rng, iteration, BRANCH_ROUND), branches=points)
  return state, trajs, stats


def trained_rows(run: Run, trajectories: Sequence[tr.Trajectory]) -> np.ndarray:
  """Which trajectories the learner uses: not those ended by an infrastructure failure (stored, counted)."""
  excluded = set(run.config.train.exclude_terminations)
  return np.asarray([t.termination.value not in excluded for t in trajectories], bool)


TERMINATIONS = tuple(t.value for t in envs.Termination)


def episode_counts(trajectories: Sequence[tr.Trajectory], **extra) -> dict[str, Any]:
  """How `trajectories` (this process's) ended, per `TERMINATIONS` name, how many of them at a gateway break
  (`history_rewritten`, an env_error), and `extra` counts, each summed over every process in one collective."""
  rewritten = sum(bool(t.turns) and t.turns[-1].outcome == envs.Outcome.HISTORY_REWRITTEN.value
                  for t in trajectories)
  counts = multihost.host_sums({"terminations": np.asarray([sum(t.termination.value == n for t in trajectories)
                                                            for n in TERMINATIONS]),
                                "history_rewritten": rewritten, **extra})
  return {**counts, "terminations": dict(zip(TERMINATIONS, (int(c) for c in counts["terminations"])))}


def record_outcomes(run: Run, supply: task_supply.TaskSupply, tasks: Sequence[envs.Task],
                    trajectories: Sequence[tr.Trajectory]) -> dict[str, float]:
  """Tells the task supply how each task's group did (verifier passes among the trained samples)."""
  shape = (len(tasks), run.config.train.group_size)
  passed = np.asarray([bool(t.verifier.passed) for t in trajectories]).reshape(shape)
  return supply.record(tasks, passed, trained_rows(run, trajectories).reshape(shape))


@dataclasses.dataclass(frozen=True)
class SampledRound:
  """One round of a training iteration: this process's tasks, their `group_size` samples each (task-major),
  the rollout's stats and the task supply's metrics after recording the outcomes."""
  tasks: list[envs.Task]
  trajectories: list[tr.Trajectory]
  stats: RolloutStats
  curriculum: dict[str, float]


def sample_round(run: Run, state: TrainState, supply: task_supply.TaskSupply, iteration: int, round_: int = 0, *,
                 kind: str | None = None) -> tuple[TrainState, SampledRound]:
  """Round `round_` of `iteration` (the one rule rl, dynamic sampling and rft sample by): the supply's draw
  (this process's slice of the global batch), the env seeds of `seeds.episodes` (`kind` None: an rl
  iteration's round 0; "refill": dynamic sampling's; "rft": rejection sampling's), the round's sampling key
  `run.rollout.key(state.rng, iteration, round_)`, the rollout, and the supply told how each group did."""
  cfg = run.config
  tasks = supply.draw(iteration, round_)
  env_seeds = seeds.episodes(cfg.run.seed, iteration, run.rows.local, jax.process_index(), kind=kind, round_=round_)
  state, trajs, stats = collect(run, state, tasks, env_seeds, group_size=cfg.train.group_size,
                                rng=run.rollout.key(state.rng, iteration, round_))
  return state, SampledRound(tasks, trajs, stats, record_outcomes(run, supply, tasks, trajs))


def over_tasks(run: Run, state: TrainState, tasks: Sequence[envs.Task], *, samples: int,
               env_seeds: Callable[[int, range], Sequence[int]], rng_seed: Callable[[int], int],
               evaluation: bool = False) -> tuple[TrainState, list[tuple[int, list[tr.Trajectory]]]]:
  """`samples` episodes of every task in `tasks` (the same list on every process).

  Calls of `run.rows.total // samples` tasks, this process running its `run.rows.local // samples` of them; the last
  call padded with copies of its first task, which are never returned. `env_seeds(start, rows)`: the env seeds of
  this process's global rows `rows` in the call whose first task is `start`; `rng_seed(start)`: its sampling seed.
  Returns the state and, for each of this process's real tasks, (its index in `tasks`, its `samples` episodes).
  """
  per_call, local = run.rows.total // samples, run.rows.local // samples
  process = jax.process_index()
  mine = range(process * local, (process + 1) * local)
  rows = range(process * run.rows.local, (process + 1) * run.rows.local)
  out = []
  for start in range(0, len(tasks), per_call):
    chunk = list(tasks[start:start + per_call])
    chunk += chunk[:1] * (per_call - len(chunk))  # pad the last call; padding is not counted
    state, trajs, _ = collect(run, state, [chunk[i] for i in mine], env_seeds(start, rows), group_size=samples,
                              evaluation=evaluation, rng=jax.random.key(rng_seed(start)))
    out += [(start + i, trajs[j * samples:(j + 1) * samples]) for j, i in enumerate(mine) if start + i < len(tasks)]
  return state, out


def evaluate(run: Run, state: TrainState, split: str | None = None, episodes: int | None = None,
             options: Mapping[str, Any] | None = None) -> tuple[TrainState, EvalResult]:
  """Held-out success over `episodes` tasks of `split` (task options: env.options unless given), with Wilson
  intervals (eval sampling temperature)."""
  cfg = run.config
  t0 = time.perf_counter()
  split = split or cfg.train.eval_split
  episodes = cfg.train.eval_episodes if episodes is None else episodes
  tasks = held_out_tasks(cfg, run.interface.env_spec, split, episodes, options)
  state, done = over_tasks(run, state, tasks, samples=1, evaluation=True,
                           env_seeds=lambda start, rows: seeds.eval_episodes(cfg.run.seed, split, start, rows),
                           rng_seed=lambda start: seeds.eval_rng(cfg.run.seed, start))
  trajs = [t for _, (t,) in done]
  counts = episode_counts(trajs, passed=sum(bool(t.verifier.passed) for t in trajs),
                          rewards=sum(t.reward.total for t in trajs))
  passed = int(counts["passed"])
  return state, EvalResult(split, episodes, passed, metrics_lib.wilson_interval(passed, episodes),
                           {n: c for n, c in counts["terminations"].items() if c},
                           float(counts["rewards"]) / max(episodes, 1), time.perf_counter() - t0)


def policy_outcomes(run_dir: Path | str, tasks: Sequence[envs.Task], samples: int, *, seed: int = 0,
                    overrides: Sequence[str] = ()) -> np.ndarray:
  """Successes of `samples` policy samples on each task ([len(tasks)] ints), from the latest checkpoint of the
  run in `run_dir`, with the run's rollout sampling (its temperature) and env settings."""
  run_dir = resume.run_directory(run_dir, "--policy")
  run = build_run(config_lib.load(run_dir / "config.yaml", list(overrides)), run_dir, purpose="eval", echo=False)
  try:
    if samples < 1 or run.rows.local % samples:
      raise config_lib.ConfigError(f"--samples {samples}: must divide the run's {run.rows.local} rollout rows "
                                   "(train.tasks_per_iteration x train.group_size)")
    run_state, _ = resume.restore(run)
    _, done = over_tasks(run, run_state.train, tasks, samples=samples,
                         env_seeds=lambda start, rows: seeds.policy_filter(seed, start, rows),
                         rng_seed=lambda start: seeds.policy_filter_rng(seed, start))
    wins = np.zeros(len(tasks), np.int64)
    for index, trajs in done:
      wins[index] = sum(bool(t.verifier.passed) for t in trajs)
    return np.asarray(multihost.host_sum(wins), np.int64)
  finally:
    run.close()
