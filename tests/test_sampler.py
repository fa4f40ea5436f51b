"""Sampler: greedy ≡ full-forward argmax, log-probs ≡ full forward, extend ≡ prefill, statistics, shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

import models
from jaxagent import sharding
from jaxagent.rollout import sampler as sampler_lib
from jaxagent.rollout.sampler import Finish, Sampler, SamplingConfig

CONFIG = models.ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            tie_word_embeddings=False)
PAD = 0


@pytest.fixture(scope="module")
def model():
  # Larger init than the default so sampled distributions are far from uniform.
  model = models.Transformer(CONFIG, rngs=nnx.Rngs(7))
  _, state = nnx.split(model)
  nnx.update(model, jax.tree_util.tree_map_with_path(  # the weights, not the norms' scales
      lambda path, x: x if "scale" in jax.tree_util.keystr(path) else x * 8, state))
  return model


def _params(model):
  return nnx.split(model)[1]


_FORWARDS = {}


def _full_logits(model, seq):
  """The model's logits for `seq`, one full forward without a cache (the reference the sampler must match).

  Jitted once per model and padded on the right to a multiple of 32 tokens: causal attention keeps padding out
  of the real positions' logits, and an eager forward per sequence length would compile every op again."""
  if id(model) not in _FORWARDS:
    graphdef, _ = nnx.split(model)
    _FORWARDS[id(model)] = (model, jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)))
  _, forward = _FORWARDS[id(model)]
  padded = list(seq) + [PAD] * (-len(seq) % 32)
  return np.asarray(forward(nnx.split(model)[1], jnp.asarray([padded], jnp.int32)))[0, :len(seq)]


PROMPTS = [[5, 9, 3, 7, 1], [2, 4], [8, 8, 6, 11, 13, 17, 19, 23]]


def test_greedy_equals_full_forward_argmax_on_padded_batch(model):
  s = Sampler(model, cache_size=64, config=SamplingConfig(temperature=0.0, max_new_tokens=10), pad_id=PAD)
  state = s.prefill(_params(model), PROMPTS, jax.random.key(0))
  _, turn = s.generate(_params(model), state)
  tokens = np.asarray(turn.tokens)
  assert (np.asarray(turn.lengths) == 10).all() and (np.asarray(turn.finish) == Finish.BUDGET).all()
  for b, prompt in enumerate(PROMPTS):
    seq = list(prompt)
    for _ in range(10):  # step-by-step argmax of a full forward, no cache
      seq.append(int(np.argmax(_full_logits(model, seq)[-1])))
    assert tokens[b].tolist() == seq[len(prompt):], f"row {b}"
  assert len(set(tokens[:, 0].tolist())) > 1, "degenerate model: all rows produce the same token"


def test_logprobs_equal_log_softmax_of_full_forward(model):
  s = Sampler(model, cache_size=64, config=SamplingConfig(temperature=1.0, max_new_tokens=12), pad_id=PAD)
  state = s.prefill(_params(model), PROMPTS, jax.random.key(1))
  _, turn = s.generate(_params(model), state)
  for b, prompt in enumerate(PROMPTS):
    gen = np.asarray(turn.tokens[b]).tolist()
    logp = jax.nn.log_softmax(_full_logits(model, prompt + gen), axis=-1)
    expected = np.asarray([logp[len(prompt) - 1 + i, t] for i, t in enumerate(gen)])
    np.testing.assert_allclose(np.asarray(turn.logprobs[b]), expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(turn.raw_logprobs[b]), expected, rtol=0, atol=1e-5)


def test_tempered_logprobs_are_under_the_sampled_distribution(model):
  s = Sampler(model, cache_size=64, config=SamplingConfig(temperature=0.5, max_new_tokens=6), pad_id=PAD)
  state = s.prefill(_params(model), PROMPTS[:1], jax.random.key(2))
  _, turn = s.generate(_params(model), state)
  gen = np.asarray(turn.tokens[0]).tolist()
  logits = _full_logits(model, PROMPTS[0] + gen)
  for i, t in enumerate(gen):
    row = logits[len(PROMPTS[0]) - 1 + i]
    assert abs(float(jax.nn.log_softmax(row / 0.5)[t]) - float(turn.logprobs[0, i])) <= 1e-5
    assert abs(float(jax.nn.log_softmax(row)[t]) - float(turn.raw_logprobs[0, i])) <= 1e-5


def test_extend_then_continue_equals_prefilling_the_concatenation(model):
  cfg = SamplingConfig(temperature=0.0, max_new_tokens=5)
  s = Sampler(model, cache_size=128, config=cfg, pad_id=PAD)
  p = _params(model)
  state = s.prefill(p, PROMPTS, jax.random.key(0))
  state, turn1 = s.generate(p, state)
  observations = [[30, 31, 32], [], [40, 41, 42, 43, 44, 45, 46]]  # row 1 gets no observation
  state, ok = s.extend(p, state, observations)
  assert np.asarray(ok).all()
  state, turn2 = s.generate(p, state, active=[True, False, True])
  assert np.asarray(turn2.lengths).tolist() == [5, 0, 5]
  assert np.asarray(turn2.finish).tolist() == [Finish.BUDGET, Finish.NONE, Finish.BUDGET]
  for b in (0, 2):
    history = PROMPTS[b] + np.asarray(turn1.tokens[b]).tolist() + observations[b]
    fresh = s.prefill(p, [history], jax.random.key(0))
    np.testing.assert_allclose(np.asarray(fresh.next_logits[0]), _full_logits(model, history)[-1], atol=1e-5)
    _, again = s.generate(p, fresh)
    assert np.asarray(turn2.tokens[b]).tolist() == np.asarray(again.tokens[0]).tolist()


def test_same_seed_same_samples():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(16, 64)) * 3, jnp.float32)
  cfg = SamplingConfig(temperature=1.0)
  keys = jax.random.key
  a = sampler_lib.sample_logits(logits, keys(3), cfg)[0]
  b = sampler_lib.sample_logits(logits, keys(3), cfg)[0]
  c = sampler_lib.sample_logits(logits, keys(4), cfg)[0]
  assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.parametrize("cfg", [SamplingConfig(top_k=3), SamplingConfig(top_p=0.7),
                                 SamplingConfig(temperature=0.7, top_k=4, top_p=0.8)], ids=str)
def test_truncated_sampling_frequencies(cfg, impl):
  """Chi-square goodness of fit against the truncated distribution; significance level 1e-3, fixed seed."""
  base = np.log(np.asarray([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02]))
  n = 20000
  logits = jnp.asarray(np.tile(base, (n, 1)), jnp.float32)
  tokens, logp, _, _ = sampler_lib.sample_logits(logits, jax.random.key(0, impl=impl), cfg)
  scaled = base / cfg.temperature
  probs = np.exp(scaled - scaled.max())
  probs /= probs.sum()
  order = np.argsort(-probs)
  keep = np.zeros(8, bool)
  keep[order[: cfg.top_k or 8]] = True
  renorm = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()  # top-p applies after top-k
  before = np.cumsum(renorm[order]) - renorm[order]
  keep[order[before >= cfg.top_p]] = False
  expected = np.where(keep, probs, 0)
  expected /= expected.sum()
  counts = np.bincount(np.asarray(tokens), minlength=8)
  assert counts[~keep].sum() == 0, f"sampled a truncated token: {counts}"
  _, pvalue = scipy.stats.chisquare(counts[keep], expected[keep] * n)
  assert pvalue > 1e-3, f"counts {counts} vs expected {expected * n}"
  np.testing.assert_allclose(np.asarray(logp), np.log(expected[np.asarray(tokens)]), atol=1e-5)


def test_inverse_cdf_takes_only_kept_tokens_at_the_extremes_of_the_uniform():
  """u = 0 takes the last kept token, u -> 1 the first; a truncated token is never taken."""
  probs = np.asarray([0.05, 0.30, 1e-30, 0.20, 0.15, 0.0, 0.30])
  logits = jnp.asarray(np.tile(np.log(np.maximum(probs, 1e-38)), (4, 1)), jnp.float32)
  below_one = float(np.nextafter(np.float32(1), np.float32(0)))
  uniforms = jnp.asarray([0.0, 1e-7, 0.5, below_one], jnp.float32)
  cases = {SamplingConfig(): (set(range(7)), 0),
           SamplingConfig(top_k=3): ({1, 3, 6}, 1),
           SamplingConfig(top_p=0.5): ({1, 6}, 1),
           SamplingConfig(temperature=0.5, top_k=4): ({1, 3, 4, 6}, 1)}
  for cfg, (kept, first) in cases.items():
    tokens, logp, _, _ = sampler_lib.sample_with_uniform(logits, uniforms, cfg)
    tokens = np.asarray(tokens).tolist()
    assert set(tokens) <= kept, (cfg, tokens)
    assert tokens[0] == 6 and tokens[-1] == first, (cfg, tokens)
    assert np.isfinite(np.asarray(logp)).all(), (cfg, logp)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 20, 1.0), (1.0, 0, 0.9), (0.7, 20, 0.9), (1.0, 1, 1.0),
                                                     (0.6, 0, 0.3)])
def test_truncation_threshold_keeps_the_top_k_top_p_set_and_the_learner_rescores_it_exactly(temperature, top_k, top_p):
  """The recorded threshold reproduces the kept set (the k likeliest, then the smallest prefix of their
  renormalised mass reaching top_p), and the learner's truncated log-prob of each sampled token is the sampler's."""
  from jaxagent import algos
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(32, 300)) * 3, jnp.float32)
  cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
  tokens, logp, _, tau = sampler_lib.sample_with_uniform(logits, jnp.asarray(rng.uniform(size=32), jnp.float32), cfg)
  scaled = np.asarray(logits) / temperature
  for row, t in zip(scaled, np.asarray(tau)):
    order = np.argsort(-row, kind="stable")
    k = top_k or len(row)
    probs = np.exp(row[order[:k]] - row[order[0]])
    probs /= probs.sum()
    n = int(np.sum(np.cumsum(probs) - probs < top_p))
    assert set(np.flatnonzero(row >= t)) == set(order[:n].tolist())
    assert row[order[n - 1]] > t > row[order[n]]  # strictly between: recomputed logits keep the same set
  learner = algos.token_logprobs(algos.truncated_logits(jnp.asarray(scaled), tokens, tau), tokens)
  np.testing.assert_allclose(np.asarray(learner), np.asarray(logp), rtol=0, atol=2e-6)
  untruncated = algos.token_logprobs(jnp.asarray(scaled), tokens)
  assert (np.asarray(untruncated) < np.asarray(logp) - 1e-3).all()  # the full softmax would be a different policy


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (20, 1.0), (20, 0.5), (0, 0.05)])
def test_truncation_threshold_with_tied_logits_keeps_every_tie_and_sits_strictly_between(top_k, top_p):
  """The bisection over float32 order (no sort) on logits with many ties (bf16-like: few distinct values): the
  kept set is every token at least as likely as the last kept value, and τ lies strictly between that value
  and the next lower one."""
  rng = np.random.default_rng(1)
  logits = np.round(rng.normal(size=(16, 4096)) * 2, 1).astype(np.float32)
  tau = np.asarray(sampler_lib.truncation_threshold(jnp.asarray(logits), top_k, top_p))
  for row, t in zip(logits, tau):
    values = np.unique(row)[::-1]  # distinct, descending
    kth = np.sort(row)[::-1][top_k - 1] if top_k else values[-1]
    kept = row >= kth
    probs = np.where(kept, np.exp(row.astype(np.float64) - row.max()), 0.0)
    last = kth
    if top_p < 1.0:
      last = min(x for x in values if x >= kth and probs[row > x].sum() < top_p * probs.sum())
    lower = values[values < last]
    assert lower.size and lower[0] < t < last, (t, last, lower[:1])
    assert set(np.flatnonzero(row >= t)) == set(np.flatnonzero(row >= last))


def test_stop_tokens_and_sequences(model):
  p = _params(model)
  free = Sampler(model, cache_size=64, config=SamplingConfig(temperature=0.0, max_new_tokens=10), pad_id=PAD)
  _, turn = free.generate(p, free.prefill(p, PROMPTS, jax.random.key(0)))
  greedy = np.asarray(turn.tokens)
  stop_token = int(greedy[0, 3])
  stop_seq = tuple(int(t) for t in greedy[2, 4:6])
  cfg = SamplingConfig(temperature=0.0, max_new_tokens=10, stop_sequences=((stop_token,), stop_seq))
  s = Sampler(model, cache_size=64, config=cfg, pad_id=PAD)
  _, turn = s.generate(p, s.prefill(p, PROMPTS, jax.random.key(0)))
  lengths = np.asarray(turn.lengths)

  def first_stop(row):
    for i in range(10):
      if row[i] == stop_token or (i >= 1 and tuple(row[i - 1:i + 1]) == stop_seq):
        return i + 1
    return None

  for b in range(3):
    expected = first_stop(greedy[b].tolist())
    if expected is None:
      assert lengths[b] == 10 and turn.finish[b] == Finish.BUDGET
    else:
      assert lengths[b] == expected and turn.finish[b] == Finish.STOP, b
      assert np.asarray(turn.tokens[b, :expected]).tolist() == greedy[b, :expected].tolist()
      assert (np.asarray(turn.tokens[b, expected:]) == PAD).all()
  assert lengths[0] <= 4 and lengths[2] <= 6


def test_context_is_exhausted_per_row(model):
  """Each row has its own cache length: a long row fills its slots and stops (CONTEXT_FULL) while a short one
  decodes its whole budget; a chunk that does not fit is refused for that row only."""
  p = _params(model)
  s = Sampler(model, cache_size=12, config=SamplingConfig(temperature=0.0, max_new_tokens=10), pad_id=PAD,
              buckets=(8, 12))
  state, turn = s.generate(p, s.prefill(p, PROMPTS, jax.random.key(0)))  # prompt lengths 5, 2, 8
  assert np.asarray(turn.lengths).tolist() == [7, 10, 4]
  assert np.asarray(turn.finish).tolist() == [Finish.CONTEXT_FULL, Finish.BUDGET, Finish.CONTEXT_FULL]
  assert np.asarray(state.cache.index).tolist() == [12, 12, 12]
  free = Sampler(model, cache_size=64, config=SamplingConfig(temperature=0.0, max_new_tokens=10), pad_id=PAD)
  _, unbounded = free.generate(p, free.prefill(p, PROMPTS, jax.random.key(0)))
  for b, n in enumerate([7, 10, 4]):  # the cut rows produced exactly the prefix they had room for
    assert np.asarray(turn.tokens[b, :n]).tolist() == np.asarray(unbounded.tokens[b, :n]).tolist()

  short = s.prefill(p, [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11]], jax.random.key(0))
  short, ok = s.extend(p, short, [[1, 2, 3], [1, 2, 3, 4]])  # row 1: 9 + 4 > 12
  assert np.asarray(ok).tolist() == [True, False]
  assert np.asarray(short.cache.index).tolist() == [5, 9] and np.asarray(short.next_position).tolist() == [5, 9]


def test_finished_rows_cost_nothing_observable(model):
  p = _params(model)
  cfg = SamplingConfig(temperature=1.0, max_new_tokens=6)
  s = Sampler(model, cache_size=64, config=cfg, pad_id=PAD)
  _, mixed = s.generate(p, s.prefill(p, PROMPTS, jax.random.key(5)), active=[True, False, True])
  assert int(mixed.lengths[1]) == 0 and int(mixed.finish[1]) == Finish.NONE
  assert (np.asarray(mixed.tokens[1]) == PAD).all()
  greedy = Sampler(model, cache_size=64, config=SamplingConfig(temperature=0.0, max_new_tokens=6), pad_id=PAD)
  _, with_idle = greedy.generate(p, greedy.prefill(p, PROMPTS, jax.random.key(5)), active=[True, False, True])
  _, alone = greedy.generate(p, greedy.prefill(p, [PROMPTS[0], PROMPTS[2]], jax.random.key(5)))
  assert np.array_equal(np.asarray(with_idle.tokens)[[0, 2]], np.asarray(alone.tokens))


def test_prefix_reuse_equals_prefilling_each_copy(model):
  p = _params(model)
  s = Sampler(model, cache_size=64, config=SamplingConfig(temperature=0.0, max_new_tokens=6), pad_id=PAD)
  shared = s.repeat(s.prefill(p, PROMPTS, jax.random.key(0)), 4)
  each = s.prefill(p, [q for q in PROMPTS for _ in range(4)], jax.random.key(0))
  np.testing.assert_allclose(np.asarray(shared.next_logits), np.asarray(each.next_logits), atol=1e-5)  # batch 3 vs 12: float32 reduction order
  _, a = s.generate(p, shared)
  _, b = s.generate(p, each)
  assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


def test_no_recompilation_for_new_data_in_the_same_bucket(model):
  p = _params(model)
  s = Sampler(model, cache_size=64, config=SamplingConfig(max_new_tokens=4), pad_id=PAD)
  state = s.prefill(p, PROMPTS, jax.random.key(0))
  state, _ = s.generate(p, state)
  state, _ = s.extend(p, state, [[1, 2], [3], [4, 5, 6]])
  sizes = (s._prefill._cache_size(), s._generate._cache_size(), s._extend._cache_size())
  state = s.prefill(p, [[9, 9, 9], [1, 2, 3, 4, 5, 6, 7], [4]], jax.random.key(1))  # same 16-bucket
  state, _ = s.generate(p, state, active=[True, True, False])
  state, _ = s.extend(p, state, [[7], [], [8, 9]])
  assert (s._prefill._cache_size(), s._generate._cache_size(), s._extend._cache_size()) == sizes == (1, 1, 1)


def test_sharded_generation_equals_single_device(model):
  mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 4})
  cfg = SamplingConfig(temperature=1.0, max_new_tokens=6)
  prompts = PROMPTS + [[3, 1, 4, 1, 5]]  # batch 4, divisible by data=2
  single = Sampler(model, cache_size=64, config=cfg, pad_id=PAD)
  _, expected = single.generate(_params(model), single.prefill(_params(model), prompts, jax.random.key(9)))
  sharded_model = models.shard_model(model, mesh, sharding.FSDP_TP_RULES)
  s = Sampler(sharded_model, cache_size=64, config=cfg, pad_id=PAD, mesh=mesh, rules=sharding.FSDP_TP_RULES)
  state = s.prefill(_params(sharded_model), prompts, jax.random.key(9))
  assert state.cache.k[0].sharding.spec[0] == "data"
  _, got = s.generate(_params(sharded_model), state)
  assert len(got.tokens.sharding.device_set) == 8
  assert np.array_equal(np.asarray(got.tokens), np.asarray(expected.tokens))
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(expected.logprobs), atol=1e-5)
