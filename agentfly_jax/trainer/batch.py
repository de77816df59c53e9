"""The one batch path: a step's trajectories -> one typed `UpdateBatch`, packed once per mini-batch.

Host side (numpy, this module): trajectories are assigned to PPO mini-batches once per step, and each
mini-batch is packed once into rows of a bucketed length (several trajectories per row, separated by
`segment_ids`) and split into micro-batches: every per-token array is `[K, M, R, L]` (K mini-batches of M
micro-batches of R rows of L tokens). Index maps between the packed rows and the per-trajectory view
`[N, T]` travel with it, so the device can unpack for the advantage estimators and pack the results back
without a round trip through the host. The whole batch moves to the devices in one transfer
(`trainer/update.py` fills old/reference logprobs, values, advantages and loss weights there, in one jitted
pass). Shapes come from a few buckets (L from `seq_buckets`, R rounded up to `rows_multiple`) so jit
compiles a handful of times, not once per step.

Images (a vision-language policy, models/qwen2_5_vl.py): each micro-batch carries the images of its own rows
(`VisionRows`): their patches in row order, and within a row in the order their `<|image_pad|>` runs appear, which
is the order in which the model's embedding hands the merged patches to the pad tokens. The patch count is padded
to a bucket (a power of two, the same for every micro-batch of the step) and the grids stay on the host: the
vision tower's layout and the decoder's mRoPE positions [3, R, L] (restarting in every packed segment) are computed
here, per micro-batch, so jit sees shapes only. A batch without images is packed exactly as for a text policy.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import jax
import numpy as np

from agentfly_jax.models import ModelConfig, VisionLayout, mrope_positions, vision_layout

#: The fewest patch rows a micro-batch's images are padded to (then powers of two): a few vision-tower shapes.
MIN_PATCH_BUCKET = 64


class VisionRows(flax.struct.PyTreeNode):
    """The images of a micro-batch for the vision tower, `[..., P, ...]` (leading axes as the rows'): their patches
    (the Qwen2-VL processor's `pixel_values`, images one after another in the order their pad tokens appear in
    the micro-batch's rows, zero rows after the last) and the tower's `VisionLayout` of them (padding: segment 0)."""

    pixel_values: Any  # float32 [..., P, 3 * temporal_patch_size * patch_size**2]
    rotary_positions: Any  # int32 [..., P, 2]
    window_segments: Any  # int32 [..., P]
    full_segments: Any  # int32 [..., P]

    def layout(self) -> VisionLayout:
        return VisionLayout(self.rotary_positions, self.window_segments, self.full_segments)


class PackedRows(flax.struct.PyTreeNode):
    """Per-token arrays of packed rows, `[..., R, L]` (leading axes: mini-batch, micro-batch).

    The first five come from the rollout; the rest are filled on the device before the update (None until
    then, or when the recipe needs none: `ref_logprobs` without KL, `old_values`/`returns`/`value_weights`
    without a critic). A batch with images (vision-language policy) has `vision` and mRoPE `positions`
    `[..., 3, R, L]` (temporal, height, width; text tokens advance all three)."""

    tokens: Any  # int32
    positions: Any  # int32, restarting at 0 in every segment ([..., 3, R, L] with images)
    segment_ids: Any  # int32, 1, 2, ... per row; 0 = padding
    action_mask: Any  # float32, 1 on sampled tokens
    sampler_logprobs: Any  # float32, the rollout engine's logprobs (0 off-action)
    old_logprobs: Any = None  # the policy before this update (None: the train step takes its own, rl.old_logprobs)
    ref_logprobs: Any = None  # the frozen reference policy
    old_values: Any = None  # the critic before this update (0 off-action)
    advantages: Any = None
    returns: Any = None
    loss_weights: Any = None  # aggregation weights of the recipe over each mini-batch
    value_weights: Any = None  # token-mean weights over each mini-batch, for the critic
    vision: VisionRows | None = None  # each micro-batch's images (a vision-language policy's batch with images)


class UpdateBatch(flax.struct.PyTreeNode):
    """One RL step: packed rows `[K, M, R, L]` plus the per-trajectory view the estimators need.

    pack_index [K, M, R, L]: for each packed slot, the flat index n * T + t of the trajectory token it holds
    in the `[N, T]` view, or N * T for padding. unpack_index [N, T]: for each trajectory token, the flat index
    of its packed slot, or -1 past the trajectory's end."""

    rows: PackedRows
    rewards: Any  # [N] float32
    group_ids: Any  # [N] int32
    minibatch: Any  # [N] int32, the mini-batch each trajectory is in
    lengths: Any  # [N] int32
    pack_index: Any  # [K, M, R, L] int32
    unpack_index: Any  # [N, T] int32

    @property
    def num_minibatches(self) -> int:
        return int(self.rows.tokens.shape[0])


def drop_failed_chains(trajectories: Sequence[Any]) -> tuple[list, list]:
    """(chains to train on, chains dropped): a chain that ended in a runtime error (`Trajectory.chain_error`:
    the backend failed, an environment raised) is not an episode, and its 0.0 reward would be trained on as if
    the policy had earned it, so it is left out of the batch.

    Group baselines (GRPO and the other group estimators) are taken over the chains of a group that remain: a
    group that lost some chains is scored against its other chains, a group left with one chain gets advantage 0
    (the estimators' rule for a lone member), and a group that lost all is simply absent from the step."""
    kept = [t for t in trajectories if not t.chain_error]
    dropped = [t for t in trajectories if t.chain_error]
    return kept, dropped


class NoChainsLeftError(RuntimeError):
    """Every chain of an RL step ended in a runtime error (e.g. prompts longer than the context): the run stops."""


def no_chains_left_error(dropped: Sequence[Any], step: int) -> NoChainsLeftError:
    """The error for a step whose every chain ended in a runtime error: there is nothing to train on."""
    first = next((t.metrics.get("error") for t in dropped if t.metrics.get("error")), "no error recorded")
    return NoChainsLeftError(f"RL step {step}: all {len(dropped)} chains ended in a runtime error (chain_error), "
                             f"so there is nothing to train on; the first error: {first}")


def choose_bucket(length: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= length; a clear error when even the largest is too small."""
    for b in sorted(buckets):
        if b >= length:
            return int(b)
    raise ValueError(f"a sequence of {length} tokens does not fit the largest bucket {max(buckets)}; raise "
                     f"config.seq_buckets or lower the rollout's max context length")


def row_runs(segment_ids: np.ndarray) -> np.ndarray:
    """The runs of equal segment ids in each row of `segment_ids` [..., L] (host numpy): a row's sequences, plus one
    for its padding where it has some; what cuDNN's packed-sequence attention describes per row."""
    seg = np.asarray(segment_ids)
    return 1 + np.count_nonzero(seg[..., 1:] != seg[..., :-1], axis=-1)


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def first_fit_decreasing(lengths: np.ndarray, row_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Assigns sequences to rows: returns (row [N], offset [N], number of rows used)."""
    lengths = np.asarray(lengths)
    if len(lengths) and lengths.max() > row_len:
        raise ValueError(f"sequence of length {int(lengths.max())} longer than row length {row_len}")
    row, offset = np.zeros(len(lengths), np.int32), np.zeros(len(lengths), np.int32)
    fill: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        r = next((j for j, used in enumerate(fill) if used + n <= row_len), None)
        if r is None:
            r = len(fill)
            fill.append(0)
        row[i], offset[i] = r, fill[r]
        fill[r] += n
    return row, offset, len(fill)


def assign_minibatches(num: int, mini_batches: int, rng: np.random.Generator) -> np.ndarray:
    """[num] mini-batch index of each trajectory: a random split into `mini_batches` near-equal parts."""
    minibatch = np.zeros(num, np.int32)
    for k, part in enumerate(np.array_split(rng.permutation(num), mini_batches)):
        minibatch[part] = k
    return minibatch


def micro_batch_count(rows_needed: int, *, micro_batches: int, rows_multiple: int, row_len: int,
                      max_tokens: int | None) -> int:
    """How many micro-batches a mini-batch of `rows_needed` packed rows is split into: at least
    `micro_batches`, and enough that one holds at most `max_tokens` tokens (rows x row_len; at least
    `rows_multiple` rows whatever the budget). Counts above `micro_batches` are rounded up to 1, 2, 3, 4, 6, 8,
    12, 16, ... so that steps of similar size share compiled shapes."""
    if not max_tokens:
        return micro_batches
    cap_rows = max(rows_multiple, (max_tokens // row_len) // rows_multiple * rows_multiple)
    needed = -(-rows_needed // cap_rows)
    if needed <= micro_batches:
        return micro_batches
    power = 1  # the smallest of 1, 2, 3, 4, 6, 8, 12, ... (2^k and 3 * 2^(k-1)) that holds `needed`
    while True:
        for count in (power, 3 * power // 2):
            if count >= needed:
                return count
        power *= 2


def pack_step(tokens: np.ndarray, action_mask: np.ndarray, sampler_logprobs: np.ndarray, lengths: np.ndarray, *,
              rewards: np.ndarray, group_ids: np.ndarray, minibatch: np.ndarray, num_minibatches: int,
              micro_batches: int = 1, rows_multiple: int = 1, row_len: int | None = None,
              micro_batch_tokens: int | None = None, images: Mapping[str, np.ndarray] | None = None,
              model_config: ModelConfig | None = None, pad_patches_to: int | None = None, min_rows: int = 0,
              row_blocks: int = 1) -> UpdateBatch:
    """Packs per-trajectory arrays `[N, T]` into an UpdateBatch (numpy leaves).

    Each mini-batch is packed into rows of `row_len` (default T) tokens by first-fit-decreasing; every
    mini-batch gets the same row count R: the most any needs, rounded up to `micro_batches * rows_multiple`
    (pass the data-parallel size times a row bucket, so rows split evenly over devices and shapes repeat).
    `micro_batch_tokens` raises the micro-batch count where one would hold more tokens (`micro_batch_count`).

    images: the trajectories' images in `rollout.images_to_batch`'s layout (`pixel_values` [P, D] with every
    image's patches in trajectory order, `image_grid_thw` [I, 3], `image_rows` [I]: the trajectory of each); with
    `model_config`, the vision-language policy's config (its `vision` and mRoPE), the rows get `vision` (each
    micro-batch's images, padded to `pad_patches_to` patches or the smallest power of two >= MIN_PATCH_BUCKET
    that holds the largest micro-batch's) and mRoPE positions (see `pack_vision`).

    Several processes (each packs its own trajectories, its rows one block of a global batch of `row_blocks`
    equal blocks per micro-batch, see `rows_needed` and `place_block`): `min_rows` is the most rows any process's
    mini-batch needs, so that every process gets the same R and M; the micro-batch count is chosen for the global
    batch (`row_blocks` times the rows and the row multiple; `micro_batch_tokens` counts the global micro-batch).
    The defaults (0, 1) pack one process's whole batch.
    """
    tokens = np.asarray(tokens)
    n, t = tokens.shape
    row_len = t if row_len is None else int(row_len)
    lengths = np.asarray(lengths, np.int32)
    minibatch = np.asarray(minibatch, np.int32)
    if len(lengths) != n or len(minibatch) != n:
        raise ValueError(f"pack_step: {n} trajectories but {len(lengths)} lengths and {len(minibatch)} mini-batch ids")
    if minibatch.min(initial=0) < 0 or minibatch.max(initial=0) >= num_minibatches:
        raise ValueError(f"pack_step: mini-batch ids must be in [0, {num_minibatches})")
    placement = []
    used_max = 1
    for k in range(num_minibatches):
        members = np.flatnonzero(minibatch == k)
        row, offset, used = first_fit_decreasing(lengths[members], row_len)
        placement.append((members, row, offset))
        used_max = max(used_max, used)
    used_max = max(used_max, int(min_rows))
    micro_batches = micro_batch_count(used_max * row_blocks, micro_batches=micro_batches,
                                      rows_multiple=rows_multiple * row_blocks, row_len=row_len,
                                      max_tokens=micro_batch_tokens)
    rows = round_up(used_max, micro_batches * rows_multiple)

    def zeros(dtype):
        return np.zeros((num_minibatches, rows, row_len), dtype)

    out = {"tokens": zeros(np.int32), "positions": zeros(np.int32), "segment_ids": zeros(np.int32),
           "action_mask": zeros(np.float32), "sampler_logprobs": zeros(np.float32)}
    pack_index = np.full((num_minibatches, rows, row_len), n * t, np.int32)
    unpack_index = np.full((n, t), -1, np.int32)
    sources = {"tokens": tokens, "action_mask": np.asarray(action_mask, np.float32),
               "sampler_logprobs": np.asarray(sampler_logprobs, np.float32)}
    row_members = [[[] for _ in range(rows)] for _ in range(num_minibatches)]  # trajectories of each row, in order
    for k, (members, row, offset) in enumerate(placement):
        next_segment = np.ones(rows, np.int32)
        for j in np.argsort(row * row_len + offset, kind="stable"):  # row-major, so segment ids increase
            i, r, o, length = members[j], row[j], offset[j], lengths[members[j]]
            row_members[k][r].append(int(i))
            span = slice(o, o + length)
            for key, src in sources.items():
                out[key][k, r, span] = src[i, :length]
            out["segment_ids"][k, r, span] = next_segment[r]
            next_segment[r] += 1
            out["positions"][k, r, span] = np.arange(length)
            pack_index[k, r, span] = i * t + np.arange(length)
            unpack_index[i, :length] = (k * rows + r) * row_len + o + np.arange(length)

    def split(x):  # [K, R, L] -> [K, M, R / M, L]
        return x.reshape(num_minibatches, micro_batches, rows // micro_batches, row_len)

    packed = PackedRows(**{k: split(v) for k, v in out.items()})
    if images is not None:
        if model_config is None or model_config.vision is None:
            family = "none given" if model_config is None else f"family {model_config.family!r}"
            raise ValueError(f"pack_step: the trajectories have {len(images['image_grid_thw'])} images but the policy "
                             f"is not a vision-language model ({family}): train a Qwen2.5-VL policy "
                             "(config.model.family='qwen2_5_vl', or a Qwen2.5-VL checkpoint) on tasks with images")
        micro_rows = [[row_members[k][r] for r in range(m * (rows // micro_batches), (m + 1) * (rows // micro_batches))]
                      for k in range(num_minibatches) for m in range(micro_batches)]
        positions, vision = pack_vision(packed.tokens.reshape(-1, rows // micro_batches, row_len),
                                        packed.segment_ids.reshape(-1, rows // micro_batches, row_len), micro_rows,
                                        images, model_config, n, pad_patches_to=pad_patches_to)
        def lead(x):  # [K * M, ...] -> [K, M, ...]
            return x.reshape(num_minibatches, micro_batches, *x.shape[1:])

        packed = packed.replace(positions=lead(positions), vision=jax.tree.map(lead, vision))
    return UpdateBatch(rows=packed, rewards=np.asarray(rewards, np.float32), group_ids=np.asarray(group_ids, np.int32),
                       minibatch=minibatch, lengths=lengths, pack_index=split(pack_index), unpack_index=unpack_index)


def rows_needed(lengths: np.ndarray, minibatch: np.ndarray, num_minibatches: int, row_len: int) -> int:
    """The packed rows the fullest of the mini-batches needs (first-fit-decreasing, as `pack_step` packs; at
    least 1): what processes compare before packing so that they all pack to the same shapes."""
    lengths, minibatch = np.asarray(lengths, np.int32), np.asarray(minibatch, np.int32)
    return max([1] + [first_fit_decreasing(lengths[minibatch == k], row_len)[2] for k in range(num_minibatches)])


def place_block(batch: UpdateBatch, *, first_trajectory: int, num_trajectories: int) -> UpdateBatch:
    """A process's packed block (`pack_step` of its own trajectories) with `pack_index` numbering the trajectories
    globally: its trajectories are `first_trajectory`, ... of the `num_trajectories` of every process (in process
    order), padding slots point at `num_trajectories * T`. The per-trajectory arrays stay this process's own;
    `unpack_index` still indexes the block's own slots (the global one is computed from the global `pack_index`,
    `unpack_index_from`)."""
    n, t = np.asarray(batch.unpack_index).shape
    index = np.asarray(batch.pack_index)
    placed = np.where(index >= n * t, num_trajectories * t, index + first_trajectory * t).astype(np.int32)
    return batch.replace(pack_index=placed)


def unpack_index_from(pack_index, num_trajectories: int, row_len: int):
    """The `[N, T]` unpack_index that `pack_index` [K, M, R, L] implies (the flat slot of each trajectory token, -1
    past each trajectory's end); jnp or np. pack_step builds both on the host; a batch assembled from several
    processes' blocks gets its unpack_index from its global pack_index this way."""
    xp = np if isinstance(pack_index, np.ndarray) else jax.numpy
    slots = xp.arange(pack_index.size, dtype=np.int32)
    flat = xp.full((num_trajectories * row_len,), -1, np.int32)
    if xp is np:
        real = pack_index.reshape(-1) < num_trajectories * row_len
        flat[pack_index.reshape(-1)[real]] = slots[real]
    else:  # indices past the end (padding) are dropped
        flat = flat.at[pack_index.reshape(-1)].set(slots, mode="drop")
    return flat.reshape(num_trajectories, row_len)


def patch_bucket(count: int, smallest: int = MIN_PATCH_BUCKET) -> int:
    """The patch rows `count` patches are padded to: the smallest power of two >= max(count, smallest)."""
    return max(smallest, 1 << max(count - 1, 0).bit_length())


def pack_vision(tokens: np.ndarray, segment_ids: np.ndarray, micro_rows: Sequence[Sequence[Sequence[int]]],
                images: Mapping[str, np.ndarray], model_config: ModelConfig, num_trajectories: int, *,
                pad_patches_to: int | None = None) -> tuple[np.ndarray, VisionRows]:
    """(mRoPE positions [B, 3, R, L], VisionRows [B, P, ...]) of B packed micro-batches (host numpy).

    tokens, segment_ids [B, R, L]: the packed micro-batches; micro_rows[b][r]: the trajectories packed into row r
    of micro-batch b, in the order they sit in the row; images: `rollout.images_to_batch`'s `pixel_values`,
    `image_grid_thw` and `image_rows` of the `num_trajectories` trajectories. Micro-batch b gets the images of
    its rows' trajectories in that order, which is the order of their `<|image_pad|>` runs in the packed tokens.
    """
    vision = model_config.vision
    grids = np.asarray(images["image_grid_thw"], np.int64).reshape(-1, 3)
    image_rows = np.asarray(images["image_rows"], np.int64).reshape(-1)
    pixels = np.asarray(images["pixel_values"], np.float32)
    if len(image_rows) != len(grids) or (len(image_rows) and (image_rows.min() < 0
                                                              or image_rows.max() >= num_trajectories)):
        raise ValueError(f"pack_vision: {len(grids)} image grids with {len(image_rows)} image rows, which must "
                         f"index the {num_trajectories} trajectories")
    if pixels.ndim != 2 or pixels.shape[1] != vision.patch_dim:
        raise ValueError(f"pack_vision: pixel_values must be [patches, {vision.patch_dim}] (the policy's patch "
                         f"geometry), got {pixels.shape}: prepare images with the policy's patch size")
    sizes = grids.prod(axis=1)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    if starts[-1] > len(pixels):
        raise ValueError(f"pack_vision: the grids need {starts[-1]} patches but pixel_values has {len(pixels)}")
    of_trajectory = [np.flatnonzero(image_rows == i) for i in range(num_trajectories)]
    chosen = [[index for row in rows for i in row for index in of_trajectory[i]] for rows in micro_rows]
    most = max((int(sizes[c].sum()) for c in chosen), default=0)
    bucket = patch_bucket(most) if pad_patches_to is None else int(pad_patches_to)
    if bucket < most or bucket % vision.merge_unit:
        raise ValueError(f"pack_vision: pad_patches_to={bucket} must hold a micro-batch's {most} patches and be a "
                         f"multiple of spatial_merge_size**2={vision.merge_unit}")
    b = len(micro_rows)
    positions = np.zeros((b, 3, *tokens.shape[1:]), np.int32)
    out = {"pixel_values": np.zeros((b, bucket, vision.patch_dim), np.float32),
           "rotary_positions": np.zeros((b, bucket, 2), np.int32),
           "window_segments": np.zeros((b, bucket), np.int32), "full_segments": np.zeros((b, bucket), np.int32)}
    for m, indexes in enumerate(chosen):
        grid = grids[indexes]
        positions[m] = mrope_positions(model_config, tokens[m], grid, segment_ids[m])
        layout = vision_layout(vision, grid, bucket)
        out["rotary_positions"][m], out["window_segments"][m], out["full_segments"][m] = layout
        if indexes:
            out["pixel_values"][m, :int(sizes[indexes].sum())] = np.concatenate(
                [pixels[starts[i]:starts[i + 1]] for i in indexes])
    return positions, VisionRows(**out)


def unpack_rows(packed: np.ndarray, batch: UpdateBatch) -> np.ndarray:
    """A packed per-token array [K, M, R, L] back to the trajectory view [N, T] (0 past each end); numpy."""
    flat = np.asarray(packed).reshape(-1)
    index = np.asarray(batch.unpack_index)
    return np.where(index >= 0, flat[np.maximum(index, 0)], 0)
