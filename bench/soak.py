"""Env pool soak: many concurrent episodes over local workers for a bounded time, with injected faults.

    .venv/bin/python bench/soak.py [--slots 1000 --workers 8 --seconds 180 --seed 0 --spares 0] [--json out.json]

Every slot runs episodes of the `faults` env back to back until `--seconds` have passed, then the open
episodes finish (bounded by `--drain-seconds`). An episode is a seeded script of 3-12 harmless steps (`ok`,
`echo`, `sleep 0.005`) ending with `done`; some carry one injected fault at a random step:

    crash     the worker process dies (os._exit)        expected: retries_exhausted (it dies on every retry)
    hang      the step never returns                   expected: env_timeout (the worker is killed)
    raise     a tool fault                             expected: env_error
    big       a 20,000-byte observation (not terminal) expected: completed, that observation truncated

A crash or a hang restarts the worker, and every other episode on it is replayed on the new one: those
episodes must still complete. The run fails (exit 1) when any episode is lost (no end by the drain deadline)
or mis-terminated (its end is not the one its script implies). Printed: episodes/s, steps/s, p50/p99 step
latency (submit to result, queueing included), worker restarts, replays, replay divergences, and resident
memory of this process and the workers at the start (after a warm-up) and the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import envs  # noqa: E402
from envs import pool as pool_lib  # noqa: E402

FAULTS = {"crash": "retries_exhausted", "hang": "env_timeout", "raise": "env_error"}
HARMLESS = ("ok", "echo soak", "sleep 0.005")


@dataclasses.dataclass
class Episode:
  index: int
  actions: list[str]
  expected: str
  big: bool
  step: int = 0
  resetting: bool = True
  truncated: bool = False
  submitted: float = 0.0


def script(seed: int, index: int, rates: dict[str, float]) -> Episode:
  """Episode `index`'s actions and the termination they imply (the same for every run with `seed`)."""
  rng = random.Random(f"soak/{seed}/{index}")
  actions = [rng.choice(HARMLESS) for _ in range(rng.randint(3, 12))]
  expected, big = "completed", False
  roll = rng.random()
  for fault, rate in rates.items():
    if roll < rate:
      at = rng.randrange(len(actions))
      if fault == "big":
        actions.insert(at, "big 20000")
        big = True
      else:
        actions = actions[:at] + [fault]
        expected = FAULTS[fault]
      break
    roll -= rate
  if expected == "completed":
    actions.append("done")
  return Episode(index, actions, expected, big)


def rss_mb(pid: int | None) -> float:
  """Resident memory of `pid` and its descendants (a sandboxed worker is bwrap, then the server under it)."""
  if pid is None:
    return 0.0
  total = 0.0
  try:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
      if line.startswith("VmRSS:"):
        total += int(line.split()[1]) / 1024
    for task in Path(f"/proc/{pid}/task").iterdir():
      for child in (task / "children").read_text().split():
        total += rss_mb(int(child))
  except OSError:
    pass
  return total


class Latencies:
  """Step latencies in fixed memory (log-spaced bins from 0.1 ms to 1000 s): the soak measures the pool's
  memory, not a growing list of its own."""

  def __init__(self):
    self.edges = np.logspace(-4, 3, 1401)
    self.counts = np.zeros(len(self.edges) + 1, np.int64)

  def add(self, seconds: float) -> None:
    self.counts[np.searchsorted(self.edges, seconds)] += 1

  def __len__(self) -> int:
    return int(self.counts.sum())

  def percentile_ms(self, q: float) -> float:
    if not len(self):
      return 0.0
    k = int(np.searchsorted(np.cumsum(self.counts), q / 100 * len(self)))
    return float(self.edges[min(k, len(self.edges) - 1)] * 1000)


def memory(pool: pool_lib.Pool) -> dict[str, float]:
  import os
  workers = [rss_mb(p) for p in pool.worker_pids()]
  return {"driver_mb": rss_mb(os.getpid()), "workers_mb": float(sum(workers))}


def soak(*, slots: int, workers: int, seconds: float, seed: int = 0, drain_seconds: float = 120.0,
         rates: dict[str, float] | None = None, action_timeout_s: float = 2.0, spares: int = 0, echo=print) -> dict:
  """Runs the soak; returns its report (see the module docstring)."""
  rates = rates or {"crash": 0.004, "hang": 0.004, "raise": 0.01, "big": 0.05}
  cfg = pool_lib.PoolConfig(kind="local", num_workers=workers, env="faults", action_timeout_s=action_timeout_s,
                            reset_timeout_s=30.0, episode_timeout_s=600.0, max_retries=2, max_obs_bytes=4096,
                            max_inflight=256, warm_spares=spares)
  task = envs.get("faults").tasks("train", 1)[0]
  done: queue.Queue = queue.Queue()
  latencies = Latencies()
  ended: dict[str, int] = {}  # termination -> count
  problems: list[str] = []
  with pool_lib.Pool(cfg, num_slots=slots) as pool:
    counter = iter(range(1 << 40))
    running: dict[int, Episode] = {}

    def start(slot: int) -> None:
      ep = script(seed, next(counter), rates)
      running[slot] = ep
      ep.submitted = time.monotonic()
      pool.reset_async(slot, task, ep.index).add_done_callback(lambda f, s=slot: done.put((s, f)))

    def advance(slot: int) -> None:
      ep = running[slot]
      ep.submitted = time.monotonic()
      pool.step_async(slot, ep.actions[ep.step]).add_done_callback(lambda f, s=slot: done.put((s, f)))

    def finish(slot: int, termination: str) -> None:
      ep = running.pop(slot)
      ended[termination] = ended.get(termination, 0) + 1
      if termination != ep.expected:
        problems.append(f"episode {ep.index} {ep.actions}: ended {termination}, expected {ep.expected}")
      elif ep.big and not ep.truncated:
        problems.append(f"episode {ep.index}: its 20,000-byte observation was not truncated")

    def run(until: float, admit: bool) -> None:
      while running and time.monotonic() < until:
        try:
          slot, fut = done.get(timeout=0.5)
        except queue.Empty:
          continue
        ep = running[slot]
        result = fut.result()  # a reset's Observation (or the exception that ended it), or a StepResult
        if ep.resetting:
          ep.resetting = False
          if isinstance(result, Exception):
            finish(slot, f"reset failed: {result}")
            if admit:
              start(slot)
            continue
        else:
          latencies.add(time.monotonic() - ep.submitted)
          ep.truncated |= bool(result.observation.truncated)
          ep.step += 1
          if result.done:
            finish(slot, result.termination.value)
            if admit:
              start(slot)
            continue
          if ep.step >= len(ep.actions):
            finish(slot, "still running after its script")
            if admit:
              start(slot)
            continue
        advance(slot)

    # Warm-up: one episode per slot (workers started, code paths and buffers warm), then the baseline memory.
    for slot in range(slots):
      start(slot)
    run(time.monotonic() + 120.0, admit=False)
    base = memory(pool)
    echo(f"soak: {slots} concurrent episodes over {workers} local workers (sandboxed: {pool.sandboxed}) for "
         f"{seconds:.0f} s; memory after warm-up: driver {base['driver_mb']:.0f} MB, workers "
         f"{base['workers_mb']:.0f} MB")
    warm = sum(ended.values())
    ended.clear()
    latencies = Latencies()
    t0 = time.monotonic()
    for slot in range(slots):
      if slot not in running:
        start(slot)
    run(t0 + seconds, admit=True)
    admitted_until = time.monotonic()
    run(admitted_until + drain_seconds, admit=False)
    wall = time.monotonic() - t0
    lost = len(running)
    for slot, ep in running.items():
      problems.append(f"episode {ep.index} lost: no end {drain_seconds:.0f} s after admission stopped "
                      f"(at step {ep.step} of {ep.actions})")
    end = memory(pool)
    restarts = sum(w.generation for w in pool.workers)
    replays, divergences, swaps = pool.replays, pool.replay_divergences, pool.spare_swaps
  counts = dict(ended)
  episodes = sum(counts.values())
  total = base["driver_mb"] + base["workers_mb"]
  report = {
      "slots": slots, "workers": workers, "seconds": seconds, "wall_s": wall, "episodes": episodes,
      "episodes_per_s": episodes / wall, "steps": len(latencies), "steps_per_s": len(latencies) / wall,
      "step_ms_p50": latencies.percentile_ms(50), "step_ms_p99": latencies.percentile_ms(99),
      "terminations": counts, "restarts": restarts, "replays": replays, "replay_divergences": divergences,
      "spares": spares, "spare_swaps": swaps,
      "warmup_episodes": warm, "lost": lost, "mis_terminated": len(problems) - lost, "problems": problems[:20],
      "memory_start_mb": base, "memory_end_mb": end,
      "memory_growth": (end["driver_mb"] + end["workers_mb"]) / max(total, 1e-9) - 1.0,
  }
  echo(f"episodes: {report['episodes']} in {wall:.0f} s = {report['episodes_per_s']:.1f}/s; steps "
       f"{report['steps_per_s']:.0f}/s, latency p50 {report['step_ms_p50']:.1f} ms, p99 {report['step_ms_p99']:.0f} ms")
  echo(f"terminations: {counts}")
  echo(f"worker restarts {restarts} ({swaps} by a warm spare), replays {replays}, replay divergences {divergences}")
  echo(f"memory: driver {base['driver_mb']:.0f} -> {end['driver_mb']:.0f} MB, workers {base['workers_mb']:.0f} -> "
       f"{end['workers_mb']:.0f} MB (growth {100 * report['memory_growth']:+.1f} %)")
  echo(f"lost {lost}, mis-terminated {report['mis_terminated']}" + "".join(f"\n  {p}" for p in problems[:10]))
  return report


def main(argv=None) -> int:
  import logging
  logging.getLogger("envs.pool").setLevel(logging.ERROR)  # every injected crash logs a restart: counted instead
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--slots", type=int, default=1000, help="concurrent episodes")
  parser.add_argument("--workers", type=int, default=8, help="local worker processes")
  parser.add_argument("--seconds", type=float, default=180.0, help="admission time (then the open ones finish)")
  parser.add_argument("--drain-seconds", type=float, default=120.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--spares", type=int, default=0, help="warm spare workers (env.pool.warm_spares)")
  parser.add_argument("--json", help="also write the report here")
  args = parser.parse_args(argv)
  report = soak(slots=args.slots, workers=args.workers, seconds=args.seconds, seed=args.seed,
                drain_seconds=args.drain_seconds, spares=args.spares)
  if args.json:
    Path(args.json).write_text(json.dumps(report, indent=1))
  return 1 if report["lost"] or report["mis_terminated"] else 0


if __name__ == "__main__":
  sys.exit(main())
