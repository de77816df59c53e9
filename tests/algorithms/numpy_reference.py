"""Independent float64 references for the algorithms, written as plain loops over sequences and tokens.

Deliberately not a transcription of the vectorised JAX code: groups are dicts, returns are accumulated
token by token, statistics are running sums. Inputs are numpy arrays; a nonzero mask entry is an action
token.
"""

from __future__ import annotations

import math

import numpy as np


# ----------------------------------------------------------------------------------------------- batches
def multi_turn_mask(rng, batch, seq_len, empty_rows=()):
    """[batch, seq] 0/1 masks: a prompt, then action spans separated by observation spans, then padding."""
    mask = np.zeros((batch, seq_len), np.float32)
    for b in range(batch):
        if b in empty_rows:
            continue
        t = int(rng.integers(1, 5))  # prompt
        while t < seq_len:
            span = int(rng.integers(1, 6))
            mask[b, t : t + span] = 1.0
            t += span + int(rng.integers(1, 5))  # tool output / template tokens
            if rng.random() < 0.15:  # ragged: this chain ends early, the rest is padding
                break
    return mask


def action_positions(mask_row):
    return [t for t in range(len(mask_row)) if mask_row[t] != 0]


def num_spans(mask_row):
    return sum(1 for t in range(len(mask_row)) if mask_row[t] != 0 and (t == 0 or mask_row[t - 1] == 0))


def groups_of(group_ids):
    groups: dict[int, list[int]] = {}
    for i, gid in enumerate(group_ids):
        groups.setdefault(int(gid), []).append(i)
    return groups


# ----------------------------------------------------------------------------------------------- logprobs
def logprobs_and_entropy(logits, targets, temperature=1.0):
    batch, seq_len, _vocab = logits.shape
    logprobs = np.zeros((batch, seq_len))
    entropy = np.zeros((batch, seq_len))
    for b in range(batch):
        for t in range(seq_len):
            z = [float(v) / temperature for v in logits[b, t]]
            top = max(z)
            log_norm = top + math.log(sum(math.exp(v - top) for v in z))
            logprobs[b, t] = z[int(targets[b, t])] - log_norm
            entropy[b, t] = -sum(math.exp(v - log_norm) * (v - log_norm) for v in z)
    return logprobs, entropy


# ---------------------------------------------------------------------------------------------- advantages
def _spread(per_sequence, mask):
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for t in action_positions(mask[b]):
            out[b, t] = per_sequence[b]
    return out


def grpo(rewards, group_ids, mask, normalize_std=True, eps=1e-6):
    per_sequence = np.zeros(len(rewards))
    for members in groups_of(group_ids).values():
        n = len(members)
        if n == 1:
            continue
        mean = sum(float(rewards[i]) for i in members) / n
        std = math.sqrt(sum((float(rewards[i]) - mean) ** 2 for i in members) / (n - 1))
        for i in members:
            advantage = float(rewards[i]) - mean
            per_sequence[i] = advantage / (std + eps) if normalize_std else advantage
    return _spread(per_sequence, mask)


def rloo(rewards, group_ids, mask):
    per_sequence = np.zeros(len(rewards))
    for members in groups_of(group_ids).values():
        if len(members) == 1:
            continue
        for i in members:
            others = [float(rewards[j]) for j in members if j != i]
            per_sequence[i] = float(rewards[i]) - sum(others) / len(others)
    return _spread(per_sequence, mask)


def reinforce_pp(rewards, mask, token_kl=None, kl_coef=0.0, eps=1e-8):
    """Whitened with the sample std (ddof=1) over every action token of the batch."""
    returns = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        positions = action_positions(mask[b])
        running = 0.0
        for k, t in enumerate(reversed(positions)):
            reward = -kl_coef * float(token_kl[b, t]) if token_kl is not None else 0.0
            if k == 0:
                reward += float(rewards[b])
            running += reward
            returns[b, t] = running
    action_returns = [returns[b, t] for b in range(mask.shape[0]) for t in action_positions(mask[b])]
    n = len(action_returns)
    mean = sum(action_returns) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in action_returns) / (n - 1))
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for t in action_positions(mask[b]):
            out[b, t] = (returns[b, t] - mean) / (std + eps)
    return out


def reinforce_pp_baseline(rewards, group_ids, mask, token_kl=None, kl_coef=0.0, eps=1e-8):
    """Score = reward - kl_coef * sum of the action tokens' KL; minus the group's mean score (a group of one:
    0); on every action token; whitened (sample std) over all action tokens of the batch."""
    scores = []
    for b in range(mask.shape[0]):
        kl_sum = sum(float(token_kl[b, t]) for t in action_positions(mask[b])) if token_kl is not None else 0.0
        scores.append(float(rewards[b]) - kl_coef * kl_sum)
    per_sequence = np.zeros(len(scores))
    for members in groups_of(group_ids).values():
        if len(members) > 1:
            mean = sum(scores[i] for i in members) / len(members)
            for i in members:
                per_sequence[i] = scores[i] - mean
    return whiten(_spread(per_sequence, mask), mask, eps)


def whiten(values, mask, eps=1e-8):
    """(x - mean) / (sample std + eps) over all action tokens of the batch; 0 elsewhere."""
    xs = [float(values[b, t]) for b in range(mask.shape[0]) for t in action_positions(mask[b])]
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for t in action_positions(mask[b]):
            out[b, t] = (float(values[b, t]) - mean) / (std + eps)
    return out


def overlong_penalty(length, max_len, buffer_len):
    """DAPO's soft overlong punishment for one response length."""
    if length <= max_len - buffer_len:
        return 0.0
    if length >= max_len:
        return -1.0
    return -(length - (max_len - buffer_len)) / buffer_len


def gae(token_rewards, values, mask, gamma, lam):
    advantages = np.zeros(mask.shape)
    returns = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        next_value, next_advantage = 0.0, 0.0
        for t in reversed(action_positions(mask[b])):
            value = float(values[b, t])
            delta = float(token_rewards[b, t]) + gamma * next_value - value
            advantage = delta + gamma * lam * next_advantage
            advantages[b, t], returns[b, t] = advantage, advantage + value
            next_value, next_advantage = value, advantage
    return advantages, returns


# -------------------------------------------------------------------------------------------------- losses
def aggregate(per_token, mask, mode, norm_len=None):
    batch, seq_len = mask.shape
    if mode == "token-mean":
        values = [float(per_token[b, t]) for b in range(batch) for t in action_positions(mask[b])]
        return sum(values) / len(values) if values else 0.0
    per_sequence = []
    for b in range(batch):
        values = [float(per_token[b, t]) for t in action_positions(mask[b])]
        if not values:
            continue
        if mode == "seq-mean-token-mean":
            per_sequence.append(sum(values) / len(values))
        elif mode == "seq-mean-token-sum":
            per_sequence.append(sum(values))
        else:
            per_sequence.append(sum(values) / (seq_len if norm_len is None else norm_len))
    return sum(per_sequence) / len(per_sequence) if per_sequence else 0.0


def _mean_over_actions(x, mask):
    values = [float(x[b, t]) for b in range(mask.shape[0]) for t in action_positions(mask[b])]
    return sum(values) / len(values) if values else 0.0


def ppo(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_eps=0.2,
    clip_eps_high=None,
    dual_clip=None,
    agg="token-mean",
    is_weights=None,
):
    """-> (loss, metrics, dloss_dlogprobs): the gradient is written out per token from the case analysis."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    per_token = np.zeros(mask.shape)
    slope = np.zeros(mask.shape)  # d per_token / d logprob
    clipped = np.zeros(mask.shape)
    dual = np.zeros(mask.shape)
    ratios = np.zeros(mask.shape)
    kl = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for t in action_positions(mask[b]):
            log_ratio = float(logprobs[b, t]) - float(old_logprobs[b, t])
            ratio = math.exp(log_ratio)
            adv = float(advantages[b, t])
            bounded = min(max(ratio, 1 - clip_eps), 1 + high)
            loss, d = -adv * ratio, -adv * ratio
            if -adv * bounded > loss:
                loss, d = -adv * bounded, 0.0
                clipped[b, t] = 1
            if dual_clip is not None and adv < 0 and loss > -adv * dual_clip:
                loss, d = -adv * dual_clip, 0.0
                dual[b, t] = 1
            weight = 1.0 if is_weights is None else float(is_weights[b, t])
            per_token[b, t], slope[b, t] = loss * weight, d * weight
            ratios[b, t], kl[b, t] = ratio, ratio - 1 - log_ratio
    action_ratios = [ratios[b, t] for b in range(mask.shape[0]) for t in action_positions(mask[b])]
    metrics = {
        "clip_fraction": _mean_over_actions(clipped, mask),
        "dual_clip_fraction": _mean_over_actions(dual, mask),
        "approx_kl": _mean_over_actions(kl, mask),
        "ratio_mean": _mean_over_actions(ratios, mask),
        "ratio_min": min(action_ratios),
        "ratio_max": max(action_ratios),
    }
    # Every aggregation mode is linear in the per-token loss, so its gradient aggregates the slopes.
    grad = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for t in action_positions(mask[b]):
            unit = np.zeros(mask.shape)
            unit[b, t] = slope[b, t]
            grad[b, t] = aggregate(unit, mask, agg)
    return aggregate(per_token, mask, agg), metrics, grad


def value_loss(values, old_values, returns, mask, clip_eps=0.2, agg="token-mean"):
    per_token = np.zeros(mask.shape)
    clipped = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for t in action_positions(mask[b]):
            v, old, ret = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
            error = (v - ret) ** 2
            if clip_eps is not None:
                v_clipped = old + min(max(v - old, -clip_eps), clip_eps)
                if (v_clipped - ret) ** 2 > error:
                    error = (v_clipped - ret) ** 2
                    clipped[b, t] = 1
            per_token[b, t] = 0.5 * error
    metrics = {
        "value_clip_fraction": _mean_over_actions(clipped, mask),
        "value_mean": _mean_over_actions(values, mask),
        "return_mean": _mean_over_actions(returns, mask),
    }
    return aggregate(per_token, mask, agg), metrics


def kl(logprobs, ref_logprobs, kind, clamp=None):
    out = np.zeros(logprobs.shape)
    for index in np.ndindex(logprobs.shape):
        diff = float(logprobs[index]) - float(ref_logprobs[index])
        if kind == "k1":
            out[index] = diff
        elif kind == "k2":
            out[index] = 0.5 * diff * diff
        else:
            value = math.exp(-diff) + diff - 1
            out[index] = value if clamp is None else min(max(value, -clamp), clamp)
    return out


def truncated_is_weights(logprobs, sampler_logprobs, mask, cap):
    weights = np.zeros(mask.shape)
    capped = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for t in action_positions(mask[b]):
            raw = math.exp(float(logprobs[b, t]) - float(sampler_logprobs[b, t]))
            weights[b, t] = min(raw, cap)
            capped[b, t] = float(raw > cap)
    action_weights = [weights[b, t] for b in range(mask.shape[0]) for t in action_positions(mask[b])]
    metrics = {
        "is_weight_mean": _mean_over_actions(weights, mask),
        "is_weight_max": max(action_weights),
        "is_capped_fraction": _mean_over_actions(capped, mask),
    }
    return weights, metrics


def gspo(logprobs, old_logprobs, advantages, mask, segment_ids=None, clip_eps=3e-4, clip_eps_high=None,
         dual_clip=None):
    """-> (loss, metrics, dloss_dlogprobs). Sequences are rows, or (row, segment id) pairs of packed rows; the
    loss is the mean over sequences with action tokens of max(-A s, -A clip(s)), s = exp(mean log-ratio)."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    sequences = {}
    for b in range(mask.shape[0]):
        for t in action_positions(mask[b]):
            key = (b, 0 if segment_ids is None else int(segment_ids[b, t]))
            sequences.setdefault(key, []).append(t)
    losses, grad = [], np.zeros(mask.shape)
    token_clipped, token_dual, token_ratio, token_kl = [], [], [], []
    for (b, _), positions in sequences.items():
        n = len(positions)
        log_ratio = sum(float(logprobs[b, t]) - float(old_logprobs[b, t]) for t in positions) / n
        ratio = math.exp(log_ratio)
        adv = sum(float(advantages[b, t]) for t in positions) / n
        bounded = min(max(ratio, 1 - clip_eps), 1 + high)
        loss, slope, clipped, dual = -adv * ratio, -adv * ratio, 0, 0  # slope: d loss / d log_ratio
        if -adv * bounded > loss:
            loss, slope, clipped = -adv * bounded, 0.0, 1
        if dual_clip is not None and adv < 0 and loss > -adv * dual_clip:
            loss, slope, dual = -adv * dual_clip, 0.0, 1
        losses.append(loss)
        for t in positions:
            grad[b, t] = slope / n  # d log_ratio / d logprob_t = 1 / n
        token_clipped += [clipped] * n
        token_dual += [dual] * n
        token_ratio += [ratio] * n
        token_kl += [ratio - 1 - log_ratio] * n
    count = len(losses)
    metrics = {
        "clip_fraction": sum(token_clipped) / len(token_clipped),
        "dual_clip_fraction": sum(token_dual) / len(token_dual),
        "approx_kl": sum(token_kl) / len(token_kl),
        "ratio_mean": sum(token_ratio) / len(token_ratio),
        "ratio_min": min(token_ratio),
        "ratio_max": max(token_ratio),
    }
    return sum(losses) / count, metrics, grad / count
