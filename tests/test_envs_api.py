"""Env API and the deterministic built-ins: demos solve every split, splits are template-isolated, replay."""

import ast
import pathlib

import pytest

import envs

DETERMINISTIC = ("calculator", "guess", "gridworld", "sokoban")


def test_envs_package_never_imports_jax():
  for path in pathlib.Path(envs.__file__).parent.rglob("*.py"):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
          [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      for n in names:
        assert n.split(".")[0] not in ("jax", "jaxlib", "jaxagent", "flax", "models"), f"{path}: imports {n}"


def test_termination_strings_match_the_trajectory_contract():
  assert envs.TERMINATIONS == ("completed", "max_turns", "context_exhausted", "turn_budget_exhausted",
                               "invalid_action", "parser_rejected", "env_error", "env_timeout",
                               "retries_exhausted", "cancelled")
  assert envs.OUTCOME_CODES["ok"] == 0 and len(set(envs.OUTCOME_CODES.values())) == len(envs.OUTCOMES)


@pytest.mark.parametrize("name", DETERMINISTIC)
@pytest.mark.parametrize("split", envs.SPLITS)
def test_demos_solve_every_task(name, split):
  spec = envs.get(name)
  for seed, task in enumerate(spec.tasks(split, 12, 0)):
    env = spec.make()
    env.reset(task, seed)
    for action in spec.demo(task, seed):
      result = env.step(action)
    assert result.done and result.termination == envs.COMPLETED and result.reward_components["outcome"] == 1.0
    assert result.verdict.passed is True and result.outcome is envs.Outcome.COMPLETED


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_splits_are_isolated_by_template(name):
  spec = envs.get(name)
  key = {"calculator": "template", "gridworld": "layout", "guess": "high", "sokoban": "layout"}[name]
  templates = {split: {t.payload[key] for t in spec.tasks(split, 40, 1)} for split in envs.SPLITS}
  assert templates["train"].isdisjoint(templates["tune"]) and templates["train"].isdisjoint(templates["eval"])
  assert templates["tune"].isdisjoint(templates["eval"])


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_replay_is_deterministic(name):
  spec = envs.get(name)
  for task in spec.tasks("train", 8, 2):
    runs = []
    for _ in range(2):
      env = spec.make()
      obs = [env.reset(task, 5).text]
      obs += [env.step(a).observation.text for a in spec.demo(task, 5)]
      runs.append(obs)
    assert runs[0] == runs[1]
  assert spec.version == envs.get(name).version and len(spec.version) == 12


def test_calculator_actions_are_short_and_regular():
  spec = envs.get("calculator")
  env = spec.make()
  task = spec.tasks("train", 1, 0)[0]
  assert env.reset(task, 0).text == task.payload["question"]
  assert env.step("calc 12*7").observation.text == "84"
  assert env.step("calc (3+4)*2").observation.text == "14"
  result = env.step("answer 0")
  assert result.done and result.termination == "completed" and result.verdict.passed is False
  assert result.call == envs.Call("answer", "0") and result.verdict.evidence == {
      "expected": envs.builtin.calculator.safe_eval(task.payload["question"]), "got": "0"}
  assert all(len(a) <= 16 for t in spec.tasks("train", 50, 0) for a in spec.demo(t))
  with pytest.raises(ValueError, match="max_operand=1"):
    envs.builtin.calculator.tasks("train", 1, 0, max_operand=1)


def test_calculator_mixed_demos_mix_both_solvers_and_only_direct_fits_two_turns():
  spec = envs.get("calculator")
  ts = spec.tasks("train", 400, 0)
  scripts = [spec.demo(t, k, style="mixed", direct_fraction=0.25) for k, t in enumerate(ts)]
  direct = [len(s) == 2 for s in scripts]
  assert 0.18 < sum(direct) / len(ts) < 0.32  # 400 Bernoulli(0.25) draws: 4 standard deviations either side
  assert all(len(s) in (2, 3) for s in scripts)
  assert scripts == [spec.demo(t, k, style="mixed", direct_fraction=0.25) for k, t in enumerate(ts)]
  assert spec.demo(ts[0], 0, style="mixed", direct_fraction=1.0) == spec.demo(ts[0], 0, style="direct")
  assert spec.demo(ts[0], 0, style="mixed", direct_fraction=0.0) == spec.demo(ts[0], 0, style="steps")
  for task, script in zip(ts[:16], scripts):  # under a 2-turn budget only the direct solver reaches its answer
    env = spec.make(max_turns=2)
    env.reset(task, 0)
    results = [env.step(a) for a in script[:2]]
    assert results[-1].done and (results[-1].verdict is not None and results[-1].verdict.passed) == (len(script) == 2)
  with pytest.raises(ValueError, match="direct_fraction=1.5"):
    spec.demo(ts[0], 0, style="mixed", direct_fraction=1.5)
  with pytest.raises(ValueError, match="not one of"):
    spec.demo(ts[0], 0, style="sideways")


@pytest.mark.parametrize("rule", envs.INVALID_ACTION_RULES)
@pytest.mark.parametrize("action,kind", [("CALC 1+1\nx", "parser_rejected"), ("calc __import__('os')", "invalid_action"),
                                         ("fly away", "invalid_action")])
def test_invalid_action_rules(rule, action, kind):
  env = envs.get("calculator").make(invalid_action=envs.InvalidActionRule(rule, penalty=0.5))
  env.reset(envs.get("calculator").tasks("train", 1, 0)[0], 0)
  result = env.step(action)
  assert result.info["rule"] == rule and result.observation.text.startswith("error:")
  if rule == "terminate":
    assert result.done and result.termination == kind and result.outcome == kind
    assert type(result.termination) is envs.Termination and type(result.outcome) is envs.Outcome
  else:
    assert not result.done and result.outcome == f"{kind}_continued"
    assert result.reward_components["validity"] == (-0.5 if rule == "penalty" else 0.0)
    assert env.step("calc 1+1").observation.text == "2"   # the episode goes on


def test_bad_rule_and_split_name_the_valid_values():
  with pytest.raises(ValueError, match="'ignore'.*error_observation"):
    envs.InvalidActionRule("ignore")
  with pytest.raises(ValueError, match="'test'"):
    envs.Task("x", "test", {}, "0")
  with pytest.raises(KeyError, match="did you mean 'calculator'"):
    envs.get("calculater")


def test_observation_cap_flags_truncation():
  env = envs.get("faults").make(max_obs_bytes=100)
  env.reset(envs.get("faults").tasks("train", 1, 0)[0], 0)
  result = env.step("big 10000000")
  assert result.observation.truncated and result.observation.original_size == 10_000_000
  assert len(result.observation.text) == 100


def test_max_turns_and_env_error():
  spec = envs.get("faults")
  env = spec.make(max_turns=2)
  env.reset(spec.tasks("train", 1, 0)[0], 0)
  assert not env.step("ok").done
  assert env.step("ok").termination == "max_turns"
  env.reset(spec.tasks("train", 1, 0)[0], 0)
  assert env.step("raise").termination == "env_error"


def test_guess_budget_is_not_completion():
  spec = envs.get("guess")
  task = spec.tasks("train", 1, 0)[0]
  env = spec.make()
  env.reset(task, 0)
  target = envs.builtin.guess.secret(task, 0)
  wrong = 1 if target != 1 else 2
  results = [env.step(f"guess {wrong}") for _ in range(envs.builtin.guess.budget(16))]
  assert results[-1].termination == "turn_budget_exhausted" and not any(r.done for r in results[:-1])
  assert results[-1].outcome is envs.Outcome.TURN_BUDGET_EXHAUSTED and results[-1].verdict.passed is False


def test_snapshot_is_an_optional_capability_answered_over_the_wire():
  from envs.server import Host, RequestError
  host = Host("faults")  # offers no snapshot
  host.handle("reset", {"instance": "a", "task": envs.get("faults").tasks("train", 1, 0)[0].to_wire(), "seed": 0,
                        "options": {}})
  for op, args in (("snapshot", {"instance": "a"}), ("restore", {"instance": "a", "state": None})):
    with pytest.raises(RequestError, match="does not support") as err:
      host.handle(op, args)
    assert err.value.kind == "unsupported"
  calc = Host("calculator")
  task = envs.get("calculator").tasks("train", 1, 0)[0]
  calc.handle("reset", {"instance": "a", "task": task.to_wire(), "seed": 0, "options": {}})
  saved = calc.handle("snapshot", {"instance": "a"})
  first = calc.handle("step", {"instance": "a", "action": "calc 1+1"})
  calc.handle("restore", {"instance": "a", "state": saved})
  assert calc.handle("step", {"instance": "a", "action": "calc 1+1"}) == first


def test_one_vocabulary_of_terminations_and_outcomes():
  assert tuple(t.value for t in envs.Termination) == envs.TERMINATIONS
  assert envs.OUTCOMES == ("ok",) + envs.TERMINATIONS + (
      "worker_crash", "invalid_action_continued", "parser_rejected_continued", "replay_diverged", "history_rewritten")
  assert tuple(o.value for o in envs.Outcome) == envs.OUTCOMES
  assert [envs.OUTCOME_CODES[o] for o in envs.Outcome] == list(range(len(envs.OUTCOMES)))
  assert envs.COMPLETED is envs.Termination.COMPLETED and envs.ENV_ERROR is envs.Termination.ENV_ERROR
  for member in (envs.Termination.ENV_TIMEOUT, envs.Outcome.REPLAY_DIVERGED):
    assert str(member) == f"{member}" == "%s" % member == member.value and member == member.value
  assert f"{envs.Outcome.OK:>4}" == "  ok"
  assert envs.INVALID_ACTION_RULES == ("error_observation", "terminate", "penalty")


def test_step_result_outcome_is_derived_and_checked():
  obs = envs.Observation("x")
  done = envs.StepResult(obs, {}, True, "env_error", {"error": "boom"})  # positional, plain string
  assert done.termination is envs.Termination.ENV_ERROR and done.outcome is envs.Outcome.ENV_ERROR
  assert envs.StepResult(obs, {}, False, None).outcome is envs.Outcome.OK
  crash = envs.StepResult(obs, {}, True, envs.ENV_ERROR, outcome="worker_crash")
  assert crash.outcome is envs.Outcome.WORKER_CRASH
  with pytest.raises(ValueError, match="outcome='ok' with done=True"):
    envs.StepResult(obs, {}, True, envs.COMPLETED, outcome=envs.Outcome.OK)
  with pytest.raises(ValueError, match="outcome='completed' with done=False"):
    envs.StepResult(obs, {}, False, None, outcome=envs.Outcome.COMPLETED)
  with pytest.raises(ValueError, match="termination='finished': not one of"):
    envs.StepResult(obs, {}, True, "finished")
  with pytest.raises(ValueError, match="outcome='meh': not one of"):
    envs.StepResult(obs, {}, False, None, outcome="meh")
  with pytest.raises(ValueError, match="a finished step needs one of"):
    envs.StepResult(obs, {}, True, None)


def test_typed_fields_round_trip_the_wire_exactly():
  from envs import _protocol as P
  verdict = envs.Verdict(False, 0.25, {"got": "7", "steps": [1, 2], "nested": {"ok": None}}, "v3")
  results = [
      envs.StepResult(envs.Observation("t" * 20, True, 99), {"validity": -0.5}, False, None, {"rule": "penalty"},
                      outcome=envs.Outcome.INVALID_ACTION_CONTINUED, call=envs.Call("calc", "1+")),
      envs.StepResult(envs.Observation("done"), {"outcome": 0.25}, True, envs.COMPLETED, {"turn": 3},
                      call=envs.Call("answer", "7"), verdict=verdict),
      envs.StepResult(envs.Observation(""), {}, True, envs.ENV_ERROR, outcome=envs.Outcome.REPLAY_DIVERGED),
  ]
  for r in results:
    back = envs.StepResult.from_wire(P.msgpack.unpackb(P.pack(r.to_wire())[4:], raw=False))
    assert back == r
    assert type(back.termination) is type(r.termination) and type(back.outcome) is envs.Outcome
  # What a worker answers for a real step equals the step in this process, typed fields included.
  from envs.server import Host
  spec = envs.get("calculator")
  task = spec.tasks("train", 1, 0)[0]
  host, env = Host("calculator"), spec.make()
  host.handle("reset", {"instance": "a", "task": task.to_wire(), "seed": 0, "options": {}})
  env.reset(task, 0)
  for action in spec.demo(task, 0):
    wire = P.msgpack.unpackb(P.pack(host.handle("step", {"instance": "a", "action": action}))[4:], raw=False)
    assert envs.StepResult.from_wire(wire) == env.step(action)
  assert envs.StepResult.from_wire(wire).verdict.passed is True


def test_an_env_version_hashes_its_own_code_and_the_api_version_not_the_api_file(monkeypatch, tmp_path):
  """Editing envs/_api.py (a docstring) changes no env's version; bumping ENV_API_VERSION changes every one."""
  import envs._api as api
  spec = envs.get("calculator")
  before = {n: envs.get(n).version for n in ("calculator", "guess", "gridworld")}
  real = api.inspect.getsourcefile
  edited = tmp_path / "_api.py"
  edited.write_text(pathlib.Path(api.__file__).read_text() + "\n# an edited comment\n")
  monkeypatch.setattr(api.inspect, "getsourcefile",
                      lambda o: str(edited) if real(o) == api.__file__ else real(o))
  assert {n: envs.get(n).version for n in before} == before
  assert spec.version == envs.source_version(*spec.version_sources, extra=f"env-api-{envs.ENV_API_VERSION}")
  monkeypatch.setattr(api, "ENV_API_VERSION", envs.ENV_API_VERSION + 1)
  after = {n: envs.get(n).version for n in before}
  assert all(after[n] != before[n] for n in before)
