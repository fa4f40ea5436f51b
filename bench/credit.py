"""Credit-assignment benchmark: GiGPO vs GRPO on Sokoban or gridworld from one cold start per seed, in one run.

    .venv/bin/python bench/credit.py [--recipe sokoban_cpu|gridworld_cpu --iterations 40 --seeds 0 1
                                      --advantages gigpo grpo --root DIR --set KEY=VALUE]

Per seed: one behavior-cloning cold start (the recipe's, e.g. `jaxagent/configs/sokoban_cpu.yaml`: 120 BC steps on
BFS solutions, then its held-out success), copied once per estimator and resumed for `--iterations` rl iterations (B=8 x G=8,
the recipe's model, optimizer and env; the copies share the cold start's optimizer state and RNG, so the
estimator is the only difference), then 200 held-out episodes with Wilson intervals (the run's own final eval).

Printed per (seed, estimator): held-out success after the cold start and after RL, the env interactions the RL
iterations took, the train success of the last 10 iterations, gigpo's step-group statistics.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxagent import config as config_lib  # noqa: E402
from jaxagent.train import loop  # noqa: E402
from jaxagent.train import metrics as metrics_lib  # noqa: E402


def _rows(run_dir: Path) -> list[dict]:
  return list(map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--iterations", type=int, default=40)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  parser.add_argument("--advantages", nargs="+", default=["gigpo", "grpo"])
  parser.add_argument("--recipe", default="sokoban_cpu")
  parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="more config overrides, for every run")
  parser.add_argument("--root", help="run directories go here (default: a temporary directory)")
  parser.add_argument("--json", help="also write the results here")
  args = parser.parse_args(argv)
  root = Path(args.root or tempfile.mkdtemp(prefix="jaxagent-credit-"))
  print(f"{args.recipe}: {args.iterations} rl iterations per estimator from one cold start per seed; runs under "
        f"{root}", flush=True)
  results = {}
  for seed in args.seeds:
    bc = root / f"seed{seed}-cold-start"
    if not (bc / "checkpoints").is_dir():  # a --root that has it already: the same cold start again
      loop.train(config_lib.load(args.recipe, args.overrides + [f"run.seed={seed}", "train.iterations=0"]),
                 run_dir=bc)
    before = next(r["eval_success_rate"] for r in _rows(bc) if "eval_success_rate" in r)
    for adv in args.advantages:
      run_dir = root / f"seed{seed}-{adv}"
      shutil.rmtree(run_dir, ignore_errors=True)
      shutil.copytree(bc, run_dir)
      cfg = config_lib.load(run_dir / "config.yaml", args.overrides + [
          f"algo.advantage={adv}", f"train.iterations={args.iterations}"])
      loop.train(cfg, run_dir=run_dir, resume=True)
      rows = _rows(run_dir)
      rl = [r for r in rows if "reward_mean" in r]
      final = [r for r in rows if "eval_success_rate" in r][-1]
      n = cfg.train.eval_episodes
      results.setdefault(str(seed), {})[adv] = row = {
          "held_out_after_cold_start": before, "held_out_after_rl": final["eval_success_rate"],
          "held_out_ci": list(metrics_lib.wilson_interval(round(final["eval_success_rate"] * n), n)),
          "env_interactions": rl[-1]["env_interactions"],  # cumulative; the cold start takes none
          "train_success_last10": sum(r["success_rate"] for r in rl[-10:]) / len(rl[-10:]),
          **({"grouped_step_fraction": sum(r["gigpo/grouped_step_fraction"] for r in rl) / len(rl),
              "step_group_size_mean": sum(r["gigpo/step_group_size_mean"] for r in rl) / len(rl)}
             if adv == "gigpo" else {})}
      print(json.dumps({"seed": seed, "advantage": adv,
                        **{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}}), flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps(results, indent=1))
  return results


if __name__ == "__main__":
  main()
