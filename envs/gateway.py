"""Bring your agent: an agent written against an OpenAI-style chat API, trained as an env.

    def agent(task, client):                      # client: an `openai.OpenAI`
      messages = [{"role": "user", "content": task.payload["question"]}]
      reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
      ...                                          # run tools, append messages, call again
      return answer                                # or a reward (a float)

    SPEC = envs.agent_spec("calc-agent", agent=agent, tasks=tasks, tools=TOOLS_AS_ENVS_TOOLS, verifier=...)

The env worker runs `agent(task, client)` in a thread for each episode; `client` talks to a gateway this module
serves on the worker's own loopback (inside its sandbox, so no path to the trainer is needed), at
`POST /v1/chat/completions` (non-streaming; `messages`, `tools`, `tool_choice`, `temperature`, `top_p`,
`max_tokens` accepted). The gateway turns the agent's calls into the env protocol:

  agent's first request  -> the episode's first observation (its user message; its system message, if any,
                            replaces the configured one in the prompt the engine renders)
  the policy's action    -> the reply to the pending request (text, or a tool call parsed from the template's
                            convention: `<tool_call>{json}</tool_call>` or bare JSON)
  agent's next request   -> the next observation, when it EXTENDS the record: its messages are the previous
                            request's, then the reply served (content and tool calls equal), then exactly one
                            new tool message, whose text is the observation (mask 0). The engine frames it
                            with the chat template's token deltas: the sampled tokens stay as sampled.
  anything else          -> a recorded break: the request gets HTTP 409 naming what differs, the episode ends
                            as env_error with outcome `history_rewritten` (an infrastructure end: counted, stored,
                            never trained on). Nothing is learned from re-rendered history.
  the agent returns      -> the episode is completed: a float/int is the reward, anything else is scored by the
                            spec's verifier.
  the agent raises       -> env_error with its message; a malformed request gets HTTP 400 and the episode waits
                            for a good one (until `agent_timeout_s`).

Sampling is the run's (`rollout.temperature`, `top_p`, `max_new_tokens`): a request's own values are accepted
and not applied, since training needs the behaviour policy the run records. Each episode's requests carry its
own key (`api_key`); a request from an earlier episode's agent gets 401.

Plain Python (stdlib + `openai` in the worker, for the client handed to the agent).
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import queue
import threading
import time
import uuid
from typing import Any, Callable, Sequence

from envs._api import Env, EnvSpec, Verifier
from envs._tools import _TOOL_CALL, ActionParser, Tool
from envs._vocabulary import COMPLETED, ENV_ERROR, EnvError, Outcome
from envs._wire import Call, Observation, StepResult, Task, Verdict

GATEWAY_VERSION = "gateway-v1"  # the request/extension rules above: part of every agent env's version
ROLES = ("system", "user", "assistant", "tool")


class RequestError(ValueError):
  """A request the gateway answers with an HTTP error (`status`) and `message`, in OpenAI's error shape."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


# ----------------------------------------------------------------------------------------------
# Messages: what a request carries, normalised for the extension check.


def _text(content: Any, where: str) -> str:
  """A message's content as text: a string, None (""), or a list of `{"type": "text", "text": ...}` parts."""
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in content):
    return "".join(p["text"] for p in content)
  raise RequestError(400, f"{where}.content: expected a string or a list of text parts, got "
                          f"{json.dumps(content)[:80]}")


def _calls(tool_calls: Any, where: str) -> tuple[tuple[str, str], ...]:
  """An assistant message's tool calls as (name, canonical JSON arguments) pairs (ids and order of keys aside)."""
  if not tool_calls:
    return ()
  if not isinstance(tool_calls, list):
    raise RequestError(400, f"{where}.tool_calls: expected a list")
  out = []
  for i, call in enumerate(tool_calls):
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
      raise RequestError(400, f"{where}.tool_calls[{i}]: expected {{'type': 'function', 'function': "
                              f"{{'name': ..., 'arguments': ...}}}}")
    arguments = fn.get("arguments", "{}")
    try:
      arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
      pass  # compared as the string it is
    out.append((fn["name"], json.dumps(arguments, sort_keys=True)))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Message:
  """One chat message as the extension check compares it: role, text and tool calls."""
  role: str
  text: str
  calls: tuple[tuple[str, str], ...] = ()

  @classmethod
  def of(cls, m: Any, where: str) -> "Message":
    if not isinstance(m, dict):
      raise RequestError(400, f"{where}: expected an object with 'role' and 'content'")
    role = m.get("role")
    if role not in ROLES:
      raise RequestError(400, f"{where}.role={role!r}: not one of {ROLES}")
    return cls(role, _text(m.get("content"), where), _calls(m.get("tool_calls"), where))


@dataclasses.dataclass(frozen=True)
class ChatRequest:
  """A validated `POST /v1/chat/completions` body."""
  messages: tuple[Message, ...]
  tools: tuple[str, ...]  # canonical JSON of each function schema
  model: str

  @classmethod
  def parse(cls, body: bytes) -> "ChatRequest":
    try:
      req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise RequestError(400, f"the body is not JSON: {e}") from None
    if not isinstance(req, dict):
      raise RequestError(400, "the body must be a JSON object")
    if req.get("stream"):
      raise RequestError(400, "stream=true is not supported: the gateway answers whole completions")
    if req.get("n", 1) != 1:
      raise RequestError(400, f"n={req.get('n')!r}: one choice per request (the episode has one policy)")
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
      raise RequestError(400, "'messages' must be a non-empty list")
    tools = req.get("tools") or []
    if not isinstance(tools, list):
      raise RequestError(400, "'tools' must be a list of function schemas")
    return cls(tuple(Message.of(m, f"messages[{i}]") for i, m in enumerate(messages)),
               tuple(_canonical_tool(t, i) for i, t in enumerate(tools)), str(req.get("model", "")))


def _canonical_tool(tool: Any, i: int) -> str:
  fn = tool.get("function") if isinstance(tool, dict) else None
  if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
    raise RequestError(400, f"tools[{i}]: expected {{'type': 'function', 'function': {{'name', 'parameters'}}}}")
  return json.dumps({"name": fn["name"], "parameters": fn.get("parameters", {})}, sort_keys=True)


def reply_message(text: str, tool_names: Sequence[str]) -> Message:
  """The assistant message the policy's action text is: one tool call when it holds one of `tool_names` in the
  template's convention (`<tool_call>{"name", "arguments"}</tool_call>`, or the whole text as that JSON), with
  the text around it as content; else the text as content."""
  tagged = _TOOL_CALL.findall(text)
  body = tagged[0].strip() if len(tagged) == 1 else text.strip()
  try:
    obj = json.loads(body)
  except json.JSONDecodeError:
    obj = None
  if isinstance(obj, dict) and obj.get("name") in tool_names:
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
      try:
        arguments = json.loads(arguments)
      except json.JSONDecodeError:
        pass
    content = _TOOL_CALL.sub("", text).strip() if tagged else ""
    return Message("assistant", content, ((obj["name"], json.dumps(arguments, sort_keys=True)),))
  return Message("assistant", text)


def completion(message: Message, request_id: str, model: str) -> dict[str, Any]:
  """The `chat.completion` object that answers a request with `message`."""
  calls = [{"id": f"call_{request_id}_{i}", "type": "function",
            "function": {"name": name, "arguments": arguments}} for i, (name, arguments) in enumerate(message.calls)]
  body: dict[str, Any] = {"role": "assistant", "content": message.text or (None if calls else "")}
  if calls:
    body["tool_calls"] = calls
  return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()), "model": model,
          "choices": [{"index": 0, "message": body, "finish_reason": "tool_calls" if calls else "stop",
                       "logprobs": None}]}


def extension(served: Sequence[Message], request: ChatRequest) -> Message | str:
  """The one new tool message `request` appends to `served` (the history so far, the last reply included), or
  why it does not extend it (a break)."""
  got = request.messages
  if len(got) < len(served) or tuple(got[:len(served)]) != tuple(served):
    k = next((i for i, (a, b) in enumerate(zip(served, got)) if a != b), min(len(served), len(got)))
    what = (f"message {k} differs from the one served" if k < min(len(served), len(got)) else
            f"{len(got)} messages do not hold the {len(served)} served")
    return f"the history was rewritten: {what}"
  new = got[len(served):]
  if len(new) != 1 or new[0].role != "tool":
    roles = [m.role for m in new]
    return f"a request must add exactly one tool message to the history served (it added {roles})"
  return new[0]


# ----------------------------------------------------------------------------------------------
# The gateway: one HTTP server per env instance, one episode at a time.


@dataclasses.dataclass
class _Pending:
  """A request waiting for the policy: the env answers it by putting (status, body) in `answer`."""
  request: ChatRequest
  id: str
  answer: "queue.Queue[tuple[int, dict]]" = dataclasses.field(default_factory=lambda: queue.Queue(maxsize=1))


class _Episode:
  """The rendezvous of one episode's agent thread and the env: events in the order they happened."""

  def __init__(self):
    self.key = uuid.uuid4().hex
    self.events: "queue.Queue[tuple[str, Any]]" = queue.Queue()  # ("request", _Pending) | ("returned", v) | ("raised", e)
    self.pending: _Pending | None = None
    self.requests = 0
    self.over = False


def _error(status: int, message: str) -> tuple[int, dict]:
  kind = "invalid_request_error" if status == 400 else "conflict" if status == 409 else "authentication_error"
  return status, {"error": {"message": message, "type": kind, "code": status}}


class Gateway:
  """`POST /v1/chat/completions` on 127.0.0.1 (an ephemeral port), routed to the current episode by its key."""

  def __init__(self, answer_timeout_s: float):
    self.episode: _Episode | None = None
    self.answer_timeout_s = answer_timeout_s
    self.lock = threading.Lock()
    gateway = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"
      # Headers and body go out in two writes: with Nagle's algorithm the body waits for the client's delayed
      # ACK (~40 ms per call, measured with bench/gateway.py).
      disable_nagle_algorithm = True

      def log_message(self, *args):  # quiet: errors go to the agent in the response
        pass

      def do_GET(self):
        self._send(*_error(404, f"GET {self.path}: only POST /v1/chat/completions is served"))

      def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        key = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        self._send(*gateway.handle(self.path, key, body))

      def _send(self, status: int, payload: dict):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.server.daemon_threads = True
    self.port = self.server.server_address[1]
    threading.Thread(target=self.server.serve_forever, name="agent-gateway", daemon=True).start()

  @property
  def base_url(self) -> str:
    return f"http://127.0.0.1:{self.port}/v1"

  def handle(self, path: str, key: str, body: bytes) -> tuple[int, dict]:
    if path.rstrip("/") != "/v1/chat/completions":
      return _error(404, f"POST {path}: only /v1/chat/completions is served")
    with self.lock:
      ep = self.episode
      if ep is None or key != ep.key or ep.over:
        return _error(401, "this key is not the current episode's (an earlier episode's agent is still running?)")
      try:
        request = ChatRequest.parse(body)
      except RequestError as e:
        return _error(e.status, str(e))
      if ep.pending is not None:
        return _error(409, "one request at a time per episode: the previous one is not answered yet")
      ep.requests += 1
      pending = ep.pending = _Pending(request, f"{ep.key[:8]}-{ep.requests}")
      ep.events.put(("request", pending))
    try:
      return pending.answer.get(timeout=self.answer_timeout_s)
    except queue.Empty:
      return _error(504, f"the policy did not answer within {self.answer_timeout_s:g} s")

  def close(self) -> None:
    self.server.shutdown()
    self.server.server_close()


# ----------------------------------------------------------------------------------------------
# The env.


class AgentEnv(Env):
  """An agent callable played as an env through the gateway (see the module docstring).

  Args:
    agent: `agent(task, client) -> reward (float) or final answer (scored by `verifier`)`.
    tools: the tools the agent offers the model (`Tool`s): the chat template renders them into the prompt, and
      each request's `tools` must be these (by name and parameters).
    verifier: scores a non-numeric return value; None: the agent must return a number.
    agent_timeout_s: how long the env waits for the agent's next call (or its return) before env_error.
  """

  name = "agent"

  def __init__(self, agent: Callable[[Task, Any], Any], tools: Sequence[Tool] = (), verifier: Verifier | None = None,
               agent_timeout_s: float = 60.0, **kwargs):
    self.parser = ActionParser(tools=tuple(tools), version=GATEWAY_VERSION, free_text=True)  # any text: a reply
    super().__init__(**{k: v for k, v in kwargs.items() if k != "action_syntax"})
    self.agent = agent
    self.verifier = verifier
    self.agent_timeout_s = float(agent_timeout_s)
    self.tools = tuple(_canonical_tool(t.schema(), i) for i, t in enumerate(self.parser.tools))
    self.gateway: Gateway | None = None
    self.episode: _Episode | None = None
    self.served: list[Message] = []

  # -- the agent's thread

  def _start(self, task: Task) -> _Episode:
    try:
      import openai
    except ImportError as e:
      raise EnvError(f"an agent env's worker needs the `openai` package (pip install 'jaxagent[agent]'): {e}")
    if self.gateway is None:
      self.gateway = Gateway(answer_timeout_s=self.agent_timeout_s)
    ep = _Episode()
    client = openai.OpenAI(base_url=self.gateway.base_url, api_key=ep.key, max_retries=0,
                           timeout=self.agent_timeout_s)

    def run():
      try:
        ep.events.put(("returned", self.agent(task, client)))
      except BaseException as e:  # the agent's own failure: the episode's env_error
        ep.events.put(("raised", e))

    with self.gateway.lock:
      self.gateway.episode = ep
    threading.Thread(target=run, name=f"agent-{ep.key[:8]}", daemon=True).start()
    return ep

  def _next(self) -> tuple[str, Any]:
    try:
      return self.episode.events.get(timeout=self.agent_timeout_s)
    except queue.Empty:
      raise EnvError(f"the agent neither called the model nor returned within {self.agent_timeout_s:g} s "
                     f"(agent_spec(agent_timeout_s=...))") from None

  def _answer(self, status: int, body: dict) -> None:
    pending, self.episode.pending = self.episode.pending, None
    pending.answer.put((status, body))

  def _stop(self) -> None:
    """Ends the current episode: its agent's later requests get 401, a pending one a 409."""
    if self.episode is None:
      return
    with self.gateway.lock:
      self.episode.over = True
      if self.episode.pending is not None:
        self._answer(*_error(409, "the episode is over"))

  # -- the env protocol

  def _check_request(self, request: ChatRequest) -> str | None:
    if request.tools != self.tools:
      names = lambda tools: [json.loads(t)["name"] for t in tools]
      return (f"tools differ from the env's (the prompt the policy sees renders the env's): the env has "
              f"{names(self.tools)}, the request {names(request.tools)} (or their parameters differ)")
    return None

  def reset(self, task: Task, seed: int) -> Observation:
    obs = super().reset(task, seed)
    system = self.served[0].text if self.served[0].role == "system" else None
    return dataclasses.replace(obs, system=system)

  def _reset(self, task: Task, seed: int) -> str:
    self._stop()
    self.episode, self.served = self._start(task), []
    while True:
      kind, value = self._next()
      if kind == "raised":
        raise EnvError(f"the agent raised before its first model call: {type(value).__name__}: {value}")
      if kind == "returned":
        raise EnvError(f"the agent returned {value!r} before calling the model")
      roles = [m.role for m in value.request.messages]
      problem = self._check_request(value.request)
      if problem is None and roles not in (["user"], ["system", "user"]):
        problem = f"the first request's messages must be [system,] user; got {roles}"
      if problem is None:
        self.served = list(value.request.messages)
        return self.served[-1].text
      with self.gateway.lock:
        self._answer(*_error(400, problem))  # the agent may fix it and call again

  def _parse(self, action_text: str) -> Call:
    message = reply_message(action_text, [t.name for t in self.parser.tools])
    name, arguments = message.calls[0] if message.calls else ("", "{}")
    return Call(name, action_text, json.loads(arguments) if name else {})

  def _step(self, call: Call) -> StepResult:
    message = reply_message(call.arg, [t.name for t in self.parser.tools])
    with self.gateway.lock:
      pending = self.episode.pending
      self._answer(200, completion(message, pending.id, pending.request.model or "policy"))
    self.served.append(message)
    kind, value = self._next()
    if kind == "raised":
      raise EnvError(f"the agent raised: {type(value).__name__}: {value}")
    if kind == "returned":
      return self._finish(value)
    problem = self._check_request(value.request)
    new = extension(self.served, value.request) if problem is None else problem
    if isinstance(new, str):
      with self.gateway.lock:
        self._answer(*_error(409, f"{new}; the gateway trains only on histories that extend what the policy "
                                  f"saw (the episode ends here, recorded as history_rewritten)"))
        self.episode.over = True
      return StepResult(Observation.capped(f"history rewritten: {new}", self.max_obs_bytes), {}, True, ENV_ERROR,
                        {"error": new, "break": new}, outcome=Outcome.HISTORY_REWRITTEN)
    self.served = list(value.request.messages)
    return StepResult(Observation(new.text, False, len(new.text.encode())), {}, False, None)

  def _finish(self, value: Any) -> StepResult:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      verdict = Verdict(float(value) > 0, float(value), {"returned": float(value)}, GATEWAY_VERSION)
    elif self.verifier is None:
      raise EnvError(f"the agent returned {type(value).__name__} {str(value)[:80]!r}: return a number (the reward) "
                     f"or give agent_spec a verifier to score it")
    else:
      verdict = self.judge(value)
    return StepResult(Observation(""), {"outcome": verdict.reward}, True, COMPLETED, verdict=verdict)

  def close(self) -> None:
    self._stop()
    if self.gateway is not None:
      self.gateway.close()
      self.gateway = None


def _no_demo(task: Task, seed: int = 0) -> list[str]:
  raise ValueError("this agent env has no demonstrations (agent_spec(demo=...)); set train.bc_steps=0")


def agent_spec(name: str, *, agent: Callable[[Task, Any], Any], tasks: Callable[..., list[Task]],
               tools: Sequence[Tool] = (), verifier: Verifier | None = None,
               demo: Callable[..., list[str]] | None = None, description: str = "",
               version_sources: Sequence[Any] = (), agent_timeout_s: float = 60.0) -> EnvSpec:
  """An `EnvSpec` that plays `agent` through the gateway (see the module docstring).

  `demo(task, seed)`: the model replies that solve `task` (text, or a tool call as JSON), for a
  behaviour-cloning cold start; None: none (train with `train.bc_steps=0`). `version_sources`: what defines
  the env's version besides the source files of `agent`, `tasks` and the verifier's class; the gateway's rules
  are recorded as the parser version (`GATEWAY_VERSION`).
  """
  def make(**kwargs) -> AgentEnv:
    kwargs.setdefault("agent_timeout_s", agent_timeout_s)
    env = AgentEnv(agent, tools, verifier, **kwargs)
    env.name, env.description = name, description
    return env

  sources = (agent, tasks, *(() if verifier is None else (type(verifier),)), *version_sources)
  return EnvSpec(name=name, description=description or f"the agent {getattr(agent, '__qualname__', agent)}",
                 make=make, tasks=tasks, demo=demo or _no_demo, version_sources=sources, site_packages=True)
