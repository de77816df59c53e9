"""Pure, jittable RL algorithms on token-aligned arrays: logprobs, advantage estimators and losses, by name."""
from agentfly_jax.algorithms.advantages import (
    WHITEN_EPS,
    as_float_mask,
    compute_advantages,
    gae,
    grpo,
    last_action_token,
    masked_whiten,
    reinforce_pp,
    rloo,
    token_level_rewards,
)
from agentfly_jax.algorithms.logprobs import logprobs_from_logits, token_logprobs_and_entropy
from agentfly_jax.algorithms.losses import (
    AGGREGATION_MODES,
    aggregate_loss,
    entropy_bonus,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    loss_denominator,
    ppo_policy_loss,
    truncated_is_weights,
    value_loss,
)
from agentfly_jax.algorithms.registry import (
    advantage_estimator_names,
    get_advantage_estimator,
    get_policy_loss,
    policy_loss_names,
    register_advantage_estimator,
    register_policy_loss,
)

__all__ = [
    "WHITEN_EPS", "AGGREGATION_MODES", "as_float_mask", "compute_advantages", "gae", "grpo", "rloo",
    "reinforce_pp", "last_action_token", "masked_whiten", "token_level_rewards", "logprobs_from_logits",
    "token_logprobs_and_entropy", "aggregate_loss", "loss_denominator", "entropy_bonus", "kl_k1", "kl_k2", "kl_k3",
    "kl_penalty", "ppo_policy_loss", "truncated_is_weights", "value_loss", "advantage_estimator_names",
    "get_advantage_estimator", "get_policy_loss", "policy_loss_names", "register_advantage_estimator",
    "register_policy_loss",
]
