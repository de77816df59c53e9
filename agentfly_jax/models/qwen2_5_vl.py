"""Qwen2.5-VL in Flax: the vision tower, and the Qwen2 decoder with multimodal rotary positions (mRoPE).

An image reaches the model as the Qwen2-VL processor's flattened patch matrix `pixel_values`
[total_patches, C * temporal_patch * patch * patch] (every image of the batch in order, each image's patches
ordered frame, merged row, merged column, then the spatial_merge_size^2 patches of that merged token) and its
`image_grid_thw` [num_images, 3] in patches. The vision tower embeds each patch with one linear map (the
checkpoint's 3-D convolution, whose stride equals its kernel), runs `depth` pre-norm blocks with 2-D rotary
attention, and the patch merger turns each group of spatial_merge_size^2 patches into one language-model token
embedding. Those embeddings replace the image pad tokens (`VisionConfig.image_token_id`) of `input_ids` in
order, and the decoder runs on the result with 3-D positions [3, B, T] (temporal, height, width): text tokens
advance all three together, an image's tokens take its grid coordinates offset by the position where it starts.

jit: everything that depends on the grid values is computed on the host by pure numpy functions, whose array
outputs go into the jitted apply in place of the grid, so jit specialises only on shapes:
  - `vision_layout(vision_config, grid_thw, num_patches)`: each patch's (row, column) for the 2-D rotary
    embedding and its attention segment for the window blocks and for the full-attention blocks;
  - `mrope_positions(config, input_ids, image_grid_thw, segment_ids)`: the decoder's [3, B, T] positions.
Called with `image_grid_thw` instead (and positions None) outside jit, the model computes both itself.

Attention in the vision tower is masked by those segment ids (a patch attends to the patches of its own window,
or of its own frame in `fullatt_block_indexes`) over all patches of the call at once. transformers instead
permutes patches into window order and attends over contiguous chunks; attention without a causal mask does
not depend on the order of its keys, so the two agree, and no permutation is needed here. The cost is dense in
the total patch count of a call (memory ~ heads x patches^2 per block), so feed a few images per call.

Fixed shapes: pad `pixel_values` with rows of zeros to a bucket of `num_patches` (a multiple of
spatial_merge_size^2; `pad_patches`) and pass the same `num_patches` to `vision_layout`. Padded patches get
segment id 0: they attend only among themselves, never to or from real patches, and their merged outputs come
after the real ones, which the image pad tokens consume in order, so they are never used.

Video inputs (`video_token_id`, `pixel_values_videos`) are not supported.
"""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from agentfly_jax.models.config import ModelConfig, VisionConfig
from agentfly_jax.models.transformer import (
    _KERNEL_INIT,
    Decoder,
    HeadProjection,
    Linear,
    RMSNorm,
    _constrain,
    _param_init,
    dot_product_attention,
    head_input,
)

_VISION_NORM_EPS = 1e-6  # transformers hard-codes it for the vision blocks and the merger


# ------------------------------------------------------------------------------------------ host layout
class VisionLayout(NamedTuple):
    """What the vision tower needs to know about the grids, as arrays over the (padded) patches [P]:

    rotary_positions [P, 2] int32: each patch's row and column in its frame (0 for padding);
    window_segments [P] int32: its attention window, 1.. unique over the call (0 for padding);
    full_segments [P] int32: its frame, 1.. unique over the call (0 for padding).
    """

    rotary_positions: np.ndarray
    window_segments: np.ndarray
    full_segments: np.ndarray


def _check_grid(vision: VisionConfig, grid_thw, what: str = "image_grid_thw") -> np.ndarray:
    grid = np.asarray(grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3 or not np.issubdtype(grid.dtype, np.integer):
        raise ValueError(f"{what} must be an integer array [num_images, 3] of (t, h, w) in patches, got shape "
                         f"{grid.shape} dtype {grid.dtype}")
    m = vision.spatial_merge_size
    if (grid < 1).any() or (grid[:, 1:] % m).any():
        raise ValueError(f"{what} rows must be positive with h and w multiples of spatial_merge_size={m}; got "
                         f"{grid.tolist()} (use the Qwen2-VL image processor with merge_size={m})")
    return grid.astype(np.int64)


def vision_layout(vision: VisionConfig, grid_thw, num_patches: int | None = None) -> VisionLayout:
    """The `VisionLayout` of images with grids `grid_thw` [num_images, 3], padded to `num_patches` patches
    (default: exactly the images' patches; a bucket must be a multiple of spatial_merge_size^2)."""
    grid = _check_grid(vision, grid_thw)
    m, ws = vision.spatial_merge_size, vision.window_merged
    rotary, windows, frames = [], [], []
    n_windows = n_frames = 0
    for t, h, w in grid:
        hm, wm = h // m, w // m
        # the processor's patch order: frame, merged row, merged column, row and column inside the merged token
        tt, hb, wb, mh, mw = np.meshgrid(np.arange(t), np.arange(hm), np.arange(wm), np.arange(m), np.arange(m),
                                         indexing="ij")
        rotary.append(np.stack([hb * m + mh, wb * m + mw], axis=-1).reshape(-1, 2))
        # windows tile each frame in squares of ws x ws merged tokens, the last row/column of windows cut short
        win_h, win_w = -(-hm // ws), -(-wm // ws)
        window = (tt * win_h + hb // ws) * win_w + wb // ws
        windows.append(window.reshape(-1) + n_windows + 1)
        frames.append(tt.reshape(-1) + n_frames + 1)
        n_windows += t * win_h * win_w
        n_frames += t
    total = int(sum(int(t * h * w) for t, h, w in grid))
    num_patches = total if num_patches is None else int(num_patches)
    if num_patches < total or num_patches % vision.merge_unit:
        raise ValueError(f"num_patches={num_patches} must be >= the images' {total} patches and a multiple of "
                         f"spatial_merge_size^2={vision.merge_unit}")
    pad = num_patches - total

    def cat(parts, shape):
        out = np.concatenate(parts) if parts else np.zeros(shape, np.int64)
        return np.pad(out, [(0, pad)] + [(0, 0)] * (out.ndim - 1)).astype(np.int32)

    return VisionLayout(cat(rotary, (0, 2)), cat(windows, (0,)), cat(frames, (0,)))


_layout_of = vision_layout  # for the model's methods, whose `vision_layout` argument shadows the function


def pad_patches(pixel_values, num_patches: int) -> np.ndarray:
    """pixel_values [P, D] with rows of zeros appended up to `num_patches` (see the module docstring)."""
    pixel_values = np.asarray(pixel_values)
    if pixel_values.shape[0] > num_patches:
        raise ValueError(f"{pixel_values.shape[0]} patches do not fit a bucket of num_patches={num_patches}")
    return np.pad(pixel_values, [(0, num_patches - pixel_values.shape[0]), (0, 0)])


def mrope_positions(config: ModelConfig, input_ids, image_grid_thw=None, segment_ids=None) -> np.ndarray:
    """The decoder's 3-D rotary positions [3, B, T] int32 (temporal, height, width), as transformers'
    `get_rope_index` computes them, per packed sequence.

    Within each segment (segment_ids [B, T]: 1..k per packed sequence, 0 = padding; default one segment per
    row) positions start at 0. A text token takes the next position on all three axes. An image (a run of
    `image_token_id` tokens; consecutive images split by their token counts) takes, for its merged token at
    grid coordinates (t, r, c), start + (t, r, c) where start is the position after the preceding text, and
    the text after it continues from start + max(rows, columns). Images are matched to the grids of
    `image_grid_thw` [num_images, 3] in the order their tokens appear in the batch (row by row). Padding
    gets 0. Rows without images reduce to 0, 1, 2, ... on all three axes.
    """
    vision = config.vision
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {ids.shape}")
    seg = np.ones(ids.shape, np.int64) if segment_ids is None else np.asarray(segment_ids)
    if seg.shape != ids.shape:
        raise ValueError(f"segment_ids has shape {seg.shape} but input_ids has {ids.shape}")
    if (ids == vision.video_token_id).any():
        raise ValueError(f"input_ids hold video tokens (id {vision.video_token_id}); videos are not supported")
    grids = _check_grid(vision, image_grid_thw) if image_grid_thw is not None else np.zeros((0, 3), np.int64)
    m = vision.spatial_merge_size
    out = np.zeros((3, *ids.shape), np.int64)
    used = 0
    for b in range(ids.shape[0]):
        is_image = ids[b] == vision.image_token_id
        cuts = np.flatnonzero((seg[b, 1:] != seg[b, :-1]) | (is_image[1:] != is_image[:-1])) + 1
        next_position = {}  # per segment id
        for start, end in zip([0, *cuts], [*cuts, ids.shape[1]]):
            sid = int(seg[b, start])
            if sid == 0:
                if is_image[start]:
                    raise ValueError(f"row {b} has image tokens in padding (segment id 0) at {start}..{end - 1}")
                continue
            cur = next_position.get(sid, 0)
            if not is_image[start]:
                out[:, b, start:end] = np.arange(cur, cur + end - start)
                cur += end - start
            k = start
            while is_image[start] and k < end:
                if used == len(grids):
                    raise ValueError(f"input_ids hold more image tokens than the {len(grids)} image(s) of "
                                     "image_grid_thw account for")
                t, h, w = grids[used]
                n = int(t * (h // m) * (w // m))
                if k + n > end:
                    raise ValueError(f"image {used} (grid {grids[used].tolist()}) needs {n} image tokens but row {b} "
                                     f"has a run of {end - k} at {k}; the prompt and image_grid_thw disagree")
                coords = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij")
                out[:, b, k:k + n] = np.stack(coords).reshape(3, -1) + cur
                cur += int(max(h, w) // m)
                k += n
                used += 1
            next_position[sid] = cur
    if used != len(grids):
        raise ValueError(f"image_grid_thw has {len(grids)} images but input_ids hold image tokens for {used}")
    return out.astype(np.int32)


def _text_positions(input_ids, segment_ids):
    """`mrope_positions` of rows without images, in jnp (traceable): 0.. per segment on all three axes."""
    b, t = input_ids.shape
    index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
        positions = index
    else:
        starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
        first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
        positions = jnp.where(segment_ids > 0, index - first, 0)
    return jnp.broadcast_to(positions[None], (3, b, t))


def _as_mrope(positions, batch_shape):
    """positions [3, B, T], or [B, T] broadcast to the three axes (text), checked against [B, T]."""
    positions = jnp.asarray(positions)
    if positions.ndim == 2:
        positions = jnp.broadcast_to(positions[None], (3, *positions.shape))
    if positions.shape != (3, *batch_shape):
        raise ValueError(f"positions must be [3, B, T] (or [B, T]) for a batch of shape {tuple(batch_shape)}, got "
                         f"{positions.shape}")
    return positions


def _host(x):
    """x as a numpy array, or None when it is traced (inside jit)."""
    if x is None:
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


# ----------------------------------------------------------------------------------------- vision tower
def _dense(features: int, names: tuple, c: ModelConfig, name: str) -> nn.Dense:
    """nn.Dense with bias, kernel and bias carrying logical axis names (the vision tower's linear layers)."""
    return nn.Dense(features, use_bias=True, dtype=c.dtype, param_dtype=c.param_dtype, name=name,
                    kernel_init=_param_init(_KERNEL_INIT, names),
                    bias_init=_param_init(nn.initializers.zeros, names[1:]))


def _rotary_tables(vision: VisionConfig, positions):
    """cos, sin [P, head_dim] of the 2-D rotary embedding: the first quarter of the frequencies turns with the
    row, the second with the column, and the second half of the head repeats the first (half-split)."""
    quarter = vision.head_dim // 2
    inv_freq = 1.0 / (vision.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq, jnp.float32)  # [P, 2, hd/4]
    angles = angles.reshape(angles.shape[0], -1)  # [P, hd/2]: rows' angles, then columns'
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x, cos, sin):
    """x [1, P, H, D] rotated in fp32 (as transformers does in the vision tower), back in x's dtype."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[None, :, None] + rotated * sin[None, :, None]).astype(x.dtype)


class VisionAttention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, cos, sin, mask):  # x [P, E]; mask [P, P] bool
        c, v = self.config, self.config.vision
        # qkv kernel [E, 3 * heads, head_dim]: q's heads, then k's, then v's (transformers' fused layout)
        qkv = HeadProjection(3 * v.num_heads, v.head_dim, True, "heads", c.dtype, c.param_dtype, name="qkv")(x[None])
        q, k, val = jnp.split(qkv, 3, axis=2)  # [1, P, H, D] each
        out = dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), val, mask[None], c.attention_impl)
        return _dense(v.hidden_size, ("heads", "embed"), c, "proj")(out.reshape(x.shape[0], -1))


class VisionMLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        c, v = self.config, self.config.vision
        gate = _dense(v.intermediate_size, ("embed", "mlp"), c, "gate_proj")(x)
        up = _dense(v.intermediate_size, ("embed", "mlp"), c, "up_proj")(x)
        return _dense(v.hidden_size, ("mlp", "embed"), c, "down_proj")(nn.silu(gate) * up)


class VisionBlock(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, cos, sin, mask):
        c = self.config
        x = x + VisionAttention(c, name="attn")(RMSNorm(_VISION_NORM_EPS, c.dtype, c.param_dtype, name="norm1")(x),
                                                cos, sin, mask)
        return x + VisionMLP(c, name="mlp")(RMSNorm(_VISION_NORM_EPS, c.dtype, c.param_dtype, name="norm2")(x))


class PatchMerger(nn.Module):
    """RMSNorm per patch, then an MLP over each group of spatial_merge_size^2 consecutive patches."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):  # [P, E] -> [P / merge_unit, out_hidden_size]
        c, v = self.config, self.config.vision
        x = RMSNorm(_VISION_NORM_EPS, c.dtype, c.param_dtype, name="ln_q")(x)
        x = x.reshape(-1, v.hidden_size * v.merge_unit)
        x = jax.nn.gelu(_dense(x.shape[-1], (None, "mlp"), c, "mlp_0")(x), approximate=False)
        return _dense(v.out_hidden_size, ("mlp", "embed"), c, "mlp_2")(x)


class VisionTransformer(nn.Module):
    """pixel_values [P, patch_dim] + VisionLayout -> merged image features [P / merge_unit, out_hidden_size]."""

    config: ModelConfig

    @nn.compact
    def __call__(self, pixel_values, layout: VisionLayout):
        c, v = self.config, self.config.vision
        if pixel_values.ndim != 2 or pixel_values.shape[1] != v.patch_dim:
            raise ValueError(f"pixel_values must be [num_patches, {v.patch_dim}] (channels x temporal_patch_size x "
                             f"patch_size^2, the Qwen2-VL processor's layout), got shape {pixel_values.shape}")
        if layout.window_segments.shape[0] != pixel_values.shape[0]:
            raise ValueError(f"vision layout covers {layout.window_segments.shape[0]} patches but pixel_values has "
                             f"{pixel_values.shape[0]}; build it with num_patches=pixel_values.shape[0]")
        x = Linear(v.hidden_size, (None, "embed"), c.dtype, c.param_dtype, name="patch_embed")(
            pixel_values.astype(c.dtype))
        cos, sin = _rotary_tables(v, jnp.asarray(layout.rotary_positions))
        window, full = jnp.asarray(layout.window_segments), jnp.asarray(layout.full_segments)
        window_mask = window[:, None] == window[None, :]
        full_mask = full[:, None] == full[None, :]
        block_cls = nn.remat(VisionBlock) if c.remat else VisionBlock
        for i in range(v.depth):
            mask = full_mask if i in v.fullatt_block_indexes else window_mask
            x = block_cls(c, name=f"blocks_{i}")(x, cos, sin, mask)
        return PatchMerger(c, name="merger")(x)


# ---------------------------------------------------------------------------------------------- the model
class Qwen2_5_VLCausalLM(nn.Module):
    """Qwen2.5-VL: `apply({"params": p}, input_ids, positions=None, segment_ids=None, *, pixel_values=None,
    image_grid_thw=None, vision_layout=None) -> logits [B, T, V]`.

    The interface of `CausalLM` (`hidden_states`, `logits_from_hidden`), plus `embed` (token embeddings with
    the image features merged in, e.g. for a sampler's prefill), `hidden_from_embeddings` and
    `image_features`. Parameters: {"visual": vision tower, "model": the `Decoder` tree of the text models,
    "lm_head" unless tied}.

    positions: [3, B, T] (mRoPE), or [B, T] for the same position on all three axes; None: computed like
    transformers (`mrope_positions`) on the host, which needs concrete input_ids (and image_grid_thw when
    there are images); inside jit, rows without images get 0.. per segment and rows with images need
    positions passed in. Vision inputs: `pixel_values` with either `image_grid_thw` (outside jit) or
    `vision_layout` (a `VisionLayout`, anywhere).
    """

    config: ModelConfig

    def setup(self):
        c = self.config
        if c.vision is None:
            raise ValueError("Qwen2_5_VLCausalLM needs a config with a VisionConfig (family 'qwen2_5_vl')")
        self.visual = VisionTransformer(c)
        self.model = Decoder(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Dense(c.vocab_size, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype,
                                    kernel_init=_param_init(_KERNEL_INIT, ("embed", "vocab")))

    def _layout(self, pixel_values, image_grid_thw, vision_layout) -> VisionLayout:
        if vision_layout is not None:
            return vision_layout
        if image_grid_thw is None:
            raise ValueError("pixel_values need image_grid_thw (outside jit) or vision_layout=vision_layout(...)")
        grid = _host(image_grid_thw)
        if grid is None:
            raise ValueError("image_grid_thw is traced (inside jit): compute vision_layout(config.vision, grid, "
                             "num_patches) on the host and pass vision_layout= instead")
        return _layout_of(self.config.vision, grid, num_patches=pixel_values.shape[0])

    def image_features(self, pixel_values, image_grid_thw=None, vision_layout=None):
        """Merged image features [P / merge_unit, hidden]: the images' tokens in order, then padding's."""
        return self.visual(pixel_values, self._layout(pixel_values, image_grid_thw, vision_layout))

    def embed(self, input_ids, *, pixel_values=None, image_grid_thw=None, vision_layout=None):
        """Input embeddings [B, T, E]: token embeddings with the image pad tokens replaced, in order, by the
        merged image features."""
        x = self.model.embed(input_ids)
        if pixel_values is None:
            if self.is_initializing():  # create the vision tower's parameters too (init runs on text alone)
                v = self.config.vision
                grid = np.array([[1, v.spatial_merge_size, v.spatial_merge_size]])
                self.visual(jnp.zeros((v.merge_unit, v.patch_dim), self.config.dtype), _layout_of(v, grid))
            return x
        layout = self._layout(pixel_values, image_grid_thw, vision_layout)
        features = self.visual(pixel_values, layout)  # [M, E]
        is_image = input_ids == self.config.vision.image_token_id
        ids, segments = _host(input_ids), _host(layout.full_segments)
        if ids is not None and segments is not None:
            n_tokens, n_features = int((ids == self.config.vision.image_token_id).sum()), int((segments > 0).sum())
            if n_tokens * self.config.vision.merge_unit != n_features:
                raise ValueError(f"input_ids hold {n_tokens} image tokens but the images have "
                                 f"{n_features // self.config.vision.merge_unit} merged patches; each image needs "
                                 "t*h*w / spatial_merge_size^2 image pad tokens")
        order = jnp.cumsum(is_image.reshape(-1)).reshape(is_image.shape) - 1  # i-th image token -> feature i
        gathered = jnp.take(features, jnp.clip(order, 0, features.shape[0] - 1), axis=0)
        return jnp.where(is_image[..., None], gathered.astype(x.dtype), x)

    def _positions(self, input_ids, positions, segment_ids, pixel_values, image_grid_thw):
        if positions is not None:
            return _as_mrope(positions, input_ids.shape)
        ids, grid, segs = _host(input_ids), _host(image_grid_thw), _host(segment_ids)
        concrete = ids is not None and (segment_ids is None or segs is not None)
        if concrete and (pixel_values is None or grid is not None):
            return jnp.asarray(mrope_positions(self.config, ids, grid, segs))
        if pixel_values is None:
            return _text_positions(input_ids, segment_ids)
        raise ValueError("positions=None with images needs concrete input_ids and image_grid_thw; inside jit (or "
                         "with vision_layout alone) pass positions=mrope_positions(config, input_ids, "
                         "image_grid_thw, segment_ids) computed on the host")

    def hidden_from_embeddings(self, embeddings, positions, segment_ids=None):
        """Final hidden states [B, T, E] of input embeddings [B, T, E] at positions [3, B, T] (or [B, T])."""
        return self.model.from_embeddings(embeddings, _as_mrope(positions, embeddings.shape[:2]), segment_ids)

    def hidden_states(self, input_ids, positions=None, segment_ids=None, *, pixel_values=None, image_grid_thw=None,
                      vision_layout=None):
        positions = self._positions(input_ids, positions, segment_ids, pixel_values, image_grid_thw)
        x = self.embed(input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                       vision_layout=vision_layout)
        return self.model.from_embeddings(x, positions, segment_ids)

    def logits_from_hidden(self, hidden):
        hidden = head_input(hidden)
        logits = self.model.attend(hidden) if self.config.tie_word_embeddings else self.lm_head(hidden)
        return _constrain(logits, ("act_batch", "act_length", "act_vocab"))

    def __call__(self, input_ids, positions=None, segment_ids=None, *, pixel_values=None, image_grid_thw=None,
                 vision_layout=None):
        return self.logits_from_hidden(self.hidden_states(
            input_ids, positions, segment_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
            vision_layout=vision_layout))
