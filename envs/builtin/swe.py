"""SWE: repair a real Python package from PyPI whose source was mutated until its own tests fail (SWE-smith's
method; the corpus, its packages and how tasks are mined: `envs/builtin/swe_corpus.py`).

A task is one or more AST mutations (`envs.builtin.mutations`) of one source file of a package; it was kept
because at least one of the package's kept tests fails with it and every other kept test still passes. The
task text is written from the failing tests (their node ids and the exceptions' one-line messages, paths and
line numbers removed), never from the mutated line. The reference solution is the inverse patch.

Tools (JSON function calls, or the keyword line form `NAME key=value ...`):
  list_files [path=DIR]               the package's files under DIR
  view path=FILE [start=N] [end=M]    FILE with line numbers (at most VIEW_LINES lines at once)
  search pattern=TEXT [path=DIR]      lines containing TEXT (literal), as FILE:LINE: text
  edit path=FILE old=TEXT new=TEXT    replace the one occurrence of TEXT in a source file (tests are read-only)
  run_tests [test=TEXT]               run the tests the edits can affect and the task's failing ones (with
                                      TEXT: the kept tests whose id contains it), show the failures
  submit                              end the episode; the verifier runs the same selection
Observations are capped at OBS_CHARS characters and marked truncated.

Splits are by repository: train / tune / eval packages are disjoint (`swe_corpus.PACKAGES`). Versions: a task's
version is `NAME==VERSION+DIGEST` (the package version and a digest of its mutations, the kept tests and the
corpus code); a task whose version no longer matches is refused at reset.

Which tests run: a change confined to the bodies of some functions can affect only the tests that call them
(`swe_selection`, from the baseline's per-test trace); so a test run and the verifier run the task's failing
tests plus the kept tests that call a function the episode changed (every kept test when a change reaches
module-level code or a def's header). The held-out verifier (`score_heldout`) runs every kept test. Each run's
time limit is measured on this machine (`swe_corpus.run_limit`, in CPU seconds); a run past it ends the episode
as `env_timeout`, never as a failed fix, and `SPEC.timeouts` raises a pool's action and reset timeouts to what
those limits need.

Isolation (as code_repair): every test run is a fresh interpreter in the episode's sandbox, with pytest bound
read-only; the verifier copies the submitted source files out of the episode's tree (regular files only, no
links followed) onto the pristine tree of its own, with the pristine tests, and runs them in a read-only
sandbox; a submission that brings in identifiers its pristine file does not use (`open`, `sys`, `os`) fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any, Mapping, Sequence

from envs import _sandbox
from envs._api import (COMPLETED, ENV_TIMEOUT, ActionParser, Call, Env, EnvError, EnvSpec, InvalidAction,
                       Observation, StepResult, Task, Tool, Verdict, Verifier, source_version)
from envs.builtin import mutations as mutations_lib
from envs.builtin import swe_corpus as corpus
from envs.builtin.code_repair import SAFE_NEW_NAMES

OBS_CHARS = 3000
VIEW_LINES = 80
SEARCH_HITS = 30
LIST_ENTRIES = 200
FAILURES_SHOWN = 3
MAX_FILE_BYTES = 1 << 20
TASK_CODE_VERSION = source_version(mutations_lib.candidates, data=(Path(__file__), corpus.RUNNER,
                                                                  Path(corpus.selection_lib.__file__)))


def _version(pkg: corpus.Package, ms: Sequence[Mapping[str, Any]], kept_digest: str) -> str:
  blob = json.dumps([[m[f] for f in mutations_lib.FIELDS] for m in ms]) + kept_digest + TASK_CODE_VERSION
  return f"{pkg.name}=={pkg.version}+{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def prompt(pkg: corpus.Package, failing: Sequence[str], messages: Mapping[str, str]) -> str:
  """The task text: the failing tests and their messages; nothing of the mutated line."""
  lines = [f"The tests of {pkg.name} {pkg.version} fail after a change to its source:"]
  for name in failing[:FAILURES_SHOWN]:
    lines.append(f"FAILED {name}: {messages.get(name, '')}".rstrip(": "))
  if len(failing) > FAILURES_SHOWN:
    lines.append(f"... and {len(failing) - FAILURES_SHOWN} more failing tests")
  lines.append("Fix the package's source (tests are read-only), then submit.")
  return "\n".join(lines)


def tasks(split: str, n: int, seed: int = 0, mutations: int = 1, limit: int = corpus.DEFAULT_LIMIT) -> list[Task]:
  """`n` tasks of `split`'s packages, drawn without replacement from their kept mutations (cycling when n
  exceeds them). The packages are fetched and mined on first use (`limit` mutants tried per package, cached).

  `mutations` > 1: each task applies that many kept mutations of one file, on distinct lines (the combination
  is not run here; a task whose failing tests all pass on reset, one mutation masking another, is refused
  there and reported by `jaxagent tasks filter`).
  """
  if n < 0:
    raise ValueError(f"n={n}: must be >= 0")
  if not isinstance(mutations, int) or mutations < 1:
    raise ValueError(f"mutations={mutations!r}: must be an int >= 1")
  pkgs = corpus.split_packages(split)
  if not all(corpus.is_cached(p, limit) for p in pkgs):
    corpus.log(f"building the {split} tasks' cache first, once per machine, in {corpus.cache_root()} (fetch each "
               "package, run its tests, try mutants; progress follows) ...")
  pool: list[tuple[corpus.Package, dict[str, Any]]] = []
  digests = {}
  for pkg in pkgs:
    digests[pkg.name] = corpus.kept_digest(corpus.baseline(pkg))
    pool += [(pkg, m) for m in corpus.valid_mutations(pkg, limit)]
  if not pool:
    raise RuntimeError(f"swe: no kept mutation in the {split} packages {[p.name for p in pkgs]}")
  rng = random.Random(f"swe:{split}:{seed}:x{mutations}")
  groups: list[list[tuple[corpus.Package, dict[str, Any]]]] = []
  if mutations == 1:
    while len(groups) < n:
      batch = list(pool)
      rng.shuffle(batch)
      groups += [[x] for x in batch]
  else:
    by_file: dict[tuple[str, str], list] = {}
    for pkg, m in pool:
      by_file.setdefault((pkg.name, m["module"]), []).append((pkg, m))
    files = sorted(k for k, v in by_file.items() if len({m["line"] for _, m in v}) >= mutations)
    if not files:
      raise ValueError(f"mutations={mutations}: no file of split {split!r} has kept mutations on {mutations} lines")
    seen: set[tuple[str, ...]] = set()
    while len(groups) < n:
      for _ in range(100):
        key = rng.choices(files, [len(by_file[f]) for f in files])[0]
        combo: list = []
        for pkg, m in rng.sample(by_file[key], len(by_file[key])):
          if m["line"] not in {c["line"] for _, c in combo}:
            combo.append((pkg, m))
          if len(combo) == mutations:
            break
        combo.sort(key=lambda x: (x[1]["line"], x[1]["col"]))
        ids = tuple(mutations_lib.mutation_id(m) for _, m in combo)
        if ids not in seen:
          break
      seen.add(ids)
      groups.append(combo)
  out = []
  for i, group in enumerate(groups[:n]):
    pkg = group[0][0]
    ms = [{f: m[f] for f in mutations_lib.FIELDS} for _, m in group]
    failing = sorted({t for _, m in group for t in m["failing_tests"]})
    messages = {t: msg for _, m in group for t, msg in m["messages"].items()}
    out.append(Task(id=f"swe{'' if mutations == 1 else mutations}-{split}-{seed}-{i}", split=split,
                    version=_version(pkg, ms, digests[pkg.name]), payload=dict(
                        package=pkg.name, package_version=pkg.version, module=ms[0]["module"], mutations=ms,
                        mutation_id="+".join(mutations_lib.mutation_id(m) for m in ms), failing_tests=failing,
                        messages={t: messages.get(t, "") for t in failing}, prompt=prompt(pkg, failing, messages))))
  return out


def _task_package(task: Task) -> corpus.Package:
  pkg = corpus.package(task.payload["package"])
  if pkg.version != task.payload.get("package_version"):
    raise EnvError(f"task {task.id} is for {pkg.name} {task.payload.get('package_version')}, the corpus has "
                   f"{pkg.version}: regenerate the tasks")
  return pkg


def _unique_snippet(text: str, line: int) -> str:
  """The shortest run of whole lines starting at `line` (1-based) that occurs once in `text`."""
  lines = text.splitlines(keepends=True)
  for end in range(line, len(lines) + 1):
    snippet = "".join(lines[line - 1:end]).rstrip("\n")  # what `edit` is given: checked as given
    if text.count(snippet) == 1:
      return snippet
  return "".join(lines[line - 1:]).rstrip("\n")


def demo(task: Task, seed: int = 0) -> list[str]:
  """The inverse patch: one `edit` per mutation (its line, with following lines when it is not unique), then
  `submit`."""
  pkg = _task_package(task)
  tree = corpus.fetch(pkg)
  parser = SweEnv.parser
  ms = task.payload["mutations"]
  current = {}
  for rel in {m["module"] for m in ms}:
    current[rel] = mutations_lib.apply((tree / rel).read_text(encoding="utf-8"), [m for m in ms if m["module"] == rel])
  out = []
  for m in ms:
    rel, line = m["module"], int(m["line"])
    old = _unique_snippet(current[rel], line)
    fixed_line = mutations_lib.apply(current[rel].splitlines(keepends=True)[line - 1], dict(m, line=1, replacement=m[
        "original"], original=m["replacement"]))
    new = fixed_line.rstrip("\n") + old[len(current[rel].splitlines()[line - 1]):]
    current[rel] = current[rel].replace(old, new, 1)
    out.append(parser.format(Call("edit", rel, {"path": rel, "old": old, "new": new})))
  return out + ["submit"]


def probes(task: Task, seed: int = 0) -> dict[str, list[str]]:
  """Exploit probes (each must score 0): submit untouched; edit a failing test instead of the code (refused:
  tests are read-only); the reference fix plus an `import os` (a repair never needs a new module: refused by the
  new-identifier rule, which stops code that would reach the test runner's report)."""
  pkg = _task_package(task)
  rel = task.payload["module"]
  test_file = task.payload["failing_tests"][0].split("::")[0]
  tree = corpus.fetch(pkg)
  first = _unique_snippet((tree / rel).read_text(encoding="utf-8"), 1)
  fmt = lambda args: SweEnv.parser.format(Call("edit", args["path"], args))
  return {
      "submit_untouched": ["submit"],
      "edit_the_tests": [fmt({"path": test_file, "old": "assert", "new": "assert True or"}), "submit"],
      "new_identifiers": [fmt({"path": rel, "old": first, "new": "import os\n" + first}), *demo(task, seed)],
  }


def selected_tests(task: Task, base: Mapping[str, Any], tree: Path, changed: Mapping[str, str | None]) -> list[str]:
  """The task's failing tests and the kept tests that the changed source files ({file: new text, None: gone or
  unreadable}) can affect, in kept order."""
  if any(text is None for text in changed.values()):
    return list(base["kept"])
  tests = set(corpus.affected(_task_package(task), base, tree, changed)) | set(task.payload["failing_tests"])
  return [t for t in base["kept"] if t in tests]


class SweVerifier(Verifier):
  """The package's pristine tests on the submitted source files (see the module docstring): the task's failing
  tests and the kept tests the changes can affect (`SweSuiteVerifier`, the held-out one: every kept test)."""

  version = "swe-affected-tests-" + TASK_CODE_VERSION
  sandbox_mode = "auto"
  refuse_new_identifiers = True
  every_kept_test = False

  def score(self, task: Task, final: Path) -> Verdict:
    pkg = _task_package(task)
    base, tree = corpus.baseline(pkg), corpus.fetch(pkg)
    box = corpus.sandbox(self.sandbox_mode, read_only=True, prefix="sweverify-")
    try:
      corpus.copy_tree(tree, box.work)
      new_names: dict[str, list[str]] = {}
      changed: dict[str, str | None] = {}
      for rel in corpus.source_files(pkg, tree):
        data = _sandbox.read_artifact(Path(final), rel, MAX_FILE_BYTES)
        pristine = (tree / rel).read_bytes()
        if data is None:
          (box.work / rel).unlink()  # missing or not a regular file: the tests report the broken import
          changed[rel] = None
          continue
        if data == pristine:
          continue
        changed[rel] = data.decode("utf-8", errors="replace")
        (box.work / rel).write_bytes(data)
        try:
          extra = (mutations_lib.identifiers(data.decode("utf-8")) - mutations_lib.identifiers(pristine.decode(
              "utf-8")) - SAFE_NEW_NAMES)
        except (SyntaxError, ValueError):
          continue  # the tests report the broken module
        if extra and self.refuse_new_identifiers:
          new_names[rel] = sorted(extra)
      tests = list(base["kept"]) if self.every_kept_test else selected_tests(task, base, tree, changed)
      limit = corpus.run_limit(base, tests)
      evidence: dict[str, Any] = dict(package=pkg.key, kept_tests=len(base["kept"]), tests_run=len(tests),
                                      changed=sorted(changed), new_names=new_names, sandbox=box.mode,
                                      runner_timeout=False, cpu_limit_s=limit.cpu_s)
      try:
        report = corpus.run_tests(box, corpus.test_files(tests), limit, kept=tests)
      except corpus.RunnerTimeout as e:
        evidence.update(runner_timeout=True, error=str(e))
        return Verdict(False, 0.0, evidence, self.version)
    finally:
      box.close()
    verdict, failing = corpus.classify(report, tests)
    all_pass = verdict == "no_test_fails"  # every test run passed
    passed = all_pass and not new_names
    result = {"kept": "tests_fail", "no_test_fails": "all_passed"}.get(verdict, verdict)
    evidence.update(result=result, failing=failing[:20],
                    died=report.get("died"), collect_errors=dict(list(report.get("collect_errors", {}).items())[:5]))
    return Verdict(passed, 1.0 if passed else 0.0, evidence, self.version)


class SweSuiteVerifier(SweVerifier):
  """The held-out check: every kept test, whatever the change touched."""

  version = "swe-kept-tests-" + TASK_CODE_VERSION
  every_kept_test = True


def _cap(text: str) -> Observation:
  if len(text) <= OBS_CHARS:
    return Observation(text)
  return Observation(text[:OBS_CHARS] + "\n[truncated]", True, len(text.encode()))


def _rel(path: str, *, allow_root: bool = False) -> str:
  """A path inside the episode's tree, normalised; InvalidAction for an absolute path or one that leaves it."""
  norm = os.path.normpath(path.strip() or ".")
  if os.path.isabs(norm) or norm == ".." or norm.startswith("../"):
    raise InvalidAction(f"path {path[:60]!r}: give a path inside the package tree (e.g. a file list_files shows)")
  if norm == "." and not allow_root:
    raise InvalidAction("path: give a file, not the tree's root")
  return norm


class SweEnv(_sandbox.SandboxedEpisodes, Env):
  name = "swe"
  description = "repair a real PyPI package whose source was mutated until its own tests fail (sandboxed)"
  parser = ActionParser(tools=(
      Tool.with_params("list_files", "List the package's files under a directory.",
                       {"path": ("string", "a directory of the tree (default: all)")}, arg="path"),
      Tool.with_params("view", "Show a file with line numbers.",
                       {"path": ("string", "a file of the tree"), "start": ("integer", "first line (default 1)"),
                        "end": ("integer", "last line")}, required=("path",), arg="path"),
      Tool.with_params("search", "Find the lines that contain a text (literal).",
                       {"pattern": ("string", "the text to find"), "path": ("string", "a directory or file")},
                       required=("pattern",), arg="pattern"),
      Tool.with_params("edit", "Replace the one occurrence of a text in a source file.",
                       {"path": ("string", "a source file"), "old": ("string", "the text to replace, as it is"),
                        "new": ("string", "what replaces it")}, required=("path", "old", "new"), arg="path"),
      Tool.with_params("run_tests", "Run the package's tests and show the failures.",
                       {"test": ("string", "only the tests whose id contains this text")}, arg="test"),
      Tool.with_params("submit", "End the episode; every test is run on the edited package.", {})),
      max_chars=2048)

  def __init__(self, max_turns: int = 16, **kwargs):
    super().__init__(max_turns=max_turns, **kwargs)
    self.verifier = SweVerifier()
    self.heldout_verifier = SweSuiteVerifier()
    self.edits = 0

  def _reset(self, task: Task, seed: int) -> str:
    self.close()
    pkg = _task_package(task)
    base, tree = corpus.baseline(pkg), corpus.fetch(pkg)
    ms = task.payload["mutations"]
    if task.version != _version(pkg, ms, corpus.kept_digest(base)):
      raise EnvError(f"task {task.id} has version {task.version}; this corpus and env make "
                     f"{_version(pkg, ms, corpus.kept_digest(base))}: regenerate the tasks")
    self.pkg, self.base, self.tree, self.kept, self.edits = pkg, base, tree, base["kept"], 0
    self.sources = set(corpus.source_files(pkg, tree))
    self.box = corpus.sandbox(self.episode_sandbox, prefix="swe-")
    self.verifier.sandbox_mode = self.heldout_verifier.sandbox_mode = self.episode_sandbox
    corpus.copy_tree(tree, self.box.work)
    for rel in sorted({m["module"] for m in ms}):
      try:
        text = mutations_lib.apply((tree / rel).read_text(encoding="utf-8"), [m for m in ms if m["module"] == rel])
      except mutations_lib.MutationMismatch as e:
        raise EnvError(f"task {task.id}: {e}") from None
      (self.box.work / rel).write_text(text, encoding="utf-8")
    failing = task.payload["failing_tests"]
    try:
      report = corpus.run_tests(self.box, corpus.test_files(failing), corpus.run_limit(base, failing), kept=failing)
    except corpus.RunnerTimeout as e:
      raise EnvError(f"task {task.id}: {e}") from None
    if not any(report["results"].get(t) == "failed" for t in failing):
      raise EnvError(f"task {task.id} does not reproduce: none of its failing tests fails "
                     f"({dict(list(report['results'].items())[:3])}{report.get('died', '')})")
    return task.payload["prompt"] + "\nTools: list_files view search edit run_tests submit"

  # -- tools

  def _read(self, rel: str) -> str:
    data = _sandbox.read_artifact(self.root, rel, MAX_FILE_BYTES + 1)
    if data is None:
      raise InvalidAction(f"no file {rel!r} (list_files shows the package's files)")
    if len(data) > MAX_FILE_BYTES:
      raise InvalidAction(f"{rel} is over {MAX_FILE_BYTES} bytes")
    return data.decode("utf-8", errors="replace")

  def _files(self, under: str) -> list[str]:
    listing = _sandbox.listing(self.root)
    prefix = "" if under == "." else under.rstrip("/") + "/"
    return sorted(p for p, kind in listing.items() if kind == "file" and (p == under or p.startswith(prefix))
                  and "__pycache__" not in p and not p.endswith(".pyc"))

  def _step(self, call: Call) -> StepResult:
    args = dict(call.arguments)
    handler = getattr(self, f"_tool_{call.name}")
    return handler(args)

  def _tool_list_files(self, args) -> StepResult:
    under = _rel(args.get("path", "."), allow_root=True)
    files = self._files(under)
    if not files:
      raise InvalidAction(f"no files under {under!r}")
    shown = files[:LIST_ENTRIES]
    text = "\n".join(shown) + (f"\n... {len(files) - len(shown)} more" if len(files) > len(shown) else "")
    return StepResult(_cap(text), {}, False, None, dict(files=len(files)))

  def _tool_view(self, args) -> StepResult:
    rel = _rel(args["path"])
    lines = self._read(rel).splitlines()
    start = max(1, int(args.get("start", 1)))
    end = min(len(lines), int(args.get("end", start + VIEW_LINES - 1)), start + VIEW_LINES - 1)
    if start > max(len(lines), 1):
      raise InvalidAction(f"{rel} has lines 1..{len(lines)}, not {start}")
    body = "\n".join(f"{i:4d}| {lines[i - 1]}" for i in range(start, end + 1))
    more = f"\n[lines {start}-{end} of {len(lines)}]" if (start, end) != (1, len(lines)) else ""
    return StepResult(_cap(body + more), {}, False, None, dict(file=rel, start=start, end=end))

  def _tool_search(self, args) -> StepResult:
    pattern = args["pattern"]
    if not pattern:
      raise InvalidAction("search: pattern is empty")
    under = _rel(args.get("path", "."), allow_root=True)
    hits, total = [], 0
    for rel in self._files(under):
      if not rel.endswith(".py"):
        continue
      for i, line in enumerate(self._read(rel).splitlines(), 1):
        if pattern in line:
          total += 1
          if len(hits) < SEARCH_HITS:
            hits.append(f"{rel}:{i}: {line.strip()[:160]}")
    if not hits:
      return StepResult(Observation(f"no line contains {pattern[:80]!r}"), {}, False, None, dict(hits=0))
    more = f"\n... {total - len(hits)} more" if total > len(hits) else ""
    return StepResult(_cap("\n".join(hits) + more), {}, False, None, dict(hits=total))

  def _tool_edit(self, args) -> StepResult:
    rel, old, new = _rel(args["path"]), args["old"], args["new"]
    if rel not in self.sources:
      if self.pkg.is_test(rel):
        raise InvalidAction(f"{rel} is a test: tests are read-only, fix the package's source")
      raise InvalidAction(f"{rel} is not a source file of {self.pkg.name} (list_files shows them)")
    if not old:
      raise InvalidAction("edit: old is empty; give the text to replace, as it is in the file")
    text = self._read(rel)
    count = text.count(old)
    if count != 1:
      raise InvalidAction(f"edit: old occurs {count} times in {rel}; give text that occurs exactly once "
                          "(include a neighbouring line)")
    self._write(rel, text.replace(old, new, 1))
    self.edits += 1
    line = text[:text.index(old)].count("\n") + 1
    return StepResult(Observation(f"edited {rel} at line {line}"), {}, False, None, dict(file=rel, line=line))

  def _write(self, rel: str, text: str) -> None:
    """Replaces file `rel` by a new file (never writes through whatever the package's code left there)."""
    target = self.root / rel
    if target.parent.is_symlink() or not target.parent.is_dir():
      raise InvalidAction(f"cannot edit {rel}: its directory is not there any more")
    try:
      _sandbox.replace_file(target, text)
    except OSError as e:
      raise InvalidAction(f"cannot edit {rel}: {e.strerror}") from None

  def _changed(self) -> dict[str, str | None]:
    """The episode's source files that differ from the pristine package: {file: text, None: gone}."""
    out: dict[str, str | None] = {}
    for rel in sorted(self.sources):
      data = _sandbox.read_artifact(self.root, rel, MAX_FILE_BYTES)
      if data is None or data != (self.tree / rel).read_bytes():
        out[rel] = None if data is None else data.decode("utf-8", errors="replace")
    return out

  def _tool_run_tests(self, args) -> StepResult:
    only = args.get("test", "")
    tests = [t for t in self.kept if only in t] if only else selected_tests(self.task, self.base, self.tree,
                                                                             self._changed())
    if not tests:
      raise InvalidAction(f"no test id contains {only[:80]!r}")
    try:
      report = corpus.run_tests(self.box, corpus.test_files(tests), corpus.run_limit(self.base, tests), kept=tests)
    except corpus.RunnerTimeout as e:
      return StepResult(Observation(f"run_tests: {e}"), {}, True, ENV_TIMEOUT, dict(error=str(e)))
    return StepResult(_cap(format_report(report)), {}, False, None, dict(
        failed=sum(v != "passed" for v in report["results"].values()), ran=len(report["results"])))

  def _tool_submit(self, args) -> StepResult:
    v = self.judge(self.root)
    info = dict(edits=self.edits)
    if v.evidence.get("runner_timeout"):
      return StepResult(Observation(f"submit: {v.evidence['error']}"), {"outcome": 0.0}, True, ENV_TIMEOUT, info,
                        verdict=v)
    text = "passed: every test passes" if v.passed else f"failed: {v.evidence['result']}" + "".join(
        f"\nFAILED {t}" for t in v.evidence["failing"][:FAILURES_SHOWN])
    if v.evidence["new_names"]:
      text += f"\nrejected: new identifiers {v.evidence['new_names']}"
    return StepResult(_cap(text), {"outcome": v.reward}, True, COMPLETED, info, verdict=v)


def format_report(report: Mapping[str, Any]) -> str:
  """Deterministic text of a test run: counts, then each failure with its message (no timings, no paths)."""
  if report.get("died"):
    return report["died"]
  lines = []
  for name, msg in sorted(report.get("collect_errors", {}).items()):
    lines.append(f"ERROR collecting {name}: {msg}")
  results = report["results"]
  counts: dict[str, int] = {}
  for v in results.values():
    counts[v] = counts.get(v, 0) + 1
  lines.insert(0, f"{len(results)} tests: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
  for name, status in results.items():
    if status != "passed":
      lines.append(f"{status.upper()} {name}: {report['messages'].get(name, '')}".rstrip(": "))
  return "\n".join(lines)


def describe(task: Task) -> str:
  return task.payload["prompt"]


TIMEOUT_SLACK_S = 10.0  # a pool's limit over the runs' own: copying the tree, starting the sandbox


def timeouts() -> dict[str, float]:
  """The pool limits swe needs here: a step runs at most two test runs (the verifier's and, evaluating, the
  held-out verifier's every kept test), a reset one; each within its wall-clock limit, measured on this machine
  (the cached baselines; none yet: the pool's own limits)."""
  walls = [corpus.run_limit(b, b["kept"]).wall_s for b in corpus.cached_baselines()]
  if not walls:
    return {}
  return dict(action_timeout_s=2 * max(walls) + TIMEOUT_SLACK_S, reset_timeout_s=max(walls) + TIMEOUT_SLACK_S)


SPEC = EnvSpec(name="swe", description=SweEnv.description, make=SweEnv, tasks=tasks, demo=demo,
               version_sources=(SweEnv,), data_files=(corpus.RUNNER, Path(corpus.__file__),
                                                      Path(mutations_lib.__file__),
                                                      Path(corpus.selection_lib.__file__)),
               needs_sandbox=True, describe=describe, probes=probes, data_dirs=corpus.data_dirs,
               timeouts=timeouts)
