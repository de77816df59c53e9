"""Incremental decoding with a preallocated KV cache, for samplers: pure functions on the CausalLM param tree.

The layers are the training model's own modules (`RMSNorm`, `HeadProjection`, `OutProjection`, `MLP`,
`apply_rope`, `dot_product_attention`) applied to the same params, so a token's logits equal those of
`CausalLM.apply` on the whole sequence up to float rounding; only where keys and values come from differs.

Qwen2.5-VL (`Qwen2_5_VLCausalLM`, whose params hold the same decoder tree under "model") decodes with the same
functions: its prompt pass runs on the model's own `embed` (image features merged into the token embeddings)
with the mRoPE positions [3, B, T] of `qwen2_5_vl.mrope_positions`, and each later token turns by its cache
index plus a per-row offset (the prompt's largest position + 1 - its length; 0 for text), the same on all three
axes, which is the ordinary rotation (`rope_positions`). A cache index and a rotary position are kept apart
for that reason: the first says where a key lives and what a query may see, the second how it is rotated.

Cache: {"k": [L, B, S, K, D], "v": [L, B, S, K, D]}, L layers, B rows (sampler slots), S max length, K kv heads,
D head dim. A row's entry at position p holds the key/value of the token at position p. Entries beyond what a
row has written are stale (earlier occupants, padding) and masked out: a query at position p attends to keys at
positions <= p only, and `extend` writes a token's key/value before any query can attend to it.

Tensor parallelism. Traced under a mesh and logical axis rules (`jax.sharding.use_abstract_mesh` and
`sharding.axis_rules`, as the sampler's programs are on a mesh), the activations take the training model's layouts
(`sharding.constrain`): q heads, kv heads and the MLP's hidden units split over `tensor`, the residual stream
replicated (so XLA all-reduces after o_proj and down_proj, as in Megatron), and the cache its kv heads
(`CACHE_AXES`); dimensions the mesh axis does not divide are replicated. Where the mesh splits the query heads into
more pieces than the K kv heads can be cut into (tensor=4, 2 kv heads), each kv head is computed and cached r times
in a row (`transformer.kv_repeats`, as the training model computes them; the cache then has K * r heads, split
like the queries): each device holds the one kv head its queries read instead of the whole cache. Without a mesh
the constraints do nothing and r = 1.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from agentfly_jax.models.config import ModelConfig
from agentfly_jax.models.sharding import constrain
from agentfly_jax.models.transformer import (
    MLP,
    CausalLM,
    HeadProjection,
    OutProjection,
    RMSNorm,
    apply_rope,
    dot_product_attention,
    kv_repeats,
    rope_inv_freq,
)

#: logical names of the cache's dimensions [L, B, S, K, D]: split over kv heads (as the k/v projections)
CACHE_AXES = (None, None, None, "act_kv_heads", None)
_EMBED_AXES = ("act_batch", "act_length", "act_embed")


def cache_kv_heads(config: ModelConfig) -> int:
    """The cache's kv heads: the model's, each repeated `kv_repeats` times under the active mesh (module doc)."""
    return config.num_kv_heads * kv_repeats(config.num_heads, config.num_kv_heads)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> dict:
    """A zero KV cache {"k", "v"}: [layers, batch, max_len, kv_heads, head_dim] in `dtype` (default: compute);
    kv_heads = `cache_kv_heads(config)`."""
    shape = (config.num_layers, batch, max_len, cache_kv_heads(config), config.resolved_head_dim)
    dtype = dtype or config.dtype
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def cache_bytes(config: ModelConfig, batch: int, max_len: int, dtype=None) -> int:
    """Bytes of `init_cache(config, batch, max_len, dtype)` without a mesh (the model's kv heads)."""
    itemsize = jnp.dtype(dtype or config.dtype).itemsize
    return 2 * config.num_layers * batch * max_len * config.num_kv_heads * config.resolved_head_dim * itemsize


def _norm(c: ModelConfig, params, x):
    return RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype).apply({"params": params}, x)


def _heads(c: ModelConfig, params, x, num_heads: int, head_axis: str, repeats: int = 1):
    proj = HeadProjection(num_heads, c.resolved_head_dim, c.qkv_bias, head_axis, c.dtype, c.param_dtype,
                          repeats=repeats)
    return proj.apply({"params": params}, x)


def extend(model: CausalLM, params, cache: dict, tokens, positions, *, kv_len: int | None = None,
           rope_positions=None, embeddings=None, cache_rows=None):
    """Runs `tokens` [B, T] at `positions` [B, T] against `cache`; returns (hidden [B, T, E], new cache).

    Each token's key/value is written into its row of the cache at its position, then every query attends to
    its row's keys at positions <= its own among the first `kv_len` cache entries (a static bucket, default the
    whole cache; every position in `positions` must be < kv_len). Positions past the cache end are dropped.
    Prefill: a fresh cache, positions 0..T-1 (right padding is harmless: pads sit after the real tokens).
    Decode: T = 1, positions = tokens already in the row.
    rope_positions: what the queries and keys are rotated by, [B, T] or mRoPE [3, B, T] (config.mrope_section);
      default `positions`. embeddings: input embeddings [B, T, E] to run instead of the tokens' own (a
      vision-language prompt with its image features merged in); `tokens` is then not read.
    cache_rows: [B] the cache row each batch row reads and writes (default row b for batch row b): a prompt pass
      that continues rows of a sampler's cache already holding a prefix (positions start past it; the queries
      attend to the prefix's keys as well). Rows must be distinct, except padding rows: they give positions
      >= the cache length, so they write nothing.
    """
    c = model.config
    kv_len = cache["k"].shape[2] if kv_len is None else kv_len
    b = positions.shape[0]
    decoder = params["model"]
    if embeddings is None:
        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.param_dtype)
        x = embed.apply({"params": decoder["embed_tokens"]}, tokens)  # [B, T, E]
    else:
        x = embeddings.astype(c.dtype)
    x = constrain(x, _EMBED_AXES)
    rope_positions = positions if rope_positions is None else rope_positions
    if rope_positions.ndim == 3 and c.mrope_section is None:
        raise ValueError("rope_positions [3, B, T] (mRoPE) need a config with mrope_section (Qwen2.5-VL)")
    mrope_section = c.mrope_section if rope_positions.ndim == 3 else None
    inv_freq = jnp.asarray(rope_inv_freq(c))
    rows = (jnp.arange(b) if cache_rows is None else cache_rows)[:, None]  # [B, 1]
    key_positions = jnp.arange(kv_len)
    mask = key_positions[None, None, :] <= positions[:, :, None]  # [B, T, kv_len]
    cache_k, cache_v = constrain(cache["k"], CACHE_AXES), constrain(cache["v"], CACHE_AXES)
    repeats = kv_repeats(c.num_heads, c.num_kv_heads)  # 1 but where the mesh splits queries further (module doc)
    if cache_k.shape[3] != c.num_kv_heads * repeats:
        raise ValueError(f"the cache has {cache_k.shape[3]} kv heads; under the active mesh this model caches "
                         f"{c.num_kv_heads * repeats} (init_cache under the same mesh and axis rules)")
    for i in range(c.num_layers):
        layer = decoder[f"layers_{i}"]
        attn = layer["self_attn"]
        h = _norm(c, layer["input_layernorm"], x)
        q = _heads(c, attn["q_proj"], h, c.num_heads, "heads")  # [B, T, H, D]
        k = _heads(c, attn["k_proj"], h, c.num_kv_heads, "kv_heads", repeats)  # [B, T, K * repeats, D]
        q = apply_rope(q, rope_positions, inv_freq, mrope_section)
        k = apply_rope(k, rope_positions, inv_freq, mrope_section)
        v = _heads(c, attn["v_proj"], h, c.num_kv_heads, "kv_heads", repeats)
        q, k, v = (constrain(a, ("act_batch", "act_length", axis, None))
                   for a, axis in ((q, "act_heads"), (k, "act_kv_heads"), (v, "act_kv_heads")))
        cache_k = cache_k.at[i, rows, positions].set(k.astype(cache_k.dtype), mode="drop")
        cache_v = cache_v.at[i, rows, positions].set(v.astype(cache_v.dtype), mode="drop")
        if cache_rows is None:
            keys = cache_k[i, :, :kv_len].astype(c.dtype)  # [B, kv_len, K, D]
            values = cache_v[i, :, :kv_len].astype(c.dtype)
        else:
            keys = cache_k[i, cache_rows, :kv_len].astype(c.dtype)
            values = cache_v[i, cache_rows, :kv_len].astype(c.dtype)
        out = dot_product_attention(q, keys, values, mask, "xla")  # [B, T, H, D]
        out = constrain(out, ("act_batch", "act_length", "act_heads", None))
        x = x + OutProjection(c.hidden_size, c.dtype, c.param_dtype).apply({"params": attn["o_proj"]}, out)
        x = constrain(x, _EMBED_AXES)  # tensor parallel: the all-reduce of o_proj's partial sums
        x = x + MLP(c).apply({"params": layer["mlp"]}, _norm(c, layer["post_attention_layernorm"], x))
        x = constrain(x, _EMBED_AXES)  # ... and of down_proj's
    hidden = _norm(c, decoder["norm"], x)
    return hidden, {"k": constrain(cache_k, CACHE_AXES), "v": constrain(cache_v, CACHE_AXES)}


def logits(model: CausalLM, params, hidden):
    """Logits [..., V] of final hidden states (the model's own head: tied embedding or lm_head)."""
    return model.apply({"params": params}, hidden, method=type(model).logits_from_hidden)


def prefill(model: CausalLM, params, tokens, *, cache_dtype=None, rope_positions=None, pixel_values=None,
            vision_layout=None):
    """Prompt pass on a fresh cache sized to the prompts: tokens [P, T] (right-padded) -> (hidden, cache).

    A vision-language model (`Qwen2_5_VLCausalLM`) takes its prompts' images as `pixel_values` [N, patch_dim]
    (every row's images in row order, zero rows after) with their `vision_layout` (a `VisionLayout` over the
    same N patches), merged into the image pad tokens by the model's `embed`, and `rope_positions` [3, P, T]
    (`mrope_positions` of the prompts); without images its prompts are text and need neither.
    """
    p, t = tokens.shape
    cache = init_cache(model.config, p, t, cache_dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (p, t))
    embeddings = None
    if pixel_values is not None:
        if vision_layout is None:
            raise ValueError("prefill with pixel_values needs their vision_layout (qwen2_5_vl.vision_layout)")
        embeddings = model.apply({"params": params}, tokens, pixel_values=pixel_values, vision_layout=vision_layout,
                                 method=type(model).embed)
    return extend(model, params, cache, tokens, positions, rope_positions=rope_positions, embeddings=embeddings)


def decode_step(model: CausalLM, params, cache: dict, tokens, positions, *, kv_len: int | None = None,
                rope_positions=None):
    """One token per row: tokens [B], positions [B] (cache indices) -> (logits [B, V], new cache).
    rope_positions [B]: the rotary position of each row's token (default its cache index)."""
    rope = None if rope_positions is None else rope_positions[:, None]
    hidden, cache = extend(model, params, cache, tokens[:, None], positions[:, None], kv_len=kv_len,
                           rope_positions=rope)
    # [B, 1, V] then the token: the model's logit layout names [batch, length, vocab] (vocab split over tensor)
    return logits(model, params, hidden)[:, 0], cache


def prefill_rows(model: CausalLM, params, cache: dict, tokens, rows, starts, *, kv_len: int) -> dict:
    """Prompt pass continuing rows of `cache`: row r's tokens [T] go to cache row `rows[r]` at positions
    starts[r], starts[r] + 1, ... after the prefix already there (positions < starts[r], which the queries attend
    to). Returns the new cache. kv_len: a static bucket > every real token's position. A padding row has
    starts >= the cache length (writes nothing); tokens after a row's real ones write keys past its prompt,
    which the sampler overwrites before any query may see them."""
    positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    _, cache = extend(model, params, cache, tokens, positions, kv_len=kv_len, cache_rows=rows)
    return cache


def copy_row(cache: dict, src, dst) -> dict:
    """Copies row `src` of `cache` (every layer and position) into row `dst`."""
    def put(buf):
        return jax.lax.dynamic_update_slice_in_dim(buf, jax.lax.dynamic_slice_in_dim(buf, src, 1, axis=1), dst,
                                                   axis=1)
    return {name: put(buf) for name, buf in cache.items()}


def copy_into(cache: dict, prompt_cache: dict, row, slot):
    """Copies row `row` of a prefill cache [L, P, T, K, D] into row `slot` of `cache` (positions 0..T-1)."""
    def put(dst, src):
        piece = jax.lax.dynamic_index_in_dim(src, row, axis=1, keepdims=True).astype(dst.dtype)  # [L, 1, T, K, D]
        return jax.lax.dynamic_update_slice(dst, piece, (0, slot, 0, 0, 0))
    return {"k": put(cache["k"], prompt_cache["k"]), "v": put(cache["v"], prompt_cache["v"])}
