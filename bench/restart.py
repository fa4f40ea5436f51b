"""Worker recovery with and without warm spares: how long the first step after a worker dies takes.

    .venv/bin/python bench/restart.py [--kinds local docker] [--repeats 10] [--json out.json]

For each pool kind (local: bubblewrap workers; docker: containers, needs envs/docker/setup.sh) and for
`warm_spares` 0 and 1, a pool of one worker and two `faults` episodes (3 steps each) loses its worker
(SIGKILL of the process / of the container) `--repeats` times. Measured each time: the wall time of the next
`step_many` on both episodes, which restarts the worker (or swaps in the spare) and replays both episodes
there. Printed: the median and max per setting, and the ratio spare / no spare measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import envs  # noqa: E402
from envs import pool as pool_lib  # noqa: E402

FAULTS = envs.get("faults")


def _kill(p: pool_lib.Pool) -> None:
  w = p.workers[0]
  if p.cfg.kind == "docker":
    w.container.kill()
  else:
    os.killpg(w.pid(), signal.SIGKILL)
  deadline = time.monotonic() + 30
  while not w.conn.closed:
    if time.monotonic() > deadline:
      raise RuntimeError("the killed worker's connection never closed")
    time.sleep(0.005)


def measure(kind: str, spares: int, repeats: int) -> list[float]:
  extra = dict(start_timeout_s=60) if kind == "docker" else dict(sandbox="bwrap")
  times = []
  with pool_lib.make_pool(2, env="faults", kind=kind, num_workers=1, warm_spares=spares, **extra) as p:
    p.reset_many([0, 1], FAULTS.tasks("train", 2, 0), [0, 1])
    p.step_many([0, 1], ["ok", "echo warm"])
    for _ in range(repeats):
      deadline = time.monotonic() + 60
      while len(p._spares) < spares:  # a ready spare, as in steady state
        if time.monotonic() > deadline:
          raise RuntimeError("no warm spare within 60 s")
        time.sleep(0.01)
      _kill(p)
      t = time.perf_counter()
      r = p.step_many([0, 1], ["ok", "ok"])
      times.append(time.perf_counter() - t)
      if any(x.done for x in r):
        raise RuntimeError(f"an episode ended: {r}")
    assert p.spare_swaps == (repeats if spares else 0), p.spare_swaps
  return times


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--kinds", nargs="+", default=["local", "docker"], choices=["local", "docker"])
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--json", help="also write the report here")
  args = parser.parse_args()
  report = {}
  for kind in args.kinds:
    row = {}
    for spares in (0, 1):
      t = np.array(measure(kind, spares, args.repeats)) * 1e3
      row[spares] = dict(median_ms=float(np.median(t)), max_ms=float(t.max()))
      print(f"{kind:6s} warm_spares={spares}: recovery step median {row[spares]['median_ms']:7.1f} ms, "
            f"max {row[spares]['max_ms']:7.1f} ms ({args.repeats} worker kills)", flush=True)
    ratio = row[1]["median_ms"] / row[0]["median_ms"]
    print(f"{kind:6s} spare / no spare (median): {ratio:.3f}")
    report[kind] = dict(no_spare=row[0], spare=row[1], ratio=ratio)
  if args.json:
    Path(args.json).write_text(json.dumps(report, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
