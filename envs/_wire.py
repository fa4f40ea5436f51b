"""Records that cross the wire between the trainer and env workers (msgpack-able): `Task`, `Observation`,
`Verdict`, `Call`, `StepResult`. Part of the env API (`envs/_api.py` re-exports every name).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from envs._vocabulary import OUTCOMES, REWARD_COMPONENTS, SPLITS, TERMINATIONS, Outcome, Termination



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
  """Text shown to the policy. Capped: `truncated` and `original_size` (bytes) keep what was cut.

  `state_key`: the anchor state this observation shows (a short stable hash of the env state that matters for
  what comes next, `Env.state_key`), or None when the env does not say. Steps of one task group that start from
  the same key form a GiGPO step group (docs/design.md §2.6).

  `system`: a first observation's own system message, which replaces the configured one in the prompt (an agent
  over the gateway brings its own); None: the configured one. Later observations never carry one.
  """
  text: str
  truncated: bool = False
  original_size: int = 0
  state_key: str | None = None
  system: str | None = None

  def __post_init__(self):
    if self.state_key is not None and not isinstance(self.state_key, str):
      raise TypeError(f"Observation.state_key={self.state_key!r}: must be a str or None")
    if self.system is not None and not isinstance(self.system, str):
      raise TypeError(f"Observation.system: must be a str or None, got {type(self.system).__name__}")

  @classmethod
  def capped(cls, text: str, max_bytes: int, state_key: str | None = None) -> "Observation":
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= max_bytes:
      return cls(text, False, len(raw), state_key)
    return cls(raw[:max_bytes].decode("utf-8", errors="ignore"), True, len(raw), state_key)

  def to_wire(self) -> dict[str, Any]:
    wire = dict(text=self.text, truncated=self.truncated, original_size=self.original_size,
                state_key=self.state_key)
    if self.system is not None:
      wire["system"] = self.system
    return wire

  @classmethod
  def from_wire(cls, d: Mapping[str, Any]) -> "Observation":
    key = d.get("state_key")  # absent from a worker older than state keys
    system = d.get("system")
    return cls(str(d["text"]), bool(d["truncated"]), int(d["original_size"]), None if key is None else str(key),
               None if system is None else str(system))


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What a verifier returns. `evidence` is kept with the trajectory (msgpack-able); `seconds` is the time the
  verifier took (T_verify, filled by `Verifier.verify`)."""
  passed: bool
  reward: float
  evidence: Mapping[str, Any]
  version: str
  seconds: float = dataclasses.field(default=0.0, compare=False)  # a measurement, not part of the verdict

  def __post_init__(self):
    if not isinstance(self.evidence, Mapping):
      raise TypeError(f"Verdict.evidence: must be a mapping, got {type(self.evidence).__name__}")
    _check_wire_value(dict(self.evidence), "Verdict.evidence")

  def to_wire(self) -> dict[str, Any]:
    return dict(passed=bool(self.passed), reward=float(self.reward), evidence=dict(self.evidence),
                version=str(self.version), seconds=float(self.seconds))

  @classmethod
  def from_wire(cls, d: Mapping[str, Any]) -> "Verdict":
    return cls(bool(d["passed"]), float(d["reward"]), dict(d["evidence"]), str(d["version"]),
               float(d.get("seconds", 0.0)))


@dataclasses.dataclass(frozen=True)
class Call:
  """A parsed action: tool name and its argument string.

  `arguments` holds the JSON arguments of a call that came as a JSON function call (`syntax="json"`), else it
  is empty; `arg` is the tool's line argument either way (`Tool.arg`'s value), so envs read `arg` alone.
  """
  name: str
  arg: str
  arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def to_wire(self) -> dict[str, Any]:
    wire = dict(name=self.name, arg=self.arg)
    if self.arguments:
      wire["arguments"] = dict(self.arguments)
    return wire

  @classmethod
  def from_wire(cls, d: Mapping[str, Any]) -> "Call":
    return cls(str(d["name"]), str(d["arg"]), dict(d.get("arguments") or {}))


@dataclasses.dataclass(frozen=True)
class StepResult:
  """One env step.

  The first five fields keep their positions (`StepResult(obs, components, done, termination, info)`); the
  typed ones after them are keywords in practice.

  Attributes:
    observation: the next observation (already capped by whoever produced it).
    reward_components: named parts of the step reward (validity, progress, outcome, cost), each logged.
    done: the episode is over.
    termination: a `Termination` when done, else None (a plain string is converted).
    info: msgpack-able details that are not typed fields (rule, error, timings, worker_restarts, ...).
    outcome: the step's `Outcome`; None on construction derives it: the termination when done, else ok.
      A finished step never has ok / *_continued, an unfinished one has nothing else.
    call: the parsed action (`Env.step` fills it from its parser), None if the text was not an action.
    verdict: the verifier's verdict when one scored the episode on this step, else None.
  """
  observation: Observation
  reward_components: Mapping[str, float]
  done: bool
  termination: Termination | None
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  outcome: Outcome = None  # type: ignore[assignment]  # derived in __post_init__ when None
  call: Call | None = None
  verdict: Verdict | None = None

  def __post_init__(self):
    if self.termination is not None:
      if self.termination not in TERMINATIONS:
        raise ValueError(f"StepResult.termination={self.termination!r}: not one of {TERMINATIONS}")
      object.__setattr__(self, "termination", Termination(self.termination))
    if self.done and self.termination is None:
      raise ValueError(f"StepResult.termination=None: a finished step needs one of {TERMINATIONS}")
    if not self.done and self.termination is not None:
      raise ValueError(f"StepResult.termination={self.termination.value!r} but done=False")
    if self.outcome is None:
      outcome = Outcome(self.termination.value) if self.done else Outcome.OK
    elif self.outcome in OUTCOMES:
      outcome = Outcome(self.outcome)
    else:
      raise ValueError(f"StepResult.outcome={self.outcome!r}: not one of {OUTCOMES}")
    if outcome.ends_episode != self.done:
      raise ValueError(f"StepResult.outcome={outcome.value!r} with done={self.done}: "
                       + ("a finished step's outcome is a termination or a finer reason of one" if self.done else
                          "an unfinished step's outcome is ok, invalid_action_continued or parser_rejected_continued"))
    object.__setattr__(self, "outcome", outcome)
    if self.call is not None and not isinstance(self.call, Call):
      raise TypeError(f"StepResult.call: must be a Call or None, got {type(self.call).__name__}")
    if self.verdict is not None and not isinstance(self.verdict, Verdict):
      raise TypeError(f"StepResult.verdict: must be a Verdict or None, got {type(self.verdict).__name__}")
    bad = set(self.reward_components) - set(REWARD_COMPONENTS)
    if bad:
      raise ValueError(f"reward components {sorted(bad)}: valid are {REWARD_COMPONENTS}")

  @property
  def reward(self) -> float:
    return float(sum(self.reward_components.values()))

  def to_wire(self) -> dict[str, Any]:
    return dict(observation=self.observation.to_wire(), reward_components=dict(self.reward_components),
                done=self.done, termination=None if self.termination is None else self.termination.value,
                info=dict(self.info), outcome=self.outcome.value,
                call=None if self.call is None else self.call.to_wire(),
                verdict=None if self.verdict is None else self.verdict.to_wire())

  @classmethod
  def from_wire(cls, d: Mapping[str, Any]) -> "StepResult":
    return cls(Observation.from_wire(d["observation"]),
               {str(k): float(v) for k, v in d["reward_components"].items()}, bool(d["done"]),
               d["termination"], dict(d.get("info") or {}), outcome=d["outcome"],
               call=None if d.get("call") is None else Call.from_wire(d["call"]),
               verdict=None if d.get("verdict") is None else Verdict.from_wire(d["verdict"]))


