"""Runs inside a venv with google-tunix: times tunix's `vanilla` sampler on the tiny config's shape.

Prints one JSON line: {"decode_tok_s": ..., "prefill_s": ..., "total_s": ...}. Used by bench/sampler.py.
The model is tunix's own Llama3 with the same shape as jaxagent/configs/tiny_cpu.yaml (random weights),
a byte tokenizer, prompts of `--prompt` tokens (BOS + bytes), `--new` sampled tokens at temperature 1 (EOS forbidden so
every row generates exactly `--new` tokens, as ours does).
"""

import argparse
import json
import time

import jax
import numpy as np
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.models.llama3 import model as llama3

from _tunix_grpo import ByteTokenizer  # same byte tokenizer as the GRPO bench (bench/ is on sys.path)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=64)
  parser.add_argument("--new", type=int, default=64)
  args = parser.parse_args()
  config = llama3.ModelConfig(num_layers=4, vocab_size=264, embed_dim=128, hidden_dim=384, num_heads=4,
                              head_dim=32, num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, weight_tying=True)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"))
  with jax.set_mesh(mesh):
    model = llama3.Llama3(config, rngs=nnx.Rngs(0))
    cache = sampler_lib.CacheConfig(cache_size=args.prompt + args.new + 8, num_layers=4, num_kv_heads=2,
                                    head_dim=32)
    sampler = sampler_lib.Sampler(model, ByteTokenizer(), cache)
    rng = np.random.default_rng(0)
    prompts = ["".join(chr(c) for c in rng.integers(97, 123, args.prompt - 1)) for _ in range(args.batch)]

    def run(steps):
      start = time.perf_counter()
      out = sampler(prompts, max_generation_steps=steps, max_prompt_length=args.prompt, temperature=1.0,
                    top_p=1.0, seed=0, eos_tokens=[258], forbidden_tokens=[258])
      jax.block_until_ready(out.tokens)
      return time.perf_counter() - start, out

    run(1)
    run(args.new)  # compile both
    prefill = min(run(1)[0] for _ in range(7))
    total, out = min((run(args.new) for _ in range(7)), key=lambda r: r[0])
    lengths = [len(t) for t in out.tokens]
  print(json.dumps({"decode_tok_s": args.batch * (args.new - 1) / (total - prefill), "prefill_s": prefill,
                    "total_s": total, "min_len": min(lengths)}))


if __name__ == "__main__":
  main()
