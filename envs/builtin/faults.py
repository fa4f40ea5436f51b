"""Fault injection for tests of workers and pools: `ok`, `echo TEXT`, `sleep SECONDS`, `hang`, `crash`,
`raise`, `big BYTES`, `random` (a fresh random token: not replayable), `done`; isolation probes `read PATH`,
`write PATH`, `net HOST:PORT` that report `allowed ...` or `denied ...` (what an untrusted action could do from
inside the worker). A task whose
payload has `"reset": "raise" | "crash" | "hang"` fails that way in reset.

Tool latency: a task whose payload has `"latency": {"median_s": m, "sigma": s, "cap_s": c}` makes every step
(valid or not) take a lognormal time with median m and shape s, capped at c, drawn from the episode's seed and
turn (the same episode waits the same times on every run). `tasks(..., latency_median_s=0.02,
latency_sigma=1.5)` makes such tasks: real tools (test runners, compilers, search) have heavy-tailed latency.

Not a task: it exists so every failure mode a real env can have is reproducible on demand.
"""

from __future__ import annotations

import math
import os
import random
import socket
import time

from envs._api import (COMPLETED, ActionParser, Call, Env, EnvError, EnvSpec, InvalidAction, Observation,
                       StepResult, Task)


class FaultEnv(Env):
  name = "faults"
  description = "fault injection for tests: ok, echo, sleep, hang, crash, raise, big, random, done"
  parser = ActionParser(tools=("ok", "echo", "sleep", "hang", "crash", "raise", "big", "random", "done", "read",
                               "write", "net"), max_chars=128)

  def __init__(self, max_turns: int = 64, **kwargs):
    super().__init__(max_turns=max_turns, **kwargs)

  def _reset(self, task: Task, seed: int) -> str:
    self.count = 0
    self.seed = seed
    fault = (task.payload or {}).get("reset")
    if fault == "raise":
      raise EnvError("injected reset fault")
    if fault == "crash":
      os._exit(17)
    if fault == "hang":
      time.sleep(3600)
    return f"faults {task.id} seed {seed}"

  def step(self, action_text: str) -> StepResult:
    latency = (self.task.payload or {}).get("latency") if self.task is not None else None
    if latency:
      draw = random.Random(f"{self.seed}/{self.turn}").lognormvariate(math.log(latency["median_s"]),
                                                                      latency.get("sigma", 0.0))
      time.sleep(min(draw, latency.get("cap_s", 5.0)))
    return super().step(action_text)

  def _step(self, call: Call) -> StepResult:
    self.count += 1
    if call.name == "hang":
      time.sleep(3600)
    if call.name == "sleep":
      time.sleep(float(call.arg))
    if call.name == "crash":
      os._exit(17)
    if call.name == "raise":
      raise EnvError("injected tool fault")
    if call.name == "big":
      try:
        n = int(call.arg)
      except ValueError:
        raise InvalidAction(f"big needs a byte count, got {call.arg!r}") from None
      return StepResult(Observation("x" * n), {}, False, None, {})
    if call.name == "random":
      return StepResult(Observation(os.urandom(8).hex()), {}, False, None, {})
    if call.name in ("read", "write", "net"):
      return StepResult(Observation(_probe(call.name, call.arg)), {}, False, None, {})
    if call.name == "done":
      return StepResult(Observation("bye"), {"outcome": 1.0}, True, COMPLETED)
    text = call.arg if call.name == "echo" else f"ok {self.count}"
    return StepResult(Observation(text), {}, False, None, {})


def _probe(kind: str, arg: str) -> str:
  try:
    if kind == "read":
      with open(arg, "rb") as f:
        return f"allowed read {len(f.read(1 << 16))} bytes"
    if kind == "write":
      with open(arg, "w") as f:
        f.write("pwned")
      return "allowed write"
    host, _, port = arg.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=2):
      return "allowed net"
  except (OSError, ValueError) as e:
    return f"denied {type(e).__name__}: {e}"


def tasks(split: str, n: int, seed: int = 0, latency_median_s: float = 0.0, latency_sigma: float = 0.0,
          latency_cap_s: float = 5.0) -> list[Task]:
  """`n` tasks; with `latency_median_s` > 0 every step of their episodes sleeps a lognormal time (see above)."""
  if latency_median_s < 0 or latency_sigma < 0 or latency_cap_s < 0:
    raise ValueError(f"latency_median_s={latency_median_s}, latency_sigma={latency_sigma}, "
                     f"latency_cap_s={latency_cap_s}: must be >= 0")
  payload = ({"latency": {"median_s": latency_median_s, "sigma": latency_sigma, "cap_s": latency_cap_s}}
             if latency_median_s > 0 else {})
  return [Task(id=f"fault-{split}-{seed}-{i}", split=split, payload=dict(payload), version="0") for i in range(n)]


def demo(task: Task, seed: int = 0) -> list[str]:
  return ["ok", "echo hi", "done"]


SPEC = EnvSpec(name="faults", description=FaultEnv.description, make=FaultEnv, tasks=tasks, demo=demo,
               version_sources=(FaultEnv,))
