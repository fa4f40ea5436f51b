"""GRPO iteration throughput: our sync rl iteration (`jaxagent.train.rl.iteration`) vs tunix's agentic GRPO
learner, in one run.

    .venv/bin/python bench/grpo_vs_tunix.py [--tasks 4 --group 4 --iters 3] \
        [--tunix-python /tmp/tunixvenv/bin/python]

Both sides: the same Qwen3-shaped byte-level policy with random weights (vocab 264, hidden 128, 4 layers,
4 heads / 2 KV heads, head_dim 32, MLP 384, tied embeddings, qk-norm, rope 10000, float32), the same 2-turn
toy environment (the built-in `guess` env: `envs.get("guess")` with max_turns=2 and the error_observation
rule, stepped in-process on both sides — the tunix side wraps the very same env class in a `BaseTaskEnv`
subclass), B tasks x G samples per iteration, at most `--max-new` sampled tokens per turn, observations cut to
16 tokens, temperature 1.0, stop on "\\n" / <|eot|> / <eos>, GRPO advantages, clipped policy loss (eps 0.2,
token-mean), no reference model / KL, AdamW 1e-4 with global-norm clip 1.0, one optimizer step per iteration.
Each side pads its update batch its own way: ours to the smallest length bucket holding the longest
trajectory (`train.batch_length=bucket`, the library default: 96 for this bench's ~81-token trajectories),
tunix to its configured maximum lengths.
`--warmup` untimed iterations (default 2: compilation and warm caches on both sides; tests/test_train.py
asserts our trainer compiles nothing after its first iteration), then `--iters` timed iterations on both
sides; we report the mean.

Equal work per trajectory: with random weights a turn almost never samples a stop token, and our rollout
engine ends an episode whose action fills the turn budget (turn_budget_exhausted) while tunix hands that
text to the env and continues. So that both sides really run 2 turns, this bench maps our sampler's
`Finish.BUDGET` to `Finish.STOP` (the same tokens are sampled, decoded, trained on; only the code changes).
Turns per trajectory are printed for both sides.

"Trained tokens" = tokens with loss (sampled action tokens); "processed" = all non-pad tokens in the
training batch (prompt + actions + observations). Rates are per second of steady-state iteration wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

MODEL = dict(model_type="qwen3", qk_norm="true", vocab_size=264, hidden_size=128, intermediate_size=384,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             tie_word_embeddings="true", rope_theta=10000.0, rms_norm_eps=1e-6)
ENV, MAX_TURNS, OBS_TOKENS, MAX_CONTEXT, LR = "guess", 2, 16, 128, 1e-4


def run_ours(args) -> dict:
  from jaxagent import config as config_lib
  from jaxagent.rollout import actors
  from jaxagent.rollout.sampler import Finish
  from jaxagent.train import rl
  from jaxagent.train.run import build_run

  overrides = [f"model.init.{k}={v}" for k, v in MODEL.items()] + [
      "train.bc_steps=0", "train.eval_episodes=0", "train.dynamic_sampling=false", f"env.name={ENV}",
      "env.demo_options=null", f"env.max_turns={MAX_TURNS}",
      "env.pool.kind=inprocess", "env.invalid_action=error_observation", "train.save_trajectories=false",
      "train.plots=false", f"train.tasks_per_iteration={args.tasks}", f"train.group_size={args.group}",
      f"train.iterations={args.warmup + args.iters}", "train.updates_per_iteration=1", "train.micro_batches=1",
      f"rollout.temperature={args.temperature}", f"rollout.max_new_tokens={args.max_new}",
      f"rollout.max_observation_tokens={OBS_TOKENS}", f"rollout.max_context={MAX_CONTEXT}",
      "algo.kl_coef=0.0", "algo.aggregation=token-mean", f"optim.learning_rate={LR}", "optim.max_grad_norm=1.0",
      "train.batch_length=bucket",  # the library default (tiny_cpu.yaml pins max_context for make run's tables)
      "run.name=bench-grpo-vs-tunix"]
  cfg = config_lib.load("tiny_cpu", overrides)
  run_dir = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
  run = build_run(cfg, run_dir, echo=False)
  progress = run.new_state()

  actions = actors.SampledActions._actions

  def actions_budget_is_stop(self, running):  # see the module docstring
    return {i: a if a.finish != Finish.BUDGET else dataclasses.replace(a, finish=Finish.STOP)
            for i, a in actions(self, running).items()}

  actors.SampledActions._actions = actions_budget_is_stop
  seen = []
  engine_run = run.rollout.engine.run

  def run_and_count(*a, **k):
    trajs, stats = engine_run(*a, **k)
    seen.append(dict(tokens=sum(int(np.sum(t.tokens != run.interface.tokenizer.pad_id)) for t in trajs),
                     turns=float(np.mean([len(t.turns) for t in trajs]))))
    return trajs, stats

  run.rollout.engine.run = run_and_count
  iters = []
  try:
    for i in range(args.warmup + args.iters):
      t0 = time.perf_counter()
      progress, record = rl.iteration(run, progress)
      m = record.metrics
      jax.block_until_ready(progress.train.params)
      wall = time.perf_counter() - t0
      iters.append(dict(s=wall, loss_tokens=float(m["loss_tokens"]), tokens=seen[-1]["tokens"],
                        turns=seen[-1]["turns"], trajectories=args.tasks * args.group,
                        reported_s=float(record.seconds)))
      print(f"  ours iter {i}: {wall:.2f}s loss_tokens={m['loss_tokens']:.0f} turns/traj={seen[-1]['turns']:.2f}"
            + (" (warm-up)" if i < args.warmup else ""), flush=True)
  finally:
    run.close()
  return summarize(iters[args.warmup:])


def summarize(iters: list[dict]) -> dict:
  s = float(np.mean([it["s"] for it in iters]))
  return dict(iteration_s=s, iteration_s_all=[round(it["s"], 3) for it in iters],
              trajectories_per_s=float(np.mean([it["trajectories"] for it in iters])) / s,
              trained_tokens_per_s=float(np.mean([it["loss_tokens"] for it in iters])) / s,
              processed_tokens_per_s=float(np.mean([it["tokens"] for it in iters])) / s,
              turns_per_trajectory=float(np.mean([it["turns"] for it in iters])),
              loss_tokens_per_iteration=float(np.mean([it["loss_tokens"] for it in iters])))


def run_tunix(args) -> dict:
  cmd = [args.tunix_python, str(ROOT / "bench" / "_tunix_grpo.py"), "--tasks", str(args.tasks), "--group",
         str(args.group), "--iters", str(args.iters), "--warmup", str(args.warmup), "--max-new", str(args.max_new),
         "--temperature", str(args.temperature), "--obs-tokens", str(OBS_TOKENS), "--env", ENV, "--max-turns", str(MAX_TURNS),
         "--max-context", str(MAX_CONTEXT), "--lr", str(LR), "--repo", str(ROOT)]
  env = dict(os.environ, PYTHONPATH="")
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.tunix_timeout, env=env)
  for line in proc.stdout.splitlines():
    if line.startswith("  tunix iter"):
      print(line, flush=True)
  result = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  if proc.returncode != 0 or not result:
    tail = "\n".join((proc.stdout + "\n" + proc.stderr).strip().splitlines()[-25:])
    return {"error": f"tunix side exited {proc.returncode}:\n{tail}"}
  return json.loads(result[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tasks", type=int, default=4, help="B: tasks per iteration")
  parser.add_argument("--group", type=int, default=4, help="G: samples per task")
  parser.add_argument("--iters", type=int, default=3, help="timed iterations after one warm-up")
  parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first (compiles), >= 1")
  parser.add_argument("--max-new", type=int, default=16, help="sampled tokens per turn at most")
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--tunix-python", default="/tmp/tunixvenv/bin/python")
  parser.add_argument("--tunix-timeout", type=int, default=480)
  parser.add_argument("--skip-tunix", action="store_true")
  args = parser.parse_args()
  print(f"B={args.tasks} tasks x G={args.group} samples, {MAX_TURNS} turns of <= {args.max_new} tokens, "
        f"env {ENV}, temperature {args.temperature}, {args.iters} timed iterations after {args.warmup} warm-up; "
        f"jax {jax.__version__} on {jax.devices()[0].platform} x{jax.device_count()}", flush=True)

  ours = run_ours(args)
  tunix = None if args.skip_tunix or not Path(args.tunix_python).exists() else run_tunix(args)

  def line(name, r):
    return (f"{name:6s} {r['iteration_s']:8.3f} s/iter  {r['trajectories_per_s']:8.2f} traj/s  "
            f"{r['trained_tokens_per_s']:9.1f} trained tok/s  {r['processed_tokens_per_s']:9.1f} processed tok/s  "
            f"turns/traj {r['turns_per_trajectory']:.2f}  (iters: {r['iteration_s_all']})")

  print("\nsteady state (mean over timed iterations):")
  print(line("ours", ours))
  if tunix is None:
    print("tunix  not run (--skip-tunix, or --tunix-python missing)")
  elif "error" in tunix:
    print(f"tunix  could not run: {tunix['error']}")
  else:
    print(line("tunix", tunix))
    print(f"ratio ours/tunix: trajectories/s {ours['trajectories_per_s'] / tunix['trajectories_per_s']:.2f}x, "
          f"trained tokens/s {ours['trained_tokens_per_s'] / tunix['trained_tokens_per_s']:.2f}x, "
          f"processed tokens/s {ours['processed_tokens_per_s'] / tunix['processed_tokens_per_s']:.2f}x "
          f"(target >= 5x)")
  print(json.dumps({"ours": ours, "tunix": tunix}))


if __name__ == "__main__":
  main()
