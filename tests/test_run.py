"""The trainer shell's contracts: infrastructure failures are stored but never trained, a resume refuses a changed
env, evaluation builds no train step, a user's env trains from outside the repo, the CLI's defaults."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import envs
from jaxagent import cli
from jaxagent import config as config_lib
from jaxagent import trajectory as tr
from jaxagent.rollout import sampler as sampler_lib
from jaxagent.rollout.actors import ScriptedActions
from jaxagent.train import learner, loop, resume, rollouts
from jaxagent.train import metrics as metrics_lib
from jaxagent.train import run as run_lib
from tests import test_envs_plugin
from tests.test_train import _COMPILES, ROOT, TINY, _config


def _scripted(run, scripts, *, group_size):
  """Runs `scripts` (one action list per row) through the engine, as demonstrations are."""
  tasks = run.interface.env_spec.tasks("train", len(scripts) // group_size, 0)
  tokens = [[run.interface.chat.action_tokens(a) for a in s] for s in scripts]
  trajs, _ = run.rollout.engine.run(ScriptedActions(tokens, run.config.rollout.max_context), tasks,
                                    list(range(len(scripts))), group_size=group_size, policy_version=0)
  return trajs


def test_infrastructure_failures_are_recorded_but_never_trained_or_grouped(tmp_path):
  """A mid-episode tool fault (env_error) used to be trained as a task failure with reward 0, inside its GRPO
  group (which then looked varied). Now: stored with its step outcome, loss mask and advantage 0, in no group."""
  run = run_lib.build_run(_config(tmp_path, "env.name=faults", "env.demo_options=null", "env.max_turns=3",
                                  "train.eval_episodes=0",
                                  "train.bc_steps=0"), tmp_path / "run")
  try:
    state = run.policy.init_state()
    # Two groups of 4: group 0 = three solved + one tool fault; group 1 = two solved, two failed by the verifier
    # (an action the env rejects, then max turns).
    scripts = ([["ok", "done"]] * 3 + [["ok", "raise"]]) + ([["ok", "done"]] * 2 + [["ok", "ok", "ok"]] * 2)
    trajs = _scripted(run, scripts, group_size=4)
    prepared = learner.prepare_batch(run, state, trajs)
  finally:
    run.close()
  faulted = trajs[3]
  assert faulted.termination == envs.Termination.ENV_ERROR
  assert [t.outcome for t in faulted.turns] == ["ok", "env_error"]  # the record keeps every step's outcome
  assert [t.outcome for t in trajs[0].turns] == ["ok", "completed"]
  train = rollouts.trained_rows(run, trajs)
  assert train.tolist() == [True] * 3 + [False] + [True] * 4
  batch = jax.tree.map(np.asarray, prepared.batch)
  rows = batch.trajectory_index[:, 0]
  assert not batch.loss_mask[rows == 3].any() and not batch.advantages[rows == 3].any()
  assert batch.loss_mask[rows == 0].any()
  # Group 0 has only solved members left: no signal (it would have been "varied" with the fault counted).
  adv = np.asarray(prepared.estimate.advantages)
  assert not adv[:4].any() and adv[4:6, 0].min() > 0 > adv[6:8, 0].max()
  tokens = int((batch.segment_ids > 0).sum())
  assert prepared.stats == {"excluded_trajectories": 1, metrics_lib.TOKENS_COMPUTED: tokens,
                            metrics_lib.TOKENS_UNSHARED: tokens}  # train.shared_prefix off: every token computed
  spread = {"reward_std_within_group": pytest.approx(0.25), "zero_variance_group_fraction": 0.5}
  assert learner.group_statistics(run, trajs, prepared.estimate) == spread
  compiles = len(_COMPILES)
  assert learner.group_statistics(run, trajs) == spread  # the estimator run again: the same grouping
  assert len(_COMPILES) == compiles, "the estimator was called another way than prepare_batch calls it"


def test_error_replies_are_error_observations(tmp_path):
  """A rejected action under the error_observation rule is answered with an ERROR-role observation."""
  run = run_lib.build_run(_config(tmp_path, "train.eval_episodes=0", "train.bc_steps=0"), tmp_path / "run")
  try:
    (t, *_) = _scripted(run, [["?? not an action", "calc 1+1"]] * 8, group_size=1)
  finally:
    run.close()
  (bad, good) = t.turns[:2]
  assert bad.outcome == "parser_rejected_continued" and not bad.action.valid
  assert good.outcome == "ok" and good.action.valid and good.action.parsed == {"name": "calc", "arg": "1+1"}
  assert (t.roles[slice(*bad.observation.span)] == tr.Role.ERROR).all()
  assert (t.roles[slice(*good.observation.span)] == tr.Role.TOOL).all()


def test_resume_refuses_a_changed_env_unless_allowed_and_recorded(tmp_path):
  run = run_lib.build_run(_config(tmp_path, "train.eval_episodes=0", "train.bc_steps=0"), tmp_path / "run")
  try:
    # The env tells what a policy depends on: its code's version, its action parser's and its verifier's.
    assert {k: run.env_versions[k] for k in ("name", "parser", "verifier")} == {
        "name": "calculator", "parser": "line-v1", "verifier": "calc-exact-v1"}
    resume.save(run, run.new_state(), None)
    run.checkpointer.wait()
    changed = dataclasses.replace(run, env_versions={**run.env_versions, "verifier": "calculator-v2"})
    with pytest.raises(resume.EnvChangedError, match=r"verifier: checkpoint '\S+' vs now 'calculator-v2'"):
      resume.restore(changed)
    with pytest.warns(RuntimeWarning, match="evaluating on a changed environment"):  # evaluation asks, not trains
      assert "env_change_allowed" not in resume.restore(dataclasses.replace(changed, purpose="eval"))[1]
    allowed = dataclasses.replace(changed, config=dataclasses.replace(
        run.config, train=dataclasses.replace(run.config.train, allow_env_change=True)))
    with pytest.warns(RuntimeWarning, match="changed environment"):
      progress, meta = resume.restore(allowed)
    assert meta["env_change_allowed"]["to"]["verifier"] == "calculator-v2"
    resume.save(allowed, dataclasses.replace(progress, iteration=1), None, meta["env_change_allowed"])  # recorded
    run.checkpointer.wait()
    _, _, stored = run.checkpointer.restore_latest(progress.train, run.policy.model_config)
  finally:
    run.close()
  assert stored["env_change_allowed"]["from"]["verifier"] == run.env_versions["verifier"]
  assert stored["env"]["verifier"] == "calculator-v2"


def test_eval_builds_no_train_step(tmp_path, monkeypatch, capsys):
  config = _config(tmp_path, "train.iterations=1", "train.bc_steps=0", "train.eval_episodes=0", "train.plots=false")
  loop.train(config, run_dir=tmp_path / "run")

  def refuse(*args, **kwargs):
    raise AssertionError("evaluation built a train step")

  monkeypatch.setattr(run_lib, "make_train_step", refuse)
  monkeypatch.setattr(run_lib, "make_value_fn", refuse)
  assert cli.main(["eval", "--checkpoint", str(tmp_path / "run"), "--episodes", "8"]) == 0
  assert "eval success" in capsys.readouterr().out


def test_train_without_a_config_runs_the_embedded_default(monkeypatch, capsys):
  seen = []
  monkeypatch.setattr(loop, "train", lambda config, **kw: seen.append(config))
  assert cli.main(["train", "--set", "train.iterations=1"]) == 0
  assert seen == [config_lib.load(cli.DEFAULT_RECIPE, ["train.iterations=1"])]
  assert "embedded default recipe 'tiny_cpu'" in capsys.readouterr().err


def test_generate_does_not_print_the_end_of_sequence_token(tmp_path, monkeypatch, capsys):
  import models
  from flax import nnx
  from jaxagent import weights
  tok = models.ByteTokenizer()
  cfg = config_lib.load("tiny_cpu", TINY).model.init
  weights.save_model(models.Transformer(cfg, rngs=nnx.Rngs(0)), tmp_path / "ckpt")
  real = sampler_lib.Sampler.generate

  def ends_with_eos(self, params, state, active=None):
    state, out = real(self, params, state, active)
    tokens = np.asarray(out.tokens).copy()
    tokens[0, :3] = [ord("h"), ord("i"), tok.eos_id]
    return state, out.replace(tokens=tokens, lengths=np.asarray([3]), finish=np.asarray([int(sampler_lib.Finish.STOP)]))

  monkeypatch.setattr(sampler_lib.Sampler, "generate", ends_with_eos)
  assert cli.main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "x", "--max-new-tokens", "4"]) == 0
  assert capsys.readouterr().out == "hi\n"


@pytest.mark.slow
def test_a_user_env_outside_the_repo_trains_under_the_sandboxed_local_pool(tmp_path):
  """`--set env.name=pkg.mod:SPEC`: the module is only on PYTHONPATH; workers run in the default local pool."""
  src = tmp_path / "src"
  (src / "userenvs_pkg").mkdir(parents=True)
  (src / "userenvs_pkg" / "__init__.py").write_text("")
  (src / "userenvs_pkg" / "mod.py").write_text(textwrap.dedent(test_envs_plugin.USER_MODULE))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(ROOT)]))
  check = subprocess.run([sys.executable, "-m", "jaxagent", "envs", "check", "userenvs_pkg.mod:SPEC", "--pool",
                          "local", "--episodes", "4"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
  assert check.returncode == 0 and "replay rate: 100.0%" in check.stdout, check.stdout + check.stderr
  sets = [x for o in TINY + [f"run.root={tmp_path / 'runs'}", "env.name=userenvs_pkg.mod:SPEC", "env.max_turns=6",
                             "env.demo_options=null",
                             "env.pool.kind=local", "train.iterations=2", "train.plots=false"] for x in ("--set", o)]
  r = subprocess.run([sys.executable, "-m", "jaxagent", "train", "tiny_cpu", *sets], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "after RL:" in r.stdout
  (run_dir,) = (tmp_path / "runs").iterdir()
  from jaxagent import trajectory_store
  stored = list(trajectory_store.read(run_dir / "trajectories"))
  assert stored and all(t.env.name == "counter" and t.task.id.startswith("counter-train-") for t in stored)
  if envs.pool.bwrap_available():
    assert all(t.env.network == "none" for t in stored)  # the default local pool ran them sandboxed
