"""OpenEnv both ways: play an OpenEnv environment server as a jaxagent env, and serve any jaxagent env as one.

Client: `env.name: openenv:http://127.0.0.1:8000` plays the server at that URL through `openenv-core`'s own
client (`GenericEnvClient`: a WebSocket session per episode, the server's reset / step / state):

  tasks        seeds: task i of a split resets the server with seed `reset_seed` (splits use disjoint seeds);
               the episode's own seed is not sent, so the G samples of a group play the same instance
  action       the policy's text, as the server's action: the value of its one string field when the action
               schema (`GET /schema`) has one required string field, else the text must be the action as a
               JSON object (a text that is not one is an invalid action, under the invalid-action rule)
  observation  the observation's one string field (besides done, reward and metadata), else its fields as JSON
  reward       each step's reward is the step's `outcome` component; `done` ends the episode as completed with
               a verdict passed iff the episode's reward is > 0
  failures     a server that cannot be reached, refuses a reset or drops the session: env_error
OpenEnv servers are reached over the network, so their workers are not sandboxed (the env code there is this
client: what the server runs is the server's business); use `env.pool.kind: inprocess` or `local`.

Server: `jaxagent envs serve NAME --openenv --port 8000` (loopback) serves env NAME with OpenEnv's own server
(`openenv.core.env_server.create_app`): action `{"text": ...}` (what the policy writes), observation `{"text",
"done", "reward", "metadata"}` with the termination, outcome and verdict in the metadata; reset takes `seed`,
`split` ("train") and `task_index` (0): the task is `tasks(split, task_index + 1)[task_index]`. Each WebSocket
session gets its own env instance.

Needs `openenv-core` (the `[openenv]` extra); imported when used.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from envs._api import Env, EnvSpec, source_version
from envs._tools import ActionParser, InvalidAction
from envs._vocabulary import COMPLETED, SPLITS, EnvError
from envs._wire import Call, Observation, StepResult, Task, Verdict

PREFIX = "openenv:"
BRIDGE_VERSION = "openenv-v1"  # the mapping rules above: part of every OpenEnv client env's version
_SPLIT_SEEDS = {"train": 0, "tune": 1 << 29, "eval": 1 << 30}  # disjoint reset seeds per split (< 2**31)
_RESERVED = ("done", "reward", "metadata")


def _need_openenv():
  try:
    from openenv.core import GenericEnvClient
  except ImportError as e:
    raise EnvError(f"OpenEnv needs the `openenv-core` package (pip install 'jaxagent[openenv]'): {e}") from None
  return GenericEnvClient


# ----------------------------------------------------------------------------------------------
# Client: an OpenEnv server as a jaxagent env.


def observation_text(observation: Any) -> str:
  """An OpenEnv observation as the text the policy reads (see the module docstring)."""
  if not isinstance(observation, dict):
    return str(observation)
  fields = {k: v for k, v in observation.items() if k not in _RESERVED}
  strings = [v for v in fields.values() if isinstance(v, str)]
  if len(fields) == 1 and len(strings) == 1:
    return strings[0]
  return json.dumps(fields, sort_keys=True, default=str)


def text_field(schema: Any) -> str | None:
  """The action's one required string field, if its JSON schema has exactly one (else None)."""
  if not isinstance(schema, dict):
    return None
  props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
  required = [k for k in schema.get("required", []) if k in props]
  strings = [k for k in required if isinstance(props[k], dict) and props[k].get("type") == "string"]
  return strings[0] if len(required) == 1 and len(strings) == 1 else None


class OpenEnvClientEnv(Env):
  """One OpenEnv server session per episode (see the module docstring)."""

  parser = ActionParser(tools=(), version=BRIDGE_VERSION, free_text=True)  # any text: the server judges it

  def __init__(self, url: str, **kwargs):
    kwargs.pop("action_syntax", None)  # any text is an action; the server's schema judges it
    super().__init__(**kwargs)
    self.url = url.rstrip("/")
    self.name = f"{PREFIX}{self.url}"
    self.client = None
    self.field: str | None = None
    self.total = 0.0

  def _connect(self):
    client_cls = _need_openenv()
    try:
      import requests
      schema = requests.get(f"{self.url}/schema", timeout=10).json()
      self.field = text_field(schema.get("action"))
      self.client = client_cls(base_url=self.url).sync()
      self.client.connect()
    except Exception as e:
      self.client = None
      raise EnvError(f"OpenEnv server {self.url}: cannot connect: {type(e).__name__}: {e}") from None

  def _reset(self, task: Task, seed: int) -> str:
    del seed  # the task's reset seed names the instance (a group plays one)
    self._disconnect()
    self._connect()
    self.total = 0.0
    try:
      result = self.client.reset(seed=int(task.payload["reset_seed"]))
    except Exception as e:
      raise EnvError(f"OpenEnv server {self.url}: reset failed: {type(e).__name__}: {e}") from None
    return observation_text(result.observation)

  def _parse(self, action_text: str) -> Call:
    return Call("", action_text)

  def _action(self, text: str) -> dict[str, Any]:
    if self.field is not None:
      return {self.field: text}
    try:
      action = json.loads(text)
    except json.JSONDecodeError:
      action = None
    if not isinstance(action, dict):
      raise InvalidAction(f"the server's action is a JSON object (its schema at {self.url}/schema); got "
                          f"{text[:60]!r}")
    return action

  def _step(self, call: Call) -> StepResult:
    action = self._action(call.arg)
    try:
      result = self.client.step(action)
    except Exception as e:
      raise EnvError(f"OpenEnv server {self.url}: step failed: {type(e).__name__}: {e}") from None
    reward = float(result.reward or 0.0)
    self.total += reward
    obs = Observation.capped(observation_text(result.observation), self.max_obs_bytes)
    if not result.done:
      return StepResult(obs, {"outcome": reward}, False, None)
    meta = result.observation.get("metadata") if isinstance(result.observation, dict) else None
    evidence = {"reward": self.total, **({"metadata": json.loads(json.dumps(meta, default=str))} if meta else {})}
    verdict = Verdict(self.total > 0, self.total, evidence, BRIDGE_VERSION)
    return StepResult(obs, {"outcome": reward}, True, COMPLETED, verdict=verdict)

  def _disconnect(self) -> None:
    if self.client is not None:
      try:
        self.client.close()
      except Exception:  # a dropped session is already closed
        pass
      self.client = None

  def close(self) -> None:
    self._disconnect()


def _tasks_for(url: str):
  def tasks(split: str, n: int, seed: int = 0) -> list[Task]:
    """Task i of `split`: the server reset with seed `reset_seed` (disjoint ranges per split)."""
    if split not in SPLITS:
      raise ValueError(f"split={split!r}: not one of {SPLITS}")
    version = source_version(OpenEnvClientEnv, extra=url)
    base = _SPLIT_SEEDS[split] + (seed * 100_003) % (1 << 29)
    return [Task(f"openenv-{split}-{seed}-{i}", split, {"reset_seed": base + i % (1 << 29)}, version)
            for i in range(n)]
  return tasks


def _no_demo(task: Task, seed: int = 0) -> list[str]:
  raise ValueError("an OpenEnv server has no demonstrations here; set train.bc_steps=0")


_SPECS: dict[str, EnvSpec] = {}
_SPECS_LOCK = threading.Lock()


def client_spec(name: str) -> EnvSpec:
  """The EnvSpec of `openenv:<url>` (one per URL)."""
  url = name[len(PREFIX):].rstrip("/")
  if not url.startswith(("http://", "https://")):
    raise ValueError(f"environment {name!r}: expected '{PREFIX}http://HOST:PORT' (an OpenEnv server's URL)")
  with _SPECS_LOCK:
    if url not in _SPECS:
      _SPECS[url] = EnvSpec(name=f"{PREFIX}{url}", description=f"the OpenEnv server at {url}",
                            make=lambda **kwargs: OpenEnvClientEnv(url, **kwargs), tasks=_tasks_for(url),
                            demo=_no_demo, version_sources=(OpenEnvClientEnv,), deterministic=False,
                            network=True)
    return _SPECS[url]


# ----------------------------------------------------------------------------------------------
# Server: a jaxagent env as an OpenEnv server.


def make_app(spec: EnvSpec, *, max_turns: int = 8, max_sessions: int = 16):
  """The FastAPI app of OpenEnv's server for `spec` (see the module docstring)."""
  _need_openenv()
  from openenv.core.env_server import Action as OEAction
  from openenv.core.env_server import Environment, State, create_app
  from openenv.core.env_server import Observation as OEObservation
  from pydantic import Field

  class TextAction(OEAction):
    text: str = Field(description="the action as the policy writes it (e.g. `calc 12*7`, or a JSON tool call)")

  class TextObservation(OEObservation):
    text: str = Field(default="", description="what the env shows")

  class JaxagentEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
      super().__init__()
      self.env = spec.make(max_turns=max_turns)
      self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, split: str = "train",
              task_index: int = 0, **kwargs) -> TextObservation:
      index = int(task_index)
      if index < 0:
        raise ValueError(f"task_index={index}: must be >= 0")
      task = spec.tasks(split, index + 1, 0)[index]
      obs = self.env.reset(task, int(seed or 0))
      self._state = State(episode_id=episode_id, step_count=0)
      return TextObservation(text=obs.text, done=False, reward=None,
                             metadata={"task_id": task.id, "split": split, "env": spec.name,
                                       "env_version": spec.version})

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs) -> TextObservation:
      result = self.env.step(action.text)
      self._state = State(episode_id=self._state.episode_id, step_count=self._state.step_count + 1)
      meta: dict[str, Any] = {"outcome": result.outcome.value}
      if result.done:
        meta["termination"] = result.termination.value
      if result.verdict is not None:
        meta["verdict"] = result.verdict.to_wire()
      return TextObservation(text=result.observation.text, done=result.done, reward=result.reward, metadata=meta)

    @property
    def state(self) -> State:
      return self._state

    def close(self) -> None:
      self.env.close()

  return create_app(JaxagentEnvironment, TextAction, TextObservation, env_name=spec.name,
                    max_concurrent_envs=max_sessions)


def serve(spec: EnvSpec, host: str, port: int, *, max_turns: int = 8, max_sessions: int = 16) -> None:
  """Serves `spec` as an OpenEnv server until interrupted (uvicorn)."""
  import uvicorn
  uvicorn.run(make_app(spec, max_turns=max_turns, max_sessions=max_sessions), host=host, port=port,
              log_level="warning")
