"""MCP tools beside any env's own: `env.tools: ["mcp:stdio:python -m mypkg.tools_server"]`.

`McpToolsEnv(inner, servers)` wraps any `Env` (as `envs.perturb` does; the env under test is never edited) and is
what a worker builds when a reset carries the option `tools`. Each episode starts its own MCP servers (stdio
subprocesses of the worker, so inside its sandbox), lists their tools into the parser (so the chat template's
tool schemas show them) and routes the policy's JSON calls: a call of an MCP tool goes to `tools/call` and its
text content is the observation; every other call is the inner env's.

  a tool's error result (`is_error`)       -> `InvalidAction` with its text: the invalid-action rule applies
                                              (by default an error observation, the episode goes on)
  a server that dies or does not answer    -> env_error (an infrastructure end: stored, never trained on)
  tools that differ from the trainer's     -> env_error at reset (the prompt showed other tools)

The trainer starts each server once when it builds the run, to list the tools for the prompt (as it imports an
env's module to validate it). A command's first word `python` is the worker's own interpreter; workers of a run
with MCP tools see the trainer's site-packages read-only inside bubblewrap (the server imports `mcp`).

Plain Python besides the `mcp` package (imported when a server starts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shlex
import sys
import threading
from typing import Any, Sequence

from envs._api import Env
from envs._tools import InvalidAction, Tool
from envs._vocabulary import EnvError
from envs._wire import Call, Observation, StepResult, Task

PREFIX = "mcp:stdio:"
START_TIMEOUT_S = 60.0  # a server's start, initialize and tool listing
CALL_TIMEOUT_S = 60.0   # one tools/call


def parse_server(spec: str) -> list[str]:
  """The command line of an `mcp:stdio:<command ...>` entry (a ValueError names the entry and the form)."""
  if not isinstance(spec, str) or not spec.startswith(PREFIX) or not shlex.split(spec[len(PREFIX):]):
    raise ValueError(f"tool server {spec!r}: expected '{PREFIX}<command and arguments>' (e.g. "
                     f"'{PREFIX}python -m mypkg.tools_server')")
  argv = shlex.split(spec[len(PREFIX):])
  return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


class McpServer:
  """One MCP server over stdio, driven from synchronous code: an event loop in a thread runs one task that owns
  the connection (anyio's scopes must close in the task that opened them) and serves calls from a queue."""

  def __init__(self, spec: str, start_timeout_s: float = START_TIMEOUT_S):
    self.spec, self.argv = spec, parse_server(spec)
    self.loop = asyncio.new_event_loop()
    self.thread = threading.Thread(target=self.loop.run_forever, name="mcp-client", daemon=True)
    self.thread.start()
    ready: concurrent.futures.Future = concurrent.futures.Future()
    self.requests: asyncio.Queue | None = None
    self.main = asyncio.run_coroutine_threadsafe(self._serve(ready), self.loop)
    try:
      self.tools: list[Tool] = ready.result(timeout=start_timeout_s)
    except concurrent.futures.TimeoutError:
      self.close()
      raise EnvError(f"MCP server {spec!r} did not list its tools within {start_timeout_s:g} s") from None
    except Exception as e:
      self.close()
      e = _leaf(e)
      raise EnvError(f"MCP server {spec!r} failed to start: {type(e).__name__}: {e}") from None

  async def _serve(self, ready: concurrent.futures.Future) -> None:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client
    self.requests = asyncio.Queue()
    try:
      # The client passes only a few variables on by default; the worker's PYTHONPATH is where `mcp` and the
      # server's own package are (a sandboxed worker's bound site-packages, /opt/jaxagent).
      extra = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
      params = StdioServerParameters(command=self.argv[0], args=self.argv[1:], env=extra)
      async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        listed = (await session.list_tools()).tools
        ready.set_result([_tool(t) for t in listed])
        while (item := await self.requests.get()) is not None:
          name, arguments, answer = item
          try:
            answer.set_result(await session.call_tool(name, arguments))
          except Exception as e:  # the connection closed (the server died), a protocol error: no more calls
            answer.set_exception(e)
            break
    except BaseException as e:
      if not ready.done():
        ready.set_exception(e)
      raise

  def call(self, name: str, arguments: dict[str, Any], timeout_s: float = CALL_TIMEOUT_S) -> tuple[str, bool]:
    """The text content of `tools/call` and whether the server flagged it an error; EnvError when the server is
    gone or silent."""
    if self.main.done():
      raise EnvError(f"MCP server {self.spec!r} is not running: {self._why()}")
    answer: concurrent.futures.Future = concurrent.futures.Future()
    self.loop.call_soon_threadsafe(self.requests.put_nowait, (name, arguments, answer))
    try:
      result = answer.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
      raise EnvError(f"MCP server {self.spec!r}: {name} did not answer within {timeout_s:g} s") from None
    except Exception as e:
      e = _leaf(e)
      raise EnvError(f"MCP server {self.spec!r} failed on {name}: {type(e).__name__}: {e}") from None
    text = "\n".join(getattr(c, "text", "") for c in result.content if getattr(c, "type", "") == "text")
    return text, bool(result.is_error)

  def _why(self) -> str:
    try:
      self.main.result(timeout=0)
      return "it exited"
    except BaseException as e:
      return f"{type(e).__name__}: {e}"

  def close(self) -> None:
    if self.requests is not None and not self.main.done():
      self.loop.call_soon_threadsafe(self.requests.put_nowait, None)
      try:
        self.main.result(timeout=10)
      except BaseException:
        pass  # a dead server's error was reported by the call that met it
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join(timeout=10)


def _leaf(e: BaseException) -> BaseException:
  """The first error inside (nested) exception groups: anyio's task groups wrap what went wrong."""
  while isinstance(e, BaseExceptionGroup) and e.exceptions:
    e = e.exceptions[0]
  return e


def _tool(t: Any) -> Tool:
  """An MCP tool listing as a `Tool` (its first description line; its input schema, title dropped)."""
  schema = dict(t.input_schema or {"type": "object", "properties": {}})
  schema.pop("title", None)
  try:
    return Tool(t.name, (t.description or "").strip().splitlines()[0] if t.description else "", schema)
  except ValueError as e:
    raise EnvError(f"MCP tool {t.name!r} cannot be offered to the policy: {e}") from None


def tools_version(tools: Sequence[Tool]) -> str:
  """A short hash of the tools' schemas: part of the parser version (a policy depends on the tools it saw)."""
  return hashlib.sha256(json.dumps([t.schema() for t in tools], sort_keys=True).encode()).hexdigest()[:8]


class McpToolsEnv(Env):
  """`inner` with the tools of MCP `servers` beside its own (see the module docstring).

  `expected`: the tools' version the trainer listed (the parser version's suffix); None: whatever they list.
  """

  def __init__(self, inner: Env, servers: Sequence[str], expected: str | None = None):
    super().__init__(max_turns=inner.max_turns, invalid_action=inner.invalid_action,
                     max_obs_bytes=inner.max_obs_bytes)
    self.inner, self.specs, self.expected = inner, tuple(servers), expected
    self.name, self.description = inner.name, inner.description
    self.verifier, self.heldout_verifier = inner.verifier, inner.heldout_verifier
    self.servers: list[McpServer] = []
    self.routes: dict[str, McpServer] = {}
    self.episodes = 0
    self._open()

  def _open(self) -> None:
    """Starts the servers and builds the parser of the inner env's tools and theirs."""
    self.servers, self.routes = [], {}
    try:
      for spec in self.specs:
        server = McpServer(spec)
        self.servers.append(server)
        for tool in server.tools:
          if tool.name in self.routes or tool.name in self.inner.parser.names:
            raise EnvError(f"MCP tool {tool.name!r} of {spec!r}: the name is taken (by "
                           f"{self.routes[tool.name].spec if tool.name in self.routes else self.inner.name})")
          self.routes[tool.name] = server
    except BaseException:
      self._close_servers()
      raise
    mcp = [t for s in self.servers for t in s.tools]
    version = tools_version(mcp)
    if self.expected is not None and version != self.expected:
      self._close_servers()
      raise EnvError(f"the MCP servers list other tools than when the run was built ({version} != "
                     f"{self.expected}): the prompt shows those")
    inner = self.inner.parser
    self.tools_version = version  # what the trainer hands the workers to compare (`expected`)
    self.parser = dataclasses.replace(inner, tools=(*inner.tools, *mcp), version=f"{inner.version}+mcp-{version}")

  def versions(self) -> dict[str, str]:
    return {**self.inner.versions(), "parser": str(self.parser.version)}

  def _reset(self, task: Task, seed: int) -> str:
    if self.episodes:  # every episode its own servers: no tool state crosses episodes (nor a dead server)
      self._close_servers()
      self._open()
    self.episodes += 1
    return self.inner.reset(task, seed).text

  def state_key(self) -> str | None:
    return self.inner.state_key()

  def _step(self, call: Call) -> StepResult:
    server = self.routes.get(call.name)
    if server is None:
      self.inner.turn = self.turn
      return self.inner._step(call)  # the hook Env.step would call
    text, is_error = server.call(call.name, dict(call.arguments))
    if is_error:
      raise InvalidAction(f"{call.name}: {text}" if text else f"{call.name} failed")
    return StepResult(Observation.capped(text, self.max_obs_bytes), {}, False, None, {"tool": call.name})

  def _close_servers(self) -> None:
    for server in self.servers:
      server.close()
    self.servers = []

  def close(self) -> None:
    self._close_servers()
    self.inner.close()


def wrap(env: Env, servers: Sequence[str] | None, expected: str | None = None) -> Env:
  """`env` with the MCP `servers`' tools; `env` itself without servers."""
  return McpToolsEnv(env, servers, expected) if servers else env


def check_servers(servers: Sequence[str] | None) -> None:
  """Raises ValueError for an entry that is not `mcp:stdio:<command ...>` (config validation: nothing starts)."""
  for spec in servers or ():
    parse_server(spec)

