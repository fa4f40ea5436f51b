"""Algorithms: advantage estimators and masked policy / value losses, as pure jitted functions.

    out = algos.get_advantage("grpo")(algos.AdvantageInputs(rewards_ns, mask_ns, group_ids_n),
                                      algos.AdvantageConfig(gamma=1.0))
    normalizer = algos.loss_normalizer(batch.loss_mask, batch.segment_ids, aggregation="token-mean")
    logp_bt = algos.next_token_logprobs(model(batch.tokens), batch.tokens, batch.loss_mask)
    tokens = algos.TokenLossInputs(logp_bt, batch.behavior_logprobs, batch.advantages, batch.loss_mask, normalizer)
    loss, metrics = algos.policy_loss(tokens, algos.PolicyLossConfig.from_algo(config.algo))
"""

from jaxagent.algos._advantages import (ADVANTAGES, AdvantageConfig, AdvantageInputs, AdvantageOutput,
                                        discounted_returns, gae, get_advantage,
                                        grpo_scalar, register_advantage, rloo_scalar, step_group_advantages,
                                        trajectory_returns, turn_advantages)
from jaxagent.algos._losses import (AGGREGATIONS, KL_ESTIMATORS, AllMaskedError, ImportanceWeightConfig,
                                    PolicyLossConfig, TokenLossInputs, aggregate, entropy, importance_weighted_loss,
                                    loss_normalizer, next_token_entropy, next_token_logprobs, next_token_stats,
                                    policy_loss, token_logprobs, truncated_logits, value_loss)


__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "AdvantageConfig", "AdvantageInputs", "AdvantageOutput", "AllMaskedError",
    "KL_ESTIMATORS", "next_token_stats", "truncated_logits",
    "aggregate", "discounted_returns", "entropy", "gae", "get_advantage", "grpo_scalar",
    "ImportanceWeightConfig", "PolicyLossConfig", "TokenLossInputs", "importance_weighted_loss", "loss_normalizer",
    "next_token_entropy", "next_token_logprobs", "policy_loss", "register_advantage",
    "rloo_scalar", "step_group_advantages", "token_logprobs", "trajectory_returns", "turn_advantages",
    "value_loss",
]
