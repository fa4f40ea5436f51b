"""Freshness benchmark: sync vs one_step_off vs async training on the default model and env with heavy-tailed
tool latency, in one run.

    .venv/bin/python bench/freshness.py [--iterations 50 --seeds 0 1 --median-s 0.02 --sigma 1.5 --cap-s 5]

Per seed: one behavior-cloning cold start (the default's 160 steps), then each mode trains `--iterations` GRPO
iterations from it (B=8 tasks x G=8 samples, `make run`'s model, optimizer and env, dynamic sampling off in
every mode) on `bench/_latency_env.py` (calculator whose every step sleeps a lognormal time, drawn from the
episode's seed and turn: bench/rollout.py's latency), env workers in-process threads. Then 200 held-out
episodes of the final policy, with Wilson intervals.

Printed per mode: trajectories/s and trained (loss) tokens/s over iterations 2..N (the first one compiles) and
their ratio to sync; the env interactions those iterations took; the mean policy lag of trained tokens; held-out
success. Every mode trains with algo.loss=ppo (the clipped ratio to the recorded behavior log-probs; one_step_off
at max_staleness 1, async at 2); `--modes ... async_decoupled` adds async with algo.loss=decoupled_ppo.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxagent import config as config_lib  # noqa: E402
from jaxagent.train import loop, resume, rollouts  # noqa: E402
from jaxagent.train.run import build_run  # noqa: E402

MODES = {
    "sync": ["train.freshness=sync"],
    "one_step_off": ["train.freshness=one_step_off", "train.max_staleness=1"],
    "async": ["train.freshness=async", "train.max_staleness=2"],
    # Not in the default set: decoupled PPO at the same staleness (see the module docstring).
    "async_decoupled": ["train.freshness=async", "train.max_staleness=2", "algo.loss=decoupled_ppo"],
}
COMMON = ["env.name=bench._latency_env:SPEC", "env.pool.kind=inprocess", "train.dynamic_sampling=false",
          "train.plots=false", "train.save_trajectories=false", "train.eval_every=0"]


def _rows(run_dir: Path) -> list[dict]:
  return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss_tokens" in r]


def _held_out(run_dir: Path, episodes: int):
  cfg = config_lib.load(run_dir / "config.yaml", [f"train.eval_episodes={episodes}"])
  run = build_run(cfg, run_dir, purpose="eval", echo=False)
  try:
    run_state, _ = resume.restore(run)
    _, result = rollouts.evaluate(run, run_state.train)
    return result
  finally:
    run.close()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--iterations", type=int, default=50)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  parser.add_argument("--median-s", type=float, default=0.02)
  parser.add_argument("--sigma", type=float, default=1.5)
  parser.add_argument("--cap-s", type=float, default=5.0)
  parser.add_argument("--eval-episodes", type=int, default=200)
  parser.add_argument("--modes", nargs="+", default=["sync", "one_step_off", "async"], choices=list(MODES))
  parser.add_argument("--root", help="run directories go here (default: a temporary directory)")
  parser.add_argument("--json", help="also write the results here")
  args = parser.parse_args(argv)
  os.environ.update(JAXAGENT_BENCH_LATENCY_MEDIAN_S=str(args.median_s), JAXAGENT_BENCH_LATENCY_SIGMA=str(args.sigma),
                    JAXAGENT_BENCH_LATENCY_CAP_S=str(args.cap_s))
  root = Path(args.root or tempfile.mkdtemp(prefix="jaxagent-freshness-"))
  print(f"tool latency: lognormal, median {args.median_s * 1e3:.0f} ms, sigma {args.sigma}, cap {args.cap_s} s; "
        f"{args.iterations} iterations per mode; runs under {root}", flush=True)
  results = {}
  for seed in args.seeds:
    bc = root / f"seed{seed}-cold-start"
    if not (bc / "checkpoints").is_dir():  # a --root that has it already: the same cold start again
      loop.train(config_lib.load("tiny_cpu", COMMON + [f"run.seed={seed}", "train.iterations=0",
                                                        "train.eval_episodes=0"]), run_dir=bc)
    for mode in args.modes:
      run_dir = root / f"seed{seed}-{mode}"
      shutil.rmtree(run_dir, ignore_errors=True)
      cfg = config_lib.load("tiny_cpu", COMMON + MODES[mode] + [
          f"run.seed={seed}", f"model.path={bc / 'checkpoints'}", "train.bc_steps=0",
          f"train.iterations={args.iterations}", "train.eval_episodes=0", f"train.checkpoint_every={args.iterations}"])
      t0 = time.perf_counter()
      loop.train(cfg, run_dir=run_dir)
      total = time.perf_counter() - t0
      rows = _rows(run_dir)
      first, last = rows[0], rows[-1]
      wall = last["wall_seconds"] - first["wall_seconds"]
      trajectories = (len(rows) - 1) * cfg.train.tasks_per_iteration * cfg.train.group_size
      tokens = sum(r["loss_tokens"] for r in rows[1:])
      result = _held_out(run_dir, args.eval_episodes)
      lag = [r.get("freshness/lag_mean", r.get("policy_lag", 0.0)) for r in rows[1:]]
      results.setdefault(str(seed), {})[mode] = row = {
          "trajectories_per_s": trajectories / wall, "trained_tokens_per_s": tokens / wall,
          "steady_wall_s": wall, "run_s": total,
          "env_interactions": last["env_interactions"] - first["env_interactions"],
          "policy_lag_mean": sum(lag) / len(lag), "dropped_groups": last.get("freshness/dropped_total", 0),
          "held_out_success": result.success_rate, "held_out_ci": list(result.ci),
          "train_success_last10": sum(r["success_rate"] for r in rows[-10:]) / len(rows[-10:])}
      base = results[str(seed)].get("sync")
      if base:
        row["vs_sync_trajectories"] = row["trajectories_per_s"] / base["trajectories_per_s"]
        row["vs_sync_tokens"] = row["trained_tokens_per_s"] / base["trained_tokens_per_s"]
      print(json.dumps({"seed": seed, "mode": mode, **{k: round(v, 4) if isinstance(v, float) else v
                                                        for k, v in row.items()}}), flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps(results, indent=1))
  return results


if __name__ == "__main__":
  main()
