"""Environment API: tasks, environments, verifiers, action parsing and the invalid-action rule.

Plain Python only (no JAX, no jaxagent imports): everything here also runs inside sandboxed worker processes
and containers. Termination reasons are the strings of `jaxagent.trajectory.Termination`, repeated here so the
two sides agree without importing each other.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import inspect
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

# ----------------------------------------------------------------------------------------------
# Termination reasons and per-step outcomes.

COMPLETED = "completed"
MAX_TURNS = "max_turns"
CONTEXT_EXHAUSTED = "context_exhausted"
TURN_BUDGET_EXHAUSTED = "turn_budget_exhausted"
INVALID_ACTION = "invalid_action"
PARSER_REJECTED = "parser_rejected"
ENV_ERROR = "env_error"
ENV_TIMEOUT = "env_timeout"
RETRIES_EXHAUSTED = "retries_exhausted"
CANCELLED = "cancelled"

TERMINATIONS = (COMPLETED, MAX_TURNS, CONTEXT_EXHAUSTED, TURN_BUDGET_EXHAUSTED, INVALID_ACTION,
                PARSER_REJECTED, ENV_ERROR, ENV_TIMEOUT, RETRIES_EXHAUSTED, CANCELLED)

# Per-step outcome: finer than the termination (a worker crash ends as env_error, a rejected action under the
# error_observation rule does not end the episode). Codes are what the host-callback bridge returns.
OUTCOMES = ("ok",) + TERMINATIONS + ("worker_crash", "invalid_action_continued", "parser_rejected_continued")
OUTCOME_CODES: Mapping[str, int] = {name: i for i, name in enumerate(OUTCOMES)}

SPLITS = ("train", "tune", "eval")
INVALID_ACTION_RULES = ("error_observation", "terminate", "penalty")
REWARD_COMPONENTS = ("validity", "progress", "outcome", "cost")


class EnvError(RuntimeError):
  """An environment or tool fault (not a task failure): ends the episode as `env_error`."""


# ----------------------------------------------------------------------------------------------
# Records that cross the wire (msgpack-able: str/int/float/bool/None/list/dict only).


def _check_wire_value(value: Any, where: str) -> None:
  if value is None or isinstance(value, (str, int, float, bool, bytes)):
    return
  if isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      _check_wire_value(v, f"{where}[{i}]")
    return
  if isinstance(value, dict):
    for k, v in value.items():
      if not isinstance(k, str):
        raise TypeError(f"{where}: keys must be str, got {k!r}")
      _check_wire_value(v, f"{where}.{k}")
    return
  raise TypeError(f"{where}={value!r}: not msgpack-able (use str/int/float/bool/None/list/dict)")


@dataclasses.dataclass(frozen=True)
class Task:
  """One task: `payload` is what the env needs to build the episode; answers stay in the env/verifier.

  Attributes:
    id: unique within (env, version).
    split: "train", "tune" or "eval"; splits are isolated by template, not by id.
    payload: msgpack-able dict.
    version: task/dataset version (generator hash).
  """
  id: str
  split: str
  payload: Mapping[str, Any]
  version: str

  def __post_init__(self):
    if not isinstance(self.id, str) or not self.id:
      raise ValueError(f"Task.id={self.id!r}: must be a non-empty str")
    if self.split not in SPLITS:
      raise ValueError(f"Task.split={self.split!r}: not one of {SPLITS}")
    if not isinstance(self.payload, Mapping):
      raise TypeError(f"Task.payload: must be a mapping, got {type(self.payload).__name__}")
    _check_wire_value(dict(self.payload), "Task.payload")

  def to_wire(self) -> dict[str, Any]:
    return dict(id=self.id, split=self.split, payload=dict(self.payload), version=self.version)

  @classmethod
  def from_wire(cls, d: Mapping[str, Any]) -> "Task":
    missing = {"id", "split", "payload", "version"} - set(d)
    if missing:
      raise ValueError(f"task is missing {sorted(missing)}")
    return cls(id=d["id"], split=d["split"], payload=d["payload"], version=str(d["version"]))


@dataclasses.dataclass(frozen=True)
class Observation:
  """Text shown to the policy. Capped: `truncated` and `original_size` (bytes) keep what was cut."""
  text: str
  truncated: bool = False
  original_size: int = 0

  @classmethod
  def capped(cls, text: str, max_bytes: int) -> "Observation":
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= max_bytes:
      return cls(text, False, len(raw))
    return cls(raw[:max_bytes].decode("utf-8", errors="ignore"), True, len(raw))


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What a verifier returns. `evidence` is kept with the trajectory (msgpack-able)."""
  passed: bool
  reward: float
  evidence: Mapping[str, Any]
  version: str


@dataclasses.dataclass(frozen=True)
class StepResult:
  """One env step.

  Attributes:
    observation: the next observation (already capped by whoever produced it).
    reward_components: named parts of the step reward (validity, progress, outcome, cost), each logged.
    done: the episode is over.
    termination: one of TERMINATIONS when done, else None.
    info: msgpack-able details (parsed call, verdict, outcome, timings...).
  """
  observation: Observation
  reward_components: Mapping[str, float]
  done: bool
  termination: str | None
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.done and self.termination not in TERMINATIONS:
      raise ValueError(f"StepResult.termination={self.termination!r}: a finished step needs one of {TERMINATIONS}")
    if not self.done and self.termination is not None:
      raise ValueError(f"StepResult.termination={self.termination!r} but done=False")
    bad = set(self.reward_components) - set(REWARD_COMPONENTS)
    if bad:
      raise ValueError(f"reward components {sorted(bad)}: valid are {REWARD_COMPONENTS}")

  @property
  def reward(self) -> float:
    return float(sum(self.reward_components.values()))

  @property
  def outcome(self) -> str:
    return str(self.info.get("outcome", self.termination if self.done else "ok"))

  def to_wire(self) -> dict[str, Any]:
    return dict(observation=dataclasses.asdict(self.observation), reward_components=dict(self.reward_components),
                done=self.done, termination=self.termination, info=dict(self.info))

  @classmethod
  def from_wire(cls, d: Mapping[str, Any]) -> "StepResult":
    obs = d["observation"]
    return cls(Observation(str(obs["text"]), bool(obs["truncated"]), int(obs["original_size"])),
               {str(k): float(v) for k, v in d["reward_components"].items()}, bool(d["done"]),
               d["termination"], dict(d.get("info") or {}))


# ----------------------------------------------------------------------------------------------
# Actions.


@dataclasses.dataclass(frozen=True)
class Call:
  """A parsed action: tool name and its argument string."""
  name: str
  arg: str


class ParseError(ValueError):
  """The model text is not an action at all (wrong syntax): `parser_rejected`."""


class InvalidAction(ValueError):
  """A well-formed call that the env refuses (unknown tool, bad argument): `invalid_action`."""


@dataclasses.dataclass(frozen=True)
class ActionParser:
  """`NAME ARG` on one line: a tool name from `tools`, one space, the argument (may be empty if allowed).

  Short and regular on purpose: the default RL run teaches a ~1M-parameter byte model this syntax.
  """
  tools: tuple[str, ...]
  max_chars: int = 256
  version: str = "line-v1"

  def parse(self, text: str) -> Call:
    text = text.strip()
    if not text:
      raise ParseError("empty action")
    if len(text) > self.max_chars:
      raise ParseError(f"action of {len(text)} chars exceeds {self.max_chars}")
    if "\n" in text:
      raise ParseError("an action is one line")
    name, _, arg = text.partition(" ")
    if not re.fullmatch(r"[a-z_]+", name):
      raise ParseError(f"bad tool name {name[:20]!r}")
    if name not in self.tools:
      raise InvalidAction(f"unknown tool {name!r}; tools are {' '.join(self.tools)}")
    return Call(name, arg.strip())


@dataclasses.dataclass(frozen=True)
class InvalidActionRule:
  """What happens to an action the parser or env rejects (DESIGN.md §2.3); recorded in every step's info.

  Attributes:
    rule: "error_observation" (reply with the error, continue, no reward change), "terminate" (end the
      episode as parser_rejected / invalid_action), "penalty" (reply with the error, continue, validity
      reward -penalty).
    penalty: subtracted under "penalty".
  """
  rule: str = "error_observation"
  penalty: float = 0.1

  def __post_init__(self):
    if self.rule not in INVALID_ACTION_RULES:
      raise ValueError(f"invalid_action rule={self.rule!r}: not one of {INVALID_ACTION_RULES}")
    if self.penalty < 0:
      raise ValueError(f"invalid_action penalty={self.penalty!r}: must be >= 0")

  def apply(self, error: Exception, turn_limited: bool = False) -> StepResult:
    """The StepResult for a rejected action (`error` is a ParseError or InvalidAction)."""
    kind = PARSER_REJECTED if isinstance(error, ParseError) else INVALID_ACTION
    info = dict(rule=self.rule, error=str(error))
    text = f"error: {error}"
    if self.rule == "terminate":
      return StepResult(Observation(text, False, len(text.encode())), {"validity": 0.0}, True, kind,
                        dict(info, outcome=kind))
    validity = -self.penalty if self.rule == "penalty" else 0.0
    return StepResult(Observation(text, False, len(text.encode())), {"validity": validity}, False, None,
                      dict(info, outcome=f"{kind}_continued"))


# ----------------------------------------------------------------------------------------------
# Env and verifier.


class Verifier(abc.ABC):
  """Scores an outcome; versioned separately from the env that produced it."""

  version: str = "0"

  @abc.abstractmethod
  def score(self, task: Task, final: Any) -> Verdict:
    """Args: task; final: what the episode produced (an answer string, a directory...)."""


class Env(abc.ABC):
  """One episode at a time. Subclasses implement `_reset` and `_step`; the base class enforces turn limits,
  the invalid-action rule and observation caps, and turns `EnvError` into `env_error`.
  """

  name: str = "env"
  description: str = ""
  parser: ActionParser

  def __init__(self, *, max_turns: int = 8, invalid_action: InvalidActionRule = InvalidActionRule(),
               max_obs_bytes: int = 4096):
    if max_turns < 1:
      raise ValueError(f"max_turns={max_turns}: must be >= 1")
    if max_obs_bytes < 16:
      raise ValueError(f"max_obs_bytes={max_obs_bytes}: must be >= 16")
    self.max_turns = max_turns
    self.invalid_action = invalid_action
    self.max_obs_bytes = max_obs_bytes
    self.task: Task | None = None
    self.turn = 0
    self.done = False

  # -- subclass hooks
  @abc.abstractmethod
  def _reset(self, task: Task, seed: int) -> str: ...

  @abc.abstractmethod
  def _step(self, call: Call) -> StepResult:
    """Run a parsed call; raise InvalidAction for refused calls, EnvError for tool faults."""

  def snapshot(self) -> Any:
    raise NotImplementedError(f"{self.name} does not support snapshot()")

  def restore(self, state: Any) -> None:
    raise NotImplementedError(f"{self.name} does not support restore()")

  def close(self) -> None:
    pass

  # -- public
  def reset(self, task: Task, seed: int) -> Observation:
    self.task, self.turn, self.done = task, 0, False
    return Observation.capped(self._reset(task, int(seed)), self.max_obs_bytes)

  def step(self, action_text: str) -> StepResult:
    if self.task is None:
      raise RuntimeError(f"{self.name}: step() before reset()")
    if self.done:
      raise RuntimeError(f"{self.name}: step() after the episode ended")
    self.turn += 1
    info: dict[str, Any] = dict(turn=self.turn, action=action_text[:256])
    try:
      call = self.parser.parse(action_text)
      info["call"] = dict(name=call.name, arg=call.arg[:256])
      result = self._step(call)
    except (ParseError, InvalidAction) as e:
      result = self.invalid_action.apply(e)
    except EnvError as e:
      result = StepResult(Observation.capped(f"env error: {e}", self.max_obs_bytes), {}, True, ENV_ERROR,
                          dict(outcome=ENV_ERROR, error=str(e)))
    if not result.done and self.turn >= self.max_turns:
      result = dataclasses.replace(result, done=True, termination=MAX_TURNS,
                                   info=dict(result.info, outcome=MAX_TURNS))
    obs = result.observation
    if len(obs.text.encode("utf-8", errors="replace")) > self.max_obs_bytes:
      capped = Observation.capped(obs.text, self.max_obs_bytes)
      obs = dataclasses.replace(capped, original_size=max(capped.original_size, obs.original_size))
    self.done = result.done
    return dataclasses.replace(result, observation=obs, info={**info, **result.info})


# ----------------------------------------------------------------------------------------------
# Versions.


def source_version(*objs: Any, data: Iterable[Path] = (), extra: str = "") -> str:
  """A short hash of the source files defining `objs`, the files in `data` and `extra`."""
  h = hashlib.sha256()
  files = sorted({inspect.getsourcefile(o) for o in objs} | {str(Path(p)) for p in data})
  for f in files:
    h.update(Path(f).name.encode())
    h.update(Path(f).read_bytes())
  h.update(extra.encode())
  return h.hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """A registered environment.

  Attributes:
    name: registry name.
    description: one line.
    make: `make(**kwargs) -> Env`.
    tasks: `tasks(split, n, seed) -> list[Task]` (deterministic).
    demo: `demo(task) -> list[str]`, scripted actions that solve `task` (behavior cloning).
    version_sources: objects whose source files define the version.
    deterministic: replay with the same seed and actions gives the same observations.
    needs_sandbox: actions run real programs (terminal, code repair).
  """
  name: str
  description: str
  make: Callable[..., Env]
  tasks: Callable[[str, int, int], list[Task]]
  demo: Callable[[Task], list[str]]
  version_sources: tuple[Any, ...] = ()
  data_files: tuple[Path, ...] = ()
  deterministic: bool = True
  needs_sandbox: bool = False

  @property
  def version(self) -> str:
    return source_version(*(self.version_sources or (self.make,)), Env, data=self.data_files)
