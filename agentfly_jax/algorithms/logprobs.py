"""Per-token log-probabilities and entropies of sampled tokens, in fp32, optionally chunked over the sequence.

Token alignment: `targets[b, t]` is the token whose probability the logits at position t give (the caller
shifts), so `logprobs[b, t]` lines up with `action_mask[b, t]`.
Shapes: B batch, T sequence, C chunk, E hidden size, V vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


def logprobs_from_logits(logits, targets, temperature=1.0):
    """(logprobs [B, T], entropy [B, T]) in fp32 of `targets` under softmax(logits / temperature).

    One pass over the [.., V] logits forward (max, log-sum-exp, the target's logit, the entropy) and one backward
    (`_logprobs_bwd`): only the logits (in their own dtype) and two fp32 numbers per position are kept for the
    backward, not an fp32 [.., V] log-softmax, and the target's gradient is a compare against the vocabulary
    index, not a scatter. Differentiable in `logits` only.
    """
    return _logprobs_entropy(logits, jnp.asarray(targets, jnp.int32), temperature)


def _scaled(logits, temperature):
    return logits.astype(jnp.float32) / temperature


def _logprobs_fwd(logits, targets, temperature):
    z = _scaled(logits, temperature)  # [.., V]
    top = jnp.max(z, axis=-1)
    shifted = z - top[..., None]  # <= 0
    e = jnp.exp(shifted)
    log_sum = jnp.log(jnp.sum(e, axis=-1))  # [..]
    # entropy = log(sum e) - sum(e * shifted) / sum(e): no large cancellation (both terms are small for a peaked
    # distribution); positions where e underflows to 0 (a -inf logit) add nothing
    weighted = jnp.sum(jnp.where(e > 0, e * shifted, 0.0), axis=-1) / jnp.sum(e, axis=-1)
    entropy = log_sum - weighted
    target = jnp.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0]
    return (target - log_sum, entropy), (logits, targets, temperature, top + log_sum, entropy)


def _logprobs_bwd(residuals, cotangents):
    """d logprob / dz = onehot - p; d entropy / dz = -p (log p + entropy); z = logits / temperature."""
    logits, targets, temperature, lse, entropy = residuals
    g_logprob, g_entropy = cotangents
    log_p = _scaled(logits, temperature) - lse[..., None]
    p = jnp.exp(log_p)
    spread = g_logprob[..., None] + g_entropy[..., None] * (log_p + entropy[..., None])
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    dz = jnp.where(vocab == targets[..., None], g_logprob[..., None], 0.0) - jnp.where(p > 0, p * spread, 0.0)
    return (dz / temperature).astype(logits.dtype), None, None


@jax.custom_vjp
def _logprobs_entropy(logits, targets, temperature):
    return _logprobs_fwd(logits, targets, temperature)[0]


_logprobs_entropy.defvjp(_logprobs_fwd, _logprobs_bwd)


def token_logprobs_and_entropy(
    hidden, targets, logits_fn: Callable, *, temperature=1.0, chunk_size: int | None = None
):
    """(logprobs [B, T], entropy [B, T]) in fp32 from final hidden states [B, T, E] and
    `logits_fn(hidden_chunk [B, C, E]) -> logits [B, C, V]`.

    With `chunk_size`, the sequence is cut into chunks of that many positions (T padded up internally) and
    the fp32 logits of only one chunk exist at a time, in the forward and, thanks to rematerialisation, the
    backward pass; without it the whole sequence goes through `logits_fn` at once. Both give the same values
    and gradients.
    """
    batch, seq_len, _ = hidden.shape
    if chunk_size is None or chunk_size >= seq_len:
        return logprobs_from_logits(logits_fn(hidden), targets, temperature)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of positions, got {chunk_size}")

    num_chunks = -(-seq_len // chunk_size)
    pad = num_chunks * chunk_size - seq_len
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))  # [B, N*C, E]; padded rows are sliced off below
    targets = jnp.pad(targets, ((0, 0), (0, pad)))  # [B, N*C]
    hidden_chunks = hidden.reshape(batch, num_chunks, chunk_size, -1).swapaxes(0, 1)  # [N, B, C, E]
    target_chunks = targets.reshape(batch, num_chunks, chunk_size).swapaxes(0, 1)  # [N, B, C]

    # Without remat the scan would keep every chunk's [B, C, V] softmax as a residual for the backward pass,
    # i.e. materialise the full-sequence logits after all; this recomputes them chunk by chunk instead.
    # (prevent_cse=False is safe under a scan, which already keeps XLA from merging the recomputation away.)
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(chunk):
        hidden_chunk, target_chunk = chunk
        return logprobs_from_logits(logits_fn(hidden_chunk), target_chunk, temperature)  # [B, C] each

    logprobs, entropy = jax.lax.map(one_chunk, (hidden_chunks, target_chunks))  # [N, B, C] each

    def unchunk(x):  # [N, B, C] -> [B, T]
        return x.swapaxes(0, 1).reshape(batch, num_chunks * chunk_size)[:, :seq_len]

    return unchunk(logprobs), unchunk(entropy)
