"""Masked policy-gradient / PPO losses (docs/design.md §2.2), value loss, and token log-prob helpers.

Shape letters: B rows, T tokens, V vocab. Everything is aligned with the token stream: position `t` of
`logp_bt` is `log π(z_t | z_<t)` (use `next_token_logprobs` to get it from a model's logits).

Masking rule: every input is passed through `jnp.where(mask, x, safe)` before use, so values at masked
positions (garbage tokens, NaN or Inf log-probs/logits) change neither the loss nor any gradient, and the
gradient at masked positions is exactly zero. Multiplying by a 0 mask would not do: `0 * NaN = NaN`.

Aggregation and micro-batching: the loss is `Σ_j w_j ℓ_j / normalizer`, where the per-token weight `w_j` only
depends on the token's own sequence and `normalizer` is computed ONCE over the whole batch with
`loss_normalizer` and passed in. Hence the gradient of a batch equals the sum of its micro-batches' gradients
(sequences are never split across micro-batches). Modes (Yu et al. 2025 DAPO, arXiv:2503.14476; Liu et al.
2025 Dr. GRPO, arXiv:2503.20783):
  token-mean              w = m,        normalizer = Σ m                  (all loss tokens weigh the same)
  seq-mean-token-mean     w = m / |s|,  normalizer = #sequences with loss (each sequence weighs the same)
  seq-mean-token-sum-norm w = m,        normalizer = #sequences · L      (L: a constant, no length bias)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class AllMaskedError(ValueError):
  """The batch has no loss token; its loss is undefined (skip it explicitly)."""


# ----------------------------------------------------------------------------------------------
# KL estimators (Schulman 2020, "Approximating KL divergence"), of KL(π_θ || π_ref) from samples of π_θ.
# Argument: log_r = log π_ref(z) − log π_θ(z).

KL_ESTIMATORS = {
    "k1": lambda log_r: -log_r,
    "k2": lambda log_r: 0.5 * log_r * log_r,
    "k3": lambda log_r: jnp.expm1(log_r) - log_r,
}


# ----------------------------------------------------------------------------------------------
# Log-probs and entropy from logits.


def token_logprobs(logits_btv: jax.Array, tokens_bt: jax.Array, mask_bt: jax.Array | None = None
                   ) -> jax.Array:
  """`log_softmax(logits)[b, t, tokens[b, t]]` in float32 (no shift: `logits[:, t]` scores `tokens[:, t]`).

  With `mask_bt`, masked positions see logits 0 and token 0, so NaN/Inf logits or out-of-range tokens there
  give a finite 0-gradient result.
  """
  logits_btv = logits_btv.astype(jnp.float32)
  if mask_bt is not None:
    logits_btv = jnp.where(mask_bt[..., None], logits_btv, 0.0)
    tokens_bt = jnp.where(mask_bt, tokens_bt, 0)
  logp_btv = jax.nn.log_softmax(logits_btv, axis=-1)
  return jnp.take_along_axis(logp_btv, tokens_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]


def _shift(logits_btv, tokens_bt, mask_bt):
  # logits at t-1 predict token t; position 0 has no prediction (and is never a loss token).
  pad = jnp.zeros_like(logits_btv[:, :1])
  logits_btv = jnp.concatenate([pad, logits_btv[:, :-1]], axis=1)
  if mask_bt is not None:
    mask_bt = mask_bt.at[:, 0].set(False)
  return logits_btv, mask_bt


def next_token_logprobs(logits_btv: jax.Array, tokens_bt: jax.Array, mask_bt: jax.Array | None = None
                        ) -> jax.Array:
  """`log π(z_t | z_<t)` aligned with `tokens_bt`, from a causal model's `logits_btv = model(tokens_bt)`."""
  logits_btv, mask_bt = _shift(logits_btv, tokens_bt, mask_bt)
  return token_logprobs(logits_btv, tokens_bt, mask_bt)


def entropy(logits_btv: jax.Array, mask_bt: jax.Array | None = None) -> jax.Array:
  """Entropy of `softmax(logits)` per position, float32[B, T] (no shift); -inf logits are fine."""
  logits_btv = logits_btv.astype(jnp.float32)
  if mask_bt is not None:
    logits_btv = jnp.where(mask_bt[..., None], logits_btv, 0.0)
  logp_btv = jax.nn.log_softmax(logits_btv, axis=-1)
  p_btv = jnp.exp(logp_btv)
  # Where p == 0 use log p := 0 so that 0 · (−inf) never appears, in the value or in the gradient.
  return -jnp.sum(p_btv * jnp.where(p_btv > 0, logp_btv, 0.0), axis=-1)


def next_token_entropy(logits_btv: jax.Array, mask_bt: jax.Array | None = None) -> jax.Array:
  """Entropy of the distribution that sampled `z_t`, aligned with the tokens (see `next_token_logprobs`)."""
  logits_btv, mask_bt = _shift(logits_btv, None, mask_bt)
  return entropy(logits_btv, mask_bt)


def truncated_logits(logits_btv: jax.Array, tokens_bt: jax.Array, thresholds_bt: jax.Array) -> jax.Array:
  """`logits` cut where the sampler cut them: entries below the recorded threshold of their position become
  float32's lowest, except the recorded token itself (a token the behavior policy drew stays scoreable however
  the logits moved since). A NaN threshold cuts nothing. No shift: position t's logits, token and threshold.

  The kept set is a property of the recorded sample (`rollout.sampler.truncation_threshold`, midway between the
  lowest kept and the highest cut logit), and the policy scored is the renormalised softmax over it: at the
  behavior parameters it is the distribution the token was drawn from, so the on-policy ratio is 1.
  """
  keep_btv = (jnp.isnan(thresholds_bt)[..., None] | (logits_btv >= thresholds_bt[..., None])
              | (jnp.arange(logits_btv.shape[-1]) == tokens_bt[..., None]))
  return jnp.where(keep_btv, logits_btv, jnp.finfo(jnp.float32).min)


def next_token_stats(x_btd: jax.Array, unembed_dv: jax.Array, tokens_bt: jax.Array, mask_bt: jax.Array, *,
                     temperature: float = 1.0, chunk: int | None = None, with_entropy: bool = True,
                     thresholds_bt: jax.Array | None = None, targets_bt: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """`next_token_logprobs` and `next_token_entropy` of the logits `(x_btd @ unembed_dv) / temperature`.

  `targets_bt`: the token each position predicts, given explicitly: position t's hidden state scores
  `targets_bt[t]` (with `mask_bt[t]`, `thresholds_bt[t]`) and the results are aligned with the predicting
  position instead of the predicted token (a shared-prefix batch, where a position's successor is not the next
  slot: `jaxagent.shared_prefix`). `tokens_bt` is then unused.

  `chunk=None` builds the float32 logits [B, T, V] once. With `chunk`, each row's positions are taken `chunk`
  at a time (`lax.scan`, the body rematerialized in the backward pass): the largest array is [B, chunk, V], and
  the values and gradients are those of the direct path. Rows stay whole, so a batch sharded over rows needs no
  communication.

  `thresholds_bt` (aligned with the tokens, like the mask): score each token under the truncated distribution
  it was sampled from (`truncated_logits`); the entropy is that distribution's, and the third result is the
  log of the mass the truncation kept, `logsumexp(kept) - logsumexp(all)`, per position.

  Returns:
    (logp_bt, entropy_bt, log_kept_bt), float32[B, T] each; entropy None unless `with_entropy`, log_kept None
    without thresholds.
  """
  logits = lambda x: jnp.einsum("btd,dv->btv", x, unembed_dv, preferred_element_type=jnp.float32)
  scaled = (lambda x: logits(x) / temperature) if temperature != 1.0 else logits
  truncating = thresholds_bt is not None
  if chunk is None and not truncating and targets_bt is None:
    logits_btv = scaled(x_btd)
    return (next_token_logprobs(logits_btv, tokens_bt, mask_bt),
            next_token_entropy(logits_btv, mask_bt) if with_entropy else None, None)
  b, t, d = x_btd.shape
  if targets_bt is None:
    # The hidden state at t-1 predicts token t; position 0 predicts nothing (zeros, masked: as `_shift`).
    x_btd = jnp.concatenate([jnp.zeros_like(x_btd[:, :1]), x_btd[:, :-1]], axis=1)
    mask_bt = mask_bt.at[:, 0].set(False)
  else:
    tokens_bt = targets_bt
  if truncating:
    thresholds_bt = jnp.where(mask_bt, thresholds_bt, jnp.nan)

  def stats(x, tokens, mask, tau):
    logits_v = scaled(x)
    full = logits_v
    if truncating:
      logits_v = truncated_logits(jnp.where(mask[..., None], logits_v, 0.0), jnp.where(mask, tokens, 0), tau)
    ent = entropy(logits_v, mask) if with_entropy else jnp.zeros(mask.shape, jnp.float32)
    kept = jnp.zeros(mask.shape, jnp.float32)
    if truncating:
      safe = lambda z: jnp.where(mask[..., None], z, 0.0)
      kept = jnp.where(mask, jax.nn.logsumexp(safe(logits_v), axis=-1) - jax.nn.logsumexp(safe(full), axis=-1), 0.0)
    return token_logprobs(logits_v, tokens, mask), ent, kept

  if chunk is None:
    logp, ent, kept = stats(x_btd, tokens_bt, mask_bt, thresholds_bt)
    return logp, (ent if with_entropy else None), (kept if truncating else None)
  n = -(-t // chunk)
  pad = n * chunk - t
  tau_bt = thresholds_bt if truncating else jnp.zeros(mask_bt.shape, jnp.float32)
  if pad:
    x_btd = jnp.pad(x_btd, ((0, 0), (0, pad), (0, 0)))
    tokens_bt, mask_bt = jnp.pad(tokens_bt, ((0, 0), (0, pad))), jnp.pad(mask_bt, ((0, 0), (0, pad)))
    tau_bt = jnp.pad(tau_bt, ((0, 0), (0, pad)), constant_values=jnp.nan)
  to_chunks = lambda a: jnp.moveaxis(a.reshape((b, n, chunk) + a.shape[2:]), 1, 0)  # [n, B, chunk, ...]

  @jax.checkpoint
  def body(carry, xs):
    x_bcd, tokens_bc, mask_bc, tau_bc = xs
    return carry, stats(x_bcd, tokens_bc, mask_bc, tau_bc if truncating else None)

  _, (logp, ent, kept) = jax.lax.scan(body, None, tuple(map(to_chunks, (x_btd, tokens_bt, mask_bt, tau_bt))))
  from_chunks = lambda a: jnp.moveaxis(a, 0, 1).reshape(b, n * chunk)[:, :t]
  return (from_chunks(logp), (from_chunks(ent) if with_entropy else None),
          (from_chunks(kept) if truncating else None))


# ----------------------------------------------------------------------------------------------
# Sequences and aggregation.


def _sequence_ids(mask_bt, segment_ids_bt):
  """Flat sequence index per token: row-major (row, segment); segment_ids None means one sequence per row."""
  b, t = mask_bt.shape
  seg_bt = jnp.ones((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)
  seg_bt = jnp.clip(seg_bt, 0, t)
  return jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1) + seg_bt, b * (t + 1)


def _segment_sum_per_token(x_bt, ids_bt, num):
  total = jax.ops.segment_sum(x_bt.reshape(-1), ids_bt.reshape(-1), num_segments=num)
  return total[ids_bt]


def loss_normalizer(loss_mask_bt, segment_ids_bt=None, *, aggregation: Aggregation = "token-mean",
                    norm_length: int | None = None, allow_empty: bool = False) -> np.float32:
  """The loss denominator for the WHOLE batch (host side, numpy); pass it to every micro-batch's loss.

  Args:
    loss_mask_bt: bool[B, T] of the whole batch.
    segment_ids_bt: int[B, T] packed sequence ids (0 = padding); None: one sequence per row.
    aggregation: one of `AGGREGATIONS`.
    norm_length: L for `seq-mean-token-sum-norm` (a constant, e.g. the max response length); default T.
    allow_empty: return 0 (the loss then reports `skipped=1` and has zero gradient) instead of raising.
  Raises:
    AllMaskedError: no token has loss_mask = 1 (and allow_empty is False).
  """
  mask = np.asarray(loss_mask_bt).astype(bool)
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"aggregation={aggregation!r}: not one of {list(AGGREGATIONS)}")
  n_tokens = int(mask.sum())
  if n_tokens == 0:
    if allow_empty:
      return np.float32(0.0)
    raise AllMaskedError(f"all {mask.size} positions have loss_mask=0: the loss is undefined; skip this batch")
  if aggregation == "token-mean":
    return np.float32(n_tokens)
  b, t = mask.shape
  seg = np.ones((b, t), np.int64) if segment_ids_bt is None else np.asarray(segment_ids_bt).astype(np.int64)
  flat = (np.arange(b)[:, None] * (t + 1) + seg)[mask]
  n_seq = len(np.unique(flat))
  if aggregation == "seq-mean-token-mean":
    return np.float32(n_seq)
  length = t if norm_length is None else norm_length
  if length < 1:
    raise ValueError(f"norm_length={norm_length}: must be >= 1")
  return np.float32(n_seq * length)


def _token_weights(mask_bt, segment_ids_bt, aggregation):
  m_bt = mask_bt.astype(jnp.float32)
  if aggregation in ("token-mean", "seq-mean-token-sum-norm"):
    return m_bt
  if aggregation == "seq-mean-token-mean":
    ids_bt, num = _sequence_ids(mask_bt, segment_ids_bt)
    n_bt = _segment_sum_per_token(m_bt, ids_bt, num)
    return jnp.where(mask_bt, 1.0 / jnp.maximum(n_bt, 1.0), 0.0)
  raise ValueError(f"aggregation={aggregation!r}: not one of {list(AGGREGATIONS)}")


def aggregate(loss_bt: jax.Array, loss_mask_bt: jax.Array, normalizer: jax.Array, *,
              segment_ids_bt: jax.Array | None = None, aggregation: Aggregation = "token-mean") -> jax.Array:
  """`Σ w ℓ / normalizer`; 0 (with zero gradient) when normalizer == 0. Masked ℓ may be NaN/Inf."""
  mask_bt = loss_mask_bt.astype(bool)
  w_bt = _token_weights(mask_bt, segment_ids_bt, aggregation)
  total = jnp.sum(jnp.where(mask_bt, w_bt * jnp.where(mask_bt, loss_bt, 0.0), 0.0))
  normalizer = jnp.asarray(normalizer, jnp.float32)
  return jnp.where(normalizer > 0, total / jnp.where(normalizer > 0, normalizer, 1.0), 0.0)


def _masked_mean(x_bt, mask_bt, count):
  return jnp.sum(jnp.where(mask_bt, x_bt, 0.0)) / jnp.maximum(count, 1.0)


def _entropy_bonus(loss_bt, entropy_bt, mask_bt, entropy_coef):
  """`loss_bt − entropy_coef · H` (when a coefficient is set) and the masked entropy (None without one)."""
  if entropy_bt is None:
    return loss_bt, None
  ent_bt = jnp.where(mask_bt, entropy_bt, 0.0).astype(jnp.float32)
  return (loss_bt - entropy_coef * ent_bt if entropy_coef > 0 else loss_bt), ent_bt


def _ratio_stats(ratio_bt, mask_bt, count) -> dict[str, jax.Array]:
  """ratio_mean / min / max over the loss tokens (0 when there are none)."""
  any_tokens = count > 0
  return dict(ratio_mean=_masked_mean(ratio_bt, mask_bt, count),
              ratio_min=jnp.where(any_tokens, jnp.min(jnp.where(mask_bt, ratio_bt, jnp.inf)), 0.0),
              ratio_max=jnp.where(any_tokens, jnp.max(jnp.where(mask_bt, ratio_bt, -jnp.inf)), 0.0))


# ----------------------------------------------------------------------------------------------
# Losses.


@flax.struct.dataclass
class TokenLossInputs:
  """The per-token inputs of a policy-gradient loss: float/bool [B, T] each, None where a loss does not use it.

  Attributes:
    logp: log π_θ of the taken tokens (differentiated).
    old_logp: the log-probs the ratio is taken against: the policy that sampled the tokens (behavior μ), or the
      proximal policy π_prox when `behavior_logp` is given (decoupled PPO).
    advantages: per-token advantages.
    loss_mask: only these positions count; anything may sit elsewhere (NaN, Inf).
    normalizer: scalar from `loss_normalizer` over the whole batch; 0 means skip (loss 0, zero gradient).
    segment_ids: int packed sequence ids (0 = pad); None: one sequence per row.
    ref_logp: reference log-probs (the KL term).
    entropy: the policy's entropy per position (e.g. `next_token_entropy`); reported when given.
    behavior_logp: the recorded behavior log-probs μ under decoupled PPO; None: `old_logp` is μ.
  """
  logp: jax.Array
  old_logp: jax.Array
  advantages: jax.Array
  loss_mask: jax.Array
  normalizer: jax.Array
  segment_ids: jax.Array | None = None
  ref_logp: jax.Array | None = None
  entropy: jax.Array | None = None
  behavior_logp: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
  """`policy_loss`'s settings (static: a change compiles a new program); `from_algo` reads an `AlgoConfig`.

  Attributes:
    aggregation: how token losses are summed (module docstring).
    ratio_level: "token" (PPO) or "sequence" (GSPO).
    eps_low, eps_high: the clip range 1 − ε_low … 1 + ε_high.
    dual_clip: c > 1 bounds the loss of a negative-advantage token at −c Â; None: off.
    kl_estimator, kl_coef: the reference-KL term (`KL_ESTIMATORS`; 0: off).
    entropy_coef: the entropy bonus (0: off).
    behavior_weight_cap: the truncation of π_prox/μ (decoupled PPO).
  """
  aggregation: Aggregation = "token-mean"
  ratio_level: Literal["token", "sequence"] = "token"
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: float | None = None
  kl_estimator: str = "k3"
  kl_coef: float = 0.0
  entropy_coef: float = 0.0
  behavior_weight_cap: float = 2.0

  @classmethod
  def from_algo(cls, algo) -> "PolicyLossConfig":
    """The settings of a `jaxagent.config.AlgoConfig`."""
    return cls(aggregation=algo.aggregation, ratio_level=algo.ratio_level, eps_low=algo.eps_low,
               eps_high=algo.eps_high, dual_clip=algo.dual_clip, kl_estimator=algo.kl_estimator,
               kl_coef=algo.kl_coef, entropy_coef=algo.entropy_coef, behavior_weight_cap=algo.behavior_weight_cap)

  def check(self, x: TokenLossInputs) -> None:
    if self.kl_coef > 0 and x.ref_logp is None:
      raise ValueError("kl_coef > 0 needs ref_logp")
    if self.entropy_coef > 0 and x.entropy is None:
      raise ValueError("entropy_coef > 0 needs entropy")
    if self.dual_clip is not None and self.dual_clip <= 1.0:
      raise ValueError(f"dual_clip={self.dual_clip}: must be > 1")
    if self.kl_estimator not in KL_ESTIMATORS:
      raise ValueError(f"kl_estimator={self.kl_estimator!r}: not one of {sorted(KL_ESTIMATORS)}")
    if x.behavior_logp is not None and self.behavior_weight_cap <= 0:
      raise ValueError(f"behavior_weight_cap={self.behavior_weight_cap}: must be > 0")


def _log_ratio(x: TokenLossInputs, mask_bt, logp_bt, token_log_ratio_bt, ratio_level: str) -> jax.Array:
  """log ρ per token: the token's own (PPO) or its sequence's geometric mean (GSPO-token form: value `s_i`,
  gradient `s_i ∇log π(z_t)`)."""
  if ratio_level == "token":
    log_ratio_bt = token_log_ratio_bt
  elif ratio_level == "sequence":
    ids_bt, num = _sequence_ids(mask_bt, x.segment_ids)
    n_bt = _segment_sum_per_token(mask_bt.astype(jnp.float32), ids_bt, num)
    seq_log_ratio_bt = _segment_sum_per_token(token_log_ratio_bt, ids_bt, num) / jnp.maximum(n_bt, 1.0)
    log_ratio_bt = jax.lax.stop_gradient(seq_log_ratio_bt) + logp_bt - jax.lax.stop_gradient(logp_bt)
  else:
    raise ValueError(f"ratio_level={ratio_level!r}: not 'token' or 'sequence'")
  return jnp.where(mask_bt, log_ratio_bt, 0.0)


def _clipped(adv_bt, ratio_bt, config: PolicyLossConfig) -> tuple[jax.Array, jax.Array]:
  """PPO's clipped term per token (with the dual clip when set), and where it clipped."""
  unclipped_bt = -adv_bt * ratio_bt
  clipped_bt = -adv_bt * jnp.clip(ratio_bt, 1.0 - config.eps_low, 1.0 + config.eps_high)
  pg_bt = jnp.maximum(unclipped_bt, clipped_bt)
  is_clipped_bt = clipped_bt > unclipped_bt
  if config.dual_clip is not None:
    dual_bt = -adv_bt * config.dual_clip
    is_clipped_bt = is_clipped_bt | ((adv_bt < 0) & (pg_bt > dual_bt))
    pg_bt = jnp.where(adv_bt < 0, jnp.minimum(pg_bt, dual_bt), pg_bt)
  return pg_bt, is_clipped_bt


def _behavior_weight(x: TokenLossInputs, mask_bt, old_bt, count, cap: float) -> tuple[jax.Array, dict]:
  """Decoupled PPO's truncated behavior weight min(π_prox/μ, cap) per token (no gradient), and its metrics."""
  mu_bt = jnp.where(mask_bt, x.behavior_logp, 0.0).astype(jnp.float32)
  raw_w_bt = jnp.exp(jnp.minimum(jnp.where(mask_bt, old_bt - mu_bt, 0.0), 80.0))
  return jnp.minimum(raw_w_bt, cap), dict(
      behavior_weight_mean=_masked_mean(raw_w_bt, mask_bt, count),
      behavior_weight_max=jnp.where(count > 0, jnp.max(jnp.where(mask_bt, raw_w_bt, -jnp.inf)), 0.0),
      truncated_fraction=_masked_mean((raw_w_bt > cap).astype(jnp.float32), mask_bt, count))


@functools.partial(jax.jit, static_argnames=("config",))
def policy_loss(x: TokenLossInputs, config: PolicyLossConfig = PolicyLossConfig()
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped policy-gradient loss (PPO, Schulman et al. 2017) with reference-KL and entropy terms.

  Per loss token: `ρ = π_θ/π_old`, `ℓ = max(−Â ρ, −Â clip(ρ, 1−ε_low, 1+ε_high))`; with `dual_clip = c > 1`
  (Ye et al. 2020, arXiv:1912.09729) `ℓ = min(ℓ, −c Â)` where `Â < 0`. `ratio_level="sequence"` uses the
  GSPO ratio (Zheng et al. 2025, arXiv:2507.18071): the geometric mean of token ratios over the sequence,
  applied to every token of it. Then `ℓ += kl_coef · KL_est(π_θ‖π_ref) − entropy_coef · H`, aggregated by
  `aggregate`.

  Decoupled PPO (Hilton et al. 2021, arXiv:2110.00641; AReaL, arXiv:2505.24298): with `x.behavior_logp` = μ
  given, `x.old_logp` is the proximal policy π_prox (the parameters at the start of the update) and the clipped
  term is weighted by the behavior weight `w = min(π_prox/μ, behavior_weight_cap)` (no gradient): the clip keeps
  the update near π_prox, the weight corrects for data μ sampled (an older policy, in flight or queued).

  Returns:
    (loss scalar, metrics): loss_tokens, skipped, clip_fraction, ratio_mean/min/max, approx_kl (k3 between
    old and current policy), entropy, kl (when a reference is given), pg_loss, and with `x.behavior_logp`
    behavior_weight_mean / behavior_weight_max (before truncation) and truncated_fraction; means over this
    call's loss tokens.
  """
  config.check(x)
  mask_bt = x.loss_mask.astype(bool)
  logp_bt = jnp.where(mask_bt, x.logp, 0.0).astype(jnp.float32)
  old_bt = jnp.where(mask_bt, x.old_logp, 0.0).astype(jnp.float32)
  adv_bt = jnp.where(mask_bt, x.advantages, 0.0).astype(jnp.float32)
  token_log_ratio_bt = logp_bt - old_bt
  ratio_bt = jnp.exp(_log_ratio(x, mask_bt, logp_bt, token_log_ratio_bt, config.ratio_level))
  pg_bt, is_clipped_bt = _clipped(adv_bt, ratio_bt, config)

  metrics = {}
  sg = jax.lax.stop_gradient
  count = jnp.sum(mask_bt.astype(jnp.float32))
  if x.behavior_logp is not None:
    weight_bt, weight_metrics = _behavior_weight(x, mask_bt, old_bt, count, config.behavior_weight_cap)
    pg_bt = weight_bt * pg_bt
    metrics.update(weight_metrics)

  loss_bt = pg_bt
  if x.ref_logp is not None:
    ref_bt = jnp.where(mask_bt, x.ref_logp, 0.0).astype(jnp.float32)
    kl_bt = KL_ESTIMATORS[config.kl_estimator](ref_bt - logp_bt)
    if config.kl_coef > 0:
      loss_bt = loss_bt + config.kl_coef * kl_bt
  loss_bt, ent_bt = _entropy_bonus(loss_bt, x.entropy, mask_bt, config.entropy_coef)

  agg = functools.partial(aggregate, segment_ids_bt=x.segment_ids, aggregation=config.aggregation)
  loss = agg(loss_bt, mask_bt, x.normalizer)
  metrics.update(
      loss_tokens=count,
      skipped=(jnp.asarray(x.normalizer) <= 0).astype(jnp.float32),
      pg_loss=sg(agg(pg_bt, mask_bt, x.normalizer)),
      clip_fraction=_masked_mean(is_clipped_bt.astype(jnp.float32), mask_bt, count),
      **_ratio_stats(sg(ratio_bt), mask_bt, count),
      approx_kl=_masked_mean(KL_ESTIMATORS["k3"](sg(token_log_ratio_bt)), mask_bt, count),
  )
  if x.ref_logp is not None:
    metrics["kl"] = _masked_mean(sg(kl_bt), mask_bt, count)
  if x.entropy is not None:
    metrics["entropy"] = _masked_mean(sg(ent_bt), mask_bt, count)
  return loss, metrics


@dataclasses.dataclass(frozen=True)
class ImportanceWeightConfig:
  """`importance_weighted_loss`'s settings (static).

  Attributes:
    aggregation: how token losses are summed.
    max_ratio: c > 0, the truncation of the importance weight.
    min_negative_ratio: m in [0, 1): a negative-advantage token whose ratio fell below it gets no gradient (0: off).
    entropy_coef: the entropy bonus (0: off).
  """
  aggregation: Aggregation = "token-mean"
  max_ratio: float = 1.0
  min_negative_ratio: float = 0.0
  entropy_coef: float = 0.0


@functools.partial(jax.jit, static_argnames=("config",))
def importance_weighted_loss(x: TokenLossInputs, config: ImportanceWeightConfig = ImportanceWeightConfig()
                             ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Off-policy policy gradient with truncated importance weights, for data of another policy μ (`x.old_logp`:
  the recorded behavior log-probs).

  Per loss token: `ρ = π_θ/μ` against the recorded behavior log-prob, `ℓ = −sg(w) Â log π_θ` with
  `w = min(ρ, c)`. Its gradient `w Â ∇log π_θ` is the importance-sampled on-policy gradient with the weight
  truncated at `c = max_ratio` (Espeholt et al. 2018, arXiv:1802.01561, ρ̄): bias for bounded variance. Unlike
  PPO's clip, a token the learner finds unlikely under its own policy still gets a (down-weighted) push up when
  its advantage is positive, which learning from a different policy's data needs.

  `min_negative_ratio = m`: a token with `Â < 0` whose ratio has already fallen below `m` gets no gradient (the
  lower half of PPO's clip, on negative advantages only). Without it the learner keeps pushing down the
  behavior policy's failed actions wherever it still assigns them mass, which measured on the default env
  (a weak policy learning from a stronger one's store) drove held-out success from 2 % to 0 % within 100 steps:
  the mass went to garbage, not to the successful actions, whose small ratios give them small weights.

  Returns:
    (loss, metrics): loss_tokens, skipped, pg_loss, ratio_mean/min/max (untruncated ρ), clip_fraction (share of
    tokens whose weight was truncated or cut), approx_kl (k3 between μ and π_θ), entropy when given.
  """
  if config.max_ratio <= 0:
    raise ValueError(f"max_ratio={config.max_ratio}: must be > 0")
  if not 0.0 <= config.min_negative_ratio < 1.0:
    raise ValueError(f"min_negative_ratio={config.min_negative_ratio}: must be in [0, 1)")
  mask_bt = x.loss_mask.astype(bool)
  logp_bt = jnp.where(mask_bt, x.logp, 0.0).astype(jnp.float32)
  mu_bt = jnp.where(mask_bt, x.old_logp, 0.0).astype(jnp.float32)
  adv_bt = jnp.where(mask_bt, x.advantages, 0.0).astype(jnp.float32)
  sg = jax.lax.stop_gradient
  log_ratio_bt = jnp.where(mask_bt, sg(logp_bt) - mu_bt, 0.0)
  ratio_bt = jnp.exp(jnp.minimum(log_ratio_bt, 80.0))
  cut_bt = (adv_bt < 0) & (ratio_bt < config.min_negative_ratio)
  weight_bt = jnp.where(cut_bt, 0.0, jnp.minimum(ratio_bt, config.max_ratio))
  loss_bt, ent_bt = _entropy_bonus(-weight_bt * adv_bt * logp_bt, x.entropy, mask_bt, config.entropy_coef)
  agg = functools.partial(aggregate, segment_ids_bt=x.segment_ids, aggregation=config.aggregation)
  loss = agg(loss_bt, mask_bt, x.normalizer)
  count = jnp.sum(mask_bt.astype(jnp.float32))
  metrics = dict(
      loss_tokens=count,
      skipped=(jnp.asarray(x.normalizer) <= 0).astype(jnp.float32),
      pg_loss=sg(agg(-weight_bt * adv_bt, mask_bt, x.normalizer)),
      clip_fraction=_masked_mean(((ratio_bt > config.max_ratio) | cut_bt).astype(jnp.float32), mask_bt, count),
      **_ratio_stats(ratio_bt, mask_bt, count),
      approx_kl=_masked_mean(KL_ESTIMATORS["k3"](log_ratio_bt), mask_bt, count),
  )
  if ent_bt is not None:
    metrics["entropy"] = _masked_mean(sg(ent_bt), mask_bt, count)
  return loss, metrics


@functools.partial(jax.jit, static_argnames=("aggregation", "clip_eps"))
def value_loss(values_bt: jax.Array, old_values_bt: jax.Array, returns_bt: jax.Array, loss_mask_bt: jax.Array,
               normalizer: jax.Array, *, segment_ids_bt: jax.Array | None = None,
               aggregation: Aggregation = "token-mean", clip_eps: float | None = 0.2
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped value loss `½ max((V − R)², (V_old + clip(V − V_old, ±ε) − R)²)` (PPO); no clip if ε is None.

  Returns:
    (loss scalar, metrics: value_positions (count of mask positions), value_clip_fraction, value_error
    (mean |V − R|); the last two are means over this call's value positions).
  """
  mask_bt = loss_mask_bt.astype(bool)
  v_bt = jnp.where(mask_bt, values_bt, 0.0).astype(jnp.float32)
  old_bt = jnp.where(mask_bt, old_values_bt, 0.0).astype(jnp.float32)
  ret_bt = jnp.where(mask_bt, returns_bt, 0.0).astype(jnp.float32)
  err_bt = jnp.square(v_bt - ret_bt)
  if clip_eps is None:
    loss_bt, clipped_bt = 0.5 * err_bt, jnp.zeros_like(mask_bt)
  else:
    v_clip_bt = old_bt + jnp.clip(v_bt - old_bt, -clip_eps, clip_eps)
    err_clip_bt = jnp.square(v_clip_bt - ret_bt)
    loss_bt, clipped_bt = 0.5 * jnp.maximum(err_bt, err_clip_bt), err_clip_bt > err_bt
  loss = aggregate(loss_bt, mask_bt, normalizer, segment_ids_bt=segment_ids_bt, aggregation=aggregation)
  count = jnp.sum(mask_bt.astype(jnp.float32))
  return loss, {"value_positions": count,
                "value_clip_fraction": _masked_mean(clipped_bt.astype(jnp.float32), mask_bt, count),
                "value_error": _masked_mean(jax.lax.stop_gradient(jnp.abs(v_bt - ret_bt)), mask_bt, count)}
