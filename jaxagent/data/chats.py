"""OpenAI-style chat data -> trajectories in the run's own framing, for supervised fine-tuning (`paradigm: sft`).

One JSON object per line of a JSONL file:

    {"id": "optional", "messages": [
      {"role": "system", "content": "..."},                              optional, see below
      {"role": "user", "content": "What is 12*7?"},                      the task's first observation
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
          "function": {"name": "calc", "arguments": "{\\"expression\\": \\"12*7\\"}"}}]},
      {"role": "tool", "tool_call_id": "...", "content": "84"},
      {"role": "assistant", "tool_calls": [... "answer" ...]}]}

A chat is framed exactly as the rollout engine frames an episode (`ChatFormat`): the first user message is the
prompt, each assistant message one action, each tool message the observation after it (cut to
`rollout.max_observation_tokens` as rollouts cut it). So supervised data trains the policy on the token
sequences it will see and produce when it acts. Consequences, each a rule:

* The run's framing owns the system prompt and the tool schemas (`model.system_prompt`, the env's tools), as in
  rollouts. A `system` message is not used; the number dropped is reported. The line's own `tools` are ignored.
* An assistant message is one action: exactly one tool call, formatted in the run's action syntax after the
  env's parser has validated it against the tool's schema (an unknown tool or bad arguments is an error naming
  the line), or a `content` text that the env's parser accepts as an action as it stands. Both at once,
  several calls, or prose the parser refuses is an error: the env takes one action per turn, and an action it
  would refuse is not a target.
* Only assistant tokens carry loss (role POLICY, `loss_mask` 1); prompt, framing and tool tokens never do.
  Their behavior log-probs are recorded as 0 (no policy sampled them) and their policy version as -1, as for
  scripted demonstrations.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import envs
from jaxagent import trajectory as tr
from jaxagent.chat import ChatFormat

SOURCE = "chat_data"


class ChatDataError(ValueError):
  """A chat line cannot be used; the message names the file, line and message."""


@dataclasses.dataclass(frozen=True)
class ChatData:
  """The trajectories of a chat file and what was left out of them."""
  trajectories: list[tr.Trajectory]
  system_messages_dropped: int
  observations_truncated: int


def _action_text(message: Mapping[str, Any], parser: envs.ActionParser, json_parser: envs.ActionParser,
                 where: str) -> tuple[str, Any]:
  calls = message.get("tool_calls") or []
  content = message.get("content") or ""
  if not isinstance(content, str):
    raise ChatDataError(f"{where}: content must be a string, got {type(content).__name__}")
  if not isinstance(calls, list):
    raise ChatDataError(f"{where}: tool_calls must be a list")
  if len(calls) > 1:
    raise ChatDataError(f"{where}: {len(calls)} tool calls in one message; the env takes one action per turn")
  if calls and content.strip():
    raise ChatDataError(f"{where}: both content {content[:40]!r} and a tool call; an action is one tool call or "
                        "one text (put the text in a message of its own, or drop it)")
  if not calls:
    if not content.strip():
      raise ChatDataError(f"{where}: an assistant message with neither content nor a tool call")
    try:
      parsed = parser.parse(content)
    except (envs.ParseError, envs.InvalidAction) as e:
      raise ChatDataError(f"{where}: content {content[:60]!r} is not an action the env's parser accepts ({e}); "
                          "the policy would be trained on an action the env refuses") from None
    return content, parsed.to_wire()
  call = calls[0]
  function = call.get("function") if isinstance(call, Mapping) else None
  if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
    raise ChatDataError(f"{where}: a tool call is {{'type': 'function', 'function': {{'name': ..., "
                        f"'arguments': ...}}}}, got {call!r}"[:300])
  try:
    parsed = json_parser.parse(json.dumps({"name": function["name"], "arguments": function.get("arguments", {})}))
    return parser.format(parsed), parsed.to_wire()
  except (envs.ParseError, envs.InvalidAction) as e:
    raise ChatDataError(f"{where}: the env's parser refuses the tool call: {e}") from None


def chat_trajectory(messages: Sequence[Mapping[str, Any]], chat: ChatFormat, parser: envs.ActionParser, *,
                    chat_id: str, where: str = "chat") -> tuple[tr.Trajectory, int, int]:
  """One chat as a trajectory framed by `chat`, actions in `parser`'s syntax. Returns it, the number of system
  messages left out and of tool replies cut to the observation budget. Raises `ChatDataError` naming `where`
  and the message index."""
  if not isinstance(messages, (list, tuple)) or not messages:
    raise ChatDataError(f"{where}: 'messages' must be a non-empty list")
  json_parser = parser if parser.syntax == "json" else parser.with_syntax("json")
  roles = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or m.get("role") not in ("system", "user", "assistant", "tool"):
      raise ChatDataError(f"{where}: message {i}: role must be system, user, assistant or tool, got "
                          f"{(m.get('role') if isinstance(m, Mapping) else m)!r}")
    roles.append(m["role"])
  system = sum(r == "system" for r in roles)
  body = [(i, m) for i, m in enumerate(messages) if m["role"] != "system"]
  if not body or body[0][1]["role"] != "user" or sum(r == "user" for r in roles) != 1:
    raise ChatDataError(f"{where}: a chat is one user message (the task), then assistant actions and tool "
                        f"replies; got roles {roles}")
  user = body[0][1].get("content")
  if not isinstance(user, str):
    raise ChatDataError(f"{where}: message {body[0][0]}: the user content must be a string")
  stream = chat.prompt(user)
  turns: list[tr.Turn] = []
  truncated = 0
  rest = body[1:]
  k = 0
  while k < len(rest):
    i, m = rest[k]
    if m["role"] != "assistant":
      raise ChatDataError(f"{where}: message {i}: a {m['role']} message where an assistant action belongs "
                          "(each tool reply follows one assistant action)")
    text, parsed = _action_text(m, parser, json_parser, f"{where}: message {i}")
    tokens = chat.action_tokens(text)
    span = stream.sampled(tokens, [0.0] * len(tokens), role=tr.Role.POLICY)
    observation = None
    if k + 1 < len(rest) and rest[k + 1][1]["role"] == "tool":
      j, reply = rest[k + 1]
      content = reply.get("content")
      if not isinstance(content, str):
        raise ChatDataError(f"{where}: message {j}: tool content must be a string")
      frame = chat.observation(content, tr.Role.TOOL, after=tokens)
      start, _ = stream.extend(frame.stream)
      body_span = (start + frame.body[0], start + frame.body[1])
      observation = tr.ObservationRecord(span=body_span, text=content, truncated=frame.truncated,
                                         original_bytes=len(content.encode()))
      truncated += frame.truncated
      k += 1
    elif k + 1 < len(rest):
      raise ChatDataError(f"{where}: message {rest[k + 1][0]}: two assistant messages in a row (an action is "
                          "followed by its tool reply)")
    turns.append(tr.Turn(action=tr.Action(span=span, text=text, parsed=parsed), observation=observation,
                         policy_version=-1))
    k += 1
  if not turns:
    raise ChatDataError(f"{where}: no assistant message: nothing to learn")
  version = hashlib.sha256(json.dumps(list(messages), sort_keys=True, default=str).encode()).hexdigest()[:16]
  trajectory = tr.Trajectory(
      task=tr.TaskRecord(id=chat_id, split="train", version=version), env=tr.EnvInfo(name=SOURCE, version="", seed=0),
      policy_version=-1, termination=envs.Termination.COMPLETED, reward=tr.Reward(total=0.0), turns=tuple(turns),
      id=chat_id, metadata={"source": SOURCE}, **stream.arrays())
  return trajectory, system, truncated


def read_chats(path: str | Path, chat: ChatFormat, parser: envs.ActionParser) -> ChatData:
  """Every chat of a JSONL file as a trajectory (see the module docstring). Raises `ChatDataError` at the first
  unusable line, naming it: a training set with a silently skipped line is not the set the user wrote."""
  path = Path(path)
  try:
    lines = path.read_text().splitlines()
  except OSError as e:
    raise ChatDataError(f"{path}: {e.strerror or e}") from None
  except UnicodeDecodeError as e:
    raise ChatDataError(f"{path}: not UTF-8 text (byte {e.start}); a chat file is JSON lines") from None
  out, system, truncated = [], 0, 0
  for n, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    where = f"{path}:{n}"
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise ChatDataError(f"{where}: not JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(obj, Mapping) or "messages" not in obj:
      raise ChatDataError(f"{where}: expected an object with 'messages' (OpenAI chat format)")
    chat_id = str(obj.get("id") or f"{path.name}:{n}")
    t, dropped, cut = chat_trajectory(obj["messages"], chat, parser, chat_id=chat_id, where=where)
    out.append(dataclasses.replace(t, metadata={**t.metadata, "file": str(path), "line": n}))
    system += dropped
    truncated += cut
  if not out:
    raise ChatDataError(f"{path}: no chat in the file")
  return ChatData(out, system, truncated)


def is_chat_file(path: str | Path) -> bool:
  """A JSONL chat file (by its suffix) rather than stored trajectories."""
  return Path(path).suffix in (".jsonl", ".json")
