"""Actions: tools and their schemas, the action parser (line `NAME ARG` or JSON function calls), and the
invalid-action rule. Part of the env API (`envs/_api.py` re-exports every name).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping

from envs._vocabulary import INVALID_ACTION, INVALID_ACTION_RULES, PARSER_REJECTED, Outcome
from envs._wire import Call, Observation, StepResult



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
    arg: the parameter that the line syntax `NAME ARG` fills (None: the line form takes no argument), and that
      `Call.arg` holds whichever syntax the call came in.
    keywords: the line form is `NAME key=value key=value ...` (a tool of several typed parameters): each value is
      a JSON literal (`"two words"`, `"a\\nb"`, `3`, `[1, 2]`) or a bare word typed by the schema (`7` for an
      integer, `toolz/dicttoolz.py` for a string); the arguments are validated against the schema as JSON calls
      are, and `Call.arguments` holds them in both syntaxes.
  """
  name: str
  description: str = ""
  parameters: Mapping[str, Any] = dataclasses.field(
      default_factory=lambda: {"type": "object", "properties": {}})
  arg: str | None = None
  keywords: bool = False

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

  @classmethod
  def with_params(cls, name: str, description: str, params: Mapping[str, tuple[str | list[str], str]],
                  required: tuple[str, ...] = (), arg: str | None = None) -> "Tool":
    """A tool of several typed parameters {name: (JSON type, description)} and the keyword line form."""
    return cls(name, description, {"type": "object", "properties": {
        k: {"type": t, "description": d} for k, (t, d) in params.items()}, "required": list(required),
        "additionalProperties": False}, arg, keywords=True)

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


_BARE = re.compile(r"[^\s\"\[{]\S*")
_KEY = re.compile(r"([a-z_][a-z0-9_]*)=")


def parse_keywords(text: str, tool: Tool) -> dict[str, Any]:
  """`key=value key=value ...` (see `Tool.keywords`) as an arguments object; ParseError names the position."""
  out: dict[str, Any] = {}
  props = tool.parameters.get("properties", {})
  decoder, i = json.JSONDecoder(), 0
  while True:
    while i < len(text) and text[i] == " ":
      i += 1
    if i == len(text):
      return out
    key = _KEY.match(text, i)
    if key is None:
      raise ParseError(f"{tool.name}: expected key=value at column {i + 1}, got {text[i:i + 20]!r}; keys are "
                       f"{' '.join(props)}")
    name, i = key.group(1), key.end()
    if name in out:
      raise ParseError(f"{tool.name}: {name}= given twice")
    if i < len(text) and text[i] in "\"[{":
      try:
        value, i = decoder.raw_decode(text, i)
      except json.JSONDecodeError as e:
        raise ParseError(f"{tool.name}: {name}= is not a JSON value ({e.msg} at column {e.pos + 1})") from None
    else:
      bare = _BARE.match(text, i)
      word = bare.group(0) if bare else ""
      i += len(word)
      value = _typed(word, props.get(name, {})) if word else ""
    if i < len(text) and text[i] != " ":
      raise ParseError(f"{tool.name}: expected a space after {name}= at column {i + 1}")
    out[name] = value


def format_keywords(arguments: Mapping[str, Any]) -> str:
  """The keyword line form of `arguments` (strings bare when they read back as themselves)."""
  parts = []
  for k, v in arguments.items():
    bare = isinstance(v, str) and _BARE.fullmatch(v) and not re.fullmatch(r"-?[\d.]+(e-?\d+)?|true|false|null", v)
    parts.append(f"{k}={v if bare else json.dumps(v, ensure_ascii=False)}")
  return " ".join(parts)


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
    free_text: the env takes any text as an action (an agent over the gateway: a reply without a tool call is
      its answer), so its scripted actions are written as the model's replies, not as `NAME ARG` lines.
  """
  tools: tuple[Tool | str, ...]
  max_chars: int = 256
  version: str = "line-v1"
  syntax: str = "line"
  free_text: bool = False

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
    tool = self._tool(name)
    if tool.keywords:
      return self._checked(tool, parse_keywords(arg, tool))
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
    return self._checked(tool, arguments)

  def _checked(self, tool: Tool, arguments: dict[str, Any]) -> Call:
    """The call of `tool` with `arguments` validated against its schema."""
    import jsonschema  # only JSON-syntax runs need it
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
    if self.syntax == "line" and tool.keywords:
      return f"{call.name} {format_keywords(call.arguments)}".rstrip()
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


