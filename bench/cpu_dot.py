"""The ceiling under bench/real_model.py: one float32 matmul of each shape SmolLM2-135M runs, XLA:CPU (what our
model compiles to) beside numpy (its BLAS) in the same run, against this machine's rooflines.

    .venv/bin/python bench/cpu_dot.py [--rows 1 8 32 1024] [--repeats 50] [--bandwidth-gbs 25.6 --peak-gflops 188]

Shapes: x[rows, K] @ w[K, N] for the layer's projections (576 -> 576 q/o, 576 -> 192 k/v, 576 -> 1536 gate/up,
1536 -> 576 down) and the tied head (576 -> 49,152). rows 1 / 8 / 32 are decode steps at those batch sizes (the
weights are read once per step: bandwidth-bound), 1024 a training micro-batch (compute-bound). Each op's time is
the median of `--repeats` calls after a warm-up; printed: GFLOP/s, weight GB/s, the share of the roofline
(bandwidth or compute, whichever binds) and XLA / numpy. A whole decode step of the model is 30 layers of the
first four shapes plus one head: the "model step" line sums them, the best any implementation of that step can
do with these kernels.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

SHAPES = (("q/o", 576, 576), ("k/v", 576, 192), ("gate/up", 576, 1536), ("down", 1536, 576),
          ("head", 576, 49152))
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}
LAYERS = 30


def _median(fn, repeats: int) -> float:
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 1024])
  p.add_argument("--repeats", type=int, default=50)
  p.add_argument("--bandwidth-gbs", type=float, default=25.6)
  p.add_argument("--peak-gflops", type=float, default=188.0)
  args = p.parse_args()
  import jax
  import jax.numpy as jnp
  print(f"jax {jax.__version__} ({jax.devices()[0].platform}), numpy {np.__version__}, "
        f"{os.cpu_count()} cores; rooflines {args.bandwidth_gbs} GB/s, {args.peak_gflops} GFLOP/s")
  rng = np.random.default_rng(0)
  dot = jax.jit(jnp.dot)
  print(f"{'rows':>5} {'op':>8} {'xla GF/s':>9} {'xla GB/s':>9} {'np GF/s':>8} {'np GB/s':>8} {'xla/np':>7} "
        f"{'xla/roof':>8}")
  for rows in args.rows:
    step = {"xla": 0.0, "numpy": 0.0, "bytes": 0.0, "flops": 0.0}
    for name, k, n in SHAPES:
      x = rng.standard_normal((rows, k), dtype=np.float32)
      w = rng.standard_normal((k, n), dtype=np.float32)
      xd, wd = jnp.asarray(x), jnp.asarray(w)
      t_xla = _median(lambda: dot(xd, wd).block_until_ready(), args.repeats)
      t_np = _median(lambda: np.dot(x, w), args.repeats)
      flops, nbytes = 2.0 * rows * k * n, 4.0 * k * n
      roof = max(nbytes / (args.bandwidth_gbs * 1e9), flops / (args.peak_gflops * 1e9))
      print(f"{rows:>5} {name:>8} {flops / t_xla / 1e9:>9.1f} {nbytes / t_xla / 1e9:>9.1f} "
            f"{flops / t_np / 1e9:>8.1f} {nbytes / t_np / 1e9:>8.1f} {t_np / t_xla:>7.2f} {roof / t_xla:>8.0%}")
      count = LAYERS * PER_LAYER.get(name, 0) or 1
      step["xla"] += count * t_xla
      step["numpy"] += count * t_np
      step["bytes"] += count * nbytes
      step["flops"] += count * flops
    roof = max(step["bytes"] / (args.bandwidth_gbs * 1e9), step["flops"] / (args.peak_gflops * 1e9))
    print(f"{rows:>5} {'model step':>8}: xla {step['xla'] * 1e3:.1f} ms ({rows / step['xla']:.0f} rows/s, "
          f"{roof / step['xla']:.0%} of the roofline), numpy {step['numpy'] * 1e3:.1f} ms "
          f"({rows / step['numpy']:.0f} rows/s, {roof / step['numpy']:.0%}); roofline {roof * 1e3:.1f} ms "
          f"({rows / roof:.0f} rows/s)")


if __name__ == "__main__":
  main()
