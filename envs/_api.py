"""Environment API: tasks, environments, verifiers, action parsing and the invalid-action rule.

Plain Python only (no JAX, no jaxagent imports): everything here also runs inside sandboxed worker processes
and containers. `Termination` and `Outcome` are the one vocabulary of episode ends: jaxagent imports them from
here (envs never imports jaxagent).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import hashlib
import inspect
import json
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

# ----------------------------------------------------------------------------------------------
# Termination reasons and per-step outcomes: the one vocabulary shared with jaxagent (which imports these).


class Termination(str, enum.Enum):
  """Why an episode ended (docs/design.md §2.1), recorded with the trajectory, never inferred later.

  A `str` enum: members compare and hash equal to their value (`Termination.COMPLETED == "completed"`), and
  `str()` / f-strings give the value. Use `.value` when writing to the wire or logs.
  """
  COMPLETED = "completed"                      # the task ran to its end and a verifier scored it
  MAX_TURNS = "max_turns"                      # the turn limit was reached first
  CONTEXT_EXHAUSTED = "context_exhausted"      # the policy's context / token budget ran out
  TURN_BUDGET_EXHAUSTED = "turn_budget_exhausted"  # the task's own budget (e.g. guesses) ran out
  INVALID_ACTION = "invalid_action"            # a refused call ended the episode (rule "terminate")
  PARSER_REJECTED = "parser_rejected"          # text that is not an action ended the episode (rule "terminate")
  ENV_ERROR = "env_error"                      # a tool / env / worker fault
  ENV_TIMEOUT = "env_timeout"                  # an action or the episode exceeded its time limit
  RETRIES_EXHAUSTED = "retries_exhausted"      # the worker kept dying on this step
  CANCELLED = "cancelled"                      # the trainer cancelled the episode

  def __str__(self) -> str:
    return self.value

  __format__ = str.__format__


class Outcome(str, enum.Enum):
  """What one step came to: "ok", a termination, or a finer reason (a worker crash ends as env_error, a
  rejected action under the error_observation / penalty rules does not end the episode).

  Members after the terminations only ever get appended: their position is their `OUTCOME_CODES` code.
  """
  OK = "ok"
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
  WORKER_CRASH = "worker_crash"                              # done, env_error: worker died, no replay
  INVALID_ACTION_CONTINUED = "invalid_action_continued"      # not done: refused call answered with an error
  PARSER_REJECTED_CONTINUED = "parser_rejected_continued"    # not done: non-action answered with an error
  REPLAY_DIVERGED = "replay_diverged"                        # done, env_error: a replay answered differently

  def __str__(self) -> str:
    return self.value

  __format__ = str.__format__

  @property
  def ends_episode(self) -> bool:
    """True for every outcome of a finished step (all but ok and the *_continued ones)."""
    return self not in _CONTINUING


_CONTINUING = frozenset({Outcome.OK, Outcome.INVALID_ACTION_CONTINUED, Outcome.PARSER_REJECTED_CONTINUED})
if [o.value for o in Outcome][1:len(Termination) + 1] != [t.value for t in Termination]:
  raise AssertionError("Outcome must list every Termination, in order, right after ok")

COMPLETED = Termination.COMPLETED
MAX_TURNS = Termination.MAX_TURNS
CONTEXT_EXHAUSTED = Termination.CONTEXT_EXHAUSTED
TURN_BUDGET_EXHAUSTED = Termination.TURN_BUDGET_EXHAUSTED
INVALID_ACTION = Termination.INVALID_ACTION
PARSER_REJECTED = Termination.PARSER_REJECTED
ENV_ERROR = Termination.ENV_ERROR
ENV_TIMEOUT = Termination.ENV_TIMEOUT
RETRIES_EXHAUSTED = Termination.RETRIES_EXHAUSTED
CANCELLED = Termination.CANCELLED

TERMINATIONS: tuple[str, ...] = tuple(t.value for t in Termination)
# Ends that are faults of the infrastructure, not of the policy or the task: the trainer's default
# train.exclude_terminations (stored, counted, never trained on), and what `jaxagent tasks execute` retries.
INFRASTRUCTURE_TERMINATIONS: tuple[str, ...] = (ENV_ERROR.value, ENV_TIMEOUT.value, RETRIES_EXHAUSTED.value,
                                                CANCELLED.value)
OUTCOMES: tuple[str, ...] = tuple(o.value for o in Outcome)
# Codes are what the host-callback bridge returns (int32); keyed by the value, so a member looks up too.
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
    return dict(observation=dataclasses.asdict(self.observation), reward_components=dict(self.reward_components),
                done=self.done, termination=None if self.termination is None else self.termination.value,
                info=dict(self.info), outcome=self.outcome.value,
                call=None if self.call is None else self.call.to_wire(),
                verdict=None if self.verdict is None else self.verdict.to_wire())

  @classmethod
  def from_wire(cls, d: Mapping[str, Any]) -> "StepResult":
    obs = d["observation"]
    return cls(Observation(str(obs["text"]), bool(obs["truncated"]), int(obs["original_size"])),
               {str(k): float(v) for k, v in d["reward_components"].items()}, bool(d["done"]),
               d["termination"], dict(d.get("info") or {}), outcome=d["outcome"],
               call=None if d.get("call") is None else Call.from_wire(d["call"]),
               verdict=None if d.get("verdict") is None else Verdict.from_wire(d["verdict"]))


# ----------------------------------------------------------------------------------------------
# Actions.


class ParseError(ValueError):
  """The model text is not an action at all (wrong syntax): `parser_rejected`."""


class InvalidAction(ValueError):
  """A well-formed call that the env refuses (unknown tool, bad argument): `invalid_action`."""


@dataclasses.dataclass(frozen=True)
class Tool:
  """A tool the policy may call, as chat templates expect it (the OpenAI function format).

  Attributes:
    name: lower-case letters and underscores.
    description: one line, shown to the policy in the system prompt.
    parameters: JSON Schema of the arguments object; JSON calls are validated against it.
    arg: the parameter that the line syntax `NAME ARG` fills (None: the line form takes no argument).
  """
  name: str
  description: str = ""
  parameters: Mapping[str, Any] = dataclasses.field(
      default_factory=lambda: {"type": "object", "properties": {}})
  arg: str | None = None

  def __post_init__(self):
    if not re.fullmatch(r"[a-z_]+", self.name):
      raise ValueError(f"Tool.name={self.name!r}: lower-case letters and underscores only")
    if not isinstance(self.parameters, Mapping) or self.parameters.get("type") != "object":
      raise ValueError(f"Tool {self.name!r}: parameters must be a JSON schema of type 'object'")
    if self.arg is not None and self.arg not in self.parameters.get("properties", {}):
      raise ValueError(f"Tool {self.name!r}: arg={self.arg!r} is not one of its parameters "
                       f"{sorted(self.parameters.get('properties', {}))}")

  @classmethod
  def with_arg(cls, name: str, description: str, arg: str, arg_description: str = "",
               arg_type: str | list[str] = "string") -> "Tool":
    """A tool of one required argument (what every built-in tool takes)."""
    return cls(name, description, {"type": "object", "properties": {arg: {"type": arg_type,
                                                                          "description": arg_description}},
                                   "required": [arg]}, arg)

  def schema(self) -> dict[str, Any]:
    """The OpenAI-style function schema that `tokenizer.apply_chat_template(tools=...)` renders."""
    return {"type": "function", "function": {"name": self.name, "description": self.description,
                                             "parameters": _plain(self.parameters)}}


def _plain(value: Any) -> Any:
  """Mappings and tuples as dicts and lists (what json and jinja's tojson expect)."""
  if isinstance(value, Mapping):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def _typed(text: str, schema: Mapping[str, Any]) -> Any:
  """`text` as the JSON type `schema` asks for: kept a string when strings are allowed, else an int or float."""
  types = schema.get("type", "string")
  types = [types] if isinstance(types, str) else list(types)
  if "string" in types:
    return text
  for name, cast in (("integer", int), ("number", float)):
    if name in types:
      try:
        return cast(text)
      except ValueError:
        pass
  return text


_INT64 = (-(2 ** 63), 2 ** 63 - 1)


def _check_wire_ints(value: Any, tool: str) -> None:
  """JSON integers are unbounded; the env wire (msgpack) carries 64-bit ones. A bigger one is a bad argument."""
  if isinstance(value, bool):
    return
  if isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
    raise InvalidAction(f"bad arguments for {tool!r}: integer {str(value)[:24]}... does not fit in 64 bits")
  for v in (value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()):
    _check_wire_ints(v, tool)


ACTION_SYNTAXES = ("line", "json")
JSON_PARSER_VERSION = "json-v1"
JSON_ENVELOPE_CHARS = 128
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclasses.dataclass(frozen=True)
class ActionParser:
  """Turns the policy's action text into a `Call`. Two syntaxes, one per run (`syntax`):

  * `line` (default): `NAME ARG` on one line; short and regular on purpose, the default RL run teaches a ~1M
    parameter byte model this syntax.
  * `json`: a JSON function call `{"name": NAME, "arguments": {...}}` (`"parameters"` is accepted for
    `"arguments"`, as Llama 3 writes it; arguments may be a JSON-encoded string, as OpenAI writes it), bare or in
    `<tool_call>...</tool_call>` tags (Qwen/Hermes templates); one call per action. The arguments are validated
    against the tool's JSON schema (`jsonschema`).
  Malformed text raises `ParseError` (parser_rejected); an unknown tool or bad arguments raise `InvalidAction`
  (invalid_action): the invalid-action rule decides what follows, with the message as the error observation.

  Attributes:
    tools: `Tool`s, or bare names (a tool whose line argument is the string parameter "arg").
    version: recorded with checkpoints (a policy depends on it); `with_syntax("json")` sets `json-v1`.
  """
  tools: tuple[Tool | str, ...]
  max_chars: int = 256
  version: str = "line-v1"
  syntax: str = "line"

  def __post_init__(self):
    tools = tuple(t if isinstance(t, Tool) else Tool.with_arg(t, "", "arg") for t in self.tools)
    if len({t.name for t in tools}) != len(tools):
      raise ValueError(f"ActionParser: duplicate tool names in {[t.name for t in tools]}")
    object.__setattr__(self, "tools", tools)
    if self.syntax not in ACTION_SYNTAXES:
      raise ValueError(f"ActionParser.syntax={self.syntax!r}: not one of {ACTION_SYNTAXES}")

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(t.name for t in self.tools)

  def with_syntax(self, syntax: str) -> "ActionParser":
    if syntax == self.syntax:
      return self
    if syntax == "json":  # the JSON envelope and tags get room beyond the line form's limit (escapes double)
      return dataclasses.replace(self, syntax=syntax, version=JSON_PARSER_VERSION,
                                 max_chars=2 * self.max_chars + JSON_ENVELOPE_CHARS)
    raise ValueError(f"a {self.syntax} parser cannot be turned into a {syntax} one")

  def _tool(self, name: str) -> Tool:
    for tool in self.tools:
      if tool.name == name:
        return tool
    raise InvalidAction(f"unknown tool {name!r}; tools are {' '.join(self.names)}")

  def parse(self, text: str) -> Call:
    text = text.strip()
    if not text:
      raise ParseError("empty action")
    if len(text) > self.max_chars:
      raise ParseError(f"action of {len(text)} chars exceeds {self.max_chars}")
    return self._parse_json(text) if self.syntax == "json" else self._parse_line(text)

  def _parse_line(self, text: str) -> Call:
    if "\n" in text:
      raise ParseError("an action is one line")
    name, _, arg = text.partition(" ")
    if not re.fullmatch(r"[a-z_]+", name):
      raise ParseError(f"bad tool name {name[:20]!r}")
    self._tool(name)
    return Call(name, arg.strip())

  def _parse_json(self, text: str) -> Call:
    calls = _TOOL_CALL.findall(text)
    if len(calls) > 1:
      raise ParseError(f"one tool call per action, got {len(calls)}")
    if calls:
      text = calls[0].strip()
    elif "<tool_call>" in text:
      raise ParseError("<tool_call> without its closing </tool_call>")
    try:
      obj = json.loads(text)
    except json.JSONDecodeError as e:
      raise ParseError(f"malformed JSON tool call: {e.msg} (line {e.lineno}, column {e.colno}); expected "
                       '{"name": <tool>, "arguments": {...}}') from None
    if isinstance(obj, list) and len(obj) == 1:
      obj = obj[0]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
      raise ParseError('a tool call is a JSON object {"name": <tool>, "arguments": {...}}')
    tool = self._tool(obj["name"])
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
      try:
        arguments = json.loads(arguments) if arguments.strip() else {}
      except json.JSONDecodeError as e:
        raise ParseError(f"arguments of {tool.name!r}: a string that is not JSON ({e.msg})") from None
    if not isinstance(arguments, dict):
      raise InvalidAction(f"arguments of {tool.name!r} must be a JSON object, got {type(arguments).__name__}")
    import jsonschema  # pylint: disable=g-import-not-at-top  # only JSON-syntax runs need it
    errors = sorted(jsonschema.Draft202012Validator(_plain(tool.parameters)).iter_errors(arguments),
                    key=lambda e: list(map(str, e.absolute_path)))
    if errors:
      where = "/".join(map(str, errors[0].absolute_path)) or "arguments"
      raise InvalidAction(f"bad arguments for {tool.name!r}: {where}: {errors[0].message}")
    _check_wire_ints(arguments, tool.name)
    value = arguments.get(tool.arg, "") if tool.arg else ""
    arg = value if isinstance(value, str) else json.dumps(value)
    return Call(tool.name, arg, arguments)

  def format(self, call: Call) -> str:
    """The action text of `call` in this parser's syntax (scripted demonstrations are written as lines); a line
    argument becomes the JSON type its schema asks for (a tool whose `arg` is an integer gets 7, not "7")."""
    tool = self._tool(call.name)
    if self.syntax == "line":
      return f"{call.name} {call.arg}".rstrip() if tool.arg else call.name
    if call.arguments:
      arguments = dict(call.arguments)
    elif tool.arg:
      arguments = {tool.arg: _typed(call.arg, tool.parameters["properties"][tool.arg])}
    elif call.arg:
      raise InvalidAction(f"tool {call.name!r} takes no argument, got {call.arg!r}")
    else:
      arguments = {}
    return json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class InvalidActionRule:
  """What happens to an action the parser or env rejects (docs/design.md §2.3); recorded in the step's info.

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
      return StepResult(Observation(text, False, len(text.encode())), {"validity": 0.0}, True, kind, info)
    validity = -self.penalty if self.rule == "penalty" else 0.0
    continued = (Outcome.PARSER_REJECTED_CONTINUED if kind is PARSER_REJECTED else
                 Outcome.INVALID_ACTION_CONTINUED)
    return StepResult(Observation(text, False, len(text.encode())), {"validity": validity}, False, None, info,
                      outcome=continued)


# ----------------------------------------------------------------------------------------------
# Env and verifier.


class Verifier(abc.ABC):
  """Scores an outcome; versioned separately from the env that produced it."""

  version: str = "0"

  @abc.abstractmethod
  def score(self, task: Task, final: Any) -> Verdict:
    """Args: task; final: what the episode produced (an answer string, a directory...)."""

  def verify(self, task: Task, final: Any) -> Verdict:
    """`score`, timed: the verdict carries the verifier's wall time in `seconds` (recorded as T_verify)."""
    start = time.perf_counter()
    verdict = self.score(task, final)
    return dataclasses.replace(verdict, seconds=time.perf_counter() - start)


class Env(abc.ABC):
  """One episode at a time. Subclasses implement `_reset` and `_step`; the base class enforces turn limits,
  the invalid-action rule and observation caps, and turns `EnvError` into `env_error`.
  """

  name: str = "env"
  description: str = ""
  parser: ActionParser
  verifier: Verifier | None = None  # set by envs that score their episodes
  # How the programs an action runs are confined (`envs._sandbox` modes: bwrap, none, auto); the worker that
  # hosts the env sets it (`envs.server --episode-sandbox`). Envs that run programs give it to EpisodeSandbox.
  episode_sandbox: str = "auto"

  def versions(self) -> dict[str, str]:
    """What a policy trained here depends on besides the env's code: its action parser and verifier versions."""
    return {"parser": str(self.parser.version), "verifier": "" if self.verifier is None else str(self.verifier.version)}

  def __init__(self, *, max_turns: int = 8, invalid_action: InvalidActionRule = InvalidActionRule(),
               max_obs_bytes: int = 4096, action_syntax: str | None = None):
    if max_turns < 1:
      raise ValueError(f"max_turns={max_turns}: must be >= 1")
    if max_obs_bytes < 16:
      raise ValueError(f"max_obs_bytes={max_obs_bytes}: must be >= 16")
    self.max_turns = max_turns
    self.invalid_action = invalid_action
    self.max_obs_bytes = max_obs_bytes
    if action_syntax is not None:  # None: the class's parser as declared
      if action_syntax not in ACTION_SYNTAXES:
        raise ValueError(f"action_syntax={action_syntax!r}: not one of {ACTION_SYNTAXES}")
      self.parser = self.parser.with_syntax(action_syntax)  # the class's parser, in this episode's syntax
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
    call: Call | None = None
    try:
      call = self.parser.parse(action_text)
      result = self._step(call)
    except (ParseError, InvalidAction) as e:
      result = self.invalid_action.apply(e)
    except EnvError as e:
      result = StepResult(Observation.capped(f"env error: {e}", self.max_obs_bytes), {}, True, ENV_ERROR,
                          dict(error=str(e)))
    if not result.done and self.turn >= self.max_turns:
      result = dataclasses.replace(result, done=True, termination=MAX_TURNS, outcome=Outcome.MAX_TURNS)
    obs = result.observation
    if len(obs.text.encode("utf-8", errors="replace")) > self.max_obs_bytes:
      capped = Observation.capped(obs.text, self.max_obs_bytes)
      obs = dataclasses.replace(capped, original_size=max(capped.original_size, obs.original_size))
    self.done = result.done
    return dataclasses.replace(result, observation=obs, info={**info, **result.info}, call=call)


# ----------------------------------------------------------------------------------------------
# Versions.

# The version of the contract every env runs under (`Env.step`'s invalid-action rule, turn and observation caps,
# what a termination means). An env's version is its own source plus this number, not the source of this file:
# editing a docstring here changes no env's version. Bump it when a change here changes what any env does for the
# same actions; every env's version changes with it, and resuming a run refuses (docs/design.md §2.8) unless
# `train.allow_env_change` (recorded in the checkpoint).
ENV_API_VERSION = 1


def source_version(*objs: Any, data: Iterable[Path] = (), extra: str = "") -> str:
  """A short hash of the source files defining `objs`, the files in `data` and `extra`.

  Independent of where the files are (a worker sees envs/ and user packages at other paths than the trainer):
  each file counts by its name and contents, in that order.
  """
  h = hashlib.sha256()
  paths = {inspect.getsourcefile(o) for o in objs} | {str(Path(p)) for p in data}
  files = sorted((Path(f).name, Path(f).read_bytes()) for f in paths)
  for name, body in files:
    h.update(name.encode())
    h.update(body)
  h.update(extra.encode())
  return h.hexdigest()[:12]


class EnvAPIError(TypeError):
  """An `EnvSpec` whose functions cannot be called the way the trainer calls them (e.g. written for an older API)."""


# How the trainer calls an EnvSpec's functions: (attribute, positional args, keyword args, the expected signature).
_CALLS = (
    ("make", (), {"max_turns": 1}, "make(**kwargs) -> Env (the trainer passes max_turns and env.options)"),
    ("tasks", ("train", 1, 0), {}, "tasks(split, n, seed, **options) -> list[Task]"),
    ("demo", (None, 0), {}, "demo(task, seed, **options) -> list[str]"),
    ("describe", (None,), {}, "describe(task) -> str"),
)
# What changed in the API, by function, for the error a stale user env gets.
_CHANGES = {"demo": "demo gained the episode's `seed` after `task` (a seeded env, like guess, needs it to solve "
                    "the task it was reset with): add it, e.g. `def demo(task, seed, **options)`"}


def _check_callable(name: str, attr: str, fn: Any, args: tuple, kwargs: dict, expected: str) -> None:
  if not callable(fn):
    raise EnvAPIError(f"EnvSpec {name!r}: {attr} is {type(fn).__name__!r}, not a function; expected {expected}")
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # a builtin or C callable: nothing to check
    return
  try:
    signature.bind(*args, **kwargs)
  except TypeError as e:
    hint = f"; {_CHANGES[attr]}" if attr in _CHANGES else ""
    where = getattr(fn, "__qualname__", attr)
    raise EnvAPIError(f"EnvSpec {name!r}: {attr} = {where}{signature} cannot be called as {expected} ({e})"
                      f"{hint}") from None


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """A registered environment.

  Attributes:
    name: registry name.
    description: one line.
    make: `make(**kwargs) -> Env`.
    tasks: `tasks(split, n, seed) -> list[Task]` (deterministic).
    demo: `demo(task, seed, **options) -> list[str]`, scripted actions that solve `task` reset with `seed`
      (behavior cloning; `options` are the config's `env.demo_options`).
    version_sources: objects whose source files define the version.
    deterministic: replay with the same seed and actions gives the same observations.
    needs_sandbox: actions run real programs (terminal, code repair).
    describe: `describe(task) -> str`, the task as a person would compare two of them (near-duplicate checks
      between splits); None: the payload as `key=value` lines, which suits payloads of text and numbers.
  """
  name: str
  description: str
  make: Callable[..., Env]
  tasks: Callable[[str, int, int], list[Task]]
  demo: Callable[..., list[str]]
  version_sources: tuple[Any, ...] = ()
  data_files: tuple[Path, ...] = ()
  deterministic: bool = True
  needs_sandbox: bool = False
  describe: Callable[[Task], str] | None = None

  def __post_init__(self):
    for attr, args, kwargs, expected in _CALLS:
      fn = getattr(self, attr)
      if fn is None and attr == "describe":
        continue
      _check_callable(self.name, attr, fn, args, kwargs, expected)

  @property
  def version(self) -> str:
    """The env's own source files (`version_sources`, else `make`'s), its data files and `ENV_API_VERSION`."""
    return source_version(*(self.version_sources or (self.make,)), data=self.data_files,
                          extra=f"env-api-{ENV_API_VERSION}")
