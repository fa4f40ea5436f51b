"""Masked policy / value losses: hand-computed values, masking properties, micro-batch equivalence."""

import functools
import math

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from jaxagent import algos

SETTINGS = hypothesis.settings(max_examples=12, deadline=None)
LN = math.log


def policy_loss(logp, old, adv, mask, normalizer, *, segment_ids_bt=None, ref_logp_bt=None, entropy_bt=None,
                behavior_logp_bt=None, **config):
  """`algos.policy_loss` on these arrays, with `config` its `PolicyLossConfig` fields."""
  tokens = algos.TokenLossInputs(logp, old, adv, mask, normalizer, segment_ids=segment_ids_bt, ref_logp=ref_logp_bt,
                                 entropy=entropy_bt, behavior_logp=behavior_logp_bt)
  return algos.policy_loss(tokens, algos.PolicyLossConfig(**config))


def _loss(logp, old, adv, mask, normalizer=None, **kw):
  mask = jnp.asarray(mask, bool)
  if normalizer is None:
    normalizer = algos.loss_normalizer(np.asarray(mask), kw.get("segment_ids_bt"),
                                       aggregation=kw.get("aggregation", "token-mean"))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return policy_loss(f32(logp), f32(old), f32(adv), mask, normalizer, **kw)


def test_ppo_clip_hand_computed():
  # ratios 1.5, 0.5, 0.5, 4 (and a masked NaN slot); advantages +1, +2, -1, -1; ε = 0.2.
  logp = [[LN(1.5), LN(0.5), LN(0.5), LN(4.0), np.nan]]
  old = [[0.0, 0.0, 0.0, 0.0, np.inf]]
  adv = [[1.0, 2.0, -1.0, -1.0, np.nan]]
  mask = [[1, 1, 1, 1, 0]]
  # per token: max(-A r, -A clip(r)) = -1.2 (clipped), -1.0, 0.8 (clipped), 4.0
  loss, m = _loss(logp, old, adv, mask)
  np.testing.assert_allclose(loss, (-1.2 - 1.0 + 0.8 + 4.0) / 4, rtol=1e-6)
  np.testing.assert_allclose(m["clip_fraction"], 0.5)
  np.testing.assert_allclose([m["ratio_mean"], m["ratio_min"], m["ratio_max"]], [1.625, 0.5, 4.0], rtol=1e-6)
  # approx-KL (k3 of old vs new): mean of (r - 1 - log r).
  want = np.mean([r - 1 - LN(r) for r in (1.5, 0.5, 0.5, 4.0)])
  np.testing.assert_allclose(m["approx_kl"], want, rtol=1e-5)
  assert float(m["loss_tokens"]) == 4 and float(m["skipped"]) == 0
  # Dual clip c = 3 caps the last token (A < 0, r = 4) at 3.
  loss, m = _loss(logp, old, adv, mask, dual_clip=3.0)
  np.testing.assert_allclose(loss, (-1.2 - 1.0 + 0.8 + 3.0) / 4, rtol=1e-6)
  np.testing.assert_allclose(m["clip_fraction"], 0.75)
  # Asymmetric ε (clip-higher): ε_high = 0.6 leaves r = 1.5 unclipped; ε_low = 0.4 clips 0.5 up to 0.6.
  loss, _ = _loss(logp, old, adv, mask, eps_low=0.4, eps_high=0.6)
  np.testing.assert_allclose(loss, (-1.5 - 1.0 + 0.6 + 4.0) / 4, rtol=1e-6)


def test_aggregation_modes_hand_computed():
  # ratio 1, A = -ℓ, so the per-token loss is ℓ: row 0 has ℓ = 1, 2, 3; row 1 has ℓ = 4.
  ell = np.array([[1, 2, 3, 0], [4, 0, 0, 0]], np.float32)
  mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
  zeros = np.zeros_like(ell)
  packed_ell, packed_mask = np.array([[1, 2, 3, 4]], np.float32), np.ones((1, 4), bool)
  packed_seg = np.array([[1, 1, 1, 2]], np.int32)
  for agg, want, kw in (("token-mean", 10 / 4, {}), ("seq-mean-token-mean", (2 + 4) / 2, {}),
                        ("seq-mean-token-sum-norm", 10 / (2 * 5), {"norm_length": 5})):
    norm = algos.loss_normalizer(mask, aggregation=agg, **kw)
    loss, _ = _loss(zeros, zeros, -ell, mask, norm, aggregation=agg)
    np.testing.assert_allclose(loss, want, rtol=1e-6, err_msg=agg)
    # The same two sequences packed into one row with segment ids give the same loss.
    norm = algos.loss_normalizer(packed_mask, packed_seg, aggregation=agg, **kw)
    loss, _ = _loss(np.zeros((1, 4)), np.zeros((1, 4)), -packed_ell, packed_mask, norm, aggregation=agg,
                    segment_ids_bt=jnp.asarray(packed_seg))
    np.testing.assert_allclose(loss, want, rtol=1e-6, err_msg=f"packed {agg}")


def test_sequence_ratio_gspo_hand_computed():
  # log-ratios log 2 and 0 -> sequence ratio exp(mean) = √2 on both tokens; A = 1; ε_high = 0.5: unclipped.
  logp = jnp.array([[LN(2.0), 0.0]], jnp.float32)
  f = lambda lp: _loss(lp, [[0.0, 0.0]], [[1.0, 1.0]], [[1, 1]], ratio_level="sequence", eps_high=0.5)
  (loss, m), grad = jax.value_and_grad(f, has_aux=True)(logp)
  s = math.sqrt(2)
  np.testing.assert_allclose(loss, -s, rtol=1e-6)
  np.testing.assert_allclose(m["ratio_mean"], s, rtol=1e-6)
  np.testing.assert_allclose(grad, [[-s / 2, -s / 2]], rtol=1e-6)   # GSPO: s_i ∇ mean_t log π
  # ε_high = 0.2 clips √2 to 1.2 (A > 0): constant loss, zero gradient.
  g = lambda lp: _loss(lp, [[0.0, 0.0]], [[1.0, 1.0]], [[1, 1]], ratio_level="sequence")[0]
  np.testing.assert_allclose(g(logp), -1.2, rtol=1e-6)
  np.testing.assert_array_equal(jax.grad(g)(logp), 0.0)


def test_kl_and_entropy_terms_hand_computed():
  logp, ref = [[-1.0, 5.0]], [[-2.0, np.nan]]
  mask = [[1, 0]]
  for est, want in (("k1", 1.0), ("k2", 0.5), ("k3", math.exp(-1) - 1 + 1)):
    loss, m = _loss(logp, logp, [[0.0, 0.0]], mask, ref_logp_bt=jnp.asarray(ref), kl_estimator=est,
                    kl_coef=0.5)
    np.testing.assert_allclose(loss, 0.5 * want, rtol=1e-6, err_msg=est)
    np.testing.assert_allclose(m["kl"], want, rtol=1e-6)
  logits = jnp.array([[[0.0, 0.0], [0.0, -jnp.inf]]])
  ent = algos.entropy(logits)
  np.testing.assert_allclose(ent, [[LN(2), 0.0]], atol=1e-7)
  assert np.all(np.isfinite(jax.grad(lambda x: algos.entropy(x).sum())(logits)))
  loss, m = _loss(logp, logp, [[0.0, 0.0]], [[1, 1]], entropy_bt=ent, entropy_coef=0.1)
  np.testing.assert_allclose(loss, -0.1 * LN(2) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["entropy"], LN(2) / 2, rtol=1e-6)
  with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logp"):
    _loss(logp, logp, [[0.0, 0.0]], mask, kl_coef=0.1)


def test_value_loss_hand_computed():
  v, old, ret = [[1.5, 1.1, np.nan]], [[1.0, 1.0, np.inf]], [[2.0, 1.0, 0.0]]
  mask = jnp.array([[1, 1, 0]], bool)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  loss, m = algos.value_loss(f32(v), f32(old), f32(ret), mask, 2.0, clip_eps=0.2)
  # token 0: max((1.5-2)², (1.2-2)²)/2 = 0.32 (clipped); token 1: 0.01/2.
  np.testing.assert_allclose(loss, (0.32 + 0.005) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["value_clip_fraction"], 0.5)
  np.testing.assert_allclose(m["value_error"], (0.5 + 0.1) / 2, rtol=1e-6)
  assert float(m["value_positions"]) == 2   # the weight of these means when micro-batches are combined
  loss, _ = algos.value_loss(f32(v), f32(old), f32(ret), mask, 2.0, clip_eps=None)
  np.testing.assert_allclose(loss, (0.125 + 0.005) / 2, rtol=1e-6)


def test_all_masked_batch_is_explicit():
  mask = np.zeros((2, 3), bool)
  with pytest.raises(algos.AllMaskedError, match="loss_mask=0"):
    algos.loss_normalizer(mask)
  norm = algos.loss_normalizer(mask, allow_empty=True)
  assert norm == 0
  nan = jnp.full((2, 3), jnp.nan)
  f = lambda lp: policy_loss(lp, nan, nan, jnp.asarray(mask), norm, ref_logp_bt=nan, kl_coef=0.1)
  (loss, m), grad = jax.value_and_grad(f, has_aux=True)(nan)
  assert float(loss) == 0.0 and float(m["skipped"]) == 1.0 and float(m["loss_tokens"]) == 0
  np.testing.assert_array_equal(grad, 0.0)
  assert all(np.isfinite(float(v)) for v in m.values())


# ----------------------------------------------------------------------------------------------
# Properties.

CONFIGS = st.fixed_dictionaries({
    "aggregation": st.sampled_from(algos.AGGREGATIONS),
    "ratio_level": st.sampled_from(["token", "sequence"]),
    "dual_clip": st.sampled_from([None, 3.0]),
    "kl_coef": st.sampled_from([0.0, 0.1]),
    "entropy_coef": st.sampled_from([0.0, 0.01]),
    "kl_estimator": st.sampled_from(["k1", "k3"]),
})


def _problem(seed, b=3, t=6, v=5, pack=False):
  rng = np.random.default_rng(seed)
  mask = rng.random((b, t)) < 0.5
  mask[0, 1] = True   # never all-masked
  mask[:, 0] = False  # position 0 is never predicted
  seg = None
  if pack:
    seg = np.where(np.arange(t) < t // 2, 1, 2)[None].repeat(b, 0).astype(np.int32)
  return dict(
      logits=rng.normal(size=(b, t, v)).astype(np.float32),
      tokens=rng.integers(0, v, size=(b, t)).astype(np.int32),
      old=(-rng.random((b, t)) * 2).astype(np.float32),
      ref=(-rng.random((b, t)) * 2).astype(np.float32),
      adv=rng.normal(size=(b, t)).astype(np.float32),
      mask=mask, seg=seg)


@functools.lru_cache(maxsize=None)
def _compiled(cfg_items, shifted, packed):
  """One jitted value-and-grad per configuration (hypothesis examples reuse it)."""
  cfg = dict(cfg_items)
  lp_fn, ent_fn = ((algos.next_token_logprobs, algos.next_token_entropy) if shifted
                   else (algos.token_logprobs, algos.entropy))

  def f(logits, tokens, old, ref, adv, mask, seg, normalizer):
    logp = lp_fn(logits, tokens, mask)
    ent = ent_fn(logits, mask)
    return policy_loss(logp, old, adv, mask, normalizer, segment_ids_bt=seg if packed else None,
                             ref_logp_bt=ref, entropy_bt=ent, **cfg)
  return jax.jit(jax.value_and_grad(f, has_aux=True))


def _logit_loss(p, cfg, shifted):
  normalizer = algos.loss_normalizer(p["mask"], p["seg"], aggregation=cfg["aggregation"], norm_length=8)
  packed = p["seg"] is not None
  seg = p["seg"] if packed else np.zeros_like(p["tokens"])
  fn = _compiled(tuple(sorted(cfg.items())), shifted, packed)
  return fn(p["logits"], p["tokens"], p["old"], p["ref"], p["adv"], p["mask"], seg, normalizer)


@SETTINGS
@hypothesis.given(cfg=CONFIGS, seed=st.integers(0, 2**31 - 1), shifted=st.booleans())
def test_masked_positions_have_exactly_zero_gradient(cfg, seed, shifted):
  p = _problem(seed)
  (loss, _), grad = _logit_loss(p, cfg, shifted)
  grad = np.asarray(grad)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(grad))
  if shifted:   # logits at t-1 predict token t; the last position predicts nothing
    dead = np.concatenate([~p["mask"][:, 1:], np.ones_like(p["mask"][:, :1])], axis=1)
  else:
    dead = ~p["mask"]
  assert np.all(grad[dead] == 0.0)
  # Vacuous draws (every live token clipped, so the true gradient is 0) prove nothing: discard them.
  hypothesis.assume(np.any(grad[~dead] != 0.0))


@SETTINGS
@hypothesis.given(cfg=CONFIGS, seed=st.integers(0, 2**31 - 1), shifted=st.booleans(),
                  junk=st.sampled_from([np.nan, np.inf, -np.inf, 1e30, -7.0]))
def test_masked_inputs_change_nothing(cfg, seed, shifted, junk):
  p = _problem(seed)
  (loss, metrics), grad = _logit_loss(p, cfg, shifted)
  q = dict(p)
  dead = ~p["mask"]
  rng = np.random.default_rng(seed + 1)
  q["tokens"] = np.where(dead, rng.integers(-3, 50, size=dead.shape), p["tokens"]).astype(np.int32)
  for k in ("old", "ref", "adv"):
    q[k] = np.where(dead, np.float32(junk), p[k])
  if not shifted:   # unshifted: the logits row at a masked position belongs to that position alone
    q["logits"] = np.where(dead[..., None], np.float32(junk), p["logits"])
  (loss2, metrics2), grad2 = _logit_loss(q, cfg, shifted)
  assert float(loss2) == float(loss)
  np.testing.assert_array_equal(np.asarray(grad2), np.asarray(grad))
  for k in metrics:
    assert float(metrics2[k]) == float(metrics[k]), k


@pytest.mark.parametrize("aggregation", algos.AGGREGATIONS)
@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(cfg=CONFIGS, seed=st.integers(0, 2**31 - 1), pack=st.booleans())
def test_micro_batches_sum_to_the_full_batch_gradient(aggregation, cfg, seed, pack):
  """A shared parameter W (logits = E[tokens] @ W); grad over 4 rows == Σ grads over 2-row micro-batches."""
  b, t, v, d = 4, 6, 5, 3
  p = _problem(seed, b=b, t=t, v=v, pack=pack)
  cfg = {**cfg, "aggregation": aggregation}
  p["mask"][2] = False   # one row without loss tokens: its micro-batch still uses the global normalizer
  rng = np.random.default_rng(seed + 2)
  emb = jnp.asarray(rng.normal(size=(v, d)).astype(np.float32))
  w = jnp.asarray(rng.normal(size=(d, v)).astype(np.float32))
  normalizer = algos.loss_normalizer(p["mask"], p["seg"], aggregation=cfg["aggregation"], norm_length=8)

  @jax.jit
  @jax.value_and_grad
  def loss_fn(w, tokens, old, ref, adv, mask, seg):
    logits = emb[tokens] @ w
    logp = algos.next_token_logprobs(logits, tokens, mask)
    ent = algos.next_token_entropy(logits, mask)
    return policy_loss(logp, old, adv, mask, normalizer, segment_ids_bt=seg if pack else None,
                             ref_logp_bt=ref, entropy_bt=ent, **cfg)[0]

  seg = p["seg"] if pack else np.zeros_like(p["tokens"])
  run = lambda rows: loss_fn(w, *(x[rows] for x in (p["tokens"], p["old"], p["ref"], p["adv"], p["mask"],
                                                      seg)))
  full_loss, full = run(np.arange(4))
  parts = [run(rows) for rows in (np.arange(2), np.arange(2, 4))]
  np.testing.assert_allclose(sum(l for l, _ in parts), full_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sum(g for _, g in parts), full, rtol=1e-5, atol=1e-6)
  # Vacuous draws (every token clipped, so the true gradient is 0) prove nothing about accumulation: discard them.
  hypothesis.assume(np.any(np.asarray(full) != 0))
