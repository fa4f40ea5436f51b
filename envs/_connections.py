"""Connections to env workers and their errors: the handshake, a unix-socket connection and an in-process one.
Part of `envs.pool`, which re-exports every public name.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import socket
import threading
import time
from typing import Any, Sequence

from envs import _protocol as P


log = logging.getLogger("envs.pool")

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
  """Same interface, no socket: ops run on daemon threads against a `Host` in this process.

  The threads are kept (at most `max_inflight`, started as ops queue up, and stopped by `close`): starting a
  thread per op cost about 4 ms of each env call on the 2-core machine while XLA held both cores. A hung op
  cannot be killed in-process: its thread is abandoned (the pool restarts the worker: a new connection, a new
  instance table) and, being a daemon, never keeps the interpreter from exiting (a ThreadPoolExecutor joins its
  threads at exit: one hung `time.sleep(3600)` would hold the process for an hour).
  """

  def __init__(self, env: str, max_inflight: int, episode_sandbox: str = "auto"):
    from envs.server import Host
    self.host = Host(env, episode_sandbox=episode_sandbox)
    self.max_inflight = max_inflight
    self.closed = False
    self._ops: queue.SimpleQueue = queue.SimpleQueue()  # (op, args, future), or None: a thread's stop
    self._lock = threading.Lock()
    self._threads = 0   # started and not stopped
    self._waiting = 0   # threads waiting for an op
    self._queued = 0    # ops no thread has taken yet

  def call(self, op: str, args: dict[str, Any], timeout: float) -> concurrent.futures.Future:
    out: concurrent.futures.Future = concurrent.futures.Future()
    with self._lock:
      if self.closed:
        out.set_exception(WorkerCrashed("in-process connection is closed"))
        return out
      self._ops.put((op, args, out))
      self._queued += 1
      start = self._queued > self._waiting and self._threads < self.max_inflight
      self._threads += start
    if start:
      threading.Thread(target=self._serve, name="inproc-env", daemon=True).start()
    return out

  def _serve(self) -> None:
    from envs.server import RequestError
    while True:
      with self._lock:
        self._waiting += 1
      item = self._ops.get()
      with self._lock:
        self._waiting -= 1
        if item is None:
          self._threads -= 1
          return
        self._queued -= 1
      op, args, out = item
      try:
        out.set_result(P.msgpack.unpackb(P.msgpack.packb(self.host.handle(op, args), use_bin_type=True)))
      except RequestError as e:
        out.set_exception(RemoteError(e.kind, str(e)))
      except Exception as e:
        out.set_exception(RemoteError("env_error", f"{type(e).__name__}: {e}"))

  def close(self, error: Exception | None = None) -> None:
    """No new op; queued ones fail as the socket connection's pending ones do, idle threads stop (a busy one
    stops after its op; a hung one stays abandoned)."""
    with self._lock:
      self.closed = True
      pending, stops = [], self._threads
      while True:
        try:
          item = self._ops.get_nowait()
        except queue.Empty:
          break
        if item is not None:
          pending.append(item[2])
      self._queued = 0
      for _ in range(stops):
        self._ops.put(None)
    for fut in pending:
      if not fut.done():
        fut.set_exception(error or WorkerCrashed("in-process connection is closed"))


