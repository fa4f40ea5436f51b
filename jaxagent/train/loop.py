"""`jaxagent train CONFIG`: behavior-cloning cold start, then GRPO/PPO over multi-turn env episodes.

Stage functions over the parts of a `Run` (jaxagent/train/run.py); each takes the train state and returns the
new one, nothing holds it. Rollouts (`collect`, `evaluate`) are jaxagent/train/rollouts.py; checkpoints and
resuming (`save`, `restore`) jaxagent/train/resume.py; both are re-exported here.

  prepare_batch, update                       jaxagent/train/learner.py (re-exported)
  behavior_cloning(run, state, logger)        -> state                         (scripted demos through the engine)
  rl_iteration(run, progress, writer)         -> progress, metrics
  train(config, run_dir, resume)              the loop: restore, stages, checkpoints, logs

Everything that decides the next step lives in one checkpoint (params, optimizer, step, policy version, RNG,
grain iterator state); env seeds and sampling keys are derived from (seed, iteration), so a resumed run
continues exactly where an uninterrupted one would be.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import envs
from jaxagent import multihost, seeds
from jaxagent import config as config_lib
from jaxagent import trajectory as tr
from jaxagent import trajectory_store
from jaxagent.config import Config
from jaxagent.rollout.engine import ScriptedActions
from jaxagent.tasks import supply as task_supply
from jaxagent.train import metrics as metrics_lib
from jaxagent.train import freshness, learner, monitors, paradigms
from jaxagent.train.learner import TRUNCATIONS, Prepared, group_statistics, prepare_batch, update  # noqa: F401
from jaxagent.train.resume import EnvChangedError, check_env_versions, lora_settings, restore, save  # noqa: F401
from jaxagent.train.rollouts import (EvalResult, branch_round, collect, evaluate, record_outcomes,  # noqa: F401
                                     sample_round, trained_rows)
from jaxagent.train.run import Run, build_run
from jaxagent.train.state import LoopState, TrainState

def set_reference(run: Run, state: TrainState) -> TrainState:
  """Makes the current policy the frozen KL reference (a copy; unchanged without `algo.kl_coef`)."""
  if run.config.algo.kl_coef <= 0:
    return state
  return jax.jit(lambda s: s.replace(ref_params=s.params["policy"]), donate_argnums=0,
                 out_shardings=run.layout.state_shardings)(state)


def scripted_action(run: Run, line: str) -> str:
  """A scripted action (written `NAME ARG`) in the run's action syntax (a JSON call for `json`)."""
  if run.action_syntax == "line":
    return line
  text = run.action_parser.format(run.demo_parser.parse(line))
  run.action_parser.parse(text)  # a demonstration the env would refuse is an error here, not a silent BC target
  return text


def demonstrations(run: Run, n: int, seed: int, options: Mapping[str, Any] | None = None) -> list[tr.Trajectory]:
  """`n` scripted demonstrations, run through the rollout engine like sampled episodes (same framing, records).

  Every process builds all `n` (the behavior-cloning batches pick rows from the same global list). `options`:
  the task generator's (a stage's), else env.options.
  """
  cfg = run.config
  options = cfg.env.options if options is None else options
  tasks = run.env_spec.tasks("train", n, seeds.demos(seed), **dict(options or {}))
  out = []
  for start in range(0, n, run.rows):
    chunk = tasks[start:start + run.rows]
    # The episode's seed goes to the script too: a seeded env (guess draws its secret from it) needs it.
    scripts = [[run.chat.action_tokens(scripted_action(run, a))
                for a in run.env_spec.demo(task, start + k, **dict(cfg.env.demo_options or {}))]
               for k, task in enumerate(chunk)]
    trajs, _ = run.engine.run(ScriptedActions(scripts, cfg.rollout.max_context), chunk,
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
    mine = pick[jax.process_index() * run.bc_rows:(jax.process_index() + 1) * run.bc_rows]
    batch = paradigms.supervised_batch(run, [demos[i] for i in mine])
    state, m = run.bc_step(state, run.layout.to_global(batch), jnp.float32(paradigms.loss_normalizer(run, batch)))
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


def _dynamic_sampling(run: Run, state: TrainState, iteration: int, sampled: list[tr.Trajectory], stats,
                      supply: task_supply.TaskSupply | None = None):
  """DAPO dynamic sampling (Yu et al. 2025): a group whose rewards are all equal carries no GRPO signal.

  The batch keeps its B task slots. While some slot (on any process) holds such a flat group, and at most
  `train.dynamic_sampling_rounds` times, a new batch of tasks is rolled out and each flat slot takes the
  group rolled out in its own slot if that one varies. Slot by slot, so the choice does not depend on how
  the slots are spread over processes; rounds are decided collectively, so every process draws the same
  task batches and the data order stays exact across resume and topologies. Slots still flat at the end
  are trained as they are (advantage 0) and counted.

  Returns (state, trained trajectories, sampled-but-unused trajectories, merged stats, metrics).
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
  supply = run.tasks if supply is None else supply
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
  return state, [t for group in chosen for t in group], unused, stats, metrics


def rl_iteration(run: Run, progress: LoopState, writer: trajectory_store.TrajectoryWriter | None,
                 start_wall: float) -> tuple[LoopState, dict[str, Any]]:
  """Rollout (with dynamic sampling), batch preparation, update(s) and trajectory storage for one iteration,
  on the tasks of the current curriculum stage."""
  cfg = run.config
  it, state = progress.iteration, progress.state
  supply = run.supply(progress.stage)
  timer = metrics_lib.StageTimer()
  wall0 = time.perf_counter()
  with timer("rollout"):
    state, first = sample_round(run, state, supply, it)
    sampled, stats, curriculum = first.trajectories, first.stats, first.curriculum
    trajs, extra, refill = sampled, [], {}
    if cfg.train.dynamic_sampling:
      state, trajs, extra, stats, refill = _dynamic_sampling(run, state, it, sampled, stats, supply)
    branched = {}
    if cfg.rollout.branch.at:  # continuations from the sampled trajectories' states, trained with them
      t0 = time.perf_counter()
      state, branches, bstats = branch_round(run, state, first, it)
      trajs = sampled + branches
      replayed = sum(int(t.metadata["branch"]["turn"]) for t in branches)  # env steps a replay took
      branched = {"branch/trajectories": len(branches), "branch/replayed_steps": replayed,
                  "branch/diverged": sum(bool(t.metadata["branch"].get("diverged")) for t in branches),
                  "time/branch_s": time.perf_counter() - t0,
                  "_steps": replayed + (bstats.env_steps if bstats else 0),
                  "_tokens": bstats.action_tokens if bstats else 0}
      if branches:
        branched["branch/success_rate"] = float(np.mean([bool(t.verifier.passed) for t in branches]))
  with timer("advantages"):
    prepared = prepare_batch(run, state, trajs)
  with timer("update"):
    state, m = update(run, state, prepared)
  if writer is not None:
    with timer("write"):
      for t, why in zip(trajs, prepared.excluded):
        writer.write(learner.stored(t, why))
      for t in extra:  # sampled by dynamic sampling but not trained on: kept, marked
        writer.write(dataclasses.replace(t, metadata={**t.metadata, "trained": False}))
      writer.flush()

  # Policy metrics describe the first-round sample (dynamic sampling's refills are selected, not sampled).
  totals = multihost.host_gather(np.asarray([t.reward.total for t in sampled], np.float64))
  passed = multihost.host_gather(np.asarray([bool(t.verifier.passed) for t in sampled]))
  stage = timer.pop()
  names = [t.value for t in envs.Termination]
  # Termination counts, env steps and tokens, and env determinism measured (episodes replayed after a worker
  # restart and how many diverged, since this process started): one collective, every process summed.
  counts = multihost.host_sums({
      "terminations": np.asarray([sum(t.termination.value == n for t in sampled) for n in names]),
      "replays": run.pool.replays, "replay_divergences": run.pool.replay_divergences,
      "env_steps": stats.env_steps + branched.pop("_steps", 0),
      "action_tokens": stats.action_tokens + branched.pop("_tokens", 0)})
  counters = metrics_lib.advance(progress.counters, env_interactions=counts["env_steps"],
                                 action_tokens=counts["action_tokens"],
                                 device_s=stats.decode_s + stats.extend_s + stage.get("time/update_s", 0.0),
                                 wall_s=time.perf_counter() - start_wall)
  # Like reward_mean, the group statistics describe the first-round sample (what the policy does; the "echo
  # trap" diagnostic of docs/design.md §2.6), with the estimator's grouping.
  spread = group_statistics(run, sampled, prepared.estimate if trajs is sampled else None)
  out = {
      metrics_lib.REWARD_MEAN: float(totals.mean()), metrics_lib.SUCCESS_RATE: float(passed.mean()), **spread,
      **prepared.stats,
      "learning_rate": float(run.schedule(int(state.step) - 1)),
      "time/reset_s": stats.reset_s, "time/decode_s": stats.decode_s, "time/env_s": stats.env_s,
      "time/extend_s": stats.extend_s, "time/rollout_idle_s": stats.idle_s,
      **({"time/weight_transfer_s": stats.transfer_s} if run.layout.disaggregated else {}),
      metrics_lib.ITERATION_SECONDS: time.perf_counter() - wall0, **metrics_lib.device_memory(),
      **stage, **{k: float(v) for k, v in m.items()}, **counters, **curriculum, **refill, **branched,
  }
  # Like reward_mean, over the first-round sample. Reward components: this process's rows (their names
  # come from the env and may differ between processes, so they are not gathered).
  for key in sorted({k for t in sampled for k in t.reward.components}):
    out[f"reward/{key}"] = float(np.mean([t.reward.components.get(key, 0.0) for t in sampled]))
  out.update({f"termination/{n}": int(c) for n, c in zip(names, counts["terminations"]) if c})
  ident = monitors.task_identification(sampled)  # this process's rows, like the reward components
  if ident is not None:
    out[monitors.TASK_IDENTIFICATION] = ident
  out.update({"env/replays": int(counts["replays"]), "env/replay_divergences": int(counts["replay_divergences"])})
  return dataclasses.replace(progress, state=state, iteration=it + 1, counters=counters), out


# ------------------------------------------------------------------------------------------------
# Checkpoints.


# ------------------------------------------------------------------------------------------------
# The loop.


def new_run_dir(config: Config) -> Path:
  """`<root>/<name>-<timestamp>`; in a multi-process run every process gets process 0's timestamp."""
  text = datetime.datetime.now().strftime("%Y%m%d%H%M%S")
  if jax.process_count() > 1:  # as digits: a 14-digit integer would not survive JAX's default 32-bit ints
    digits = multihost_utils.broadcast_one_to_all(np.frombuffer(text.encode(), np.uint8).astype(np.int32))
    text = bytes(np.asarray(digits, np.uint8).tolist()).decode()
  run_dir = Path(config.run.root) / f"{config.run.name}-{text[:8]}-{text[8:]}"
  run_dir.mkdir(parents=True, exist_ok=jax.process_count() > 1)
  return run_dir


# What the progress bar shows of an iteration's metrics, when present.
_BAR_FIELDS = ((metrics_lib.REWARD_MEAN, "reward"), (metrics_lib.SUCCESS_RATE, "succ"), ("sft/nll", "nll"),
               ("offline/nll", "nll"), ("offline/loss", "loss"), ("rft/kept_total", "kept"), ("rft/nll", "nll"))


def _bar_label(cfg: Config, stages) -> str:
  kinds = sorted({s.paradigm for s in stages if not s.kind.cold_start}, key=list(config_lib.PARADIGMS).index)
  if kinds in ([], ["rl"]):
    return "PPO" if cfg.algo.name == "ppo" else "GiGPO" if cfg.algo.advantage == "gigpo" else "GRPO"
  return "+".join(k.upper() for k in kinds)


@dataclasses.dataclass
class _Session:
  """What run_loop's actions share: the metrics logger, the trajectory writer, the env change a resume allowed
  (recorded in every checkpoint), the wall-clock origin and the progress bar."""
  logger: metrics_lib.MetricsLogger
  writer: trajectory_store.TrajectoryWriter | None
  env_change: Mapping[str, Any] | None
  start_wall: float
  bar: metrics_lib.Progress | None = None
  stream: freshness.Freshness | None = None  # train.freshness one_step_off / async: built with the rl stage
  monitors: monitors.Monitors | None = None
  resume_stream: Mapping[str, Any] | None = None  # what the restored checkpoint holds of it


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


def _cold_start(run: Run, session: _Session, progress: LoopState) -> LoopState:
  """The bc stages, one after the other (counted in optimizer steps), and one checkpoint after the last."""
  cfg = run.config
  stages = config_lib.stages(cfg)
  after_cold_start = next((i for i, st in enumerate(stages) if not st.kind.cold_start), len(stages))
  if int(progress.state.step) >= cfg.train.bc_steps:
    return progress
  begin = 0
  for i, stage in enumerate(stages[:after_cold_start]):
    end = begin + stage.steps
    if int(progress.state.step) < end:
      state = behavior_cloning(run, progress.state, session.logger, begin=begin, end=end, stage=i)
      if end == cfg.train.bc_steps:  # one checkpoint after all bc stages (all at iteration 0: one step)
        progress = dataclasses.replace(progress, state=set_reference(run, state), stage=after_cold_start,
                                       stage_start=progress.iteration)
        save(run, progress, session.writer, session.env_change, session.stream, session.monitors)
      else:
        progress = dataclasses.replace(progress, state=state, stage=i + 1)
    begin = end
  return progress


def _after_iteration(run: Run, session: _Session, progress: LoopState, end: int) -> tuple[LoopState, bool, bool]:
  """What follows every iteration of a stage ending at iteration `end`, in this order: the periodic held-out
  eval, the stage's promotion check, the switch to the next stage, the checkpoint. Returns (progress, promoted,
  checkpointed)."""
  cfg, bar, logger = run.config, session.bar, session.logger
  stages = config_lib.stages(cfg)
  it, i = progress.iteration, progress.stage
  stage = stages[i]
  promoted = False
  every = cfg.train.eval_every
  if cfg.train.eval_episodes and every and it % every == 0 and it < cfg.train.iterations:
    if session.stream is not None:
      session.stream.pause()  # the eval needs the env pool's slots
    state, mid = evaluate(run, progress.state)
    progress = dataclasses.replace(progress, state=state)
    bar.write(f"iteration {it}: {mid.line()}")
    logger.log(int(state.step), mid.metrics(), iteration=it)
  if stage.promote_at is not None and (it - progress.stage_start) % stage.promote_every == 0 and it < end:
    state, check = evaluate(run, progress.state, stage.promote_split, stage.promote_episodes, stage.env_options)
    progress = dataclasses.replace(progress, state=state)
    logger.log(int(state.step), {f"curriculum/{stage.name}/success_rate": check.success_rate}, iteration=it)
    if check.success_rate >= stage.promote_at:
      promoted = True
      bar.write(f"iteration {it}: stage {stage.name!r} promoted ({check.line()} >= {stage.promote_at})")
  # The next stage starts here (a checkpoint taken now resumes in it). The last stage stays current at its end:
  # resumed with more iterations (or steps), it goes on.
  if promoted or (it == end and i + 1 < len(stages)):
    progress = dataclasses.replace(progress, stage=i + 1, stage_start=it)
  checkpointed = it % cfg.train.checkpoint_every == 0 or it == cfg.train.iterations or promoted
  if checkpointed:
    save(run, progress, session.writer, session.env_change, session.stream, session.monitors)
  return progress, promoted, checkpointed


def run_loop(run: Run, progress: LoopState, *, resume_meta: Mapping[str, Any] | None = None
             ) -> tuple[LoopState, EvalResult | None, EvalResult | None]:
  """Cold start, held-out eval, RL iterations with checkpoints and eval, final eval.

  Args:
    run: the parts.
    progress: where to start (a new state, or `restore`'s).
    resume_meta: the restored checkpoint's metadata when resuming (trajectory shards, allowed env change).
  Returns:
    (final progress, held-out result after the cold start or None, after RL or None).
  """
  cfg = run.config
  resumed = resume_meta is not None
  run.print(f"RUN_DIR {run.run_dir.resolve()}")
  if jax.process_index() == 0:
    (run.run_dir / "config.yaml").write_text(config_lib.dump(cfg))
  logger = metrics_lib.MetricsLogger(run.run_dir, enabled=jax.process_index() == 0,
                                     resume_step=int(progress.state.step) if resumed else None)
  session = _Session(logger=logger, writer=_open_writer(run, resume_meta),
                     env_change=(resume_meta or {}).get("env_change_allowed"),
                     start_wall=time.perf_counter() - progress.counters[metrics_lib.WALL_SECONDS],
                     resume_stream=(resume_meta or {}).get("stream"),
                     monitors=monitors.Monitors(cfg.train.monitors, (resume_meta or {}).get("monitors")))
  before = after = None
  stages = config_lib.stages(cfg)
  explicit = bool(cfg.curriculum.stages)
  try:
    progress = _cold_start(run, session, progress)
    if cfg.train.eval_episodes and progress.iteration == 0:
      state, before = evaluate(run, progress.state)
      progress = dataclasses.replace(progress, state=state)
      run.print(f"{'after cold start:' if cfg.train.bc_steps else 'before training: '} {before.line()}")
      logger.log(int(state.step), {**before.metrics(), **progress.counters}, iteration=progress.iteration)
    bar = session.bar = metrics_lib.Progress(cfg.train.iterations, _bar_label(cfg, stages), run.echo)
    bar.update(progress.iteration)
    saved = progress.iteration
    data = None  # a non-rl stage's data (paradigms.StageData), built when the stage starts or resumes
    stopped = False  # a monitor stopped the run (train.monitors.action=stop)
    while progress.stage < len(stages) and not stopped:
      i, stage = progress.stage, stages[progress.stage]
      end = progress.stage_start + stage.steps
      promoted = False
      while progress.iteration < end and not promoted:
        if stage.paradigm == "rl" and cfg.train.freshness != "sync":
          if session.stream is None:
            session.stream = freshness.Freshness(run, progress, session.resume_stream)
          progress, m = session.stream.iteration(progress, session.writer, session.start_wall)
        elif stage.paradigm == "rl":
          progress, m = rl_iteration(run, progress, session.writer, session.start_wall)
        else:
          if data is None or data.index != i:
            data = paradigms.prepare(run, progress, i)
          progress, m = paradigms.iteration(run, progress, data, session.writer, session.start_wall)
        it = progress.iteration
        if explicit:
          m["curriculum/stage"] = i
        alerts = session.monitors.observe(it, m) if stage.paradigm == "rl" else []
        logger.log(int(progress.state.step), m, iteration=it)
        for alert in alerts:
          bar.write(f"WARNING iteration {it}: {alert.message}")
        bar.update(1, **{short: f"{m[key]:.2f}" for key, short in _BAR_FIELDS if key in m})
        progress, promoted, checkpointed = _after_iteration(run, session, progress, end)
        if checkpointed:
          saved = it
        if alerts and cfg.train.monitors.action == "stop":
          if not checkpointed:
            save(run, progress, session.writer, session.env_change, session.stream, session.monitors)
            saved = it
          bar.write(f"stopping at iteration {it} (train.monitors.action=stop), checkpointed: resume with --resume "
                    "after changing what collapsed (e.g. a lower optim.learning_rate)")
          stopped = True
          break
      if stopped:
        break
      if progress.stage == i:  # the stage has no iteration left (resumed at its end, or 0 steps)
        if i + 1 == len(stages):
          break
        progress = dataclasses.replace(progress, stage=i + 1, stage_start=progress.iteration)
    if saved != progress.iteration:
      save(run, progress, session.writer, session.env_change, session.stream, session.monitors)
    bar.close()
    run.checkpointer.wait()
    if session.stream is not None:
      session.stream.pause()
    if cfg.train.eval_episodes:
      state, after = evaluate(run, progress.state)
      progress = dataclasses.replace(progress, state=state)
      label = _bar_label(cfg, stages)
      run.print(f"{'after RL:        ' if label in ('GRPO', 'GiGPO', 'PPO') else f'after {label}:':<17} {after.line()}")
      logger.log(int(state.step), {**after.metrics(), **progress.counters}, iteration=progress.iteration)
    if cfg.train.plots and jax.process_index() == 0:
      metrics_lib.write_plots(run.run_dir)
  finally:
    if session.stream is not None:
      session.stream.close()
    if session.writer is not None:
      session.writer.close()
    logger.close()
  return progress, before, after


def train(config: Config, *, run_dir: Path | None = None, resume: bool = False) -> LoopState:
  """Trains per `config` in `run_dir` (a new one unless resuming). Returns the final progress.

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
    progress, meta = restore(run) if resume else (LoopState(state=run.init_state()), None)
    progress, _, _ = run_loop(run, progress, resume_meta=meta)
  finally:
    run.close()
  return progress
