"""Per-episode sandboxes for envs whose actions run programs (terminal, code_repair), and safe artifact reads
for their verifiers.

An episode owns a private tree on the worker's side: `work/` (the agent's working directory, `/work` inside)
and `tmp/` (`/tmp` inside). Each program an action runs starts in a fresh bubblewrap sandbox over that tree
alone:
  * its own user, pid, network, IPC, UTS and mount namespaces, no capabilities, a new session;
  * the system directories and the interpreter read-only, `/work` and `/tmp` writable (or `/work` read-only);
  * nothing else of the worker: not the env code and its data (held-out material, pristine sources), not the
    worker's socket, not a sibling episode's tree, no /proc of the worker;
  * when the program exits or times out, everything it started dies with its pid namespace.
The same mechanism runs nested inside the local pool's worker sandbox and inside docker worker containers; a
nested sandbox cannot mount a fresh /proc there, so none gets one (shells and Python do not need it).

Verifiers never execute in the agent's tree. They read final artifacts from the worker side (`read_artifact`,
`listing`: regular files only, no symlinks followed, size-capped) and run what must run (code_repair's tests)
in a sandbox of their own over a read-only copy.

Mode "none" (the pool's sandbox='none', asked for explicitly): programs run unconfined in the same tree, in
their own process group (killed whole at exit or timeout). Plain stdlib: this runs inside workers.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Mapping, Sequence

MODES = ("auto", "bwrap", "none")
OUTPUT_CAP_BYTES = 1 << 16  # of a program's output kept in memory; the rest is read, counted and dropped
ARTIFACT_CAP_BYTES = 1 << 20  # a verifier reads at most this much of one artifact
_SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc/alternatives")


class SandboxUnavailable(RuntimeError):
  """mode='bwrap' was asked for but bubblewrap cannot create a sandbox here."""


@dataclasses.dataclass(frozen=True)
class Completed:
  """What a program did: the first OUTPUT_CAP_BYTES of stdout and stderr merged, the total byte count, and
  the exit code (None: killed at its timeout)."""
  output: bytes
  total: int
  code: int | None


def _probe_argv() -> list[str]:
  return [*bwrap_base(nests=False), *system_binds(), "--dev", "/dev", "--remount-ro", "/", "true"]  # as episodes


@functools.lru_cache(maxsize=None)
def bwrap_error() -> str | None:
  """Why an episode sandbox cannot be made here (None: it can). Probed once per process."""
  if shutil.which("bwrap") is None:
    return "bubblewrap (bwrap) is not installed"
  try:
    probe = subprocess.run(_probe_argv(), capture_output=True, timeout=10)
  except (OSError, subprocess.TimeoutExpired) as e:
    return f"bwrap did not run: {e}"
  if probe.returncode != 0:
    return f"bwrap cannot create namespaces here: {probe.stderr.decode(errors='replace').strip()[:300]}"
  return None


@functools.lru_cache(maxsize=None)
def _userns_flags() -> tuple[str, ...]:
  """`--disable-userns` where it works (bwrap >= 0.8, and a writable /proc/sys/user: not in a docker container):
  a program in the sandbox cannot make user namespaces of its own (the kernel surface they open)."""
  flags = ("--unshare-user", "--disable-userns")
  try:
    probe = subprocess.run(["bwrap", "--unshare-all", *flags, *system_binds(), "--dev", "/dev", "true"],
                           capture_output=True, timeout=10)
  except (OSError, subprocess.TimeoutExpired):
    return ()
  return flags if probe.returncode == 0 else ()


def bwrap_base(*, nests: bool) -> list[str]:
  """The flags every bubblewrap sandbox here starts with (the one home of that rule): every namespace unshared (no
  network), killed with its parent, its own session (no TIOCSTI into the caller's terminal), an empty environment.

  nests=False (a program an episode runs): also every capability dropped and, where bwrap supports it, no user
  namespace of its own. nests=True (an env worker, envs/pool.py): keeps both, on purpose, because the worker makes
  each episode's sandbox inside itself, and a nested bwrap must write its uid map and create a user namespace:
  under `--cap-drop ALL` it fails with "setting up uid map: Operation not permitted", under `--disable-userns`
  with ENOSPC (measured, bubblewrap 0.8). Every episode inside the worker still gets the nests=False flags.
  """
  flags = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
  return flags if nests else [*flags, *_userns_flags(), "--cap-drop", "ALL"]


def resolve(mode: str) -> str:
  """'auto' -> 'bwrap' when it works here, else 'none'; 'bwrap' -> 'bwrap' or SandboxUnavailable."""
  if mode not in MODES:
    raise ValueError(f"episode sandbox mode={mode!r}: not one of {MODES}")
  if mode == "none":
    return "none"
  why = bwrap_error()
  if why is None:
    return "bwrap"
  if mode == "bwrap":
    raise SandboxUnavailable(f"episode sandbox 'bwrap' asked for, but {why} (install bubblewrap; in docker the "
                             "worker container needs user namespaces, see envs.pool.DockerWorker)")
  return "none"


def system_binds() -> list[str]:
  out: list[str] = []
  for d in _SYSTEM_DIRS:
    if os.path.islink(d):
      out += ["--symlink", os.readlink(d), d]
    elif os.path.isdir(d):
      out += ["--ro-bind", d, d]
  prefix = os.path.realpath(sys.base_prefix)  # the interpreter, when it lives outside /usr (pyenv, conda)
  if not any(prefix == d or prefix.startswith(d + "/") for d in _SYSTEM_DIRS):
    out += ["--ro-bind", prefix, prefix]
  return out


def _hide_envs() -> list[str]:
  """An empty tmpfs over the envs package when a system bind holds it (installed into the interpreter's prefix):
  env code and data (held-out material) are never inside an episode's sandbox."""
  envs_dir = os.path.realpath(Path(__file__).parent)
  binds = system_binds()
  bound = [a for flag, a in zip(binds, binds[1:]) if flag == "--ro-bind"]
  if any(envs_dir == d or envs_dir.startswith(d.rstrip("/") + "/") for d in bound):
    return ["--tmpfs", envs_dir, "--remount-ro", envs_dir]
  return []


def python() -> str:
  """This interpreter's path, valid inside a sandbox too (its prefix is bound at the same path)."""
  return os.path.realpath(sys.executable)


class EpisodeSandbox:
  """One episode's private tree and the confinement its programs run in (see the module docstring).

  Args:
    mode: "bwrap", "none" or "auto" (bwrap when it works here).
    binds: read-only extras, {path inside (under /opt/): path on the worker} (a test runner); `add_file` adds
      files of the sandbox's own.
    read_only: `/work` is mounted read-only (a verifier's run over a copy of the agent's artifacts).
  """

  def __init__(self, mode: str = "auto", *, binds: Mapping[str, str | os.PathLike] = (), read_only: bool = False,
               prefix: str = "episode-"):
    self.mode = resolve(mode)
    self.binds = {str(k): str(v) for k, v in dict(binds).items()}
    for inside in self.binds:
      if not inside.startswith("/opt/"):
        raise ValueError(f"bind target {inside!r}: extras go under /opt/")
    self.read_only = read_only
    self.base = Path(tempfile.mkdtemp(prefix=prefix))
    self.work = self.base / "work"   # the agent's tree, as the worker (and the verifier) sees it
    self.tmp = self.base / "tmp"
    self.work.mkdir()
    self.tmp.mkdir()
    self.closed = False

  def add_file(self, inside: str, text: str) -> None:
    """A read-only file at `inside` (under /opt/) for the sandbox's programs: written outside the agent's tree,
    removed with the sandbox."""
    if not inside.startswith("/opt/"):
      raise ValueError(f"bind target {inside!r}: extras go under /opt/")
    path = self.base / "files" / inside[len("/opt/"):].replace("/", "_")
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    self.binds[inside] = str(path)

  def path(self, inside: str) -> str:
    """Where a program run by this sandbox finds `inside`: "/work", "/tmp" or a bind target (mode none: the
    worker-side path, since nothing is mounted)."""
    if self.mode == "bwrap":
      return inside
    return {"/work": str(self.work), "/tmp": str(self.tmp), **self.binds}[inside]

  def argv(self, program: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The command line that runs `program` confined (mode bwrap) or as is (mode none)."""
    if self.mode == "none":
      return list(program)
    cmd = [*bwrap_base(nests=False), *system_binds(), *_hide_envs(), "--dev", "/dev",
           "--ro-bind" if self.read_only else "--bind", str(self.work), "/work", "--bind", str(self.tmp), "/tmp"]
    for inside, host in self.binds.items():
      cmd += ["--ro-bind", host, inside]
    for k, v in {**self._env(), **dict(env or {})}.items():
      cmd += ["--setenv", k, v]
    return cmd + ["--chdir", "/work", "--remount-ro", "/", "--", *program]

  def _env(self) -> dict[str, str]:
    if self.mode == "none":
      return {"PATH": "/usr/bin:/bin", "HOME": str(self.work), "TMPDIR": str(self.tmp), "LC_ALL": "C"}
    return {"PATH": "/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp", "LC_ALL": "C"}

  def run(self, program: Sequence[str], *, timeout: float, stdin: bytes = b"",
          env: Mapping[str, str] | None = None) -> Completed:
    """Runs `program` in the sandbox (cwd /work) with `stdin`; raises OSError when it cannot start."""
    if self.mode == "none":
      return run_capped(list(program), cwd=self.work, env={**self._env(), **dict(env or {})}, stdin=stdin,
                        timeout=timeout)
    return run_capped(self.argv(program, env), cwd=self.work, env={"PATH": "/usr/bin:/bin"}, stdin=stdin,
                      timeout=timeout)

  def close(self) -> None:
    if not self.closed:
      self.closed = True
      rmtree(self.base)


class SandboxedEpisodes:
  """Mixin for envs whose episode owns an `EpisodeSandbox` in `self.box` (made in `_reset`): `root`, the
  agent's tree on the worker's side, and `close`, which removes the sandbox and everything in it."""

  box: EpisodeSandbox | None = None

  @property
  def root(self) -> Path | None:
    """The episode's tree on the worker's side (/work inside its sandbox); None between episodes."""
    return None if self.box is None else self.box.work

  def close(self) -> None:
    if self.box is not None:
      self.box.close()
      self.box = None


def rmtree(path: Path) -> None:
  """Removes a tree whatever an agent did to its permissions (chmod 000 or 400 directories), best effort,
  never raising. A permission is only ever changed on a directory inside the tree (never through a link, never
  on `path`'s parent), and each path is retried once."""
  top = os.path.normpath(path)
  retried: set[str] = set()

  def inside(p: str) -> bool:
    return os.path.normpath(p).startswith(top + os.sep)

  def own_dir(p: str) -> None:
    if (inside(p) or os.path.normpath(p) == top) and os.path.isdir(p) and not os.path.islink(p):
      os.chmod(p, 0o700)

  def fix(_func, p, _exc):
    p = os.fsdecode(p)
    if p in retried or not (inside(p) or os.path.normpath(p) == top):
      return
    retried.add(p)
    try:
      if inside(p):
        own_dir(os.path.dirname(p))  # the directory holding p: readable, searchable, writable again
      if os.path.isdir(p) and not os.path.islink(p):
        own_dir(p)
        shutil.rmtree(p, onerror=fix)
      elif os.path.lexists(p):
        os.unlink(p)
    except OSError:
      pass

  try:
    shutil.rmtree(path, onerror=fix)
  except Exception:  # cleanup: never the reason an episode fails
    pass


def run_capped(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], stdin: bytes = b"",
               timeout: float) -> Completed:
  """Runs `argv` in a new process group (session), stdout and stderr merged, at most OUTPUT_CAP_BYTES kept.

  When the program exits or times out the whole group is SIGKILLed: background jobs die with it (under bwrap,
  everything in the sandbox's pid namespace dies with its first process too).
  """
  proc = subprocess.Popen(list(argv), cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True, env=dict(env))
  kept, total = bytearray(), 0

  def drain():
    nonlocal total
    try:
      while chunk := proc.stdout.read1(1 << 16):
        total += len(chunk)
        if len(kept) < OUTPUT_CAP_BYTES:
          kept.extend(chunk[:OUTPUT_CAP_BYTES - len(kept)])
    except (OSError, ValueError):  # the pipe was closed under us (an escaped process kept it open)
      pass

  reader = threading.Thread(target=drain, name="sandbox-output", daemon=True)
  reader.start()
  try:
    if stdin:
      proc.stdin.write(stdin)
    proc.stdin.close()
  except OSError:  # the program exited without reading its input
    pass
  try:
    code = proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    code = None
  finally:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is already empty
      pass
    proc.wait()
  reader.join(timeout=1.0)
  proc.stdout.close()
  return Completed(bytes(kept), total, code)


# ----------------------------------------------------------------------------------------------
# Reading an agent's artifacts from outside its sandbox.


def replace_file(path: Path, text: str) -> None:
  """Replaces `path` by a new regular file holding `text` (UTF-8, mode 644), never writing through whatever an
  agent left at that name (a link, a FIFO); OSError when it cannot (e.g. the agent's code put a directory
  there), with nothing left behind."""
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".edit-")
  try:
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, path)
  except OSError:
    os.unlink(tmp)
    raise


def read_artifact(root: Path, rel: str, max_bytes: int = ARTIFACT_CAP_BYTES) -> bytes | None:
  """The bytes of regular file `rel` under `root`, or None when it is missing, is not a regular file or has a
  symlink anywhere on its path (an agent's link to a worker file, or a FIFO that would block a reader, is
  refused, never followed). At most `max_bytes` are read."""
  parts = [p for p in Path(rel).parts if p not in ("", ".")]
  if not parts or any(p == ".." for p in parts) or Path(rel).is_absolute():
    return None
  flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
  try:
    fd = os.open(root, flags | os.O_DIRECTORY)
  except OSError:
    return None
  try:
    for part in parts[:-1]:
      nxt = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
      os.close(fd)
      fd = nxt
    leaf = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
  except OSError as e:
    if e.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EACCES, errno.ENXIO):
      raise
    return None
  finally:
    os.close(fd)
  try:
    if not stat.S_ISREG(os.fstat(leaf).st_mode):
      return None
    with os.fdopen(leaf, "rb", closefd=False) as f:
      return f.read(max_bytes)
  finally:
    os.close(leaf)


def listing(root: Path, max_entries: int = 4096) -> dict[str, str]:
  """{relative path: "file" | "dir" | "link" | "other" | "unreadable"} of the tree under `root`, symlinks
  listed, never followed; a directory that cannot be read is listed as "unreadable" (a verifier must not judge
  a tree it could not see whole); at most `max_entries` entries (an agent can make millions)."""
  out: dict[str, str] = {}

  def unreadable(e: OSError) -> None:
    if e.filename is not None:
      out[os.path.relpath(e.filename, root)] = "unreadable"

  for top, dirs, files in os.walk(root, followlinks=False, onerror=unreadable):
    for name in sorted(dirs) + sorted(files):
      path = os.path.join(top, name)
      try:
        mode = os.lstat(path).st_mode
      except FileNotFoundError:
        continue
      except OSError:  # a directory that can be listed but not searched (chmod 400): its entries are hidden
        out[os.path.relpath(path, root)] = "unreadable"
        continue
      out[os.path.relpath(path, root)] = ("link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else
                                          "file" if stat.S_ISREG(mode) else "other")
      if len(out) >= max_entries:
        return out
    dirs[:] = [d for d in dirs if out.get(os.path.relpath(os.path.join(top, d), root)) == "dir"]
  return out
