"""Task supply: the frontier curriculum's maths and exact state, the uniform stream's data order, near-duplicate
detection between splits, the generate → execute → filter pipeline and the trainer's contamination gate."""

import dataclasses
import json

import grain
import numpy as np
import pytest

import envs
from envs.builtin import calculator
from envs.builtin import code_repair
from jaxagent import config as config_lib
from jaxagent.tasks import cli as tasks_cli
from jaxagent.tasks import contamination, pipeline
from jaxagent.tasks.supply import FrontierTasks, UniformTasks
from tests._sandbox import require_bwrap

TASKS = calculator.tasks("train", 500, 0)


def _frontier(**overrides) -> FrontierTasks:
  cfg = dataclasses.replace(config_lib.TasksConfig(sampler="frontier", active=16), **overrides)
  return FrontierTasks(TASKS, cfg, seed=0, batch=4, process=0, num_processes=1)


def _play(supply, true_p: dict[str, float], iterations: int, rng: np.random.Generator, group: int = 8):
  """Rounds against a synthetic policy that solves task i with probability true_p[id]; returns the draws."""
  drawn = []
  for it in range(iterations):
    tasks = supply.draw(it, 0)
    drawn.append([t.id for t in tasks])
    passed = np.stack([rng.random(group) < true_p[t.id] for t in tasks])
    supply.record(tasks, passed, np.ones_like(passed))
  return drawn


def _true_p(tasks=TASKS):
  """Thirds: never solved, always solved, solved half the time."""
  return {t.id: (0.0, 1.0, 0.5)[i % 3] for i, t in enumerate(tasks)}


def test_uniform_supply_keeps_the_data_order_of_the_grain_batch_pipeline():
  old = iter(grain.MapDataset.source(TASKS).shuffle(seed=3).repeat().batch(8, batch_fn=list))
  for process in range(2):
    new = UniformTasks(TASKS, seed=3, batch=8, process=process, num_processes=2)
    old = iter(grain.MapDataset.source(TASKS).shuffle(seed=3).repeat().batch(8, batch_fn=list))
    for it in range(130):  # past one epoch (500 / 8)
      assert [t.id for t in new.draw(it, 0)] == [t.id for t in next(old)][process * 4:(process + 1) * 4]
  assert new.get_state()["next_index"] == 130


def test_frontier_draw_probabilities_are_p_times_one_minus_p_plus_exploration():
  supply = _frontier(exploration=0.2)
  for e, (a, b) in zip(supply.active, [(1, 1), (1, 9), (9, 1), (5, 5)] * 4):
    e.a, e.b = float(a), float(b)
  p = np.asarray([e.p for e in supply.active])
  expected = 0.8 * p * (1 - p) / (p * (1 - p)).sum() + 0.2 / len(p)
  np.testing.assert_allclose(supply.probabilities(), expected, rtol=1e-12)
  assert supply.probabilities().sum() == pytest.approx(1.0)
  drawn = supply.draw(0, 0)
  assert len({t.id for t in drawn}) == 4  # distinct tasks


def test_frontier_updates_with_decay_and_retires_mastered_and_never_solved_tasks():
  supply = _frontier(decay=0.5, min_attempts=8, mastered=0.9, unsolved_attempts=16, prior=0.5, prior_strength=2.0)
  tasks = supply.draw(0, 0)
  picked = [supply.active[i] for i in supply._last]
  before = {id(e): (e.a, e.b) for e in supply.active}
  passed = np.asarray([[1] * 8, [0] * 8, [1, 0] * 4, [1] * 8])
  counted = np.ones_like(passed)
  counted[3, 4:] = 0  # an excluded sample (infrastructure failure) says nothing about the task
  supply.record(tasks, passed, counted)
  # Row 0: 8/8 -> a = 1 + 0.5 (1 - 1) + 8 = 9, b = 1 -> p = 0.9 after 8 samples: retired as mastered.
  assert supply.counters["retired_mastered"] == 1 and picked[0] not in supply.active
  assert (picked[1].a, picked[1].b, picked[1].attempts, picked[1].successes) == (1.0, 9.0, 8, 0)
  assert (picked[2].a, picked[2].b) == (5.0, 5.0)
  assert (picked[3].a, picked[3].b, picked[3].attempts) == (5.0, 1.0, 4)
  untouched = [e for e in supply.active if e not in picked and id(e) in before]
  assert len(untouched) == 12
  assert all((e.a, e.b) == before[id(e)] for e in untouched)  # at the prior: decay keeps it there
  assert len(supply.active) == 16 and supply.counters["added"] == 17  # refilled from the stream
  # Never solved in 16 samples: retired and counted.
  supply._last = [supply.active.index(picked[1])] + [i for i in range(16) if supply.active[i] is not picked[1]][:3]
  supply.record(tasks, np.zeros((4, 8), int), np.ones((4, 8), int))
  assert supply.counters["retired_unsolved"] >= 1 and picked[1] not in supply.active


def test_frontier_spends_its_draws_where_outcomes_vary():
  truth = _true_p()
  frontier = _frontier(active=32)
  uniform = UniformTasks(TASKS, seed=0, batch=4, process=0, num_processes=1)
  f = _play(frontier, truth, 60, np.random.default_rng(0))
  u = _play(uniform, truth, 60, np.random.default_rng(0))
  varied = lambda draws: np.mean([truth[i] == 0.5 for d in draws[20:] for i in d])
  assert varied(u) < 0.45  # a third of the tasks vary
  assert varied(f) > 0.6, varied(f)
  assert frontier.counters["retired_mastered"] > 0 and frontier.counters["retired_unsolved"] > 0


def test_frontier_state_resumes_the_same_task_sequence():
  truth = _true_p()
  whole = _frontier()
  drawn = _play(whole, truth, 40, np.random.default_rng(1))
  first = _frontier()
  rng = np.random.default_rng(1)
  head = _play(first, truth, 17, rng)
  state = json.loads(json.dumps(first.get_state()))  # as the checkpoint stores it
  resumed = _frontier()
  resumed.set_state(state)
  tail = []
  for it in range(17, 40):
    tasks = resumed.draw(it, 0)
    tail.append([t.id for t in tasks])
    passed = np.stack([rng.random(8) < truth[t.id] for t in tasks])
    resumed.record(tasks, passed, np.ones_like(passed))
  assert head + tail == drawn
  assert resumed.get_state() == whole.get_state()
  with pytest.raises(config_lib.ConfigError, match="tasks.sampler='frontier'"):
    UniformTasks(TASKS, seed=0, batch=4, process=0, num_processes=1).set_state(state)
  with pytest.raises(config_lib.ConfigError, match="tasks.sampler=uniform"):
    _frontier().set_state({"next_index": 3})
  other = FrontierTasks(TASKS[:400], _frontier().config, seed=0, batch=4, process=0, num_processes=1)
  with pytest.raises(config_lib.ConfigError, match="another train task list .500 tasks"):
    other.set_state(state)  # e.g. tasks.train_file rewritten between save and resume
  with pytest.raises(config_lib.ConfigError, match="the train task list has 3"):
    from jaxagent.tasks.supply import make_supply
    make_supply(TASKS[:3], _frontier().config, seed=0, batch=4, process=0, num_processes=1)


def test_frontier_config_is_checked():
  with pytest.raises(config_lib.ConfigError, match="tasks.active=4"):
    config_lib.load("tiny_cpu", ["tasks.sampler=frontier", "tasks.active=4"])
  with pytest.raises(config_lib.ConfigError, match="tasks.prior"):
    config_lib.load("tiny_cpu", ["tasks.prior=1.0"])


# ------------------------------------------------------------------------------------------------
# Contamination.


def _edit(task: envs.Task, split: str) -> envs.Task:
  """A near-duplicate: the same task with a word added to its instruction (true Jaccard ~0.95), in another
  split."""
  payload = dict(task.payload, instruction=task.payload["instruction"] + " now")
  return envs.Task(id=f"planted-{task.id}", split=split, payload=payload, version=task.version)


def test_contamination_check_finds_planted_near_duplicates_and_passes_a_clean_split():
  spec = envs.get("terminal")
  train, held = spec.tasks("train", 2000, 0), spec.tasks("eval", 300, 1)
  clean = contamination.check(train, held)
  assert clean.contaminated == 0 and clean.fraction == 0.0
  planted = [_edit(t, "eval") for t in train[::100]]  # 20 near-duplicates
  exact = [dataclasses.replace(t, id=f"copy-{t.id}", split="eval") for t in train[5:10]]
  report = contamination.check(train, held + planted + exact)
  found = {m.held_out: m for m in report.matches}
  assert set(found) == {t.id for t in planted + exact}
  assert all(found[t.id].train == t.id[len("planted-"):] and not found[t.id].exact for t in planted)
  assert all(found[t.id].exact and found[t.id].similarity == 1.0 for t in exact)
  assert report.exact == 5 and report.fraction == pytest.approx(25 / 325)
  assert all(0.8 <= m.similarity < 1.0 for m in report.matches if not m.exact)


def test_contamination_check_cli_exit_codes(tmp_path, capsys):
  spec = envs.get("terminal")
  train = spec.tasks("train", 300, 0)
  pipeline.write_jsonl(tmp_path / "train.jsonl", "terminal", train)
  pipeline.write_jsonl(tmp_path / "clean.jsonl", "terminal", spec.tasks("eval", 100, 1))
  pipeline.write_jsonl(tmp_path / "leaky.jsonl", "terminal",
                       spec.tasks("eval", 100, 1) + [_edit(t, "eval") for t in train[:3]])
  args = ["check", "terminal", "--train", str(tmp_path / "train.jsonl")]
  assert tasks_cli.main(args + ["--eval", str(tmp_path / "clean.jsonl")]) == 0
  assert "clean" in capsys.readouterr().out
  assert tasks_cli.main(args + ["--eval", str(tmp_path / "leaky.jsonl")]) == 1
  out = capsys.readouterr().out
  assert "3/103 held-out tasks" in out and "CONTAMINATED" in out
  assert tasks_cli.main(args + ["--eval", str(tmp_path / "leaky.jsonl"), "--max-contamination", "0.05"]) == 0


# ------------------------------------------------------------------------------------------------
# Pipeline.


# calculator, except that the reference answers a 'wrong' task wrong and a 'bad' task cannot reset.
def _broken_demo(task, seed=0, **options):
  steps = calculator.demo(task, seed, **options)
  if task.payload.get("wrong"):
    steps[-1] = "answer -1"
  return steps


def _broken_make(**kwargs):
  env = calculator.CalculatorEnv(**kwargs)
  reset = env._reset

  def _reset(task, seed):
    if task.payload.get("bad"):
      raise envs.EnvError(f"task {task.id} does not reproduce")
    return reset(task, seed)

  env._reset = _reset
  return env


BROKEN = envs.EnvSpec(name="calculator_broken", description="test", make=_broken_make, tasks=calculator.tasks,
                      demo=_broken_demo)


def test_execute_runs_every_reference_and_reports_broken_tasks_with_their_reason():
  tasks = calculator.tasks("train", 12, 0)
  tasks[3] = dataclasses.replace(tasks[3], payload=dict(tasks[3].payload, wrong=True))
  tasks[7] = dataclasses.replace(tasks[7], payload=dict(tasks[7].payload, bad=True))
  runs = pipeline.execute("tests.test_tasks:BROKEN", tasks, kind="inprocess", workers=1, slots=3)
  assert [r.task.id for r in runs] == [t.id for t in tasks]  # task order, whatever finished first
  reasons = [r.reason for r in runs]
  assert reasons[3] == "reference_failed" and '"expected"' in runs[3].detail
  assert reasons[7] == "reset_error" and "does not reproduce" in runs[7].detail
  assert reasons.count("solved") == 10 and all(r.seconds > 0 for r in runs)


def test_combined_code_repair_mutations_are_distinct_and_solved_by_their_reference():
  require_bwrap()
  tasks = code_repair.tasks("train", 40, 0, mutations=3)
  assert len({t.payload["mutation_id"] for t in tasks}) == 40
  for t in tasks:
    ms = t.payload["mutations"]
    assert len(ms) == 3 and len({m["line"] for m in ms}) == 3 and len({m["module"] for m in ms}) == 1
  assert code_repair.tasks("train", 5, 0) == code_repair.tasks("train", 5, 0, mutations=1)  # unchanged
  runs = pipeline.execute("code_repair", tasks[:12], kind="local", workers=2)
  assert [r.reason for r in runs].count("solved") >= 10, [(r.reason, r.detail[:200]) for r in runs]
  with pytest.raises(ValueError, match="mutations=0"):
    code_repair.tasks("train", 1, 0, mutations=0)


def test_generate_filter_cli_writes_the_solvable_tasks(tmp_path, capsys):
  require_bwrap()
  out, kept = tmp_path / "t.jsonl", tmp_path / "kept.jsonl"
  assert tasks_cli.main(["generate", "terminal", "-n", "40", "--out", str(out)]) == 0
  assert "40 tasks" in capsys.readouterr().out
  env, tasks = pipeline.read_jsonl(out)
  assert env == "terminal" and tasks == envs.get("terminal").tasks("train", 40, 0)
  # Plant a broken task: its reference deletes a file the verifier then misses.
  lines = out.read_text().splitlines()
  record = json.loads(lines[0])
  bad = dict(record, id="broken", payload=dict(record["payload"], files={}))
  out.write_text("\n".join(lines + [json.dumps(bad)]) + "\n")
  assert tasks_cli.main(["filter", str(out), "--out", str(kept), "--report", str(tmp_path / "r.json"),
                         "--quiet"]) == 0
  text = capsys.readouterr().out
  assert "tasks/s" in text and "kept 40/41" in text
  report = json.loads((tmp_path / "r.json").read_text())
  assert [b["id"] for b in report["broken"]] == ["broken"]
  assert [t.id for t in pipeline.read_jsonl(kept)[1]] == [t.id for t in tasks]
  with pytest.raises(SystemExit, match="unknown environment"):
    tasks_cli.main(["generate", "no_such_env", "--out", str(out)])
  with pytest.raises(ValueError, match=r"t.jsonl:2: not a task record"):
    out.write_text(lines[0] + "\n{\"id\": 1}\n")
    pipeline.read_jsonl(out)


def test_filter_with_a_policy_keeps_the_tasks_it_sometimes_solves(tmp_path, capsys):
  from jaxagent.train import loop, rollouts
  from tests.test_train import TINY
  tiny = TINY + ["train.iterations=0", "train.eval_episodes=0", "train.plots=false", f"run.root={tmp_path}"]
  loop.train(config_lib.load("tiny_cpu", tiny), run_dir=tmp_path / "run")
  tasks = calculator.tasks("train", 6, 0)
  wins = rollouts.policy_outcomes(tmp_path / "run", tasks, 4)
  assert wins.shape == (6,) and ((0 <= wins) & (wins <= 4)).all()
  np.testing.assert_array_equal(rollouts.policy_outcomes(tmp_path / "run" / "checkpoints", tasks, 4), wins)
  pipeline.write_jsonl(tmp_path / "t.jsonl", "calculator", tasks)
  args = ["filter", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "kept.jsonl"), "--pool", "inprocess",
          "--policy", str(tmp_path / "run"), "--samples", "4", "--report", str(tmp_path / "r.json"), "--quiet"]
  assert tasks_cli.main(args) == 0
  report = json.loads((tmp_path / "r.json").read_text())
  assert report["successes"] == {t.id: int(w) for t, w in zip(tasks, wins)}
  kept = [t.id for t in pipeline.read_jsonl(tmp_path / "kept.jsonl")[1]]
  assert kept == [t.id for t, w in zip(tasks, wins) if 0 < w < 4]
  assert report["always_solved"] + report["never_solved"] + len(kept) == 6
  assert "never solved" in capsys.readouterr().out
  with pytest.raises(config_lib.ConfigError, match="--samples 3: must divide the run's 8"):
    rollouts.policy_outcomes(tmp_path / "run", tasks, 3)


def test_frontier_retires_a_task_after_max_draws():
  supply = _frontier(max_draws=2, active=4, unsolved_attempts=1000, mastered=1.0)
  first = list(supply.active)
  for it in range(2):  # every active task drawn twice: all four retire as used, four fresh ones replace them
    tasks = supply.draw(it, 0)
    supply.record(tasks, np.asarray([[1, 0] * 4] * 4), np.ones((4, 8), int))
  assert supply.counters["retired_used"] == 4 and supply.counters["added"] == 8
  assert not any(e in first for e in supply.active) and all(e.draws == 0 for e in supply.active)


def test_execute_runs_an_infrastructure_failure_again_and_reports_it_apart():
  tasks = envs.get("faults").tasks("train", 4, 0)
  tasks[1] = dataclasses.replace(tasks[1], id="crashes", payload={"reset": "crash"})
  runs = pipeline.execute("faults", tasks, kind="local", workers=2, slots=2)
  crashed = runs[1]
  assert crashed.reason == "worker_failure" and crashed.infrastructure and not crashed.solved
  # The others ran to their end (faults has no verifier: its `done` is no verified pass), or, when the crashing
  # reset took their worker down with it, count as infrastructure failures too: never as broken tasks.
  others = [r for i, r in enumerate(runs) if i != 1]
  assert all(r.reason == "reference_failed" or r.infrastructure for r in others), [r.reason for r in others]
  assert sum(r.reason == "reference_failed" for r in others) >= 2


def test_no_builtin_env_has_near_duplicates_between_its_train_and_held_out_splits():
  for name in ("calculator", "guess", "gridworld", "sokoban", "terminal", "code_repair"):
    spec = envs.get(name)
    for split in ("tune", "eval"):
      report = contamination.check(spec.tasks("train", 2000, 0), spec.tasks(split, 200, 1), describe=spec.describe)
      assert report.contaminated == 0, (name, split, report.matches[:3])


def test_frontier_families_steer_fresh_draws_to_templates_whose_outcomes_vary():
  templates = calculator.SPLIT_TEMPLATES["train"]
  rate = {t: (0.0, 1.0, 0.5)[i % 3] for i, t in enumerate(templates)}  # per template: never, always, half
  truth = {t.id: rate[t.payload["template"]] for t in TASKS}
  varied = lambda draws: np.mean([truth[i] == 0.5 for d in draws[20:] for i in d])
  plain = _play(_frontier(active=32), truth, 80, np.random.default_rng(0))
  pooled_supply = _frontier(active=32, family="template")
  pooled = _play(pooled_supply, truth, 80, np.random.default_rng(0))
  assert varied(pooled) > varied(plain) + 0.1, (varied(pooled), varied(plain))
  state = json.loads(json.dumps(pooled_supply.get_state()))
  assert set(state["families"]) == set(templates)
  resumed = _frontier(active=32, family="template")
  resumed.set_state(state)
  assert [resumed.estimate(e) for e in resumed.active] == [pooled_supply.estimate(e) for e in pooled_supply.active]


def test_frontier_family_skips_are_bounded_and_inside_the_checked_horizon():
  tasks = calculator.tasks("train", 20000, 0)
  supply = FrontierTasks(tasks, dataclasses.replace(config_lib.TasksConfig(sampler="frontier", active=16),
                                                    family="template"), seed=0, batch=4, process=0, num_processes=1)
  never = {t.id: 0.0 for t in tasks}  # every family turns hopeless: fresh tasks are skipped, within bounds
  _play(supply, never, 12, np.random.default_rng(0))
  assert 0 < supply.counters["skipped"] <= 12 * 16
  assert supply._source.get_state()["next_index"] <= len(supply.horizon(12, 1))
  with pytest.raises(config_lib.ConfigError, match="tasks.family='templat': not a payload key"):
    from jaxagent.tasks.supply import make_supply
    make_supply(TASKS, dataclasses.replace(_frontier().config, family="templat"), seed=0, batch=4, process=0,
                num_processes=1)
