"""`jaxagent train CONFIG`: the run loop. A run is a cold start (behavior cloning on scripted demonstrations),
then its curriculum stages' iterations, each followed by the hooks.

  train(config, run_dir, resume, hooks)   build the run, restore or start its state, run the loop
  run_loop(run, state, hooks=...)         cold start, then per iteration: `iteration_of(run, state)(run, state)`
                                          -> (state, IterationRecord), then every hook in order
  behavior_cloning(run, state, logger)    the cold start's masked NLL on scripted demos (through the engine)

Where the rest lives, by name:
  jaxagent/train/state.py       RunState: everything that decides the next step; what a checkpoint saves
  jaxagent/train/rl.py          the sync rl iteration (dynamic sampling, branches)
  jaxagent/train/freshness.py   the one_step_off / async rl iteration (a rollout stream, a learner thread)
  jaxagent/train/paradigms.py   the sft, offline and rft iterations
  jaxagent/train/records.py     IterationRecord and the metric lines
  jaxagent/train/hooks.py       store, monitors, log, eval, promotion, stage switch, checkpoint, plots
  jaxagent/train/resume.py      save and restore a RunState; jaxagent/train/rollouts.py collect and evaluate

Env seeds and sampling keys are derived from (seed, iteration), so a run restored from its state's checkpoint
continues exactly where an uninterrupted one would be.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxagent import seeds
from jaxagent import config as config_lib
from jaxagent import trajectory as tr
from jaxagent import trajectory_store
from jaxagent.config import Config
from jaxagent.rollout.actors import ScriptedActions
from jaxagent.train import hooks as hooks_lib
from jaxagent.train import metrics as metrics_lib
from jaxagent.train import freshness, paradigms, rl
from jaxagent.train.records import IterationRecord
from jaxagent.train.resume import restore
from jaxagent.train.rollouts import EvalResult
from jaxagent.train.run import Run, build_run
from jaxagent.train.state import RunState, TrainState

# One iteration of a stage: (run, state) -> (state, what it did).
Iteration = Callable[[Run, RunState], tuple[RunState, IterationRecord]]


def set_reference(run: Run, state: TrainState) -> TrainState:
  """Makes the current policy the frozen KL reference (a copy; unchanged without `algo.kl_coef`)."""
  if run.config.algo.kl_coef <= 0:
    return state
  return jax.jit(lambda s: s.replace(ref_params=s.params["policy"]), donate_argnums=0,
                 out_shardings=run.policy.layout.state_shardings)(state)


def scripted_action(run: Run, line: str) -> str:
  """A scripted action (written `NAME ARG`) in the run's action syntax (a JSON call for `json`); an env that
  takes free text (`ActionParser.free_text`) writes its scripts as the model's replies already."""
  if run.interface.syntax == "line" or run.interface.env_info.parser.free_text:
    return line
  text = run.interface.action_parser.format(run.interface.env_info.parser.parse(line))
  # A demonstration the env would refuse is an error here, not a silent BC target.
  run.interface.action_parser.parse(text)
  return text


def demonstrations(run: Run, n: int, seed: int, options: Mapping[str, Any] | None = None) -> list[tr.Trajectory]:
  """`n` scripted demonstrations, run through the rollout engine like sampled episodes (same framing, records).

  Every process builds all `n` (the behavior-cloning batches pick rows from the same global list). `options`:
  the task generator's (a stage's), else env.options.
  """
  cfg = run.config
  options = cfg.env.options if options is None else options
  tasks = run.interface.env_spec.tasks("train", n, seeds.demos(seed), **dict(options or {}))
  out = []
  for start in range(0, n, run.rows.local):
    chunk = tasks[start:start + run.rows.local]
    # The episode's seed goes to the script too: a seeded env (guess draws its secret from it) needs it.
    scripts = [[run.interface.chat.action_tokens(scripted_action(run, a))
                for a in run.interface.env_spec.demo(task, start + k, **dict(cfg.env.demo_options or {}))]
               for k, task in enumerate(chunk)]
    trajs, _ = run.rollout.engine.run(ScriptedActions(scripts, cfg.rollout.max_context), chunk,
                                      list(range(start, start + len(chunk))), group_size=1, policy_version=-1)
    out += [dataclasses.replace(t, metadata={**t.metadata, "source": "scripted_demo"}) for t in trajs]
  return out


def behavior_cloning(run: Run, state: TrainState, logger: metrics_lib.MetricsLogger, *, begin: int = 0,
                     end: int | None = None, stage: int = 0) -> TrainState:
  """Masked NLL on scripted demonstrations from optimizer step `begin` to `end` (default: the cold start, 0 to
  `train.bc_steps`); resumes mid-way. `stage`: the curriculum stage (its task options; stage 0's demos are the
  cold start's of every run so far)."""
  cfg, train = run.config, run.config.train
  end = train.bc_steps if end is None else end
  start_step = int(state.step)
  if start_step >= end:
    return state
  t0 = time.perf_counter()
  spec = config_lib.stages(cfg)[stage]
  demos = demonstrations(run, train.bc_demos or max((end - begin) * train.bc_batch_size // 4, train.bc_batch_size),
                         seeds.stage(cfg.run.seed, stage, first=0), spec.env_options)
  rng = np.random.default_rng(seeds.bc_order(cfg.run.seed, start_step))
  label = "cold start (BC)" if not cfg.curriculum.stages else f"stage {spec.name} (BC)"
  bar = metrics_lib.Progress(end - start_step, label, run.echo)
  shown = start_step  # steps the bar has counted (it redraws with the logged metrics, every 10 steps)
  for step in range(start_step, end):
    pick = rng.choice(len(demos), train.bc_batch_size, replace=False)
    mine = pick[jax.process_index() * run.rows.bc:(jax.process_index() + 1) * run.rows.bc]
    batch = paradigms.supervised_batch(run, [demos[i] for i in mine])
    normalizer = jnp.float32(paradigms.loss_normalizer(run, batch))
    state, m = run.steps.bc(state, run.policy.layout.to_global(batch), normalizer)
    if step % 10 == 0 or step == end - 1:
      m = jax.device_get(m)
      # The last step's line also has the stage's wall time (demonstrations included; a resumed stage: since
      # the resume).
      done = {metrics_lib.BC_SECONDS: time.perf_counter() - t0} if step == end - 1 else {}
      logger.log(int(state.step), {"bc/nll": m["nll"], "bc/grad_norm": m["grad_norm"], **done})
      bar.update(step + 1 - shown, nll=f"{float(m['nll']):.3f}")
      shown = step + 1
  bar.close()
  return state


def new_run_dir(config: Config) -> Path:
  """`<root>/<name>-<timestamp>`; in a multi-process run every process gets process 0's timestamp."""
  text = datetime.datetime.now().strftime("%Y%m%d%H%M%S")
  if jax.process_count() > 1:  # as digits: a 14-digit integer would not survive JAX's default 32-bit ints
    digits = multihost_utils.broadcast_one_to_all(np.frombuffer(text.encode(), np.uint8).astype(np.int32))
    text = bytes(np.asarray(digits, np.uint8).tolist()).decode()
  run_dir = Path(config.run.root) / f"{config.run.name}-{text[:8]}-{text[8:]}"
  run_dir.mkdir(parents=True, exist_ok=jax.process_count() > 1)
  return run_dir


def _open_writer(run: Run, resume_meta: Mapping[str, Any] | None) -> trajectory_store.TrajectoryWriter | None:
  """This process's trajectory writer; on a resume, shards written after the checkpoint are set aside first
  (their iterations are replayed)."""
  if not run.config.train.save_trajectories:
    return None
  prefix = trajectory_store.shard_prefix(jax.process_index(), jax.process_count())
  if resume_meta is not None:
    shards = int(resume_meta.get("trajectory_shards", {}).get(prefix, 0))
    moved = trajectory_store.discard_from(run.run_dir / "trajectories", shards, prefix=prefix)
    if moved:
      run.print(f"set aside {len(moved)} trajectory shard(s) written after that checkpoint "
                "(trajectories/discarded/): their iterations are replayed")
  return trajectory_store.TrajectoryWriter(run.run_dir / "trajectories", prefix=prefix)


def _cold_start(run: Run, session: hooks_lib.Session, run_state: RunState) -> RunState:
  """The bc stages, one after the other (counted in optimizer steps), and one checkpoint after the last."""
  cfg = run.config
  stages = config_lib.stages(cfg)
  after_cold_start = next((i for i, st in enumerate(stages) if not st.kind.cold_start), len(stages))
  if int(run_state.train.step) >= cfg.train.bc_steps:
    return run_state
  begin = 0
  for i, stage in enumerate(stages[:after_cold_start]):
    end = begin + stage.steps
    if int(run_state.train.step) < end:
      state = behavior_cloning(run, run_state.train, session.logger, begin=begin, end=end, stage=i)
      if end == cfg.train.bc_steps:  # one checkpoint after all bc stages (all at iteration 0: one step)
        run_state = dataclasses.replace(run_state, train=set_reference(run, state), stage=after_cold_start,
                                        stage_start=run_state.iteration)
        session.checkpoint(run_state)
      else:
        run_state = dataclasses.replace(run_state, train=state, stage=i + 1)
    begin = end
  return run_state


def iteration_of(run: Run, run_state: RunState) -> Iteration:
  """The iteration function of the current stage: by its paradigm, and for rl by `train.freshness`."""
  if config_lib.stages(run.config)[run_state.stage].paradigm != "rl":
    return paradigms.iteration
  if run.config.train.freshness == "sync":
    return rl.iteration
  return _stream_iteration


def _stream_iteration(run: Run, run_state: RunState) -> tuple[RunState, IterationRecord]:
  """An rl iteration of `train.freshness` one_step_off / async: the stage's stream, started (or restarted from
  its saved state) by its first iteration, does it."""
  if run_state.stream is None:
    run_state = dataclasses.replace(run_state, stream=freshness.Freshness(run, run_state), saved_stream=None)
  return run_state.stream.iteration(run_state)


def run_loop(run: Run, run_state: RunState, *, resume_meta: Mapping[str, Any] | None = None,
             hooks: Sequence[hooks_lib.Hook] | None = None) -> tuple[RunState, EvalResult | None, EvalResult | None]:
  """Cold start, then every stage's iterations, each followed by the hooks (jaxagent/train/hooks.py).

  Args:
    run: the parts.
    run_state: where to start (`run.new_state()`, or `restore`'s).
    resume_meta: the restored checkpoint's metadata when resuming (trajectory shards, allowed env change).
    hooks: the hooks, in order (default: `hooks.default_hooks()`).
  Returns:
    (final state, held-out result after the cold start or None, after training or None).
  """
  cfg = run.config
  hooks = hooks_lib.default_hooks() if hooks is None else list(hooks)
  run.print(f"RUN_DIR {run.run_dir.resolve()}")
  if jax.process_index() == 0:
    (run.run_dir / "config.yaml").write_text(config_lib.dump(cfg))
  logger = metrics_lib.MetricsLogger(run.run_dir, enabled=jax.process_index() == 0,
                                     resume_step=int(run_state.train.step) if resume_meta is not None else None)
  session = hooks_lib.Session(run=run, logger=logger, writer=_open_writer(run, resume_meta),
                              env_change=(resume_meta or {}).get("env_change_allowed"),
                              start_wall=time.perf_counter() - run_state.counters[metrics_lib.WALL_SECONDS],
                              saved=run_state.iteration)
  stages = config_lib.stages(cfg)
  try:
    run_state = _cold_start(run, session, run_state)
    for hook in hooks:
      run_state = hook.start(session, run_state)
    session.bar = metrics_lib.Progress(cfg.train.iterations, hooks_lib.paradigm_label(cfg), run.echo)
    session.bar.update(run_state.iteration)
    while run_state.stage < len(stages) and session.stop is None:
      if run_state.iteration >= run_state.stage_start + stages[run_state.stage].steps:
        # The stage has no iteration left (resumed at its end, or 0 steps).
        if run_state.stage + 1 == len(stages):
          break
        run_state = dataclasses.replace(run_state, stage=run_state.stage + 1, stage_start=run_state.iteration)
        continue
      run_state, record = iteration_of(run, run_state)(run, run_state)
      run_state = dataclasses.replace(run_state, counters=metrics_lib.advance(
          run_state.counters, wall_s=time.perf_counter() - session.start_wall))
      for hook in hooks:
        run_state, record = hook(session, run_state, record)
    for hook in hooks:
      run_state = hook.finish(session, run_state)
  finally:
    if run_state.stream is not None:
      run_state.stream.close()
    if session.writer is not None:
      session.writer.close()
    logger.close()
  return run_state, session.before, session.after


def train(config: Config, *, run_dir: Path | None = None, resume: bool = False,
          hooks: Sequence[hooks_lib.Hook] | None = None) -> RunState:
  """Trains per `config` in `run_dir` (a new one unless resuming). Returns the final state. `hooks`: the
  periodic work after each iteration, in order (default: `hooks.default_hooks()`).

  `jax.distributed` is initialized first (a no-op for a single process), so the same command runs on one
  machine or on every host of a cluster.
  """
  from jaxagent import distributed
  distributed.initialize(config.distributed)
  if resume and run_dir is None:
    raise ValueError("--resume needs the run directory")
  run_dir = run_dir or new_run_dir(config)
  run_dir.mkdir(parents=True, exist_ok=True)
  run = build_run(config, run_dir)
  try:
    run_state, meta = restore(run) if resume else (run.new_state(), None)
    run_state, _, _ = run_loop(run, run_state, resume_meta=meta, hooks=hooks)
  finally:
    run.close()
  return run_state
