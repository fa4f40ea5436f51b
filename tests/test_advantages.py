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


def estimate(name, rewards, mask, groups, *, values_ns=None, bootstrap_n=None, step_groups_ns=None, **config):
  """The registered estimator `name` on these arrays, with `config` its `AdvantageConfig` fields."""
  inputs = algos.AdvantageInputs(rewards, mask, groups, values=values_ns, bootstrap=bootstrap_n,
                                 step_groups=step_groups_ns)
  return algos.get_advantage(name)(inputs, algos.AdvantageConfig(**config))


def _run(name, rewards, mask, groups, **kw):
  out = estimate(name, jnp.asarray(rewards, jnp.float32), jnp.asarray(mask, bool), jnp.asarray(groups, jnp.int32),
                 **kw)
  return np.asarray(out.advantages), np.asarray(out.returns), int(out.zero_variance_groups)


def test_registry_names_and_config_validation():
  assert sorted(algos.ADVANTAGES) == ["gae", "gigpo", "grpo", "returns", "rloo"]
  with pytest.raises(config_lib.ConfigError, match=r"algo.advantage='grp': not one of .*did you mean 'grpo'"):
    config_lib.load(overrides=["algo.advantage=grp"])
  assert config_lib.load(overrides=["algo.advantage=gae", "algo.name=ppo"]).algo.advantage == "gae"
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


def test_group_statistics_count_only_the_trajectories_the_estimator_uses():
  """An all-masked row (no valid step: e.g. excluded for an infrastructure failure) is in no group.

  Group 0: returns 1, 1 and an all-masked row (its return would be 0 if counted: std 0.47, not flat).
  Group 1: returns 0, 2 -> population std 1. Group 2: only an all-masked row -> not a group at all.
  Group 3: returns 1 + 2 = 3, 0 and 6 (a NaN after its last valid step) -> std sqrt(6).
  """
  nan = np.nan
  rewards = np.array([[1, 0], [0, 1], [5, 5], [0, 0], [2, 0], [7, 7], [1, 2], [0, 0], [6, nan]], np.float32)
  mask = np.array([[1, 0], [1, 1], [0, 0], [1, 1], [1, 0], [0, 0], [1, 1], [1, 1], [1, 0]], bool)
  groups = [0, 0, 0, 1, 1, 2, 3, 3, 3]
  want_std = (0.0 + 1.0 + math.sqrt(6.0)) / 3
  for name in sorted(algos.ADVANTAGES):
    kw = {"values_ns": jnp.zeros(mask.shape)} if name == "gae" else {}
    out = estimate(name, jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(groups, jnp.int32), **kw)
    assert out.groups.dtype == jnp.int32 and out.group_return_std.dtype == jnp.float32, name
    assert int(out.groups) == 3, name
    assert int(out.zero_variance_groups) == 1, name   # group 0: a zero_variance_group_fraction of 1/3
    np.testing.assert_allclose(float(out.group_return_std), want_std, rtol=1e-6, err_msg=name)
  # Counting every row, as the host statistics over all trajectories did, would give other numbers.
  totals = np.array([1, 1, 0, 0, 2, 0, 3, 0, 6], np.float64)
  per_group = [totals[np.asarray(groups) == g] for g in range(4)]
  assert np.mean([x.std() for x in per_group]) != pytest.approx(want_std)
  # All rows: group 0 varies and the all-masked group 2 counts as flat: 1 of 4 groups, not 1 of 3.
  assert np.mean([np.ptp(x) == 0 for x in per_group]) == 1 / 4


def test_group_statistics_match_numpy_on_random_batches():
  rng = np.random.default_rng(0)
  n, s = 12, 3
  for trial in range(5):
    rewards = rng.choice([0.0, 0.5, 1.0], size=(n, s)).astype(np.float32)
    lengths = rng.integers(0, s + 1, size=n)   # some rows have no valid step
    mask = np.arange(s)[None, :] < lengths[:, None]
    groups = np.sort(rng.integers(0, 5, size=n)).astype(np.int32)
    ret = np.where(mask, rewards, 0.0).sum(axis=1).astype(np.float64)
    stds, flat = [], 0
    for g in np.unique(groups[lengths > 0]):
      x = ret[(groups == g) & (lengths > 0)]
      stds.append(x.std())
      flat += int(np.ptp(x) == 0)
    for name in ("grpo", "returns"):
      out = estimate(name, jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(groups))
      assert int(out.groups) == len(stds), (trial, name)
      assert int(out.zero_variance_groups) == flat, (trial, name)
      np.testing.assert_allclose(float(out.group_return_std), np.mean(stds) if stds else 0.0, rtol=1e-5,
                                 atol=1e-6, err_msg=f"{trial} {name}")
  # No valid trajectory at all: no group, std 0 (not NaN).
  out = estimate("grpo", jnp.ones((2, 2)), jnp.zeros((2, 2), bool), jnp.array([0, 1], jnp.int32))
  assert int(out.groups) == 0 and int(out.zero_variance_groups) == 0 and float(out.group_return_std) == 0.0


def test_gae_estimator_bootstraps_truncated_episodes_only():
  """Row 0 is truncated after 2 steps (V(s_T) = 2 passed as bootstrap_n), row 1 terminal (bootstrap 0).

  γ = 0.9, λ = 0.8, r = [0, 1], V = [0.5, 0.8] in both rows; step 2 is masked (NaN: never read).
  Truncated: δ1 = 1 + 0.9·2 − 0.8 = 2.0, δ0 = 0.9·0.8 − 0.5 = 0.22, A = [0.22 + 0.72·2.0, 2.0] = [1.66, 2.0].
  Terminal:  δ1 = 1 − 0.8 = 0.2, A = [0.22 + 0.72·0.2, 0.2] = [0.364, 0.2]. Returns = A + V.
  """
  rewards = jnp.array([[0, 1, np.nan], [0, 1, np.nan]], jnp.float32)
  values = jnp.array([[0.5, 0.8, np.inf], [0.5, 0.8, np.inf]], jnp.float32)
  mask = jnp.array([[1, 1, 0], [1, 1, 0]], bool)
  out = estimate("gae", rewards, mask, jnp.array([0, 1], jnp.int32), values_ns=values,
                                   bootstrap_n=jnp.array([2.0, 0.0]), gamma=0.9, lam=0.8)
  np.testing.assert_allclose(out.advantages, [[1.66, 2.0, 0], [0.364, 0.2, 0]], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(out.returns, [[2.16, 2.8, 0], [0.864, 1.0, 0]], rtol=1e-6, atol=1e-7)
  # Without bootstrap_n both rows are terminal.
  plain = estimate("gae", rewards, mask, jnp.array([0, 1], jnp.int32), values_ns=values, gamma=0.9,
                                     lam=0.8)
  np.testing.assert_allclose(plain.advantages[0], plain.advantages[1])
  np.testing.assert_allclose(plain.advantages[1], [0.364, 0.2, 0], rtol=1e-6, atol=1e-7)
