"""Real Python packages from PyPI as a task corpus for the `swe` env (SWE-smith's method: the verifier is the
package's own test suite, inherited, not written).

For each package of `PACKAGES` (pure Python, permissive licence, a source distribution that ships its tests):
1. `fetch`: `pip download --no-deps --no-binary :all:` of the pinned version into the cache (never installed
   into this interpreter), its sha256 checked against the pin, extracted (tar's `data` filter: no links out, no
   devices). The episode tree is the import packages (from the sdist's `src` directory) plus its test paths.
2. `baseline`: the package's tests run twice on the pristine tree, in a sandbox, with line tracing on the first
   run. Kept tests = passed both times in under `KEEP_TEST_S`; the executed lines of the package's own source
   are where mutations are tried (a line no kept test runs cannot make one fail), and which tests call each
   function is what `swe_selection` runs for a change. The second run's CPU times (start-up and collection, each
   kept test) are this machine's measure for the time limits (`run_limit`).
3. `mine`: AST mutations (`envs.builtin.mutations`) of covered lines, in a fixed shuffled order, `limit` of them
   per package; each mutant runs the kept tests it can affect (`swe_selection`) in a sandbox. A mutant is kept
   when at least one test fails and every other still passes (no collection error, no timeout, no test lost);
   the reasons others are dropped are counted. Results are cached per mutation, so a larger `limit` only runs
   the new ones. Progress goes to stderr (mutants tried and kept, elapsed) at least every `PROGRESS_S`.

Time limits come from measurement on this machine, never from constants alone: a test run's limit is
`RUN_CPU_MULTIPLE` times its pristine CPU time as the baseline measured it (start-up and collection plus each
selected test), at least `RUN_CPU_FLOOR_S`, in CPU seconds of the run's process: a loaded machine (other runs
sharing the cores) slows a run without turning it into a timeout. A wall-clock backstop of `WALL_PER_CPU` times
that stops code that sleeps. A run past its limit is a timeout (`RunnerTimeout`: the env's `env_timeout`),
never a failed test.

Cache: `$JAXAGENT_CACHE/swe/` (default `~/.cache/jaxagent/swe`): `<name>-<version>/{sdist, tree/,
baseline.json, mined.json}` and `pylib-<pytest version>/` (a copy of pytest and its dependencies that the
sandboxed runs import: the sandbox sees the interpreter and nothing of this virtualenv). Needs pytest here
(`pip install jaxagent[swe]`), no JAX. `jaxagent envs swe-corpus` prints the scale report.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from envs import _sandbox
from envs._api import EnvError, source_version
from envs.builtin import mutations as mutations_lib
from envs.builtin import swe_selection as selection_lib
from envs.builtin.swe_runner import CPU_LIMIT_EXIT, WALL_PER_CPU  # a run's wall-clock backstop per CPU second

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "swe_runner.py"
KEEP_TEST_S = 0.25          # a test using more CPU seconds than this on the pristine tree is not kept
PER_TEST_S = 2.0            # one test's limit in CPU seconds (episodes and mining): 8x the slowest kept test
RUN_CPU_MULTIPLE = 4.0      # a test run's CPU limit: this multiple of its measured pristine CPU time ...
RUN_CPU_FLOOR_S = 5.0       # ... and at least this
BASELINE_TIMEOUT_S = 300.0  # the baseline runs every test of the package (wall clock; no CPU limit)
PROGRESS_S = 10.0           # mining says how far it is at least this often
DEFAULT_LIMIT = 48          # mutants tried per package when a split's tasks are first asked for
PYTEST_DISTS = ("pytest", "pluggy", "iniconfig", "packaging", "pygments")
SPLITS = ("train", "tune", "eval")


@dataclasses.dataclass(frozen=True)
class Package:
  """One PyPI package of the corpus.

  Attributes:
    name, version, sha256: the pinned source distribution.
    licence: its licence (permissive: tasks derived from it are shared).
    split: train, tune or eval: splits are by repository (no package in two).
    src: the sdist directory holding the import packages ("." or "src").
    packages: import packages copied into the episode tree (from `src`).
    tests: test files or directories, relative to the sdist root (a leading `src/` is dropped in the tree).
    mutate: the import packages whose source is mutated (default: all of `packages`).
    skip: source files never mutated (generated data tables).
  """
  name: str
  version: str
  sha256: str
  licence: str
  split: str
  src: str
  packages: tuple[str, ...]
  tests: tuple[str, ...]
  mutate: tuple[str, ...] = ()
  skip: tuple[str, ...] = ()

  @property
  def key(self) -> str:
    return f"{self.name}-{self.version}"

  @property
  def test_paths(self) -> tuple[str, ...]:
    """The test paths inside the episode tree."""
    return tuple(t[len("src/"):] if t.startswith("src/") else t for t in self.tests)

  def is_test(self, rel: str) -> bool:
    return any(rel == t or rel.startswith(t.rstrip("/") + "/") for t in self.test_paths) or \
        Path(rel).name.startswith(("test_", "conftest"))


PACKAGES: tuple[Package, ...] = (
    Package("toolz", "1.0.0", "2c86e3d9a04798ac556793bced838816296a2f085017664e4995cb40a1047a02", "BSD-3-Clause",
            "train", ".", ("toolz", "tlz"), ("toolz/tests",), mutate=("toolz",)),
    Package("more-itertools", "11.2.1", "cbf08fd0af284dc69718b9b76a8e6203df624d70209ea511e4219d350c856f63", "MIT",
            "train", ".", ("more_itertools",), ("tests",)),
    Package("cachetools", "8.0.2", "30ac523adfc118b51d2b2e7bad8a0ddb31370dfe2700c7f10ca224f36ccf81e0", "MIT",
            "train", "src", ("cachetools",), ("tests",)),
    Package("boltons", "26.2.0", "d39cfd15c1a1c3bd4d705c82252fa9edb8e4f5e8cc039f8e39afac7b1b47e92c",
            "BSD-3-Clause", "train", ".", ("boltons",), ("tests",)),
    Package("semver", "3.1.2", "bea193552413194252d33ff26ce0962b76669bd1c6fb17e8e203ac37f072feaf", "BSD-3-Clause",
            "tune", "src", ("semver",), ("tests",)),
    Package("inflection", "0.5.1", "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417", "MIT",
            "eval", ".", ("inflection",), ("test_inflection.py",)),
    Package("idna", "3.20", "a7db850025b95ded1eae8a46181a1a6c56c92c96f0e2b005d9ff8dc0210cab44", "BSD-3-Clause",
            "eval", ".", ("idna",), ("tests/test_idna.py", "tests/test_idna_codec.py", "tests/test_idna_compat.py",
                                     "tests/test_intranges.py", "tests/test_idna_errors.py"),
            skip=("idna/idnadata.py", "idna/uts46data.py")),
)


def package(name: str) -> Package:
  for p in PACKAGES:
    if p.name == name:
      return p
  raise ValueError(f"swe package {name!r}: not one of {[p.name for p in PACKAGES]}")


def split_packages(split: str) -> tuple[Package, ...]:
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: not one of {SPLITS}")
  return tuple(p for p in PACKAGES if p.split == split)


CACHE_VARIABLE = "JAXAGENT_SWE_CACHE"


def cache_root() -> Path:
  """`$JAXAGENT_SWE_CACHE`, else `$JAXAGENT_CACHE/swe` (default `~/.cache/jaxagent/swe`); sandboxed workers get
  it bound read-only with the variable set (`EnvSpec.data_dirs`)."""
  if os.environ.get(CACHE_VARIABLE):
    return Path(os.environ[CACHE_VARIABLE])
  return Path(os.environ.get("JAXAGENT_CACHE") or Path.home() / ".cache" / "jaxagent") / "swe"


def data_dirs() -> dict[str, Path]:
  root = cache_root()
  root.mkdir(parents=True, exist_ok=True)
  return {CACHE_VARIABLE: root}


def package_dir(pkg: Package) -> Path:
  return cache_root() / pkg.key


def log(msg: str) -> None:
  print(f"swe corpus: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress(what: str, short: str | None = None):
  """Says `what` now and, while the block runs, `short` (default `what`) and how long it has been running, every
  `PROGRESS_S` (one long subprocess, such as a traced run of a whole suite, is otherwise silent for minutes)."""
  log(f"{what} ...")
  started, done = time.perf_counter(), threading.Event()

  def beat():
    while not done.wait(PROGRESS_S):
      log(f"{short or what}: {time.perf_counter() - started:.0f} s ...")

  thread = threading.Thread(target=beat, name="swe-progress", daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join()


def _sha256(path: Path) -> str:
  h = hashlib.sha256()
  with path.open("rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _write_json(path: Path, value: Any) -> None:
  tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
  tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
  tmp.replace(path)  # a crash mid-write leaves the old file, never half a new one


# ----------------------------------------------------------------------------------------------
# Fetch and the pristine tree.


def fetch(pkg: Package, *, timeout_s: float = 600) -> Path:
  """The pristine episode tree of `pkg` (fetched, checked and extracted once; then from the cache)."""
  target = package_dir(pkg)
  tree = target / "tree"
  if (tree / ".complete").is_file():
    return tree
  target.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=target, prefix=".fetch-") as tmp:
    tmp = Path(tmp)
    sdists = sorted(target.glob("*.tar.gz"))
    if not sdists:
      with progress(f"fetching {pkg.name}=={pkg.version} (sdist, no dependencies, not installed)"):
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               "--disable-pip-version-check", "-q", "-d", str(tmp / "dl"),
                               f"{pkg.name}=={pkg.version}"], capture_output=True, text=True, timeout=timeout_s,
                              check=False)
      got = sorted((tmp / "dl").glob("*.tar.gz"))
      if done.returncode or len(got) != 1:
        raise EnvError(f"swe: `pip download {pkg.name}=={pkg.version}` failed ({done.returncode}): "
                       f"{(done.stderr or done.stdout).strip()[-600:]}")
      sdists = [got[0]]
    sha = _sha256(sdists[0])
    if sha != pkg.sha256:
      raise EnvError(f"swe: {sdists[0].name} has sha256 {sha}, expected {pkg.sha256} (pinned); refusing it")
    if sdists[0].parent != target:
      shutil.move(str(sdists[0]), target / sdists[0].name)
      sdists = [target / sdists[0].name]
    with tarfile.open(sdists[0]) as tar:
      tar.extractall(tmp / "x", filter="data")
    roots = [d for d in (tmp / "x").iterdir() if d.is_dir()]
    if len(roots) != 1:
      raise EnvError(f"swe: {sdists[0].name} does not hold one top directory ({[d.name for d in roots]})")
    root, new = roots[0], tmp / "tree"
    new.mkdir()
    for name in pkg.packages:
      shutil.copytree(root / pkg.src / name, new / name)
    for rel, inside in zip(pkg.tests, pkg.test_paths):
      if not (new / inside).exists():
        (new / inside).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (root / rel).is_dir() else shutil.copy2)(root / rel, new / inside)
    for p in list(new.rglob("__pycache__")):
      shutil.rmtree(p)
    (new / ".complete").write_text(json.dumps(dict(name=pkg.name, version=pkg.version, sha256=sha)))
    if tree.exists():
      shutil.rmtree(tree)
    new.rename(tree)
  return tree


def pylib() -> Path:
  """A copy of pytest and its dependencies for the sandboxed runs (made once per pytest version, by a process
  that has pytest; a sandboxed worker, whose cache is read-only, uses the copy that is there)."""
  made = sorted(cache_root().glob("pylib-*/.complete"))
  try:
    version = importlib.metadata.version("pytest")
  except importlib.metadata.PackageNotFoundError:
    version = None
  if version is not None and (cache_root() / f"pylib-{version}" / ".complete").is_file():
    return cache_root() / f"pylib-{version}"
  if version is None or (made and not os.access(cache_root(), os.W_OK)):
    if made:
      return made[-1].parent
    raise EnvError("the swe env runs packages' tests with pytest, which is not installed here: "
                   "pip install 'jaxagent[swe]'")
  target = cache_root() / f"pylib-{version}"
  target.parent.mkdir(parents=True, exist_ok=True)
  new = Path(tempfile.mkdtemp(dir=target.parent, prefix=".pylib-"))
  for dist_name in PYTEST_DISTS:
    dist = importlib.metadata.distribution(dist_name)
    tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
    for top in sorted(tops):
      if top.endswith((".dist-info", ".egg-info")) or top == "__pycache__":
        continue
      src = Path(dist.locate_file(top))
      if src.is_dir():
        shutil.copytree(src, new / top, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
      elif src.is_file() and src.suffix == ".py":
        shutil.copy2(src, new / top)
  (new / ".complete").write_text(version)
  if target.exists():
    shutil.rmtree(new)  # another process made it meanwhile
  else:
    new.rename(target)
  return target


def source_files(pkg: Package, tree: Path) -> list[str]:
  """The package's own source files (relative to the tree) that mutations may change: no tests."""
  out = []
  for name in pkg.mutate or pkg.packages:
    for path in sorted((tree / name).rglob("*.py")):
      rel = path.relative_to(tree).as_posix()
      if not pkg.is_test(rel) and rel not in pkg.skip:
        out.append(rel)
  return out


# ----------------------------------------------------------------------------------------------
# Running the tests.


class RunnerTimeout(Exception):
  """The test process did not finish within its limit (killed): a timeout, not a failed test."""


@dataclasses.dataclass(frozen=True)
class RunLimit:
  """A test run's limits: `cpu_s` CPU seconds of its process (None: none), `wall_s` wall-clock seconds."""
  cpu_s: float | None
  wall_s: float

  @classmethod
  def of_cpu(cls, cpu_s: float) -> "RunLimit":
    return cls(cpu_s, WALL_PER_CPU * cpu_s)


BASELINE_LIMIT = RunLimit(None, BASELINE_TIMEOUT_S)


def measured_cpu_s(base: Mapping[str, Any], tests: Iterable[str]) -> float:
  """A run's CPU seconds on the pristine tree, from the baseline's measure on this machine: start-up and
  collection (of every test file: an upper bound for a run that collects fewer) plus each test's (its setup,
  call, teardown and pytest's own work)."""
  return base["startup_cpu_s"] + sum(base["test_s"].get(t, KEEP_TEST_S) for t in tests)


def run_limit(base: Mapping[str, Any], tests: Iterable[str]) -> RunLimit:
  """The limit of a run of `tests`: `RUN_CPU_MULTIPLE` x its measured CPU time, at least `RUN_CPU_FLOOR_S`."""
  return RunLimit.of_cpu(round(max(RUN_CPU_FLOOR_S, RUN_CPU_MULTIPLE * measured_cpu_s(base, tests)), 2))


def test_files(tests: Iterable[str]) -> list[str]:
  """The files holding test node ids (what a run collects)."""
  return sorted({t.split("::", 1)[0] for t in tests})


def sandbox(mode: str = "auto", **kwargs) -> _sandbox.EpisodeSandbox:
  """A sandbox whose programs find the runner at /opt/run and pytest at /opt/pylib (read-only)."""
  return _sandbox.EpisodeSandbox(mode, binds={"/opt/run/swe_runner.py": RUNNER, "/opt/pylib": pylib()}, **kwargs)


def run_tests(box: _sandbox.EpisodeSandbox, paths: Sequence[str], limit: RunLimit, *,
              kept: Iterable[str] | None = None, select: Iterable[str] | None = None,
              per_test_s: float = PER_TEST_S, trace: Sequence[str] | None = None) -> dict[str, Any]:
  """The package's tests (`paths`, filtered to `kept` and `select` node ids) on the tree in `box.work`, inside
  the sandbox. Returns the runner's report (see swe_runner.py), or {results: {}, died: why} when the process
  died before reporting. RunnerTimeout past `limit`, EnvError when it cannot start."""
  nonce = secrets.token_hex(16)
  spec = dict(nonce=nonce, paths=list(paths), kept=None if kept is None else sorted(kept),
              select=None if select is None else sorted(select), per_test_s=per_test_s, cpu_limit_s=limit.cpu_s,
              trace=list(trace) if trace else None, report=f"{box.path('/tmp')}/report-{nonce}.json")
  argv = [_sandbox.python(), "-s", "-S", "-B", box.path("/opt/run/swe_runner.py"), box.path("/work")]
  env = {"PYTHONPATH": box.path("/opt/pylib"), "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
  try:
    done = box.run(argv, timeout=limit.wall_s, stdin=(json.dumps(spec) + "\n").encode(), env=env)
  except OSError as e:
    raise EnvError(f"cannot start the test runner: {e}") from None
  if done.code is None:
    raise RunnerTimeout(f"the tests did not finish within {limit.wall_s:g}s (killed)")
  if done.code in (CPU_LIMIT_EXIT, -signal.SIGXCPU, 128 + signal.SIGXCPU):
    raise RunnerTimeout(f"the tests used more than their {limit.cpu_s:g}s of CPU (stopped; the limit is "
                        f"{RUN_CPU_MULTIPLE:g}x their measured time on this machine)")
  for line in done.output.decode("utf-8", errors="replace").splitlines():
    if line.startswith(nonce + " "):
      path = box.tmp / f"report-{nonce}.json"
      data = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
      path.unlink(missing_ok=True)
      if hashlib.sha256(data).hexdigest() != line[len(nonce) + 1:].strip():
        return dict(results={}, messages={}, collect_errors={}, died="the test report was changed after it was written")
      return json.loads(data)
  tail = done.output.decode("utf-8", errors="replace").strip()[-300:]
  return dict(results={}, messages={}, collect_errors={}, died=f"the test process died (exit {done.code}) "
              f"before reporting{': ' + tail if tail else ''}")


def copy_tree(src: Path, dst: Path) -> None:
  for path in sorted(src.rglob("*")):
    rel = path.relative_to(src)
    if rel.name == ".complete":
      continue
    if path.is_dir():
      (dst / rel).mkdir(parents=True, exist_ok=True)
    else:
      (dst / rel).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(path, dst / rel)


# ----------------------------------------------------------------------------------------------
# Baseline and mining.


def baseline(pkg: Package, *, mode: str = "auto") -> dict[str, Any]:
  """Which of the package's tests pass here (twice, fast), the source lines they run, which tests call each
  function, and their CPU times on this machine (cached)."""
  path = package_dir(pkg) / "baseline.json"
  version = _corpus_version()
  if path.is_file():
    cached = json.loads(path.read_text())
    if cached.get("version") == version:
      return cached
  tree = fetch(pkg)
  runs, started = [], time.perf_counter()
  for k, how in enumerate(("traced: which lines and functions each test runs", "timed")):
    box = sandbox(mode, read_only=True, prefix="swebase-")
    try:
      copy_tree(tree, box.work)
      with progress(f"{pkg.key}: its own tests on the pristine tree, run {k + 1} of 2 ({how})",
                    f"{pkg.key}: run {k + 1} of 2"):
        runs.append(run_tests(box, pkg.test_paths, BASELINE_LIMIT, per_test_s=30.0,
                              trace=(pkg.mutate or pkg.packages) if k == 0 else None))
    finally:
      box.close()
  first, second = runs
  for run in runs:
    if "died" in run:
      raise EnvError(f"swe: {pkg.key}'s tests did not run: {run['died']}")
  # Slow is judged by the untraced run's CPU time, as every limit is: wall time grows with whatever else shares
  # the cores, and the traced run's wall time with the tracer.
  kept = sorted(n for n, r in first["results"].items()
                if r == "passed" and second["results"].get(n) == "passed"
                and second["cpu"].get(n, math.inf) <= KEEP_TEST_S)
  counts = collections.Counter(first["results"].values())
  sources, keep = set(source_files(pkg, tree)), set(kept) | {selection_lib.AT_IMPORT}
  lines = {f: v for f, v in first.get("lines", {}).items() if f in sources}
  callers = {f: {line: [t for t in tests if t in keep] for line, tests in by_line.items()}
             for f, by_line in first.get("callers", {}).items() if f in sources}
  out = dict(version=version, package=pkg.name, package_version=pkg.version, sha256=pkg.sha256, kept=kept,
             tests=len(first["results"]), outcomes=dict(counts), collect_errors=first["collect_errors"],
             flaky=sorted(n for n, r in first["results"].items() if r == "passed" and
                          second["results"].get(n) != "passed"),
             slow=sum(1 for n, r in first["results"].items() if r == "passed" and n not in kept),
             lines=lines, callers=callers, startup_cpu_s=round(second["collect_cpu_s"], 3),
             suite_cpu_s=second["cpu_s"], test_s={n: second["cpu"].get(n, KEEP_TEST_S) for n in kept},
             seconds=round(time.perf_counter() - started, 2))
  _write_json(path, out)
  log(f"{pkg.key}: {len(kept)} of {out['tests']} tests kept ({dict(counts)}; {out['slow']} slow or flaky); "
       f"CPU s: start-up {out['startup_cpu_s']:.2f}, start-up and every kept test {measured_cpu_s(out, kept):.2f}")
  return out


def cached_baselines() -> list[dict[str, Any]]:
  """The baselines in the cache made by this corpus code (every package measured on this machine so far)."""
  version, out = _corpus_version(), []
  for path in sorted(cache_root().glob("*/baseline.json")):
    try:
      base = json.loads(path.read_text())
    except (OSError, ValueError):
      continue
    if base.get("version") == version:
      out.append(base)
  return out


def affected(pkg: Package, base: Mapping[str, Any], tree: Path, changed: Mapping[str, str]) -> list[str]:
  """The kept tests that the changed source files ({file: new text}) can affect (`swe_selection`)."""
  return selection_lib.affected_tests(
      base["callers"], base["kept"],
      ((rel, (tree / rel).read_text(encoding="utf-8"), text) for rel, text in sorted(changed.items())))


def kept_digest(base: Mapping[str, Any]) -> str:
  return hashlib.sha256("\n".join(base["kept"]).encode()).hexdigest()[:12]


def candidate_order(pkg: Package, base: Mapping[str, Any]) -> list[dict[str, Any]]:
  """Every mutation of a covered line of the package's source, in the corpus's fixed shuffled order."""
  tree = fetch(pkg)
  out = []
  for rel in source_files(pkg, tree):
    covered = set(base["lines"].get(rel, ()))
    if not covered:
      continue
    try:
      cands = mutations_lib.candidates(rel, (tree / rel).read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
      continue
    out += [m for m in cands if m["line"] in covered]
  random.Random(f"swe:{pkg.key}").shuffle(out)
  return out


def classify(report: Mapping[str, Any], kept: Sequence[str]) -> tuple[str, list[str]]:
  """(verdict, failing kept tests) of a mutant's run: "kept" or why it is dropped."""
  if "died" in report:
    return "died", []
  if report.get("collect_errors"):
    return "collection_error", []
  results = report["results"]
  if any(results.get(n) is None for n in kept):
    return "tests_lost", []
  bad = {results[n] for n in kept} - {"passed", "failed"}
  if "timeout" in bad:
    return "timeout", []
  if bad:
    return "error", []
  failing = [n for n in kept if results[n] == "failed"]
  return ("kept", failing) if failing else ("no_test_fails", [])


def try_mutant(pkg: Package, tree: Path, base: Mapping[str, Any], ms: Sequence[Mapping[str, Any]],
               mode: str = "auto") -> dict[str, Any]:
  """Runs the kept tests that mutations `ms` can affect on the pristine tree with them applied: {verdict, failing,
  messages, ran, s}."""
  started = time.perf_counter()
  box = sandbox(mode, read_only=True, prefix="swemut-")
  try:
    copy_tree(tree, box.work)
    changed = {}
    for rel in sorted({m["module"] for m in ms}):
      text = mutations_lib.apply((tree / rel).read_text(encoding="utf-8"), [m for m in ms if m["module"] == rel])
      try:
        mutations_lib.parse(text)
      except SyntaxError:
        return dict(verdict="syntax_error", failing=[], messages={}, ran=0, s=0.0)
      (box.work / rel).write_text(text, encoding="utf-8")
      changed[rel] = text
    tests = affected(pkg, base, tree, changed)
    if not tests:
      return dict(verdict="not_covered", failing=[], messages={}, ran=0, s=0.0)  # no kept test calls that code
    try:
      report = run_tests(box, test_files(tests), run_limit(base, tests), kept=tests)
    except RunnerTimeout:
      return dict(verdict="run_timeout", failing=[], messages={}, ran=len(tests),
                  s=round(time.perf_counter() - started, 3))
  finally:
    box.close()
  verdict, failing = classify(report, tests)
  return dict(verdict=verdict, failing=failing, messages={n: report["messages"].get(n, "") for n in failing},
              ran=len(tests), s=round(time.perf_counter() - started, 3))


def mine(pkg: Package, limit: int = DEFAULT_LIMIT, *, workers: int = 2, mode: str = "auto") -> dict[str, Any]:
  """The first `limit` candidates of the package tried (cached per mutation); returns the mined record, with
  `order` (this limit's candidates, `candidate_order`) and `candidates` (how many there are) added."""
  base = baseline(pkg, mode=mode)
  path = package_dir(pkg) / "mined.json"
  version, digest = _corpus_version(), kept_digest(base)
  record = json.loads(path.read_text()) if path.is_file() else {}
  if record.get("version") != version or record.get("kept_digest") != digest:
    record = dict(version=version, kept_digest=digest, tried={}, seconds=0.0)
  order = candidate_order(pkg, base)
  todo = [m for m in order[:limit] if mutations_lib.mutation_id(m) not in record["tried"]]
  if todo:
    tree, started = fetch(pkg), time.perf_counter()
    log(f"{pkg.key}: trying {len(todo)} mutants ({len(record['tried'])} cached; {len(order)} candidates) ...")
    said = saved = started
    kept = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as ex:
      for done, (m, result) in enumerate(zip(todo, ex.map(lambda m: try_mutant(pkg, tree, base, [m], mode), todo)), 1):
        record["tried"][mutations_lib.mutation_id(m)] = dict(result, mutation=m)
        kept += result["verdict"] == "kept"
        now = time.perf_counter()
        if now - said >= PROGRESS_S or done == len(todo):
          log(f"{pkg.key}: {done}/{len(todo)} mutants tried, {kept} kept, {now - started:.0f} s")
          record["seconds"] = round(record["seconds"] + now - saved, 2)
          said = saved = now
          _write_json(path, record)  # a stopped build keeps what it tried
  return dict(record, candidates=len(order), order=order[:limit])


def is_cached(pkg: Package, limit: int = DEFAULT_LIMIT) -> bool:
  """Whether the package's baseline and its first `limit` mutants are in the cache for this corpus code."""
  base_path, mined_path = package_dir(pkg) / "baseline.json", package_dir(pkg) / "mined.json"
  if not (base_path.is_file() and mined_path.is_file()):
    return False
  base, record = json.loads(base_path.read_text()), json.loads(mined_path.read_text())
  version = _corpus_version()
  if base.get("version") != version or record.get("version") != version:
    return False
  return len(record.get("tried", {})) >= min(limit, 1) and all(
      mutations_lib.mutation_id(m) in record["tried"] for m in candidate_order(pkg, base)[:limit])


def valid_mutations(pkg: Package, limit: int = DEFAULT_LIMIT) -> list[dict[str, Any]]:
  """The kept single mutations among the package's first `limit` candidates, in candidate order."""
  record = mine(pkg, limit)
  out = []
  for m in record["order"]:
    r = record["tried"].get(mutations_lib.mutation_id(m))
    if r is not None and r["verdict"] == "kept":
      out.append(dict(m, failing_tests=r["failing"], messages=r["messages"]))
  return out


MINING_VERSION = 3  # bump when what baseline/mine keep changes (KEEP_TEST_S, classify, the packages' layout)


def _corpus_version() -> str:
  """Cached baselines and mined mutants are reused while the runner, the operators and MINING_VERSION stay."""
  return source_version(mutations_lib.candidates, data=(RUNNER,), extra=f"mining-{MINING_VERSION}")


# ----------------------------------------------------------------------------------------------
# The scale report.


def report(packages: Sequence[Package] = PACKAGES, limit: int = DEFAULT_LIMIT, workers: int = 2) -> list[dict]:
  """Per package: tests kept, candidates, mutants tried / kept, drop reasons, tests per mutant run, the whole
  suite's measured CPU limit, throughput."""
  rows = []
  for pkg in packages:
    started = time.perf_counter()
    base = baseline(pkg)
    record = mine(pkg, limit, workers=workers)
    tried = [record["tried"][mutations_lib.mutation_id(m)] for m in record["order"]
             if mutations_lib.mutation_id(m) in record["tried"]]
    reasons = collections.Counter(r["verdict"] for r in tried)
    run_s = [r["s"] for r in tried if r["s"]]
    ran = [r["ran"] for r in tried if r.get("ran")]
    rows.append(dict(package=pkg.name, version=pkg.version, split=pkg.split, licence=pkg.licence,
                     tests=base["tests"], kept_tests=len(base["kept"]), candidates=record["candidates"],
                     tried=len(tried), kept=reasons.pop("kept", 0), dropped=dict(reasons),
                     mean_run_s=round(sum(run_s) / max(len(run_s), 1), 2),
                     mean_tests_run=round(sum(ran) / max(len(ran), 1), 1),
                     suite_limit_s=run_limit(base, base["kept"]).cpu_s,
                     mining_s=record["seconds"], wall_s=round(time.perf_counter() - started, 1)))
  return rows


def add_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--packages", nargs="*", default=None, help=f"names (default: all of "
                      f"{' '.join(p.name for p in PACKAGES)})")
  parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="mutants tried per package (cached: a "
                      "larger limit runs only the new ones)")
  parser.add_argument("--workers", type=int, default=2, help="mutants run at once")
  parser.add_argument("--json", type=Path, default=None, help="also write the rows here")


def cmd_report(args: argparse.Namespace) -> int:
  """`jaxagent envs swe-corpus`: the scale report (fetching, baselining and mining what is not cached)."""
  pkgs = [package(n) for n in args.packages] if args.packages else list(PACKAGES)
  rows = report(pkgs, args.limit, args.workers)
  print(f"{'package':<22}{'split':<7}{'tests':>7}{'kept':>6}{'cands':>7}{'tried':>7}{'tasks':>7}{'yield':>7}"
        f"{'run s':>7}{'tests/run':>10}{'limit s':>8}{'mutants/s':>10}  dropped")
  for r in rows:
    print(f"{r['package'] + ' ' + r['version']:<22}{r['split']:<7}{r['tests']:>7}{r['kept_tests']:>6}"
          f"{r['candidates']:>7}{r['tried']:>7}{r['kept']:>7}{r['kept'] / max(r['tried'], 1):>7.0%}"
          f"{r['mean_run_s']:>7.2f}{r['mean_tests_run']:>10.1f}{r['suite_limit_s']:>8.1f}"
          f"{r['tried'] / max(r['mining_s'], 1e-9):>10.2f}  "
          + " ".join(f"{k}={v}" for k, v in sorted(r["dropped"].items())))
  if args.json:
    args.json.write_text(json.dumps(rows, indent=1))
  return 0
