"""Code repair: a tiny Python package with tests ships in `code_repair_pkg/`; a task is one AST mutation of its
source that makes an existing test fail (found by running the tests); the agent edits the mutated copy until
the tests pass again. The verifier is the package's own test file, run in a sandbox of its own.

An episode of split S sees S's slice of the package only: S's modules (mutated) and S's tests, as
`pkg_tests.py`. The other splits' modules and tests (held out, and the pristine text of every module, which
is the answer to its mutations) never enter the episode's tree or any sandbox its code runs in.

Actions (one line each):
  show FILE                 print FILE with line numbers (a module, or the read-only pkg_tests.py)
  replace FILE:LINE TEXT    replace line LINE of FILE with TEXT; `replace LINE TEXT` edits the last shown
                            module. TEXT without leading whitespace keeps the line's indentation.
  test                      run the split's tests against the edited copy, show the result
  submit                    end the episode; the verifier runs the split's pristine tests (failing test + rest)

Mutation operators (each changes exactly one line): cmp_swap (< <=, > >=, == !=), const_off_by_one (integer
literal +-1), arith_flip (+ -, += -=), bool_swap (and or), negate_cond (if/while test -> not (test)). A
mutation is kept when at least one test fails and no test hangs (per-test alarm); the first failing test is
the task's. Splits are isolated by MODULE: train mutates textops.py and stack.py, tune intervals.py, eval
search.py. Scripted demonstration: the inverse mutation as one `replace`, then `submit`.

Every test run is a fresh interpreter (`code_repair_runner.py`) with a per-test alarm, a total budget and a
subprocess timeout, inside the episode's sandbox (`envs._sandbox`: /work is the episode's modules, the runner
and the split's tests are bound read-only, nothing else of the worker is there). The verifier copies the
submitted modules out of the episode's tree (regular files only, never through a link), runs the pristine
tests on that copy in a read-only sandbox of its own, and rejects submissions that introduce identifiers the
pristine module does not use (e.g. `open`, `sys`). Run it in a sandboxed pool (local + bubblewrap, or docker):
actions execute arbitrary edited code.
"""

from __future__ import annotations

import ast
import concurrent.futures
import functools
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from envs import _sandbox
from envs.builtin import mutations as mutations_lib
from envs._api import (COMPLETED, ENV_TIMEOUT, ActionParser, Call, Env, EnvError, EnvSpec, InvalidAction,
                       Observation, StepResult, Task, Verdict, Verifier, source_version, Tool)

HERE = Path(__file__).resolve().parent
PKG_DIR = HERE / "code_repair_pkg"
RUNNER = HERE / "code_repair_runner.py"
TESTS_FILE = "pkg_tests.py"
SPLIT_MODULES = {"train": ("textops.py", "stack.py"), "tune": ("intervals.py",), "eval": ("search.py",)}
MODULES = tuple(m for ms in SPLIT_MODULES.values() for m in ms)
FILES = tuple(sorted(MODULES + (TESTS_FILE,)))
DATA_FILES = tuple(PKG_DIR / f for f in FILES) + (RUNNER,)

PER_TEST_TIMEOUT_S = 1.0     # alarm per test function inside the runner
RUN_BUDGET_S = 3.0           # tests still pending after this are reported as not run
MAX_MODULE_BYTES = 1 << 17  # a module the episode's code grew past this is not shown or edited
RUN_TIMEOUT_S = 6.0          # the runner subprocess itself (below the pool's default 10 s action timeout)
GEN_PER_TEST_TIMEOUT_S = 0.3  # task generation: a mutant that makes any test this slow is dropped
SAFE_NEW_NAMES = frozenset({"len", "range", "min", "max", "abs", "sorted", "reversed", "enumerate", "zip", "sum",
                            "list", "tuple", "dict", "int", "str", "bool", "any", "all", "repr", "chr", "ord",
                            "append", "pop", "True", "False", "None"})


class RunnerTimeout(Exception):
  """The test runner process did not finish within RUN_TIMEOUT_S (killed)."""


def _run_runner(launch, python: str, runner: str, pkg_dir: str, tests_file: str, names: Sequence[str],
                per_test_s: float | None, budget_s: float | None, timeout_s: float | None) -> dict[str, Any]:
  """Runs code_repair_runner.py by `launch(argv, stdin, timeout) -> Completed` and returns its report."""
  per_test_s = PER_TEST_TIMEOUT_S if per_test_s is None else per_test_s
  budget_s = RUN_BUDGET_S if budget_s is None else budget_s
  timeout_s = RUN_TIMEOUT_S if timeout_s is None else timeout_s
  nonce = secrets.token_hex(16)
  argv = [python, "-s", "-S", "-B", runner, pkg_dir, tests_file, repr(per_test_s), repr(budget_s), *names]
  try:
    done = launch(argv, (nonce + "\n").encode(), timeout_s)
  except OSError as e:
    raise EnvError(f"cannot start the test runner {python}: {e}") from None
  if done.code is None:
    raise RunnerTimeout(f"the tests did not finish within {timeout_s:g}s (killed)")
  for line in done.output.decode("utf-8", errors="replace").splitlines():
    if line.startswith(nonce + " "):
      return json.loads(line[len(nonce) + 1:])
  # No report: the runner died (e.g. the code under test hit a resource limit or killed it).
  return dict(results={}, details={}, import_error=f"the test process died (exit {done.code}) before reporting")


def run_tests(pkg_dir: Path, names: Sequence[str] = (), *, per_test_s: float | None = None,
              budget_s: float | None = None, timeout_s: float | None = None) -> dict[str, Any]:
  """Run the pristine tests (all, or `names`) against the modules in `pkg_dir` in a fresh interpreter, here,
  unconfined: for trusted code only (task generation runs our own mutants). Episodes use `run_in_sandbox`.

  Returns {results: {test: pass|fail|timeout|not_run|missing}, details: {test: text}, import_error: str|None}.
  Raises RunnerTimeout when the process outlives `timeout_s` (its whole process group is killed), EnvError
  when it cannot start. Defaults: the module's PER_TEST_TIMEOUT_S, RUN_BUDGET_S, RUN_TIMEOUT_S.
  """
  env = {"PATH": "/usr/bin:/bin", "HOME": str(pkg_dir), "LC_ALL": "C", "PYTHONHASHSEED": "0"}
  launch = lambda argv, stdin, timeout: _sandbox.run_capped(argv, cwd=pkg_dir, env=env, stdin=stdin, timeout=timeout)
  return _run_runner(launch, sys.executable, str(RUNNER), str(pkg_dir), str(PKG_DIR / TESTS_FILE), names,
                     per_test_s, budget_s, timeout_s)


def tests_sandbox(mode: str, split: str, **kwargs) -> _sandbox.EpisodeSandbox:
  """A sandbox for `split`'s tests: the runner and the split's slice of the tests bound read-only at /opt/run
  (`run_in_sandbox` runs them on the modules in its /work)."""
  box = _sandbox.EpisodeSandbox(mode, binds={"/opt/run/runner.py": RUNNER}, **kwargs)
  box.add_file("/opt/run/pkg_tests.py", split_tests(split)[0])
  return box


def run_in_sandbox(box: _sandbox.EpisodeSandbox, names: Sequence[str] = (), *, per_test_s: float | None = None,
                   budget_s: float | None = None, timeout_s: float | None = None) -> dict[str, Any]:
  """`run_tests` for an episode: the modules in `box.work` against the tests of `box` (see `tests_sandbox`),
  inside the sandbox."""
  launch = lambda argv, stdin, timeout: box.run(argv, timeout=timeout, stdin=stdin, env={"PYTHONHASHSEED": "0"})
  return _run_runner(launch, _sandbox.python(), box.path("/opt/run/runner.py"), box.path("/work"),
                     box.path("/opt/run/pkg_tests.py"), names, per_test_s, budget_s, timeout_s)


def format_report(report: Mapping[str, Any], only: Sequence[str] = ()) -> str:
  """Deterministic text of a runner report (no paths, no timings)."""
  if report.get("import_error"):
    return "cannot import the package:\n" + report["import_error"]
  results = report["results"]
  names = list(only) or list(results)
  counts: dict[str, int] = {}
  for n in names:
    counts[results.get(n, "missing")] = counts.get(results.get(n, "missing"), 0) + 1
  lines = [f"{len(names)} tests: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))]
  for n in names:
    status = results.get(n, "missing")
    if status != "pass":
      lines.append(f"{status.upper()} {n}")
      if n in report.get("details", {}):
        lines.append(report["details"][n])
  return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Mutations.

CODE_REPAIR_KINDS = ("cmp_swap", "const_off_by_one", "arith_flip", "bool_swap", "negate_cond")


def candidate_mutations(module: str, source: str) -> list[dict[str, Any]]:
  """Every single-line mutation of `source` by code_repair's operators (`envs.builtin.mutations`), in source
  order."""
  if not source.isascii():
    raise ValueError(f"{module}: the package sources must be ASCII")
  return mutations_lib.candidates(module, source, CODE_REPAIR_KINDS)


def apply_mutation(source: str, m: Mapping[str, Any]) -> str:
  """`source` with mutation `m` applied; raises EnvError if `source` is not the text `m` was made from."""
  try:
    return mutations_lib.apply(source, m)
  except mutations_lib.MutationMismatch as e:
    raise EnvError(str(e)) from None


def pristine(module: str) -> str:
  return (PKG_DIR / module).read_text()


def write_package(root: Path, mutation: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                  modules: Sequence[str] = MODULES) -> None:
  """`modules` (default: all) in `root`, with the mutation or mutations applied; the tests stay in PKG_DIR."""
  mutations = [] if mutation is None else [mutation] if isinstance(mutation, Mapping) else list(mutation)
  for module in modules:
    text = pristine(module)
    for m in mutations:
      if m["module"] == module:
        text = apply_mutation(text, m)
    (root / module).write_text(text)


@functools.lru_cache(maxsize=None)
def split_tests(split: str) -> tuple[str, tuple[str, ...]]:
  """(source, test names) of `split`'s slice of the test file: its modules' imports, the helpers, and the tests
  that use only its modules' names. What an episode of `split` sees as pkg_tests.py and what its verifier runs."""
  if split not in SPLIT_MODULES:
    raise ValueError(f"split={split!r}: not one of {sorted(SPLIT_MODULES)}")
  source = (PKG_DIR / TESTS_FILE).read_text()
  tree = ast.parse(source)
  mine = {m[:-len(".py")] for m in SPLIT_MODULES[split]}
  owner = {a.asname or a.name: n.module for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
  kept, names = [], []
  for node in tree.body:
    if isinstance(node, ast.ImportFrom) and node.module not in mine:
      continue
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
      used = {owner[n.id] for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in owner}
      if used - mine:
        continue
      names.append(node.name)
    kept.append(ast.get_source_segment(source, node))
  return "\n\n".join(kept) + "\n", tuple(names)


def _try_mutation(m: dict[str, Any]) -> dict[str, Any] | None:
  root = Path(tempfile.mkdtemp(prefix="crgen-"))
  try:
    write_package(root, m)
    try:
      compile((root / m["module"]).read_text(), m["module"], "exec")
    except SyntaxError:
      return None
    try:
      report = run_tests(root, per_test_s=GEN_PER_TEST_TIMEOUT_S, budget_s=RUN_BUDGET_S)
    except RunnerTimeout:
      return None
    results = report["results"]
    if report.get("import_error") or any(v != "pass" and v != "fail" for v in results.values()):
      return None  # broken import, a hang or a budget overrun: not a clean, fast, deterministic task.
    failing = [n for n, v in results.items() if v == "fail"]
    return dict(m, failing_tests=failing) if failing else None   # no test fails: an equivalent mutant.
  finally:
    shutil.rmtree(root, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def valid_mutations(module: str) -> tuple[dict[str, Any], ...]:
  """The mutations of `module` that make at least one test fail, found by running the tests (cached)."""
  if module not in MODULES:
    raise ValueError(f"module={module!r}: not one of {MODULES}")
  cands = candidate_mutations(module, pristine(module))
  with concurrent.futures.ThreadPoolExecutor(max(2, min(8, 2 * (os.cpu_count() or 1)))) as ex:
    found = list(ex.map(_try_mutation, cands))
  return tuple(m for m in found if m is not None)


mutation_id = mutations_lib.mutation_id
TASK_VERSION = source_version(candidate_mutations, mutations_lib.candidates, data=DATA_FILES)  # operators, how applied


def tasks(split: str, n: int, seed: int = 0, mutations: int = 1) -> list[Task]:
  """`n` tasks of `split`, drawn without replacement from its modules' mutations (cycling when n exceeds them).

  `mutations` > 1: each task applies that many of one module's failing mutations, on distinct lines (distinct
  combinations while there are enough, ~1.6k pairs and ~17k triples of train mutations). The combination is not
  run at generation time: one mutation can mask another, so the task's failing test (its first mutation's) may
  pass. Such a task does not reproduce on reset: `jaxagent tasks filter` finds and reports it.
  """
  if split not in SPLIT_MODULES:
    raise ValueError(f"split={split!r}: not one of {sorted(SPLIT_MODULES)}")
  if n < 0:
    raise ValueError(f"n={n}: must be >= 0")
  if not isinstance(mutations, int) or mutations < 1:
    raise ValueError(f"mutations={mutations!r}: must be an int >= 1")
  pool = [m for module in SPLIT_MODULES[split] for m in valid_mutations(module)]
  if not pool:
    raise RuntimeError(f"code_repair: no mutation of {SPLIT_MODULES[split]} makes a test fail")
  if mutations > 1:
    return _combined_tasks(split, n, seed, mutations, pool)
  rng = random.Random(f"code_repair:{split}:{seed}")
  order: list[dict[str, Any]] = []
  while len(order) < n:
    batch = list(pool)
    rng.shuffle(batch)
    order += batch
  out = []
  for i, m in enumerate(order[:n]):
    mutation = {k: m[k] for k in ("module", "line", "col", "kind", "original", "replacement")}
    out.append(Task(id=f"cr-{split}-{seed}-{i}", split=split, version=TASK_VERSION, payload=dict(
        module=m["module"], mutation=mutation, mutation_id=mutation_id(m), failing_test=m["failing_tests"][0],
        failing_tests=list(m["failing_tests"]))))
  return out


def _combined_tasks(split: str, n: int, seed: int, k: int, pool: list[dict[str, Any]]) -> list[Task]:
  by_module: dict[str, list[dict[str, Any]]] = {}
  for m in pool:
    by_module.setdefault(m["module"], []).append(m)
  modules = sorted(mod for mod, ms in by_module.items() if len({m["line"] for m in ms}) >= k)
  if not modules:
    raise ValueError(f"mutations={k}: no module of split {split!r} has failing mutations on {k} distinct lines")
  weights = [len(by_module[mod]) for mod in modules]
  rng = random.Random(f"code_repair:{split}:{seed}:x{k}")
  seen: set[tuple[str, ...]] = set()
  out = []
  for i in range(n):
    for _ in range(100):  # a new combination while any is left (then repeats are allowed)
      module = rng.choices(modules, weights)[0]
      combo: list[dict[str, Any]] = []
      for m in rng.sample(by_module[module], len(by_module[module])):
        if m["line"] not in {c["line"] for c in combo}:
          combo.append(m)
        if len(combo) == k:
          break
      combo.sort(key=lambda m: (m["line"], m["col"]))
      key = tuple(mutation_id(m) for m in combo)
      if key not in seen:
        break
    seen.add(key)
    ms = [{f: m[f] for f in ("module", "line", "col", "kind", "original", "replacement")} for m in combo]
    failing = sorted({t for m in combo for t in m["failing_tests"]})
    out.append(Task(id=f"cr{k}-{split}-{seed}-{i}", split=split, version=TASK_VERSION, payload=dict(
        module=module, mutation=ms[0], mutations=ms, mutation_id="+".join(key),
        failing_test=combo[0]["failing_tests"][0], failing_tests=failing)))
  return out


def task_mutations(task: Task) -> list[Mapping[str, Any]]:
  """The mutations of a task (one, or `mutations` of a combined task)."""
  return list(task.payload.get("mutations") or [task.payload["mutation"]])


def demo(task: Task, seed: int = 0) -> list[str]:
  """Each inverse mutation as one `replace` of the mutated line with its pristine text, then `submit`."""
  out = []
  for m in task_mutations(task):
    line = pristine(m["module"]).splitlines()[int(m["line"]) - 1]
    out.append(f"replace {m['module']}:{m['line']} {line}")
  return out + ["submit"]


# ----------------------------------------------------------------------------------------------
# Verifier and env.


_identifiers = mutations_lib.identifiers


class CodeRepairVerifier(Verifier):
  """Runs the split's pristine tests (not the agent's copy) against the submitted modules.

  The submitted modules are copied out of the episode's tree (regular files only, no links followed) into a
  tree of the verifier's own, and the tests run there in a read-only sandbox: nothing the agent left running
  or linked can change what is verified. passed = every test of the split passes (the task's failing test
  included) and no module uses an identifier its pristine version does not (beyond a few builtins): repairs
  never need `open`, `sys` or `__import__`.
  """

  version = "code-repair-split-tests-" + source_version(data=(PKG_DIR / TESTS_FILE, RUNNER))
  sandbox_mode = "auto"  # the hosting env's episode_sandbox

  def score(self, task: Task, final: Path) -> Verdict:
    box = tests_sandbox(self.sandbox_mode, task.split, read_only=True, prefix="crverify-")
    try:
      return self._score_in(box, task, Path(final))
    finally:
      box.close()

  def _score_in(self, box: _sandbox.EpisodeSandbox, task: Task, final: Path) -> Verdict:
    new_names: dict[str, list[str]] = {}
    submitted: dict[str, str] = {}
    for module in SPLIT_MODULES[task.split]:
      data = _sandbox.read_artifact(final, module)
      if data is None:
        continue  # missing or not a regular file: the tests report the broken import
      (box.work / module).write_bytes(data)
      submitted[module] = hashlib.sha256(data).hexdigest()[:16]
      try:
        extra = _identifiers(data.decode("utf-8")) - _identifiers(pristine(module)) - SAFE_NEW_NAMES
      except (SyntaxError, ValueError):
        continue  # the tests report the broken module
      if extra:
        new_names[module] = sorted(extra)
    evidence: dict[str, Any] = dict(failing_test=task.payload["failing_test"], new_names=new_names,
                                    python=sys.version.split()[0], runner_timeout=False, submitted=submitted,
                                    tests=len(split_tests(task.split)[1]), sandbox=box.mode)
    try:
      report = run_in_sandbox(box)
    except RunnerTimeout as e:
      evidence.update(runner_timeout=True, error=str(e))
      return Verdict(False, 0.0, evidence, self.version)
    results = report["results"]
    all_pass = bool(results) and not report.get("import_error") and all(v == "pass" for v in results.values())
    passed = all_pass and results.get(task.payload["failing_test"]) == "pass" and not new_names
    evidence.update(results=dict(results), import_error=report.get("import_error"),
                    failing_test_result=results.get(task.payload["failing_test"], "missing"),
                    report=format_report(report)[:2000])
    return Verdict(passed, 1.0 if passed else 0.0, evidence, self.version)


_REPLACE = re.compile(r"(?:([A-Za-z_][\w.]*):)?(\d+)(?: (.*))?", re.S)


class CodeRepairEnv(_sandbox.SandboxedEpisodes, Env):
  name = "code_repair"
  description = ("repair a mutated Python package until its tests pass (sandboxed): show FILE, "
                 "replace FILE:LINE TEXT, test, submit")
  parser = ActionParser(tools=(
      Tool.with_arg("show", "Print a file with line numbers.", "file", "a module of the package or pkg_tests.py"),
      Tool.with_arg("replace", "Replace one line of a file.", "edit",
                    "FILE:LINE TEXT, or LINE TEXT for the last shown file"),
      Tool("test", "Run the package's tests against the edited copy and show the result."),
      Tool("submit", "End the episode; the tests are run on the edited package.")), max_chars=512)

  def __init__(self, max_turns: int = 12, **kwargs):
    super().__init__(max_turns=max_turns, **kwargs)
    self.verifier = CodeRepairVerifier()
    self.current: str | None = None
    self.files: tuple[str, ...] = ()
    self.edits = 0

  def _reset(self, task: Task, seed: int) -> str:
    self.close()
    if task.version != TASK_VERSION:
      raise EnvError(f"task {task.id} was generated for package version {task.version}, this env has "
                     f"{TASK_VERSION}: regenerate the tasks")
    p = task.payload
    self.current, self.edits = None, 0
    # The episode's tree holds the task split's modules only, and its tests file only the split's tests: a
    # train episode's code never meets a held-out module (the pristine text is the answer to its mutations).
    self.files = tuple(sorted(SPLIT_MODULES[task.split] + (TESTS_FILE,)))
    self.box = tests_sandbox(self.episode_sandbox, task.split, prefix="crepair-")
    self.verifier.sandbox_mode = self.episode_sandbox
    write_package(self.root, task_mutations(task), SPLIT_MODULES[task.split])
    try:
      report = run_in_sandbox(self.box, [p["failing_test"]])
    except RunnerTimeout as e:
      raise EnvError(f"task {task.id}: {e}") from None
    if report["results"].get(p["failing_test"]) != "fail":
      raise EnvError(f"task {task.id} does not reproduce: {p['failing_test']} gave "
                     f"{report['results'].get(p['failing_test'])!r} ({report.get('import_error')})")
    return (f"The test {p['failing_test']} fails:\n{report['details'][p['failing_test']]}\n"
            f"Files: {' '.join(self.files)} ({TESTS_FILE} is read-only)\n"
            "Actions: show FILE | replace FILE:LINE TEXT | test | submit")

  def _read(self, name: str) -> str:
    """The text of file `name` of the episode. A module is read as `envs._sandbox.read_artifact` reads: the
    agent's code may have replaced it by a link (to a pristine module on the worker's side), a FIFO or a
    directory, and none of those is followed or read."""
    if name not in self.files:
      raise InvalidAction(f"unknown file {name[:40]!r}; files are {' '.join(self.files)}")
    if name == TESTS_FILE:
      return split_tests(self.task.split)[0]  # from memory: in mode none the agent could swap the file
    self._own_root()
    data = _sandbox.read_artifact(self.root, name, MAX_MODULE_BYTES + 1)
    if data is None:
      raise InvalidAction(f"{name} is not a regular file any more (the package's code replaced it)")
    if len(data) > MAX_MODULE_BYTES:
      raise InvalidAction(f"{name} is over {MAX_MODULE_BYTES} bytes (the package's code grew it)")
    return data.decode("utf-8", errors="replace")

  def _write(self, name: str, text: str) -> None:
    """Replaces module `name` by a new file (never writes through whatever the agent left at that name)."""
    self._own_root()
    try:
      _sandbox.replace_file(self.root / name, text)
    except OSError as e:  # the package's code put a directory at that name
      raise InvalidAction(f"cannot edit {name}: {e.strerror}") from None

  def _own_root(self) -> None:
    """The episode's directory is the env's: whatever mode the package's code gave it, the env reads and
    writes it (never through a link: it is the directory the env made, a mount point inside the sandbox)."""
    if not self.root.is_symlink():
      os.chmod(self.root, 0o755)

  def _step(self, call: Call) -> StepResult:
    if call.name == "show":
      lines = self._read(call.arg).splitlines()
      if call.arg != TESTS_FILE:
        self.current = call.arg
      return StepResult(Observation("\n".join(f"{i:3d}| {t}" for i, t in enumerate(lines, 1))), {}, False, None,
                        dict(file=call.arg))
    if call.name == "replace":
      return self._replace(call.arg)
    if call.name == "test":
      if call.arg:
        raise InvalidAction("test takes no argument")
      try:
        report = run_in_sandbox(self.box)
      except RunnerTimeout as e:
        return StepResult(Observation(f"test: {e}"), {}, True, ENV_TIMEOUT, dict(error=str(e)))
      return StepResult(Observation(format_report(report)), {}, False, None,
                        dict(results=dict(report["results"]), import_error=report.get("import_error")))
    if call.arg:
      raise InvalidAction("submit takes no argument")
    v = self.verifier.verify(self.task, self.root)
    info = dict(edits=self.edits)
    if v.evidence.get("runner_timeout"):
      return StepResult(Observation(f"submit: {v.evidence['error']}"), {"outcome": 0.0}, True, ENV_TIMEOUT,
                        info, verdict=v)
    text = "passed" if v.passed else "failed\n" + v.evidence.get("report", "")
    if v.evidence["new_names"]:
      text += f"\nrejected: new identifiers {v.evidence['new_names']}"
    return StepResult(Observation(text), {"outcome": v.reward}, True, COMPLETED, info, verdict=v)

  def _replace(self, arg: str) -> StepResult:
    m = _REPLACE.fullmatch(arg)
    if m is None:
      raise InvalidAction("use: replace FILE:LINE TEXT (or replace LINE TEXT after show FILE)")
    name, line_no, text = m.group(1) or self.current, int(m.group(2)), m.group(3) or ""
    if name is None:
      raise InvalidAction("replace LINE needs a file: replace FILE:LINE TEXT, or show FILE first")
    if name == TESTS_FILE:
      raise InvalidAction(f"{TESTS_FILE} is read-only: fix the package, not the tests")
    lines = self._read(name).splitlines()
    if not 1 <= line_no <= len(lines):
      raise InvalidAction(f"{name} has lines 1..{len(lines)}, not {line_no}")
    if text and not text[0].isspace():
      old = lines[line_no - 1]
      text = old[:len(old) - len(old.lstrip())] + text
    lines[line_no - 1] = text.rstrip()
    self._write(name, "\n".join(lines) + "\n")
    self.current, self.edits = name, self.edits + 1
    return StepResult(Observation(f"{name}:{line_no}| {lines[line_no - 1]}"), {}, False, None,
                      dict(file=name, line=line_no))


SPEC = EnvSpec(name="code_repair", description=CodeRepairEnv.description, make=CodeRepairEnv, tasks=tasks,
               demo=demo, version_sources=(CodeRepairEnv,), data_files=DATA_FILES, needs_sandbox=True)
