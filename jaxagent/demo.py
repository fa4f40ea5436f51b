"""The embedded default job until the trainer lands: a tiny model through every foundation piece.

It initializes the configured tiny model (random weights), writes it as a Hugging Face checkpoint,
converts that to an Orbax checkpoint, restores it, checks that both loads give identical logits, then greedily
decodes with the KV cache and checks the tokens against a full forward without cache. Every number printed is
measured in this run; the text it generates is from untrained weights.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
from jaxagent import weights
from jaxagent.config import Config
from jaxagent.rollout.sampler import Sampler, SamplingConfig
from jaxagent.train.loop import new_run_dir


def greedy_decode(model: models.Transformer, prompt: list[int], max_new_tokens: int, pad_id: int
                  ) -> tuple[list[int], float]:
  """Greedy decoding with the rollout sampler (KV cache, one compiled while_loop). Returns tokens and the
  seconds of a second, compiled, call."""
  sampler = Sampler(model, cache_size=len(prompt) + max_new_tokens,
                    config=SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens), pad_id=pad_id,
                    buckets=(len(prompt),))
  params = nnx.split(model)[1]
  jax.block_until_ready(sampler.generate(params, sampler.prefill(params, [prompt], jax.random.key(0)))[1])
  state = sampler.prefill(params, [prompt], jax.random.key(0))
  start = time.perf_counter()
  _, turn = sampler.generate(params, state)
  tokens = jax.device_get(turn.tokens[0]).tolist()
  return tokens, time.perf_counter() - start


def run(config: Config) -> Path:
  run_dir = new_run_dir(config)
  print(f"RUN_DIR {run_dir.resolve()}")
  print("note: the trainer is not built yet; this job exercises the model, checkpoint and decode path.")
  tokenizer = models.load_tokenizer(config.model.tokenizer)
  dtype = jnp.dtype(config.model.dtype)
  if config.model.path:
    model = weights.load_model(config.model.path, dtype=dtype)
    print(f"loaded {config.model.path}")
  else:
    model = models.Transformer(config.model.init, dtype=dtype, rngs=nnx.Rngs(config.run.seed))
    print(f"initialized {config.model.init.model_type} with {config.model.init.num_params():,} parameters "
          f"(random weights, seed {config.run.seed})")
  if model.config.vocab_size < tokenizer.vocab_size:
    raise ValueError(f"model vocab_size {model.config.vocab_size} < tokenizer vocab {tokenizer.vocab_size}")

  hf_dir = models.save_pretrained(model, run_dir / "hf")
  ckpt_dir = weights.save_model(models.from_pretrained(hf_dir, dtype=dtype), run_dir / "checkpoints")
  restored = weights.load_model(ckpt_dir, dtype=dtype)
  probe = jnp.asarray([tokenizer.encode(config.generate.prompt)], jnp.int32)
  diff = float(jnp.max(jnp.abs(model(probe) - restored(probe))))
  print(f"HF -> Orbax -> restore: max |logit diff| = {diff:.3g}  ({hf_dir.name}/, {ckpt_dir.name}/)")

  prompt = tokenizer.encode(config.generate.prompt)
  new, seconds = greedy_decode(restored, prompt, config.generate.max_new_tokens, tokenizer.pad_id)
  full = restored(jnp.asarray([prompt + new], jnp.int32))
  reference = np.asarray(jnp.argmax(full[0, len(prompt) - 1:-1], -1)).tolist()
  agree = sum(int(a == b) for a, b in zip(new, reference))
  print(f"greedy decode with KV cache: {len(new)} tokens, {len(new) / max(seconds, 1e-9):.0f} tokens/s; "
        f"agrees with no-cache argmax on {agree}/{len(new)} tokens")
  print(f"continuation (untrained weights): {tokenizer.decode(new)!r}")
  if agree != len(new):
    raise SystemExit("KV-cache decode disagrees with the full forward")
  return run_dir
