"""Terminal tasks: real shell commands on a small generated file tree; the verifier checks the final state.

Actions: `sh CMD` runs `/bin/sh -c CMD` in the episode's directory (timeout, output capped) and shows its
output; `done` ends the episode and runs the verifier. A command runs in its own process group, killed whole
when the command exits or times out: nothing it starts in the background outlives the step. Run it in a
sandboxed pool (local + bubblewrap, or docker): commands are arbitrary. Splits are isolated by template:
  train: create (write a file with given text), delete_logs (remove every *.log)
  tune: rename (rename a directory)       eval: count_lines (write the line count of a file to count.txt)
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from envs._api import (COMPLETED, ActionParser, Call, Env, EnvError, EnvSpec, InvalidAction, Observation,
                       StepResult, Task, Verdict, Verifier, source_version, Tool)

SPLIT_TEMPLATES = {"train": ("create", "delete_logs"), "tune": ("rename",), "eval": ("count_lines",)}
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta")
COMMAND_TIMEOUT_S = 5.0
OUTPUT_CAP_BYTES = 1 << 16  # of a command's output kept in memory; the rest is read, counted and dropped


class TerminalVerifier(Verifier):
  """Inspects the directory after the episode (read-only)."""

  version = "terminal-state-v1"

  def score(self, task: Task, final: Path) -> Verdict:
    p, root = task.payload, Path(final)
    t = p["template"]
    if t == "create":
      f = root / p["target"]
      passed = f.is_file() and f.read_text(errors="replace").strip() == p["text"]
    elif t == "delete_logs":
      passed = not list(root.rglob("*.log")) and all((root / k).exists() for k in p["files"] if not k.endswith(".log"))
    elif t == "rename":
      passed = (root / p["new"]).is_dir() and not (root / p["old"]).exists()
    else:
      f = root / "count.txt"
      passed = f.is_file() and f.read_text(errors="replace").strip() == str(p["files"][p["target"]].count("\n"))
    listing = sorted(str(q.relative_to(root)) for q in root.rglob("*"))[:64]
    return Verdict(passed, 1.0 if passed else 0.0, dict(listing=listing), self.version)


class TerminalEnv(Env):
  name = "terminal"
  description = "shell tasks on a generated file tree (sandboxed): `sh CMD`, then `done`"
  parser = ActionParser(tools=(
      Tool.with_arg("sh", "Run a shell command in the task's directory; the reply is its output.", "command"),
      Tool("done", "End the episode; the final state of the directory is checked.")), max_chars=512)

  def __init__(self, max_turns: int = 8, **kwargs):
    super().__init__(max_turns=max_turns, **kwargs)
    self.verifier = TerminalVerifier()
    self.root: Path | None = None

  def _reset(self, task: Task, seed: int) -> str:
    self.close()
    self.root = Path(tempfile.mkdtemp(prefix="term-"))
    for rel, text in task.payload["files"].items():
      (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
      (self.root / rel).write_text(text)
    return task.payload["instruction"]

  def _step(self, call: Call) -> StepResult:
    if call.name == "done":
      v = self.verifier.verify(self.task, self.root)
      return StepResult(Observation("passed" if v.passed else "failed"), {"outcome": v.reward}, True, COMPLETED,
                        verdict=v)
    if not call.arg:
      raise InvalidAction("sh needs a command")
    try:
      out, total, code = run_command(call.arg, self.root)
    except OSError as e:
      raise EnvError(f"cannot run /bin/sh: {e}") from None
    text = out.decode("utf-8", errors="replace")
    tail = f"[timeout after {COMMAND_TIMEOUT_S:g}s]" if code is None else f"[exit {code}]"
    obs = Observation(text + tail, total > len(out), total + len(tail))
    info = dict(command_timeout=True) if code is None else dict(exit=code)
    return StepResult(obs, {}, False, None, info)

  def close(self) -> None:
    if self.root is not None:
      shutil.rmtree(self.root, ignore_errors=True)
      self.root = None


def run_command(command: str, cwd: Path, timeout: float | None = None) -> tuple[bytes, int, int | None]:
  """Runs `/bin/sh -c command` in `cwd` in a new process group (session), stdout and stderr merged.

  Returns (the first OUTPUT_CAP_BYTES of output, total output bytes, exit code or None after a timeout). When
  the shell exits or times out the whole group is SIGKILLed: background jobs die with it. (A process that
  calls setsid itself leaves the group; the worker's sandbox bounds it.)
  """
  proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "LC_ALL": "C"})
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

  reader = threading.Thread(target=drain, name="terminal-output", daemon=True)
  reader.start()
  try:
    code = proc.wait(timeout=COMMAND_TIMEOUT_S if timeout is None else timeout)
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
  return bytes(kept), total, code


def tasks(split: str, n: int, seed: int = 0) -> list[Task]:
  if split not in SPLIT_TEMPLATES:
    raise ValueError(f"split={split!r}: not one of {sorted(SPLIT_TEMPLATES)}")
  rng = random.Random(f"terminal:{split}:{seed}")
  version = source_version(tasks)
  out = []
  for i in range(n):
    t = SPLIT_TEMPLATES[split][i % len(SPLIT_TEMPLATES[split])]
    a, b, c = rng.sample(WORDS, 3)
    files = {f"{a}/notes.txt": f"{b}\n", f"{b}/run.log": "log\n", f"{c}/data.txt": "".join(
        f"{w}\n" for w in rng.choices(WORDS, k=rng.randint(2, 9))), "top.log": "x\n"}
    if t == "create":
      p = dict(target=f"{a}/{c}.txt", text=b, instruction=f"create {a}/{c}.txt containing {b}")
    elif t == "delete_logs":
      p = dict(instruction="delete every .log file, keep the rest")
    elif t == "rename":
      p = dict(old=a, new=f"{a}_{c}", instruction=f"rename directory {a} to {a}_{c}")
    else:
      p = dict(target=f"{c}/data.txt", instruction=f"write the number of lines of {c}/data.txt to count.txt")
    out.append(Task(id=f"term-{split}-{seed}-{i}", split=split, payload=dict(p, template=t, files=files),
                    version=version))
  return out


def demo(task: Task, seed: int = 0) -> list[str]:
  p = task.payload
  cmd = {"create": lambda: f"printf '%s\\n' {p.get('text')} > {p.get('target')}",
         "delete_logs": lambda: "find . -name '*.log' -delete",
         "rename": lambda: f"mv {p.get('old')} {p.get('new')}",
         "count_lines": lambda: f"wc -l < {p.get('target')} > count.txt"}[p["template"]]()
  return [f"sh {cmd}", "done"]


SPEC = EnvSpec(name="terminal", description=TerminalEnv.description, make=TerminalEnv, tasks=tasks, demo=demo,
               version_sources=(TerminalEnv,), needs_sandbox=True)
