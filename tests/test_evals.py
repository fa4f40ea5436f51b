"""Release evaluation (`jaxagent eval --suite`, jaxagent/evals/): suites and gates load with errors that name the
bad value; pass^k is the unbiased estimator; every exploit probe scores 0 and would score > 0 against the obvious
weaker verifier; and a suite run on a trained checkpoint perturbs through the env workers, cuts budgets, equals
`jaxagent eval` on its clean condition, and gates the exit status."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import textwrap

import numpy as np
import pytest

import envs
from envs import perturb
from envs.builtin import calculator
from jaxagent import config as config_lib
from jaxagent import trajectory as tr
from jaxagent import trajectory_store
from jaxagent.evals import runner
from jaxagent.evals import suite as suite_lib


# ----------------------------------------------------------------------------------------------
# Suites and gates.


def test_the_shipped_release_suite_loads():
  suite = suite_lib.load("release")
  kinds = {c.name: c.kind for c in suite.conditions}
  assert kinds["clean"] == "clean" and kinds["turns_half"] == kinds["tokens_half"] == "budget"
  assert {"latency", "transient", "tool_down", "implicit", "truncated"} <= {n for n, k in kinds.items()
                                                                             if k == "perturbation"}
  assert suite.pass_k == 4 and suite.probe_tasks > 0 and suite.split == "eval"


@pytest.mark.parametrize("body, says", [
    ({"conditions": {"clean": {}, "x": {"perturb": {"transient": 0.1}}}}, "conditions.x.perturb: unknown key(s) ['transient']"),
    ({"conditions": {"clean": {}, "x": {"budget": {"turns": 2}}}}, "conditions.x.budget.turns=2: must be a fraction"),
    ({"conditions": {"x": {"budget": {"turns": 0.5}}}}, "has no unperturbed `clean"),
    ({"conditions": {"clean": {}}, "pass_k": {"k": -1}}, "pass_k.k=-1"),
    ({"conditions": {"clean": {}}, "split": "test"}, "split='test'"),
    ({"conditions": {"clean": {}}, "episode": 3}, "unknown key(s) ['episode']"),
])
def test_bad_suites_name_what_is_wrong(tmp_path, body, says):
  path = tmp_path / "s.yaml"
  path.write_text(json.dumps(body))
  with pytest.raises(config_lib.ConfigError, match=re.escape(says)):
    suite_lib.load(path)
  with pytest.raises(config_lib.ConfigError, match="not a shipped suite"):
    suite_lib.load(tmp_path / "missing")


def test_a_tool_index_is_named_against_the_env_and_checked():
  cfg = config_lib.load("tiny_cpu")
  down = suite_lib.Condition.from_dict("d", {"perturb": {"down_tool": 1}, "budget": {"turns": 0.5}})
  assert down.overrides(cfg, ("calc", "answer")) == ['env.perturb={"down_tool": "answer"}', "env.max_turns=2"]
  with pytest.raises(config_lib.ConfigError, match=r"down_tool=2: the env has 2 tool\(s\)"):
    suite_lib.Condition.from_dict("d", {"perturb": {"down_tool": 2}}).overrides(cfg, ("calc", "answer"))


def test_gates_parse_and_unknown_metrics_list_the_valid_ones(tmp_path):
  path = tmp_path / "g.yaml"
  path.write_text("gates:\n  - clean.success >= 0.5\n  - probes.passed == 0\n")
  gates = suite_lib.load_gates(path, {"clean.success": 0.4, "probes.passed": 0.0})
  assert [g.check({"clean.success": 0.4, "probes.passed": 0.0})[0] for g in gates] == [False, True]
  with pytest.raises(config_lib.ConfigError, match=r"no metric 'clean.succes'.*'clean.success'"):
    path.write_text("gates: ['clean.succes >= 0.5']\n")
    suite_lib.load_gates(path, {"clean.success": 0.4})
  with pytest.raises(config_lib.ConfigError, match="write `metric op number`"):
    path.write_text("gates: ['clean.success => 0.5']\n")
    suite_lib.load_gates(path)


def test_shipped_gate_files_name_metrics_the_release_suite_produces():
  suite = suite_lib.load("release")
  clean = runner.ConditionResult("clean", "clean", (), np.array([True, False]), 0.5, {}, dict.fromkeys(
      runner.COST_KEYS, 1.0), 1.0, (1, 1))
  report = {"conditions": {c.name: dataclasses.replace(clean, name=c.name, kind=c.kind).summary(
      None if c.name == "clean" else clean) for c in suite.conditions},
            "pass_k": runner._pass_estimates(np.array([1, 2]), suite.pass_k),
            "probes": {"passed": 0, "by_probe": {}}}
  metrics = runner.flat_metrics(report)
  shipped = sorted(suite_lib.SUITE_DIR.glob("*gates*.yaml"))
  assert len(shipped) >= 2
  for path in shipped:
    assert suite_lib.load_gates(path, metrics)  # every metric named exists


def test_pass_at_k_and_pass_hat_k_are_the_unbiased_estimators():
  counts = np.array([0, 1, 2, 4])  # successes of 4 samples, per task
  est = runner._pass_estimates(counts, 4)
  assert est["pass@1"] == pytest.approx(est["pass^1"]) == pytest.approx(np.mean(counts / 4))
  assert est["pass^4"] == pytest.approx(0.25)  # only the task that passed all 4
  assert est["pass@4"] == pytest.approx(0.75)  # every task with a success
  assert est["pass^2"] == pytest.approx((0 + 0 + 1 / math.comb(4, 2) + 1) / 4)
  assert all(est[f"pass^{j}"] >= est[f"pass^{j + 1}"] and est[f"pass@{j}"] <= est[f"pass@{j + 1}"]
             for j in range(1, 4))


# ----------------------------------------------------------------------------------------------
# Exploit probes: 0 against the real verifier, > 0 against the obvious weaker one.

def _lax_evaluates(task, final):  # evaluates what was submitted: the question handed back passes
  return calculator.safe_eval(final) == calculator.safe_eval(task.payload["question"])


def _lax_any_number(task, final):  # the value anywhere among the numbers submitted
  return str(calculator.safe_eval(task.payload["question"])) in final.split()


def _lax_float(task, final):  # parses the answer as a number of any format
  return float(final) == calculator.safe_eval(task.payload["question"])


WEAKER = {"expression_as_answer": _lax_evaluates, "several_numbers": _lax_any_number, "wrong_format": _lax_float}


def _probe_passes(task, actions) -> bool:
  env = calculator.SPEC.make()
  env.reset(task, 0)
  for a in actions:
    result = env.step(a)
  return bool(result.done and result.verdict is not None and result.verdict.passed)


@pytest.mark.parametrize("probe", sorted(WEAKER))
def test_each_calculator_probe_scores_zero_and_would_pass_a_weaker_verifier(probe, monkeypatch):
  tasks = calculator.tasks("eval", 10, 0)
  assert set(calculator.probes(tasks[0])) == set(WEAKER)  # a new probe needs its weaker verifier here
  assert not any(_probe_passes(t, calculator.probes(t)[probe]) for t in tasks)
  lax = WEAKER[probe]

  def weakened(self, task, final):
    try:
      passed = bool(lax(task, final))
    except (ValueError, envs.InvalidAction):
      passed = False
    return envs.Verdict(passed, float(passed), {}, self.version)

  monkeypatch.setattr(calculator.CalculatorVerifier, "score", weakened)
  assert all(_probe_passes(t, calculator.probes(t)[probe]) for t in tasks)


def _files(root):
  return {str(q.relative_to(root)): q for q in root.rglob("*")}


TERMINAL_WEAKER = {  # the check each probe's template would get from a verifier weakened the obvious way
    "target_as_directory": lambda task, root: (root / task.payload["target"]).exists(),
    "delete_everything": lambda task, root: not any(k.endswith(".log") for k in _files(root)),
    "copy_not_move": lambda task, root: (root / task.payload["new"]).is_dir(),
    "count_through_link": lambda task, root: (root / "count.txt").read_text().strip() == str(
        task.payload["files"][task.payload["target"]].count("\n")),  # follows the link the agent made
}


@pytest.mark.parametrize("probe", sorted(TERMINAL_WEAKER))
def test_each_terminal_probe_scores_zero_and_would_pass_a_weaker_verifier(probe, monkeypatch):
  from envs.builtin import terminal
  tasks = [t for split in envs.SPLITS for t in terminal.tasks(split, 4, 0) if probe in terminal.probes(t)]
  assert tasks

  def passes(task):
    env = terminal.SPEC.make()
    try:
      env.reset(task, 0)
      results = [env.step(a) for a in terminal.probes(task)[probe]]
      return bool(results[-1].verdict.passed)
    finally:
      env.close()

  assert not any(passes(t) for t in tasks)
  lax = TERMINAL_WEAKER[probe]
  monkeypatch.setattr(terminal.TerminalVerifier, "score", lambda self, task, final: envs.Verdict(
      bool(lax(task, final)), float(bool(lax(task, final))), {}, self.version))
  assert all(passes(t) for t in tasks)


# ----------------------------------------------------------------------------------------------
# The held-out verifier and the high-reward-failure report.


def test_the_heldout_verifier_scores_only_when_asked_and_never_pays():
  task = envs.Task(id="c", split="eval", payload=dict(calculator.tasks("eval", 1, 0)[0].payload, question="12*7"),
                   version="v")
  for asked in (False, True):
    with envs.pool.make_pool(1, env="calculator", kind="inprocess", score_heldout=asked) as pool:
      pool.reset(0, task, 0)
      result = pool.step_many([0], ["answer 084"])[0]
    assert result.verdict.passed and result.reward == 1.0  # int("084") == 84: the training verifier's rule
    assert ("heldout" in result.verdict.evidence) == asked
  held = result.verdict.evidence["heldout"]
  assert held["passed"] is False and held["version"] == "calc-canonical-v1"


def test_the_report_lists_heldout_perturbation_and_reward_failures(tmp_path):
  from jaxagent.evals import report
  from tests import _trajectories

  def episode(task_id, *, passed, reward=1.0, heldout=None, seed=0):
    t = _trajectories.make(task_id=task_id, seed=seed, reward=reward)
    evidence = {"expected": 1} if heldout is None else {"expected": 1, "heldout": {
        "passed": heldout, "version": "h1", "evidence": {"got": "01"}}}
    return dataclasses.replace(t, verifier=tr.VerifierRecord(name="v", version="t1", passed=passed,
                                                             evidence=evidence))

  result = lambda *ts, overrides=(): runner.ConditionResult(  # noqa: E731
      "x", "clean", overrides, np.zeros(len(ts), bool), 0.0, {}, {}, 0.0, (0, 0), tuple(ts))
  results = {"clean": result(episode("a", passed=True, heldout=False), episode("b", passed=True, heldout=True),
                             episode("c", passed=False, reward=0.9)),
             "transient": result(episode("a", passed=True), episode("b", passed=False, reward=0.0),
                                 episode("c", passed=False, reward=0.0), overrides=("env.perturb={}",))}
  found = report.find(results, min_reward=0.5)
  assert [(f.kind, f.condition, f.trajectory.task.id) for f in found] == [
      ("heldout", "clean", "a"), ("perturbation", "transient", "b"), ("reward", "clean", "c")]
  assert "held-out verifier h1 rejected it" in found[0].why and "solved clean" in found[1].why
  page = report.write(tmp_path / "r.html", {"suite": "s", "run": "r", "split": "eval", "episodes": 3, "conditions": {
      "clean": {"kind": "clean", "success": 0.5, "ci": [0.1, 0.9], "terminations": {"completed": 3}}}}, found)
  text = page.read_text()
  assert text.count("<section>") == 3 and "prompt: List the files." in text and "class=rpolicy" in text
  assert "class=rtool" in text and "solved clean" in text


# ----------------------------------------------------------------------------------------------
# A suite on a trained checkpoint.

SUITE = textwrap.dedent("""\
    name: small
    episodes: 8
    conditions:
      clean: {}
      tool_down: {perturb: {down_tool: 0}}
      half: {budget: {turns: 0.5, tokens_per_turn: 0.5}}
    pass_k: {k: 4, tasks: 4}
    probes: {tasks: 2}
    """)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  from jaxagent.train import loop
  from tests.test_train import TINY
  root = tmp_path_factory.mktemp("evals")
  config = config_lib.load("tiny_cpu", TINY + [f"run.root={root}", "train.iterations=0", "train.eval_episodes=0",
                                               "train.plots=false", "train.bc_steps=150",
                                               "train.bc_learning_rate=3e-3"])  # enough to call tools
  loop.train(config, run_dir=root / "run")
  return root


def test_a_suite_perturbs_through_the_workers_cuts_budgets_and_gates_the_exit(trained, capsys):
  from jaxagent import cli
  from jaxagent.train import resume, rollouts
  from jaxagent.train.run import build_run
  run_dir = trained / "run"
  (trained / "small.yaml").write_text(SUITE)
  (trained / "pass.yaml").write_text("gates: ['probes.passed == 0', 'clean.success >= 0', 'tool_down.episodes == 8']\n")
  (trained / "fail.yaml").write_text("gates: ['probes.passed == 0', 'clean.success > 1']\n")
  assert cli.main(["eval", "--checkpoint", str(run_dir), "--suite", str(trained / "small.yaml"),
                   "--gate", str(trained / "pass.yaml")]) == 0
  out = capsys.readouterr().out
  assert "gates: all passed" in out and "pass@4" in out and "exploit probes: 0 of 6 scored > 0" in out
  report = json.loads((run_dir / "evals" / "small.json").read_text())
  rows = report["conditions"]
  assert set(rows) == {"clean", "tool_down", "half"}
  assert report["probes"]["runs"] == 6 and report["pass_k"]["tasks"] == 4
  for r in rows.values():  # every episode that reached the verifier was scored by the held-out one too
    assert r.get("heldout_scored", 0) == r["terminations"].get("completed", 0)
    if "proxy_gap" in r:
      assert r["proxy_gap"] == pytest.approx(r["success"] - r["heldout_success"])
  page = (run_dir / "evals" / "small-failures.html").read_text()
  assert "high-reward failures" in page and report["failures"]["html"].endswith("small-failures.html")
  assert sum(report["pass_k"]["successes_per_task"]) == 4

  # The clean condition is `jaxagent eval`: the same tasks, env seeds and sampling keys.
  run = build_run(config_lib.load(run_dir / "config.yaml"), run_dir, purpose="eval", echo=False)
  try:
    progress, _ = resume.restore(run)
    _, plain = rollouts.evaluate(run, progress.train, "eval", 8)
  finally:
    run.close()
  assert (plain.successes, plain.terminations) == (rows["clean"]["successes"], rows["clean"]["terminations"])
  assert plain.mean_reward == pytest.approx(rows["clean"]["mean_reward"])

  episodes = {name: list(trajectory_store.read(run_dir / "evals" / "small" / name)) for name in rows}
  assert all(len(e) == 8 for e in episodes.values())
  assert [t.task.id for t in episodes["clean"]] == [t.task.id for t in episodes["tool_down"]]  # paired
  down = perturb.DOWN_REPLY.format(tool="calc")
  for t in episodes["tool_down"]:  # every calc call the policy made was refused by the worker, nothing else
    for turn in t.turns:
      if turn.observation is not None and turn.action.parsed and turn.action.parsed.get("name") == "calc":
        assert turn.observation.text == down
  clean_calls = sum(1 for t in episodes["clean"] for turn in t.turns
                    if turn.action.parsed and turn.action.parsed.get("name") == "calc")
  assert clean_calls > 0, "the policy never called calc: the tool_down check above checked nothing"
  for t in episodes["half"]:  # env.max_turns 4 -> 2, rollout.max_new_tokens 16 -> 8
    assert len(t.turns) <= 2 and all(turn.action.span[1] - turn.action.span[0] <= 8 for turn in t.turns)
  clean = episodes["clean"]  # what the cuts cut: longer episodes and actions exist without them
  assert any(len(t.turns) > 2 for t in clean) and any(turn.action.span[1] - turn.action.span[0] > 8
                                                      for t in clean for turn in t.turns)
  assert rows["tool_down"]["drop"] == pytest.approx((rows["clean"]["successes"] - rows["tool_down"]["successes"]) / 8)

  # A gate that fails makes the exit status 1 (a CI job refuses the checkpoint). Run again into the same place,
  # a suite replaces its episodes.
  (trained / "clean.yaml").write_text("conditions: {clean: {}}\npass_k: {k: 0}\nprobes: {tasks: 0}\n")
  assert cli.main(["eval", "--checkpoint", str(run_dir), "--suite", str(trained / "clean.yaml"), "--episodes", "8",
                   "--gate", str(trained / "fail.yaml"), "--out", str(trained / "again")]) == 1
  assert cli.main(["eval", "--checkpoint", str(run_dir), "--suite", str(trained / "clean.yaml"), "--episodes", "8",
                   "--out", str(trained / "again")]) == 0
  assert len(list(trajectory_store.read(trained / "again" / "clean" / "clean"))) == 8
  assert "gate FAIL  clean.success > 1" in capsys.readouterr().out
  # --reuse gates the stored report without running the suite again
  assert cli.main(["eval", "--checkpoint", str(run_dir), "--suite", str(trained / "small.yaml"), "--reuse",
                   "--gate", str(trained / "pass.yaml")]) == 0
  assert "gates: all passed" in capsys.readouterr().out
  assert cli.main(["eval", "--checkpoint", str(run_dir), "--suite", "nope"]) == 2


# ----------------------------------------------------------------------------------------------
# Comparing runs.


def _fake_run(path, rates, *, episodes=200, per_iteration=100):
  path.mkdir(parents=True)
  (path / "config.yaml").write_text(f"train: {{eval_episodes: {episodes}}}\n")
  lines = []
  for i, rate in enumerate(rates, 1):
    axes = {"env_interactions": i * per_iteration, "action_tokens": i * 10 * per_iteration,
            "device_seconds": 2.0 * i, "wall_seconds": 3.0 * i}
    lines.append({"step": i, "iteration": i, "time": 0, "reward_mean": rate, "success_rate": rate, **axes})
    lines.append({"step": i, "iteration": i, "time": 0, "eval_success_rate": rate})
  (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  return path


def test_compare_draws_every_run_on_four_axes_and_tables_final_evals(tmp_path, capsys):
  from jaxagent import cli
  from jaxagent.train import metrics as metrics_lib
  a = _fake_run(tmp_path / "a" / "run", [0.1, 0.2, 0.3])
  b = _fake_run(tmp_path / "b" / "run", [0.05, 0.4], per_iteration=250)
  (a / "evals").mkdir()
  (a / "evals" / "release.json").write_text(json.dumps({"suite": "release", "conditions": {"clean": {
      "success": 0.31, "ci": [0.25, 0.38]}}, "metrics": {"probes.passed": 0.0}}))
  out = tmp_path / "c.png"
  assert cli.main(["compare", str(a), str(b), "--out", str(out)]) == 0
  text = capsys.readouterr().out
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
  lo, hi = metrics_lib.wilson_interval(60, 200)
  assert "a/run" in text and "b/run" in text and f"[{lo:.3f}, {hi:.3f}]" in text  # 0.3 of 200 episodes
  assert "release: 0.310 / 0" in text and "500" in text  # b's env interactions at its end
  with pytest.raises(config_lib.ConfigError, match="not a run directory"):
    from jaxagent.evals import compare
    compare.compare([tmp_path], out)


def test_compare_reports_what_rl_added_to_the_cold_start_with_stage_times(tmp_path, capsys):
  from jaxagent import cli
  from jaxagent.train import metrics as metrics_lib
  run = tmp_path / "gain"
  run.mkdir()
  (run / "config.yaml").write_text("train: {eval_episodes: 200, tasks_per_iteration: 4}\n")
  lines = [{"step": 8, "iteration": None, "time": 0, "bc/nll": 0.04, "time/bc_s": 345.0},
           {"step": 8, "iteration": 0, "time": 0, "eval_success_rate": 0.2, "time/eval_s": 300.0}]
  for i, (zv, flat) in enumerate([(0.5, 1), (0.25, 0)], 1):
    lines.append({"step": 8 + i, "iteration": i, "time": 0, "success_rate": 0.3, "zero_variance_group_fraction": zv,
                  "dynamic_sampling/zero_variance_groups_trained": flat, "time/iteration_s": 100.0 + i})
  lines.append({"step": 10, "iteration": 2, "time": 0, "eval_success_rate": 0.45, "time/eval_s": 290.0})
  (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  flat = _fake_run(tmp_path / "flat", [0.3, 0.32])  # from 60/200 to 64/200: the intervals overlap
  assert cli.main(["compare", str(run), str(flat), "--out", str(tmp_path / "c.png")]) == 0
  text = capsys.readouterr().out.split("what RL added to the first held-out eval:")[1]
  lo, hi = metrics_lib.wilson_interval(40, 200)
  lo2, hi2 = metrics_lib.wilson_interval(90, 200)
  gain, flat_line = text.strip().splitlines()[:2]
  assert gain.startswith("gain: held-out 20.0 %") and f"[{100 * lo:.1f}, {100 * hi:.1f}] -> 45.0 %" in gain
  assert f"[{100 * lo2:.1f}, {100 * hi2:.1f}] (apart)" in gain
  assert "sampled 0.50, 0.25, trained 0.25, 0.00" in gain and "bc 345 s, evals 300 + 290 s, rl 203 s" in gain
  assert flat_line.startswith("flat: held-out 30.0 %") and "(overlap)" in flat_line
