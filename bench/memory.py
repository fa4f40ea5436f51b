"""Peak memory of one RL train step: direct logits vs chunked logits vs chunked + per-layer remat.

    .venv/bin/python bench/memory.py                  # a Qwen3-0.6B-shaped policy, B = 4, T = 2,048
    .venv/bin/python bench/memory.py --tiny           # the shape the CPU test compiles (seconds)

Nothing is run or allocated: each variant of the jitted step (`make_train_step`, GRPO with the state donated) is
compiled for abstract inputs and XLA's memory analysis reports its buffers (this works on CPU). Printed per
variant: temp (activations and workspace), arguments (state + batch), and peak = arguments + outputs - aliased
(the donated state) + temp, with each peak's ratio to the direct path's measured in the same run.
Target: chunked + remat peak <= 1/4 of the direct path at V = 151,936. "+ LoRA" adds rank-16 adapters
on q, k, v, o trained alone (no Adam moments for the base weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

QWEN3_06B = dict(model_type="qwen3", vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, qk_norm=True,
                 tie_word_embeddings=True, max_position_embeddings=4096)
TINY = dict(QWEN3_06B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32)
VARIANTS = ("direct", "chunked", "chunked + remat", "+ LoRA")
LORA = dict(rank=16, targets=("q", "k", "v", "o"))


def variants(chunk: int) -> dict[str, dict]:
  return {"direct": {}, "chunked": {"logits_chunk": chunk}, "chunked + remat": {"logits_chunk": chunk, "remat": "full"},
          "+ LoRA": {"logits_chunk": chunk, "remat": "full", "frozen": ("policy",), "lora_scale": 2.0}}


@dataclasses.dataclass(frozen=True)
class Footprint:
  temp: int
  arguments: int
  peak: int
  compile_s: float


def measure(model_kwargs: dict, batch: int, length: int, memory: dict) -> Footprint:
  """Compiles one GRPO train step for abstract inputs and reads XLA's memory analysis."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  import models
  from jaxagent.assembly import Batch
  from jaxagent.config import AlgoConfig, OptimConfig
  from jaxagent.train.state import TrainState, make_optimizer
  from jaxagent.train.step import StepOptions, make_train_step

  config = models.ModelConfig(**model_kwargs)
  model = nnx.eval_shape(lambda: models.Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(0)))
  graphdef, policy = nnx.split(model)
  optimizer = make_optimizer(OptimConfig(), optax.constant_schedule(1e-4))
  lora = "frozen" in memory  # LoRA adapters trained alone: the optimizer holds moments for them only

  def new_state(p):
    params = {"policy": p}
    if lora:
      params["lora"] = models.lora_init(p, key=jax.random.key(0), **LORA)
    trained = {k: v for k, v in params.items() if k not in memory.get("frozen", ())}
    return TrainState(params=params, opt_state=optimizer.init(trained), step=jnp.zeros((), jnp.int32),
                      policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(0), ref_params=None)

  state = jax.eval_shape(new_state, policy)
  s = lambda dtype: jax.ShapeDtypeStruct((batch, length), dtype)
  abstract_batch = Batch(tokens=s(jnp.int32), positions=s(jnp.int32), segment_ids=s(jnp.int32), loss_mask=s(bool),
                         roles=s(jnp.int8), behavior_logprobs=s(jnp.float32), advantages=s(jnp.float32),
                         policy_versions=s(jnp.int32), trajectory_index=s(jnp.int32))
  step = make_train_step({"policy": graphdef}, optimizer, StepOptions(AlgoConfig(), mode="rl", **memory))
  start = time.perf_counter()
  compiled = step.lower(state, abstract_batch, jax.ShapeDtypeStruct((), jnp.float32)).compile()
  seconds = time.perf_counter() - start
  m = compiled.memory_analysis()
  peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  return Footprint(temp=m.temp_size_in_bytes, arguments=m.argument_size_in_bytes, peak=peak, compile_s=seconds)


def main(argv: list[str] | None = None) -> dict[str, Footprint]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="a 2-layer, width-64 model with the real vocabulary")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=2048)
  parser.add_argument("--chunk", type=int, default=None, help="train.logits_chunk (default: T / 8)")
  args = parser.parse_args(argv)
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
  shape, batch, length = (TINY, 2, 256) if args.tiny else (QWEN3_06B, args.batch, args.length)
  chunk = args.chunk or max(length // 8, 1)
  print(f"one GRPO train step, float32, V={shape['vocab_size']:,}, {shape['num_hidden_layers']} layers of "
        f"width {shape['hidden_size']}, B={batch}, T={length} (XLA memory analysis of the compiled step)")
  results = {}
  for name, memory in variants(chunk).items():
    results[name] = f = measure(shape, batch, length, memory)
    ratio = f.peak / results["direct"].peak
    print(f"  {name:<16} temp {f.temp / 2**30:7.2f} GiB  args {f.arguments / 2**30:6.2f} GiB  "
          f"peak {f.peak / 2**30:7.2f} GiB  = {ratio:.3f} x direct   ({memory or 'logits [B, T, V]'}; "
          f"compiled in {f.compile_s:.0f} s)", flush=True)
  return results


if __name__ == "__main__":
  main()
