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
    """(logprobs [B, T], entropy [B, T]) in fp32 of `targets` under softmax(logits / temperature)."""
    scaled = logits.astype(jnp.float32) / temperature  # [B, T, V]
    log_probs = jax.nn.log_softmax(scaled, axis=-1)  # [B, T, V]
    target_index = targets[..., None].astype(jnp.int32)  # [B, T, 1]
    token_logprobs = jnp.take_along_axis(log_probs, target_index, axis=-1)[..., 0]  # [B, T]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)  # [B, T]
    return token_logprobs, entropy


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
