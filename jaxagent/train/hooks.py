"""The periodic work of a run, as hooks over its stream of iteration records (`records.IterationRecord`).

`loop.run_loop` runs every hook after every iteration, in the order of `default_hooks`:

  StoreTrajectories  every iteration    the record's trajectories to the run's store (before any checkpoint)
  WatchHealth        rl iterations      the training-health monitors: their next value, the alerts that start
  LogMetrics         every iteration    the metrics line (metrics.jsonl, TensorBoard), alerts, the progress bar
  HeldOutEval        train.eval_every   held-out success (and once before training, when nothing has run)
  Promotion          stage.promote_every   the stage's promotion check (`promote_at`)
  StageSwitch        a stage's end      the next stage starts (after its last iteration, or a promotion)
  Checkpoint         train.checkpoint_every, the run's last iteration, a promotion, a stop
  FinalEval          at the end         held-out success of the final policy
  Plots              at the end         learning-curve figures (train.plots)

A hook is called as `hook(session, state, record) -> (state, record)`; `start(session, state)` runs once before
the first iteration and `finish(session, state)` once after the last (in the same order), whatever stopped the
run. Hooks change the run's state only through what they return; what they share besides it (the logger, the
writer, the progress bar, whether the run stops) is the `Session`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping

import jax

from jaxagent import config as config_lib
from jaxagent import trajectory_store
from jaxagent.train import metrics as metrics_lib
from jaxagent.train.records import IterationRecord, metric_line
from jaxagent.train.resume import save
from jaxagent.train.rollouts import EvalResult, evaluate
from jaxagent.train.run import Run
from jaxagent.train.state import RunState

# What the progress bar shows of an iteration's metrics, when present.
BAR_FIELDS = ((metrics_lib.REWARD_MEAN, "reward"), (metrics_lib.SUCCESS_RATE, "succ"), ("sft/nll", "nll"),
              ("offline/nll", "nll"), ("offline/loss", "loss"), ("rft/kept_total", "kept"), ("rft/nll", "nll"))


@dataclasses.dataclass
class Session:
  """What the hooks of one `run_loop` call share besides the run's state.

  Attributes:
    run: the run's parts.
    logger: the metrics logger (process 0 writes).
    writer: this process's trajectory writer (None: train.save_trajectories off).
    env_change: the env change a resume allowed (recorded in every checkpoint).
    start_wall: the wall-clock origin of the run's `wall_seconds` (a resumed run continues its count).
    bar: the progress bar over the run's iterations (set before the first iteration).
    saved: the iteration of the newest checkpoint.
    stop: why a hook stopped the run (None: it goes on).
    before, after: held-out results before training and of the final policy (None: not evaluated).
  """
  run: Run
  logger: metrics_lib.MetricsLogger
  writer: trajectory_store.TrajectoryWriter | None
  env_change: Mapping[str, Any] | None
  start_wall: float
  bar: metrics_lib.Progress | None = None
  saved: int = -1
  stop: str | None = None
  before: EvalResult | None = None
  after: EvalResult | None = None

  def checkpoint(self, state: RunState) -> None:
    save(self.run, state, self.writer, self.env_change)
    self.saved = state.iteration


class Hook:
  """Work after iterations; each hook decides when it is due."""

  def start(self, session: Session, state: RunState) -> RunState:
    return state

  def __call__(self, session: Session, state: RunState, record: IterationRecord
               ) -> tuple[RunState, IterationRecord]:
    return state, record

  def finish(self, session: Session, state: RunState) -> RunState:
    return state


class StoreTrajectories(Hook):
  """The record's trajectories to this process's store, flushed; its time in `time/write_s` and the
  iteration's seconds."""

  def __call__(self, session, state, record):
    if session.writer is None or not record.stored:
      return state, record
    t0 = time.perf_counter()
    for t in record.stored:
      session.writer.write(t)
    session.writer.flush()
    write_s = time.perf_counter() - t0
    return state, dataclasses.replace(record, metrics={**record.metrics, "time/write_s": write_s},
                                      seconds=record.seconds + write_s)


class WatchHealth(Hook):
  """The training-health monitors over rl iterations (`train.monitors`): the state's next monitors value,
  their flags in the metrics, the alerts that start here; `action: stop` stops the run on one."""

  def __call__(self, session, state, record):
    if record.paradigm != "rl":
      return state, record
    metrics = dict(record.metrics)
    monitors, alerts = state.monitors.observe(state.iteration, metrics)
    if alerts and session.run.config.train.monitors.action == "stop":
      session.stop = "; ".join(a.message for a in alerts)
    return (dataclasses.replace(state, monitors=monitors),
            dataclasses.replace(record, metrics=metrics, alerts=tuple(alerts)))


class LogMetrics(Hook):
  """The iteration's metrics line (`records.metric_line`), its alerts as warnings, the progress bar."""

  def __call__(self, session, state, record):
    line = metric_line(session.run, state, record)
    session.logger.log(int(state.train.step), line, iteration=state.iteration)
    for alert in record.alerts:
      session.bar.write(f"WARNING iteration {state.iteration}: {alert.message}")
    session.bar.update(1, **{short: f"{line[key]:.2f}" for key, short in BAR_FIELDS if key in line})
    return state, record

  def finish(self, session, state):
    if session.bar is not None:
      session.bar.close()
    return state


Evaluate = Callable[..., tuple[Any, EvalResult]]  # `rollouts.evaluate`'s signature


@dataclasses.dataclass
class HeldOutEval(Hook):
  """Held-out success every `train.eval_every` iterations (not at the last: `FinalEval` is), and once before
  the first iteration of a run that has not started."""
  evaluate: Evaluate = evaluate

  def start(self, session, state):
    cfg = session.run.config
    if not cfg.train.eval_episodes or state.iteration != 0:
      return state
    train, session.before = self.evaluate(session.run, state.train)
    session.run.print(f"{'after cold start:' if cfg.train.bc_steps else 'before training: '} "
                      f"{session.before.line()}")
    session.logger.log(int(train.step), {**session.before.metrics(), **state.counters}, iteration=state.iteration)
    return dataclasses.replace(state, train=train)

  def __call__(self, session, state, record):
    cfg, it = session.run.config, state.iteration
    every = cfg.train.eval_every
    if not (cfg.train.eval_episodes and every and it % every == 0 and it < cfg.train.iterations):
      return state, record
    if state.stream is not None:
      state.stream.pause()  # the eval needs the env pool's slots
    train, result = self.evaluate(session.run, state.train)
    session.bar.write(f"iteration {it}: {result.line()}")
    session.logger.log(int(train.step), result.metrics(), iteration=it)
    return dataclasses.replace(state, train=train), record


@dataclasses.dataclass
class Promotion(Hook):
  """A stage with `promote_at`: every `promote_every` iterations of it (not at its end), its success on
  `promote_split`; reaching `promote_at` promotes the run to the next stage (`record.promoted`)."""
  evaluate: Evaluate = evaluate

  def __call__(self, session, state, record):
    stage = config_lib.stages(session.run.config)[state.stage]
    it, end = state.iteration, state.stage_start + stage.steps
    if stage.promote_at is None or (it - state.stage_start) % stage.promote_every or it >= end:
      return state, record
    train, check = self.evaluate(session.run, state.train, stage.promote_split, stage.promote_episodes,
                                 stage.env_options)
    session.logger.log(int(train.step), {f"curriculum/{stage.name}/success_rate": check.success_rate}, iteration=it)
    promoted = check.success_rate >= stage.promote_at
    if promoted:
      session.bar.write(f"iteration {it}: stage {stage.name!r} promoted ({check.line()} >= {stage.promote_at})")
    return dataclasses.replace(state, train=train), dataclasses.replace(record, promoted=promoted)


class StageSwitch(Hook):
  """The next stage starts after a promotion or the stage's last iteration (a checkpoint taken now resumes in
  it). The last stage stays current at its end: resumed with more iterations (or steps), it goes on."""

  def __call__(self, session, state, record):
    stages = config_lib.stages(session.run.config)
    end = state.stage_start + stages[state.stage].steps
    if record.promoted or (state.iteration == end and state.stage + 1 < len(stages)):
      state = dataclasses.replace(state, stage=state.stage + 1, stage_start=state.iteration)
    return state, record


class Checkpoint(Hook):
  """A checkpoint every `train.checkpoint_every` iterations, at the run's last, after a promotion and when a
  hook stops the run; at the end, one of the final state if it has none, then every save is waited on."""

  def __call__(self, session, state, record):
    cfg, it = session.run.config, state.iteration
    if it % cfg.train.checkpoint_every == 0 or it == cfg.train.iterations or record.promoted or session.stop:
      session.checkpoint(state)
    if session.stop:
      session.bar.write(f"stopping at iteration {it} (train.monitors.action=stop), checkpointed: resume with "
                        "--resume after changing what collapsed (e.g. a lower optim.learning_rate)")
    return state, record

  def finish(self, session, state):
    if session.saved != state.iteration:
      session.checkpoint(state)
    session.run.checkpointer.wait()
    return state


@dataclasses.dataclass
class FinalEval(Hook):
  """Held-out success of the final policy (train.eval_episodes), the episodes in flight of an async stream
  finished first."""
  evaluate: Evaluate = evaluate

  def finish(self, session, state):
    run = session.run
    if state.stream is not None:
      state.stream.pause()
    if not run.config.train.eval_episodes:
      return state
    train, session.after = self.evaluate(run, state.train)
    label = paradigm_label(run.config)
    run.print(f"{'after RL:        ' if label in ('GRPO', 'GiGPO', 'PPO') else f'after {label}:':<17} "
              f"{session.after.line()}")
    session.logger.log(int(train.step), {**session.after.metrics(), **state.counters}, iteration=state.iteration)
    return dataclasses.replace(state, train=train)


class Plots(Hook):
  """The learning-curve figures of the run's metrics (train.plots), by process 0."""

  def finish(self, session, state):
    if session.run.config.train.plots and jax.process_index() == 0:
      metrics_lib.write_plots(session.run.run_dir)
    return state


def paradigm_label(cfg: config_lib.Config) -> str:
  """What the run trains, for the progress bar and the final line: the rl algorithm, or the paradigms."""
  stages = config_lib.stages(cfg)
  kinds = sorted({s.paradigm for s in stages if not s.kind.cold_start}, key=list(config_lib.PARADIGMS).index)
  if kinds in ([], ["rl"]):
    return "PPO" if cfg.algo.name == "ppo" else "GiGPO" if cfg.algo.advantage == "gigpo" else "GRPO"
  return "+".join(k.upper() for k in kinds)


def default_hooks() -> list[Hook]:
  """Every hook of a training run, in the order they run (the module docstring)."""
  return [StoreTrajectories(), WatchHealth(), LogMetrics(), HeldOutEval(), Promotion(), StageSwitch(), Checkpoint(),
          FinalEval(), Plots()]
