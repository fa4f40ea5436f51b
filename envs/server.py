"""Env worker: hosts many env instances of one environment behind the wire protocol.

`python -m envs.server --env calculator --socket /run/w.sock` (also `jaxagent envs serve`), or
`--tcp 127.0.0.1:PORT`. The env is a registered name, a `jaxagent.envs` entry point or `package.module:ATTR`
(the module must be importable here: see `envs.pool` for how local and docker workers get user code).

Requests run on a bounded thread pool (so one slow instance does not block the others); when `max_inflight`
requests are running the reader stops reading, which is the backpressure a client sees. A bad frame gets an
error reply; nothing a client sends stops the server.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import socket
import signal
import socketserver
import sys
import threading
import time
from typing import Any, Mapping

from envs import _protocol as P
from envs import _sandbox
from envs import mcp_tools
from envs import perturb as perturb_lib
from envs._api import Env, InvalidActionRule, Task
from envs._registry import UnknownEnvError, get

RESET_OPTIONS = {"max_turns": int, "invalid_action": str, "penalty": float, "max_obs_bytes": int,
                 "action_syntax": str, "perturb": dict, "score_heldout": bool, "tools": list, "tools_version": str}
MAX_INSTANCES = 4096


class RequestError(ValueError):
  def __init__(self, kind: str, message: str):
    super().__init__(message)
    self.kind = kind


def _arg(args: Mapping[str, Any], name: str, typ, *, default=..., limit: int = 1 << 16):
  if name not in args:
    if default is ...:
      raise RequestError("bad_args", f"missing argument {name!r}")
    return default
  value = args[name]
  if typ is float and type(value) is int:
    value = float(value)
  if type(value) is not typ:
    raise RequestError("bad_args", f"{name}={str(value)[:64]!r}: must be {typ.__name__}")
  if typ is str and len(value) > limit:
    raise RequestError("bad_args", f"{name}: {len(value)} chars exceeds {limit}")
  return value


class Host:
  """The instance table and op dispatch, shared by the socket server and the in-process pool."""

  def __init__(self, env_name: str, max_instances: int = MAX_INSTANCES, episode_sandbox: str = "auto"):
    self.spec = get(env_name)
    self.version = self.spec.version
    self.max_instances = max_instances
    # How the programs of an episode's actions are confined (envs._sandbox). Resolved now for an env that runs
    # programs, so a worker that cannot sandbox them fails at its start, not at its first episode.
    self.episode_sandbox = _sandbox.resolve(episode_sandbox) if self.spec.needs_sandbox else episode_sandbox
    self._instances: dict[str, tuple[Env, threading.Lock]] = {}
    self._lock = threading.Lock()

  def handle(self, op: str, args: Mapping[str, Any]) -> Any:
    """Run one validated op; raises RequestError (an error reply) for anything the client got wrong."""
    if op == "hello":
      return dict(env=self.spec.name, version=self.version, protocol=P.PROTOCOL_VERSION, pid=os.getpid(),
                  host=socket.gethostname(), deterministic=self.spec.deterministic,
                  episode_sandbox=self.episode_sandbox if self.spec.needs_sandbox else None)
    if op == "ping":
      return dict(time=time.time())
    instance = _arg(args, "instance", str, limit=128)
    if op == "reset":
      return self._reset(instance, args)
    with self._lock:
      entry = self._instances.get(instance)
    if entry is None:
      raise RequestError("unknown_instance", f"instance {instance!r} does not exist (reset it first)")
    env, lock = entry
    with lock:
      if op == "step":
        action = _arg(args, "action", str, limit=1 << 16)
        if env.done:
          raise RequestError("episode_done", f"instance {instance!r}: the episode already ended")
        return env.step(action).to_wire()
      if op in ("snapshot", "restore"):
        try:  # optional capabilities: an env without them answers `unsupported`, not an env fault
          if op == "snapshot":
            return env.snapshot()
          env.restore(args.get("state"))
          return None
        except NotImplementedError as e:
          raise RequestError("unsupported", str(e)) from None
      if op == "close":
        with self._lock:
          self._instances.pop(instance, None)
        env.close()
        return None
    raise RequestError("bad_op", f"op={op!r}")

  def _reset(self, instance: str, args: Mapping[str, Any]) -> Any:
    task_d = args.get("task")
    if not isinstance(task_d, dict):
      raise RequestError("bad_args", "task must be a map with id, split, payload, version")
    try:
      task = Task.from_wire(task_d)
    except (ValueError, TypeError) as e:
      raise RequestError("bad_args", f"task: {e}") from None
    seed = _arg(args, "seed", int)
    options = args.get("options") or {}
    if not isinstance(options, dict) or set(options) - set(RESET_OPTIONS):
      raise RequestError("bad_args", f"options {options!r}: valid keys are {sorted(RESET_OPTIONS)}")
    kwargs: dict[str, Any] = {}
    for k, typ in RESET_OPTIONS.items():
      if k in options:
        kwargs[k] = _arg(options, k, typ)
    with self._lock:  # refuse before building an env when full (re-checked below: resets race)
      if instance not in self._instances and len(self._instances) >= self.max_instances:
        raise RequestError("too_many_instances", f"worker holds {self.max_instances} instances; close some")
    try:
      if "invalid_action" in kwargs or "penalty" in kwargs:
        kwargs["invalid_action"] = InvalidActionRule(kwargs.pop("invalid_action", "error_observation"),
                                                     kwargs.pop("penalty", 0.1))
      perturb, heldout = kwargs.pop("perturb", None), kwargs.pop("score_heldout", False)
      tools, tools_version = kwargs.pop("tools", None), kwargs.pop("tools_version", None)
      mcp_tools.check_servers(tools)
      env = self.spec.make(**kwargs)
      env.episode_sandbox, env.score_heldout = self.episode_sandbox, heldout
      env = mcp_tools.wrap(env, tools, tools_version)  # MCP servers' tools beside the env's (they start here)
      env = perturb_lib.wrap(env, perturb)  # the env under test is never edited: its tools are wrapped
    except (ValueError, TypeError) as e:
      raise RequestError("bad_args", f"options: {e}") from None
    with self._lock:
      full = instance not in self._instances and len(self._instances) >= self.max_instances
      old = None if full else self._instances.pop(instance, None)
      if not full:
        self._instances[instance] = (env, threading.Lock())
    if full:  # the env made for this reset never enters the table: close it here or nobody will.
      env.close()
      raise RequestError("too_many_instances", f"worker holds {self.max_instances} instances; close some")
    if old is not None:
      old[0].close()
    try:
      obs = env.reset(task, seed)
    except BaseException:  # a failed reset holds no instance (nor its files): the client never learns its name
      with self._lock:
        if self._instances.get(instance, (None,))[0] is env:
          del self._instances[instance]
      env.close()
      raise
    return dict(obs.to_wire(), version=self.version)

  def close_instances(self, names) -> None:
    """Closes these instances if they are still open (a client connection that ended without closing them)."""
    for name in names:
      with self._lock:
        entry = self._instances.pop(name, None)
      if entry is not None:
        entry[0].close()

  def close_all(self) -> None:
    with self._lock:
      entries, self._instances = list(self._instances.values()), {}
    for env, _ in entries:
      env.close()


def serve_connection(host: Host, conn: socket.socket, executor: concurrent.futures.Executor,
                     inflight: threading.Semaphore, max_frame: int = P.MAX_FRAME_BYTES) -> None:
  """Read requests until EOF; each runs on `executor`; replies may come back out of order (by id)."""
  write_lock = threading.Lock()
  opened: set[str] = set()  # instances this connection reset: closed when it ends (a client that goes away
  opened_lock = threading.Lock()  # never leaves episodes holding the server's admission capacity)

  def send(msg) -> None:
    try:
      data = P.pack(msg)
    except Exception as e:  # an env returned something msgpack cannot encode
      data = P.pack(P.error_reply(msg.get("id", -1), "env_error", f"unencodable result: {e}"))
    with write_lock:
      try:
        conn.sendall(data)
      except OSError:
        pass  # the client went away; its reader will notice.

  def run(req_id: int, op: str, args) -> None:
    try:
      result = host.handle(op, args)
      if op in ("reset", "close"):
        with opened_lock:
          (opened.add if op == "reset" else opened.discard)(args["instance"])
      send(P.ok_reply(req_id, result))
    except RequestError as e:
      send(P.error_reply(req_id, e.kind, str(e)))
    except Exception as e:  # an env bug: report it as an env fault, keep serving.
      send(P.error_reply(req_id, "env_error", f"{type(e).__name__}: {e}"))
    finally:
      inflight.release()

  while True:
    try:
      msg = P.read_frame(conn, max_frame)
      req_id, op, args = P.validate_request(msg)
    except P.ProtocolError as e:
      send(P.error_reply(e.req_id, e.kind, str(e)))
      continue
    except (ConnectionError, OSError):
      with opened_lock:
        left = list(opened)
      host.close_instances(left)
      return
    inflight.acquire()
    executor.submit(run, req_id, op, args)


def _exit_on_sigterm(*_) -> None:
  """As a container's PID 1, Python ignores SIGTERM unless told: stop at once (Kubernetes, docker stop)."""
  raise SystemExit(0)


def serve(env_name: str, *, socket_path: str | None = None, tcp: str | None = None, threads: int = 8,
          max_inflight: int = 64, ready_file: str | None = None, max_episodes: int = MAX_INSTANCES,
          allow_any_address: bool = False, episode_sandbox: str = "auto") -> None:
  """Serve until killed. Exactly one of `socket_path` (unix) or `tcp` ("127.0.0.1:PORT": loopback, unless
  `allow_any_address`, for a server in its own network namespace such as a Kubernetes pod).

  `max_episodes`: admission control, the open episodes (instances) this server holds at once; a reset beyond
  it is refused with `too_many_instances`, which a pool waits out (back-pressure).
  `episode_sandbox`: how an env that runs programs confines each episode's (`envs._sandbox`: auto, bwrap,
  none); 'bwrap' where bubblewrap cannot run fails here, at the start."""
  if (socket_path is None) == (tcp is None):
    raise ValueError("give exactly one of --socket PATH or --tcp HOST:PORT")
  if max_episodes < 1:
    raise ValueError(f"--max-episodes {max_episodes}: must be >= 1")
  host = Host(env_name, max_instances=max_episodes, episode_sandbox=episode_sandbox)
  executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="env")
  inflight = threading.Semaphore(max_inflight)

  class Handler(socketserver.BaseRequestHandler):
    def handle(self):
      serve_connection(host, self.request, executor, inflight)

  if socket_path is not None:
    if os.path.exists(socket_path):
      os.unlink(socket_path)
    # Bound and listening under a private name, then renamed: the path appears only once a connect succeeds
    # (clients wait for it to exist; between bind and listen a connect is refused).
    staging = os.path.join(os.path.dirname(socket_path) or ".", f".{os.getpid()}.sock")
    server = socketserver.ThreadingUnixStreamServer(staging, Handler)
    os.replace(staging, socket_path)
    where = f"unix:{socket_path}"
  else:
    addr, _, port = tcp.rpartition(":")
    if addr not in ("127.0.0.1", "localhost", "::1") and not allow_any_address:
      raise ValueError(f"--tcp {tcp}: only loopback addresses are served (127.0.0.1, ::1) unless "
                       "--allow-any-address (a server alone in its network namespace, e.g. a Kubernetes pod)")
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    server = socketserver.ThreadingTCPServer((addr, int(port)), Handler)
    where = f"tcp:{addr}:{server.server_address[1]}"
  server.daemon_threads = True
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
  boxes = f", episode sandbox {host.episode_sandbox}" if host.spec.needs_sandbox else ""
  print(f"envs worker: {env_name} {host.version} on {where} (pid {os.getpid()}{boxes})", file=sys.stderr,
        flush=True)
  if ready_file:
    with open(ready_file, "w") as f:
      f.write(where)
  try:
    server.serve_forever()
  finally:
    host.close_all()


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="envs.server", description=__doc__)
  add_serve_args(parser)
  args = parser.parse_args(argv)
  try:
    get(args.env)
  except UnknownEnvError as e:
    print(f"envs.server: error: {e}", file=sys.stderr)
    return 2
  return serve_args(args)


def serve_args(args: argparse.Namespace) -> int:
  """`serve` with the arguments `add_serve_args` defines; 2 (and the reason on stderr) if it cannot start."""
  if args.openenv:
    return _serve_openenv(args)
  try:
    serve(args.env, socket_path=args.socket, tcp=args.tcp, threads=args.threads, max_inflight=args.max_inflight,
          max_episodes=args.max_episodes, allow_any_address=args.allow_any_address,
          episode_sandbox=args.episode_sandbox)
  except (_sandbox.SandboxUnavailable, ValueError) as e:
    print(f"envs.server: error: {e}", file=sys.stderr)
    return 2
  return 0


def _serve_openenv(args: argparse.Namespace) -> int:
  """`--openenv`: the env behind OpenEnv's HTTP/WebSocket server (envs/openenv_bridge.py) at --tcp."""
  from envs import openenv_bridge
  host, _, port = (args.tcp or "127.0.0.1:8000").rpartition(":")
  try:
    if not port.isdigit():
      raise ValueError(f"--tcp {args.tcp!r}: expected HOST:PORT")
    if host not in ("127.0.0.1", "localhost", "::1") and not args.allow_any_address:
      raise ValueError(f"--tcp {args.tcp!r}: not a loopback address (--allow-any-address to bind it anyway)")
    spec = get(args.env)
    openenv_bridge.make_app(spec)  # fails here, before binding, without openenv-core
  except (ValueError, UnknownEnvError, openenv_bridge.EnvError) as e:
    print(f"envs.server: error: {e}", file=sys.stderr)
    return 2
  print(f"serving {spec.name} as an OpenEnv server at http://{host}:{port}", flush=True)
  openenv_bridge.serve(spec, host, int(port), max_turns=args.max_turns, max_sessions=min(args.max_episodes, 256))
  return 0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("env", nargs="?", default=os.environ.get("JAXAGENT_ENV", "calculator"),
                      help="registered env name or package.module:ATTR naming an EnvSpec "
                      "(default $JAXAGENT_ENV or calculator)")
  parser.add_argument("--env", dest="env", help=argparse.SUPPRESS)
  parser.add_argument("--socket", help="unix socket path to listen on")
  parser.add_argument("--tcp", help="HOST:PORT on loopback to listen on")
  parser.add_argument("--threads", type=int, default=8, help="requests run concurrently")
  parser.add_argument("--max-inflight", type=int, default=64, help="backpressure: requests accepted at once")
  parser.add_argument("--max-episodes", type=int, default=MAX_INSTANCES, help="admission control: open episodes "
                      "held at once; a reset beyond waits in the client (back-pressure)")
  parser.add_argument("--episode-sandbox", choices=_sandbox.MODES, default="auto",
                      help="envs that run programs (terminal, code_repair): bwrap gives every episode its own "
                      "sandbox (required: fail at start without it), none runs them unconfined, auto is bwrap "
                      "where it works")
  parser.add_argument("--openenv", action="store_true", help="serve the env as an OpenEnv server (HTTP and "
                      "WebSocket, openenv-core's own) at --tcp (default 127.0.0.1:8000) instead of the worker protocol")
  parser.add_argument("--max-turns", type=int, default=8, help="--openenv: the env's turn limit per episode")
  parser.add_argument("--allow-any-address", action="store_true", help="--tcp may bind a non-loopback address "
                      "(only for a server alone in its network namespace, e.g. a Kubernetes pod)")


if __name__ == "__main__":
  sys.exit(main())
