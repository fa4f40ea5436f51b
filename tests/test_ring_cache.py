"""Sliding-window layers keep a ring of their window in the KV cache (Gemma 3): through the sampler, a fork made
after its source decoded past the prompt, and a refill under new weights, equal a fresh prefill of the same
tokens; and the ring's bytes on a 32K-context rollout of Gemma 3 4B's shapes. The cache ≡ no cache equivalences
with rings (prefill, ragged extends, decode, every attention kernel) are in test_kv_cache.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
from jaxagent.rollout.sampler import Feed, Sampler, SamplingConfig
from tests.test_kv_cache import GEMMA_CONFIG
from tests.test_kv_cache import cache_layout  # noqa: F401  (autouse: every test on both cache layouts)

WINDOW = 4  # shorter than the prompt: the ring wraps while the prompt is fed
CONFIG = dataclasses.replace(GEMMA_CONFIG, sliding_window=WINDOW)
PROMPT = [5, 9, 3, 7, 1, 4, 6]


def _model(seed=3):
  model = models.Transformer(CONFIG, rngs=nnx.Rngs(seed))
  _, state = nnx.split(model)
  nnx.update(model, jax.tree_util.tree_map_with_path(  # peaked distributions: the weights, not the norms
      lambda path, x: x if "scale" in jax.tree_util.keystr(path) else x * 4, state))
  return model


def _sampler(model):
  return Sampler(model, cache_size=32, config=SamplingConfig(temperature=0.0, max_new_tokens=6), pad_id=0,
                 extend_buckets=(8,))


def _fork_row_0_and_decode(sampler, params, state):
  """Row 1 forks row 0's prompt and decodes an action: the same tokens and log-probs as the prompt prefilled on
  its own (a fork that copied the source's moved-on ring would decode from other keys). Returns (state, the
  prefilled prompt's action)."""
  f = Feed.empty(2, 8, 0)
  f.reset[1], f.episode[1], f.fork[1], f.start[1] = 1, 1, 0, 1
  state, ok = sampler.feed(params, state, f)
  state = sampler.decode(params, state, 6)
  _, want = sampler.generate(params, sampler.prefill(params, [PROMPT], jax.random.key(0)))
  assert np.asarray(ok).all()
  np.testing.assert_array_equal(np.asarray(state.tokens[1]), np.asarray(want.tokens[0]))
  np.testing.assert_allclose(np.asarray(state.raw_logprobs[1]), np.asarray(want.raw_logprobs[0]), atol=1e-5)
  return state, want


def test_the_sliding_layers_cache_is_a_ring_of_the_window():
  cache = models.KVCache.init(CONFIG, 2, 32)
  assert cache.stack_slots() == [WINDOW, 32]  # layer 0 slides, layer 1 is global
  assert models.KVCache.init(CONFIG, 2, 3).stack_slots() == [3, 3]  # a cache within the window: full


def test_a_fork_after_its_source_decoded_equals_a_fresh_prefill():
  """Row 0 takes the prompt and decodes a whole action (its ring moves past the prompt); row 1 then forks the
  prompt from it and decodes: the same greedy tokens as the prompt prefilled on its own."""
  model = _model()
  params, sampler = nnx.state(model), _sampler(model)
  f = Feed.empty(2, 8, 0)
  f.tokens[0, :len(PROMPT)], f.lengths[0], f.reset[0], f.prompt_done[0], f.start[0] = PROMPT, len(PROMPT), 1, 1, 1
  state, ok = sampler.feed(params, sampler.init(2, jax.random.key(0)), f)
  state = sampler.decode(params, state, 6)
  assert int(state.n[0]) == 6 and np.asarray(ok).all()
  state, out = _fork_row_0_and_decode(sampler, params, state)
  np.testing.assert_array_equal(np.asarray(state.tokens[0]), np.asarray(out.tokens[0]))


def test_a_refill_under_new_weights_equals_a_fresh_prefill_and_keeps_the_prompt_for_forks():
  model, other = _model(3), _model(4)
  params, new = nnx.state(model), nnx.state(other)
  sampler = _sampler(model)
  state = sampler.prefill(params, [PROMPT, PROMPT[:3]], jax.random.key(0))
  state, first = sampler.generate(params, state)
  state, _ = sampler.extend(params, state, [[2, 8, 11], [12]])
  histories = [PROMPT + np.asarray(first.tokens[0]).tolist() + [2, 8, 11],
               PROMPT[:3] + np.asarray(first.tokens[1]).tolist() + [12]]
  tokens = np.zeros((2, 32), np.int32)
  for r, h in enumerate(histories):
    tokens[r, :len(h)] = h
  state, kl = sampler.refill(new, state, tokens, np.asarray([len(h) for h in histories], np.int32),
                            np.asarray([len(PROMPT), 3], np.int32))
  assert float(np.asarray(kl).max()) > 0  # the new weights do change the next token's distribution
  fresh = sampler.prefill(new, histories, jax.random.key(0))
  np.testing.assert_allclose(np.asarray(state.next_logits), np.asarray(fresh.next_logits), atol=1e-4)
  state, a = sampler.generate(new, state)  # row 0 decodes on: a fork must take its prompt-time rings
  _, b = sampler.generate(new, fresh)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  _fork_row_0_and_decode(sampler, new, state)  # the refilled prompt (its rings recomputed) serves a fork


def test_a_32k_rollout_of_gemma3_4b_keeps_a_fraction_of_the_full_cache():
  """Gemma 3 4B's text model (5 sliding layers of window 1024 to each global one), 64 rows of 32,768 tokens in
  bfloat16: the rings hold 1024 of 32,768 slots on 29 of 34 layers."""
  config = models.architecture("gemma3-4b")
  shape = lambda cfg: jax.eval_shape(lambda: models.KVCache.init(cfg, 64, 32768, jnp.bfloat16))
  ring = shape(config)
  full = shape(dataclasses.replace(config, sliding_window=32768))  # the same model without rings
  nbytes = lambda c: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((c.k, c.v)))
  sliding = sum(config.is_sliding_layer(i) for i in range(config.num_hidden_layers))
  per_slot_layer = 64 * 2 * config.num_key_value_heads * config.head_dim * 2  # rows, k and v, bf16
  assert nbytes(full) == per_slot_layer * 32768 * 34
  assert nbytes(ring) == per_slot_layer * (32768 * (34 - sliding) + 1024 * sliding)
  print(f"gemma3-4b KV cache, 64 rows x 32,768 tokens, bf16: {nbytes(full) / 2**30:.1f} GiB full, "
        f"{nbytes(ring) / 2**30:.2f} GiB with rings ({nbytes(ring) / nbytes(full):.3f}x)")
  assert sliding == 29 and nbytes(ring) < 0.2 * nbytes(full)
