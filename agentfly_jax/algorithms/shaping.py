"""Reward shaping on per-trajectory arrays (pure, jittable): DAPO's overlong penalty."""

from __future__ import annotations

import jax.numpy as jnp


def overlong_penalty(lengths, *, max_len, buffer_len):
    """DAPO's soft overlong punishment for response lengths [B] -> penalties [B] (fp32, in [-1, 0]).

    0 up to `max_len - buffer_len` tokens, then linearly down to -1 at `max_len`, and -1 beyond: a response
    that runs into the length limit is penalised in proportion to how far into the last `buffer_len` tokens it
    went. The trainer adds `penalty_factor` times this to the reward (`rl.overlong_buffer_len`)."""
    if not (isinstance(buffer_len, int) and isinstance(max_len, int)):
        raise TypeError(f"max_len and buffer_len must be ints, got {max_len!r} and {buffer_len!r}")
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    lengths = jnp.asarray(lengths, jnp.float32)
    over = (lengths - (max_len - buffer_len)) / buffer_len  # 0 at the buffer's start, 1 at max_len
    return -jnp.clip(over, 0.0, 1.0)
