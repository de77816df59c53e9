"""Pure-functional Flax (linen) decoder for the Qwen2/Qwen2.5 and Llama 3 families, and its value model.

Every parameter carries logical axis names (see `models/sharding.py` for the mapping to mesh axes):
  vocab, embed, heads, kv_heads, head_dim, mlp, norm, value_out.
Activations are constrained with act_batch, act_length, act_embed, act_heads, act_kv_heads, act_mlp, act_vocab,
by the same rules and divisibility test as the parameters they meet (`sharding.constrain`); attention's rows with
act_attn_batch where the mesh cannot split its heads (`sharding.fully_split`), the residual stream's with
act_residual_batch and the tensor-parallel GEMMs' input with act_gemm_batch (sequence parallelism, `_reshard`).

Shapes in comments: B batch, T query length, S key length, H query heads, K kv heads, G = H // K, D head dim,
E hidden size, V vocab, F intermediate size.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from agentfly_jax.models.config import ModelConfig, jit_run_once
from agentfly_jax.models.sharding import (
    active_shards,
    batch_name,
    constrain,
    fully_split,
    rows_beyond_batch,
    spec_for_shape,
)

_KERNEL_INIT = nn.initializers.normal(stddev=0.02)


def _param_init(init, names):
    return nn.with_logical_partitioning(init, names)


def _constrain(x, names):
    # A no-op unless logical axis rules and a mesh are active (see sharding.axis_rules); then it pins activation
    # layouts, agreeing with the weights', so GSPMD gathers FSDP weights instead of re-sharding activations.
    return constrain(x, names)


_IN_USE = {"embed": "act_embed", "mlp": "act_mlp", "heads": "act_heads", "kv_heads": "act_kv_heads",
           "vocab": "act_vocab"}


def _gemm_kernel(kernel, names):
    """A tensor-parallel GEMM's kernel under sequence parallelism (`act_residual_batch` or `act_gemm_batch`
    beyond the batch's axes): pinned to its layout in use (gathered over fsdp, split over tensor as the
    activations it meets). Otherwise the partitioner chose to keep the kernel split over fsdp and gather the
    activations over fsdp instead, all of the batch's rows (fsdp 2 x tensor 2: the MLP's hidden states and the
    attention output of both fsdp shards on every device), or, with the GEMM's input on the residual's rows, to
    split the GEMM over its contracting dim and replicate the input. Otherwise the kernel as it is."""
    if not (rows_beyond_batch("act_residual_batch") or rows_beyond_batch("act_gemm_batch")):
        return kernel
    return _constrain(kernel, tuple(_IN_USE.get(n) for n in names))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _reshard(x, names, grad_names):
    """`x` constrained to the layout of `names`, its gradient to that of `grad_names`: the conjugate pair of
    Megatron's sequence parallelism, which the plain transpose of a constraint (the same layout both ways) is not.
    Into a sublayer, the residual's rows are all-gathered and the gradient reduce-scattered back; out of it, the
    partial sums are reduce-scattered to the residual's rows and the gradient all-gathered. Where both names give
    one layout (no `act_residual_batch` rule, tensor=1) it is a plain constraint."""
    return _constrain(x, names)


def _reshard_fwd(x, names, grad_names):
    return _constrain(x, names), None


def _reshard_bwd(names, grad_names, _, g):
    return (_constrain(g, grad_names),)


_reshard.defvjp(_reshard_fwd, _reshard_bwd)


def _residual():
    """Logical names of the residual stream [B, T, E] between sublayers (`act_residual_batch`: see sharding.py)."""
    return batch_name("act_residual_batch"), "act_length", "act_embed"


def head_input(hidden):
    """Final hidden states [B, T, E] into the output head (vocabulary split over `tensor`): every row of the tensor
    group, the gradient back to the residual's rows (a reduce-scatter with sequence parallelism, see `_reshard`)."""
    return _reshard(hidden, ("act_batch", "act_length", "act_embed"), _residual())


def kv_repeats(num_heads: int, num_kv_heads: int) -> int:
    """How many times each kv head is computed so that k and v split over the active mesh like the H queries.

    Where the mesh cuts the query heads into more pieces than the K kv heads can be cut into (tensor=4 with 2 kv
    heads), the k/v projections compute every kv head r times in a row (their kernels repeated, Megatron's
    replicated kv heads): head j of the K*r serves queries j*G/r .. (j+1)*G/r - 1, exactly the queries of its
    original head, so each device computes the kv heads its own queries read, and q, k, v share one layout
    (cuDNN's fused attention requires that). 1 without a mesh, or where K splits as far as H.
    """
    shards = active_shards("act_heads", num_heads)
    return shards // math.gcd(num_kv_heads, shards)


# ----------------------------------------------------------------------------------------- rotary embedding
def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [D/2] (float64 math, returned as float32), with `linear` or `llama3` scaling."""
    d = config.resolved_head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return np.asarray(inv_freq, dtype=np.float32)


def apply_rope(x, positions, inv_freq, mrope_section=None):
    """Rotates x [B, T, N, D] by positions [B, T] (half-split convention of HF Qwen2/Llama).

    mRoPE (Qwen2-VL, `mrope_section` = three sizes summing to D/2): positions are [3, B, T] (temporal, height,
    width) and frequency i turns with the axis whose section holds i. Equal positions on the three axes (text)
    give the ordinary rotation.
    """
    if mrope_section is None:
        freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    else:
        axis_of_freq = np.repeat(np.arange(3), mrope_section)  # [D/2]
        per_freq = jnp.moveaxis(positions, 0, -1)[..., axis_of_freq]  # [B, T, D/2]
        freqs = per_freq.astype(jnp.float32) * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------------------------- masks
def attention_mask(segment_ids, query_len: int | None = None):
    """Causal mask within segments: [B, T, T] bool, True where query t may attend to key s.

    segment_ids [B, T]: tokens attend only to earlier tokens of the same segment id (packing); padding
    should use its own id (e.g. 0) so it never mixes with real tokens.
    """
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same


def resolve_attention_impl(impl: str, dtype) -> str:
    """"auto" picks cuDNN's fused attention on GPU for 16-bit compute, else the einsum path."""
    if impl != "auto":
        return impl
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if half and jax.default_backend() == "gpu" else "xla"


def packed_segment_bound(config: ModelConfig) -> int:
    """The runs of segment ids a row may hold for cuDNN's packed-sequence layout under `config`: its
    `attention_segments` where the attention is cuDNN's, else 0 (the dense mask, or the einsum path)."""
    if config.attention_segments and resolve_attention_impl(config.attention_impl, config.dtype) == "cudnn":
        return config.attention_segments
    return 0


def segment_layout(segment_ids, max_segments: int):
    """cuDNN's packed-sequence description of rows [B, T] of segment ids: each row's runs of equal ids (a segment,
    the padding's run included) -> (lengths [B, M], starts [B, M + 1]) int32, M = `max_segments`, entries past a
    row's last run -1 (cuDNN's filler), and the largest number of runs in a row (a row with more than M cannot be
    described: the caller must not use the layout then)."""
    b, t = segment_ids.shape
    seg = jnp.asarray(segment_ids, jnp.int32)
    starts = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # [B, T]: the run each position belongs to
    runs = run[:, -1] + 1
    lengths = jnp.sum(run[:, :, None] == jnp.arange(max_segments, dtype=jnp.int32), axis=1, dtype=jnp.int32)
    live = jnp.arange(max_segments) < runs[:, None]
    offsets = jnp.cumsum(lengths, axis=1, dtype=jnp.int32) - lengths
    lengths = jnp.where(live, lengths, -1)
    offsets = jnp.concatenate([jnp.where(live, offsets, -1), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return lengths, offsets, jnp.max(runs)


@flax.struct.dataclass
class SegmentMask:
    """A packed batch's segment ids [B, T], passed to the layers in place of their [B, T, T] mask where cuDNN
    reads them as its packed-sequence layout (`ModelConfig.attention_segments`)."""

    segment_ids: jax.Array
    max_segments: int = flax.struct.field(pytree_node=False)


def packed_bounds(max_segments: int) -> tuple[int, ...]:
    """The bounds a batch's packed layout is described with, smallest first: 2 (a row holding one sequence and
    its padding) and `max_segments`. A batch takes the smallest that holds its rows' runs: cuDNN's backward sizes a
    workspace, zeroed on every call, and part of its work by the bound, used or not (at Qwen2.5-3B's heads on an
    H200, 0.25 ms of zeroing a layer at 8 against 0.04 at 1). Each bound is a cuDNN call of its own to compile
    (at 3B, four bounds took the step's compilation from about 50 to 93 s), hence two."""
    return tuple(sorted({min(2, max_segments), max_segments}))


def _packed_kernel(q, k, v, lengths, offsets):
    """cuDNN's fused attention over packed segments (`segment_layout`'s lengths and starts), causal within each."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention
    return cudnn_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
                           scale=q.shape[-1] ** -0.5, mask_type=MaskType.PADDING_CAUSAL)


def _dense_kernel(q, k, v, mask):
    """cuDNN's fused attention with a [B, T, S] boolean mask (read as a dense bias)."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="cudnn")


def _cudnn_packed(q, k, v, segment_ids, max_segments: int, rows: str = "act_batch"):
    """Causal attention within each run of `segment_ids` through cuDNN's packed-sequence layout (each row's
    segments as starts and lengths): blocks across segments and above the diagonal are skipped, and no [B, T, T]
    bias is read or differentiated. The layout is described with the smallest of `packed_bounds(max_segments)`
    that holds the batch's fullest row (cuDNN's work and backward workspace grow with the bound, used or not); a
    batch with a row of more than `max_segments` runs takes the dense-mask kernel instead (`lax.switch`: the same
    result, at the dense path's cost). A bound above the row length is lowered to it (a row of T tokens has at
    most T runs).

    Under a mesh (active logical rules), each device runs the kernel on its own rows (`rows`, the name the
    queries' rows take) and heads, through `shard_map`: attention is independent across rows and heads, and
    XLA's partitioner of the packed kernel otherwise gathered q, k and v to every device (measured on 2 GPUs:
    8-9 more all-gathers a layer and 67-78% weak-scaling efficiency against 83-90% with the dense mask). Each
    device then also takes the dense fallback on its own rows' run counts only."""
    bounds = packed_bounds(min(max_segments, segment_ids.shape[1]))

    def local(q, k, v, segment_ids):
        def packed(bound):
            return lambda q, k, v: _packed_kernel(q, k, v, *segment_layout(segment_ids, bound)[:2])

        runs = segment_layout(segment_ids, bounds[-1])[2]  # the count alone: XLA drops the unused layout
        smallest = sum((runs > b).astype(jnp.int32) for b in bounds)  # len(bounds): more runs than any bound
        return jax.lax.switch(smallest, [*map(packed, bounds),
                                         lambda q, k, v: _dense_kernel(q, k, v, attention_mask(segment_ids))],
                              q, k, v)

    mesh, rules = jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules()
    if mesh.empty or not rules or getattr(mesh, "manual_axes", ()):
        return local(q, k, v, segment_ids)
    # the sequence whole on every device (a split length is gathered into the call), rows and heads split
    q_spec = spec_for_shape(P(rows, None, "act_heads", None), q.shape, mesh, rules)
    kv_spec = spec_for_shape(P(rows, None, "act_kv_heads", None), k.shape, mesh, rules)
    if q_spec[0] != kv_spec[0]:
        raise ValueError(f"packed attention: queries' rows split as {q_spec[0]}, keys' as {kv_spec[0]}")
    if all(axes is None for axes in (*q_spec, *kv_spec)):
        return local(q, k, v, segment_ids)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[0], None)),
                         out_specs=q_spec, check_vma=False)(q, k, v, segment_ids)


def dot_product_attention(q, k, v, mask, impl: str = "xla", rows: str = "act_batch"):
    """Grouped-query attention. q [B,T,H,D], k/v [B,S,K,D] -> [B,T,H,D]; mask [B,T,S] bool, None (= causal), or
    `SegmentMask` (causal within each row's runs of equal segment ids: cuDNN's packed layout, else their mask).
    rows: the logical name of the queries' rows under a mesh (the packed layout runs per shard)."""
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    if isinstance(mask, SegmentMask):
        if resolve_attention_impl(impl, q.dtype) == "cudnn":
            return _cudnn_packed(q, k, v, mask.segment_ids, mask.max_segments, rows)
        mask = attention_mask(mask.segment_ids)
    if resolve_attention_impl(impl, q.dtype) == "cudnn":
        if mask is None:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return _dense_kernel(q, k, v, mask)
    if mask is None:
        mask = jnp.tril(jnp.ones((t, k.shape[1]), dtype=bool))[None]
    q = q.reshape(b, t, kv_heads, h // kv_heads, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # fp32 softmax, as HF eager attention
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d)


# ----------------------------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", _param_init(nn.initializers.ones, ("norm",)), (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * y.astype(self.dtype)


def _lora_delta(module: nn.Module, x, in_names: tuple, out_names: tuple, out_shape: tuple, rank: int, scale: float):
    """scale * (x A) B for a projection from x's trailing `len(in_names)` axes to `out_shape`: adapters `lora_a`
    [*in, r] (uniform +-1/sqrt(fan_in)) and `lora_b` [r, *out] (zeros), logical axes in_names + ("lora",) and
    ("lora",) + out_names (see models/lora.py)."""
    n_in = len(in_names)
    in_shape = x.shape[-n_in:]
    fan_in = math.prod(in_shape)
    a_init = nn.initializers.uniform(scale=2.0 / math.sqrt(fan_in))  # [0, 2/sqrt(fan_in)), shifted below
    lora_a = module.param("lora_a", _param_init(lambda k, s, d: a_init(k, s, d) - 1.0 / math.sqrt(fan_in),
                                                (*in_names, "lora")), (*in_shape, rank), module.param_dtype)
    lora_b = module.param("lora_b", _param_init(nn.initializers.zeros, ("lora", *out_names)),
                          (rank, *out_shape), module.param_dtype)
    low = jnp.tensordot(x.astype(module.dtype), lora_a.astype(module.dtype), axes=n_in)  # [..., r]
    return scale * jnp.tensordot(low, lora_b.astype(module.dtype), axes=1)


class HeadProjection(nn.Module):
    """x [B, T, E] -> [B, T, N, D] (q/k/v), kernel [E, N, D] (+ bias [N, D]; + LoRA adapters with lora_rank).

    Written out rather than nn.DenseGeneral: DenseGeneral initialises a flat kernel and reshapes it, which
    breaks logical sharding constraints on the kernel when axis rules are active.
    """

    num_heads: int
    head_dim: int
    use_bias: bool
    head_axis: str
    dtype: Any
    param_dtype: Any
    lora_rank: int = 0
    lora_scale: float = 0.0
    repeats: int = 1  # output heads per stored head, in a row: N * repeats of them (see kv_repeats)

    @nn.compact
    def __call__(self, x):
        shape = (x.shape[-1], self.num_heads, self.head_dim)
        kernel = self.param("kernel", _param_init(_KERNEL_INIT, ("embed", self.head_axis, "head_dim")),
                            shape, self.param_dtype)

        def per_output_head(w, axis):
            return w if self.repeats == 1 else jnp.repeat(w, self.repeats, axis=axis)

        kernel = _gemm_kernel(kernel, ("embed", self.head_axis, "head_dim"))
        y = jnp.einsum("bte,end->btnd", x.astype(self.dtype), per_output_head(kernel.astype(self.dtype), 1))
        if self.lora_rank:
            y = y + per_output_head(_lora_delta(self, x, ("embed",), (self.head_axis, "head_dim"), shape[1:],
                                                self.lora_rank, self.lora_scale), 2)
        if self.use_bias:
            bias = self.param("bias", _param_init(nn.initializers.zeros, (self.head_axis, "head_dim")),
                              shape[1:], self.param_dtype)
            y = y + per_output_head(bias.astype(self.dtype), 0)
        return y


class OutProjection(nn.Module):
    """[B, T, H, D] -> [B, T, E], kernel [H, D, E] (+ LoRA adapters with lora_rank)."""

    features: int
    dtype: Any
    param_dtype: Any
    lora_rank: int = 0
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", _param_init(_KERNEL_INIT, ("heads", "head_dim", "embed")),
                            (*x.shape[-2:], self.features), self.param_dtype)
        y = jnp.einsum("btnd,nde->bte", x.astype(self.dtype),
                       _gemm_kernel(kernel, ("heads", "head_dim", "embed")).astype(self.dtype))
        if self.lora_rank:
            y = y + _lora_delta(self, x, ("heads", "head_dim"), ("embed",), (self.features,), self.lora_rank,
                                self.lora_scale)
        return y


class Linear(nn.Module):
    """x [..., in] -> [..., out], kernel [in, out] with logical axes `names` (nn.Dense without bias, plus LoRA
    adapters with lora_rank)."""

    features: int
    names: tuple
    dtype: Any
    param_dtype: Any
    lora_rank: int = 0
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", _param_init(_KERNEL_INIT, self.names), (x.shape[-1], self.features),
                            self.param_dtype)
        y = jax.lax.dot_general(x.astype(self.dtype), _gemm_kernel(kernel, self.names).astype(self.dtype),
                                (((x.ndim - 1,), (0,)), ((), ())))
        if self.lora_rank:
            y = y + _lora_delta(self, x, self.names[:1], self.names[1:], (self.features,), self.lora_rank,
                                self.lora_scale)
        return y


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions, mask):  # x [B, T, E]
        c = self.config
        d = c.resolved_head_dim

        def proj(n_heads, head_axis, name, repeats=1):
            return HeadProjection(n_heads, d, c.qkv_bias, head_axis, c.dtype, c.param_dtype, c.lora_on(name),
                                  c.lora_scale, repeats, name=name)(x)

        repeats = kv_repeats(c.num_heads, c.num_kv_heads)  # 1 but where the mesh splits queries further
        # Split heads, Megatron's pair (`_reshard`): the input gathered to all rows, the gradient reduce-scattered
        # back; the output's partial sums reduced to the residual's rows. Heads that the mesh cannot split (14 on
        # tensor=4) stay whole and the rows split instead: the input is this device's share of the rows (left to
        # the partitioner both ways: a slice, and a gather back), o_proj runs on it, the output is gathered.
        split_heads = fully_split("act_heads", c.num_heads)
        rows = "act_batch" if split_heads else batch_name("act_attn_batch")
        share = (batch_name("act_gemm_batch") if split_heads else rows, "act_length", "act_embed")
        x = _reshard(x, share, _residual() if split_heads else share)
        if mask is not None and not split_heads:  # the mask's rows go with the queries' (cuDNN needs that)
            mask = jax.tree.map(lambda m: _constrain(m, (rows, "act_length", None)[:m.ndim]), mask)
        q = proj(c.num_heads, "heads", "q_proj")  # [B, T, H, D]
        k = proj(c.num_kv_heads, "kv_heads", "k_proj", repeats)  # [B, T, K * repeats, D]
        v = proj(c.num_kv_heads, "kv_heads", "v_proj", repeats)
        inv_freq = jnp.asarray(rope_inv_freq(c))
        q, k = apply_rope(q, positions, inv_freq, c.mrope_section), apply_rope(k, positions, inv_freq, c.mrope_section)
        q = _constrain(q, (rows, "act_length", "act_heads", None))
        k = _constrain(k, (rows, "act_length", "act_kv_heads", None))
        v = _constrain(v, (rows, "act_length", "act_kv_heads", None))
        out = dot_product_attention(q, k, v, mask, c.attention_impl, rows)  # [B, T, H, D]
        out = _constrain(out, (rows, "act_length", "act_heads", None))
        out = OutProjection(c.hidden_size, c.dtype, c.param_dtype, c.lora_on("o_proj"), c.lora_scale,
                            name="o_proj")(out)
        if split_heads:
            return _reshard(out, _residual(), share)
        return _constrain(_constrain(out, share), _residual())


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        rows = (batch_name("act_gemm_batch"), "act_length", "act_embed")
        x = _reshard(x, rows, _residual())  # every row of the tensor group into the column-parallel GEMMs

        def dense(features, names, name):
            return Linear(features, names, c.dtype, c.param_dtype, c.lora_on(name), c.lora_scale, name=name)

        names = ("act_batch", "act_length", "act_mlp")
        gate = _constrain(dense(c.intermediate_size, ("embed", "mlp"), "gate_proj")(x), names)
        up = _constrain(dense(c.intermediate_size, ("embed", "mlp"), "up_proj")(x), names)
        hidden = _constrain(nn.silu(gate) * up, names)
        return _reshard(dense(c.hidden_size, ("mlp", "embed"), "down_proj")(hidden), _residual(), rows)


class DecoderLayer(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions, mask):
        c = self.config
        norm = lambda name: RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype, name=name)  # noqa: E731
        x = x + Attention(c, name="self_attn")(norm("input_layernorm")(x), positions, mask)
        x = _constrain(x, _residual())
        x = x + MLP(c, name="mlp")(norm("post_attention_layernorm")(x))
        return _constrain(x, _residual())


class Decoder(nn.Module):
    """Embedding + layers + final norm; returns the final hidden states [B, T, E]."""

    config: ModelConfig

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.param_dtype,
            embedding_init=_param_init(_KERNEL_INIT, ("vocab", "embed")))
        layer_cls = nn.remat(DecoderLayer) if c.remat else DecoderLayer
        self.layers = [layer_cls(c, name=f"layers_{i}") for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, c.dtype, c.param_dtype)

    def __call__(self, input_ids, positions=None, segment_ids=None):
        """input_ids [B, T] int; positions [B, T] (default 0..T-1); segment_ids [B, T] for packed sequences."""
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
        return self.from_embeddings(self.embed(input_ids), positions, segment_ids)

    def embed(self, input_ids):
        """Token embeddings [B, T, E] (nn.Embed's lookup, written out to place the table).

        The table is gathered over its embed dim first, as FSDP gathers every other weight before use, so each
        device looks up its own rows (where `tensor` splits the vocab: a masked lookup and an all-reduce over
        `tensor`). Left to itself, the partitioner gathered every device's tokens, looked the whole batch up
        everywhere and moved the result back with an all-reduce and an all-to-all of full-batch activations.
        """
        if not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
        table = _constrain(self.embed_tokens.embedding, ("vocab", None)).astype(self.config.dtype)
        return _constrain(jnp.take(table, input_ids, axis=0), _residual())

    def from_embeddings(self, x, positions, segment_ids=None):
        """The layers and final norm on input embeddings x [B, T, E] (a multimodal model merges image features
        into them first); positions [B, T], or [3, B, T] with mRoPE."""
        c = self.config
        bound = packed_segment_bound(c)
        if segment_ids is None:
            mask = None
        elif bound:
            mask = SegmentMask(_constrain(segment_ids, ("act_batch", "act_length")), bound)
        else:
            mask = _constrain(attention_mask(segment_ids), ("act_batch", "act_length", None))
        x = _constrain(x, _residual())
        n = c.layer_row_splits
        if n == 1 or x.shape[0] % n:  # a schedule, not a result: rows it does not divide (init's one) run whole
            for layer in self.layers:
                x = layer(x, positions, mask)
            return self.norm(x)
        row_axis = positions.ndim - 2  # positions [B, T] or mRoPE's [3, B, T]
        xs, ps = _row_groups(x, n, 0), _row_groups(positions, n, row_axis)
        ms = [None] * n if mask is None else [jax.tree.map(lambda m, j=j: _row_groups(m, n, 0)[j], mask)
                                              for j in range(n)]
        for layer in self.layers:  # the groups share no data within a layer: XLA may interleave them
            xs = [_constrain(layer(xi, pi, mi), _residual()) for xi, pi, mi in zip(xs, ps, ms)]
        return self.norm(_constrain(_join_rows(xs, 0), _residual()))

    def attend(self, hidden):
        """Logits against the (tied) embedding table, as nn.Embed.attend computes them; the table pinned to its
        layout in use under sequence parallelism (`_gemm_kernel`)."""
        table = _gemm_kernel(self.embed_tokens.embedding, ("vocab", "embed"))
        dtype = self.config.dtype
        return jnp.dot(hidden.astype(dtype), table.astype(dtype).T)


def _row_groups(a, n: int, axis: int) -> list:
    """`n` groups of `a`'s rows along `axis`, group j holding rows j, j + n, j + 2n, ...: a device holding a
    contiguous block of rows (divisible by n) holds its share of every group, so the split moves no data."""
    shape = a.shape
    a = a.reshape(*shape[:axis], shape[axis] // n, n, *shape[axis + 1:])
    return [jax.lax.index_in_dim(a, j, axis + 1, keepdims=False) for j in range(n)]


def _join_rows(groups: list, axis: int):
    """Inverse of `_row_groups`."""
    a = jnp.stack(groups, axis=axis + 1)
    shape = a.shape
    return a.reshape(*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2:])


class CausalLM(nn.Module):
    """The policy: `apply({"params": p}, input_ids, positions=None, segment_ids=None) -> logits [B, T, V]`.

    `method=CausalLM.hidden_states` and `method=CausalLM.logits_from_hidden` split the call, so losses can
    compute log-probabilities in sequence chunks without materialising all logits at once.
    """

    config: ModelConfig

    def setup(self):
        c = self.config
        self.model = Decoder(c)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.vocab_size, ("embed", "vocab"), c.dtype, c.param_dtype)  # nn.Dense's params

    def hidden_states(self, input_ids, positions=None, segment_ids=None):
        return self.model(input_ids, positions, segment_ids)

    def logits_from_hidden(self, hidden):
        hidden = head_input(hidden)
        logits = self.model.attend(hidden) if self.config.tie_word_embeddings else self.lm_head(hidden)
        return _constrain(logits, ("act_batch", "act_length", "act_vocab"))

    def __call__(self, input_ids, positions=None, segment_ids=None):
        return self.logits_from_hidden(self.hidden_states(input_ids, positions, segment_ids))


class ValueModel(nn.Module):
    """The critic: the same trunk with a scalar head. `apply(...) -> values [B, T]` in float32."""

    config: ModelConfig

    def setup(self):
        c = self.config
        self.model = Decoder(c)
        self.value_head = nn.Dense(1, use_bias=True, dtype=jnp.float32, param_dtype=c.param_dtype,
                                   kernel_init=_param_init(nn.initializers.zeros, ("embed", "value_out")),
                                   bias_init=_param_init(nn.initializers.zeros, ("value_out",)))

    def __call__(self, input_ids, positions=None, segment_ids=None):
        hidden = self.model(input_ids, positions, segment_ids)
        return self.value_head(hidden.astype(jnp.float32))[..., 0]


def init_params(model: nn.Module, rng, seq_len: int = 8):
    """Random parameters (unboxed) for `model`; used for fresh models and as shape templates."""
    dummy = jnp.zeros((1, seq_len), jnp.int32)
    return nn.unbox(jit_run_once(model.init, rng, dummy))["params"]


def init_params_shapes(model: nn.Module, seq_len: int = 8):
    """ShapeDtypeStruct tree of `model`'s parameters (computed abstractly, no allocation)."""
    dummy = jnp.zeros((1, seq_len), jnp.int32)
    return nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), dummy))["params"]


def logical_axes(model: nn.Module, seq_len: int = 8):
    """PartitionSpec tree of logical axis names, matching `params` (computed abstractly, no allocation)."""
    dummy = jnp.zeros((1, seq_len), jnp.int32)
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), dummy)
    return nn.get_partition_spec(boxed)["params"]
