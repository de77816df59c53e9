"""Token-masked losses: PPO clipped policy loss, clipped value loss, KL estimators, entropy bonus,
aggregation, and truncated importance-sampling weights between the trainer's and the sampler's logprobs.

All per-token inputs are fp32-castable [B, T] arrays aligned with `action_mask` (see `advantages.py`); values
at non-action positions are never read (they are selected away with `where`, so even inf/nan there is
harmless).
Metrics are dicts of fp32 scalars computed over action tokens (0 when there are none).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from agentfly_jax.algorithms.advantages import as_float_mask
from agentfly_jax.algorithms.registry import register_policy_loss

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


# ------------------------------------------------------------------------------------------------ aggregation
def _check_mode(mode):
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode '{mode}'; known: {', '.join(AGGREGATION_MODES)}")


def aggregation_weights(action_mask, mode="token-mean", *, norm_len=None, groups=None, num_groups=1):
    """Per-token weights w [B, T] such that sum(w * per_token_loss) is the `mode` aggregate: the one
    implementation of loss aggregation (every loss here, and the trainer, reduce through it).

    - "token-mean": mask / (action tokens of the group).
    - "seq-mean-token-mean": mask / (the sequence's action tokens * sequences of the group with any).
    - "seq-mean-token-sum": mask / (sequences of the group with any): each sequence's token sum, averaged over
      sequences (long sequences weigh more).
    - "seq-mean-token-sum-norm" (Dr.GRPO): mask / (norm_len * sequences of the group with any), `norm_len` a
      constant horizon (default T, the padded length).
    `groups` [B] (ints in [0, num_groups)) aggregates each group separately, e.g. each PPO mini-batch of a
    step's trajectories; by default the whole batch is one group. Being a plain weighted sum, the aggregate is
    exact under sequence packing and gradient accumulation (micro-batch sums add up to the group's).
    A group without action tokens weighs 0 everywhere (its aggregate is 0, not nan).
    """
    _check_mode(mode)
    mask = as_float_mask(action_mask)  # [B, T]
    groups = jnp.zeros(mask.shape[0], jnp.int32) if groups is None else jnp.asarray(groups, jnp.int32)

    def per_group_total(x):  # [B] -> for each sequence, the total over its group
        return jax.ops.segment_sum(x, groups, num_segments=num_groups)[groups]

    per_seq = jnp.sum(mask, axis=1)  # [B]
    if mode == "token-mean":
        denominator = per_group_total(per_seq)[:, None]
    else:
        n_seqs = per_group_total((per_seq > 0).astype(jnp.float32))
        if mode == "seq-mean-token-mean":
            denominator = (jnp.maximum(per_seq, 1.0) * n_seqs)[:, None]
        elif mode == "seq-mean-token-sum":
            denominator = n_seqs[:, None]
        else:
            horizon = mask.shape[1] if norm_len is None else norm_len
            denominator = (horizon * n_seqs)[:, None]
    return mask / jnp.maximum(denominator, 1e-30)


def aggregate_loss(per_token, action_mask, mode="token-mean", *, norm_len=None, weights=None):
    """Reduces a per-token loss [B, T] over action tokens to a scalar: sum(weights * per_token), with
    `weights` from `aggregation_weights(action_mask, mode, norm_len=...)` unless given (a trainer passes the
    weights of the whole mini-batch, so micro-batch losses add up to the mini-batch's). No action tokens at
    all gives 0, not nan."""
    mask = as_float_mask(action_mask)
    if weights is None:
        weights = aggregation_weights(mask, mode, norm_len=norm_len)
    return jnp.sum(jnp.where(mask > 0, per_token * weights, 0.0).astype(jnp.float32))


def _masked_mean(x, mask):
    return jnp.sum(jnp.where(mask > 0, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def _masked_extreme(x, mask, reduce, fill):
    extreme = reduce(jnp.where(mask > 0, x, fill))
    return jnp.where(jnp.sum(mask) > 0, extreme, 0.0)


# ------------------------------------------------------------------------------------------------ policy loss
@register_policy_loss("ppo")
def ppo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    action_mask,
    *,
    clip_eps=0.2,
    clip_eps_high=None,
    dual_clip=None,
    agg="token-mean",
    is_weights=None,
    norm_len=None,
    weights=None,
):
    """PPO clipped surrogate -> (loss, metrics), with ratio = exp(logprobs - old_logprobs) per token [B, T].

    The ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] (clip_eps_high defaults to clip_eps; larger
    values are DAPO's clip-higher). With `dual_clip` (> 1), a negative-advantage token's loss is capped at
    dual_clip * (-A). `is_weights` [B, T] (e.g. `truncated_is_weights`) multiply the per-token loss, without
    gradient, before aggregation by `agg` (see `aggregate_loss`, which also takes `norm_len`, `weights`).

    Metrics: clip_fraction (action tokens where the clipped term is the active one, i.e. its gradient is
    cut), dual_clip_fraction, approx_kl (mean over action tokens of the k3 estimator (r - 1) - log r of
    KL(old || new)), ratio_mean, ratio_min, ratio_max.
    """
    mask = as_float_mask(action_mask)  # [B, T]
    is_action = mask > 0
    log_ratio = jnp.where(is_action, logprobs - old_logprobs, 0.0).astype(jnp.float32)  # [B, T]
    advantages = jnp.where(is_action, advantages, 0.0).astype(jnp.float32)
    per_token, metrics = _clipped_surrogate(log_ratio, advantages, mask, clip_eps=clip_eps,
                                            clip_eps_high=clip_eps_high, dual_clip=dual_clip, is_weights=is_weights)
    return aggregate_loss(per_token, mask, agg, norm_len=norm_len, weights=weights), metrics


def _clipped_surrogate(log_ratio, advantages, mask, *, clip_eps, clip_eps_high, dual_clip, is_weights):
    """The clipped objective per token, max(-A r, -A clip(r, 1 - eps, 1 + eps_high)) (dual-clipped, times the
    IS weights), for a log-ratio and an advantage given on every action token [B, T] (per token for PPO, the
    sequence's for GSPO) -> (per-token loss, metrics over action tokens, without gradient)."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it caps the loss at dual_clip * -A), got {dual_clip}")
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high)
    per_token = jnp.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = jnp.zeros_like(clip_active)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_active = (advantages < 0) & (per_token > cap)
        per_token = jnp.where(dual_active, cap, per_token)
    if is_weights is not None:
        per_token = per_token * jax.lax.stop_gradient(is_weights)
    metrics = {
        "clip_fraction": _masked_mean(clip_active, mask),
        "dual_clip_fraction": _masked_mean(dual_active, mask),
        "approx_kl": _masked_mean(ratio - 1.0 - log_ratio, mask),
        "ratio_mean": _masked_mean(ratio, mask),
        "ratio_min": _masked_extreme(ratio, mask, jnp.min, jnp.inf),
        "ratio_max": _masked_extreme(ratio, mask, jnp.max, -jnp.inf),
    }
    return per_token, jax.lax.stop_gradient(metrics)


def sequence_index(action_mask, segment_ids=None):
    """Dense sequence index [B, T] in [0, B*T): each row is one sequence, or with `segment_ids` [B, T] (packed
    rows: 1, 2, ... per sequence, 0 = padding) each (row, segment) is one."""
    rows, length = action_mask.shape
    row = jnp.arange(rows, dtype=jnp.int32)[:, None] * length
    if segment_ids is None:
        return jnp.broadcast_to(row, (rows, length))
    return row + jnp.clip(jnp.asarray(segment_ids, jnp.int32), 0, length - 1)


def _per_sequence_mean(x, mask, index, count):
    """Mean of x [B, T] over each sequence's action tokens (`count` [B*T]: action tokens per sequence index),
    broadcast back to its tokens [B, T]."""
    flat = index.reshape(-1)
    total = jax.ops.segment_sum(jnp.where(mask > 0, x, 0.0).reshape(-1), flat, num_segments=index.size)
    return (total / jnp.maximum(count, 1.0))[flat].reshape(x.shape)


@register_policy_loss("gspo")
def gspo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    action_mask,
    *,
    clip_eps=3e-4,
    clip_eps_high=None,
    dual_clip=None,
    agg="seq-mean-token-mean",
    is_weights=None,
    norm_len=None,
    weights=None,
    segment_ids=None,
):
    """GSPO (Group Sequence Policy Optimization) clipped surrogate -> (loss, metrics).

    One importance ratio per sequence, s = exp(mean over the sequence's action tokens of logprobs -
    old_logprobs), clipped to [1 - clip_eps, 1 + clip_eps_high] (GSPO's ranges are small: 3e-4 / 4e-4), and the
    clipped objective max(-A s, -A clip(s)) per sequence with A the sequence's advantage (the mean of
    `advantages` over its action tokens: the outcome estimators put one value on all of them). Each row of
    [B, T] is one sequence; with `segment_ids` (packed rows) each segment is. The sequence losses are averaged
    over sequences: the per-sequence loss sits on each of its action tokens and is reduced with the
    "seq-mean-token-mean" weights (whose token weights sum to 1 / sequences per sequence), so a row with no
    action token counts for nothing and micro-batch sums add up to the mini-batch mean (`weights`).
    `dual_clip` caps a negative-advantage sequence's loss at dual_clip * (-A); `is_weights` multiply the
    per-token loss without gradient, as in `ppo_policy_loss`.

    Metrics (over action tokens, so a sequence weighs by its length; `clip_fraction` is the fraction of tokens
    whose sequence's clipped term is active): clip_fraction, dual_clip_fraction, approx_kl (k3 of the
    sequence log-ratio), ratio_mean/min/max (the sequence ratios).
    """
    mask = as_float_mask(action_mask)  # [B, T]
    is_action = mask > 0
    index = sequence_index(mask, segment_ids)
    flat = index.reshape(-1)
    count = jax.ops.segment_sum(mask.reshape(-1), flat, num_segments=index.size)  # action tokens per sequence
    token_log_ratio = jnp.where(is_action, logprobs - old_logprobs, 0.0).astype(jnp.float32)
    log_ratio = _per_sequence_mean(token_log_ratio, mask, index, count)  # [B, T], the sequence's on each token
    advantage = _per_sequence_mean(jnp.where(is_action, advantages, 0.0).astype(jnp.float32), mask, index, count)
    per_token, metrics = _clipped_surrogate(log_ratio, advantage, mask, clip_eps=clip_eps,
                                            clip_eps_high=clip_eps_high, dual_clip=dual_clip, is_weights=is_weights)
    if weights is None and segment_ids is not None:  # packed rows: aggregate over segments, not rows
        if agg != "seq-mean-token-mean":
            raise ValueError(f"gspo_policy_loss on packed rows (segment_ids) aggregates over segments only with "
                             f"agg='seq-mean-token-mean', got {agg!r}: pass `weights` computed on the unpacked view")
        weights = mask / jnp.maximum(count[flat].reshape(mask.shape) * jnp.sum(count > 0), 1.0)
    return aggregate_loss(per_token, mask, agg, norm_len=norm_len, weights=weights), metrics


# ------------------------------------------------------------------------------------------------- value loss
def value_loss(
    values,
    old_values,
    returns,
    action_mask,
    *,
    clip_eps=0.2,
    agg="token-mean",
    norm_len=None,
    weights=None,
):
    """Clipped value loss 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = old + clip(v - old, ±clip_eps)
    -> (loss, metrics); `clip_eps=None` gives the plain 0.5 * (v - R)^2.

    Metrics: value_clip_fraction (action tokens where the clipped error is the active one), value_mean,
    return_mean.
    """
    mask = as_float_mask(action_mask)  # [B, T]
    is_action = mask > 0
    values = jnp.where(is_action, values, 0.0).astype(jnp.float32)
    old_values = jnp.where(is_action, old_values, 0.0).astype(jnp.float32)
    returns = jnp.where(is_action, returns, 0.0).astype(jnp.float32)

    unclipped = (values - returns) ** 2  # [B, T]
    if clip_eps is None:
        squared_error, clip_active = unclipped, jnp.zeros(unclipped.shape, bool)
    else:
        clipped_values = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
        clipped = (clipped_values - returns) ** 2
        squared_error, clip_active = jnp.maximum(unclipped, clipped), clipped > unclipped
    loss = aggregate_loss(0.5 * squared_error, mask, agg, norm_len=norm_len, weights=weights)
    metrics = {
        "value_clip_fraction": _masked_mean(clip_active, mask),
        "value_mean": _masked_mean(values, mask),
        "return_mean": _masked_mean(returns, mask),
    }
    return loss, jax.lax.stop_gradient(metrics)


# ------------------------------------------------------------------------------------------------ KL, entropy
def kl_k1(logprobs, ref_logprobs):
    """k1 = logp - ref_logp per token: unbiased estimate of KL(policy || ref) under policy samples; high
    variance, can be negative."""
    return (logprobs - ref_logprobs).astype(jnp.float32)


def kl_k2(logprobs, ref_logprobs):
    """k2 = 0.5 * (logp - ref_logp)^2 per token: biased, low variance, always >= 0."""
    return 0.5 * kl_k1(logprobs, ref_logprobs) ** 2


def kl_k3(logprobs, ref_logprobs, *, clamp=10.0):
    """k3 ("low_var_kl") = exp(ref - logp) - (ref - logp) - 1 per token: unbiased (unclamped), >= 0, low
    variance.

    With `clamp` (default 10, as common practice) the result is clipped to [-clamp, clamp] (it is >= 0, so in
    effect to <= clamp), and tokens beyond it get no gradient; `clamp=None` disables it.
    """
    log_ratio = (ref_logprobs - logprobs).astype(jnp.float32)  # [B, T]
    if clamp is not None:
        # Clipping the log-ratio first changes no clamped value (k3 is already >= clamp outside this range),
        # but keeps exp finite, so a far-off token cannot turn the clamp's zero gradient into inf * 0 = nan.
        log_ratio = jnp.clip(log_ratio, -(clamp + 1.0), math.log(2.0 * clamp + 2.0))
    kl = jnp.exp(log_ratio) - log_ratio - 1.0
    return kl if clamp is None else jnp.clip(kl, -clamp, clamp)


_KL_ESTIMATORS = {"k1": kl_k1, "kl": kl_k1, "k2": kl_k2, "mse": kl_k2, "k3": kl_k3, "low_var_kl": kl_k3}


def kl_penalty(logprobs, ref_logprobs, kind="k3"):
    """Per-token KL estimate [B, T] of the policy from the reference by name: k1|kl, k2|mse, k3|low_var_kl."""
    if kind not in _KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator '{kind}'; known: {', '.join(_KL_ESTIMATORS)}")
    return _KL_ESTIMATORS[kind](logprobs, ref_logprobs)


def entropy_bonus(entropy, action_mask, *, coef, agg="token-mean", norm_len=None, weights=None):
    """The term to ADD to the loss for an entropy bonus: -coef * entropy [B, T] aggregated over action
    tokens."""
    return -coef * aggregate_loss(entropy, action_mask, agg, norm_len=norm_len, weights=weights)


# ----------------------------------------------------------------------------------- importance sampling
def truncated_is_weights(logprobs, sampler_logprobs, action_mask, *, cap):
    """Truncated importance weights min(exp(logprobs - sampler_logprobs), cap) on action tokens, 0 elsewhere,
    without gradient -> (weights [B, T], metrics).

    `logprobs` are the trainer's pre-update (old) logprobs and `sampler_logprobs` the rollout engine's, so the
    weights correct for the mismatch between the two. Metrics: is_weight_mean, is_weight_max,
    is_capped_fraction (action tokens whose raw weight exceeded `cap`).
    """
    mask = as_float_mask(action_mask)  # [B, T]
    is_action = mask > 0
    raw = jnp.exp(jnp.where(is_action, logprobs - sampler_logprobs, 0.0).astype(jnp.float32))  # [B, T]
    weights = jax.lax.stop_gradient(jnp.where(is_action, jnp.minimum(raw, cap), 0.0))
    metrics = {
        "is_weight_mean": _masked_mean(weights, mask),
        "is_weight_max": _masked_extreme(weights, mask, jnp.max, -jnp.inf),
        "is_capped_fraction": _masked_mean(raw > cap, mask),
    }
    return weights, jax.lax.stop_gradient(metrics)
