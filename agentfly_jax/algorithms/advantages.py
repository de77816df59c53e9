"""Advantage estimators on token-aligned, multi-turn batches: GRPO, Dr.GRPO, RLOO, REINFORCE++,
REINFORCE++-baseline and GAE.

Conventions shared by every estimator:
- `action_mask[b, t]` (bool or 0/1 float) is 1 where the policy sampled token t; prompt, tool-output and
  template tokens are 0. A multi-turn chain is several action spans separated by observation spans.
- Outputs are fp32 [B, T] and exactly 0 on non-action tokens; inputs at non-action positions are never read.
- `group_ids[b]` are arbitrary ints (same task => same id), not necessarily 0..G-1 or contiguous. A padding
  row that should not join any group's statistics needs an id of its own.
- A group of one has no baseline: the group estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline) give its
  member advantage 0 (verl instead gives GRPO's lone member its raw reward). The trainer refuses these
  algorithms with `rl.chains_per_task=1`, so a run cannot silently learn nothing.
- Multi-turn returns: REINFORCE++'s return-to-go runs over the action tokens of ALL turns, skipping the
  observation spans between them, so the outcome reward reaches every turn. (verl resets its running return
  at every masked token, so only the last turn of a multi-turn response would see the reward.)
Shapes: B batch (trajectories), T sequence.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from agentfly_jax.algorithms.registry import get_advantage_estimator, register_advantage_estimator

# Whitening divides by (std + this); small enough not to bias O(1) returns.
WHITEN_EPS = 1e-8


def as_float_mask(action_mask):
    """Any mask (bool, int or float) as fp32 0/1, nonzero meaning 1."""
    return (jnp.asarray(action_mask) != 0).astype(jnp.float32)


def _broadcast_to_actions(per_sequence, action_mask):
    """Scalar per sequence [B] -> the same value on each action token [B, T], 0 elsewhere."""
    return jnp.where(as_float_mask(action_mask) > 0, per_sequence[:, None], 0.0)


def _group_index(group_ids):
    """Dense segment index [B] in [0, B) for arbitrary int group ids [B] (jittable: at most B groups)."""
    _, index = jnp.unique(group_ids, size=group_ids.shape[0], return_inverse=True)
    return index.reshape(-1)


def _group_total(values, index):
    """For each member [B], the sum of `values` [B] over its group."""
    return jax.ops.segment_sum(values, index, num_segments=values.shape[0])[index]


def _group_centered(rewards, index, count):
    """r - group mean [B], computed relative to the group minimum so that a group of equal rewards centres to
    exactly 0 (a plain fp32 mean of, e.g., three 0.3s is not exactly 0.3, and GRPO would then amplify the
    rounding error by 1 / eps)."""
    shift = jax.ops.segment_min(rewards, index, num_segments=rewards.shape[0])[index]
    offset = rewards - shift
    return offset - _group_total(offset, index) / count


@register_advantage_estimator("grpo")
def grpo(rewards, group_ids, action_mask, *, normalize_std=True, eps=1e-6):
    """GRPO: (r - group mean) / (group sample std (ddof=1) + eps) on action tokens [B, T]; a group of one
    gets 0. `normalize_std=False` is Dr.GRPO: r - group mean, no division."""
    rewards = jnp.asarray(rewards, jnp.float32)  # [B]
    index = _group_index(group_ids)
    count = _group_total(jnp.ones_like(rewards), index)  # [B] size of each member's group
    advantages = _group_centered(rewards, index, count)  # [B]
    if normalize_std:
        sample_var = _group_total(advantages**2, index) / jnp.maximum(count - 1.0, 1.0)
        advantages = advantages / (jnp.sqrt(sample_var) + eps)
    advantages = jnp.where(count > 1, advantages, 0.0)  # _group_centered already gives a lone member 0
    return _broadcast_to_actions(advantages, action_mask)


register_advantage_estimator("drgrpo")(functools.partial(grpo, normalize_std=False))


@register_advantage_estimator("rloo")
def rloo(rewards, group_ids, action_mask):
    """RLOO: r_i minus the mean reward of the other members of its group, on action tokens [B, T]; a group
    of one gets 0."""
    rewards = jnp.asarray(rewards, jnp.float32)  # [B]
    index = _group_index(group_ids)
    count = _group_total(jnp.ones_like(rewards), index)  # [B]
    # r_i - (S - r_i)/(n-1) = n/(n-1) * (r_i - mean): the centred form keeps equal rewards at exactly 0.
    centered = _group_centered(rewards, index, count)
    advantages = jnp.where(count > 1, centered * count / jnp.maximum(count - 1.0, 1.0), 0.0)
    return _broadcast_to_actions(advantages, action_mask)


def last_action_token(action_mask):
    """One-hot [B, T] (fp32) of each sequence's last action token; an all-zero row where there is none."""
    mask = as_float_mask(action_mask)  # [B, T]
    seq_len = mask.shape[1]
    last = seq_len - 1 - jnp.argmax(mask[:, ::-1], axis=1)  # [B]; argmax finds the first 1 from the right
    one_hot = (jnp.arange(seq_len)[None, :] == last[:, None]).astype(jnp.float32)
    return one_hot * jnp.max(mask, axis=1, keepdims=True)


def token_level_rewards(rewards, action_mask, *, token_kl=None, kl_coef=0.0):
    """Per-token rewards [B, T]: -kl_coef * token_kl on action tokens, plus the scalar reward [B] on the
    last action token."""
    mask = as_float_mask(action_mask)
    token_rewards = jnp.asarray(rewards, jnp.float32)[:, None] * last_action_token(mask)
    if token_kl is not None:
        # where, not multiply: a non-action KL may be garbage (inf), and inf * 0 would be nan.
        token_rewards = token_rewards - kl_coef * jnp.where(mask > 0, token_kl, 0.0).astype(jnp.float32)
    return token_rewards


def masked_whiten(values, action_mask, *, eps=WHITEN_EPS):
    """(x - mean) / (sample std (ddof=1) + eps), mean and std over all action tokens of the batch; 0
    elsewhere."""
    mask = as_float_mask(action_mask)  # [B, T]
    values = jnp.where(mask > 0, values, 0.0).astype(jnp.float32)
    count = jnp.sum(mask)
    # Centre relative to the smallest action value, so equal values whiten to exactly 0 (see _group_centered).
    shift = jnp.min(jnp.where(mask > 0, values, jnp.inf))
    centered = (values - jnp.where(count > 0, shift, 0.0)) * mask
    # A fp32 sum over every action token of the batch is off by many ulps; a second pass removes that error.
    for _ in range(2):
        centered = (centered - jnp.sum(centered) / jnp.maximum(count, 1.0)) * mask
    sample_std = jnp.sqrt(jnp.sum(centered**2) / jnp.maximum(count - 1.0, 1.0))
    return centered / (sample_std + eps)


@register_advantage_estimator("reinforce_pp")
def reinforce_pp(rewards, action_mask, *, token_kl=None, kl_coef=0.0):
    """REINFORCE++ [B, T]: undiscounted return-to-go over action tokens of the per-token rewards
    (-kl_coef * token_kl, plus the scalar reward on the last action token), whitened over all action tokens
    of the batch with the SAMPLE std (ddof=1); see `masked_whiten`."""
    mask = as_float_mask(action_mask)  # [B, T]
    token_rewards = token_level_rewards(rewards, mask, token_kl=token_kl, kl_coef=kl_coef)  # [B, T]
    returns = jnp.flip(jnp.cumsum(jnp.flip(token_rewards, axis=1), axis=1), axis=1) * mask  # reverse cumsum
    return masked_whiten(returns, mask)


@register_advantage_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards, group_ids, action_mask, *, token_kl=None, kl_coef=0.0):
    """REINFORCE++-baseline [B, T]: each chain's score (its reward minus kl_coef * the sum of its action tokens'
    KL) minus the mean score of its group, on every action token, then whitened over all action tokens of the
    batch (`masked_whiten`). A group of one gets 0 before whitening."""
    mask = as_float_mask(action_mask)  # [B, T]
    scores = jnp.asarray(rewards, jnp.float32)  # [B]
    if token_kl is not None:
        scores = scores - kl_coef * jnp.sum(jnp.where(mask > 0, token_kl, 0.0).astype(jnp.float32), axis=1)
    index = _group_index(group_ids)
    count = _group_total(jnp.ones_like(scores), index)
    centered = jnp.where(count > 1, _group_centered(scores, index, count), 0.0)
    return masked_whiten(_broadcast_to_actions(centered, mask), mask)


@register_advantage_estimator("gae")
def gae(token_rewards, values, action_mask, *, gamma, lam, whiten=False):
    """GAE over action tokens only -> (advantages [B, T], returns = advantages + values [B, T]), 0 off-action.

    Non-action tokens are not steps: an action token's TD target uses the value of the next ACTION token, even
    across a tool output between turns; after the last action token the next value is 0.
    `whiten=True` whitens the advantages over all action tokens of the batch (`masked_whiten`, as verl always
    does); the returns the critic learns are computed before whitening.
    """
    mask = as_float_mask(action_mask) > 0  # [B, T]
    token_rewards = jnp.where(mask, token_rewards, 0.0).astype(jnp.float32)
    values = jnp.where(mask, values, 0.0).astype(jnp.float32)

    def step(carry, inputs):
        next_value, next_advantage = carry  # [B] each: from the nearest action token to the right
        reward, value, is_action = inputs  # [B] each
        delta = reward + gamma * next_value - value
        advantage = delta + gamma * lam * next_advantage
        # A non-action position passes the carry through untouched, so it is skipped rather than a step.
        carry = (jnp.where(is_action, value, next_value), jnp.where(is_action, advantage, next_advantage))
        return carry, jnp.where(is_action, advantage, 0.0)

    batch = mask.shape[0]
    init = (jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.float32))
    _, advantages = jax.lax.scan(step, init, (token_rewards.T, values.T, mask.T), reverse=True)  # [T, B]
    advantages = advantages.T  # [B, T]
    returns = jnp.where(mask, advantages + values, 0.0)
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _call_with_inputs(name, estimator, inputs, cfg):
    """Calls `estimator` with the batch inputs its signature names plus `cfg`; clear errors on gaps/typos."""
    params = inspect.signature(estimator).parameters
    unknown = sorted(set(cfg) - set(params))
    if unknown:
        accepted = sorted(p for p in params if p not in inputs)
        raise TypeError(f"advantage estimator '{name}' got unknown config {unknown}; it accepts: {accepted}")
    args = {}
    for param in params.values():
        if param.name not in inputs:
            continue
        if inputs[param.name] is not None:
            args[param.name] = inputs[param.name]
        elif param.default is inspect.Parameter.empty:
            raise ValueError(f"advantage estimator '{name}' needs `{param.name}`, which was not given")
    return estimator(**args, **cfg)


def compute_advantages(
    name, *, rewards, action_mask, group_ids=None, token_kl=None, values=None, token_rewards=None, **cfg
):
    """Runs the estimator registered as `name` -> (advantages [B, T], returns [B, T] or None).

    Every estimator is given the batch inputs its signature asks for; `cfg` holds its keyword knobs
    (`normalize_std`, `eps`, `kl_coef`, `gamma`, `lam`, ...). An estimator that needs `token_rewards` (GAE)
    gets them built from the scalar `rewards` (on the last action token) minus `kl_coef * token_kl` when not
    given. Only estimators that return a pair (GAE) produce returns.
    """
    estimator = get_advantage_estimator(name)
    takes_token_rewards = "token_rewards" in inspect.signature(estimator).parameters
    if takes_token_rewards and token_rewards is None:
        kl_coef = cfg.pop("kl_coef", 0.0)
        token_rewards = token_level_rewards(rewards, action_mask, token_kl=token_kl, kl_coef=kl_coef)
    inputs = {
        "rewards": rewards,
        "group_ids": group_ids,
        "action_mask": action_mask,
        "token_kl": token_kl,
        "values": values,
        "token_rewards": token_rewards,
    }
    out = _call_with_inputs(name, estimator, inputs, cfg)
    return out if isinstance(out, tuple) else (out, None)
