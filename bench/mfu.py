"""Speed against the hardware: train-step tokens/s and MFU, and decode tokens/s against the memory-bandwidth
roofline, for a ~0.5B policy (Qwen2.5-0.5B-shaped) on whatever devices JAX sees.

    .venv/bin/python bench/mfu.py                       # ready as is on a GPU/TPU (peaks looked up by device)
    .venv/bin/python bench/mfu.py --tiny --steps 2      # CPU smoke run (part of the tests)
    .venv/bin/python bench/mfu.py --peak-tflops 989 --bandwidth-gbs 3350   # a device not in the table

Train: the GRPO step (`make_train_step`: bf16 compute on float32 master weights, chunked log-probs, remat) on
B x T tokens; FLOPs from XLA's cost analysis of the compiled step; MFU = FLOPs / step time / peak FLOP/s.
Decode: the sampler's jitted decode loop for B rows; each step reads every weight and the KV cache written so
far, so the roofline is B x bandwidth / bytes per step; the ratio printed is measured / roofline.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

QWEN25_05B = dict(model_type="qwen2", vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                  attention_bias=True, tie_word_embeddings=True, max_position_embeddings=4096)
TINY = dict(QWEN25_05B, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32)
# Dense bf16 peak FLOP/s and HBM bandwidth per device (vendor figures), by a substring of `device_kind`.
PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12), "L4": (121e12, 0.3e12),
         "TPU v5 lite": (197e12, 0.82e12), "TPU v5p": (459e12, 2.76e12), "TPU v5": (459e12, 2.76e12),
         "TPU v4": (275e12, 1.2e12), "TPU v6 lite": (918e12, 1.64e12)}


@dataclasses.dataclass(frozen=True)
class Result:
  train_tokens_per_s: float
  train_flops: float
  mfu: float | None
  decode_tokens_per_s: float
  decode_roofline_tokens_per_s: float | None


def _peaks(device_kind: str, peak_tflops: float | None, bandwidth_gbs: float | None):
  flops, bandwidth = next((v for k, v in PEAKS.items() if k in device_kind), (None, None))
  return (peak_tflops * 1e12 if peak_tflops else flops), (bandwidth_gbs * 1e9 if bandwidth_gbs else bandwidth)


def main(argv: list[str] | None = None) -> Result:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="a 2-layer width-64 model (CPU smoke run)")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=1024, help="train: tokens per row")
  parser.add_argument("--decode-batch", type=int, default=64)
  parser.add_argument("--decode-tokens", type=int, default=128)
  parser.add_argument("--steps", type=int, default=5, help="timed train steps (after one warm-up)")
  parser.add_argument("--peak-tflops", type=float, help="per-device peak (default: looked up by device kind)")
  parser.add_argument("--bandwidth-gbs", type=float, help="per-device memory bandwidth, GB/s")
  args = parser.parse_args(argv)
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx

  import models
  from jaxagent.assembly import Batch
  from jaxagent.config import AlgoConfig, OptimConfig
  from jaxagent.rollout.sampler import Sampler, SamplingConfig
  from jaxagent.train.state import TrainState, make_optimizer
  from jaxagent.train.step import StepOptions, make_train_step

  shape = TINY if args.tiny else QWEN25_05B
  b, t = (2, 64) if args.tiny else (args.batch, args.length)
  decode_b, decode_n = (4, 8) if args.tiny else (args.decode_batch, args.decode_tokens)
  config = models.ModelConfig(**shape)
  devices = jax.devices()
  n_dev = 1  # everything runs on the default device (a ~0.5B model fits one accelerator)
  peak_flops, bandwidth = _peaks(devices[0].device_kind, args.peak_tflops, args.bandwidth_gbs)
  print(f"{devices[0].device_kind} (one device); model {config.num_params() / 1e6:.0f}M parameters "
        f"({shape['num_hidden_layers']} layers, width {shape['hidden_size']}, V={shape['vocab_size']:,})")

  # Train step: bf16 compute on float32 master weights, chunked log-probs, remat (the GPU recipe's settings).
  model = models.Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
  graphdef, policy = nnx.split(model)
  optimizer = make_optimizer(OptimConfig(), optax.constant_schedule(1e-5))
  step = make_train_step({"policy": graphdef}, optimizer, StepOptions(AlgoConfig(), mode="rl", logits_chunk=max(t // 8, 1),
                                                                   remat="full", compute_dtype=jnp.bfloat16))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.vocab_size, (b, t)).astype(np.int32)
  mask = np.ones((b, t), bool)
  mask[:, 0] = False
  batch = Batch(tokens=tokens, positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
                segment_ids=np.ones((b, t), np.int32), loss_mask=mask, roles=np.full((b, t), 2, np.int8),
                behavior_logprobs=np.full((b, t), -np.log(config.vocab_size), np.float32),
                advantages=rng.normal(size=(b, t)).astype(np.float32),
                policy_versions=np.zeros((b, t), np.int32), trajectory_index=np.zeros((b, t), np.int32))
  new_state = lambda: TrainState(params={"policy": jax.tree.map(jnp.array, policy)},
                                 opt_state=optimizer.init({"policy": policy}), step=jnp.zeros((), jnp.int32),
                                 policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(0), ref_params=None)
  normalizer = jnp.float32(mask.sum())
  compiled = step.lower(new_state(), batch, normalizer).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flops = float(cost.get("flops", 0.0))
  state = new_state()
  state, _ = step(state, batch, normalizer)  # warm-up
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(args.steps):
    state, metrics = step(state, batch, normalizer)
  jax.block_until_ready((state, metrics))
  seconds = (time.perf_counter() - start) / args.steps
  train_tps = b * t / seconds
  mfu = flops / seconds / (peak_flops * n_dev) if peak_flops and flops else None
  print(f"  train step  B={b} T={t}: {seconds * 1e3:8.1f} ms, {train_tps:10.0f} tokens/s, "
        f"{flops / 1e12:.3f} TFLOP/step, MFU " + (f"{mfu:.3f}" if mfu is not None else "n/a (unknown peak: "
                                                  "--peak-tflops)"))

  # Decode: the jitted sampler loop, bf16 weights, one prompt token per row.
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model))
  decode_model = nnx.eval_shape(lambda: models.Transformer(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
  sampler = Sampler(decode_model, cache_size=16 + decode_n, pad_id=0, buckets=(16,),
                    config=SamplingConfig(temperature=1.0, max_new_tokens=decode_n, stop_sequences=()))
  prompts = [[1] * 16] * decode_b
  for timed in (False, True):  # the first call compiles
    s = sampler.prefill(bf16, prompts, jax.random.key(1))
    start = time.perf_counter()
    _, out = sampler.generate(bf16, s)
    jax.block_until_ready(out.tokens)
    decode_s = time.perf_counter() - start
  decode_tps = decode_b * decode_n / decode_s
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(bf16))
  kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2  # per token slot
  per_step = weight_bytes + decode_b * kv_bytes * (16 + decode_n / 2)  # the cache is half full on average
  roofline = decode_b * bandwidth * n_dev / per_step if bandwidth else None
  print(f"  decode      B={decode_b}: {decode_tps:10.0f} tokens/s" + (
      f" = {decode_tps / roofline:.3f} x the bandwidth roofline ({roofline:.0f} tokens/s)" if roofline else
      ", roofline n/a (unknown bandwidth: --bandwidth-gbs)"), flush=True)
  return Result(train_tps, flops, mfu, decode_tps, roofline)


if __name__ == "__main__":
  main()
