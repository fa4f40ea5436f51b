"""Test runner of the `swe` env: runs a real package's own pytest tests in a fresh interpreter, inside the
episode's sandbox (stdlib + pytest, found on PYTHONPATH; envs imports only its constants).

    python -B swe_runner.py WORK_DIR < SPEC

SPEC (stdin, one JSON object): nonce; paths (test files or directories, relative to WORK_DIR); kept (node ids
to run, null: all collected); select (node ids to run among those, null: all); per_test_s (a test's limit in
CPU seconds of this process, and WALL_PER_CPU times that in wall-clock seconds); cpu_limit_s (the whole run's
limit in CPU seconds, null: none; past it the process exits with CPU_LIMIT_EXIT and reports nothing); trace
(directories under WORK_DIR whose executed lines are recorded, with which tests call each function, null: no
tracing); report (where to write the report, a JSON file). Limits are CPU time, so a loaded machine (other runs
sharing its cores) slows a run without changing its verdict.

The one stdout line `NONCE SHA256` vouches for the report: its sha256 (what the code under test prints cannot
forge it, nor can it swap the file unseen). The report: {results: {node id: passed|failed|error|skipped|timeout},
messages: {node id: the exception's one-line message}, durations: {node id: seconds of its call}, cpu: {node id:
CPU seconds from its start to its finish, setup, teardown and pytest's own work included}, collect_errors: {node
id: message}, collect_cpu_s and cpu_s (this process's CPU seconds when collection ended and at the end), and when
tracing: lines: {file: [line, ...]}, callers: {file: {first line of a function: [node id, ...]}} (the tests
during whose setup, call or teardown the function ran, and "" when it ran outside any test: at import; the first
line is its code object's, a decorator's line for a decorated function)}. Messages name no paths and no line
numbers of the code under test (a task's text is written from them and must not point at the mutated line).
"""

import hashlib
import json
import math
import os
import re
import resource
import signal
import sys
import threading
import time

MESSAGE_CHARS = 300
CPU_LIMIT_EXIT = 124  # the exit status of a run stopped at its CPU limit (cpu_limit_s)
WALL_PER_CPU = 4.0  # a test's wall-clock alarm per second of its CPU limit (a test that sleeps)


class _TestTimeout(BaseException):
  """Raised by the alarm; a BaseException so `except Exception` in the code under test cannot swallow it."""


def _message(report) -> str:
  crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
  text = crash.message if crash is not None else str(getattr(report, "longrepr", ""))
  text = re.sub(r"(/[\w.-]+)+\.py(:\d+)?", "<file>", text.strip())  # no paths, no line numbers
  return text.splitlines()[0][:MESSAGE_CHARS] if text else ""


class Report:
  """The pytest plugin that selects the tests and records what happened to each."""

  def __init__(self, spec):
    self.kept = None if spec.get("kept") is None else set(spec["kept"])
    self.select = None if spec.get("select") is None else set(spec["select"])
    self.per_test_s = float(spec.get("per_test_s") or 0)
    self.results, self.messages, self.durations, self.collect_errors = {}, {}, {}, {}
    self.timed_out = set()
    self.current = None  # the test whose alarm is set
    self.running = None  # the test in setup, call or teardown (for the callers of each function)
    self.collect_cpu_s = None
    self.cpu, self.started_cpu = {}, 0.0  # each test's CPU seconds: setup, call, teardown and pytest's own work

  def pytest_collection_finish(self, session):
    self.collect_cpu_s = time.process_time()

  def pytest_runtest_logstart(self, nodeid, location):
    self.started_cpu = time.process_time()

  def pytest_runtest_setup(self, item):
    self.running = item.nodeid

  def pytest_collection_modifyitems(self, config, items):
    keep = [i for i in items if (self.kept is None or i.nodeid in self.kept)
            and (self.select is None or i.nodeid in self.select)]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep

  def pytest_collectreport(self, report):
    if report.failed:
      self.collect_errors[report.nodeid] = _message(report)

  def pytest_runtest_call(self, item):
    self.current = item.nodeid
    if self.per_test_s > 0:
      signal.setitimer(signal.ITIMER_PROF, self.per_test_s)
      signal.setitimer(signal.ITIMER_REAL, WALL_PER_CPU * self.per_test_s)  # code that sleeps

  def pytest_runtest_teardown(self, item):
    signal.setitimer(signal.ITIMER_PROF, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)

  def pytest_runtest_logfinish(self, nodeid, location):
    self.running = None
    self.cpu[nodeid] = round(time.process_time() - self.started_cpu, 4)

  def alarm(self, signum, frame):
    self.timed_out.add(self.current)
    raise _TestTimeout(f"the test used more than {self.per_test_s:g}s of CPU")

  def pytest_runtest_logreport(self, report):
    nodeid = report.nodeid
    if report.when == "call" or (report.when == "setup" and not report.passed):
      if report.passed:
        status = "passed"
      elif report.skipped:
        status = "skipped"
      elif nodeid in self.timed_out:
        status = "timeout"
      else:
        status = "failed" if report.when == "call" else "error"
      self.results[nodeid] = status
      if status in ("failed", "error", "timeout"):
        self.messages[nodeid] = _message(report)
      if report.when == "call":
        self.durations[nodeid] = round(report.duration, 4)
    elif report.when == "teardown" and report.failed and self.results.get(nodeid) == "passed":
      self.results[nodeid] = "error"
      self.messages[nodeid] = _message(report)


def _tracer(roots, plugin):
  """A line tracer recording the executed lines of files under `roots`, and per function (file, first line of
  its code object) the tests running when it was called."""
  lines, callers = {}, {}

  def local(frame, event, arg):
    if event == "line":
      lines[frame.f_code.co_filename].add(frame.f_lineno)
    return local

  def global_(frame, event, arg):
    code = frame.f_code
    name = code.co_filename
    if name.startswith(roots):
      lines.setdefault(name, set()).add(frame.f_lineno)
      callers.setdefault(name, {}).setdefault(code.co_firstlineno, set()).add(plugin.running or "")
      return local
    return None

  return global_, lines, callers


def _cpu_limit(seconds: float) -> None:
  """This process exits with CPU_LIMIT_EXIT after `seconds` of CPU (SIGXCPU), and is killed a second later
  (the hard limit) if the code under test holds the interpreter in C code past it."""
  soft = max(1, math.ceil(seconds))
  signal.signal(signal.SIGXCPU, lambda signum, frame: os._exit(CPU_LIMIT_EXIT))
  resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))


def main() -> None:
  work = os.path.abspath(sys.argv[1])
  spec = json.loads(sys.stdin.readline())
  nonce = spec["nonce"]
  out = os.fdopen(os.dup(1), "w")
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)  # pytest's and the code under test's output go nowhere
  os.dup2(devnull, 2)
  if spec.get("cpu_limit_s"):
    _cpu_limit(float(spec["cpu_limit_s"]))
  os.chdir(work)
  sys.path.insert(0, work)
  import pytest  # pylint: disable=g-import-not-at-top  (after the output is redirected)
  plugin = Report(spec)
  signal.signal(signal.SIGPROF, plugin.alarm)
  signal.signal(signal.SIGALRM, plugin.alarm)
  lines = callers = None
  if spec.get("trace"):
    roots = tuple(os.path.join(work, d) + os.sep for d in spec["trace"])
    tracer, lines, callers = _tracer(roots, plugin)
    threading.settrace(tracer)
    sys.settrace(tracer)
  args = ["-q", "-p", "no:cacheprovider", "-p", "no:stepwise", "--rootdir", work, "-c", os.devnull,
          "-o", "addopts=", "--import-mode=prepend", *spec["paths"]]
  try:
    code = int(pytest.main(args, plugins=[plugin]))
  finally:
    sys.settrace(None)
    threading.settrace(None)
  report = dict(exit_code=code, results=plugin.results, messages=plugin.messages, durations=plugin.durations,
                collect_errors=plugin.collect_errors, collect_cpu_s=plugin.collect_cpu_s, cpu=plugin.cpu,
                cpu_s=round(time.process_time(), 4))
  if lines is not None:
    report["lines"] = {os.path.relpath(f, work): sorted(v) for f, v in sorted(lines.items())}
    report["callers"] = {os.path.relpath(f, work): {str(first): sorted(tests) for first, tests in sorted(v.items())}
                         for f, v in sorted(callers.items())}
  data = json.dumps(report).encode()
  with open(spec["report"], "wb") as f:
    f.write(data)
  out.write(f"{nonce} {hashlib.sha256(data).hexdigest()}\n")
  out.flush()
  os._exit(0)


if __name__ == "__main__":
  main()
