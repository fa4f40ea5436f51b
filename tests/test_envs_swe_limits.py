"""The swe env's time limits come from measurement on this machine: a package whose suite is slower gets a
proportionally longer limit (two fake packages made here, no PyPI), and a run past its limit ends the episode as
`env_timeout`, never as a failed fix. Limits are CPU seconds, so a run slowed by others sharing the cores keeps
its verdict."""

import json

import pytest

import envs
from envs.builtin import swe, swe_corpus as corpus
from tests._sandbox import require_bwrap

SOURCE = '''def bump(x):
  return x + 1


def label(x):
  return "n" + str(x)
'''
BURN = '''

def _burn(seconds):
  import time
  end = time.process_time() + seconds
  while time.process_time() < end:
    pass
'''


def _package(root, name: str, tests: int, burn_s: float) -> corpus.Package:
  """A package in the corpus cache as `fetch` leaves one: `tests` tests of `bump`, each burning `burn_s` of CPU in
  the test (not in the package: the baseline's trace covers only the package), and one test of `label`."""
  pkg = corpus.Package(name, "0.1", "0" * 64, "MIT", "train", ".", (name,), ("tests",))
  tree = root / pkg.key / "tree"
  (tree / name).mkdir(parents=True)
  (tree / name / "__init__.py").write_text(SOURCE)
  (tree / "tests").mkdir()
  body = [f"from {name} import bump, label{BURN}"]
  body += [f"\ndef test_bump_{i}():\n  _burn({burn_s})\n  assert bump({i}) == {i + 1}\n" for i in range(tests)]
  body.append("\ndef test_label():\n  assert label(2) == 'n2'\n")
  (tree / "tests" / "test_it.py").write_text("\n".join(body))
  (tree / ".complete").write_text(json.dumps(dict(name=name, version="0.1")))
  return pkg


@pytest.fixture
def packages(tmp_path, monkeypatch):
  require_bwrap()  # the runs are sandboxed
  monkeypatch.setenv(corpus.CACHE_VARIABLE, str(tmp_path / "swe"))
  fast = _package(tmp_path / "swe", "fastpkg", 2, 0.0)
  slow = _package(tmp_path / "swe", "slowpkg", 12, 0.15)  # ~1.8 s of CPU: past the floor's share
  monkeypatch.setattr(corpus, "PACKAGES", (fast, slow))
  return fast, slow


@pytest.mark.slow
def test_a_slower_suite_gets_a_longer_measured_limit(packages):
  fast, slow = packages
  fast_base, slow_base = corpus.baseline(fast), corpus.baseline(slow)
  assert len(slow_base["kept"]) == 13 and len(fast_base["kept"]) == 3
  measured = corpus.measured_cpu_s(slow_base, slow_base["kept"])
  assert measured >= 12 * 0.15 and slow_base["test_s"]["tests/test_it.py::test_bump_0"] >= 0.15
  slow_limit, fast_limit = corpus.run_limit(slow_base, slow_base["kept"]), corpus.run_limit(fast_base, fast_base["kept"])
  assert fast_limit.cpu_s == corpus.RUN_CPU_FLOOR_S  # a fast suite gets the floor
  assert slow_limit.cpu_s == pytest.approx(corpus.RUN_CPU_MULTIPLE * measured, abs=0.01)
  assert slow_limit.cpu_s > fast_limit.cpu_s
  assert slow_limit.wall_s == corpus.WALL_PER_CPU * slow_limit.cpu_s
  # Which tests call which function: a change to label's body selects its one test, not the suite.
  label_only = SOURCE.replace('"n" + str(x)', '"m" + str(x)')
  tree = corpus.fetch(slow)
  assert corpus.affected(slow, slow_base, tree, {"slowpkg/__init__.py": label_only}) == ["tests/test_it.py::test_label"]
  assert corpus.run_limit(slow_base, ["tests/test_it.py::test_label"]).cpu_s == corpus.RUN_CPU_FLOOR_S
  # The pool's limits follow from the slowest measured suite.
  need = swe.timeouts()
  assert need["action_timeout_s"] == 2 * slow_limit.wall_s + swe.TIMEOUT_SLACK_S


@pytest.mark.slow
def test_a_run_past_its_limit_is_env_timeout_not_a_failed_fix(packages, monkeypatch, capfd):
  _, slow = packages
  tasks = swe.tasks("train", 2, 0, limit=8)
  said = capfd.readouterr().err  # a cold cache says so first, then how far the build is
  assert "building the train tasks' cache first" in said and "slowpkg-0.1: its own tests on the pristine tree, run 1 of 2" in said
  assert "mutants tried" in said and said.index("cache first") < said.index("mutants tried")
  assert swe.tasks("train", 2, 0, limit=8) == tasks and "cache first" not in capfd.readouterr().err  # now cached
  task = next(t for t in tasks if t.payload["package"] == "slowpkg" and "bump" in " ".join(t.payload["failing_tests"]))
  solution = swe.demo(task, 0)
  env = swe.SPEC.make()
  try:
    env.reset(task, 0)
    for action in solution:
      result = env.step(action)
    assert result.reward == 1.0 and result.termination == envs.COMPLETED  # within the measured limit
    # The same fix, on a machine where the suite takes 4x longer than its measured limit allows (limits cut here,
    # after the reset's own run).
    env.reset(task, 0)
    monkeypatch.setattr(corpus, "RUN_CPU_FLOOR_S", 1.0)
    monkeypatch.setattr(corpus, "RUN_CPU_MULTIPLE", 0.25)
    for action in solution:
      result = env.step(action)
    assert result.done and result.termination == envs.ENV_TIMEOUT, result.observation.text
    assert "of CPU" in result.observation.text and result.verdict.evidence["runner_timeout"]
    assert result.verdict.evidence.get("result") is None  # no test verdict was made from a cut run
  finally:
    env.close()
