"""Session-level pytest hooks that tests/conftest.py installs (kept free of jax so tests/test_session.py can run
them in a bare pytest subprocess).

* `alone` tests under pytest-xdist: a test marked `@pytest.mark.alone` asserts a wall-clock bound calibrated on an
  otherwise idle machine (a hung worker replaced within N s, a slow env's episode ending after the fast ones).
  With `make test`'s workers sharing the cores, such a test waits until the other workers' running tests end,
  and they start no new test until it ends: a readers-writer lock over files every worker sees (`alone` takes
  it exclusively, every other test shared; a turnstile lock taken first keeps a waiting `alone` test from being
  starved). Without xdist there is no lock: a serial run is alone already. The wait is outside the test's setup,
  call and teardown, so `--durations` does not count it.
* The CI time budget: with JAXAGENT_TEST_BUDGET_S set (.ci/run), a session whose wall time exceeds
  budget x (1 + JAXAGENT_TEST_BUDGET_MARGIN, default 0.1) fails with a message naming the three, after every
  test has passed. On the controller only, never in an xdist worker (a worker's session is only its share).
"""

import fcntl
import os
import shutil
import tempfile
import time

import pytest

LOCK_DIR_ENV = "JAXAGENT_TEST_LOCK_DIR"
BUDGET_ENV = "JAXAGENT_TEST_BUDGET_S"
MARGIN_ENV = "JAXAGENT_TEST_BUDGET_MARGIN"
DEFAULT_MARGIN = 0.1

_START = time.monotonic()  # rebased in pytest_sessionstart; import time only matters if that never runs
_made_lock_dir = None       # the directory this controller made (and removes at its end)
_budget_report = None       # (failure message or None, wall seconds), for the terminal summary


def _is_worker(config) -> bool:
  return hasattr(config, "workerinput")


def pytest_configure(config):
  global _made_lock_dir
  # The controller makes the lock directory before xdist starts its workers (pytest_sessionstart), so they
  # inherit it through the environment.
  if not _is_worker(config) and LOCK_DIR_ENV not in os.environ:
    _made_lock_dir = os.environ[LOCK_DIR_ENV] = tempfile.mkdtemp(prefix="jaxagent-tests-locks-")


def pytest_sessionstart(session):
  global _START
  _START = time.monotonic()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  lock_dir = os.environ.get(LOCK_DIR_ENV)
  if not _is_worker(item.config) or lock_dir is None:
    return (yield)
  alone = item.get_closest_marker("alone") is not None
  with open(os.path.join(lock_dir, "turnstile"), "a") as turnstile, open(os.path.join(lock_dir, "room"), "a") as room:
    fcntl.flock(turnstile, fcntl.LOCK_EX)  # an `alone` test holds this while it waits: no new test gets in
    try:
      fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    finally:
      fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
      return (yield)
    finally:
      fcntl.flock(room, fcntl.LOCK_UN)


def budget_verdict(wall_s: float, environ=os.environ) -> str | None:
  """The failure message when `wall_s` exceeds the budget by more than the margin; None when within it or unset."""
  if not environ.get(BUDGET_ENV):
    return None
  budget = float(environ[BUDGET_ENV])
  margin = float(environ.get(MARGIN_ENV) or DEFAULT_MARGIN)
  limit = budget * (1 + margin)
  if wall_s <= limit:
    return None
  return (f"test time budget exceeded: the session took {wall_s:.1f} s, over {BUDGET_ENV}={budget:g} s "
          f"x (1 + margin {margin:g}) = {limit:.1f} s")


def pytest_sessionfinish(session, exitstatus):
  global _budget_report
  if _is_worker(session.config):
    return
  if _made_lock_dir is not None:
    shutil.rmtree(_made_lock_dir, ignore_errors=True)
  if not os.environ.get(BUDGET_ENV):
    return
  wall_s = time.monotonic() - _START
  failed = budget_verdict(wall_s)
  if failed is not None and session.exitstatus == pytest.ExitCode.OK:
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
  _budget_report = (failed, wall_s)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  if _budget_report is None:
    return
  failed, wall_s = _budget_report
  if failed is not None:
    terminalreporter.section("time budget", sep="=", red=True, bold=True)
    terminalreporter.write_line(failed, red=True)
  else:
    terminalreporter.write_line(f"time budget: the session took {wall_s:.1f} s, within {BUDGET_ENV}="
                                f"{float(os.environ[BUDGET_ENV]):g} s x (1 + margin "
                                f"{float(os.environ.get(MARGIN_ENV) or DEFAULT_MARGIN):g})")
