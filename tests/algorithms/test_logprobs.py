"""Token logprobs/entropy: numpy log-softmax reference, chunked == unchunked (values, gradients), memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentfly_jax import algorithms
from tests.algorithms import numpy_reference as ref

RTOL, ATOL = 1e-5, 1e-6
BATCH, SEQ, EMBED, VOCAB = 3, 10, 16, 50


def make_inputs(seed):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(BATCH, SEQ, EMBED)).astype(np.float32)
    targets = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32)
    weight = rng.normal(scale=0.5, size=(EMBED, VOCAB)).astype(np.float32)
    return hidden, targets, weight


def project(weight, hidden):  # the stand-in LM head: [B, C, E] -> [B, C, V]
    return hidden @ weight


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_from_logits_matches_numpy_log_softmax(temperature):
    hidden, targets, weight = make_inputs(0)
    logits = hidden @ weight
    got = jax.jit(algorithms.logprobs_from_logits)(logits, targets, temperature)
    want = ref.logprobs_and_entropy(logits, targets, temperature)
    for g, w in zip(got, want):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 10, 64])  # 3 and 4 do not divide T=10: internal padding
def test_chunked_matches_numpy_reference(chunk_size):
    hidden, targets, weight = make_inputs(1)
    fn = jax.jit(
        functools.partial(
            algorithms.token_logprobs_and_entropy,
            logits_fn=functools.partial(project, weight),
            temperature=0.8,
            chunk_size=chunk_size,
        )
    )
    got = fn(hidden, targets)
    want = ref.logprobs_and_entropy(hidden.astype(np.float64) @ weight, targets, 0.8)
    for g, w in zip(got, want):
        assert g.shape == (BATCH, SEQ)
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def _objective(weight, hidden, targets, chunk_size):
    # Uses both outputs with unequal per-token weights, so every position's gradient matters.
    logprobs, entropy = algorithms.token_logprobs_and_entropy(
        hidden, targets, functools.partial(project, weight), temperature=0.9, chunk_size=chunk_size
    )
    scale = jnp.linspace(0.5, 1.5, SEQ)[None, :]
    return jnp.sum(logprobs * scale) + 0.1 * jnp.sum(entropy * scale[:, ::-1])


@pytest.mark.parametrize("chunk_size", [1, 3, 4])
def test_chunked_gradients_equal_unchunked(chunk_size):
    hidden, targets, weight = make_inputs(2)
    grad_fn = jax.jit(jax.value_and_grad(_objective, argnums=(0, 1)), static_argnums=3)
    value, (grad_weight, grad_hidden) = grad_fn(weight, hidden, targets, chunk_size)
    full_value, (full_grad_weight, full_grad_hidden) = grad_fn(weight, hidden, targets, None)
    np.testing.assert_allclose(value, full_value, rtol=RTOL)
    np.testing.assert_allclose(grad_weight, full_grad_weight, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad_hidden, full_grad_hidden, rtol=RTOL, atol=ATOL)
    assert np.abs(np.asarray(grad_hidden)).min(axis=-1).max() > 0  # every position got a gradient


def test_gradient_of_logprob_is_onehot_minus_softmax():
    # Independent check of the gradient: d logp(y) / d logits = (onehot(y) - softmax(logits / tau)) / tau.
    hidden, targets, weight = make_inputs(3)
    logits = (hidden @ weight).astype(np.float64)
    grad = jax.grad(lambda x: jnp.sum(algorithms.logprobs_from_logits(x, targets, 0.5)[0]))(
        logits.astype(np.float32)
    )
    scaled = logits / 0.5
    softmax = np.exp(scaled - scaled.max(-1, keepdims=True))
    softmax /= softmax.sum(-1, keepdims=True)
    onehot = np.eye(VOCAB)[targets]
    np.testing.assert_allclose(grad, (onehot - softmax) / 0.5, rtol=RTOL, atol=ATOL)


def test_gradient_of_entropy_and_of_both_outputs_against_closed_forms():
    # d entropy / d logits = -p (log p + H) / tau; with weights on both outputs the two gradients add up
    hidden, targets, weight = make_inputs(6)
    logits = (hidden @ weight).astype(np.float32)
    tau = 0.7
    w_lp = np.linspace(-1.0, 2.0, BATCH * SEQ).reshape(BATCH, SEQ)
    w_h = np.linspace(0.3, -0.8, BATCH * SEQ).reshape(BATCH, SEQ)

    def objective(x):
        lp, h = algorithms.logprobs_from_logits(x, targets, tau)
        return jnp.sum(lp * w_lp) + jnp.sum(h * w_h)

    grad = jax.jit(jax.grad(objective))(logits)
    scaled = logits.astype(np.float64) / tau
    log_p = scaled - scaled.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    p = np.exp(log_p)
    entropy = -(p * log_p).sum(-1, keepdims=True)
    onehot = np.eye(VOCAB)[targets]
    want = (w_lp[..., None] * (onehot - p) - w_h[..., None] * p * (log_p + entropy)) / tau
    np.testing.assert_allclose(grad, want, rtol=RTOL, atol=ATOL)
    # and against differentiating the textbook formula (log_softmax, gather, -sum p log p) in fp32
    def textbook(x):
        lsm = jax.nn.log_softmax(x / tau, axis=-1)
        lp = jnp.take_along_axis(lsm, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(lp * w_lp) + jnp.sum(-jnp.sum(jnp.exp(lsm) * lsm, axis=-1) * w_h)
    np.testing.assert_allclose(grad, jax.grad(textbook)(logits), rtol=RTOL, atol=ATOL)


def test_the_backward_keeps_the_logits_not_an_fp32_log_softmax():
    # what jax.vjp keeps for the backward: the bf16 logits and per-position numbers, nothing of size [B, T, V] in fp32
    hidden, targets, weight = make_inputs(7)
    logits = jnp.asarray(hidden @ weight).astype(jnp.bfloat16)
    _, backward = jax.vjp(lambda x: algorithms.logprobs_from_logits(x, targets, 1.0), logits)
    kept = [x for x in jax.tree.leaves(backward) if hasattr(x, "shape")]
    assert any(x.dtype == jnp.bfloat16 and x.shape == logits.shape for x in kept)
    assert not [x.shape for x in kept if x.dtype == jnp.float32 and x.size >= logits.size], kept
    grad = backward((jnp.ones((BATCH, SEQ)), jnp.ones((BATCH, SEQ))))[0]
    assert grad.dtype == jnp.bfloat16 and grad.shape == logits.shape


def test_a_minus_inf_logit_leaves_values_and_gradients_finite():
    # a token ruled out (logit -inf) has probability 0: it adds nothing to the entropy or the gradients
    hidden, targets, weight = make_inputs(8)
    logits = (hidden @ weight).astype(np.float32)
    logits[..., 7] = -np.inf
    targets = np.where(targets == 7, 8, targets)
    lp, h = jax.jit(algorithms.logprobs_from_logits)(logits, targets)
    want = ref.logprobs_and_entropy(np.delete(logits, 7, axis=-1), np.where(targets > 7, targets - 1, targets))
    np.testing.assert_allclose(lp, want[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(h, want[1], rtol=RTOL, atol=ATOL)
    grad = jax.grad(lambda x: jnp.sum(sum(algorithms.logprobs_from_logits(x, targets))))(logits)
    assert np.isfinite(grad).all() and (np.asarray(grad)[..., 7] == 0).all()


def test_temperature_may_be_traced():
    hidden, targets, weight = make_inputs(9)
    logits = hidden @ weight
    got = jax.jit(lambda x, tau: algorithms.logprobs_from_logits(x, targets, tau))(logits, jnp.float32(0.6))
    for g, w in zip(got, ref.logprobs_and_entropy(logits, targets, 0.6)):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_bf16_logits_are_computed_in_fp32():
    hidden, targets, weight = make_inputs(4)

    def bf16_head(h):
        return (h @ weight).astype(jnp.bfloat16)

    logprobs, entropy = algorithms.token_logprobs_and_entropy(hidden, targets, bf16_head, chunk_size=4)
    assert logprobs.dtype == entropy.dtype == jnp.float32
    rounded = np.asarray(jnp.asarray(hidden @ weight).astype(jnp.bfloat16).astype(jnp.float32))
    want = ref.logprobs_and_entropy(rounded, targets)
    np.testing.assert_allclose(logprobs, want[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(entropy, want[1], rtol=RTOL, atol=ATOL)


def test_bad_chunk_size_is_rejected():
    hidden, targets, weight = make_inputs(5)
    with pytest.raises(ValueError, match="chunk_size must be a positive"):
        algorithms.token_logprobs_and_entropy(
            hidden, targets, functools.partial(project, weight), chunk_size=0
        )


def test_chunking_never_holds_full_sequence_logits():
    # XLA's own buffer accounting of the compiled program: the unchunked forward needs at least the [B, T, V]
    # fp32 logits as scratch; the chunked forward AND backward must stay well under that (the backward only
    # because each chunk's logits are recomputed instead of saved).
    batch, seq_len, embed, vocab = 2, 256, 32, 8192
    full_logits_bytes = batch * seq_len * vocab * 4
    weight = jnp.ones((embed, vocab))
    hidden = jnp.ones((batch, seq_len, embed))
    targets = jnp.zeros((batch, seq_len), jnp.int32)

    def objective(weight, hidden, chunk_size):
        logprobs, entropy = algorithms.token_logprobs_and_entropy(
            hidden, targets, functools.partial(project, weight), chunk_size=chunk_size
        )
        return jnp.sum(logprobs) + jnp.sum(entropy)

    def scratch_bytes(fn):
        return jax.jit(fn).lower(weight, hidden).compile().memory_analysis().temp_size_in_bytes

    assert scratch_bytes(functools.partial(objective, chunk_size=None)) >= full_logits_bytes
    assert scratch_bytes(functools.partial(objective, chunk_size=16)) < full_logits_bytes / 2
    grad = jax.grad(objective, argnums=(0, 1))
    assert scratch_bytes(functools.partial(grad, chunk_size=16)) < full_logits_bytes / 2
