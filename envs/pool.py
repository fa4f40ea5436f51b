"""Env pools: one client API over in-process, local (sandboxed subprocess), Docker and remote workers.

A pool owns `num_slots` episode slots spread over its workers. `reset(slot, task, seed)` starts an episode,
`step_many(slots, actions)` steps several slots concurrently. Every failure ends in a distinct outcome:

  parser_rejected / invalid_action   the env refused the action (the configured rule decides if it ends)
  env_error                          a tool fault inside the env (outcome env_error)
  env_error + outcome worker_crash   the worker died and the episode could not be replayed
  env_error + outcome replay_diverged   replaying the episode on a restarted worker gave other observations
  env_timeout                        a step exceeded `action_timeout_s`, or the episode `episode_timeout_s`
  retries_exhausted                  the worker kept dying on this step
  cancelled                          `cancel(slot)` was called

`PoolConfig` = `WorkerConfig` (how workers run: the YAML section `env.pool`) + the episode fields (env,
max_turns, invalid_action, penalty); `PoolConfig.from_workers(workers, env=...)` joins them.

A crashed or hung worker is restarted; the episodes it hosted are replayed (reset with the same seed, the same
actions) before their next step, so other trajectories are not affected when envs are deterministic. Replay is
checked, not assumed: every observation of the replay must match the one the episode saw (text, truncation,
done, termination), or the episode ends as `replay_diverged`. `Pool.replays` / `Pool.replay_divergences` count
both (the trainer logs them as `env/replays`, `env/replay_divergences`).
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import importlib.util
import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path
import typing
from typing import Any, Literal, Sequence

from envs import _protocol as P
from envs import _registry
from envs import _sandbox
from envs._api import (ACTION_SYNTAXES, CANCELLED, ENV_ERROR, ENV_TIMEOUT, INVALID_ACTION_RULES, RETRIES_EXHAUSTED,
                       Observation, Outcome, StepResult, Task, Termination)

log = logging.getLogger(__name__)
PoolKind = Literal["inprocess", "local", "docker", "remote"]
Sandbox = Literal["auto", "bwrap", "none"]
POOL_KINDS: tuple[str, ...] = typing.get_args(PoolKind)
SANDBOXES: tuple[str, ...] = typing.get_args(Sandbox)
ENVS_DIR = Path(__file__).resolve().parent


def _invalid(obj, name: str, valid: str) -> ValueError:
  return ValueError(f"{name}={getattr(obj, name)!r}: {valid}")


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
  """How env workers run (the YAML section `env.pool`). Validated on construction; an error names the field,
  the value and what is valid (`num_workers=0: must be >= 1`).

  Field types are the ones a typed YAML loader can build: str, int, float, bool, `X | None`, `tuple[str, ...]`
  and `Literal[...]`.
  """
  kind: PoolKind = "local"  # inprocess (threads here), local (subprocess, bwrap), docker, remote (addresses)
  num_workers: int = 1  # worker processes / containers / connections; the slots are spread over them
  # auto (bwrap if available), bwrap (required), none (unconfined, asked for explicitly). Local pool: each worker
  # in bubblewrap; and for envs that run programs (terminal, code_repair), in every pool kind, each episode's
  # programs in a sandbox of their own (envs._sandbox; docker: nested in the container).
  sandbox: Sandbox = "auto"
  action_timeout_s: float = 10.0  # one step's limit; past it the episode ends as env_timeout
  episode_timeout_s: float = 600.0  # a whole episode's limit (reset to last step); env_timeout past it
  reset_timeout_s: float = 30.0  # one reset's limit; the worker is restarted past it
  start_timeout_s: float = 30.0  # a worker's limit to start and answer hello
  max_retries: int = 2  # restarts a crashed step is retried on before retries_exhausted
  # local/docker pools: workers started ahead and held ready; a crashed or hung worker is replaced by one at once
  # (no start on the episode's path), and a new spare starts in the background
  warm_spares: int = 0
  replay_on_crash: bool = True  # replay episodes on a restarted worker (else they end as worker_crash)
  max_obs_bytes: int = 4096  # observation cap in bytes; longer ones are truncated and flagged
  max_inflight: int = 64  # requests in flight per worker connection (backpressure)
  addresses: tuple[str, ...] = ()  # remote pool: one `unix:/path` or `tcp:host:port` per worker
  docker_image: str = "jaxagent-envs:latest"  # docker pool: the worker image (user envs: see DockerWorker)
  docker_host: str | None = None  # docker pool: daemon URL (None: $JAXAGENT_DOCKER_HOST or the private one)
  docker_memory: str = "512m"  # docker pool: memory limit per container
  docker_cpus: float = 1.0  # docker pool: CPUs per container
  docker_pids: int = 128  # docker pool: process limit per container

  def __post_init__(self):
    if self.kind not in POOL_KINDS:
      raise _invalid(self, "kind", f"not one of {POOL_KINDS}")
    if self.sandbox not in SANDBOXES:
      raise _invalid(self, "sandbox", f"not one of {SANDBOXES}")
    for name in ("num_workers", "max_inflight", "max_obs_bytes", "docker_pids"):
      if getattr(self, name) < 1:
        raise _invalid(self, name, "must be >= 1")
    for name in ("action_timeout_s", "episode_timeout_s", "reset_timeout_s", "start_timeout_s", "docker_cpus"):
      if not getattr(self, name) > 0:
        raise _invalid(self, name, "must be > 0")
    if self.max_retries < 0:
      raise _invalid(self, "max_retries", "must be >= 0")
    if self.warm_spares < 0:
      raise _invalid(self, "warm_spares", "must be >= 0")
    if self.warm_spares and self.kind not in ("local", "docker"):
      raise _invalid(self, "warm_spares", f"only local and docker pools start workers (kind={self.kind!r}); "
                     "use 0")
    if not isinstance(self.addresses, tuple) or not all(isinstance(a, str) for a in self.addresses):
      raise _invalid(self, "addresses", "must be a tuple of str (unix:/path or tcp:host:port)")
    if self.kind == "remote" and not self.addresses:
      raise _invalid(self, "addresses", "a remote pool needs worker addresses (unix:/path or tcp:host:port)")


@dataclasses.dataclass(frozen=True)
class PoolConfig(WorkerConfig):
  """A pool: how its workers run (`WorkerConfig`) plus what each episode is (env and its reset options)."""
  env: str = "calculator"  # registered name, `jaxagent.envs` entry point, or package.module:ATTR
  max_turns: int | None = None  # per-episode turn limit (None: the env's default)
  invalid_action: str = "error_observation"  # docs/design.md §2.3: one of INVALID_ACTION_RULES
  penalty: float = 0.1  # validity penalty under the "penalty" rule
  action_syntax: str = "line"  # how actions are written: one of ACTION_SYNTAXES (line `NAME ARG`, json calls)

  def __post_init__(self):
    super().__post_init__()
    if self.invalid_action not in INVALID_ACTION_RULES:
      raise _invalid(self, "invalid_action", f"not one of {INVALID_ACTION_RULES}")
    if self.max_turns is not None and self.max_turns < 1:
      raise _invalid(self, "max_turns", "must be >= 1 or None")
    if self.penalty < 0:
      raise _invalid(self, "penalty", "must be >= 0")
    if self.action_syntax not in ACTION_SYNTAXES:
      raise _invalid(self, "action_syntax", f"not one of {ACTION_SYNTAXES}")

  @classmethod
  def from_workers(cls, workers: WorkerConfig, **episode_fields: Any) -> "PoolConfig":
    """`workers`' fields plus the episode-level ones (env, max_turns, invalid_action, penalty, action_syntax)."""
    worker_fields = {f.name for f in dataclasses.fields(WorkerConfig)}
    clash = sorted(set(episode_fields) & worker_fields)
    if clash:
      raise TypeError(f"PoolConfig.from_workers: {clash} are worker fields; set them on the WorkerConfig")
    return cls(**{name: getattr(workers, name) for name in worker_fields}, **episode_fields)

  def reset_options(self) -> dict[str, Any]:
    opts = dict(invalid_action=self.invalid_action, penalty=float(self.penalty), max_obs_bytes=self.max_obs_bytes)
    if self.max_turns is not None:
      opts["max_turns"] = self.max_turns
    if self.action_syntax != "line":  # the default is not sent: a line-syntax pool talks to any server
      opts["action_syntax"] = self.action_syntax
    return opts


# ----------------------------------------------------------------------------------------------
# Connections to one worker.


class WorkerCrashed(ConnectionError):
  """The worker's connection broke (the process died or closed it)."""


class WorkerTimeout(TimeoutError):
  """No reply within the deadline."""


class AdmissionTimeout(WorkerTimeout):
  """A full worker admitted no new episode within the reset timeout (the worker itself is fine)."""


class RemoteError(RuntimeError):
  def __init__(self, kind: str, message: str):
    super().__init__(f"{kind}: {message}")
    self.kind = kind


class HandshakeError(ValueError):
  """A worker answered hello with another env, env version or protocol than the pool expects."""


def check_handshake(expected_env: str | None, hellos: Sequence[tuple[str, dict[str, Any]]]) -> None:
  """Every worker (address, hello reply) serves the same env at the same version, speaking this protocol.

  `expected_env`: the env's registered name when this process can resolve it (a remote pool's env may exist
  only on its servers). Raises `HandshakeError` naming each worker that differs."""
  bad = [f"{where} speaks protocol {h.get('protocol')!r}" for where, h in hellos
         if h.get("protocol") != P.PROTOCOL_VERSION]
  if bad:
    raise HandshakeError(f"env workers: {'; '.join(bad)}; this client speaks protocol {P.PROTOCOL_VERSION}: run "
                         "servers from the same jaxagent version as the trainer")
  if expected_env is not None:
    bad = [f"{where} serves {h.get('env')!r}" for where, h in hellos if h.get("env") != expected_env]
    if bad:
      raise HandshakeError(f"env workers: {'; '.join(bad)}, but this pool runs env {expected_env!r}")
  versions = {h.get("version") for _, h in hellos}
  if len(versions) > 1:
    shown = "; ".join(f"{where}: {h.get('env')} {h.get('version')}" for where, h in hellos)
    raise HandshakeError(f"env workers serve different versions of the env ({shown}): episodes would differ by "
                         "worker; deploy one version everywhere")
  modes = {h.get("episode_sandbox") for _, h in hellos}
  if len(modes) > 1:  # observations differ between modes (paths, exit codes): a replay must not cross them
    shown = "; ".join(f"{where}: {h.get('episode_sandbox')}" for where, h in hellos)
    raise HandshakeError(f"env workers confine episodes differently ({shown}); run every server with the same "
                         "--episode-sandbox")


def _connect(address: str, timeout: float) -> socket.socket:
  kind, _, rest = address.partition(":")
  deadline = time.monotonic() + timeout
  while True:
    try:
      if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(rest)
      elif kind == "tcp":
        h, _, port = rest.rpartition(":")
        sock = socket.create_connection((h, int(port)), timeout=timeout)
        sock.settimeout(None)
      else:
        raise ValueError(f"address {address!r}: use unix:/path or tcp:host:port")
      return sock
    except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError) as e:
      if time.monotonic() > deadline:
        raise WorkerCrashed(f"cannot connect to {address}: {e}") from None
      time.sleep(0.05)


class SocketConnection:
  """One multiplexed connection: calls return futures resolved by a reader thread, matched by request id."""

  def __init__(self, address: str, timeout: float, max_inflight: int):
    self.address = address
    self.sock = _connect(address, timeout)
    self._ids = itertools.count()
    self._pending: dict[int, concurrent.futures.Future] = {}
    self._lock = threading.Lock()
    self._send_lock = threading.Lock()
    self._slots = threading.BoundedSemaphore(max_inflight)
    self.closed = False
    threading.Thread(target=self._read, daemon=True, name=f"conn-{address}").start()

  def _read(self) -> None:
    error: Exception = WorkerCrashed(f"worker at {self.address} closed the connection")
    try:
      while True:
        req_id, ok, value = P.validate_reply(P.read_frame(self.sock))
        with self._lock:
          fut = self._pending.pop(req_id, None)
        if fut is None:
          continue  # a reply to a call that already timed out, or to id -1.
        if ok:
          fut.set_result(value)
        else:
          fut.set_exception(RemoteError(value["kind"], str(value.get("message", ""))))
    except P.ProtocolError as e:
      error = WorkerCrashed(f"worker at {self.address} sent a bad frame: {e}")
    except (ConnectionError, OSError):
      pass
    self.close(error)

  def call(self, op: str, args: dict[str, Any], timeout: float) -> concurrent.futures.Future:
    if not self._slots.acquire(timeout=timeout):
      fut = concurrent.futures.Future()
      fut.set_exception(WorkerTimeout(f"{op}: no free request slot within {timeout:.1f}s (backpressure)"))
      return fut
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.add_done_callback(lambda _: self._slots.release())
    req_id = next(self._ids)
    with self._lock:
      if self.closed:
        fut.set_exception(WorkerCrashed(f"worker at {self.address} is gone"))
        return fut
      self._pending[req_id] = fut
    try:
      with self._send_lock:
        self.sock.sendall(P.pack(P.request(req_id, op, args)))
    except OSError as e:
      self.close(WorkerCrashed(f"send to {self.address} failed: {e}"))
    return fut

  def close(self, error: Exception | None = None) -> None:
    with self._lock:
      self.closed = True
      pending, self._pending = self._pending, {}
    for fut in pending.values():
      if not fut.done():
        fut.set_exception(error or WorkerCrashed("connection closed"))
    try:
      self.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    self.sock.close()


class InProcessConnection:
  """Same interface, no socket: ops run on a thread pool against a `Host` in this process.

  A hung step cannot be killed in-process; its thread is abandoned and the instance table replaced. Ops run
  on daemon threads so that an abandoned one never keeps the interpreter from exiting (a ThreadPoolExecutor
  joins its threads at exit: one hung `time.sleep(3600)` would hold the process for an hour).
  """

  def __init__(self, env: str, max_inflight: int, episode_sandbox: str = "auto"):
    from envs.server import Host  # pylint: disable=g-import-not-at-top
    self.host = Host(env, episode_sandbox=episode_sandbox)
    self._running = threading.BoundedSemaphore(max_inflight)  # at most max_inflight ops run at once
    self.closed = False

  def call(self, op: str, args: dict[str, Any], timeout: float) -> concurrent.futures.Future:
    from envs.server import RequestError  # pylint: disable=g-import-not-at-top
    out: concurrent.futures.Future = concurrent.futures.Future()

    if self.closed:
      out.set_exception(WorkerCrashed("in-process connection is closed"))
      return out

    def run():
      with self._running:
        try:
          out.set_result(P.msgpack.unpackb(P.msgpack.packb(self.host.handle(op, args), use_bin_type=True)))
        except RequestError as e:
          out.set_exception(RemoteError(e.kind, str(e)))
        except Exception as e:  # pylint: disable=broad-except
          out.set_exception(RemoteError("env_error", f"{type(e).__name__}: {e}"))
    threading.Thread(target=run, name="inproc-env", daemon=True).start()
    return out

  def close(self, error: Exception | None = None) -> None:
    self.closed = True


# ----------------------------------------------------------------------------------------------
# Worker processes.


def bwrap_available() -> bool:
  """bubblewrap can make sandboxes here (probed once per process)."""
  return _sandbox.bwrap_error() is None


def import_roots(module: str | None) -> list[tuple[str, str]]:
  """Where this process imports `module` from: (sys.path entry, top-level file or directory name) pairs.

  A worker needs exactly these to import a user env (`package.module:ATTR` or an entry point): the local pool
  puts the entries on an unsandboxed worker's PYTHONPATH and binds the top-level package (only it, read-only)
  into a bubblewrap sandbox. Empty for None and for `envs` itself, which every worker has.
  """
  if module is None:
    return []
  top = module.split(".")[0]
  if top == ENVS_DIR.name:
    return []
  spec = importlib.util.find_spec(top)
  if spec is None:
    return []
  if spec.submodule_search_locations:  # a package (several directories for a namespace package)
    locations = list(spec.submodule_search_locations)
  elif spec.has_location and spec.origin:
    locations = [spec.origin]
  else:
    return []  # built into the interpreter
  out = []
  for loc in locations:
    path = Path(loc).resolve()
    if (str(path.parent), path.name) not in out:
      out.append((str(path.parent), path.name))
  return out


def bwrap_command(sock_dir: str, argv: Sequence[str], user_modules: Sequence[tuple[str, str]] = ()) -> list[str]:
  """bubblewrap: no network, read-only root of system dirs + the interpreter + envs/, private /tmp.

  Nothing else of the host filesystem (home, the repo, datasets, eval answers) exists inside. `user_modules`
  (`import_roots` pairs) are the top-level packages of a user env, each bound read-only under its own
  /opt/userN on PYTHONPATH; nothing else of their sys.path entry is visible, so such a package can use the
  standard library, msgpack and `envs` only (for more, use the docker pool with an image that has them, or
  sandbox='none').
  """
  import msgpack  # pylint: disable=g-import-not-at-top
  python = os.path.realpath(sys.executable)
  cmd = [*_sandbox.bwrap_base(nests=True), *_sandbox.system_binds()]  # it nests each episode's sandbox
  cmd += ["--ro-bind", str(ENVS_DIR), "/opt/jaxagent/envs",
          "--ro-bind", str(Path(msgpack.__file__).parent), "/opt/site/msgpack",
          "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", sock_dir, "/run/jaxagent"]
  pythonpath = ["/opt/jaxagent", "/opt/site"]
  for i, (root, name) in enumerate(user_modules):
    cmd += ["--ro-bind", os.path.join(root, name), f"/opt/user{i}/{name}"]
    pythonpath.append(f"/opt/user{i}")
  cmd += ["--setenv", "PYTHONPATH", os.pathsep.join(pythonpath), "--setenv", "HOME", "/tmp",
          "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
          "--chdir", "/tmp", "--remount-ro", "/", python]
  return cmd + list(argv)


class _SharedExclusive:
  """Steps hold the worker shared; a retry after a crash holds it exclusively, so a crash during the retry is
  known to be caused by that step and other episodes' retries are not charged for it."""

  def __init__(self):
    self._cond = threading.Condition()
    self._readers = 0
    self._writer = False

  def acquire(self, exclusive: bool) -> None:
    with self._cond:
      if exclusive:
        self._cond.wait_for(lambda: not self._writer)
        self._writer = True
        self._cond.wait_for(lambda: self._readers == 0)
      else:
        self._cond.wait_for(lambda: not self._writer)
        self._readers += 1

  def release(self, exclusive: bool) -> None:
    with self._cond:
      if exclusive:
        self._writer = False
      else:
        self._readers -= 1
      self._cond.notify_all()


class Worker(abc.ABC):
  """One worker: start(), address, connection, kill(). Subclasses differ in how the process runs."""

  def __init__(self, cfg: PoolConfig, index: int):
    self.cfg, self.index = cfg, index
    # What the worker process is told to serve: an entry-point env as its module:attr (see _registry).
    self.env_ref = cfg.env if cfg.kind == "remote" else _registry.worker_name(cfg.env)
    self.generation = 0
    self.conn: Any = None
    self.access = _SharedExclusive()
    self.hello: dict[str, Any] = {}  # the worker's answer to hello at the pool's start

  @abc.abstractmethod
  def start(self) -> None:
    """Starts (or restarts) the worker and connects `self.conn`."""

  def kill(self) -> None:
    if self.conn is not None:
      self.conn.close()

  def pid(self) -> int | None:
    return None

  def alive(self) -> bool:
    """The worker's process (container) still runs, as far as can be told without a call."""
    return True


class InProcessWorker(Worker):
  def start(self) -> None:
    self.conn = InProcessConnection(self.cfg.env, self.cfg.max_inflight, self.cfg.sandbox)


class LocalWorker(Worker):
  """A subprocess `python -m envs.server` on a unix socket, inside bubblewrap when available.

  A user env (`package.module:ATTR` or an entry point) is imported by the worker from where this process
  imports it (`import_roots`): unsandboxed, those sys.path entries go first on the worker's PYTHONPATH (after
  envs/'s parent, before the inherited PYTHONPATH); in bubblewrap, only its top-level package is bound in.
  """

  _warned = False

  def __init__(self, cfg: PoolConfig, index: int, sandbox: bool):
    super().__init__(cfg, index)
    self.sandbox = sandbox
    self.roots = import_roots(_registry.module_of(cfg.env))
    self.proc: subprocess.Popen | None = None
    self.dir = tempfile.mkdtemp(prefix=f"envw{index}-")

  def start(self) -> None:
    sock = os.path.join(self.dir, "w.sock")
    if os.path.exists(sock):
      os.unlink(sock)
    argv = ["-m", "envs.server", self.env_ref, "--episode-sandbox", "bwrap" if self.sandbox else "none", "--socket"]
    if self.sandbox:
      cmd = bwrap_command(self.dir, argv + ["/run/jaxagent/w.sock"], self.roots)
      env = None
    else:
      cmd = [sys.executable] + argv + [sock]
      path = [str(ENVS_DIR.parent)] + [root for root, _ in self.roots] + [os.environ.get("PYTHONPATH", "")]
      env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in dict.fromkeys(path) if p))
    self.log = open(os.path.join(self.dir, "stderr.log"), "ab")
    self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=env,
                                 start_new_session=True)
    deadline = time.monotonic() + self.cfg.start_timeout_s
    while not os.path.exists(sock):
      if self.proc.poll() is not None or time.monotonic() > deadline:
        self.kill()
        tail = Path(self.dir, "stderr.log").read_text(errors="replace")[-2000:]
        raise WorkerCrashed(f"local worker {self.index} did not start (exit {self.proc.returncode}): {tail}")
      time.sleep(0.02)
    self.conn = SocketConnection(f"unix:{sock}", self.cfg.start_timeout_s, self.cfg.max_inflight)

  def pid(self) -> int | None:
    return self.proc.pid if self.proc else None

  def alive(self) -> bool:
    return self.proc is not None and self.proc.poll() is None

  def kill(self) -> None:
    super().kill()
    if self.proc is not None and self.proc.poll() is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      self.proc.wait(timeout=10)
    if getattr(self, "log", None) is not None:
      self.log.close()


class RemoteWorker(Worker):
  """A worker someone else runs (Kubernetes, another host): we only reconnect, never restart it."""

  def start(self) -> None:
    self.conn = SocketConnection(self.cfg.addresses[self.index], self.cfg.start_timeout_s, self.cfg.max_inflight)

  def pid(self) -> int | None:
    return self.hello.get("pid")  # the server's own process id (on its host), from its hello


class DockerWorker(Worker):
  """A container: --network none, read-only root, tmpfs /tmp, memory/CPU/pids limits, no capabilities, no
  credentials or host mounts except the directory holding its unix socket.

  Envs that run programs get a sandbox per episode nested in the container (`envs._sandbox`: bubblewrap, which
  the env image has). Creating its namespaces needs system calls docker's default seccomp profile refuses, so
  such a container runs with `envs/docker/seccomp-episodes.json` instead: those calls allowed, and refused what
  neither a worker nor an episode needs (kernel modules, keyrings, bpf, perf, io_uring, ptrace, setns, ...). It
  keeps every other limit (no capabilities, no new privileges, no network, read-only root, memory/CPU/pids
  limits). sandbox='none' keeps docker's default profile and runs episodes unconfined in their container (the
  control).

  The container runs `python3 -m envs.server ENV` from `docker_image`; nothing of the host's Python path is
  mounted, so a user env reaches it through the image. Build one FROM the env image (envs/docker/setup.sh
  builds `jaxagent-envs:latest`; its PYTHONPATH is /opt/jaxagent, its base has python3 and msgpack, no pip):

      FROM jaxagent-envs:latest
      COPY my_pkg /opt/jaxagent/my_pkg

  (on a base image with pip: `USER root`, `COPY . /src`, `RUN pip install /src`, `USER 1000` instead), then
  `docker build --network none -t my-envs .` and run the pool with `docker_image="my-envs"` and
  `env="my_pkg.my_env:SPEC"` (or the name of its `jaxagent.envs` entry point: the container is given the entry
  point's `module:attr`, so the package only has to be importable there, not installed).
  """

  def __init__(self, cfg: PoolConfig, index: int, client):
    super().__init__(cfg, index)
    self.client = client
    self.container = None
    try:  # only a container whose env runs programs nests sandboxes (and needs seccomp opened for them)
      self.needs_boxes = _registry.get(cfg.env).needs_sandbox
    except Exception:  # pylint: disable=broad-except  (an env known only inside the image)
      self.needs_boxes = True
    self.dir = tempfile.mkdtemp(prefix=f"envd{index}-")
    os.chmod(self.dir, 0o777)  # the container runs as uid 1000 and creates its socket here.

  def start(self) -> None:
    sock = os.path.join(self.dir, "w.sock")
    if os.path.exists(sock):
      os.unlink(sock)
    boxes = "none" if self.cfg.sandbox == "none" else "bwrap"
    security = ["no-new-privileges"] + ([f"seccomp={SECCOMP_EPISODES.read_text()}"]
                                        if boxes == "bwrap" and self.needs_boxes else [])
    self.container = self.client.containers.run(
        self.cfg.docker_image, [self.env_ref, "--socket", "/run/jaxagent/w.sock", "--episode-sandbox", boxes],
        detach=True, network_mode="none", read_only=True, tmpfs={"/tmp": "rw,size=64m,mode=1777"},
        mem_limit=self.cfg.docker_memory, nano_cpus=int(self.cfg.docker_cpus * 1e9),
        pids_limit=self.cfg.docker_pids, cap_drop=["ALL"], security_opt=security,
        volumes={self.dir: {"bind": "/run/jaxagent", "mode": "rw"}}, environment={}, auto_remove=False,
        labels={"jaxagent.env": self.cfg.env}, name=f"jaxagent-env-{uuid.uuid4().hex[:10]}")
    deadline = time.monotonic() + self.cfg.start_timeout_s
    while not os.path.exists(sock):
      self.container.reload()
      if self.container.status in ("exited", "dead") or time.monotonic() > deadline:
        logs = self.container.logs()[-2000:].decode(errors="replace")
        self.kill()
        raise WorkerCrashed(f"docker worker {self.index} did not start: {logs}")
      time.sleep(0.05)
    self.conn = SocketConnection(f"unix:{sock}", self.cfg.start_timeout_s, self.cfg.max_inflight)

  def alive(self) -> bool:
    if self.container is None:
      return False
    try:
      self.container.reload()
    except Exception:  # pylint: disable=broad-except  (gone)
      return False
    return self.container.status == "running"

  def kill(self) -> None:
    super().kill()
    if self.container is not None:
      try:
        self.container.remove(force=True)
      except Exception as e:  # already gone
        log.debug("container remove: %s", e)
      self.container = None


# ----------------------------------------------------------------------------------------------
# The pool.


@dataclasses.dataclass
class _Slot:
  worker: int
  instance: str
  task: Task | None = None
  seed: int = 0
  actions: list[str] = dataclasses.field(default_factory=list)
  generation: int = -1
  done: bool = False
  termination: Termination | None = None
  started: float = 0.0
  cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
  first_generation: int = -1  # the worker's generation when the episode began
  seen: list[tuple] = dataclasses.field(default_factory=list)  # what reset and each step answered (replay check)


class ReplayDiverged(RuntimeError):
  """A replayed episode answered differently from the original: the env is not deterministic."""


def _seen(reply: dict[str, Any]) -> tuple:
  """The part of a worker's reply a replay must reproduce (timings and other info may differ)."""
  obs = reply.get("observation", reply)
  return (obs.get("text"), obs.get("truncated"), reply.get("done"), reply.get("termination"))


class Pool:
  """`num_slots` episode slots over `cfg.num_workers` workers, one client API for every kind."""

  def __init__(self, cfg: PoolConfig, num_slots: int):
    if num_slots < 1:
      raise ValueError(f"num_slots={num_slots}: must be >= 1")
    self.cfg = cfg
    self.sandboxed = False
    self.spare_swaps = 0  # restarts served by a warm spare (cfg.warm_spares)
    self._spares: list[Worker] = []  # started, handshaken, ready to take a failed worker's place
    self._spare_lock = threading.Lock()
    self._spare_names = itertools.count(cfg.num_workers)
    self._spare_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pool-spare")
    self._closed = False
    self.workers = [self._make_worker(i) for i in range(cfg.num_workers)]
    self._worker_locks = [threading.Lock() for _ in self.workers]  # a worker's restart vs. its (generation, conn)
    self._count_lock = threading.Lock()
    self.replays = 0               # episodes replayed on a restarted worker, since the pool started
    self.replay_divergences = 0    # of which answered differently (ended as replay_diverged)
    self.slots = [_Slot(worker=i % cfg.num_workers, instance=f"s{i}") for i in range(num_slots)]
    self._executor = concurrent.futures.ThreadPoolExecutor(max(4, min(num_slots, 64)), thread_name_prefix="pool")
    # Resets run apart: one waiting for a full server to admit it must not hold a thread the steps of admitted
    # episodes need (those steps are what ends episodes and frees the server).
    self._reset_executor = concurrent.futures.ThreadPoolExecutor(max(4, min(num_slots, 64)),
                                                                 thread_name_prefix="pool-reset")
    self.version: str | None = None
    # Instance names are unique per episode and per pool (a late close never hits a new episode, and pools of
    # several trainer processes share servers without colliding).
    self._episodes = itertools.count()
    self._tag = uuid.uuid4().hex[:8]
    self.admission_waits = 0  # resets that waited for a full server to admit them (back-pressure)
    try:
      for w in self.workers:
        w.start()
      futures = [w.conn.call("hello", {}, cfg.start_timeout_s) for w in self.workers]
      hellos = [(getattr(w.conn, "address", f"worker {i}"), self._wait(f, cfg.start_timeout_s))
                for i, (w, f) in enumerate(zip(self.workers, futures))]
      for w, (_, hello) in zip(self.workers, hellos):
        w.hello = hello
      try:
        expected = _registry.get(cfg.env).name
      except Exception:  # pylint: disable=broad-except  (a remote pool's env may exist only on its servers)
        expected = None
      check_handshake(expected, hellos)
      unconfined = [where for where, h in hellos if h.get("episode_sandbox") == "none"]
      if unconfined and cfg.sandbox != "none":
        raise HandshakeError(f"env workers {', '.join(unconfined)} run each episode's programs unconfined "
                             f"(--episode-sandbox none) but this pool's sandbox is {cfg.sandbox!r}: start them "
                             "with --episode-sandbox bwrap, or set sandbox='none' (env.pool.sandbox) to accept it")
    except BaseException:
      self.close()
      raise
    self.version = hellos[0][1]["version"]
    self._first_hello = hellos[0][1]  # what restarted workers and spares must match
    for _ in range(cfg.warm_spares):
      self._submit_spare()

  def _unsandboxed(self, why: str) -> None:
    """An env whose actions run real programs never runs outside a sandbox unless sandbox='none' says so."""
    from envs._registry import get  # pylint: disable=g-import-not-at-top
    if get(self.cfg.env).needs_sandbox and self.cfg.sandbox != "none":
      raise RuntimeError(f"env {self.cfg.env!r} runs real programs and needs a sandbox, but {why}; use the local "
                         "pool with bubblewrap or the docker pool (sandbox='none', env.pool.sandbox in a jaxagent "
                         "config, runs it unsandboxed anyway)")

  def _make_worker(self, i: int) -> Worker:
    cfg = self.cfg
    if cfg.kind == "inprocess":
      if i == 0:
        self._unsandboxed("kind='inprocess' (env.pool.kind) runs it in this process")
      return InProcessWorker(cfg, i)
    if cfg.kind == "remote":
      if len(cfg.addresses) < cfg.num_workers:
        raise ValueError(f"addresses (env.pool.addresses) has {len(cfg.addresses)} entries for "
                         f"num_workers={cfg.num_workers}")
      return RemoteWorker(cfg, i)
    if cfg.kind == "docker":
      if i == 0:
        import docker  # pylint: disable=g-import-not-at-top
        self._docker = docker.DockerClient(base_url=cfg.docker_host or docker_host())
        self.sandboxed = True
      return DockerWorker(cfg, i, self._docker)
    if i == 0:
      want = cfg.sandbox != "none"
      self.sandboxed = want and bwrap_available()
      if cfg.sandbox == "bwrap" and not self.sandboxed:
        raise RuntimeError("sandbox='bwrap' (env.pool.sandbox) but bubblewrap is not installed or cannot create "
                           "namespaces "
                           "here (apt-get install -y bubblewrap)")
      if want and not self.sandboxed:
        self._unsandboxed("bubblewrap is unavailable here")
        warnings.warn("envs local pool: bubblewrap unavailable, env workers run UNSANDBOXED (network, host "
                      "filesystem reachable); install bubblewrap or use the docker pool", RuntimeWarning,
                      stacklevel=3)
    return LocalWorker(cfg, i, self.sandboxed)

  @staticmethod
  def _wait(fut: concurrent.futures.Future, timeout: float, cancel: threading.Event | None = None):
    deadline = time.monotonic() + timeout
    while True:
      left = deadline - time.monotonic()
      if left <= 0:
        raise WorkerTimeout(f"no reply within {timeout:.1f}s")
      try:
        return fut.result(timeout=min(left, 0.05) if cancel is not None else left)
      except concurrent.futures.TimeoutError:
        if cancel is not None and cancel.is_set():
          raise _Cancelled() from None

  def _restart(self, index: int, seen_generation: int) -> None:
    """Kill and restart worker `index` unless someone already did since `seen_generation`."""
    with self._worker_locks[index]:
      w = self.workers[index]
      if w.generation != seen_generation:
        return
      if self._closed:
        raise WorkerCrashed(f"worker {index}: the pool is closed")
      w.kill()
      spare = self._take_spare()
      if spare is not None:  # a warm spare takes the place (and the generation count) of the failed worker
        log.warning("env worker %d (%s) replaced by a warm spare", index, self.cfg.kind)
        spare.generation, spare.access = w.generation + 1, w.access
        self.workers[index] = spare
        self._discard(w)
        with self._count_lock:
          self.spare_swaps += 1
        self._submit_spare()
        return
      log.warning("restarting env worker %d (%s)", index, self.cfg.kind)
      w.generation += 1
      w.start()
      if self.cfg.kind == "remote":  # a reconnect may reach another server (a new pod of a rolling update)
        try:
          self._greet(w, w.conn.address)
        except HandshakeError as e:
          w.conn.close()
          raise WorkerCrashed(f"worker {index} reconnected to a different server: {e}") from None

  def _greet(self, w: Worker, where: str) -> None:
    """Asks a (re)started worker hello and checks it against the pool's first worker as the pool started
    (`check_handshake`: env, version, protocol, episode-sandbox mode)."""
    hello = self._wait(w.conn.call("hello", {}, self.cfg.start_timeout_s), self.cfg.start_timeout_s)
    first = self._first_hello
    check_handshake(first.get("env"), [("the pool's workers", first), (where, hello)])
    w.hello = hello

  def _add_spare(self) -> None:
    """Starts one more warm spare (on the spare thread); one that fails to start or to match is dropped."""
    if self._closed:
      return
    w = self._make_worker(next(self._spare_names))
    try:
      w.start()
      self._greet(w, "warm spare")
    except Exception as e:  # pylint: disable=broad-except  (a restart without a spare still works)
      log.error("warm spare worker did not start: %s", e)
      self._discard(w)
      return
    with self._spare_lock:
      if not self._closed:
        self._spares.append(w)
        return
    self._discard(w)

  @staticmethod
  def _discard(w: Worker) -> None:
    try:
      w.kill()
    except Exception as e:  # pylint: disable=broad-except
      log.debug("kill worker: %s", e)
    d = getattr(w, "dir", None)
    if d:
      shutil.rmtree(d, ignore_errors=True)

  def _take_spare(self) -> Worker | None:
    while True:
      with self._spare_lock:
        if not self._spares:
          return None
        w = self._spares.pop(0)
      if w.alive():  # outside the lock: for docker, a call to the daemon
        return w
      self._discard(w)  # a spare that died while it waited

  def _submit_spare(self) -> None:
    try:
      self._spare_executor.submit(self._add_spare)
    except RuntimeError:  # the pool closed meanwhile
      pass

  def _restarts(self, s: _Slot) -> int:
    """Restarts of its worker that the episode lived through (info["worker_restarts"])."""
    return self.workers[s.worker].generation - s.first_generation if s.first_generation >= 0 else 0

  def _link(self, index: int) -> tuple[int, Any]:
    """Worker `index`'s (generation, connection), read together: never the new generation with the old
    connection (a call would fail there and restart the fresh worker again) nor the reverse (an episode would
    run on the new worker without its replay). Waits while the worker restarts."""
    with self._worker_locks[index]:
      w = self.workers[index]
      return w.generation, w.conn

  # -- episode API

  def reset(self, slot: int, task: Task, seed: int) -> Observation:
    return self.reset_many([slot], [task], [seed])[0]

  def reset_many(self, slots: Sequence[int], tasks: Sequence[Task], seeds: Sequence[int], *,
                 return_exceptions: bool = False) -> list[Observation | Exception]:
    """Resets several slots concurrently.

    A slot whose reset fails (the env raised: `RemoteError`; the worker died or hung through every retry:
    `WorkerCrashed` / `WorkerTimeout`) ends its episode at once (`reset_termination`); with
    `return_exceptions` its entry is that exception instead of an `Observation` (as in `asyncio.gather`),
    otherwise the first failure is raised after every slot has been tried.
    """
    for i in slots:
      if not 0 <= i < len(self.slots):
        raise IndexError(f"slot {i}: pool has slots 0..{len(self.slots) - 1}")
    out = list(self._reset_executor.map(self._reset_one, slots, tasks, seeds))
    if not return_exceptions:
      for x in out:
        if isinstance(x, Exception):
          raise x
    return out

  def _reset_one(self, i: int, task: Task, seed: int) -> Observation | Exception:
    s = self.slots[i]
    if s.task is not None and not s.done:  # the slot's previous episode was abandoned open: free its instance
      self._close_instance(s)
    s.instance = f"{self._tag}-s{i}e{next(self._episodes)}"
    s.task, s.seed, s.actions, s.done, s.termination = task, int(seed), [], False, None
    s.seen = []
    s.cancel = threading.Event()
    s.started = time.monotonic()
    try:
      return self._try_reset(i, s)
    except (RemoteError, WorkerCrashed, WorkerTimeout) as e:
      log.warning("reset of slot %d (task %s) failed: %s", i, task.id, e)
      s.done, s.termination = True, reset_termination(e)
      return e

  def _admitted_reset(self, conn, s: _Slot) -> dict[str, Any]:
    """The reset call, waiting (with backoff) while the worker is full: its `--max-episodes` admission bound is
    the back-pressure a pool sees. Past `reset_timeout_s` the episode fails as an env timeout."""
    deadline = time.monotonic() + self.cfg.reset_timeout_s  # for admission; each call has its full timeout
    pause, waited = 0.02, False
    while True:
      try:
        return self._wait(conn.call("reset", self._reset_args(s), self.cfg.reset_timeout_s), self.cfg.reset_timeout_s)
      except RemoteError as e:
        if e.kind != "too_many_instances":
          raise
        if not waited:
          waited = True
          with self._count_lock:
            self.admission_waits += 1
        left = deadline - time.monotonic()
        if left <= 0:
          raise AdmissionTimeout(f"worker {s.worker} admitted no new episode within {self.cfg.reset_timeout_s:.0f}s "
                                 f"(it is full: {e})") from None
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.5)

  def _try_reset(self, i: int, s: _Slot) -> Observation:
    for attempt in range(self.cfg.max_retries + 1):
      gen, conn = self._link(s.worker)
      try:
        obs = self._admitted_reset(conn, s)
        s.generation = s.first_generation = gen
        s.seen = [_seen(obs)]
        return Observation(obs["text"], obs["truncated"], obs["original_size"])
      except AdmissionTimeout:
        raise  # the worker is full, not broken: no restart
      except (WorkerCrashed, WorkerTimeout) as e:
        if self.cfg.kind == "remote" and attempt == self.cfg.max_retries:
          raise
        log.warning("reset of slot %d failed (%s); restarting worker %d", i, e, s.worker)
        self._safe_restart(s.worker, gen)
    raise WorkerCrashed(f"slot {i}: reset failed {self.cfg.max_retries + 1} times")

  def _reset_args(self, s: _Slot) -> dict[str, Any]:
    return dict(instance=s.instance, task=s.task.to_wire(), seed=s.seed, options=self.cfg.reset_options())

  def step(self, slot: int, action: str) -> StepResult:
    return self.step_many([slot], [action])[0]

  def step_many(self, slots: Sequence[int], actions: Sequence[str]) -> list[StepResult]:
    """Step several slots concurrently; every slot gets its answer within its timeouts."""
    if len(slots) != len(actions):
      raise ValueError(f"{len(slots)} slots but {len(actions)} actions")
    for i in slots:
      if not 0 <= i < len(self.slots):
        raise IndexError(f"slot {i}: pool has slots 0..{len(self.slots) - 1}")
      if self.slots[i].task is None:
        raise RuntimeError(f"slot {i}: step before reset")
    return list(self._executor.map(self._step_one, slots, actions))

  def reset_async(self, slot: int, task: Task, seed: int) -> concurrent.futures.Future:
    """`reset_many([slot], ...)` without waiting: a future of the Observation, or of the exception that ended
    the episode at reset (see `reset_many`; the future itself never raises for those)."""
    self._check_slot(slot)
    return self._reset_executor.submit(self._reset_one, slot, task, seed)

  def step_async(self, slot: int, action: str) -> concurrent.futures.Future:
    """`step(slot, action)` without waiting: a future of its StepResult (every fault is a result, as in
    `step_many`). Steps of one slot must not overlap; steps of different slots run concurrently."""
    self._check_slot(slot)
    if self.slots[slot].task is None:
      raise RuntimeError(f"slot {slot}: step before reset")
    return self._executor.submit(self._step_one, slot, action)

  def _check_slot(self, i: int) -> None:
    if not 0 <= i < len(self.slots):
      raise IndexError(f"slot {i}: pool has slots 0..{len(self.slots) - 1}")

  def cancel(self, slot: int) -> None:
    """End slot's episode as `cancelled`; an in-flight step returns at once."""
    self.slots[slot].cancel.set()

  def _close_instance(self, s: _Slot) -> None:
    """Frees the episode's instance on its worker (best effort, not awaited: the name is never reused)."""
    conn = self.workers[s.worker].conn
    if conn is not None and not conn.closed:
      conn.call("close", dict(instance=s.instance), 1.0)

  def _end(self, s: _Slot, termination: Termination, outcome: Outcome, text: str, **info) -> StepResult:
    s.done, s.termination = True, termination
    self._close_instance(s)
    return StepResult(Observation.capped(text, self.cfg.max_obs_bytes), {}, True, termination,
                      dict(info, worker_restarts=self._restarts(s)), outcome=outcome)

  def _step_one(self, i: int, action: str) -> StepResult:
    s = self.slots[i]
    if s.done:  # the episode's own termination again; nothing ran (no observation to append)
      return StepResult(Observation(""), {}, True, s.termination, dict(already_done=True),
                        outcome=Outcome(s.termination))
    if s.cancel.is_set():
      return self._end(s, CANCELLED, Outcome.CANCELLED, "cancelled")
    crashes = 0
    t0 = time.monotonic()
    while True:
      left = self.cfg.episode_timeout_s - (time.monotonic() - s.started)
      if left <= 0:
        return self._end(s, ENV_TIMEOUT, Outcome.ENV_TIMEOUT, f"episode exceeded {self.cfg.episode_timeout_s:.0f}s",
                         timeout="episode")
      w = self.workers[s.worker]
      exclusive = crashes > 0
      w.access.acquire(exclusive)
      gen, conn = self._link(s.worker)
      try:
        if s.generation != gen:  # the worker restarted since this episode began: replay it there.
          if not self.cfg.replay_on_crash:
            return self._end(s, ENV_ERROR, Outcome.WORKER_CRASH, "env worker crashed")
          self._replay(s, gen, conn)
        timeout = min(self.cfg.action_timeout_s, left)
        reply = self._wait(conn.call("step", dict(instance=s.instance, action=action), timeout), timeout,
                           s.cancel)
        result = StepResult.from_wire(reply)
        s.actions.append(action)
        s.seen.append(_seen(reply))
        if result.done:
          s.done, s.termination = True, result.termination
          self._close_instance(s)  # a finished episode holds no instance (a server admits a bounded number)
        return dataclasses.replace(result, info=dict(result.info, worker_restarts=self._restarts(s),
                                                     env_s=time.monotonic() - t0))
      except _Cancelled:
        return self._end(s, CANCELLED, Outcome.CANCELLED, "cancelled")
      except WorkerTimeout:
        # The worker is stuck in this step; only killing it frees it. Its other episodes are replayed.
        self._safe_restart(s.worker, gen)
        which = "episode" if left < self.cfg.action_timeout_s else "action"
        return self._end(s, ENV_TIMEOUT, Outcome.ENV_TIMEOUT, f"env step exceeded {timeout:.1f}s", timeout=which)
      except WorkerCrashed as e:
        crashes += 1
        if not self.cfg.replay_on_crash:
          self._safe_restart(s.worker, gen)
          return self._end(s, ENV_ERROR, Outcome.WORKER_CRASH, f"env worker crashed: {e}")
        if crashes > self.cfg.max_retries:
          self._safe_restart(s.worker, gen)
          return self._end(s, RETRIES_EXHAUSTED, Outcome.RETRIES_EXHAUSTED, f"env worker crashed {crashes} times")
        self._safe_restart(s.worker, gen)
      except RemoteError as e:
        return self._end(s, ENV_ERROR, Outcome.ENV_ERROR, f"env error: {e}", error=str(e))
      except ReplayDiverged as e:
        return self._end(s, ENV_ERROR, Outcome.REPLAY_DIVERGED, f"env replay diverged: {e}", error=str(e))
      finally:
        w.access.release(exclusive)

  def _safe_restart(self, index: int, gen: int) -> None:
    try:
      self._restart(index, gen)
    except WorkerCrashed as e:  # the next call on this worker fails again and is counted there.
      log.error("restart of worker %d failed: %s", index, e)

  def _replay(self, s: _Slot, gen: int, conn) -> None:
    """Re-runs the episode on the restarted worker; raises ReplayDiverged if any answer differs."""
    with self._count_lock:
      self.replays += 1
    calls = [("reset", self._reset_args(s), self.cfg.reset_timeout_s)] + [
        ("step", dict(instance=s.instance, action=a), self.cfg.action_timeout_s) for a in s.actions]
    for k, (op, args, timeout) in enumerate(calls):
      got = _seen(self._wait(conn.call(op, args, timeout), timeout))
      if got != s.seen[k]:
        with self._count_lock:
          self.replay_divergences += 1
        what = "reset" if k == 0 else f"step {k} ({s.actions[k - 1][:64]!r})"
        raise ReplayDiverged(f"{what} answered {got[0]!r:.120}, the episode saw {s.seen[k][0]!r:.120}")
    s.generation = gen

  def worker_pids(self) -> list[int | None]:
    return [w.pid() for w in self.workers]

  def close(self) -> None:
    with self._spare_lock:
      self._closed = True
      spares, self._spares = self._spares, []
    for w in spares:
      self._discard(w)
    for i in range(len(getattr(self, "workers", []))):
      lock = self._worker_locks[i] if hasattr(self, "_worker_locks") else threading.Lock()
      with lock:  # after a restart that was under way (it installs its worker, or sees the pool closed)
        self._discard(self.workers[i])
    self._spare_executor.shutdown(wait=False, cancel_futures=True)
    self._executor.shutdown(wait=False, cancel_futures=True)
    self._reset_executor.shutdown(wait=False, cancel_futures=True)

  def __enter__(self) -> "Pool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class _Cancelled(Exception):
  pass


def reset_termination(error: Exception) -> Termination:
  """The termination of an episode whose reset failed with `error` (see `Pool.reset_many`)."""
  if isinstance(error, WorkerTimeout):
    return ENV_TIMEOUT
  if isinstance(error, WorkerCrashed):
    return RETRIES_EXHAUSTED
  return ENV_ERROR


SECCOMP_EPISODES = ENVS_DIR / "docker" / "seccomp-episodes.json"  # docker workers that nest episode sandboxes


def docker_host() -> str:
  """The daemon to use: $JAXAGENT_DOCKER_HOST, else the private one envs/docker/setup.sh starts."""
  return os.environ.get("JAXAGENT_DOCKER_HOST", "unix:///run/jaxagent-docker/docker.sock")


def make_pool(num_slots: int, cfg: WorkerConfig | None = None, **overrides) -> Pool:
  """`make_pool(8, env="calculator", kind="local")`.

  Args:
    num_slots: episode slots.
    cfg: a PoolConfig, or a WorkerConfig (the episode fields then come from `overrides` or their defaults);
      None: PoolConfig().
    **overrides: any PoolConfig field, worker-level or episode-level.
  """
  if cfg is None:
    cfg = PoolConfig()
  elif not isinstance(cfg, PoolConfig):
    episode = {f.name for f in dataclasses.fields(PoolConfig)} - {f.name for f in dataclasses.fields(WorkerConfig)}
    cfg = PoolConfig.from_workers(cfg, **{k: overrides.pop(k) for k in list(overrides) if k in episode})
  return Pool(dataclasses.replace(cfg, **overrides), num_slots)
