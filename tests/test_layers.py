"""The import graph, built from the source: no cycle, and every import goes to its own layer or one below.

Every `import` statement counts, the ones inside functions too: a function-local import may defer loading (the
CLIs load JAX only for the verbs that need it), never hide a cycle. The layers are docs/design.md §3.1;
a new module must be placed in one (the test names it otherwise).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("envs", "models", "jaxagent")

# Bottom to top. A module belongs to the layer of its longest matching prefix (`a.b` matches `a.b` and `a.b.*`).
LAYERS = (
    ("foundations", ("envs", "models", "jaxagent.__init__", "jaxagent.seeds", "jaxagent.mesh_rules",
                     "jaxagent.buckets", "jaxagent.algos", "jaxagent.multihost")),
    ("config", ("jaxagent.config", "jaxagent.config_reference")),
    ("records", ("jaxagent.trajectory", "jaxagent.trajectory_store", "jaxagent.trajectory_render", "jaxagent.chat", "jaxagent.assembly",
                 "jaxagent.shared_prefix", "jaxagent.data", "jaxagent.weights", "jaxagent.sharding", "jaxagent.distributed")),
    ("rollout", ("jaxagent.rollout",)),
    ("tasks", ("jaxagent.tasks",)),
    ("train", ("jaxagent.train",)),
    ("plan", ("jaxagent.plan",)),
    ("evals", ("jaxagent.evals",)),
    ("cli", ("jaxagent.cli", "jaxagent.reference_pages", "jaxagent.inspect_cli", "jaxagent.demo", "jaxagent.__main__", "jaxagent.tasks.cli",
             "jaxagent.plan.cli", "envs.cli")),
)
# The foundations import nothing of each other but these (envs never imports JAX, models or jaxagent).
FOUNDATION_EDGES = {("jaxagent.mesh_rules", "models"), ("jaxagent.multihost", "models")}


def modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
  out = {}
  for package in packages:
    for path in (root / package).rglob("*.py"):
      parts = path.relative_to(root).with_suffix("").parts
      out[".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)] = path
  return out


def _targets(name: str, path: Path, node: ast.AST, known: dict[str, Path]) -> set[str]:
  """The known modules an import statement in module `name` loads (an imported attribute counts as its module;
  the parent packages Python loads on the way are not edges)."""
  if isinstance(node, ast.Import):
    wanted = [a.name for a in node.names]
  else:
    base = node.module or ""
    if node.level:
      package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
      package = package[:len(package) - (node.level - 1)]
      base = ".".join(package + ([base] if base else []))
    wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
  out = set()
  for w in wanted:
    while w and w not in known:
      w = w.rpartition(".")[0]
    if w and w != name:
      out.add(w)
  return out


@functools.lru_cache(maxsize=None)
def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
  known = modules(root, packages)
  graph = {}
  for name, path in known.items():
    tree = ast.parse(path.read_text(), str(path))
    graph[name] = set().union(*(_targets(name, path, n, known) for n in ast.walk(tree)
                                if isinstance(n, (ast.Import, ast.ImportFrom))))
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle as a path `a -> ... -> a`, or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(v: str) -> list[str] | None:
    state[v] = 1
    path.append(v)
    for w in sorted(graph.get(v, ())):
      if state.get(w) == 1:
        return path[path.index(w):] + [w]
      if w not in state and (found := visit(w)):
        return found
    path.pop()
    state[v] = 2
    return None

  for v in sorted(graph):
    if v not in state and (found := visit(v)):
      return found
  return None


def layer_of(name: str) -> tuple[int, str] | None:
  best = None
  for i, (layer, prefixes) in enumerate(LAYERS):
    for p in prefixes:
      key = name if p != "jaxagent.__init__" else name + ".__init__"
      if key == p or key.startswith(p + "."):
        if best is None or len(p) > best[2]:
          best = (i, layer, len(p))
  return None if best is None else best[:2]


def test_the_import_graph_has_no_cycle():
  cycle = find_cycle(import_graph(ROOT))
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_has_a_layer_and_imports_only_its_own_layer_or_below():
  graph = import_graph(ROOT)
  unplaced = sorted(m for m in graph if layer_of(m) is None)
  assert not unplaced, f"modules in no layer of tests/test_layers.py LAYERS (docs/design.md): {unplaced}"
  upward = []
  for m, targets in sorted(graph.items()):
    (i, layer) = layer_of(m)
    for t in sorted(targets):
      (j, other) = layer_of(t)
      if j > i:
        upward.append(f"{m} ({layer}) imports {t} ({other})")
      elif i == j == 0 and m.split(".")[0] != t.split(".")[0] and (m, t) not in FOUNDATION_EDGES:
        if not (m.startswith("jaxagent") and t.startswith("jaxagent")):
          upward.append(f"{m} imports {t}: the foundations envs and models are independent")
  assert not upward, "imports against the layers:\n  " + "\n  ".join(upward)


def test_envs_never_import_jax_or_the_trainer():
  for name, path in modules(ROOT, ("envs",)).items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        bad = [n for n in names if n.split(".")[0] in ("jax", "jaxagent", "models", "flax")]
        assert not bad, f"{name} imports {bad}: envs run in worker processes and containers without JAX"


def test_the_checker_finds_a_cycle_hidden_in_a_function_and_an_upward_import(tmp_path):
  """The checks above can fail: a synthetic package whose cycle closes through a function-local import."""
  pkg = tmp_path / "jaxagent"
  (pkg / "train").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "train" / "__init__.py").write_text("")
  (pkg / "config.py").write_text("def names():\n  from jaxagent.train import loop\n  return loop.X\n")
  (pkg / "train" / "loop.py").write_text("from jaxagent import config\nX = 1\n")
  graph = import_graph(tmp_path, ("jaxagent",))
  assert graph["jaxagent.config"] == {"jaxagent.train.loop"}
  cycle = find_cycle(graph)
  assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"jaxagent.config", "jaxagent.train.loop"}
  assert layer_of("jaxagent.config")[0] < layer_of("jaxagent.train.loop")[0]  # config -> train is upward
  assert layer_of("jaxagent.tasks.cli")[1] == "cli" and layer_of("jaxagent.tasks.supply")[1] == "tasks"
  assert layer_of("jaxagent")[1] == "foundations" and layer_of("jaxagent.nothing_here") is None


@pytest.mark.parametrize("module", ["jaxagent.config", "jaxagent.tasks.supply", "jaxagent.train.paradigms"])
def test_the_modules_that_closed_the_old_cycles_import_nothing_above_them(module):
  """The issue's three circles: config <-> sharding, tasks <-> train, loop <-> paradigms."""
  graph = import_graph(ROOT)
  banned = {"jaxagent.config": ("jaxagent.sharding", "jaxagent.train"), "jaxagent.tasks.supply": ("jaxagent.train",),
            "jaxagent.train.paradigms": ("jaxagent.train.loop",)}[module]
  assert not [t for t in graph[module] if t.startswith(banned)]


def test_one_home_per_rule():
  """docs/design.md §3.3: each rule below is written once and the others derive from it."""
  import typing

  import envs
  from jaxagent import config as config_lib
  from jaxagent.tasks import pipeline
  # Seeds: only jaxagent/seeds.py derives one (a second derivation of the same stream silently diverges).
  derive = [str(p.relative_to(ROOT)) for p in (ROOT / "jaxagent").rglob("*.py")
            if "stable_seed(" in p.read_text() and p.name != "seeds.py"]
  assert not derive, f"seeds derived outside jaxagent/seeds.py: {derive}"
  # Infrastructure failures: the trainer's default exclusions are what the task pipeline retries.
  assert config_lib.TrainConfig().exclude_terminations == envs.INFRASTRUCTURE_TERMINATIONS
  assert pipeline.INFRASTRUCTURE == ("worker_failure", *envs.INFRASTRUCTURE_TERMINATIONS)
  # Paradigms: the stage Literal is the table's names.
  hints = typing.get_type_hints(config_lib.StageConfig)
  assert typing.get_args(hints["paradigm"]) == tuple(config_lib.PARADIGMS)
  # Bubblewrap: one builder of the base argv.
  bwrap = [str(p.relative_to(ROOT)) for p in (ROOT / "envs").rglob("*.py")
           if '"bwrap", "--unshare-all"' in p.read_text()]
  assert bwrap == ["envs/_sandbox.py"], bwrap
  # Length buckets: the lists and the rule in jaxagent/buckets.py, which the sampler and the assembly use.
  from jaxagent import assembly, buckets
  from jaxagent.rollout import sampler
  assert sampler.DEFAULT_BUCKETS is buckets.PREFILL and assembly.DEFAULT_BUCKETS is buckets.BATCH
  assert buckets.up_to(128) == (16, 32, 64, 128) and buckets.up_to(8192)[-2:] == (2048, 8192)
  assert sampler.bucket(17, (32, 16)) == assembly.bucket_length(17, (32, 16)) == 32  # unsorted lists too
