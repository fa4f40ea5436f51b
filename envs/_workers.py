"""The four kinds of env worker (in-process, local subprocess sandboxed by bubblewrap, Docker container,
remote address) and the sandbox and Docker helpers they use. Part of `envs.pool`, which re-exports every
public name.
"""

from __future__ import annotations

import abc
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

from envs import _registry
from envs import _sandbox


from envs._connections import InProcessConnection, SocketConnection, WorkerCrashed
from envs._pool_config import ENVS_DIR, PoolConfig

log = logging.getLogger("envs.pool")

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


def bwrap_command(sock_dir: str, argv: Sequence[str], user_modules: Sequence[tuple[str, str]] = (),
                  data_dirs: Mapping[str, str | os.PathLike] | None = None, site_packages: bool = False) -> list[str]:
  """bubblewrap: no network, read-only root of system dirs + the interpreter + envs/, private /tmp.

  Nothing else of the host filesystem (home, the repo, datasets, eval answers) exists inside. `user_modules`
  (`import_roots` pairs) are the top-level packages of a user env, each bound read-only under its own
  /opt/userN on PYTHONPATH; nothing else of their sys.path entry is visible, so such a package can use the
  standard library, msgpack and `envs` only (for more, use the docker pool with an image that has them, or
  sandbox='none'). `data_dirs` ({VARIABLE: directory}, `EnvSpec.data_dirs`) are bound read-only at the same path,
  each VARIABLE set to its directory. `site_packages` (`EnvSpec.site_packages`: an agent's `openai` client) binds
  this interpreter's site-packages read-only at the same paths, on PYTHONPATH after the env's own packages.
  """
  import msgpack
  python = os.path.realpath(sys.executable)
  cmd = [*_sandbox.bwrap_base(nests=True), *_sandbox.system_binds()]  # it nests each episode's sandbox
  cmd += ["--ro-bind", str(ENVS_DIR), "/opt/jaxagent/envs",
          "--ro-bind", str(Path(msgpack.__file__).parent), "/opt/site/msgpack",
          "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", sock_dir, "/run/jaxagent"]
  pythonpath = ["/opt/jaxagent", "/opt/site"]
  for i, (root, name) in enumerate(user_modules):
    cmd += ["--ro-bind", os.path.join(root, name), f"/opt/user{i}/{name}"]
    pythonpath.append(f"/opt/user{i}")
  for var, path in dict(data_dirs or {}).items():
    path = os.path.realpath(path)
    cmd += ["--ro-bind", path, path, "--setenv", var, path]
  if site_packages:
    import site
    for path in dict.fromkeys(os.path.realpath(p) for p in site.getsitepackages() if os.path.isdir(p)):
      cmd += ["--ro-bind", path, path]
      pythonpath.append(path)
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
    try:
      spec = _registry.get(cfg.env)
    except Exception:  # the worker reports an unknown env when it starts
      spec = None
    self.data_dirs = {k: str(v) for k, v in (spec.data_dirs() if spec and spec.data_dirs else {}).items()}
    # An agent's openai client or an MCP server's `mcp` import installed packages.
    self.site_packages = bool(spec and spec.site_packages) or bool(getattr(cfg, "tools", ()))
    self.proc: subprocess.Popen | None = None
    self.dir = tempfile.mkdtemp(prefix=f"envw{index}-")

  def start(self) -> None:
    sock = os.path.join(self.dir, "w.sock")
    if os.path.exists(sock):
      os.unlink(sock)
    argv = ["-m", "envs.server", self.env_ref, "--episode-sandbox", "bwrap" if self.sandbox else "none", "--socket"]
    if self.sandbox:
      cmd = bwrap_command(self.dir, argv + ["/run/jaxagent/w.sock"], self.roots, self.data_dirs, self.site_packages)
      env = None
    else:
      cmd = [sys.executable] + argv + [sock]
      path = [str(ENVS_DIR.parent)] + [root for root, _ in self.roots] + [os.environ.get("PYTHONPATH", "")]
      env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in dict.fromkeys(path) if p), **self.data_dirs)
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
    except Exception:  # an env known only inside the image
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
    except Exception:  # gone
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



SECCOMP_EPISODES = ENVS_DIR / "docker" / "seccomp-episodes.json"  # docker workers that nest episode sandboxes


def docker_host() -> str:
  """The daemon to use: $JAXAGENT_DOCKER_HOST, else the private one envs/docker/setup.sh starts."""
  return os.environ.get("JAXAGENT_DOCKER_HOST", "unix:///run/jaxagent-docker/docker.sock")

