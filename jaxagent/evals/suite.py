"""Evaluation suites: what a release evaluation runs (YAML, `jaxagent/suites/<name>.yaml`), and gates on its results.

A suite is a list of named conditions over the same held-out tasks and env seeds, plus pass^k and exploit probes:

    name: release
    split: eval                # held-out split (tasks isolated by template / repository from train)
    episodes: 200              # tasks per condition: the same tasks and env seeds in every condition (paired)
    conditions:
      clean: {}                                 # the production parser and tool permissions, nothing perturbed
      transient: {perturb: {transient_p: 0.2}}  # envs/perturb.py: injected by the env workers
      tool_down: {perturb: {down_tool: 0}}      # a tool name, or its index among the env's tools
      turns_half: {budget: {turns: 0.5}}        # env.max_turns x 0.5 (at least 1)
      tokens_half: {budget: {tokens_per_turn: 0.5}}   # rollout.max_new_tokens x 0.5 (at least 1)
    pass_k: {k: 4, tasks: 50}  # k samples of each of the first `tasks` held-out tasks: pass@k and pass^k
    probes: {tasks: 8}         # the env's exploit probes (EnvSpec.probes) on the first `tasks` held-out tasks

A gate file lists conditions on the results' flat metrics (`jaxagent eval --gate`); one that fails makes the
command exit non-zero:

    gates:
      - clean.success >= 0.2
      - transient.drop <= 0.15
      - probes.passed == 0
"""

from __future__ import annotations

import dataclasses
import operator
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

import envs.perturb
from jaxagent.config import ConfigError

SUITE_DIR = Path(__file__).resolve().parent.parent / "suites"
SPLITS = ("train", "tune", "eval")


def _keys(where: str, d: Any, valid: tuple[str, ...]) -> dict[str, Any]:
  if d is None:
    return {}
  if not isinstance(d, Mapping):
    raise ConfigError(f"{where}: must be a mapping with keys {list(valid)}, got {type(d).__name__}")
  unknown = sorted(set(d) - set(valid))
  if unknown:
    raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {list(valid)}")
  return dict(d)


def _fraction(where: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
    raise ConfigError(f"{where}={value!r}: must be a fraction in (0, 1]")
  return float(value)


def _count(where: str, value: Any, low: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ConfigError(f"{where}={value!r}: must be an integer >= {low}")
  return value


@dataclasses.dataclass(frozen=True)
class Condition:
  """One way of running the held-out episodes: perturbed tools and / or cut budgets (neither: clean).

  Attributes:
    name: the condition's name (metric prefix).
    perturb: `envs.perturb.Perturbation` fields; `down_tool` may be an index among the env's tools.
    turns: fraction of `env.max_turns` (at least one turn).
    tokens_per_turn: fraction of `rollout.max_new_tokens` (at least one token).
  """
  name: str
  perturb: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  turns: float = 1.0
  tokens_per_turn: float = 1.0

  @property
  def kind(self) -> str:
    if self.perturb:
      return "perturbation"
    return "budget" if (self.turns, self.tokens_per_turn) != (1.0, 1.0) else "clean"

  @classmethod
  def from_dict(cls, name: str, d: Any) -> "Condition":
    where = f"conditions.{name}"
    d = _keys(where, d, ("perturb", "budget"))
    perturb = _keys(f"{where}.perturb", d.get("perturb"), tuple(f.name for f in dataclasses.fields(
        envs.perturb.Perturbation)))
    check = dict(perturb)
    if isinstance(check.get("down_tool"), int) and not isinstance(check["down_tool"], bool):
      check["down_tool"] = "resolved-later"  # an index: named against the env's tools when the suite runs
    try:
      envs.perturb.Perturbation.from_dict(check)
    except ValueError as e:
      raise ConfigError(f"{where}: {e}") from None
    budget = _keys(f"{where}.budget", d.get("budget"), ("turns", "tokens_per_turn"))
    return cls(name, perturb, **{k: _fraction(f"{where}.budget.{k}", v) for k, v in budget.items()})

  def overrides(self, config, tools: tuple[str, ...]) -> list[str]:
    """`--set` overrides that run this condition on top of a run's config."""
    import json
    out = []
    if self.perturb:
      perturb = dict(self.perturb)
      down = perturb.get("down_tool")
      if isinstance(down, int) and not isinstance(down, bool):
        if not 0 <= down < len(tools):
          raise ConfigError(f"conditions.{self.name}.perturb.down_tool={down}: the env has {len(tools)} tool(s) "
                            f"{list(tools)}")
        perturb["down_tool"] = tools[down]
      out.append(f"env.perturb={json.dumps(perturb)}")
    if self.turns != 1.0:
      out.append(f"env.max_turns={max(1, round(config.env.max_turns * self.turns))}")
    if self.tokens_per_turn != 1.0:
      out.append(f"rollout.max_new_tokens={max(1, round(config.rollout.max_new_tokens * self.tokens_per_turn))}")
    return out


@dataclasses.dataclass(frozen=True)
class Suite:
  """A release evaluation (module docstring). `pass_k` 0 or `probe_tasks` 0 turns that part off."""
  name: str
  conditions: tuple[Condition, ...]
  split: str = "eval"
  episodes: int = 200
  pass_k: int = 4
  pass_k_tasks: int = 50
  probe_tasks: int = 8

  @classmethod
  def from_dict(cls, d: Any, default_name: str = "suite") -> "Suite":
    d = _keys("suite", d, ("name", "split", "episodes", "conditions", "pass_k", "probes"))
    split = d.get("split", "eval")
    if split not in SPLITS:
      raise ConfigError(f"split={split!r}: not one of {list(SPLITS)}")
    raw = d.get("conditions")
    if not isinstance(raw, Mapping) or not raw:
      raise ConfigError("conditions: a suite needs at least one condition (a mapping of name: {perturb, budget})")
    conditions = tuple(Condition.from_dict(str(name), body) for name, body in raw.items())
    if "clean" not in {c.name for c in conditions} or next(c for c in conditions if c.name == "clean").kind != "clean":
      raise ConfigError(f"conditions: {[c.name for c in conditions]} has no unperturbed `clean: {{}}`, which every "
                        "other condition is compared with")
    bad = [c.name for c in conditions if not re.fullmatch(r"[A-Za-z_][\w-]*", c.name) or c.name in ("probes",)]
    if bad:
      raise ConfigError(f"conditions {bad}: names are identifiers (letters, digits, _ or -), not 'probes'")
    pass_k = _keys("pass_k", d.get("pass_k", {}), ("k", "tasks"))
    probes = _keys("probes", d.get("probes", {}), ("tasks",))
    return cls(name=str(d.get("name", default_name)), conditions=conditions, split=split,
               episodes=_count("episodes", d.get("episodes", 200)),
               pass_k=_count("pass_k.k", pass_k.get("k", 4), 0), pass_k_tasks=_count("pass_k.tasks",
                                                                                     pass_k.get("tasks", 50)),
               probe_tasks=_count("probes.tasks", probes.get("tasks", 8), 0))


def _read_yaml(path: Path) -> Any:
  try:
    return yaml.safe_load(path.read_text())
  except yaml.YAMLError as e:
    raise ConfigError(f"{path}: invalid YAML: {e}") from None


def load(name_or_path: str | Path) -> Suite:
  """A suite YAML: a path, or the name of a shipped suite in `jaxagent/suites/`."""
  path = Path(name_or_path)
  if not path.is_file():
    path = SUITE_DIR / f"{Path(name_or_path).stem}.yaml"
  if not path.is_file():
    shipped = sorted(p.stem for p in SUITE_DIR.glob("*.yaml"))
    raise ConfigError(f"--suite {str(name_or_path)!r}: no such file, and not a shipped suite {shipped}")
  try:
    return Suite.from_dict(_read_yaml(path), default_name=path.stem)
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------------------------
# Gates.

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq,
        "!=": operator.ne}
_GATE = re.compile(r"^\s*(?P<metric>[\w.@^-]+)\s*(?P<op>>=|<=|==|!=|>|<)\s*(?P<value>\S+)\s*$")


@dataclasses.dataclass(frozen=True)
class Gate:
  metric: str
  op: str
  value: float
  text: str

  def check(self, metrics: Mapping[str, float]) -> tuple[bool, float]:
    got = metrics[self.metric]
    return bool(_OPS[self.op](got, self.value)), got


def load_gates(path: str | Path, metrics: Mapping[str, float] | None = None) -> list[Gate]:
  """The gates of a YAML file (`gates: ["metric op number", ...]`); with `metrics`, every metric must be one."""
  path = Path(path)
  if not path.is_file():
    raise ConfigError(f"--gate {str(path)!r}: no such file")
  data = _read_yaml(path)
  items = data.get("gates") if isinstance(data, Mapping) else None
  if not isinstance(items, list) or not items or not all(isinstance(g, str) for g in items):
    raise ConfigError(f"{path}: expected `gates:` with a list of strings like 'clean.success >= 0.2'")
  gates = []
  for text in items:
    m = _GATE.match(text)
    try:
      value = float(m["value"]) if m else None
    except ValueError:
      value = None
    if m is None or value is None:
      raise ConfigError(f"{path}: gate {text!r}: write `metric op number`, op one of {list(_OPS)}")
    if metrics is not None and m["metric"] not in metrics:
      raise ConfigError(f"{path}: gate {text!r}: no metric {m['metric']!r}; this suite's metrics are "
                        f"{sorted(metrics)}")
    gates.append(Gate(m["metric"], m["op"], value, text.strip()))
  return gates
