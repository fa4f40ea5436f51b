"""Advantage estimators (docs/design.md §2.6): pure jittable functions, registered by name.

Every registered estimator has the signature

    fn(x: AdvantageInputs, config: AdvantageConfig) -> AdvantageOutput

and reads the inputs and settings it uses (`AdvantageInputs`: rewards, step mask, task groups; values and
bootstraps for GAE; anchor-state groups for GiGPO). Outputs are per step: trajectory-level estimators (grpo,
rloo) broadcast their scalar over the valid steps.

Each estimator also describes the groups it used, over exactly the trajectories it treats as valid (those with
at least one valid step; a trajectory with an all-False step mask, e.g. one excluded for an infrastructure
failure, is in no group): how many groups have a valid trajectory, how many of them have all-equal returns (no
learning signal for group-relative estimators; counted, never hidden), and the mean within-group return std.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax


@flax.struct.dataclass
class AdvantageInputs:
  """What an estimator reads. Shape letters: N trajectories, S steps (turns).

  Attributes:
    rewards: float[N, S] per-step rewards, the terminal reward folded into the last valid step.
    mask: bool[N, S] the valid steps (a prefix of each row); values at masked steps are never read (may be NaN).
    group_ids: int[N] dense group indices in [0, N) (the trajectories of one task).
    values: float[N, S] value estimates per step (gae).
    bootstrap: float[N] the value after the last step of a truncated trajectory (0: terminal); None: all 0.
    step_groups: int[N, S] dense anchor-state group indices in [0, N·S), -1 for a step in none (gigpo;
      `assembly.step_group_indices`).
  """
  rewards: jax.Array
  mask: jax.Array
  group_ids: jax.Array
  values: jax.Array | None = None
  bootstrap: jax.Array | None = None
  step_groups: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """An estimator's settings (static); `from_algo` reads an `AlgoConfig`.

  Attributes:
    gamma: discount over turns. lam: GAE λ.
    eps, scale_std: the group normalisation (R − mean) / (std + eps); scale_std False: no std (Dr. GRPO).
    step_weight, step_gamma: gigpo's ω and the discount of its step returns.
  """
  gamma: float = 1.0
  lam: float = 1.0
  eps: float = 1e-6
  scale_std: bool = True
  step_weight: float = 1.0
  step_gamma: float = 0.95

  @classmethod
  def from_algo(cls, algo) -> "AdvantageConfig":
    return cls(gamma=algo.gamma, lam=algo.gae_lambda, eps=algo.adv_eps, scale_std=algo.scale_std,
               step_weight=algo.step_weight, step_gamma=algo.step_gamma)


@flax.struct.dataclass
class AdvantageOutput:
  """Per-step advantages and returns, and statistics of the groups the estimator used.

  Attributes:
    advantages: float32[N, S] (0 at masked steps).
    returns: float32[N, S] discounted return-to-go (GAE: A + V).
    zero_variance_groups: int32[] groups (with at least one valid trajectory) whose returns are all equal.
    groups: int32[] groups with at least one valid trajectory (the denominator of `zero_variance_groups`).
    group_return_std: float32[] mean over those groups of the population std of the trajectory returns
      (discounted, with `bootstrap_n`) of the group's valid trajectories; 0 for a group whose returns are all
      equal; 0 when there is no group.
    step_stats: gigpo only (else None): {"step_groups": step groups of >= 2 steps, "grouped_step_fraction":
      the fraction of valid steps in one, "step_group_size_mean": their mean size}.
  """
  advantages: jax.Array
  returns: jax.Array
  zero_variance_groups: jax.Array
  groups: jax.Array
  group_return_std: jax.Array
  step_stats: dict[str, jax.Array] | None = None


AdvantageFn = Callable[..., AdvantageOutput]
ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
  """Registers an estimator under `name` (validated by `AlgoConfig.advantage` at config load)."""
  def wrap(fn: AdvantageFn) -> AdvantageFn:
    if name in ADVANTAGES:
      raise ValueError(f"advantage estimator {name!r} is already registered")
    ADVANTAGES[name] = fn
    return fn
  return wrap


def get_advantage(name: str) -> AdvantageFn:
  try:
    return ADVANTAGES[name]
  except KeyError:
    raise KeyError(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGES)}") from None


# ----------------------------------------------------------------------------------------------
# Building blocks.


@functools.partial(jax.jit, static_argnames=("gamma",))
def discounted_returns(rewards_ns: jax.Array, mask_ns: jax.Array, bootstrap_n: jax.Array | None = None,
                       *, gamma: float = 1.0) -> jax.Array:
  """Return-to-go `G_t = r_t + γ G_{t+1}` per valid step (reverse `lax.scan`); 0 at masked steps.

  Args:
    rewards_ns: float[N, S] per-step rewards.
    mask_ns: bool[N, S] valid steps. Masked steps are skipped (the carry passes through them).
    bootstrap_n: float[N] value after the last valid step (truncated episodes); default 0.
    gamma: discount.
  Returns:
    float32[N, S].
  """
  mask_ns = mask_ns.astype(bool)
  r_ns = jnp.where(mask_ns, rewards_ns, 0.0).astype(jnp.float32)
  g0_n = jnp.zeros(r_ns.shape[0], jnp.float32) if bootstrap_n is None else bootstrap_n.astype(jnp.float32)

  def step(g_n, xs):
    r_n, m_n = xs
    g_new = r_n + gamma * g_n
    return jnp.where(m_n, g_new, g_n), jnp.where(m_n, g_new, 0.0)

  _, g_sn = lax.scan(step, g0_n, (r_ns.T, mask_ns.T), reverse=True)
  return g_sn.T


@functools.partial(jax.jit, static_argnames=("gamma", "lam"))
def gae(rewards_ns: jax.Array, values_ns: jax.Array, mask_ns: jax.Array,
        bootstrap_n: jax.Array | None = None, *, gamma: float = 1.0, lam: float = 1.0
        ) -> tuple[jax.Array, jax.Array]:
  """Generalized advantage estimation (Schulman et al. 2016, arXiv:1506.02438) as a reverse `lax.scan`.

  `δ_t = r_t + γ V_{t+1} − V_t`, `A_t = δ_t + γλ A_{t+1}`; after the last valid step `V = bootstrap` (0 for a
  terminal state) and `A = 0`. Masked steps are skipped: the carry passes through them unchanged.

  Returns:
    (advantages float32[N, S], returns float32[N, S] = A + V), both 0 at masked steps.
  """
  mask_ns = mask_ns.astype(bool)
  r_ns = jnp.where(mask_ns, rewards_ns, 0.0).astype(jnp.float32)
  v_ns = jnp.where(mask_ns, values_ns, 0.0).astype(jnp.float32)
  n = r_ns.shape[0]
  v0_n = jnp.zeros(n, jnp.float32) if bootstrap_n is None else bootstrap_n.astype(jnp.float32)

  def step(carry, xs):
    next_v_n, next_a_n = carry
    r_n, v_n, m_n = xs
    delta_n = r_n + gamma * next_v_n - v_n
    a_n = delta_n + gamma * lam * next_a_n
    carry = (jnp.where(m_n, v_n, next_v_n), jnp.where(m_n, a_n, next_a_n))
    return carry, jnp.where(m_n, a_n, 0.0)

  _, a_sn = lax.scan(step, (v0_n, jnp.zeros(n, jnp.float32)), (r_ns.T, v_ns.T, mask_ns.T), reverse=True)
  a_ns = a_sn.T
  return a_ns, jnp.where(mask_ns, a_ns + v_ns, 0.0)


def _group_stats(x_n, group_ids_n, valid_n):
  """Per-trajectory group count, mean, population variance, and `all equal` flag (segment reductions)."""
  return _group_stats_sized(x_n, group_ids_n, valid_n, x_n.shape[0])


def _group_stats_sized(x_n, group_ids_n, valid_n, n):
  """`_group_stats` over `n` segments (ids in [0, n))."""
  x_n = jnp.where(valid_n, x_n, 0.0)
  w_n = valid_n.astype(jnp.float32)
  count_g = jax.ops.segment_sum(w_n, group_ids_n, num_segments=n)
  mean_g = jax.ops.segment_sum(x_n, group_ids_n, num_segments=n) / jnp.maximum(count_g, 1.0)
  dev_n = jnp.where(valid_n, x_n - mean_g[group_ids_n], 0.0)
  var_g = jax.ops.segment_sum(dev_n * dev_n, group_ids_n, num_segments=n) / jnp.maximum(count_g, 1.0)
  # Exact equality, not `std == 0`: a float mean of equal values need not equal them bit for bit.
  hi_g = jax.ops.segment_max(jnp.where(valid_n, x_n, -jnp.inf), group_ids_n, num_segments=n)
  lo_g = jax.ops.segment_min(jnp.where(valid_n, x_n, jnp.inf), group_ids_n, num_segments=n)
  flat_g = (count_g > 0) & (hi_g == lo_g)
  return count_g, mean_g, var_g, flat_g


def _broadcast_steps(adv_n, mask_ns):
  return jnp.where(mask_ns, adv_n[:, None], 0.0).astype(jnp.float32)


def trajectory_returns(rewards_ns, mask_ns, bootstrap_n=None, *, gamma=1.0):
  """R(τ) = Σ_t γ^t r_t (+ γ^T bootstrap): the return-to-go at step 0. float32[N]."""
  return discounted_returns(rewards_ns, mask_ns, bootstrap_n, gamma=gamma)[:, 0]


@functools.partial(jax.jit, static_argnames=("eps", "scale_std"))
def grpo_scalar(returns_n: jax.Array, group_ids_n: jax.Array, valid_n: jax.Array | None = None, *,
                eps: float = 1e-6, scale_std: bool = True) -> tuple[jax.Array, jax.Array]:
  """GRPO (Shao et al. 2024, arXiv:2402.03300): `(R − mean_g) / (std_g + ε)`, population std.

  `scale_std=False` drops the division (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783). Groups whose returns are
  all equal get exactly 0 (not `tiny / ε`) and are counted.

  Returns:
    (advantages float32[N], zero_variance_groups int32[]).
  """
  valid_n = jnp.ones(returns_n.shape, bool) if valid_n is None else valid_n.astype(bool)
  r_n = returns_n.astype(jnp.float32)
  _, mean_g, var_g, flat_g = _group_stats(r_n, group_ids_n, valid_n)
  centered_n = r_n - mean_g[group_ids_n]
  adv_n = centered_n / (jnp.sqrt(var_g[group_ids_n]) + eps) if scale_std else centered_n
  adv_n = jnp.where(valid_n & ~flat_g[group_ids_n], adv_n, 0.0)
  return adv_n, flat_g.sum().astype(jnp.int32)


@jax.jit
def rloo_scalar(returns_n: jax.Array, group_ids_n: jax.Array, valid_n: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): `R_i − mean_{j≠i, j∈g} R_j`.

  Singleton groups have no baseline and get 0; groups with all-equal returns get exactly 0; both counted
  as zero-variance groups.

  Returns:
    (advantages float32[N], zero_variance_groups int32[]).
  """
  valid_n = jnp.ones(returns_n.shape, bool) if valid_n is None else valid_n.astype(bool)
  r_n = jnp.where(valid_n, returns_n, 0.0).astype(jnp.float32)
  count_g, _, _, flat_g = _group_stats(r_n, group_ids_n, valid_n)
  total_g = jax.ops.segment_sum(r_n, group_ids_n, num_segments=r_n.shape[0])
  k_n = count_g[group_ids_n]
  others_mean_n = (total_g[group_ids_n] - r_n) / jnp.maximum(k_n - 1.0, 1.0)
  adv_n = jnp.where(valid_n & (k_n > 1) & ~flat_g[group_ids_n], r_n - others_mean_n, 0.0)
  return adv_n, flat_g.sum().astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("eps", "scale_std"))
def step_group_advantages(returns_ns: jax.Array, step_groups_ns: jax.Array, mask_ns: jax.Array, *,
                          eps: float = 1e-6, scale_std: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GiGPO's step-level advantage A_S (Feng et al. 2025, arXiv:2505.10978): the return-to-go of each step,
  normalised within its anchor-state group, `(R_t − mean_g) / (std_g + ε)` (population std; `scale_std=False`:
  `R_t − mean_g`).

  A step in no group (index -1, or masked), alone in its group (no other step from that state to compare
  with), or in a group whose returns are all equal gets exactly 0.

  Returns:
    (A_S float32[N, S], {"step_groups", "grouped_step_fraction", "step_group_size_mean"}).
  """
  n, s = returns_ns.shape
  valid = mask_ns.astype(bool) & (step_groups_ns >= 0)
  ids = jnp.where(valid, step_groups_ns, 0).reshape(-1)
  count_g, mean_g, var_g, flat_g = _group_stats(returns_ns.astype(jnp.float32).reshape(-1), ids,
                                                valid.reshape(-1))
  r = returns_ns.astype(jnp.float32).reshape(-1)
  centered = r - mean_g[ids]
  adv = centered / (jnp.sqrt(var_g[ids]) + eps) if scale_std else centered
  used = valid.reshape(-1) & (count_g[ids] > 1) & ~flat_g[ids]
  adv = jnp.where(used, adv, 0.0).reshape(n, s)
  multi_g = count_g > 1
  groups = multi_g.sum()
  grouped = jnp.where(valid.reshape(-1), multi_g[ids], False).sum()
  stats = {"step_groups": groups.astype(jnp.int32),
           "grouped_step_fraction": grouped / jnp.maximum(mask_ns.astype(bool).sum(), 1),
           "step_group_size_mean": jnp.sum(jnp.where(multi_g, count_g, 0.0)) / jnp.maximum(groups, 1)}
  return adv, stats


@functools.partial(jax.jit, static_argnames=("eps", "scale_std"))
def turn_advantages(turn_rewards_ns: jax.Array, mask_ns: jax.Array, group_ids_n: jax.Array, *,
                    eps: float = 1e-6, scale_std: bool = True) -> jax.Array:
  """Turn-level advantages (MT-GRPO, Zeng et al. 2025, arXiv:2505.11821): each turn's own reward normalised
  over the group's trajectories at the same turn index, `(r_t − mean_{g,t}) / (std_{g,t} + ε)`; 0 at masked
  steps, for a turn no other trajectory of the group reached, and where the group's turn rewards are equal.

  Returns:
    float32[N, S].
  """
  n, s = turn_rewards_ns.shape
  mask = mask_ns.astype(bool)
  ids = (group_ids_n[:, None] * s + jnp.arange(s)[None, :]).reshape(-1)
  r = turn_rewards_ns.astype(jnp.float32).reshape(-1)
  count, mean, var, flat = _group_stats_sized(r, ids, mask.reshape(-1), n * s)
  centered = r - mean[ids]
  adv = centered / (jnp.sqrt(var[ids]) + eps) if scale_std else centered
  return jnp.where(mask.reshape(-1) & (count[ids] > 1) & ~flat[ids], adv, 0.0).reshape(n, s)


def _group_summary(returns_n, group_ids_n, valid_n):
  """(zero_variance_groups, groups, group_return_std) over the valid trajectories, from `_group_stats`."""
  count_g, _, var_g, flat_g = _group_stats(returns_n.astype(jnp.float32), group_ids_n, valid_n)
  present_g = count_g > 0
  groups = present_g.sum().astype(jnp.int32)
  std_g = jnp.where(present_g & ~flat_g, jnp.sqrt(var_g), 0.0)
  mean_std = jnp.sum(std_g) / jnp.maximum(groups, 1).astype(jnp.float32)
  return flat_g.sum().astype(jnp.int32), groups, mean_std


def _output(advantages_ns, returns_ns, trajectory_returns_n, group_ids_n, mask_ns) -> AdvantageOutput:
  """Group statistics over the trajectories the estimators use: those with a valid step."""
  valid_n = mask_ns.any(axis=1)
  zero, groups, std = _group_summary(trajectory_returns_n, group_ids_n, valid_n)
  return AdvantageOutput(advantages_ns, returns_ns, zero, groups, std)


# ----------------------------------------------------------------------------------------------
# Registered estimators (uniform signature).


@register_advantage("grpo")
@functools.partial(jax.jit, static_argnames=("config",))
def _grpo(x: AdvantageInputs, config: AdvantageConfig = AdvantageConfig()) -> AdvantageOutput:
  mask_ns = x.mask.astype(bool)
  g_ns = discounted_returns(x.rewards, mask_ns, x.bootstrap, gamma=config.gamma)
  adv_n, _ = grpo_scalar(g_ns[:, 0], x.group_ids, mask_ns.any(axis=1), eps=config.eps, scale_std=config.scale_std)
  return _output(_broadcast_steps(adv_n, mask_ns), g_ns, g_ns[:, 0], x.group_ids, mask_ns)


@register_advantage("rloo")
@functools.partial(jax.jit, static_argnames=("config",))
def _rloo(x: AdvantageInputs, config: AdvantageConfig = AdvantageConfig()) -> AdvantageOutput:
  mask_ns = x.mask.astype(bool)
  g_ns = discounted_returns(x.rewards, mask_ns, x.bootstrap, gamma=config.gamma)
  adv_n, _ = rloo_scalar(g_ns[:, 0], x.group_ids, mask_ns.any(axis=1))
  return _output(_broadcast_steps(adv_n, mask_ns), g_ns, g_ns[:, 0], x.group_ids, mask_ns)


@register_advantage("gae")
@functools.partial(jax.jit, static_argnames=("config",))
def _gae(x: AdvantageInputs, config: AdvantageConfig = AdvantageConfig()) -> AdvantageOutput:
  if x.values is None:
    raise ValueError("gae needs values (value estimates per step)")
  mask_ns = x.mask.astype(bool)
  adv_ns, ret_ns = gae(x.rewards, x.values, mask_ns, x.bootstrap, gamma=config.gamma, lam=config.lam)
  g_ns = discounted_returns(x.rewards, mask_ns, x.bootstrap, gamma=config.gamma)
  return _output(adv_ns, ret_ns, g_ns[:, 0], x.group_ids, mask_ns)


@register_advantage("returns")
@functools.partial(jax.jit, static_argnames=("config",))
def _returns(x: AdvantageInputs, config: AdvantageConfig = AdvantageConfig()) -> AdvantageOutput:
  """REINFORCE: the advantage is the discounted return-to-go itself (no baseline)."""
  mask_ns = x.mask.astype(bool)
  g_ns = discounted_returns(x.rewards, mask_ns, x.bootstrap, gamma=config.gamma)
  return _output(g_ns, g_ns, g_ns[:, 0], x.group_ids, mask_ns)


@register_advantage("gigpo")
@functools.partial(jax.jit, static_argnames=("config",))
def _gigpo(x: AdvantageInputs, config: AdvantageConfig = AdvantageConfig()) -> AdvantageOutput:
  """GiGPO (Feng et al. 2025, arXiv:2505.10978): `A = A_E(τ) + ω·A_S(s_t, a_t)`.

  A_E is GRPO's episode advantage (the return with `gamma` normalised over the task group); A_S normalises the
  `step_gamma`-discounted return-to-go R_t = Σ_k step_gamma^k r_{t+k} over the steps of the group taken in the
  same anchor state (`step_group_advantages`); ω = `step_weight`. Without anchor keys (`x.step_groups` None or
  all -1) it is GRPO exactly.
  """
  mask_ns = x.mask.astype(bool)
  g_ns = discounted_returns(x.rewards, mask_ns, x.bootstrap, gamma=config.gamma)
  adv_n, _ = grpo_scalar(g_ns[:, 0], x.group_ids, mask_ns.any(axis=1), eps=config.eps, scale_std=config.scale_std)
  step_groups_ns = jnp.full(mask_ns.shape, -1, jnp.int32) if x.step_groups is None else x.step_groups
  r_ns = discounted_returns(x.rewards, mask_ns, x.bootstrap, gamma=config.step_gamma)
  step_adv, stats = step_group_advantages(r_ns, step_groups_ns, mask_ns, eps=config.eps, scale_std=config.scale_std)
  out = _output(_broadcast_steps(adv_n, mask_ns) + config.step_weight * step_adv, g_ns, g_ns[:, 0], x.group_ids,
                mask_ns)
  return out.replace(step_stats=stats)
