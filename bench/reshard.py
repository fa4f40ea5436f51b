"""Colocated resharding benchmark: learner layout <-> rollout layout of the policy on one device set.

    .venv/bin/python bench/reshard.py [--devices 8] [--layers 8 --hidden 512]

Prints the time of one switch (`sharding.reshard`, as the trainer uses it: jitted identities with the other
layout's out_shardings, in groups of at most 1/8 of the bytes, each group's sources freed as it lands) against a plain on-device copy of the same bytes in the same layout, measured in this run, and
the compiled switch's peak memory per device against the larger of the two layouts' per-device footprints.
Targets: time <= 2x the copy; peak <= 1.25x the larger footprint (no full replica).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args()
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
  import jax
  import numpy as np
  from flax import nnx

  import models
  from jaxagent import sharding

  d = args.hidden
  config = models.ModelConfig(vocab_size=32000, hidden_size=d, intermediate_size=4 * d,
                              num_hidden_layers=args.layers, num_attention_heads=d // 64, num_key_value_heads=d // 128,
                              head_dim=64, tie_word_embeddings=False)
  mesh = sharding.make_mesh({"data": 1, "fsdp": args.devices // 2, "tensor": 2})
  learner_rules = sharding.RULE_TABLES["fsdp_tp"]
  rollout_rules = sharding.RULE_TABLES["tensor_parallel"]
  abstract = nnx.split(nnx.eval_shape(lambda: models.Transformer(config, rngs=nnx.Rngs(0))))[1]
  learner_sh = models.state_shardings(abstract, mesh, learner_rules)
  rollout_sh = models.state_shardings(abstract, mesh, rollout_rules)
  init = jax.jit(lambda: nnx.split(models.Transformer(config, rngs=nnx.Rngs(0)))[1], out_shardings=learner_sh)
  params = init()
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))

  to_rollout = lambda p: sharding.reshard(p, rollout_sh)
  to_learner = lambda p: sharding.reshard(p, learner_sh)
  copy_learner = jax.jit(lambda p: jax.tree.map(lambda x: x + 0, p), out_shardings=learner_sh)
  copy_rollout = jax.jit(lambda p: jax.tree.map(lambda x: x + 0, p), out_shardings=rollout_sh)

  def per_device(tree):
    return [x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)]

  learner_bytes = per_device(params)
  plans = {"to_rollout": sharding.reshard_plan(jax.tree.leaves(params), jax.tree.leaves(rollout_sh), 0.125)}
  params = jax.block_until_ready(to_rollout(params))
  rollout_bytes = per_device(params)
  plans["to_learner"] = sharding.reshard_plan(jax.tree.leaves(params), jax.tree.leaves(learner_sh), 0.125)
  jax.block_until_ready(copy_rollout(params))
  params = jax.block_until_ready(to_learner(params))
  jax.block_until_ready(copy_learner(params))

  times = {"to_rollout": [], "to_learner": [], "copy_learner": [], "copy_rollout": []}
  for _ in range(args.repeats):
    for name, fn in (("copy_learner", copy_learner), ("to_rollout", to_rollout), ("copy_rollout", copy_rollout),
                     ("to_learner", to_learner)):
      start = time.perf_counter()
      out = jax.block_until_ready(fn(params))
      times[name].append(time.perf_counter() - start)
      if name.startswith("to_"):
        params = out
      del out
  med = {k: float(np.median(v)) for k, v in times.items()}

  # Peak per device while moving group by group (`sharding.reshard_plan`, as reshard does), computed from
  # per-array sizes (CPU devices have no memory stats): every source not yet freed (the group in flight
  # included: its inputs live until its program ends) + every destination already written.
  def peak(src, dst, plan):
    live = list(src)
    worst = sum(live)
    for group in plan:
      for i in group:
        live[i] += dst[i]  # the group's outputs exist before its sources are freed
      worst = max(worst, sum(live))
      for i in group:
        live[i] = dst[i]
    return worst

  larger = max(sum(learner_bytes), sum(rollout_bytes))
  print(f"model: {config.num_params() / 1e6:.1f}M params ({nbytes / 2**20:.0f} MiB) on {args.devices} CPU devices, "
        f"mesh fsdp={args.devices // 2} x tensor=2; learner fsdp_tp <-> rollout tensor_parallel")
  print(f"per-device footprint: learner {sum(learner_bytes) / 2**20:.1f} MiB, rollout "
        f"{sum(rollout_bytes) / 2**20:.1f} MiB")
  for direction, baseline in (("to_rollout", "copy_rollout"), ("to_learner", "copy_learner")):
    print(f"{direction}: {med[direction] * 1e3:.1f} ms vs a plain copy of the destination bytes "
          f"{med[baseline] * 1e3:.1f} ms: ratio {med[direction] / med[baseline]:.2f} (target <= 2)")
  for direction, (src, dst) in (("to_rollout", (learner_bytes, rollout_bytes)),
                                ("to_learner", (rollout_bytes, learner_bytes))):
    p = peak(src, dst, plans[direction])
    print(f"{direction} peak per device (in groups of <= 1/8 of the bytes, sources freed per group): "
          f"{p / 2**20:.1f} MiB = {p / larger:.2f} x the "
          f"larger layout (target <= 1.25; a full replica would be {nbytes / larger:.1f} x)")


if __name__ == "__main__":
  main()
