"""End-to-end trainer: smoke run, stored-trajectory contract, no recompilation, exact resume after SIGKILL."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxagent import assembly
from jaxagent import config as config_lib
from jaxagent import trajectory as tr
from jaxagent import trajectory_store
from jaxagent.train import hooks as hooks_lib
from jaxagent.train import learner, loop, resume, rl, rollouts
from jaxagent.train import metrics as metrics_lib
from jaxagent.train.run import build_run
from tests import _iterate

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "model.init.hidden_size=32", "model.init.intermediate_size=64", "model.init.num_hidden_layers=1",
    "model.init.num_attention_heads=2", "model.init.num_key_value_heads=1", "model.init.head_dim=16",
    "train.tasks_per_iteration=2", "train.group_size=4", "train.bc_steps=3", "train.bc_batch_size=8",
    "train.checkpoint_every=1", "train.eval_episodes=8", "env.pool.kind=inprocess", "train.plots=true",
]


def _config(tmp_path, *extra):
  return config_lib.load("tiny_cpu", TINY + [f"run.root={tmp_path}"] + list(extra))


def test_grpo_smoke_run_and_stored_trajectory_contract(tmp_path, capsys):
  config = _config(tmp_path, "train.iterations=2", "train.eval_every=1")
  progress = loop.train(config, run_dir=tmp_path / "run")
  out = capsys.readouterr().out
  assert "after cold start: eval success" in out and "after RL:" in out
  assert "iteration 1: eval success" in out and "iteration 2: eval" not in out  # eval_every; the end once
  run = tmp_path / "run"
  for name in ("config.yaml", "metrics.jsonl", "checkpoints", "trajectories", "tensorboard", "plots"):
    assert (run / name).exists(), name
  assert sorted(p.name for p in (run / "plots").glob("*.png")), "no learning curves written"
  assert config_lib.load(run / "config.yaml") == config
  rl = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
  assert len(rl) == 2 and all(r["env/replays"] == 0 and r["env/replay_divergences"] == 0 for r in rl)
  assert progress.iteration == 2 and int(progress.train.policy_version) == 3 + 2  # 3 BC + 2 RL updates

  # `jaxagent eval` restores the latest checkpoint and reports, without writing into the run directory.
  from jaxagent import cli
  metrics_before = (run / "metrics.jsonl").read_bytes()
  assert cli.main(["eval", "--checkpoint", str(run / "checkpoints"), "--episodes", "8", "--split", "tune"]) == 0
  report = capsys.readouterr().out
  assert "tune success" in report and "95% CI" in report and "termination" in report
  assert (run / "metrics.jsonl").read_bytes() == metrics_before

  stored = list(trajectory_store.read(run / "trajectories"))
  trajs = [t for t in stored if t.metadata.get("trained", True)]  # the default config samples dynamically
  assert len(trajs) == 2 * 2 * 4 and len(stored) % 4 == 0
  assert sorted({t.policy_version for t in trajs}) == [3, 4]
  for t in trajs:
    policy = t.roles == tr.Role.POLICY
    assert policy.any() and (t.loss_mask == policy).all()
    assert np.isfinite(t.behavior_logprobs[policy]).all() and (t.behavior_logprobs[policy] <= 0).all()
    assert not t.loss_mask[np.isin(t.roles, [tr.Role.TOOL, tr.Role.PROMPT])].any()
    assert isinstance(t.termination, tr.Termination)
    assert t.env.name == "calculator" and t.env.version
    assert t.env.network == "host"  # an in-process pool does not cut the network, and the record says so
    # Every sampled token records the version that sampled it: a sync rollout has one.
    assert (t.behavior_versions[policy] == t.policy_version).all() and (t.behavior_versions[~policy] == -1).all()
    for turn in t.turns:
      assert turn.policy_version == t.policy_version
      if turn.observation is not None:
        start, stop = turn.observation.span
        # An error reply to a rejected action is an ERROR observation, any other reply a TOOL one.
        error = turn.outcome in ("parser_rejected_continued", "invalid_action_continued")
        assert (t.roles[start:stop] == (tr.Role.ERROR if error else tr.Role.TOOL)).all()


_COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: _COMPILES.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
# A program loaded from the persistent compilation cache (tests/conftest.py) was still compiled for this run.
jax.monitoring.register_event_listener(
    lambda name, **kw: _COMPILES.append(name) if name == "/jax/compilation_cache/cache_hits" else None)


def _run(tmp_path, *overrides):
  """The parts of a run and its initial progress (no loop)."""
  run = build_run(_config(tmp_path, *overrides), tmp_path / "run")
  return run, run.new_state()


def test_the_run_sets_its_matmul_precision_before_it_builds_any_program(tmp_path):
  """model.matmul_precision reaches jax_default_matmul_precision (read when each program is traced); float32,
  the default, makes the programs' float32 dots HIGHEST (exact on a GPU, not TF32)."""
  try:
    run, _ = _run(tmp_path, "model.matmul_precision=tensorfloat32", "train.eval_episodes=0")
    run.close()
    assert jax.config.jax_default_matmul_precision == "tensorfloat32"
    run, _ = _run(tmp_path, "train.eval_episodes=0")
    run.close()
    assert jax.config.jax_default_matmul_precision == "float32"
    x = jax.numpy.ones((4, 4))
    assert "precision = [HIGHEST, HIGHEST]" in jax.jit(lambda a: a @ a).lower(x).as_text()
  finally:
    jax.config.update("jax_default_matmul_precision", "float32")  # as tests/conftest.py sets it


def test_no_recompilation_after_the_first_iteration(tmp_path):
  import logging
  # Start from empty caches, so the first iteration compiles everything it needs whatever ran before (a
  # module-level jit cached by an earlier test hid a later compile once).
  jax.clear_caches()
  # One batch length throughout: with train.batch_length=bucket a batch of a length not seen yet compiles once
  # (test_update_batches_take_the_smallest_bucket_and_equal_the_context_length_update).
  run, progress = _run(tmp_path, "train.iterations=3", "train.bc_steps=0", "train.eval_episodes=0",
                       "train.batch_length=max_context")
  names = []  # what compiled after the first iteration, for the failure message
  handler = logging.Handler()
  handler.emit = lambda record: names.append(record.getMessage()[:300])
  try:
    before = len(_COMPILES)
    progress, _ = _iterate.rl_iteration(run, progress)
    first = len(_COMPILES) - before
    logging.getLogger("jax").addHandler(handler)
    with jax.log_compiles(True):
      for _ in range(2):
        progress, _ = _iterate.rl_iteration(run, progress)
    later = len(_COMPILES) - before - first
  finally:
    logging.getLogger("jax").removeHandler(handler)
    run.close()
  assert first > 0, "the compile counter saw nothing: the check would be vacuous"
  assert later == 0, f"{later} XLA compilations after the first iteration: {[n for n in names if 'ompil' in n]}"


def test_update_batches_take_the_smallest_bucket_and_equal_the_context_length_update(tmp_path):
  # train.batch_length=bucket (the library default) cuts the padding; the update is the context-length one up to float
  # rounding (the sums over tokens are blocked differently): same loss, gradient norm and parameters.
  from jaxagent import buckets
  from jaxagent.train import learner, rollouts
  run, progress = _run(tmp_path, "train.bc_steps=0", "train.eval_episodes=0", "train.dynamic_sampling=false",
                       "rollout.max_context=256", "train.batch_length=bucket")  # tiny_cpu.yaml pins max_context
  try:
    state, sampled = rollouts.sample_round(run, progress.train, progress.supply, 0)
    trajs = sampled.trajectories
    longest = max(len(t) for t in trajs)
    prepared = learner.prepare_batch(run, state, trajs)
    length = prepared.batch.shape[1]
    assert length == buckets.fit(longest, buckets.batch_lengths(256)) < 256, (longest, length)
    assert length < 1.5 * max(longest, buckets.BATCH_MIN)
    cfg = run.config
    full_run = dataclasses.replace(run, config=dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, batch_length="max_context")))
    full = learner.prepare_batch(full_run, state, trajs)
    assert full.batch.shape == (prepared.batch.shape[0], 256) and full.normalizer == prepared.normalizer
    np.testing.assert_array_equal(np.asarray(full.batch.tokens)[:, :length], np.asarray(prepared.batch.tokens))
    assert not np.asarray(full.batch.segment_ids)[:, length:].any()
    rng = np.random.default_rng(0)  # advantages that are not all zero, so that the gradient is not either
    advantages = np.where(np.asarray(full.batch.loss_mask), rng.normal(size=full.batch.shape), 0.0)
    results = []
    for p in (prepared, full):
      batch = p.batch.replace(advantages=jax.numpy.asarray(advantages[:, :p.batch.shape[1]], np.float32))
      copy = jax.tree.map(lambda x: jax.numpy.array(x, copy=True), state)
      new, metrics = run.steps.rl(copy, batch, np.float32(p.normalizer), None, np.float32(0.0))
      results.append((jax.device_get(new.params), jax.device_get(metrics)))
    (cut_params, cut), (full_params, whole) = results
    assert whole["grad_norm"] > 0 and whole["loss_tokens"] == cut["loss_tokens"] > 0
    np.testing.assert_allclose(cut["grad_norm"], whole["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(cut["loss"], whole["loss"], rtol=1e-5, atol=1e-7)
    lr = run.config.optim.learning_rate
    for a, b, old in zip(jax.tree.leaves(cut_params), jax.tree.leaves(full_params), jax.tree.leaves(state.params)):
      assert np.abs(np.asarray(b) - np.asarray(old)).max() > lr / 2  # the step moved the weights
      np.testing.assert_allclose(a, b, rtol=0, atol=lr / 100)
  finally:
    run.close()


def _final_params(run_dir: Path, step: int):
  with ocp.CheckpointManager((run_dir / "checkpoints").resolve(),
                             options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
    assert mngr.latest_step() == step
    state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  return jax.tree.map(np.asarray, state)


def _train_cmd(run_root: Path, *extra):
  overrides = TINY + [f"run.root={run_root}", "train.iterations=5", "train.eval_episodes=0", "train.plots=false",
                      "env.pool.kind=local", "env.pool.num_workers=2"]
  cmd = [sys.executable, "-m", "jaxagent", "train", "tiny_cpu"]
  for o in overrides:
    cmd += ["--set", o]
  return cmd + list(extra)


# Training-health monitors that stop the run as soon as their windows are full (two of 2 iterations): the
# template-collapse rule with its thresholds at their loosest (any identification <= 0.99 after any best window
# >= 0.01, any entropy above 1 % of its best). A run killed after iteration 2 stops where the uninterrupted one does
# only if the two iterations before the kill are still in the monitors' windows after the resume.
STOPPING_MONITORS = ["train.monitors.window=2", "train.monitors.identification_floor=0.99",
                     "train.monitors.identification_peak=0.01", "train.monitors.entropy_drop=0.99",
                     "train.monitors.action=stop"]


def deterministic_lines(run_dir: Path) -> list[dict]:
  """metrics.jsonl without what the clock and the machine's load decide: timestamps, durations, device seconds,
  memory, and the env workers' restarts and replays since this process started (`env/replays`: a worker that
  misses its action timeout under load is restarted and its episode replayed; the trained data is the same)."""
  lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
  return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))
           and k not in ("time", metrics_lib.WALL_SECONDS, metrics_lib.DEVICE_SECONDS, metrics_lib.BC_SECONDS,
                         "env/replays", "env/replay_divergences")}
          for r in lines]


def line_differences(a: list[dict], b: list[dict], tolerance: float = 0.0) -> list[tuple]:
  """(line index, key, value in a, value in b) of every difference between two metrics logs: an assertion
  message that names what differs (a failed `==` on the lists shows one side, truncated). `tolerance`: floats
  may differ by that much, relative or absolute (0: bitwise); everything else must be equal."""
  def same(x, y):
    if tolerance and isinstance(x, float) and isinstance(y, float):
      return math.isclose(x, y, rel_tol=tolerance, abs_tol=tolerance)
    return x == y
  out = [(len(a), "<line count>", len(a), len(b))] if len(a) != len(b) else []
  for i, (x, y) in enumerate(zip(a, b)):
    out += [(i, k, x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if not same(x.get(k), y.get(k))]
  return out


def _latest_step(run_dir: Path) -> int:
  with ocp.CheckpointManager((run_dir / "checkpoints").resolve(),
                             options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
    return mngr.latest_step()


# The continuous schedule feeds whichever rows are ready together, so env timing picks a feed's width: the same
# tokens, but behavior log-probs equal to 1e-5 only (docs/reference.md, rollout.schedule). The lockstep schedule
# feeds each turn's rows together: bitwise.
CONTINUOUS_LOGPROB_TOLERANCE = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("sampler,schedule", [("uniform", "continuous"), ("frontier", "lockstep")])
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, sampler, schedule):
  """Killed after its checkpoint at iteration 2 and resumed, a run writes the same metrics.jsonl as the
  uninterrupted run (times aside), trains the same weights on the same data, and its monitors stop it where
  they stop the uninterrupted run, from windows that hold iterations from before the kill. Lockstep: bitwise;
  continuous: the same tokens, floats to the behavior log-probs' tolerance."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONPATH=str(ROOT))
  tolerance = CONTINUOUS_LOGPROB_TOLERANCE if schedule == "continuous" else 0.0
  # frontier: a small active set, so tasks are drawn again and retire within 5 iterations.
  extra = ["--set", f"tasks.sampler={sampler}", "--set", f"rollout.schedule={schedule}"]
  extra += (["--set", "tasks.active=3", "--set", "tasks.min_attempts=4", "--set", "tasks.unsolved_attempts=8"]
            if sampler == "frontier" else [])
  extra += [a for o in STOPPING_MONITORS for a in ("--set", o)]
  subprocess.run(_train_cmd(tmp_path / "a", *extra), check=True, env=env, cwd=ROOT, capture_output=True,
                 timeout=600)
  (run_a,) = (tmp_path / "a").iterdir()

  proc = subprocess.Popen(_train_cmd(tmp_path / "b", *extra), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 600
  killed_after = None
  while time.monotonic() < deadline and proc.poll() is None:
    runs = list((tmp_path / "b").glob("*/checkpoints/2")) if (tmp_path / "b").exists() else []
    if runs:  # a finished step directory (orbax writes under a temporary name, then renames)
      proc.send_signal(signal.SIGKILL)
      killed_after = 2
      break
    time.sleep(0.02)
  assert proc.wait(timeout=60) == -signal.SIGKILL and killed_after, "the run was not killed mid-training"
  (run_b,) = (tmp_path / "b").iterdir()
  resumed = subprocess.run([sys.executable, "-m", "jaxagent", "train", "--resume", str(run_b)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from" in resumed.stdout

  # The monitors stopped both runs at the first iteration their windows were full: after the kill.
  stop = _latest_step(run_a)
  assert stop == 4 and _latest_step(run_b) == stop, (stop, _latest_step(run_b))
  assert "stopping at iteration 4 (train.monitors.action=stop)" in resumed.stdout
  assert not line_differences(deterministic_lines(run_a), deterministic_lines(run_b), tolerance)

  a, b = _final_params(run_a, stop), _final_params(run_b, stop)
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b) > 0
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_allclose(x, y, rtol=tolerance, atol=tolerance)  # 0: bitwise on CPU

  # Data order, policy versions and tokens continue: the same tasks in the same order, nothing repeated or
  # skipped. (With the default's dynamic sampling: refill rounds included, trained or not.)
  order = lambda run: [(t.task.id, t.policy_version, t.env.seed, t.metadata.get("trained", True),
                        tuple(t.tokens.tolist()))
                       for t in trajectory_store.read(run / "trajectories")]
  assert order(run_a) == order(run_b)
  assert sum(trained for _, _, _, trained, _ in order(run_a)) == stop * 2 * 4
  if sampler == "frontier":  # the curriculum's state and metrics continue too
    last = [r for r in deterministic_lines(run_a) if r.get("iteration") == stop][-1]
    assert any(k.startswith("curriculum/") for k in last)
    assert len({t.task.id for t in trajectory_store.read(run_a / "trajectories")}) < stop * 2 * 3  # drawn again


def test_ppo_smoke_iteration_trains_the_value_head(tmp_path):
  config = _config(tmp_path, "train.iterations=1", "train.bc_steps=0", "train.eval_episodes=0",
                   "algo.name=ppo", "algo.advantage=gae", "algo.gae_lambda=0.95")
  run = build_run(config, tmp_path / "run")
  try:
    progress, metrics = _iterate.rl_iteration(run, run.new_state())  # end to end
    assert np.isfinite(metrics["value_loss"]) and np.isfinite(metrics["loss"])
    # Solved demonstrations have return 1: GAE targets are non-zero, so the value head must move.
    demos = loop.demonstrations(run, run.rows.local, seed=0)
    prepared = learner.prepare_batch(run, progress.train, demos)
    adv = prepared.estimate
    assert prepared.value_normalizer == sum(len(t.turns) for t in demos)
    assert all(t.reward.total == 1.0 for t in demos), "scripted demonstrations solve their tasks"
    last = np.asarray([len(t.turns) - 1 for t in demos])
    # GAE return at the last turn = r + 0 bootstrap = 1 whatever V is; earlier turns are λ-returns (> 0).
    np.testing.assert_allclose(np.asarray(adv.returns)[np.arange(len(demos)), last], 1.0, atol=1e-5)
    assert (np.asarray(adv.returns)[:, 0] > 0).all()
    before = np.asarray(progress.train.params["value"]["b"][...]).copy()
    state, m = learner.update(run, progress.train, prepared)
    after = np.asarray(state.params["value"]["b"][...])

    # An episode cut off (max turns, budget, context) is not terminal: GAE bootstraps from V(s_T), read at its
    # last token; a completed one from 0.
    cut = [dataclasses.replace(t, termination=tr.Termination.MAX_TURNS) if i % 2 else t
           for i, t in enumerate(demos)]
    plain = assembly.assemble(cut, shape=assembly.BatchShape(length=run.config.rollout.max_context, rows=run.rows.local,
                                                             pad_id=run.interface.tokenizer.pad_id))
    values = np.asarray(run.steps.value_fn(state.params, run.policy.layout.to_global(plain)))
    returns = np.asarray(learner.prepare_batch(run, state, cut).estimate.returns)
  finally:
    run.close()
  for i, t in enumerate(cut):
    bootstrap = values[i, len(t) - 1] if i % 2 else 0.0
    assert abs(returns[i, last[i]] - (1.0 + bootstrap)) < 1e-5, (i, returns[i, last[i]], bootstrap)
  assert any(abs(values[i, len(t) - 1]) > 1e-4 for i, t in enumerate(cut) if i % 2), "V(s_T) = 0: vacuous"
  assert float(m["value_loss"]) > 0
  assert not np.array_equal(before, after), "value head received no gradient"


def test_algo_config_combinations_are_checked_when_the_config_loads(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="needs algo.advantage='gae'"):
    _config(tmp_path, "algo.name=ppo")
  with pytest.raises(config_lib.ConfigError, match="needs a value function"):
    _config(tmp_path, "algo.advantage=gae")
  # `jaxagent config` refuses them too, with the same message.
  from jaxagent import cli
  assert cli.main(["config", "tiny_cpu", "--set", "algo.name=ppo"]) == 2
  # Topology: a config that names its process count is checked against it at load time.
  with pytest.raises(config_lib.ConfigError, match=r"train.tasks_per_iteration=2: must be divisible by the 4"):
    _config(tmp_path, "distributed.num_processes=4")
  with pytest.raises(config_lib.ConfigError, match=r"train.micro_batches=3: must divide the 8 trajectories"):
    _config(tmp_path, "train.micro_batches=3")


def test_reference_policy_is_frozen_at_the_start_of_rl_and_checkpointed(tmp_path):
  # Placed by mesh.rules.reference (replicated here) while the policy is FSDP-sharded over 4 devices.
  run, progress = _run(tmp_path, "algo.kl_coef=0.5", "train.eval_episodes=0", "optim.learning_rate=1e-2",
                       "mesh.rules.reference=replicated", "mesh.ici.data=2", "mesh.ici.fsdp=4")
  try:
    layout = run.policy.layout.state_shardings
    assert all(s.is_fully_replicated for s in jax.tree.leaves(layout.ref_params))
    assert not all(s.is_fully_replicated for s in jax.tree.leaves(layout.params["policy"]))
    with metrics_lib.MetricsLogger(tmp_path / "run", tensorboard=False) as logger:
      state = loop.set_reference(run, loop.behavior_cloning(run, progress.train, logger))
    start = jax.tree.map(np.array, state.params["policy"])
    assert jax.tree.all(jax.tree.map(np.array_equal, start, jax.tree.map(np.asarray, state.ref_params)))
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state.ref_params))
    progress, first = _iterate.rl_iteration(run, dataclasses.replace(progress, train=state))
    progress, second = _iterate.rl_iteration(run, progress)
    moved = jax.tree.map(np.asarray, progress.train.params["policy"])
    ref = jax.tree.map(np.asarray, progress.train.ref_params)
    resume.save(run, progress, None)
    run.checkpointer.wait()
    _, restored, _ = run.checkpointer.restore_latest(progress.train, run.policy.model_config)
    # Resuming with algo.kl_coef turned off drops the stored reference; turned on, a checkpoint without one
    # makes its policy the reference.
    with pytest.warns(RuntimeWarning, match="dropped"):
      _, without, _ = run.checkpointer.restore_latest(progress.train.replace(ref_params=None), run.policy.model_config)
    run.checkpointer.save(99, progress.train.replace(ref_params=None), {"iteration": 99}, run.policy.model_config, {})
    run.checkpointer.wait()
    with pytest.warns(RuntimeWarning, match="becomes the reference"):
      _, with_new_ref, _ = run.checkpointer.restore_latest(progress.train, run.policy.model_config)
  finally:
    run.close()
  assert without.ref_params is None
  assert jax.tree.all(jax.tree.map(np.array_equal, jax.tree.map(np.asarray, with_new_ref.ref_params), moved))
  # The first update starts at the reference: KL is 0 up to float32 rounding (the two forwards are fused
  # differently); after an update with lr 1e-2 it is many orders of magnitude larger.
  assert abs(first["kl"]) < 1e-10, first["kl"]
  assert second["kl"] > 1e-6, "after an update the policy differs from the reference"
  assert not jax.tree.all(jax.tree.map(np.array_equal, start, moved)), "the policy did not move"
  assert jax.tree.all(jax.tree.map(np.array_equal, start, ref)), "the reference changed during RL"
  assert jax.tree.all(jax.tree.map(np.array_equal, ref, jax.tree.map(np.asarray, restored.ref_params)))


def test_bc_draws_its_batches_from_train_bc_demos_distinct_demonstrations(tmp_path, monkeypatch):
  """train.bc_demos sets how many distinct demonstrations the cold start draws its batches from (the default
  keeps a quarter of the rows the steps consume). With calculator's mixed log under a 2-turn budget the
  demonstrations are both habits: the direct solver's complete, the step-by-step solver's end at max_turns."""
  made = []
  real = loop.demonstrations
  monkeypatch.setattr(loop, "demonstrations", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
  picked = []
  real_batch = loop.paradigms.supervised_batch
  monkeypatch.setattr(loop.paradigms, "supervised_batch",
                      lambda run, trajs: picked.extend(t.id for t in trajs) or real_batch(run, trajs))
  run, progress = _run(tmp_path, "train.bc_demos=40", "env.max_turns=2", "train.eval_episodes=0",
                       "env.demo_options={style: mixed, direct_fraction: 0.25}")
  try:
    with metrics_lib.MetricsLogger(tmp_path / "run", tensorboard=False) as logger:
      loop.behavior_cloning(run, progress.train, logger)
  finally:
    run.close()
  (demos,) = made
  assert len(demos) == len({t.id for t in demos}) == 40
  assert len(picked) == 3 * 8 and set(picked) <= {t.id for t in demos}
  assert len(set(picked)) > 8, "three batches of 8 from 40 demonstrations repeat few of them"
  ends = [t.termination.value for t in demos]
  direct = [len(t.turns) == 2 and bool(t.verifier.passed) for t in demos]
  assert set(ends) == {"completed", "max_turns"} and sum(direct) == ends.count("completed")
  assert 0.1 <= sum(direct) / 40 <= 0.45, sum(direct)
  with pytest.raises(config_lib.ConfigError, match=r"train\.bc_demos=4: .* set train\.bc_demos >= 8"):
    _config(tmp_path, "train.bc_demos=4")


def test_dynamic_sampling_refills_zero_variance_groups_within_its_bound(tmp_path):
  """Selection logic on scripted rewards: flat slots take varied groups of later rounds in the same slot;
  rounds are bounded and counted."""
  from types import SimpleNamespace
  from jaxagent.rollout.episodes import RolloutStats
  run, progress = _run(tmp_path, "train.tasks_per_iteration=3", "train.group_size=2", "train.dynamic_sampling=true",
                       "train.dynamic_sampling_rounds=2", "train.eval_episodes=0")
  # Rewards per round (3 groups of 2): round 0 has one varied group, round 1 one more, round 2 none. None: a
  # reset that failed (no turn, reward 0): round 1's last group is flat, not varied.
  rounds = [[1, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, None], [1, 1, 0, 0, 1, 1]]
  calls = []

  def fake_collect(run, state, tasks, seeds, *, group_size, rng, evaluation=False):
    rewards = rounds[len(calls)]
    calls.append([t.id for t in tasks])
    trajs = [SimpleNamespace(name=f"r{len(calls) - 1}g{i // 2}", reward=SimpleNamespace(total=float(r or 0)),
                             turns=() if r is None else ("turn",), termination=tr.Termination.COMPLETED,
                             verifier=SimpleNamespace(passed=bool(r)))
             for i, r in enumerate(rewards)]
    return state, trajs, RolloutStats(1.0, 1.0, 1.0, 1.0, 6, 10)

  from jaxagent.train import rollouts  # rounds collect through it
  real_collect = rollouts.collect
  try:
    rollouts.collect = fake_collect
    state, first, stats = fake_collect(run, progress.train, progress.supply.draw(0, 0), None, group_size=2, rng=None)
    refilled = rl.dynamic_sampling(run, state, 0, first, stats, progress.supply)
    state, trained, unused, stats, metrics = (refilled.state, refilled.trained, refilled.unused, refilled.stats,
                                              refilled.metrics)
    rollouts.collect = real_collect  # and one real iteration end to end: every sampled trajectory is stored
    with trajectory_store.TrajectoryWriter(tmp_path / "run" / "trajectories") as writer:
      _, real = _iterate.rl_iteration(run, dataclasses.replace(progress, train=state), writer)
  finally:
    rollouts.collect = real_collect
    run.close()
  stored = list(trajectory_store.read(tmp_path / "run" / "trajectories"))
  unused_stored = [t for t in stored if t.metadata.get("trained") is False]
  assert len(stored) - len(unused_stored) == 6
  assert len(stored) == 2 * real["dynamic_sampling/groups_sampled"]
  assert 0 <= real["dynamic_sampling/rounds"] <= 2
  names = [t.name for t in trained]
  # Slot 0 varies in round 0; slot 1 takes round 1's varied group; slot 2 stays flat after the 2 extra rounds.
  assert names == ["r0g0", "r0g0", "r1g1", "r1g1", "r0g2", "r0g2"]
  assert sorted({t.name for t in unused}) == ["r0g1", "r1g0", "r1g2", "r2g0", "r2g1", "r2g2"]
  assert metrics == {"dynamic_sampling/rounds": 2, "dynamic_sampling/groups_sampled": 9,
                     "dynamic_sampling/zero_variance_groups_trained": 1}
  assert stats.env_steps == 18 and stats.decode_s == 3.0
  assert len(calls) == 3 and len({tuple(c) for c in calls}) == 3, "each round draws a new batch of tasks"


def test_all_masked_batch_is_an_explicit_skip(tmp_path):
  """docs/design.md §2.2: nothing to learn from -> skipped=1 and the state unchanged (no AdamW decay, same
  versions)."""
  run, progress = _run(tmp_path, "train.bc_steps=0", "train.eval_episodes=0", "optim.weight_decay=0.1")
  try:
    prepared = learner.prepare_batch(run, progress.train, loop.demonstrations(run, run.rows.local, seed=0))
    prepared = dataclasses.replace(prepared, batch=prepared.batch.replace(
        loss_mask=jax.numpy.zeros_like(prepared.batch.loss_mask)), normalizer=0.0)
    before = jax.tree.map(np.array, progress.train.params)
    step, version = int(progress.train.step), int(progress.train.policy_version)
    state, m = learner.update(run, progress.train, prepared)
    after = jax.tree.map(np.asarray, state.params)
  finally:
    run.close()
  assert float(m["skipped"]) == 1.0 and float(m["loss"]) == 0.0
  assert jax.tree.all(jax.tree.map(np.array_equal, before, after)), "a skipped step changed the weights"
  assert (int(state.step), int(state.policy_version)) == (step, version)


def test_training_refuses_greedy_rollouts(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="temperature > 0"):
    _config(tmp_path, "rollout.temperature=0")


@pytest.mark.parametrize("sampling", [("rollout.temperature=0.6",), ("rollout.top_p=0.9",), ("rollout.top_k=20",),
                                      ("rollout.temperature=0.7", "rollout.top_k=20", "rollout.top_p=0.9")],
                         ids=["temperature", "top_p", "top_k", "all_three"])
def test_rollouts_are_on_policy_for_the_learner(tmp_path, sampling):
  """The learner scores each token under the distribution it was drawn from (temperature, and top-k / top-p cut
  at the recorded threshold): the first update's ratio π_θ/μ is 1 for every token."""
  run, progress = _run(tmp_path, *sampling, "train.bc_steps=0", "train.eval_episodes=0")
  try:
    with trajectory_store.TrajectoryWriter(tmp_path / "stored") as writer:
      _, m = _iterate.rl_iteration(run, progress, writer)
    stored = list(trajectory_store.read(tmp_path / "stored"))
  finally:
    run.close()
  assert m["loss_tokens"] > 0
  assert abs(m["ratio_min"] - 1) < 1e-4 and abs(m["ratio_max"] - 1) < 1e-4, (m["ratio_min"], m["ratio_max"])
  assert m["policy_lag"] == 0.0
  tau = np.concatenate([t.sampling_thresholds[t.loss_mask] for t in stored])
  if any(o.startswith(("rollout.top_k", "rollout.top_p")) for o in sampling):
    # The behavior log-probs stored are the truncated ones: the cut is recorded and kept less than all the mass.
    assert np.isfinite(tau).mean() > 0.9 and 0 < m["kept_mass"] < 1, (np.isfinite(tau).mean(), m["kept_mass"])
  else:
    assert np.isnan(tau).all() and "kept_mass" not in m


def test_run_dir_starts_then_continues_a_restarted_job(tmp_path, capsys):
  from jaxagent import cli
  sets = [x for o in TINY + ["train.bc_steps=0", "train.eval_episodes=0", "train.plots=false"] for x in ("--set", o)]
  run = tmp_path / "job"
  assert cli.main(["train", "tiny_cpu", "--run-dir", str(run), *sets, "--set", "train.iterations=1"]) == 0
  assert "resumed from" not in capsys.readouterr().out
  # The restarted job runs the same command line: it continues in the same directory.
  assert cli.main(["train", "tiny_cpu", "--run-dir", str(run), "--set", "train.iterations=2"]) == 0
  assert "resumed from" in capsys.readouterr().out
  assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]


def test_mixed_precision_run_rolls_out_and_trains_in_bf16_on_float32_master_weights(tmp_path):
  """model.compute_dtype=bfloat16: the rollout copy and the step run in bf16, the state stays float32, and
  the first update is on-policy (the learner's bf16 log-probs match the bf16 sampler's: ratio ~ 1)."""
  config = _config(tmp_path, "train.iterations=2", "train.eval_episodes=0", "model.compute_dtype=bfloat16")
  progress = loop.train(config, run_dir=tmp_path / "run")
  assert {x.dtype for x in jax.tree.leaves((progress.train.params, progress.train.opt_state))
          if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)} == {np.dtype(np.float32)}
  rl = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "reward_mean" in r]
  assert len(rl) == 2 and all(np.isfinite(r["loss"]) for r in rl)
  assert abs(rl[0]["ratio_mean"] - 1.0) < 0.02, rl[0]["ratio_mean"]


def test_frontier_run_records_outcomes_and_checkpoints_its_state(tmp_path):
  config = _config(tmp_path, "train.iterations=2", "train.eval_episodes=8", "train.plots=false",
                   "tasks.sampler=frontier", "tasks.active=4", "train.dynamic_sampling=true")
  loop.train(config, run_dir=tmp_path / "run")
  rows = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
          if "reward_mean" in r]
  assert len(rows) == 2 and all(0 < r["curriculum/drawn_signal"] <= 0.25 for r in rows)
  with ocp.CheckpointManager((tmp_path / "run" / "checkpoints").resolve(),
                             options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
    meta = mngr.restore(2, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  state = meta["data_iterator"]
  assert state["kind"] == "frontier" and len(state["active"]) == 4
  # Every sample of the run is in the active tasks' counts or in a retired one's (counted, not kept).
  attempts = sum(n for _, _, _, n, *_ in state["active"])
  retired = sum(v for k, v in state["counters"].items() if k.startswith("retired_"))
  stored = list(trajectory_store.read(tmp_path / "run" / "trajectories"))
  assert attempts <= len(stored) and (attempts == len(stored) or retired > 0)


def test_training_refuses_eval_tasks_leaked_into_its_train_tasks(tmp_path):
  from jaxagent.tasks import pipeline
  from jaxagent.train import run as run_lib
  config = _config(tmp_path, "train.iterations=20", "train.eval_episodes=8")  # it can draw all 32 train tasks
  held = run_lib.held_out_tasks(config, run_lib.envs.get("calculator"))
  train = run_lib.envs.get("calculator").tasks("train", 30, 0)
  leaked = [dataclasses.replace(t, id=f"leak-{t.id}", split="train") for t in held[:2]]
  pipeline.write_jsonl(tmp_path / "train.jsonl", "calculator", train + leaked)
  pipeline.write_jsonl(tmp_path / "clean.jsonl", "calculator", train)
  leaky = dataclasses.replace(config, tasks=dataclasses.replace(config.tasks, train_file=str(tmp_path / "train.jsonl")))
  with pytest.raises(run_lib.ContaminationError, match=r"2/8 held-out tasks .* tasks.contamination=warn"):
    build_run(leaky, tmp_path / "run")
  warned = dataclasses.replace(leaky, tasks=dataclasses.replace(leaky.tasks, contamination="warn"))
  with pytest.warns(RuntimeWarning, match="contamination"):
    build_run(warned, tmp_path / "run2").close()
  clean = dataclasses.replace(config, tasks=dataclasses.replace(config.tasks, train_file=str(tmp_path / "clean.jsonl")))
  run = build_run(clean, tmp_path / "run3")
  try:
    supply = run.new_supplies().first
    drawn = {t.id for it in range(20) for t in supply.draw(it, 0)}
    assert drawn == {t.id for t in train}  # the file's tasks, and only them
  finally:
    run.close()
  pipeline.write_jsonl(tmp_path / "eval.jsonl", "calculator", held)
  bad = dataclasses.replace(config, tasks=dataclasses.replace(config.tasks, train_file=str(tmp_path / "eval.jsonl")))
  with pytest.raises(config_lib.ConfigError, match="holds held-out tasks"):
    build_run(bad, tmp_path / "run4")


STAGES = ("curriculum.stages=[{name: warmup, paradigm: bc, steps: 2, env_options: {max_operand: 3}}, "
          "{name: warmup2, paradigm: bc, steps: 1}, "
          "{name: easy, paradigm: rl, steps: 2, env_options: {max_operand: 3}, sampler: frontier}, "
          "{name: hard, paradigm: rl, steps: 2}]")


def test_curriculum_stages_are_checked_when_the_config_loads(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="add up to 4, but train.iterations=2"):
    _config(tmp_path, STAGES, "train.iterations=2")
  with pytest.raises(config_lib.ConfigError, match="bc stages come first"):
    _config(tmp_path, "train.iterations=1", "curriculum.stages=[{name: a, paradigm: rl, steps: 1}, "
            "{name: b, paradigm: bc, steps: 3}]")
  with pytest.raises(config_lib.ConfigError, match="must be distinct"):
    _config(tmp_path, "train.iterations=2", "train.bc_steps=0", "curriculum.stages=[{name: a, steps: 1}, "
            "{name: a, steps: 1}]")
  implicit = config_lib.stages(_config(tmp_path, "train.iterations=7"))
  assert [(s.paradigm, s.steps) for s in implicit] == [("bc", 3), ("rl", 7)]


def _staged(tmp_path, name, *extra, hooks=None):
  config = _config(tmp_path, STAGES, "train.iterations=4", "train.eval_episodes=0", "train.plots=false",
                   "train.keep_checkpoints=10", "tasks.active=4", *extra)
  loop.train(config, run_dir=tmp_path / name, hooks=hooks)
  return config, tmp_path / name


def test_curriculum_stages_run_in_order_on_their_own_tasks_and_resume_exactly(tmp_path):
  import shutil
  config, run_a = _staged(tmp_path, "a")
  rows = [r for r in map(json.loads, (run_a / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
  assert [r["curriculum/stage"] for r in rows] == [2, 2, 3, 3]
  assert "curriculum/drawn_signal" in rows[0] and "curriculum/drawn_signal" not in rows[2]  # frontier, then uniform
  stored = list(trajectory_store.read(run_a / "trajectories"))
  from envs.builtin import calculator
  version = lambda **options: calculator.tasks("train", 1, 0, **options)[0].version  # the options are in it
  easy = {t.task.version for t in stored if t.policy_version in (3, 4)}   # 3 BC updates, then one per iteration
  hard = {t.task.version for t in stored if t.policy_version in (5, 6)}
  assert easy == {version(max_operand=3)} and hard == {version()}

  # Resume from the checkpoint after iteration 1 (inside stage "easy") and after iteration 2 (the boundary to
  # "hard"): the same tasks and final weights.
  order = lambda run: [(t.task.id, t.policy_version, t.env.seed) for t in trajectory_store.read(run / "trajectories")]
  for last in (1, 2):
    run_b = tmp_path / f"b{last}"
    shutil.copytree(run_a, run_b)
    for step in range(last + 1, 5):
      shutil.rmtree(run_b / "checkpoints" / str(step))
    loop.train(config, run_dir=run_b, resume=True)
    assert order(run_b) == order(run_a)
    for x, y in zip(jax.tree.leaves(_final_params(run_a, 4)), jax.tree.leaves(_final_params(run_b, 4))):
      np.testing.assert_array_equal(x, y)


def test_a_stage_is_promoted_early_when_its_success_reaches_promote_at(tmp_path):
  asked = []

  def evaluate(run, state, split=None, episodes=None, options=None):
    if split == "tune" and options is not None:  # the promotion check of stage "easy": say it is mastered
      asked.append((split, episodes, dict(options)))
      return state, rollouts.EvalResult("tune", episodes, episodes, (0.9, 1.0), {"completed": episodes}, 1.0)
    return rollouts.evaluate(run, state, split, episodes, options)

  # The promotion hook asks this evaluation; every other hook is the default one.
  hooks = [hooks_lib.Promotion(evaluate) if isinstance(h, hooks_lib.Promotion) else h
           for h in hooks_lib.default_hooks()]
  stages = STAGES.replace("sampler: frontier}", "sampler: frontier, promote_at: 0.5, promote_every: 1, "
                          "promote_episodes: 8}")
  assert stages != STAGES
  _, run = _staged(tmp_path, "p", stages, hooks=hooks)
  rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
  # Promoted after its first iteration: "hard" runs from iteration 1 for its 2 iterations (3 in all).
  assert [r["curriculum/stage"] for r in rows] == [2, 3, 3]
  assert asked == [("tune", 8, {"max_operand": 3})]
  with ocp.CheckpointManager((run / "checkpoints").resolve(),
                             options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
    assert mngr.latest_step() == 3
    meta = mngr.restore(1, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  assert meta["curriculum"] == {"stage": 3, "stage_start": 1}  # the promotion's checkpoint resumes in "hard"


def test_a_bc_only_curriculum_trains_checkpoints_and_resumes(tmp_path):
  config = _config(tmp_path, "train.iterations=0", "train.eval_episodes=0", "train.plots=false",
                   "curriculum.stages=[{name: sft, paradigm: bc, steps: 3}]")
  progress = loop.train(config, run_dir=tmp_path / "run")
  assert int(progress.train.step) == 3
  again = loop.train(config, run_dir=tmp_path / "run", resume=True)  # nothing left to do, and no error
  assert int(again.train.step) == 3 and again.stage == progress.stage


def test_the_learner_shares_the_prefixes_of_real_rollouts_with_the_unshared_update(tmp_path):
  """A shared-prefix update of a real rollout batch (groups share the task prompt; top-p thresholds; two
  micro-batches; 16 rows over the 8 test devices, so blocks of 2 rows: what one device holds of a micro-batch)
  is on-policy and equals the unshared update of the same trajectories: metrics and weights."""
  run, progress = _run(tmp_path, "train.shared_prefix=on", "rollout.top_p=0.9", "train.micro_batches=2",
                       "train.tasks_per_iteration=4",
                       "train.bc_steps=0", "train.eval_episodes=0", "train.dynamic_sampling=false")
  initial = jax.tree.map(jax.numpy.array, progress.train)  # the iteration's update donates the state
  try:
    with trajectory_store.TrajectoryWriter(tmp_path / "stored") as writer:
      _, m = _iterate.rl_iteration(run, progress, writer)
    trajectories = [t for t in trajectory_store.read(tmp_path / "stored") if t.metadata.get("trained", True)]
    assert abs(m["ratio_min"] - 1) < 1e-4 and abs(m["ratio_max"] - 1) < 1e-4, (m["ratio_min"], m["ratio_max"])
    assert learner.share_block_rows(run, run.rows.train) == 16 // 8
    assert 0 < m[metrics_lib.TOKENS_COMPUTED] < m[metrics_lib.TOKENS_UNSHARED]
    off = dataclasses.replace(run.config, train=dataclasses.replace(run.config.train, shared_prefix="off"))
    unshared_run = dataclasses.replace(run, config=off)
    updates = {}
    for name, r in (("shared", run), ("unshared", unshared_run)):
      prepared = learner.prepare_batch(r, initial, trajectories)
      assert (prepared.batch.shared is None) == (name == "unshared")
      updates[name] = learner.update(r, jax.tree.map(jax.numpy.array, initial), prepared)
  finally:
    run.close()
  (shared_state, shared_m), (state, m) = updates["shared"], updates["unshared"]
  for key, value in m.items():
    np.testing.assert_allclose(shared_m[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(shared_state.params)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
