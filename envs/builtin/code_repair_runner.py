"""Test runner of the `code_repair` env, run as a script in a fresh interpreter (never imported by envs).

    python -s -S -B code_repair_runner.py PKG_DIR TESTS_FILE PER_TEST_TIMEOUT_S BUDGET_S [TEST_NAME ...]

The first stdin line is a nonce; the report is the one stdout line `NONCE {json}`, so output printed by the
code under test cannot forge it. Imports the modules from PKG_DIR (the episode's editable copy) and the
tests from TESTS_FILE (the pristine copy). Each test gets an alarm of PER_TEST_TIMEOUT_S; tests left when
BUDGET_S is spent are reported as not run. Tracebacks name files by basename only, so reports do not depend on
where the episode's tmp dir is (deterministic replay). Plain stdlib, no envs imports.
"""

import importlib.util
import json
import os
import resource
import signal
import sys
import time
import traceback

MAX_FRAMES = 4


class _TestTimeout(BaseException):
  """Raised by the alarm; a BaseException so `except Exception` in the code under test cannot swallow it."""


def _alarm(signum, frame):
  raise _TestTimeout()


def _describe(exc: BaseException, tests_file: str) -> str:
  me = os.path.abspath(__file__)
  frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) != me and not f.filename.startswith("<frozen")]
  lines = [f"  {os.path.basename(f.filename)}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
           for f in frames[-MAX_FRAMES:]]
  msg = str(exc)
  lines.append(f"  {type(exc).__name__}" + (f": {msg[:300]}" if msg else ""))
  return "\n".join(lines)


def main() -> None:
  pkg_dir, tests_file, per_test, budget = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
  wanted = sys.argv[5:]
  nonce = sys.stdin.readline().strip()
  out = os.fdopen(os.dup(1), "w")
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)  # prints of the code under test go nowhere
  os.dup2(devnull, 2)
  for limit, value in ((resource.RLIMIT_AS, 1 << 30), (resource.RLIMIT_FSIZE, 1 << 20)):
    try:
      resource.setrlimit(limit, (value, value))
    except (ValueError, OSError):
      pass
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path[:] = [pkg_dir] + [p for p in sys.path[1:] if p and os.path.abspath(p) != here]
  sys.setrecursionlimit(400)
  report = dict(results={}, details={}, import_error=None)
  signal.signal(signal.SIGALRM, _alarm)
  start = time.monotonic()
  try:
    signal.setitimer(signal.ITIMER_REAL, per_test)
    spec = importlib.util.spec_from_file_location("pkg_tests", tests_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    signal.setitimer(signal.ITIMER_REAL, 0)
  except BaseException as e:  # a module the tests import is broken (syntax, import-time error, hang)
    signal.setitimer(signal.ITIMER_REAL, 0)
    report["import_error"] = ("timeout" if isinstance(e, _TestTimeout) else "error") + "\n" + _describe(e, tests_file)
    out.write(nonce + " " + json.dumps(report) + "\n")
    out.flush()
    os._exit(0)
  names = [n for n, v in vars(mod).items() if n.startswith("test_") and callable(v)]
  for name in wanted or names:
    if name not in names:
      report["results"][name] = "missing"
      continue
    if time.monotonic() - start > budget:
      report["results"][name] = "not_run"
      continue
    try:
      signal.setitimer(signal.ITIMER_REAL, per_test)
      getattr(mod, name)()
      signal.setitimer(signal.ITIMER_REAL, 0)
      report["results"][name] = "pass"
    except _TestTimeout as e:
      report["results"][name] = "timeout"
      report["details"][name] = f"  timeout: the test ran longer than {per_test:g}s"
    except BaseException as e:  # SystemExit, KeyboardInterrupt from the code under test count as failures.
      signal.setitimer(signal.ITIMER_REAL, 0)
      report["results"][name] = "fail"
      report["details"][name] = _describe(e, tests_file)
  signal.setitimer(signal.ITIMER_REAL, 0)
  out.write(nonce + " " + json.dumps(report) + "\n")
  out.flush()
  os._exit(0)


if __name__ == "__main__":
  main()
