"""A user's environment plugs in without editing this repo: `package.module:ATTR`, `jaxagent.envs` entry points,
workers that import it (local pool, with and without bubblewrap), and clear errors for names that resolve to
nothing."""

import dataclasses
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import envs
from envs import _registry, cli
from envs import pool as pool_lib
from tests._sandbox import require_bwrap

REPO = Path(__file__).resolve().parents[1]

USER_MODULE = '''
"""A user's env: count up to a target with `inc`, then `submit`; the verifier checks the count."""
import dataclasses
import random

import envs


class CounterVerifier(envs.Verifier):
  version = "counter-v1"

  def score(self, task, final):
    passed = final == task.payload["target"]
    return envs.Verdict(passed, 1.0 if passed else 0.0, {"count": final}, self.version)


class CounterEnv(envs.Env):
  name = "counter"
  description = "count to the target: inc, then submit"
  parser = envs.ActionParser(tools=("inc", "submit"), max_chars=16)

  def _reset(self, task, seed):
    self.count = 0
    return f"reach {task.payload['target']} (seed {seed})"

  def _step(self, call):
    if call.arg:
      raise envs.InvalidAction(f"{call.name} takes no argument")
    if call.name == "inc":
      self.count += 1
      return envs.StepResult(envs.Observation(str(self.count)), {}, False, None)
    v = CounterVerifier().score(self.task, self.count)
    return envs.StepResult(envs.Observation("yes" if v.passed else "no"), {"outcome": v.reward}, True,
                           envs.Termination.COMPLETED, verdict=v)


SPLIT_TARGETS = {"train": (1, 3), "tune": (4, 4), "eval": (5, 5)}  # splits isolated by range (the trainer
                                                                    # refuses eval tasks that train has too)


def tasks(split, n, seed=0):
  rng = random.Random(f"{split}:{seed}")
  return [envs.Task(f"counter-{split}-{i}", split, {"target": rng.randint(*SPLIT_TARGETS[split])}, "1")
          for i in range(n)]


def demo(task, seed=0):
  return ["inc"] * task.payload["target"] + ["submit"]


SPEC = envs.EnvSpec(name="counter", description=CounterEnv.description, make=CounterEnv, tasks=tasks, demo=demo,
                    version_sources=(CounterEnv,))
NOT_A_SPEC = 3
CLASH = dataclasses.replace(SPEC, name="calculator")
'''

ENTRY_POINTS = """
[jaxagent.envs]
counter = userenvs_pkg.mod:SPEC
broken = userenvs_pkg.nope:SPEC
"""


@pytest.fixture
def user_src(tmp_path):
  """A directory holding the package `userenvs_pkg` (module `mod`, EnvSpec `SPEC`); on nobody's path yet."""
  src = tmp_path / "src"
  (src / "userenvs_pkg").mkdir(parents=True)
  (src / "userenvs_pkg" / "__init__.py").write_text("")
  (src / "userenvs_pkg" / "mod.py").write_text(textwrap.dedent(USER_MODULE))
  yield src
  for name in [m for m in sys.modules if m.split(".")[0] == "userenvs_pkg"]:  # each test imports its own copy
    del sys.modules[name]


@pytest.fixture
def dist(user_src):
  """An installed distribution's metadata declaring the entry points (next to the package, as pip does)."""
  info = user_src / "userenvs_pkg-0.1.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: userenvs-pkg\nVersion: 0.1\n")
  (info / "entry_points.txt").write_text(ENTRY_POINTS)
  return user_src


def _run(args, src, cwd):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(REPO)]))
  return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_cli_checks_a_user_module_through_local_workers(user_src, tmp_path):
  """Only the trainer's PYTHONPATH knows the module: the worker (sandboxed when bwrap exists) must import it."""
  r = _run(["-m", "envs.cli", "check", "userenvs_pkg.mod:SPEC", "--pool", "local", "--episodes", "4"], user_src,
           tmp_path)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "(local pool, 4 episodes x 2)" in r.stdout and "deterministic replay rate: 100.0%" in r.stdout, r.stdout
  assert "completed=8" in r.stdout and "parser_rejected_continued=8" in r.stdout, r.stdout


@pytest.mark.parametrize("sandbox", ["none", "bwrap"])
def test_local_workers_import_a_module_found_on_this_process_path(user_src, monkeypatch, sandbox, tmp_path):
  """The module is only on this process's sys.path (not on $PYTHONPATH): import_roots carries it over."""
  if sandbox == "bwrap":
    require_bwrap()
  monkeypatch.syspath_prepend(str(user_src))
  monkeypatch.delenv("PYTHONPATH", raising=False)
  name = "userenvs_pkg.mod:SPEC"
  spec = envs.get(name)
  assert pool_lib.import_roots("userenvs_pkg.mod") == [(str(user_src.resolve()), "userenvs_pkg")]
  tasks = spec.tasks("eval", 3, 0)
  with pool_lib.make_pool(3, env=name, kind="local", sandbox=sandbox) as p:
    assert p.sandboxed == (sandbox == "bwrap") and p.version == spec.version
    p.reset_many(range(3), tasks, range(3))
    for j in range(max(len(spec.demo(t)) for t in tasks)):
      rows = [i for i, t in enumerate(tasks) if j < len(spec.demo(t))]
      results = p.step_many(rows, [spec.demo(tasks[i])[j] for i in rows])
    assert all(r.done and r.verdict.passed and r.verdict.version == "counter-v1" for r in results), results
    assert all(r.call == envs.Call("submit", "") and r.outcome is envs.Outcome.COMPLETED for r in results)
  if sandbox == "bwrap":  # inside, only the user's package is bound in, not the rest of its directory
    (user_src / "answers.txt").write_text("42")
    probe = ("import os, userenvs_pkg.mod; print(sorted(os.listdir('/opt/user0')), "
             f"os.path.exists({str(user_src / 'answers.txt')!r}), userenvs_pkg.mod.__file__)")
    cmd = pool_lib.bwrap_command(str(tmp_path), ["-c", probe], pool_lib.import_roots("userenvs_pkg.mod"))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["['userenvs_pkg']", "False", "/opt/user0/userenvs_pkg/mod.py"], out


def test_entry_point_envs_are_listed_checked_and_served(dist, tmp_path):
  probe = ("import warnings, envs; warnings.simplefilter('always'); print(envs.names()); "
           "print(envs.get('counter').version, envs.is_valid_name('counter'), envs.is_valid_name('broken'))")
  r = _run(["-c", probe], dist, tmp_path)
  assert r.returncode == 0, r.stderr
  names, line = r.stdout.splitlines()
  assert "'counter'" in names and "'calculator'" in names and "broken" not in names
  assert line.endswith(" True False")
  # The broken entry point is a warning that names it, not a crash.
  assert "entry point 'broken' = 'userenvs_pkg.nope:SPEC'" in r.stderr and "ModuleNotFoundError" in r.stderr
  listed = _run(["-m", "envs.cli", "list"], dist, tmp_path)
  assert listed.returncode == 0 and any(l.split()[0] == "counter" for l in listed.stdout.splitlines())
  # A worker is handed the entry point's module:attr (a sandbox has the module, not the package metadata).
  checked = _run(["-m", "envs.cli", "check", "counter", "--pool", "local", "--episodes", "2"], dist, tmp_path)
  assert checked.returncode == 0 and "deterministic replay rate: 100.0%" in checked.stdout, checked.stderr


def test_entry_points_register_once_and_broken_ones_warn(monkeypatch, user_src):
  import importlib.metadata
  monkeypatch.syspath_prepend(str(user_src))
  eps = importlib.metadata.EntryPoints([
      importlib.metadata.EntryPoint("counter", "userenvs_pkg.mod:SPEC", "jaxagent.envs"),
      importlib.metadata.EntryPoint("number", "userenvs_pkg.mod:NOT_A_SPEC", "jaxagent.envs"),
      importlib.metadata.EntryPoint("dup", "envs.builtin.faults:SPEC", "jaxagent.envs"),
      importlib.metadata.EntryPoint("clash", "userenvs_pkg.mod:CLASH", "jaxagent.envs")])
  calls = []
  monkeypatch.setattr(importlib.metadata, "entry_points",
                      lambda group: calls.append(group) or eps.select(group=group))
  monkeypatch.setattr(_registry, "_REGISTRY", dict(_registry._REGISTRY))
  monkeypatch.setattr(_registry, "_SOURCES", {})
  monkeypatch.setattr(_registry, "_entry_points_loaded", False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert "counter" in envs.names() and "number" not in envs.names()
  assert calls == ["jaxagent.envs"]  # loaded lazily, once
  assert [str(w.message) for w in caught] == [
      "envs: entry point 'number' = 'userenvs_pkg.mod:NOT_A_SPEC' (group 'jaxagent.envs') skipped: TypeError: "
      "loads to a int, not an EnvSpec",
      "envs: entry point 'clash' = 'userenvs_pkg.mod:CLASH' (group 'jaxagent.envs') skipped: ValueError: "
      "environment 'calculator' is already registered"]
  assert envs.get("counter").name == "counter" and _registry.worker_name("counter") == "userenvs_pkg.mod:SPEC"
  assert _registry.worker_name("faults") == "faults"  # the same spec registered twice is not a conflict
  assert envs.get("calculator") is envs.builtin.calculator.SPEC


@pytest.mark.parametrize("name,says", [
    ("nosuchmod:SPEC", "cannot import module 'nosuchmod' (ModuleNotFoundError: No module named 'nosuchmod')"),
    ("envs.builtin.calculator:NOPE", "module 'envs.builtin.calculator' has no attribute 'NOPE' (its EnvSpecs: "
                                     "['SPEC'])"),
    ("envs.builtin.calculator:tasks", "envs.builtin.calculator:tasks is a function, not an EnvSpec"),
    ("envs.builtin.calculator:", "not of the form 'package.module:ATTR'"),
    ("calculater", "unknown environment 'calculater' (did you mean 'calculator'?)"),
])
def test_bad_names_raise_one_clear_error(name, says, capsys):
  with pytest.raises(envs.UnknownEnvError) as err:
    envs.get(name)
  message = str(err.value)
  assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
  assert repr(name) in message and says in message, message
  assert "'calculator'" in message and "'package.module:ATTR' naming an EnvSpec" in message, message
  assert not envs.is_valid_name(name)
  with pytest.raises(envs.UnknownEnvError):
    envs.check_name(name)
  assert cli.main(["check", name]) == 2
  err_lines = capsys.readouterr().err.splitlines()
  assert err_lines == [f"envs: error: {message}"]


def test_valid_names():
  assert envs.is_valid_name("calculator") and envs.is_valid_name("envs.builtin.calculator:SPEC")
  envs.check_name("envs.builtin.guess:SPEC")


STALE_MODULE = """
from envs.builtin import calculator
import dataclasses

def demo(task):  # written before demo() took the episode's seed
  return calculator.demo(task, 0)

SPEC = dataclasses.replace(calculator.SPEC, name="stale", demo=demo)
"""


def test_a_user_env_written_for_the_old_demo_signature_gets_a_clear_error(tmp_path, monkeypatch, capsys):
  (tmp_path / "stale_pkg").mkdir()
  (tmp_path / "stale_pkg" / "__init__.py").write_text("")
  (tmp_path / "stale_pkg" / "mod.py").write_text(STALE_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, "stale_pkg.mod", raising=False)
  with pytest.raises(envs.UnknownEnvError) as err:
    envs.get("stale_pkg.mod:SPEC")
  message = str(err.value)
  assert isinstance(err.value.__cause__, envs.EnvAPIError)
  for says in ("'stale_pkg.mod:SPEC'", "demo = demo(task)", "cannot be called as demo(task, seed, **options)",
               "demo gained the episode's `seed`"):
    assert says in message, message
  assert cli.main(["check", "stale_pkg.mod:SPEC"]) == 2
  assert capsys.readouterr().err.splitlines() == [f"envs: error: {message}"]
  with pytest.raises(envs.EnvAPIError, match=r"EnvSpec 'x': tasks is 'int', not a function"):
    dataclasses.replace(envs.get("calculator"), name="x", tasks=3)
