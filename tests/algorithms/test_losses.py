"""Losses, KL estimators, aggregation and IS weights against the loop-based float64 references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentfly_jax import algorithms
from tests.algorithms import numpy_reference as ref

RTOL, ATOL = 1e-5, 1e-6
BATCH, SEQ = 8, 32
EMPTY_ROW = 5
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def make_batch(seed, log_ratio_scale=0.3):
    rng = np.random.default_rng(seed)
    mask = ref.multi_turn_mask(rng, BATCH, SEQ, empty_rows=(EMPTY_ROW,))
    old_logprobs = -rng.exponential(size=(BATCH, SEQ)).astype(np.float32)
    logprobs = (old_logprobs + rng.normal(scale=log_ratio_scale, size=(BATCH, SEQ))).astype(np.float32)
    advantages = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    return rng, mask, logprobs, old_logprobs, advantages


def assert_metrics_close(got, want):
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL, err_msg=key)


# ------------------------------------------------------------------------------------------------ aggregation
@pytest.mark.parametrize("mode", MODES)
def test_aggregate_loss_matches_reference(mode):
    rng, mask, *_ = make_batch(0)
    per_token = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    got = jax.jit(algorithms.aggregate_loss, static_argnums=2)(per_token, mask, mode)
    np.testing.assert_allclose(got, ref.aggregate(per_token, mask, mode), rtol=RTOL, atol=ATOL)


def test_aggregate_modes_differ_and_norm_len_is_a_constant_horizon():
    rng, mask, *_ = make_batch(1)
    per_token = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    values = [float(algorithms.aggregate_loss(per_token, mask, mode)) for mode in MODES]
    assert len(set(values)) == len(MODES)
    got = algorithms.aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", norm_len=100)
    np.testing.assert_allclose(
        got, ref.aggregate(per_token, mask, "seq-mean-token-sum-norm", norm_len=100), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("mode", MODES)
def test_empty_mask_gives_zero_not_nan(mode):
    per_token = jnp.full((2, 5), jnp.nan)  # nothing outside the mask is read, not even nan
    assert float(algorithms.aggregate_loss(per_token, jnp.zeros((2, 5), bool), mode)) == 0.0
    loss, metrics = algorithms.ppo_policy_loss(per_token, per_token, per_token, jnp.zeros((2, 5)), agg=mode)
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())


@pytest.mark.parametrize("mode", MODES)
def test_shared_weights_make_micro_batches_add_up(mode):
    rng, mask, *_ = make_batch(2)
    per_token = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    weights = algorithms.aggregation_weights(mask, mode)  # of the whole batch
    halves = [
        algorithms.aggregate_loss(per_token[s], mask[s], mode, weights=weights[s])
        for s in (slice(0, 3), slice(3, None))
    ]
    np.testing.assert_allclose(sum(halves), ref.aggregate(per_token, mask, mode), rtol=RTOL, atol=ATOL)
    # the same halves aggregated on their own are each half's own aggregate, not the batch's
    alone = [float(algorithms.aggregate_loss(per_token[s], mask[s], mode)) for s in (slice(0, 3), slice(3, None))]
    assert abs(sum(alone) - ref.aggregate(per_token, mask, mode)) > 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_weights_per_group_match_reference(mode):
    """`groups` aggregate each group (e.g. a PPO mini-batch) on its own; a group without action tokens weighs
    0; the weights are mask-shaped and 0 off the mask."""
    rng, mask, *_ = make_batch(13)
    per_token = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    groups = np.array([2, 0, 1, 0, 2, 3, 1, 0])  # row 5 (EMPTY_ROW) alone in group 3: no action tokens
    norm_len = 50 if mode == "seq-mean-token-sum-norm" else None
    weights = np.asarray(
        jax.jit(algorithms.aggregation_weights, static_argnames=("mode", "num_groups"))(
            mask, mode, norm_len=norm_len, groups=groups, num_groups=4
        )
    )
    assert weights.shape == mask.shape and (weights[mask == 0] == 0).all()
    assert (weights[groups == 3] == 0).all()
    for g in range(3):
        rows = groups == g
        got = float((weights[rows] * per_token[rows]).sum())
        want = ref.aggregate(per_token[rows], mask[rows], mode, norm_len=norm_len)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"group {g}")
        if mode == "token-mean":
            np.testing.assert_allclose(weights[rows].sum(), 1.0, rtol=RTOL)
        if mode == "seq-mean-token-sum-norm":  # Dr.GRPO: sum = tokens / (norm_len * sequences)
            want_sum = mask[rows].sum() / (norm_len * (mask[rows].sum(1) > 0).sum())
            np.testing.assert_allclose(weights[rows].sum(), want_sum, rtol=RTOL)
    # without groups, the whole batch is one group
    np.testing.assert_allclose(
        (np.asarray(algorithms.aggregation_weights(mask, mode, norm_len=norm_len)) * per_token).sum(),
        ref.aggregate(per_token, mask, mode, norm_len=norm_len), rtol=RTOL, atol=ATOL,
    )


def test_unknown_aggregation_mode_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown loss aggregation mode 'seq-mean'; known: token-mean, "):
        algorithms.aggregate_loss(jnp.zeros((1, 2)), jnp.ones((1, 2)), "seq-mean")
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        algorithms.ppo_policy_loss(
            jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), agg="mean"
        )


# ------------------------------------------------------------------------------------------------ policy loss
PPO_CONFIGS = [
    {},
    {"clip_eps": 0.1, "clip_eps_high": 0.3},  # clip-higher
    {"dual_clip": 1.5},
    {"clip_eps": 0.2, "clip_eps_high": 0.28, "dual_clip": 2.0, "agg": "seq-mean-token-mean"},
    {"agg": "seq-mean-token-sum-norm"},
]


@pytest.mark.parametrize("config", PPO_CONFIGS)
def test_ppo_loss_metrics_and_gradient_match_reference(config):
    _, mask, logprobs, old_logprobs, advantages = make_batch(3)
    loss_fn = jax.jit(functools.partial(algorithms.ppo_policy_loss, **config))
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(
        logprobs, old_logprobs, advantages, mask
    )
    want_loss, want_metrics, want_grad = ref.ppo(logprobs, old_logprobs, advantages, mask, **config)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
    assert_metrics_close(metrics, want_metrics)
    np.testing.assert_allclose(grad, want_grad, rtol=RTOL, atol=ATOL)
    assert 0 < want_metrics["clip_fraction"] < 1  # the inputs exercise both sides of the clip
    if config.get("dual_clip"):
        assert want_metrics["dual_clip_fraction"] > 0


def test_clip_high_clips_less_than_symmetric():
    _, mask, logprobs, old_logprobs, advantages = make_batch(4)
    symmetric = algorithms.ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps=0.2)[1]
    higher = algorithms.ppo_policy_loss(
        logprobs, old_logprobs, advantages, mask, clip_eps=0.2, clip_eps_high=0.4
    )[1]
    assert float(higher["clip_fraction"]) < float(symmetric["clip_fraction"])


def test_ppo_with_is_weights_matches_reference():
    rng, mask, logprobs, old_logprobs, advantages = make_batch(5)
    sampler_logprobs = (old_logprobs + rng.normal(scale=0.3, size=(BATCH, SEQ))).astype(np.float32)
    weights, _ = algorithms.truncated_is_weights(old_logprobs, sampler_logprobs, mask, cap=1.2)
    loss_fn = jax.jit(functools.partial(algorithms.ppo_policy_loss, dual_clip=3.0))
    loss, grad = jax.value_and_grad(
        lambda lp: loss_fn(lp, old_logprobs, advantages, mask, is_weights=weights)[0]
    )(logprobs)
    want_weights, _ = ref.truncated_is_weights(old_logprobs, sampler_logprobs, mask, 1.2)
    want_loss, _, want_grad = ref.ppo(
        logprobs, old_logprobs, advantages, mask, dual_clip=3.0, is_weights=want_weights
    )
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, want_grad, rtol=RTOL, atol=ATOL)


def test_ppo_ignores_garbage_outside_the_mask():
    _, mask, logprobs, old_logprobs, advantages = make_batch(6)
    off = mask == 0
    dirty = [
        np.where(off, fill, x).astype(np.float32)
        for x, fill in ((logprobs, 1e4), (old_logprobs, -np.inf), (advantages, np.nan))
    ]
    weights = np.full((BATCH, SEQ), 0.9, np.float32)
    dirty_weights = np.where(off, np.nan, weights).astype(np.float32)
    loss_fn = functools.partial(algorithms.ppo_policy_loss, dual_clip=2.0)
    clean_loss, clean_grad = jax.value_and_grad(
        lambda lp: loss_fn(lp, old_logprobs, advantages, mask, is_weights=weights)[0]
    )(logprobs)
    loss, grad = jax.value_and_grad(lambda lp: loss_fn(lp, *dirty[1:], mask, is_weights=dirty_weights)[0])(
        dirty[0]
    )
    assert float(loss) == float(clean_loss)
    np.testing.assert_array_equal(grad, clean_grad)


GSPO_CONFIGS = [
    {},  # GSPO's own ranges (3e-4 / 4e-4)
    {"clip_eps": 0.02, "clip_eps_high": 0.03},
    {"clip_eps": 0.02, "dual_clip": 1.01},
]


@pytest.mark.parametrize("config", GSPO_CONFIGS)
def test_gspo_loss_metrics_and_gradient_match_reference(config):
    _, mask, logprobs, old_logprobs, advantages = make_batch(3, log_ratio_scale=0.1)
    loss_fn = jax.jit(functools.partial(algorithms.gspo_policy_loss, **config))
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logprobs, old_logprobs, advantages, mask)
    want_loss, want_metrics, want_grad = ref.gspo(logprobs, old_logprobs, advantages, mask, **config)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
    assert_metrics_close(metrics, want_metrics)
    np.testing.assert_allclose(grad, want_grad, rtol=RTOL, atol=ATOL)
    if config.get("clip_eps") == 0.02 and not config.get("dual_clip"):
        assert 0 < want_metrics["clip_fraction"] < 1  # both sides of the clip exercised
    if config.get("dual_clip"):
        assert want_metrics["dual_clip_fraction"] > 0


def test_gspo_is_one_ratio_per_sequence_unlike_ppo():
    """Two sequences with the same mean log-ratio but a different spread: GSPO's ratios are equal, PPO's
    per-token ratios are not; and a sequence's loss does not depend on its length at equal ratios."""
    mask = np.array([[0, 1, 1, 1, 1], [0, 0, 1, 1, 0]], np.float32)
    old = np.zeros((2, 5), np.float32)
    new = np.array([[0, 0.2, -0.2, 0.1, -0.1], [0, 0, 0.05, -0.05, 0]], np.float32)
    adv = np.ones((2, 5), np.float32)
    _, metrics = algorithms.gspo_policy_loss(new, old, adv, mask, clip_eps=0.5)
    assert float(metrics["ratio_min"]) == float(metrics["ratio_max"]) == 1.0
    _, ppo_metrics = algorithms.ppo_policy_loss(new, old, adv, mask, clip_eps=0.5)
    assert float(ppo_metrics["ratio_max"]) > 1.2
    loss, _ = algorithms.gspo_policy_loss(new, old, adv, mask, clip_eps=0.5)
    assert float(loss) == -1.0  # the mean over sequences of -A * 1


def test_gspo_packed_segments_equal_one_sequence_per_row():
    """Rows packed two sequences to a row (segment ids 1, 2) give the loss, metrics and gradient of the same
    sequences one per row: a segment is a sequence, not the row."""
    _, mask, logprobs, old_logprobs, advantages = make_batch(7, log_ratio_scale=0.1)
    config = {"clip_eps": 0.02, "clip_eps_high": 0.03}

    def pack(x):  # rows 2i and 2i+1 side by side
        return np.concatenate([x[0::2], x[1::2]], axis=1)

    segment_ids = np.concatenate([np.ones((BATCH // 2, SEQ), np.int32), np.full((BATCH // 2, SEQ), 2, np.int32)],
                                 axis=1)
    loss_fn = functools.partial(algorithms.gspo_policy_loss, **config)
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logprobs, old_logprobs, advantages, mask)
    (packed_loss, packed_metrics), packed_grad = jax.value_and_grad(
        lambda lp: loss_fn(lp, pack(old_logprobs), pack(advantages), pack(mask), segment_ids=segment_ids),
        has_aux=True)(pack(logprobs))
    np.testing.assert_allclose(packed_loss, loss, rtol=RTOL, atol=ATOL)
    assert_metrics_close(packed_metrics, jax.device_get(metrics))
    np.testing.assert_allclose(packed_grad, pack(np.asarray(grad)), rtol=RTOL, atol=ATOL)
    # without the segment ids each packed row would be one sequence: a different loss
    wrong, _ = loss_fn(pack(logprobs), pack(old_logprobs), pack(advantages), pack(mask))
    assert abs(float(wrong) - float(loss)) > 1e-4


def test_gspo_empty_mask_gives_zero_not_nan():
    garbage = jnp.full((2, 5), jnp.nan)
    loss, metrics = algorithms.gspo_policy_loss(garbage, garbage, garbage, jnp.zeros((2, 5)))
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        algorithms.ppo_policy_loss(
            jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), jnp.ones((1, 2)), dual_clip=0.9
        )


def test_policy_loss_registry():
    assert algorithms.get_policy_loss("ppo") is algorithms.ppo_policy_loss
    assert algorithms.get_policy_loss("gspo") is algorithms.gspo_policy_loss
    with pytest.raises(ValueError, match="unknown policy loss 'grpo_loss'; known: gspo, ppo"):
        algorithms.get_policy_loss("grpo_loss")


# ------------------------------------------------------------------------------------------------- value loss
@pytest.mark.parametrize(
    "clip_eps,agg", [(0.2, "token-mean"), (0.05, "seq-mean-token-mean"), (None, "token-mean")]
)
def test_value_loss_matches_reference(clip_eps, agg):
    rng, mask, *_ = make_batch(7)
    old_values = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    values = (old_values + rng.normal(scale=0.2, size=(BATCH, SEQ))).astype(np.float32)
    returns = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    fn = jax.jit(functools.partial(algorithms.value_loss, clip_eps=clip_eps, agg=agg))
    loss, metrics = fn(values, old_values, returns, mask)
    want_loss, want_metrics = ref.value_loss(values, old_values, returns, mask, clip_eps, agg)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
    assert_metrics_close(metrics, want_metrics)
    if clip_eps == 0.05:
        assert want_metrics["value_clip_fraction"] > 0


# --------------------------------------------------------------------------------------------- KL and entropy
@pytest.mark.parametrize("kind,fn", [("k1", algorithms.kl_k1), ("k2", algorithms.kl_k2)])
def test_kl_k1_k2_match_reference(kind, fn):
    _, _, logprobs, ref_logprobs, _ = make_batch(8, log_ratio_scale=1.0)
    np.testing.assert_allclose(
        jax.jit(fn)(logprobs, ref_logprobs), ref.kl(logprobs, ref_logprobs, kind), rtol=RTOL, atol=ATOL
    )


def test_kl_k3_matches_reference_with_and_without_clamp():
    _, _, logprobs, ref_logprobs, _ = make_batch(9, log_ratio_scale=3.0)  # wide enough to hit the clamp
    unclamped = ref.kl(logprobs, ref_logprobs, "k3")
    assert unclamped.max() > 10
    np.testing.assert_allclose(
        jax.jit(algorithms.kl_k3)(logprobs, ref_logprobs),
        ref.kl(logprobs, ref_logprobs, "k3", clamp=10.0),
        rtol=RTOL,
        atol=ATOL,
    )
    np.testing.assert_allclose(
        algorithms.kl_k3(logprobs, ref_logprobs, clamp=None), unclamped, rtol=RTOL, atol=ATOL
    )


def test_kl_k3_gradient_is_finite_and_zero_beyond_the_clamp():
    logprobs = jnp.array([-200.0, -1.0, 150.0, -2.0])
    ref_logprobs = jnp.array([0.0, -1.5, 0.0, -1.0])
    grad = jax.grad(lambda lp: jnp.sum(algorithms.kl_k3(lp, ref_logprobs)))(logprobs)
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp) where unclamped
    np.testing.assert_allclose(grad, [0.0, 1 - np.exp(-0.5), 0.0, 1 - np.exp(1.0)], rtol=RTOL, atol=ATOL)


def test_kl_penalty_by_name():
    _, _, logprobs, ref_logprobs, _ = make_batch(10)
    for kind, alias in (("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")):
        want = ref.kl(logprobs, ref_logprobs, kind, clamp=10.0)
        np.testing.assert_allclose(
            algorithms.kl_penalty(logprobs, ref_logprobs, kind), want, rtol=RTOL, atol=ATOL
        )
        np.testing.assert_array_equal(
            algorithms.kl_penalty(logprobs, ref_logprobs, alias),
            algorithms.kl_penalty(logprobs, ref_logprobs, kind),
        )
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; known: k1, kl, k2"):
        algorithms.kl_penalty(logprobs, ref_logprobs, "k4")


def test_entropy_bonus_is_negative_coef_times_aggregated_entropy():
    rng, mask, *_ = make_batch(11)
    entropy = rng.exponential(size=(BATCH, SEQ)).astype(np.float32)
    for mode in MODES:
        got = algorithms.entropy_bonus(entropy, mask, coef=0.01, agg=mode)
        np.testing.assert_allclose(got, -0.01 * ref.aggregate(entropy, mask, mode), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------- IS weights
def test_truncated_is_weights_match_reference_and_carry_no_gradient():
    rng, mask, logprobs, _, _ = make_batch(12)
    sampler_logprobs = (logprobs + rng.normal(scale=0.4, size=(BATCH, SEQ))).astype(np.float32)
    weights, metrics = jax.jit(functools.partial(algorithms.truncated_is_weights, cap=1.5))(
        logprobs, sampler_logprobs, mask
    )
    want_weights, want_metrics = ref.truncated_is_weights(logprobs, sampler_logprobs, mask, 1.5)
    np.testing.assert_allclose(weights, want_weights, rtol=RTOL, atol=ATOL)
    assert_metrics_close(metrics, want_metrics)
    assert 0 < want_metrics["is_capped_fraction"] < 1
    grad = jax.grad(
        lambda lp: jnp.sum(algorithms.truncated_is_weights(lp, sampler_logprobs, mask, cap=1.5)[0])
    )(logprobs)
    assert np.all(np.asarray(grad) == 0.0)
