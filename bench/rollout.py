"""Rollout engine benchmark: continuous batching vs lockstep turns, and the two env transports, in one run.

    .venv/bin/python bench/rollout.py [--episodes 256 --slots 64 --group 4 --turns 4]
                                      [--median-s 0.02 --sigma 1.5 --cap-s 5]

The workload: `--episodes` episodes of the `faults` env (every action gets an error observation, so every
episode runs `--turns` turns unless an action hits its token budget) through `--slots` decode slots, on the
tiny_cpu model shape with random weights. Each env step sleeps a lognormal time (median `--median-s`, shape
`--sigma`, capped at `--cap-s`; drawn from the episode's seed and turn, so every mode waits the same times),
and once more with no latency. Modes, on the same model, seeds and tasks:

- lockstep:            waves of `--slots` episodes, every turn waits for the wave's slowest env (the engine
                       before v2: `rollout.schedule=lockstep`);
- continuous:          a slot takes the next episode when its own ends, a waiting episode holds only its slot
                       (`rollout.schedule=continuous`, `rollout.env_transport=host_loop`);
- continuous/callback: the same schedule as one jitted program reaching the envs through io_callback.

Printed per mode: trajectories/s and its ratio to lockstep, the stage times (seconds; reset and env summed
over episodes, decode/extend/idle as wall time) and the device's idle fraction (wall time in which no episode
could use the device). Every mode is checked to produce the same trajectories (episode keys make sampling
independent of scheduling). Env workers are 8 local processes (8 request threads each: 64 concurrent steps).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import envs  # noqa: E402
import models  # noqa: E402
from jaxagent import config as config_lib  # noqa: E402
from jaxagent.chat import ControlTokenChat  # noqa: E402
from jaxagent.rollout.actors import SampledActions  # noqa: E402
from jaxagent.rollout.engine import EpisodeRules, RolloutEngine  # noqa: E402
from jaxagent.rollout.sampler import Sampler, SamplingConfig  # noqa: E402

MODES = (("lockstep", "lockstep", "host_loop"), ("continuous", "continuous", "host_loop"),
         ("continuous/callback", "continuous", "callback"))


def run_mode(pool, sampler, params, chat, tasks, group, turns, schedule, transport, decode_chunk):
  engine = RolloutEngine(pool, envs.get("faults"), chat,
                         EpisodeRules(max_turns=turns, schedule=schedule, transport=transport))
  seeds = list(range(len(tasks) * group))
  t0 = time.perf_counter()
  trajs, stats = engine.run(SampledActions(sampler, params, jax.random.key(0), decode_chunk=decode_chunk), tasks,
                            seeds, group_size=group, policy_version=0)
  return trajs, stats, time.perf_counter() - t0


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--episodes", type=int, default=256)
  parser.add_argument("--slots", type=int, default=64)
  parser.add_argument("--group", type=int, default=4, help="samples per task (G)")
  parser.add_argument("--turns", type=int, default=4)
  parser.add_argument("--median-s", type=float, default=0.02)
  parser.add_argument("--sigma", type=float, default=1.5)
  parser.add_argument("--cap-s", type=float, default=5.0)
  parser.add_argument("--decode-chunk", type=int, default=8)
  parser.add_argument("--max-new-tokens", type=int, default=32)
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=3, help="measurements per mode (a 2-core machine wanders)")
  parser.add_argument("--json", help="also write the results here")
  args = parser.parse_args(argv)
  if args.episodes % args.group:
    parser.error(f"--episodes={args.episodes} must be a multiple of --group={args.group}")

  tokenizer = models.ByteTokenizer()
  model_config = config_lib.load("tiny_cpu").model.init
  model = models.Transformer(model_config, rngs=nnx.Rngs(0))
  params = nnx.split(model)[1]
  chat = ControlTokenChat(tokenizer, max_observation_tokens=12)
  # A random model rarely samples the newline that ends an action: 32 byte values end it too (mean ~8 tokens).
  stops = chat.stop_sequences + tuple((t,) for t in range(97, 129))
  sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_sequences=stops)
  context = 48 + args.turns * (args.max_new_tokens + chat.frame_length)
  sampler = Sampler(model, cache_size=context, config=sampling, pad_id=tokenizer.pad_id,
                    extend_buckets=(chat.frame_length,))
  print(f"model: tiny_cpu shape, {model_config.num_params():,} params, random weights; {args.episodes} episodes "
        f"x <= {args.turns} turns through {args.slots} slots (G={args.group}); jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, {jax.device_count()} device(s)")
  results = {}
  spec = envs.get("faults")
  with envs.pool.make_pool(args.slots, env="faults", kind="local", num_workers=args.workers,
                           sandbox="none") as pool:
    # Compile every program once (two slots' worth of episodes per mode) before measuring.
    warm = spec.tasks("tune", 2 * args.slots // args.group, 1)
    for _, schedule, transport in MODES:
      run_mode(pool, sampler, params, chat, warm, args.group, args.turns, schedule, transport, args.decode_chunk)
    for latency in (args.median_s, 0.0):
      label = (f"lognormal latency (median {latency * 1e3:.0f} ms, sigma {args.sigma}, cap {args.cap_s} s)"
               if latency else "zero env latency")
      tasks = spec.tasks("train", args.episodes // args.group, 0, latency_median_s=latency,
                         latency_sigma=args.sigma, latency_cap_s=args.cap_s)
      print(f"\n== {label}: median of {args.rounds} rounds (modes alternate within a round)")
      runs, reference = {name: [] for name, _, _ in MODES}, None
      for _ in range(args.rounds):
        for name, schedule, transport in MODES:
          trajs, stats, wall = run_mode(pool, sampler, params, chat, tasks, args.group, args.turns, schedule,
                                        transport, args.decode_chunk)
          same = reference is None or all(np.array_equal(a.tokens, b.tokens) for a, b in zip(reference, trajs))
          reference = reference or trajs
          turns = sum(len(t.turns) for t in trajs)
          runs[name].append({
              "traj_per_s": len(trajs) / wall, "wall_s": wall, "turns": turns, "ms_per_turn": 1e3 * wall / turns,
              "decode_s": stats.decode_s, "extend_s": stats.extend_s, "idle_s": stats.idle_s,
              "env_s_summed": stats.env_s, "reset_s_summed": stats.reset_s,
              "device_idle_fraction": stats.idle_s / wall, "same_trajectories_as_lockstep": same})
      rows = {name: sorted(r, key=lambda x: x["wall_s"])[len(r) // 2] for name, r in runs.items()}
      base = rows["lockstep"]["traj_per_s"]
      for name, row in rows.items():
        row["vs_lockstep"] = row["traj_per_s"] / base
        row["vs_lockstep_rounds"] = [round(a["traj_per_s"] / b["traj_per_s"], 2)
                                     for a, b in zip(runs[name], runs["lockstep"])]
        row["same_trajectories_as_lockstep"] = all(r["same_trajectories_as_lockstep"] for r in runs[name])
        print(json.dumps({"mode": name, **{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}}))
      cb, hl = rows["continuous/callback"], rows["continuous"]
      print(f"per turn: host_loop {hl['ms_per_turn']:.2f} ms, callback {cb['ms_per_turn']:.2f} ms "
            f"(callback / host_loop = {cb['ms_per_turn'] / hl['ms_per_turn']:.2f})")
      results[label] = rows
  if args.json:
    Path(args.json).write_text(json.dumps(results, indent=1))
  return results


if __name__ == "__main__":
  main()
