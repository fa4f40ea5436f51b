"""Colocated resharding benchmark: learner layout <-> rollout layout of the policy on one device set.

    .venv/bin/python bench/reshard.py [--devices 8] [--layers 8 --hidden 512]

Prints the time of one switch (the jitted, donated identity with the other layout's out_shardings that the
trainer uses) against a plain on-device copy of the same bytes in the same layout, measured in this run, and
the compiled switch's peak memory per device against the larger of the two layouts' per-device footprints.
Targets (issue 5): time <= 2x the copy; peak <= 1.25x the larger footprint (no full replica).
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
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  import models  # pylint: disable=g-import-not-at-top
  from jaxagent import sharding  # pylint: disable=g-import-not-at-top

  d = args.hidden
  config = models.ModelConfig(vocab_size=32000, hidden_size=d, intermediate_size=4 * d,
                              num_hidden_layers=args.layers, num_attention_heads=d // 64, num_key_value_heads=d // 128,
                              head_dim=64, tie_word_embeddings=False)
  mesh = models.make_mesh({"data": 1, "fsdp": args.devices // 2, "tensor": 2})
  learner_rules = sharding.RULE_TABLES["fsdp_tp"]
  rollout_rules = sharding.RULE_TABLES["tensor_parallel"]
  abstract = nnx.split(nnx.eval_shape(lambda: models.Transformer(config, rngs=nnx.Rngs(0))))[1]
  learner_sh = models.state_shardings(abstract, mesh, learner_rules)
  rollout_sh = models.state_shardings(abstract, mesh, rollout_rules)
  init = jax.jit(lambda: nnx.split(models.Transformer(config, rngs=nnx.Rngs(0)))[1], out_shardings=learner_sh)
  params = init()
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))

  to_rollout = jax.jit(lambda p: p, out_shardings=rollout_sh, donate_argnums=0)
  to_learner = jax.jit(lambda p: p, out_shardings=learner_sh, donate_argnums=0)
  copy = jax.jit(lambda p: jax.tree.map(lambda x: x + 0, p), out_shardings=learner_sh)

  def per_device(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

  learner_bytes = per_device(params)
  params = jax.block_until_ready(to_rollout(params))
  rollout_bytes = per_device(params)
  params = jax.block_until_ready(to_learner(params))

  switch_times, copy_times = [], []
  for _ in range(args.repeats):
    start = time.perf_counter()
    params = jax.block_until_ready(to_rollout(params))
    mid = time.perf_counter()
    params = jax.block_until_ready(to_learner(params))
    switch_times.append((time.perf_counter() - start) / 2)
    del mid
    start = time.perf_counter()
    copied = jax.block_until_ready(copy(params))
    copy_times.append(time.perf_counter() - start)
    del copied

  mem = to_rollout.lower(params).compile().memory_analysis()
  peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
          + mem.temp_size_in_bytes)
  larger = max(learner_bytes, rollout_bytes)
  switch, plain = float(np.median(switch_times)), float(np.median(copy_times))
  print(f"model: {config.num_params() / 1e6:.1f}M params ({nbytes / 2**20:.0f} MiB) on {args.devices} CPU devices, "
        f"mesh fsdp={args.devices // 2} x tensor=2; learner {learner_rules is sharding.RULE_TABLES['fsdp_tp'] and 'fsdp_tp'}"
        f" -> rollout tensor_parallel")
  print(f"per-device footprint: learner {learner_bytes / 2**20:.1f} MiB, rollout {rollout_bytes / 2**20:.1f} MiB")
  print(f"switch (median of {args.repeats}): {switch * 1e3:.1f} ms; plain copy of the same bytes: {plain * 1e3:.1f} ms;"
        f" ratio {switch / plain:.2f} (target <= 2)")
  print(f"switch program peak per device: {peak / 2**20:.1f} MiB = {peak / larger:.2f} x the larger layout "
        f"(target <= 1.25; a full replica would be {nbytes / larger:.1f} x)")


if __name__ == "__main__":
  main()
