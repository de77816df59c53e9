"""Incremental decoding with a preallocated KV cache, for samplers: pure functions on the CausalLM param tree.

The layers are the training model's own modules (`RMSNorm`, `HeadProjection`, `OutProjection`, `MLP`,
`apply_rope`; attention is the model's einsum path written for the cache's layout) applied to the same params,
so a token's logits equal those of `CausalLM.apply` on the whole sequence up to float rounding; only where keys
and values come from differs.

Qwen2.5-VL (`Qwen2_5_VLCausalLM`, whose params hold the same decoder tree under "model") decodes with the same
functions: its prompt pass runs on the model's own `embed` (image features merged into the token embeddings)
with the mRoPE positions [3, B, T] of `qwen2_5_vl.mrope_positions`, and each later token turns by its cache
index plus a per-row offset (the prompt's largest position + 1 - its length; 0 for text), the same on all three
axes, which is the ordinary rotation (`rope_positions`). A cache index and a rotary position are kept apart
for that reason: the first says where a key lives and what a query may see, the second how it is rotated.

Cache: {"k": (L buffers [B, K, S, D]), "v": (the same)}: one buffer per layer (a layer's keys are a whole buffer,
never a slice of a bigger one, so a kernel reads them in place), B rows (sampler slots), K kv heads, S max length,
D head dim; each kv head's keys are contiguous. A row's entry at position p holds the key/value of the token at
position p. Entries beyond what a row has written are stale (earlier occupants, padding) and masked out: a query
at position p attends to keys at positions <= p only, and `extend` writes a token's key/value before any query
can attend to it.

Attention over the cache (`attention=`): "xla" (einsum over the first kv_len positions, fp32 softmax: every
platform) or "pallas" (decode steps only, T = 1, one device: jax's Pallas GPU decode-attention kernel, split over
the sequence, reading each row's keys up to its own length and nothing past it; "pallas_interpret" runs the same
kernel through the Pallas interpreter, for CPU tests). Prompt passes always take the einsum path.

Tensor parallelism. Traced under a mesh and logical axis rules (`jax.sharding.use_abstract_mesh` and
`sharding.axis_rules`, as the sampler's programs are on a mesh), the activations take the training model's layouts
(`sharding.constrain`): q heads, kv heads and the MLP's hidden units split over `tensor`, the residual stream
replicated (so XLA all-reduces after o_proj and down_proj, as in Megatron), and each cache buffer its kv heads
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
    Linear,
    OutProjection,
    RMSNorm,
    apply_rope,
    kv_repeats,
    rope_inv_freq,
)

#: logical names of a cache buffer's dimensions [B, K, S, D]: split over kv heads (as the k/v projections)
CACHE_AXES = (None, "act_kv_heads", None, None)
_EMBED_AXES = ("act_batch", "act_length", "act_embed")


def cache_kv_heads(config: ModelConfig) -> int:
    """The cache's kv heads: the model's, each repeated `kv_repeats` times under the active mesh (module doc)."""
    return config.num_kv_heads * kv_repeats(config.num_heads, config.num_kv_heads)


ATTENTIONS = ("xla", "pallas", "pallas_interpret")
# The Pallas decode kernel's tuning: splits of the sequence (where the cache length allows), keys per block and
# warps per program (None: the kernel's default). Benchmarks set them (scripts/bench_decode_attention.py).
PALLAS_SPLITS = 16
PALLAS_BLOCK_K = 128
PALLAS_WARPS = None


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> dict:
    """A zero KV cache {"k", "v"}: per layer a [batch, kv_heads, max_len, head_dim] buffer in `dtype` (default:
    the compute dtype); kv_heads = `cache_kv_heads(config)`."""
    shape = (batch, cache_kv_heads(config), max_len, config.resolved_head_dim)
    dtype = dtype or config.dtype
    return {name: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)) for name in ("k", "v")}


def cache_bytes(config: ModelConfig, batch: int, max_len: int, dtype=None) -> int:
    """Bytes of `init_cache(config, batch, max_len, dtype)` without a mesh (the model's kv heads)."""
    itemsize = jnp.dtype(dtype or config.dtype).itemsize
    return 2 * config.num_layers * batch * max_len * config.num_kv_heads * config.resolved_head_dim * itemsize


def set_pallas_tuning(spec: str) -> None:
    """Sets PALLAS_SPLITS, PALLAS_BLOCK_K and PALLAS_WARPS from "splits,block_k,warps" (warps 0: the kernel's
    default), powers of two; programs traced afterwards use them (benchmarks' --pallas)."""
    global PALLAS_SPLITS, PALLAS_BLOCK_K, PALLAS_WARPS
    try:
        splits, block_k, warps = (int(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"Pallas tuning {spec!r} is not 'splits,block_k,warps' (three integers)") from None
    if any(v < 0 or v & (v - 1) for v in (splits, block_k, warps)) or not splits or block_k < 16:
        raise ValueError(f"Pallas tuning {spec!r}: splits and block_k (>= 16) must be powers of two, warps 0 or a power of two")
    PALLAS_SPLITS, PALLAS_BLOCK_K, PALLAS_WARPS = splits, block_k, warps or None


def pallas_cache_length(max_len: int) -> int:
    """The cache length the Pallas decode kernel takes for rows of up to `max_len` positions: a multiple of 256
    (`_pallas_splits` then cuts it into power-of-two pieces of at least 16 positions, or pieces of 256)."""
    return 256 * -(-max(max_len, 1) // 256)


def _pallas_splits(length: int) -> int:
    """Sequence splits of the Pallas decode kernel over a cache of `length` (a multiple of 256) positions:
    PALLAS_SPLITS when 256 * a power of two (power-of-two pieces of at least 16 positions), else one per 256
    positions."""
    if length % 256:
        raise ValueError(f"the Pallas decode attention needs a cache length that is a multiple of 256, got {length} "
                         "(decode.pallas_cache_length)")
    m = length // 256
    return min(PALLAS_SPLITS, 16 * m) if m & (m - 1) == 0 else m


def cache_length(cache: dict) -> int:
    """Positions per row of `cache`."""
    return cache["k"][0].shape[2]


def _attend(q, keys, values, mask):
    """Grouped-query attention against head-major keys: q [B, T, H, D], keys/values [B, K, S, D], mask [B, T, S]
    -> [B, T, H, D]; scores and softmax in fp32 (as the model's einsum path)."""
    b, t, h, d = q.shape
    k_heads = keys.shape[1]
    q = q.reshape(b, t, k_heads, h // k_heads, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, keys, preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    return jnp.einsum("bkgts,bksd->btkgd", probs, values).reshape(b, t, h, d)


def _attend_pallas(q, keys, values, lengths, interpret: bool):
    """One query per row against its first `lengths` [B] keys: q [B, H, D], keys/values [B, K, S, D] (a whole
    layer buffer, read in place) -> [B, H, D], with jax's Pallas GPU decode-attention kernel."""
    from jax.experimental.pallas.ops.gpu.decode_attention import mqa

    b, h, d = q.shape
    k_heads, s = keys.shape[1], keys.shape[2]
    splits = _pallas_splits(s)
    out = mqa(q.reshape(b * k_heads, h // k_heads, d), keys.reshape(b * k_heads, s, d),
              values.reshape(b * k_heads, s, d), kv_seq_len=jnp.repeat(lengths, k_heads), k_splits=splits,
              block_k=min(PALLAS_BLOCK_K, s // splits), num_warps=PALLAS_WARPS, interpret=interpret)
    return out.reshape(b, h, d)


def _norm(c: ModelConfig, params, x):
    return RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype).apply({"params": params}, x)


def _heads(c: ModelConfig, params, x, num_heads: int, head_axis: str, repeats: int = 1):
    proj = HeadProjection(num_heads, c.resolved_head_dim, c.qkv_bias, head_axis, c.dtype, c.param_dtype,
                          repeats=repeats)
    return proj.apply({"params": params}, x)


# the fused layer params `fuse_projections` writes, in place of the projections they join
FUSED_QKV, FUSED_GATE_UP = "qkv_proj", "gate_up_proj"


def _plain(module_params) -> bool:
    """A projection's params are its kernel (and bias) only: no LoRA adapters, nothing else to apply."""
    return set(module_params) <= {"kernel", "bias"}


def fuse_projections(params, free_parts: bool = False):
    """The param tree with each decoder layer's q/k/v projections joined into one `qkv_proj` (kernel [E, H + 2K,
    D], bias [H + 2K, D]: the heads of q, then k, then v) and its MLP's gate/up into one `gate_up_proj` (kernel
    [E, 2F]: gate's columns, then up's), so a decode step runs two GEMMs where it ran five (the skinny GEMMs of a
    decode step are bound by their launches and waves, not by their arithmetic). `extend` takes either layout,
    layer by layer, with the same result up to the GEMMs' summation order. A layer whose projections carry
    anything but a kernel and bias (LoRA adapters) is left as it is. For one device: under a tensor-parallel
    mesh a joined kernel's head axis would mix q, k and v heads across the shards (the sampler does not fuse
    there). Other entries (embeddings, norms, a vision tower) are shared with `params`, not copied.

    free_parts: delete the arrays a layer's joined kernels were made from as soon as they are made, so that the
    copies cost one layer's projections at a time instead of all of them (a sampler joining the weights of each
    sync; only for arrays that nothing else holds: `params` is unusable afterwards)."""
    decoder = dict(params["model"])
    for name, layer in params["model"].items():
        if not name.startswith("layers_"):
            continue
        attn, mlp = dict(layer["self_attn"]), dict(layer["mlp"])
        parts = [attn.get(k) for k in ("q_proj", "k_proj", "v_proj")]
        if all(p is not None and _plain(p) for p in parts) and len({"bias" in p for p in parts}) == 1:
            fused = {"kernel": jnp.concatenate([p["kernel"] for p in parts], axis=1)}
            if "bias" in parts[0]:
                fused["bias"] = jnp.concatenate([p["bias"] for p in parts], axis=0)
            for k in ("q_proj", "k_proj", "v_proj"):
                del attn[k]
            attn[FUSED_QKV] = fused
            _free(parts, free_parts)
        parts = [mlp.get(k) for k in ("gate_proj", "up_proj")]
        if all(p is not None and set(p) == {"kernel"} for p in parts):
            mlp = {k: v for k, v in mlp.items() if k not in ("gate_proj", "up_proj")}
            mlp[FUSED_GATE_UP] = {"kernel": jnp.concatenate([p["kernel"] for p in parts], axis=1)}
            _free(parts, free_parts)
        decoder[name] = {**layer, "self_attn": attn, "mlp": mlp}
    return {**params, "model": decoder}


def _free(parts, free: bool) -> None:
    """Deletes the device buffers of joined projections (`fuse_projections(free_parts=True)`). Deleting right after
    the dispatch is safe: the runtime reuses a buffer's memory only after the concatenation that reads it."""
    if free:
        for leaf in jax.tree.leaves(parts):
            if isinstance(leaf, jax.Array):
                leaf.delete()


def _fused_qkv(c: ModelConfig, params, x, repeats: int):
    """q [B, T, H, D], k and v [B, T, K, D] from a `qkv_proj` (one GEMM; `fuse_projections`)."""
    if repeats != 1:
        raise ValueError("fused q/k/v projections are for one device; this mesh splits the queries over more "
                         "pieces than the kv heads (decode.fuse_projections)")
    h, k = c.num_heads, c.num_kv_heads
    y = _heads(c, params, x, h + 2 * k, "heads")  # the model's projection, over the joined heads
    return y[:, :, :h], y[:, :, h:h + k], y[:, :, h + k:]


def _mlp(c: ModelConfig, params, x):
    """The MLP of a decoder layer, from its own params or a fused `gate_up_proj` (`fuse_projections`)."""
    if FUSED_GATE_UP not in params:
        return MLP(c).apply({"params": params}, x)
    def dense(features, names, name, inputs):  # the model's own layer (as `MLP` builds it), joined kernel or not
        return Linear(features, names, c.dtype, c.param_dtype).apply({"params": params[name]}, inputs)

    f = c.intermediate_size
    y = dense(2 * f, ("embed", "mlp"), FUSED_GATE_UP, x)
    return dense(c.hidden_size, ("mlp", "embed"), "down_proj", nn.silu(y[..., :f]) * y[..., f:])


def extend(model: CausalLM, params, cache: dict, tokens, positions, *, kv_len: int | None = None,
           rope_positions=None, embeddings=None, cache_rows=None, attention: str = "xla"):
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
    attention: "xla", or "pallas" / "pallas_interpret" for a decode step (T = 1, no cache_rows; see the module
      docstring); a prompt pass always takes "xla".
    """
    c = model.config
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown decode attention {attention!r}; expected one of {ATTENTIONS}")
    kv_len = cache_length(cache) if kv_len is None else kv_len
    fused = attention != "xla" and positions.shape[1] == 1 and cache_rows is None
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
    cache_k = [constrain(buf, CACHE_AXES) for buf in cache["k"]]
    cache_v = [constrain(buf, CACHE_AXES) for buf in cache["v"]]
    repeats = kv_repeats(c.num_heads, c.num_kv_heads)  # 1 but where the mesh splits queries further (module doc)
    if cache_k[0].shape[1] != c.num_kv_heads * repeats:
        raise ValueError(f"the cache has {cache_k[0].shape[1]} kv heads; under the active mesh this model caches "
                         f"{c.num_kv_heads * repeats} (init_cache under the same mesh and axis rules)")
    for i in range(c.num_layers):
        layer = decoder[f"layers_{i}"]
        attn = layer["self_attn"]
        with jax.named_scope("qkv"):
            h = _norm(c, layer["input_layernorm"], x)
            if FUSED_QKV in attn:
                q, k, v = _fused_qkv(c, attn[FUSED_QKV], h, repeats)
            else:
                q = _heads(c, attn["q_proj"], h, c.num_heads, "heads")  # [B, T, H, D]
                k = _heads(c, attn["k_proj"], h, c.num_kv_heads, "kv_heads", repeats)  # [B, T, K * repeats, D]
                v = _heads(c, attn["v_proj"], h, c.num_kv_heads, "kv_heads", repeats)
            q = apply_rope(q, rope_positions, inv_freq, mrope_section)
            k = apply_rope(k, rope_positions, inv_freq, mrope_section)
            q, k, v = (constrain(a, ("act_batch", "act_length", axis, None))
                       for a, axis in ((q, "act_heads"), (k, "act_kv_heads"), (v, "act_kv_heads")))
        with jax.named_scope("cache_write"):  # [B, T] indices around the kv-head axis: values [B, T, K, D]
            cache_k[i] = cache_k[i].at[rows, :, positions].set(k.astype(cache_k[i].dtype), mode="drop")
            cache_v[i] = cache_v[i].at[rows, :, positions].set(v.astype(cache_v[i].dtype), mode="drop")
        with jax.named_scope("attention"):
            if fused:
                out = _attend_pallas(q[:, 0], cache_k[i].astype(c.dtype), cache_v[i].astype(c.dtype),
                                     positions[:, 0] + 1, attention == "pallas_interpret")[:, None]
            else:
                if cache_rows is None:
                    keys = cache_k[i][:, :, :kv_len].astype(c.dtype)  # [B, K, kv_len, D]
                    values = cache_v[i][:, :, :kv_len].astype(c.dtype)
                else:
                    keys = cache_k[i][cache_rows, :, :kv_len].astype(c.dtype)
                    values = cache_v[i][cache_rows, :, :kv_len].astype(c.dtype)
                out = _attend(q, keys, values, mask)  # [B, T, H, D]
            out = constrain(out, ("act_batch", "act_length", "act_heads", None))
        with jax.named_scope("o_proj"):
            x = x + OutProjection(c.hidden_size, c.dtype, c.param_dtype).apply({"params": attn["o_proj"]}, out)
            x = constrain(x, _EMBED_AXES)  # tensor parallel: the all-reduce of o_proj's partial sums
        with jax.named_scope("mlp"):
            x = x + _mlp(c, layer["mlp"], _norm(c, layer["post_attention_layernorm"], x))
            x = constrain(x, _EMBED_AXES)  # ... and of down_proj's
    hidden = _norm(c, decoder["norm"], x)
    return hidden, {"k": tuple(constrain(buf, CACHE_AXES) for buf in cache_k),
                    "v": tuple(constrain(buf, CACHE_AXES) for buf in cache_v)}


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
                rope_positions=None, attention: str = "xla"):
    """One token per row: tokens [B], positions [B] (cache indices) -> (logits [B, V], new cache).
    rope_positions [B]: the rotary position of each row's token (default its cache index). attention: see
    `extend` ("pallas" reads each row's keys up to its position, whatever kv_len)."""
    rope = None if rope_positions is None else rope_positions[:, None]
    hidden, cache = extend(model, params, cache, tokens[:, None], positions[:, None], kv_len=kv_len,
                           rope_positions=rope, attention=attention)
    with jax.named_scope("lm_head"):
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
        return jax.lax.dynamic_update_slice_in_dim(buf, jax.lax.dynamic_slice_in_dim(buf, src, 1, axis=0), dst,
                                                   axis=0)
    return {name: tuple(put(buf) for buf in bufs) for name, bufs in cache.items()}


def copy_into(cache: dict, prompt_cache: dict, row, slot):
    """Copies row `row` of a prefill cache (per layer [P, K, T, D]) into row `slot` of `cache` (positions
    0..T-1)."""
    def put(dst, src):
        piece = jax.lax.dynamic_index_in_dim(src, row, axis=0, keepdims=True).astype(dst.dtype)  # [1, K, T, D]
        return jax.lax.dynamic_update_slice(dst, piece, (slot, 0, 0, 0))
    return {name: tuple(put(d, s) for d, s in zip(cache[name], prompt_cache[name])) for name in ("k", "v")}
