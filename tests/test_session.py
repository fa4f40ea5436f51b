"""tests/_session.py's hooks, run in a bare pytest subprocess on tiny test files: the CI time budget fails a
session that overruns it (and only then, once, from the xdist controller), and an `alone` test under xdist
overlaps no other test."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _session

ROOT = Path(__file__).resolve().parent.parent


def _pytest(tmp_path, files, *args, **env):
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests._session"]\n\n\ndef pytest_configure(config):\n'
                                       '  config.addinivalue_line("markers", "alone: as in pyproject.toml")\n')
  environ = {k: v for k, v in os.environ.items() if k not in (_session.BUDGET_ENV, _session.MARGIN_ENV,
                                                              _session.LOCK_DIR_ENV, "PYTEST_XDIST_WORKER")}
  environ.update(PYTHONPATH=str(ROOT), **env)
  return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=tmp_path,
                        env=environ, capture_output=True, text=True, timeout=300, check=False)


SLEEPY = {"test_sleepy.py": "import time\n\ndef test_a():\n  time.sleep(1.5)\n\ndef test_b():\n  time.sleep(1.5)\n"}


def test_budget_verdict_names_the_seconds_the_budget_and_the_margin():
  assert _session.budget_verdict(100.0, {}) is None  # no budget set: no check
  assert _session.budget_verdict(109.9, {_session.BUDGET_ENV: "100"}) is None  # within the default 10 %
  assert _session.budget_verdict(110.5, {_session.BUDGET_ENV: "100"}) == (
      "test time budget exceeded: the session took 110.5 s, over JAXAGENT_TEST_BUDGET_S=100 s x (1 + margin 0.1) "
      "= 110.0 s")
  assert _session.budget_verdict(110.5, {_session.BUDGET_ENV: "100", _session.MARGIN_ENV: "0.2"}) is None


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_session_over_its_budget_fails_after_passing_tests(tmp_path, workers):
  over = _pytest(tmp_path, SLEEPY, *workers, JAXAGENT_TEST_BUDGET_S="0.5", JAXAGENT_TEST_BUDGET_MARGIN="0.2")
  out = over.stdout + over.stderr
  assert over.returncode == 1 and "2 passed" in out, out
  assert out.count("test time budget exceeded: the session took ") == 1, out  # the controller's, not the workers'
  assert "over JAXAGENT_TEST_BUDGET_S=0.5 s x (1 + margin 0.2) = 0.6 s" in out, out
  within = _pytest(tmp_path, SLEEPY, *workers, JAXAGENT_TEST_BUDGET_S="120")
  out = within.stdout + within.stderr
  assert within.returncode == 0 and "2 passed" in out and "exceeded" not in out, out
  assert out.count("time budget: the session took ") == 1 and "within JAXAGENT_TEST_BUDGET_S=120 s" in out, out
  unset = _pytest(tmp_path, SLEEPY, *workers)
  assert unset.returncode == 0 and "time budget" not in unset.stdout, unset.stdout


def test_a_failing_session_keeps_its_status_and_still_reports_the_budget(tmp_path):
  failing = _pytest(tmp_path, {"test_fail.py": "import time\n\ndef test_f():\n  time.sleep(1)\n  assert False\n"},
                    JAXAGENT_TEST_BUDGET_S="0.1")
  assert failing.returncode == 1 and "1 failed" in failing.stdout, failing.stdout
  assert "test time budget exceeded" in failing.stdout, failing.stdout


# Each test writes its own [start, end] and the lock directory is removed by the controller at the end.
SPANS = '''
import json, os, time
import pytest

def _span(name, seconds):
  start = time.time()
  time.sleep(seconds)
  with open(os.path.join(os.environ["SPANS_DIR"], name + ".json"), "w") as f:
    json.dump([start, time.time(), os.environ.get("JAXAGENT_TEST_LOCK_DIR")], f)

@pytest.mark.parametrize("i", range(6))
def test_plain(i):
  _span(f"plain{i}", 0.4)

@pytest.mark.alone
@pytest.mark.parametrize("i", range(2))
def test_alone(i):
  _span(f"alone{i}", 0.6)
'''


def test_alone_tests_overlap_no_other_test_under_xdist(tmp_path):
  spans_dir = tmp_path / "spans"
  spans_dir.mkdir()
  run = _pytest(tmp_path, {"test_spans.py": SPANS}, "-n", "2", SPANS_DIR=str(spans_dir))
  assert run.returncode == 0 and "8 passed" in run.stdout, run.stdout + run.stderr
  spans = {p.stem: json.loads(p.read_text()) for p in spans_dir.iterdir()}
  plain = [s for name, s in spans.items() if name.startswith("plain")]
  # The plain tests did run side by side (the check below is not vacuous: the workers did share the time).
  assert any(a[0] < b[1] and b[0] < a[1] for a in plain for b in plain if a is not b), spans
  for name, (start, end, lock_dir) in spans.items():
    if name.startswith("alone"):
      others = [s for other, s in spans.items() if other != name]
      assert all(e <= start or s >= end for s, e, _ in others), (name, spans)
  lock_dir = {s[2] for s in spans.values()}
  assert len(lock_dir) == 1 and None not in lock_dir and not os.path.exists(lock_dir.pop())  # shared, removed
