"""Incremental decoding with a preallocated KV cache, for samplers: pure functions on the CausalLM param tree.

The layers are the training model's own modules (`RMSNorm`, `HeadProjection`, `OutProjection`, `MLP`,
`apply_rope`, `dot_product_attention`) applied to the same params, so a token's logits equal those of
`CausalLM.apply` on the whole sequence up to float rounding; only where keys and values come from differs.

Cache: {"k": [L, B, S, K, D], "v": [L, B, S, K, D]}, L layers, B rows (sampler slots), S max length, K kv heads,
D head dim. A row's entry at position p holds the key/value of the token at position p. Entries beyond what a
row has written are stale (earlier occupants, padding) and masked out: a query at position p attends to keys at
positions <= p only, and `extend` writes a token's key/value before any query can attend to it.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from agentfly_jax.models.config import ModelConfig
from agentfly_jax.models.transformer import (
    MLP,
    CausalLM,
    HeadProjection,
    OutProjection,
    RMSNorm,
    apply_rope,
    dot_product_attention,
    rope_inv_freq,
)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> dict:
    """A zero KV cache {"k", "v"}: [layers, batch, max_len, kv_heads, head_dim] in `dtype` (default: compute)."""
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.resolved_head_dim)
    dtype = dtype or config.dtype
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def cache_bytes(config: ModelConfig, batch: int, max_len: int, dtype=None) -> int:
    """Bytes of `init_cache(config, batch, max_len, dtype)`."""
    itemsize = jnp.dtype(dtype or config.dtype).itemsize
    return 2 * config.num_layers * batch * max_len * config.num_kv_heads * config.resolved_head_dim * itemsize


def _norm(c: ModelConfig, params, x):
    return RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype).apply({"params": params}, x)


def _heads(c: ModelConfig, params, x, num_heads: int, head_axis: str):
    proj = HeadProjection(num_heads, c.resolved_head_dim, c.qkv_bias, head_axis, c.dtype, c.param_dtype)
    return proj.apply({"params": params}, x)


def extend(model: CausalLM, params, cache: dict, tokens, positions, *, kv_len: int | None = None):
    """Runs `tokens` [B, T] at `positions` [B, T] against `cache`; returns (hidden [B, T, E], new cache).

    Each token's key/value is written into its row of the cache at its position, then every query attends to
    its row's keys at positions <= its own among the first `kv_len` cache entries (a static bucket, default the
    whole cache; every position in `positions` must be < kv_len). Positions past the cache end are dropped.
    Prefill: a fresh cache, positions 0..T-1 (right padding is harmless: pads sit after the real tokens).
    Decode: T = 1, positions = tokens already in the row.
    """
    c = model.config
    kv_len = cache["k"].shape[2] if kv_len is None else kv_len
    b = tokens.shape[0]
    decoder = params["model"]
    embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.param_dtype)
    x = embed.apply({"params": decoder["embed_tokens"]}, tokens)  # [B, T, E]
    inv_freq = jnp.asarray(rope_inv_freq(c))
    rows = jnp.arange(b)[:, None]  # [B, 1]
    key_positions = jnp.arange(kv_len)
    mask = key_positions[None, None, :] <= positions[:, :, None]  # [B, T, kv_len]
    cache_k, cache_v = cache["k"], cache["v"]
    for i in range(c.num_layers):
        layer = decoder[f"layers_{i}"]
        attn = layer["self_attn"]
        h = _norm(c, layer["input_layernorm"], x)
        q = apply_rope(_heads(c, attn["q_proj"], h, c.num_heads, "heads"), positions, inv_freq)  # [B, T, H, D]
        k = apply_rope(_heads(c, attn["k_proj"], h, c.num_kv_heads, "kv_heads"), positions, inv_freq)  # [B,T,K,D]
        v = _heads(c, attn["v_proj"], h, c.num_kv_heads, "kv_heads")
        cache_k = cache_k.at[i, rows, positions].set(k.astype(cache_k.dtype), mode="drop")
        cache_v = cache_v.at[i, rows, positions].set(v.astype(cache_v.dtype), mode="drop")
        keys = cache_k[i, :, :kv_len].astype(c.dtype)  # [B, kv_len, K, D]
        values = cache_v[i, :, :kv_len].astype(c.dtype)
        out = dot_product_attention(q, keys, values, mask, "xla")  # [B, T, H, D]
        x = x + OutProjection(c.hidden_size, c.dtype, c.param_dtype).apply({"params": attn["o_proj"]}, out)
        x = x + MLP(c).apply({"params": layer["mlp"]}, _norm(c, layer["post_attention_layernorm"], x))
    hidden = _norm(c, decoder["norm"], x)
    return hidden, {"k": cache_k, "v": cache_v}


def logits(model: CausalLM, params, hidden):
    """Logits [..., V] of final hidden states (the model's own head: tied embedding or lm_head)."""
    return model.apply({"params": params}, hidden, method=CausalLM.logits_from_hidden)


def prefill(model: CausalLM, params, tokens, *, cache_dtype=None):
    """Prompt pass on a fresh cache sized to the prompts: tokens [P, T] (right-padded) -> (hidden, cache)."""
    p, t = tokens.shape
    cache = init_cache(model.config, p, t, cache_dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (p, t))
    return extend(model, params, cache, tokens, positions)


def decode_step(model: CausalLM, params, cache: dict, tokens, positions, *, kv_len: int | None = None):
    """One token per row: tokens [B], positions [B] -> (logits [B, V], new cache)."""
    hidden, cache = extend(model, params, cache, tokens[:, None], positions[:, None], kv_len=kv_len)
    return logits(model, params, hidden[:, 0]), cache


def copy_into(cache: dict, prompt_cache: dict, row, slot):
    """Copies row `row` of a prefill cache [L, P, T, K, D] into row `slot` of `cache` (positions 0..T-1)."""
    def put(dst, src):
        piece = jax.lax.dynamic_index_in_dim(src, row, axis=1, keepdims=True).astype(dst.dtype)  # [L, 1, T, K, D]
        return jax.lax.dynamic_update_slice(dst, piece, (0, slot, 0, 0, 0))
    return {"k": put(cache["k"], prompt_cache["k"]), "v": put(cache["v"], prompt_cache["v"])}
