"""Algorithms: advantage estimators and masked policy / value losses, as pure jitted functions.

    out = algos.get_advantage("grpo")(rewards_ns, mask_ns, group_ids_n, gamma=1.0)
    normalizer = algos.loss_normalizer(batch.loss_mask, batch.segment_ids, aggregation="token-mean")
    logp_bt = algos.next_token_logprobs(model(batch.tokens), batch.tokens, batch.loss_mask)
    loss, metrics = algos.policy_loss(logp_bt, batch.behavior_logprobs, batch.advantages, batch.loss_mask,
                                      normalizer, **algos.policy_loss_kwargs(config.algo))
"""

from jaxagent.algos._advantages import (ADVANTAGES, AdvantageOutput, discounted_returns, gae, get_advantage,
                                        grpo_scalar, register_advantage, rloo_scalar, step_group_advantages,
                                        trajectory_returns, turn_advantages)
from jaxagent.algos._losses import (AGGREGATIONS, KL_ESTIMATORS, AllMaskedError, aggregate, entropy,
                                    importance_weighted_loss,
                                    loss_normalizer, next_token_entropy, next_token_logprobs, next_token_stats,
                                    policy_loss,
                                    token_logprobs, truncated_logits, value_loss)


def policy_loss_kwargs(algo) -> dict:
  """The static keyword arguments of `policy_loss` from an `AlgoConfig`."""
  return dict(aggregation=algo.aggregation, ratio_level=algo.ratio_level, eps_low=algo.eps_low,
              eps_high=algo.eps_high, dual_clip=algo.dual_clip, kl_estimator=algo.kl_estimator,
              kl_coef=algo.kl_coef, entropy_coef=algo.entropy_coef)


def advantage_kwargs(algo) -> dict:
  """The static keyword arguments of a registered advantage estimator from an `AlgoConfig`."""
  return dict(gamma=algo.gamma, lam=algo.gae_lambda, eps=algo.adv_eps, scale_std=algo.scale_std,
              step_weight=algo.step_weight, step_gamma=algo.step_gamma)


__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "AdvantageOutput", "AllMaskedError", "KL_ESTIMATORS", "advantage_kwargs", "next_token_stats", "truncated_logits",
    "aggregate", "discounted_returns", "entropy", "gae", "get_advantage", "grpo_scalar",
    "importance_weighted_loss", "loss_normalizer",
    "next_token_entropy", "next_token_logprobs", "policy_loss", "policy_loss_kwargs", "register_advantage",
    "rloo_scalar", "step_group_advantages", "token_logprobs", "trajectory_returns", "turn_advantages",
    "value_loss",
]
