"""Generate → execute → filter (docs/design.md §2.7), for any registered env; the `jaxagent tasks` verbs call
these.

* `generate`: the env's own task generator (`EnvSpec.tasks`), written one task per line (JSONL).
* `execute`: the env's scripted reference solution (`EnvSpec.demo`) of every task, run through an env worker
  pool (sandboxed like training) with a slot per in-flight episode; a slot takes the next task as soon as its
  episode ends. A task the reference does not solve is *broken* (it does not reproduce, its verifier rejects the
  reference, or the env fails) and is reported with the reason, never trained on.
* the policy filter (`jaxagent tasks filter --policy`) samples a trained run k times per task with
  `jaxagent/train/rollouts.py:policy_outcomes` (a layer above this one: it needs the trainer) and drops tasks
  the policy always or never solves (p = 0 or 1: no GRPO signal).

Needs no JAX and nothing of the trainer (docs/design.md §3.1).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence


import envs
from envs import pool as pool_lib

SOLVED = "solved"
# Faults of the infrastructure, not of the task (the trainer's default train.exclude_terminations): such a task
# is run once more, and if it fails so again it is reported as unknown, neither kept nor broken.
INFRASTRUCTURE = ("worker_failure", *envs.INFRASTRUCTURE_TERMINATIONS)  # a worker that failed the reset, too
BROKEN_REASONS = ("demo_error", "reset_error", "reference_failed", "unfinished") + tuple(
    t for t in envs.TERMINATIONS if t != "completed" and t not in INFRASTRUCTURE)


@dataclasses.dataclass(frozen=True)
class Executed:
  """The reference solution's run on one task."""
  task: envs.Task
  reason: str               # "solved" or why the task is broken (one of BROKEN_REASONS)
  seconds: float
  detail: str = ""          # the env's error or the verifier's evidence, cut short

  @property
  def solved(self) -> bool:
    return self.reason == SOLVED

  @property
  def infrastructure(self) -> bool:
    return self.reason in INFRASTRUCTURE


# ----------------------------------------------------------------------------------------------
# Task files.


def write_jsonl(path: Path | str, env: str, tasks: Iterable[envs.Task]) -> int:
  """Writes tasks one per line (`Task.to_wire()` plus the env name); returns how many."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  n = 0
  tmp = path.with_name(path.name + ".tmp")
  with tmp.open("w") as f:
    for t in tasks:
      f.write(json.dumps({"env": env, **t.to_wire()}, sort_keys=True) + "\n")
      n += 1
  tmp.replace(path)  # a crash mid-write leaves the old file, never half a new one
  return n


def read_jsonl(path: Path | str) -> tuple[str | None, list[envs.Task]]:
  """(the env named in the file or None, its tasks). Errors name the file and line."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no such task file (write one with `jaxagent tasks generate`)")
  env_names, tasks = set(), []
  for n, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      tasks.append(envs.Task.from_wire(record))
      env = record.get("env")
      if env is not None and not isinstance(env, str):
        raise TypeError(f"env={env!r} is not a name")
    except (ValueError, TypeError, KeyError, AttributeError) as e:
      raise ValueError(f"{path}:{n}: not a task record ({type(e).__name__}: {e})") from None
    if env is not None:
      env_names.add(env)
  if len(env_names) > 1:
    raise ValueError(f"{path}: tasks of several envs {sorted(env_names)}; one env per file")
  return (env_names.pop() if env_names else None), tasks


# ----------------------------------------------------------------------------------------------
# Generate and execute.


def generate(env: str, split: str, n: int, seed: int = 0, **options: Any) -> list[envs.Task]:
  if n < 0:
    raise ValueError(f"n={n}: must be >= 0")
  return envs.get(env).tasks(split, n, seed, **options)


def execute(env: str, tasks: Sequence[envs.Task], *, kind: str = "local", workers: int = 2,
            slots: int | None = None, seed: int = 0, demo_options: Mapping[str, Any] | None = None,
            progress: bool = False) -> list[Executed]:
  """Runs the reference solution of every task (see the module docstring); results in task order.

  `kind` is the worker pool (`inprocess`, `local`, `docker`); an env whose actions run programs is never run
  in process. Episode k is reset with seed `seed + k`, like the demonstrations of training. A task whose run
  failed for an infrastructure reason (`INFRASTRUCTURE`) is run once more at the end.
  """
  spec = envs.get(env)
  if spec.needs_sandbox and kind == "inprocess":
    raise ValueError(f"env {env!r} runs real programs: execute it in a sandboxed pool (kind 'local' or "
                     "'docker'), not 'inprocess'")
  out: list[Executed | None] = [None] * len(tasks)
  scripts: list[list[str]] = []
  for k, t in enumerate(tasks):
    try:
      scripts.append(list(spec.demo(t, seed + k, **dict(demo_options or {}))))
    except Exception as e:  # a stale or malformed task: report it, go on
      scripts.append([])
      out[k] = Executed(t, "demo_error", 0.0, f"{type(e).__name__}: {e}"[:500])
  todo = [k for k in range(len(tasks)) if out[k] is None]
  if not todo:
    return out  # type: ignore[return-value]
  slots = slots or 2 * workers
  max_turns = max(len(scripts[k]) for k in todo) + 1
  started: dict[int, float] = {}
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=len(tasks), initial=len(tasks) - len(todo), desc=f"execute {env}", unit="task")
  retried: set[int] = set()

  def finish(k: int, reason: str, detail: str = "") -> None:
    if reason in INFRASTRUCTURE and k not in retried:
      retried.add(k)
      pending.append(k)  # once more, after the others
      return
    out[k] = Executed(tasks[k], reason, time.perf_counter() - started[k], detail[:500])
    if bar is not None:
      bar.update(1)

  with pool_lib.make_pool(slots, env=env, kind=kind, num_workers=workers, max_turns=max_turns) as pool:
    pending = collections.deque(todo)
    free = list(range(slots))[::-1]
    inflight: dict[concurrent.futures.Future, tuple[int, int, int]] = {}  # -> (slot, task, turn)
    while pending or inflight:
      while free and pending:
        slot, k = free.pop(), pending.popleft()
        started[k] = time.perf_counter()
        inflight[pool.reset_async(slot, tasks[k], seed + k)] = (slot, k, -1)
      done, _ = concurrent.futures.wait(inflight, return_when=concurrent.futures.FIRST_COMPLETED)
      for fut in done:
        slot, k, turn = inflight.pop(fut)
        result = fut.result()
        if isinstance(result, Exception):  # the env refused the task, or its worker died / hung
          infra = isinstance(result, (pool_lib.WorkerCrashed, pool_lib.WorkerTimeout))
          finish(k, "worker_failure" if infra else "reset_error", f"{type(result).__name__}: {result}")
        elif turn >= 0 and result.done:
          verdict = result.verdict
          if verdict is not None and verdict.passed:
            finish(k, SOLVED)
          elif result.termination == envs.COMPLETED:
            finish(k, "reference_failed", json.dumps(dict(verdict.evidence) if verdict else {}, default=str))
          else:
            finish(k, result.termination.value, result.observation.text)
        elif turn + 1 >= len(scripts[k]):
          finish(k, "unfinished", "the reference solution ended without ending the episode")
        else:
          inflight[pool.step_async(slot, scripts[k][turn + 1])] = (slot, k, turn + 1)
          continue
        free.append(slot)
  if bar is not None:
    bar.close()
  return out  # type: ignore[return-value]


def throughput_line(what: str, n: int, seconds: float) -> str:
  return f"{what}: {n} tasks in {seconds:.1f} s = {n / max(seconds, 1e-9):.1f} tasks/s"
