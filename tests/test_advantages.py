"""Advantage estimators: hand-computed values, GAE vs a numpy loop, zero-variance groups, masking."""

import math

import hypothesis
import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from jaxagent import algos
from jaxagent import config as config_lib

SETTINGS = hypothesis.settings(max_examples=25, deadline=None)


def _run(name, rewards, mask, groups, **kw):
  out = algos.get_advantage(name)(jnp.asarray(rewards, jnp.float32), jnp.asarray(mask, bool),
                                  jnp.asarray(groups, jnp.int32), **kw)
  return np.asarray(out.advantages), np.asarray(out.returns), int(out.zero_variance_groups)


def test_registry_names_and_config_validation():
  assert sorted(algos.ADVANTAGES) == ["gae", "grpo", "returns", "rloo"]
  with pytest.raises(config_lib.ConfigError, match=r"algo.advantage='grp': not one of .*did you mean 'grpo'"):
    config_lib.load(overrides=["algo.advantage=grp"])
  assert config_lib.load(overrides=["algo.advantage=gae"]).algo.advantage == "gae"
  with pytest.raises(config_lib.ConfigError, match="algo.kl_estimator"):
    config_lib.load(overrides=["algo.kl_estimator=k9"])
  with pytest.raises(config_lib.ConfigError, match="algo.dual_clip=0.5: must be > 1"):
    config_lib.load(overrides=["algo.dual_clip=0.5"])
  with pytest.raises(KeyError, match="registered"):
    algos.get_advantage("ppo")
  # The config's aggregation choices are exactly the loss's.
  hint = config_lib.AlgoConfig.__dataclass_fields__["aggregation"].type
  assert all(a in hint for a in algos.AGGREGATIONS)
  with pytest.raises(ValueError, match="already registered"):
    algos.register_advantage("grpo")(lambda *a, **k: None)


def test_grpo_hand_computed():
  # Group 0: returns 1, 0, 0, 1 -> mean 0.5, population std 0.5 -> ±1/(0.5+eps)*0.5.
  # Group 1: 2, 4 -> mean 3, std 1 -> -1, +1. Terminal rewards sit in the last valid step.
  rewards = [[0, 1], [0, 0], [0, 0], [1, 0], [2, 0], [4, 0]]
  mask = [[1, 1], [1, 0], [1, 1], [1, 0], [1, 0], [1, 0]]
  groups = [0, 0, 0, 0, 1, 1]
  adv, ret, zero = _run("grpo", rewards, mask, groups, eps=1e-6)
  e = 0.5 / (0.5 + 1e-6)
  np.testing.assert_allclose(adv[:, 0], [e, -e, -e, e, -1 / (1 + 1e-6), 1 / (1 + 1e-6)], rtol=1e-6)
  np.testing.assert_allclose(adv[:, 1], [e, 0, -e, 0, 0, 0], rtol=1e-6)   # broadcast over valid steps only
  np.testing.assert_allclose(ret[:, 0], [1, 0, 0, 1, 2, 4])
  assert zero == 0
  # Dr. GRPO: no std scaling.
  adv, _, _ = _run("grpo", rewards, mask, groups, scale_std=False)
  np.testing.assert_allclose(adv[:, 0], [0.5, -0.5, -0.5, 0.5, -1, 1])


def test_grpo_equal_rewards_exactly_zero_and_counted():
  # 0.1 * 3 / 3 != 0.1 in float32: a naive (R - mean) / (std + eps) gives ~±0.01 / 1e-6, not 0.
  rewards = [[0.1], [0.1], [0.1], [0.7], [0.7], [1.0], [0.0]]
  groups = [0, 0, 0, 1, 1, 2, 2]
  mask = np.ones((7, 1), bool)
  for name in ("grpo", "rloo"):
    for scale_std in (True, False):
      adv, _, zero = _run(name, rewards, mask, groups, scale_std=scale_std)
      np.testing.assert_array_equal(adv[:5], 0.0)
      assert adv[5, 0] > 0 > adv[6, 0]
      assert zero == 2, name
  # A group of one has no variance either.
  _, _, zero = _run("grpo", [[1.0], [2.0]], [[1], [1]], [0, 1])
  assert zero == 2


def test_rloo_hand_computed():
  # R = 1, 2, 6 in one group: A_i = R_i - mean(others) = 1-4, 2-3.5, 6-1.5.
  adv, _, zero = _run("rloo", [[1], [2], [6]], np.ones((3, 1)), [0, 0, 0])
  np.testing.assert_allclose(adv[:, 0], [-3.0, -1.5, 4.5])
  assert zero == 0


def test_returns_hand_computed_and_masked():
  # gamma 0.5: G = [1 + .5*(2 + .5*4), 2 + .5*4, 4] = [3, 4, 4]; row 2 has a masked NaN tail.
  rewards = np.array([[1, 2, 4], [1, np.nan, np.inf]], np.float32)
  mask = [[1, 1, 1], [1, 0, 0]]
  adv, ret, _ = _run("returns", rewards, mask, [0, 1], gamma=0.5)
  np.testing.assert_allclose(adv, [[3, 4, 4], [1, 0, 0]])
  np.testing.assert_array_equal(adv, ret)
  g = algos.discounted_returns(jnp.asarray(rewards), jnp.asarray(mask, bool), jnp.array([8.0, 2.0]), gamma=0.5)
  np.testing.assert_allclose(g, [[4, 6, 8], [2, 0, 0]])   # bootstrap after the last valid step


def test_gae_hand_computed():
  # r = [0, 1], V = [0.5, 0.8], terminal; γ = 0.9, λ = 0.8:
  # δ1 = 1 - 0.8 = 0.2; δ0 = 0 + 0.9*0.8 - 0.5 = 0.22; A1 = 0.2; A0 = 0.22 + 0.72*0.2 = 0.364.
  adv, ret, _ = _run("gae", [[0, 1]], [[1, 1]], [0], values_ns=jnp.array([[0.5, 0.8]]), gamma=0.9, lam=0.8)
  np.testing.assert_allclose(adv, [[0.364, 0.2]], rtol=1e-6)
  np.testing.assert_allclose(ret, [[0.864, 1.0]], rtol=1e-6)
  with pytest.raises(ValueError, match="values"):
    _run("gae", [[0, 1]], [[1, 1]], [0])


def _gae_reference(r, v, m, boot, gamma, lam):
  n, s = r.shape
  adv = np.zeros((n, s), np.float64)
  for i in range(n):
    steps = [t for t in range(s) if m[i, t]]
    next_v, next_a = float(boot[i]), 0.0
    for t in reversed(steps):
      delta = r[i, t] + gamma * next_v - v[i, t]
      next_a = delta + gamma * lam * next_a
      next_v = v[i, t]
      adv[i, t] = next_a
  return adv


@SETTINGS
@hypothesis.given(
    n=st.integers(1, 4), s=st.integers(1, 7), gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1))
def test_gae_equals_numpy_loop(n, s, gamma, lam, seed):
  rng = np.random.default_rng(seed)
  r = rng.normal(size=(n, s)).astype(np.float32)
  v = rng.normal(size=(n, s)).astype(np.float32)
  lengths = rng.integers(0, s + 1, size=n)
  m = np.arange(s)[None, :] < lengths[:, None]
  boot = rng.normal(size=n).astype(np.float32)
  r_bad, v_bad = r.copy(), v.copy()
  r_bad[~m], v_bad[~m] = np.nan, np.inf   # masked steps must never be read
  adv, ret = algos.gae(jnp.asarray(r_bad), jnp.asarray(v_bad), jnp.asarray(m), jnp.asarray(boot),
                       gamma=gamma, lam=lam)
  ref = _gae_reference(r, v, m, boot, gamma, lam)
  np.testing.assert_allclose(np.asarray(adv), ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ret), np.where(m, ref + v, 0.0), rtol=1e-5, atol=1e-5)
  # λ = 1 GAE is the discounted return minus the value.
  adv1, _ = algos.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), jnp.asarray(boot), gamma=gamma, lam=1.0)
  g = algos.discounted_returns(jnp.asarray(r), jnp.asarray(m), jnp.asarray(boot), gamma=gamma)
  np.testing.assert_allclose(np.asarray(adv1), np.where(m, np.asarray(g) - v, 0.0), rtol=1e-4, atol=1e-4)


@SETTINGS
@hypothesis.given(rewards=hnp.arrays(np.float32, st.integers(2, 12), elements=st.sampled_from([0.0, 0.1, 1.0])),
                  k=st.integers(1, 4))
def test_grpo_matches_numpy(rewards, k):
  groups = np.arange(len(rewards)) // k
  adv, zero = algos.grpo_scalar(jnp.asarray(rewards), jnp.asarray(groups, jnp.int32), eps=1e-6)
  want, flat = np.zeros(len(rewards)), 0
  for g in np.unique(groups):
    sel = groups == g
    x = rewards[sel].astype(np.float64)
    if x.max() == x.min():
      flat += 1
      continue
    want[sel] = (x - x.mean()) / (x.std() + 1e-6)
  np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-4, atol=1e-5)
  assert int(zero) == flat
  assert np.all(np.isfinite(np.asarray(adv)))
  assert not math.isnan(float(np.asarray(adv).sum()))
