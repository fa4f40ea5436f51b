"""KV cache ≡ no cache: prefill + token-by-token decode, ragged extends with padding holes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models

CONFIG = models.ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            qk_norm=True, tie_word_embeddings=False)
TOL = 1e-5
# A mixture of experts (layer 0 sparse, layer 1 dense) in the same shapes: routing is per token, so a cache, the
# padding and the batch's other rows change no token's experts.
MOE_CONFIG = dataclasses.replace(CONFIG, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=(1,))


@pytest.fixture(autouse=True, params=[False, True], ids=["cpu_layout", "heads_minor"])
def cache_layout(request, monkeypatch):
  """Every test here runs on both KV cache layouts (`KVCache.heads_minor`: the CPU's, and the accelerators')."""
  init = models.KVCache.init
  monkeypatch.setattr(models.KVCache, "init",
                      lambda *args, heads_minor=request.param, **kwargs: init(*args, heads_minor=heads_minor, **kwargs))
  return request.param


def decisive_routers(model, seed=0):
  """Router weights large enough that float rounding (cache vs no cache) flips no top-k choice."""
  rng = np.random.default_rng(seed)
  for stack in model.layer_stacks:
    if isinstance(stack.mlp, models.MoE):
      stack.mlp.w_router_de[...] = jnp.asarray(rng.normal(0, 0.5, stack.mlp.w_router_de.shape), jnp.float32)
  return model


# Gemma 3's layout: a sliding layer (window 3, shorter than the rows) and a global one, each with its own RoPE base.
GEMMA_CONFIG = dataclasses.replace(CONFIG, model_type="gemma3_text", hidden_activation="gelu_tanh", norm_offset=1.0,
                                   sandwich_norms=True, embed_scale=8.0, query_pre_attn_scalar=24.0,
                                   layer_types=("sliding_attention", "full_attention"), sliding_window=3,
                                   rope_theta=1e6, tie_word_embeddings=True)


@pytest.fixture(scope="module", params=[CONFIG, MOE_CONFIG, GEMMA_CONFIG], ids=["dense", "moe", "gemma3"])
def model(request):
  return decisive_routers(models.Transformer(request.param, rngs=nnx.Rngs(3)))


def _compact_logits(model, tokens, valid):
  """Per row: forward over only its valid tokens (no padding at all); logits scattered back."""
  out = np.zeros(tokens.shape + (CONFIG.vocab_size,), np.float32)
  for b in range(tokens.shape[0]):
    idx = np.flatnonzero(valid[b])
    out[b, idx] = np.asarray(model(jnp.asarray(tokens[b, idx][None], jnp.int32)))[0]
  return out


def test_prefill_then_decode_equals_full_forward_on_padded_batch(model):
  rng = np.random.default_rng(0)
  batch, prompt, steps = 3, 7, 6
  tokens = rng.integers(0, CONFIG.vocab_size, (batch, prompt + steps))
  valid = np.ones_like(tokens)
  valid[1, :3] = 0  # left padding
  valid[2, :1] = 0
  positions = np.clip(np.cumsum(valid, 1) - 1, 0, None)
  full = np.asarray(model(jnp.asarray(tokens, jnp.int32), positions_bt=jnp.asarray(positions, jnp.int32),
                          segment_ids_bt=jnp.asarray(valid, jnp.int32)))

  cache = models.KVCache.init(model.config, batch, prompt + steps)
  logits, cache = model(jnp.asarray(tokens[:, :prompt], jnp.int32),
                        positions_bt=jnp.asarray(positions[:, :prompt], jnp.int32),
                        segment_ids_bt=jnp.asarray(valid[:, :prompt], jnp.int32), cache=cache)
  pieces = [np.asarray(logits)]
  step = jax.jit(lambda t, p, s, c: model(t, positions_bt=p, segment_ids_bt=s, cache=c))
  for i in range(prompt, prompt + steps):
    logits, cache = step(jnp.asarray(tokens[:, i:i + 1], jnp.int32), jnp.asarray(positions[:, i:i + 1], jnp.int32),
                         jnp.asarray(valid[:, i:i + 1], jnp.int32), cache)
    pieces.append(np.asarray(logits))
  cached = np.concatenate(pieces, axis=1)
  mask = valid.astype(bool)
  assert np.asarray(cache.index).tolist() == [prompt + steps] * batch
  assert np.abs(cached - full)[mask].max() <= TOL
  # And both equal running each row alone without any padding.
  assert np.abs(full - _compact_logits(model, tokens, valid))[mask].max() <= TOL


def test_ragged_extend_with_holes_equals_compact_sequences(model):
  """Prompt, then an observation chunk whose rows have different lengths (padding holes), then decode."""
  rng = np.random.default_rng(1)
  batch, prompt, extend, decode = 2, 5, 6, 3
  total = prompt + extend + decode
  tokens = rng.integers(0, CONFIG.vocab_size, (batch, total))
  valid = np.ones_like(tokens)
  valid[0, :2] = 0                         # left-padded prompt
  valid[0, prompt + 4:prompt + extend] = 0  # row 0's observation is 4 tokens, row 1's is 6
  positions = np.clip(np.cumsum(valid, 1) - 1, 0, None)
  cache = models.KVCache.init(model.config, batch, total)
  pieces = []
  for start, stop in ((0, prompt), (prompt, prompt + extend)) + tuple((i, i + 1) for i in range(prompt + extend, total)):
    logits, cache = model(jnp.asarray(tokens[:, start:stop], jnp.int32),
                          positions_bt=jnp.asarray(positions[:, start:stop], jnp.int32),
                          segment_ids_bt=jnp.asarray(valid[:, start:stop], jnp.int32), cache=cache)
    pieces.append(np.asarray(logits))
  cached = np.concatenate(pieces, axis=1)
  mask = valid.astype(bool)
  if model.config.sliding_window:
    # A sliding window counts slots, as transformers counts cache positions: a hole inside a row (which the
    # sampler and assembly never leave) is inside the window, so the compact rows differ. The cache must still
    # equal the full forward of the same padded rows.
    full = np.asarray(model(jnp.asarray(tokens, jnp.int32), positions_bt=jnp.asarray(positions, jnp.int32),
                            segment_ids_bt=jnp.asarray(valid, jnp.int32)))
    assert np.abs(cached - full)[mask].max() <= TOL
    return
  assert np.abs(cached - _compact_logits(model, tokens, valid))[mask].max() <= TOL


def test_per_row_write_positions_equal_compact_sequences(model):
  """Each row writes at its own index: prompts of different lengths packed from slot 0, a ragged chunk that
  advances each row by its own length, then decode steps in which only some rows run (the others keep their
  index). Every row's logits equal a forward pass over its own tokens alone."""
  rng = np.random.default_rng(2)
  size = 24
  seqs = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (3, 9, 6)]
  cache = models.KVCache.init(model.config, 3, size)
  streams = [[] for _ in seqs]
  got = [[] for _ in seqs]

  def run(chunks):  # right-padded chunk; row b appends chunks[b] (possibly empty)
    nonlocal cache
    width = max(len(c) for c in chunks)
    tokens = np.zeros((3, width), np.int32)
    seg = np.zeros((3, width), np.int32)
    for b, c in enumerate(chunks):
      tokens[b, :len(c)], seg[b, :len(c)] = c, 1
    index = np.asarray(cache.index)
    positions = index[:, None] + np.arange(width)[None]
    logits, cache = model(jnp.asarray(tokens), positions_bt=jnp.asarray(positions, jnp.int32),
                          segment_ids_bt=jnp.asarray(seg), cache=cache)
    cache = cache.replace(index=jnp.asarray(index + [len(c) for c in chunks], jnp.int32))
    for b, c in enumerate(chunks):
      streams[b] += c
      got[b] += list(np.asarray(logits)[b, :len(c)])

  run(seqs)                                                    # prompts 3, 9, 6 tokens, all from slot 0
  run([[1, 2, 3, 4], [5], [6, 7]])                             # ragged observations
  for step in range(4):                                        # decode: row 1 idles on even steps
    run([[10 + step], [20 + step] if step % 2 else [], [30 + step]])
  assert np.asarray(cache.index).tolist() == [len(s) for s in streams] == [11, 12, 12]
  for b, stream in enumerate(streams):
    alone = np.asarray(model(jnp.asarray([stream], jnp.int32)))[0]
    assert np.abs(np.stack(got[b]) - alone).max() <= TOL, b


def test_cache_output_is_finite_at_padding_slots(model):
  tokens = jnp.zeros((2, 4), jnp.int32)
  segments = jnp.asarray([[0, 0, 0, 0], [1, 1, 1, 1]], jnp.int32)  # row 0 is all padding
  logits, _ = model(tokens, segment_ids_bt=segments, cache=models.KVCache.init(model.config, 2, 8))
  assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding"])
@pytest.mark.parametrize("attention", ["dot_product", "chunked"])
def test_attention_kernels_equal_the_einsum_path_for_forward_prefill_and_extend(attention, window, monkeypatch):
  """jax.nn.dot_product_attention and the chunked kernel (blocks of 4 queries here, so a 10-token row is three
  blocks, the last padded) on packed, padded rows and through the sampler's prefill and extend (KV cache): the
  same logits as the einsum path; decode is shared. "sliding": a Gemma 3 layout whose first layer sees 3 slots."""
  from jaxagent.rollout.sampler import Sampler, SamplingConfig

  monkeypatch.setattr(models._transformer, "ATTENTION_CHUNK", 4)

  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8)
  if window:
    cfg = dataclasses.replace(cfg, model_type="gemma3_text", qk_norm=True, hidden_activation="gelu_tanh",
                              norm_offset=1.0, sandwich_norms=True, embed_scale=32 ** 0.5,
                              layer_types=("sliding_attention", "full_attention"), sliding_window=window)
  model = models.Transformer(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 64, (3, 10)), jnp.int32)
  seg = jnp.asarray([[1] * 10, [1] * 6 + [0] * 4, [1] * 4 + [2] * 5 + [0]], jnp.int32)
  pos = jnp.asarray([list(range(10)), list(range(6)) + [0] * 4, list(range(4)) + list(range(5)) + [0]], jnp.int32)
  valid = np.asarray(seg) > 0
  einsum = model(tokens, positions_bt=pos, segment_ids_bt=seg)
  fused = model(tokens, positions_bt=pos, segment_ids_bt=seg, attention=attention)
  np.testing.assert_allclose(np.asarray(fused)[valid], np.asarray(einsum)[valid], rtol=1e-5, atol=1e-5)

  params = nnx.state(model)
  out = {}
  for kind in ("einsum", attention):
    sampler = Sampler(model, cache_size=48, config=SamplingConfig(temperature=0.0, max_new_tokens=4), pad_id=0,
                      buckets=(16,), extend_buckets=(8,), attention=kind)
    state = sampler.prefill(params, [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]], jax.random.key(0))
    state, first = sampler.generate(params, state)
    state, ok = sampler.extend(params, state, [[9, 8, 7, 6], [3]])
    state, second = sampler.generate(params, state)
    out[kind] = (np.asarray(state.next_logits), first.tokens, second.tokens, np.asarray(ok).all())
  np.testing.assert_allclose(out[attention][0], out["einsum"][0], rtol=1e-5, atol=1e-5)
  assert all(np.array_equal(a, b) for a, b in zip(out[attention][1:3], out["einsum"][1:3]))
  with pytest.raises(ValueError, match="attention='flash': not one of"):
    model(tokens, attention="flash")


def test_the_decode_kernel_traced_for_an_accelerator_equals_the_cpu_kernel():
  """`models.compiling_for("tpu")` (what `jaxagent plan` traces under) takes the accelerator decode path: dots on
  the cache as stored instead of widened multiply-reduces. In float32 both give the same next-token logits, with
  rows at different cache positions and a padded row."""
  model = models.Transformer(CONFIG, rngs=nnx.Rngs(3))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, CONFIG.vocab_size, (3, 6)), jnp.int32)
  segments = jnp.asarray([[1] * 6, [1] * 4 + [0] * 2, [0] * 6], jnp.int32)
  _, cache = model(tokens, segment_ids_bt=segments, cache=models.KVCache.init(model.config, 3, 12))
  step = jnp.asarray([[7], [8], [9]], jnp.int32)
  cpu, _ = model(step, cache=cache)
  with models.compiling_for("tpu"):
    assert models.target_platform() == "tpu"
    accelerator, _ = model(step, cache=cache)
  assert models.target_platform() == jax.default_backend()
  np.testing.assert_allclose(np.asarray(accelerator)[:2], np.asarray(cpu)[:2], rtol=1e-5, atol=1e-5)
