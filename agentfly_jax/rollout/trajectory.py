"""The Trajectory: what one rollout chain hands to the trainer, and its conversion to batch arrays.

Vision-language chains also carry their images (`Trajectory.images`, `PreparedImage`s in order of appearance,
one per run of `<|image_pad|>` ids); `images_to_batch` lays a batch's images out for the vision tower and
`trajectories_to_batch` adds those arrays when any trajectory has images (a text-only batch is unchanged).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from itertools import compress
from typing import Any

import numpy as np

from agentfly_jax.images import PreparedImage

# Unpacked batches are padded to a multiple of this, so jit sees a handful of sequence lengths.
SEQUENCE_BUCKET = 64
# A batch's image patches are padded to a power of two of at least this many: jit sees a handful of vision-tower
# shapes (the grids themselves stay on the host: the model's vision_layout / mrope_positions read them there).
PATCH_BUCKET = 1024

#: The flag of a chain the runtime could not finish (the backend failed, an environment raised, ...): not an
#: episode the policy played out, so the trainer leaves it out of the batch (trainer/batch.py).
CHAIN_ERROR_FLAG = "chain_error"


@dataclasses.dataclass
class ToolCallRecord:
    """One tool call made during a rollout, for logging and metrics."""

    turn: int
    name: str
    arguments: dict[str, Any]
    observation: str = ""
    error: str | None = None  # parse or execution error shown to the model instead of a result
    latency_s: float = 0.0
    images: int = 0  # images the tool returned with its observation


@dataclasses.dataclass
class Trajectory:
    """One rollout chain: the exact tokens (prompt and every turn) with what the policy sampled marked.

    `token_ids` are never re-tokenised from text: sampled turns are kept as the engine returned them.
    `action_mask` is 1 on tokens the policy sampled, 0 on prompt, tool/environment and template tokens.
    `sampler_logprobs` holds the engine's log-probability of each sampled token and 0.0 elsewhere.
    `token_versions` holds the weight version that sampled each token and -1 elsewhere (several versions when the
    weights changed during the chain: between turns, or within one with partial rollouts). Left out, every
    sampled token is taken to be `policy_version`'s.
    `policy_version` is the OLDEST version among the sampled tokens: staleness (trainer version minus it) is
    measured from it, so a chain counts as old as its oldest token. `policy_version_max` is the newest. Both are
    derived from `token_versions` when not given and must agree with them when given. A trajectory without
    sampled tokens keeps the versions it is given (default 0, and policy_version_max = policy_version).
    `flags` names things that went wrong but did not stop the rollout (e.g. "reward_failed").
    `images`: the chain's images in order of appearance (prompt and observations), each standing for one run of
    `<|image_pad|>` ids in `token_ids` (`PreparedImage.num_tokens` of them); empty for a text-only chain.
    """

    token_ids: list[int]
    action_mask: list[int]
    sampler_logprobs: list[float]
    reward: float = 0.0
    reward_extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    group_id: int = 0
    num_turns: int = 0
    tool_calls: int = 0
    tool_call_records: list[ToolCallRecord] = dataclasses.field(default_factory=list)
    policy_version: int | None = None  # None: derived (the oldest token version, or 0)
    finish_reason: str = "stop"
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None
    flags: set[str] = dataclasses.field(default_factory=set)
    token_versions: list[int] | None = None  # None: policy_version on sampled tokens, -1 elsewhere
    policy_version_max: int | None = None  # None: derived (the newest token version)
    images: list[PreparedImage] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        # The checks below run at C speed on valid input (a rollout builds one Trajectory per chain, all at
        # the end); the position of the first bad entry is searched for only to report it.
        self.token_ids = _int_list(self.token_ids)
        self.action_mask = _int_list(self.action_mask)
        self.sampler_logprobs = list(map(float, self.sampler_logprobs))
        self.flags = set(self.flags)
        length = len(self.token_ids)
        if length == 0:
            raise ValueError("Trajectory.token_ids is empty: a trajectory holds at least its prompt tokens")
        for name in ("action_mask", "sampler_logprobs"):
            if len(getattr(self, name)) != length:
                raise ValueError(
                    f"Trajectory.{name} has {len(getattr(self, name))} entries but token_ids has {length}: "
                    "both must have one entry per token"
                )
        if min(self.token_ids) < 0:
            raise ValueError(
                f"Trajectory.token_ids has a negative id at position {_first(t < 0 for t in self.token_ids)}"
            )
        if not set(self.action_mask) <= {0, 1}:
            bad_bit = _first(bit not in (0, 1) for bit in self.action_mask)
            raise ValueError(
                f"Trajectory.action_mask must be 0 or 1, "
                f"got {self.action_mask[bad_bit]} at position {bad_bit}"
            )
        if not all(map(math.isfinite, self.sampler_logprobs)):
            bad_logprob = _first(not math.isfinite(logprob) for logprob in self.sampler_logprobs)
            raise ValueError(
                f"Trajectory.sampler_logprobs is not finite at position {bad_logprob}: "
                f"{self.sampler_logprobs[bad_logprob]}"
            )
        # a non-zero logprob where the mask is 0 (bits are 0/1 here, logprobs finite): fewer zeros among the
        # unsampled logprobs (all zeros less the sampled ones') than unsampled tokens
        sampled_logprobs = list(compress(self.sampler_logprobs, self.action_mask))
        unsampled_zeros = self.sampler_logprobs.count(0.0) - sampled_logprobs.count(0.0)
        if unsampled_zeros != length - len(sampled_logprobs):
            unsampled = _first(
                bit == 0 and logprob != 0.0 for bit, logprob in zip(self.action_mask, self.sampler_logprobs)
            )
            raise ValueError(
                f"Trajectory.sampler_logprobs is {self.sampler_logprobs[unsampled]} at position {unsampled} "
                "where action_mask is 0: only sampled tokens have a sampler logprob; put 0.0 elsewhere"
            )
        self.reward = float(self.reward)
        if not math.isfinite(self.reward):
            raise ValueError(
                f"Trajectory.reward must be finite, got {self.reward}; flag failed rewards instead"
            )
        for name in ("group_id", "num_turns", "tool_calls", "policy_version", "policy_version_max"):
            value = getattr(self, name)
            if value is None and name.startswith("policy_version"):
                continue  # derived below
            if not _is_int(value) or value < 0:
                raise ValueError(f"Trajectory.{name} must be a non-negative int, got {value!r}")
            setattr(self, name, int(value))
        self._check_versions()
        if self.tool_call_records and len(self.tool_call_records) != self.tool_calls:
            raise ValueError(
                f"Trajectory.tool_calls is {self.tool_calls} but tool_call_records has "
                f"{len(self.tool_call_records)} entries: they must agree"
            )
        if not isinstance(self.finish_reason, str) or not self.finish_reason:
            raise ValueError(
                f"Trajectory.finish_reason must be a non-empty string, got {self.finish_reason!r}"
            )
        if self.images:
            self.images = list(self.images)
            bad_image = _first(not isinstance(image, PreparedImage) for image in self.images)
            if bad_image is not None:
                raise ValueError(
                    f"Trajectory.images[{bad_image}] is a {type(self.images[bad_image]).__name__}; images are "
                    "PreparedImages (agentfly_jax.images.prepare_image)"
                )

    def _check_versions(self) -> None:
        """Fills token_versions / policy_version / policy_version_max in and checks that they agree."""
        if self.token_versions is None:
            version = 0 if self.policy_version is None else self.policy_version
            self.token_versions = [version if bit else -1 for bit in self.action_mask]
            sampled = list(compress(self.token_versions, self.action_mask))
        else:
            if len(self.token_versions) != len(self.token_ids):
                raise ValueError(
                    f"Trajectory.token_versions has {len(self.token_versions)} entries but token_ids has "
                    f"{len(self.token_ids)}: both must have one entry per token"
                )
            if set(map(type, self.token_versions)) <= {int}:  # plain ints pass without the per-entry test
                self.token_versions = list(self.token_versions)
            else:
                bad = _first(not _is_int(version) for version in self.token_versions)
                if bad is not None:
                    raise ValueError(
                        f"Trajectory.token_versions must be ints, got {self.token_versions[bad]!r} "
                        f"at position {bad}"
                    )
                self.token_versions = list(map(int, self.token_versions))
            # sampled versions non-negative, and -1 on every other token: with no -1 among the sampled, as many
            # -1s as unsampled tokens
            sampled = list(compress(self.token_versions, self.action_mask))
            if min(sampled, default=0) < 0 or self.token_versions.count(-1) != len(self.token_versions) - len(
                sampled
            ):
                bad = _first(
                    (version < 0) if bit else (version != -1)
                    for bit, version in zip(self.action_mask, self.token_versions)
                )
                raise ValueError(
                    f"Trajectory.token_versions is {self.token_versions[bad]} at position {bad} where action_mask "
                    f"is {self.action_mask[bad]}: sampled tokens carry the (non-negative) weight version that "
                    "sampled them, the others -1"
                )
        if not sampled:
            self.policy_version = 0 if self.policy_version is None else self.policy_version
            if self.policy_version_max is None:
                self.policy_version_max = self.policy_version
            if self.policy_version_max < self.policy_version:
                raise ValueError(
                    f"Trajectory.policy_version_max={self.policy_version_max} is older than "
                    f"policy_version={self.policy_version}"
                )
            return
        for name, value, what in (
            ("policy_version", min(sampled), "oldest"),
            ("policy_version_max", max(sampled), "newest"),
        ):
            given = getattr(self, name)
            if given is None:
                setattr(self, name, value)
            elif given != value:
                raise ValueError(
                    f"Trajectory.{name} is {given} but the {what} version among the sampled tokens is {value}: "
                    f"{name} is the {what} entry of token_versions (give token_versions when several versions "
                    "sampled the chain, or leave it out to derive it)"
                )

    @property
    def length(self) -> int:
        """Number of tokens."""
        return len(self.token_ids)

    @property
    def num_action_tokens(self) -> int:
        """Number of tokens the policy sampled."""
        return sum(self.action_mask)

    @property
    def chain_error(self) -> bool:
        """Whether the chain ended in a runtime error (its reward says nothing about the policy)."""
        return CHAIN_ERROR_FLAG in self.flags or self.finish_reason == "error"


def _int_list(values) -> list[int]:
    """`list(map(int, values))`: a plain copy when every entry is an int already (a rollout's lists)."""
    values = list(values)
    return values if set(map(type, values)) <= {int} else list(map(int, values))


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _first(conditions) -> int | None:
    """Index of the first true condition, or None."""
    return next((index for index, condition in enumerate(conditions) if condition), None)


def bucketed_length(length: int, bucket: int = SEQUENCE_BUCKET) -> int:
    """`length` rounded up to a multiple of `bucket`."""
    return max(bucket, -(-length // bucket) * bucket)


def trajectories_to_batch(
    trajectories: Sequence[Trajectory],
    *,
    pad_to: int | None = None,
    pad_id: int = 0,
    pad_patches_to: int | None = None,
    image_token_id: int | None = None,
) -> dict[str, np.ndarray]:
    """Unpacked, right-padded batch arrays, one row per trajectory.

    The row length T is `pad_to`, or the longest trajectory rounded up to a multiple of 64.
    Returns `tokens`, `positions` (0..len-1, 0 on padding), `segment_ids` (1 on tokens, 0 on padding),
    `action_mask`, `sampler_logprobs` [N, T]; `rewards`, `group_ids`, `lengths` [N]; `policy_versions` [N] (each
    trajectory's oldest sampled-token version, what staleness is measured from) and `policy_versions_max` [N]
    (its newest).
    When any trajectory has images, also `images_to_batch`'s arrays (`pixel_values`, `image_grid_thw`,
    `image_rows`, `patch_image_ids`; patches padded as `pad_patches_to` says); a text-only batch has none of them.
    """
    if not trajectories:
        raise ValueError("trajectories_to_batch() got no trajectories")
    lengths = np.array([trajectory.length for trajectory in trajectories], dtype=np.int32)  # [N]
    longest = int(np.argmax(lengths))
    if pad_to is None:
        row_length = bucketed_length(int(lengths[longest]))
    else:
        if pad_to <= 0:
            raise ValueError(f"pad_to must be positive, got {pad_to}")
        if lengths[longest] > pad_to:
            raise ValueError(
                f"trajectory {longest} (group {trajectories[longest].group_id}) has {lengths[longest]} "
                f"tokens, more than pad_to={pad_to}: raise pad_to or limit the rollout length"
            )
        row_length = pad_to
    count = len(trajectories)
    tokens = np.full((count, row_length), pad_id, dtype=np.int32)  # [N, T]
    positions = np.zeros((count, row_length), dtype=np.int32)  # [N, T]
    segment_ids = np.zeros((count, row_length), dtype=np.int32)  # [N, T]
    action_mask = np.zeros((count, row_length), dtype=np.float32)  # [N, T]
    sampler_logprobs = np.zeros((count, row_length), dtype=np.float32)  # [N, T]
    for row, trajectory in enumerate(trajectories):
        length = trajectory.length
        tokens[row, :length] = trajectory.token_ids
        positions[row, :length] = np.arange(length, dtype=np.int32)
        segment_ids[row, :length] = 1
        action_mask[row, :length] = trajectory.action_mask
        sampler_logprobs[row, :length] = trajectory.sampler_logprobs
    batch = {
        "tokens": tokens,
        "positions": positions,
        "segment_ids": segment_ids,
        "action_mask": action_mask,
        "sampler_logprobs": sampler_logprobs,
        "rewards": np.array([trajectory.reward for trajectory in trajectories], dtype=np.float32),  # [N]
        "group_ids": np.array([trajectory.group_id for trajectory in trajectories], dtype=np.int32),  # [N]
        "lengths": lengths,  # [N]
        "policy_versions": np.array([t.policy_version for t in trajectories], dtype=np.int32),  # [N]
        "policy_versions_max": np.array([t.policy_version_max for t in trajectories], dtype=np.int32),  # [N]
    }
    if any(trajectory.images for trajectory in trajectories):
        batch.update(
            images_to_batch(trajectories, pad_patches_to=pad_patches_to, image_token_id=image_token_id)
        )
    return batch


def _power_of_two_at_least(count: int, smallest: int) -> int:
    return max(smallest, 1 << max(count - 1, 0).bit_length())


def images_to_batch(
    trajectories: Sequence[Trajectory],
    *,
    pad_patches_to: int | None = None,
    image_token_id: int | None = None,
) -> dict[str, np.ndarray]:
    """The vision-tower inputs of a batch: every image of row 0 in order of appearance, then row 1's, ...

    Returns, for the batch's I images and P patch rows:
      `pixel_values` [P, 3 * temporal_patch_size * patch_size**2] float32: each image's patches
        (`PreparedImage.pixel_values()`, the processor's), images one after another; rows of zeros after the last
        one (the padding `models.qwen2_5_vl.pad_patches` makes);
      `image_grid_thw` [I, 3] int32: each image's (t, h, w) patch grid, in the same order (the model's
        `vision_layout(config.vision, grid, P)` and `mrope_positions` read it on the host);
      `image_rows` [I] int32: the batch row (trajectory) of each image;
      `patch_image_ids` [P] int32: the index (into image_grid_thw) of each patch's image, -1 on padding.
    Row order is token order: the k-th `<|image_pad|>` id of `tokens` in row-major order is the k-th merged patch
    (merge_size**2 consecutive patches) of `pixel_values`, so the vision tower's output fills the pad positions of
    the whole batch in one scatter, as transformers' `masked_scatter` does.
    P is `pad_patches_to` (a multiple of merge_size**2), or the total patch count rounded up to a power of two
    (at least PATCH_BUCKET). `image_token_id`: when given, each row's count of that id must equal its images'
    tokens.
    """
    images = [(row, image) for row, trajectory in enumerate(trajectories) for image in trajectory.images]
    if not images:
        raise ValueError("images_to_batch() got trajectories without images")
    geometry = {(image.patch_size, image.temporal_patch_size, image.merge_size) for _, image in images}
    if len(geometry) > 1:
        raise ValueError(
            f"the batch's images have different patch geometries (patch, temporal, merge): {sorted(geometry)}; "
            "prepare every image with the same ImageSettings"
        )
    if image_token_id is not None:
        for row, trajectory in enumerate(trajectories):
            expected = sum(image.num_tokens for image in trajectory.images)
            found = trajectory.token_ids.count(image_token_id)
            if found != expected:
                raise ValueError(
                    f"trajectory {row} has {found} image tokens (id {image_token_id}) but its "
                    f"{len(trajectory.images)} images stand for {expected}: its images and tokens do not match"
                )
    patch_size, temporal, merge = next(iter(geometry))
    total_patches = sum(image.num_patches for _, image in images)
    patch_rows = pad_patches_to if pad_patches_to is not None else _power_of_two_at_least(total_patches, PATCH_BUCKET)
    if total_patches > patch_rows or patch_rows % (merge * merge):
        raise ValueError(
            f"pad_patches_to={patch_rows} must be at least the batch's {total_patches} patches and a multiple of "
            f"merge_size**2={merge * merge}: raise it, or lower max_pixels"
        )
    pixel_values = np.zeros((patch_rows, 3 * temporal * patch_size * patch_size), dtype=np.float32)  # [P, D]
    patch_image_ids = np.full((patch_rows,), -1, dtype=np.int32)  # [P]
    grid_thw = np.zeros((len(images), 3), dtype=np.int32)  # [I, 3]
    image_rows = np.zeros((len(images),), dtype=np.int32)  # [I]
    start = 0
    for index, (row, image) in enumerate(images):
        end = start + image.num_patches
        pixel_values[start:end] = image.pixel_values()
        patch_image_ids[start:end] = index
        grid_thw[index] = image.grid_thw
        image_rows[index] = row
        start = end
    return {
        "pixel_values": pixel_values,
        "image_grid_thw": grid_thw,
        "image_rows": image_rows,
        "patch_image_ids": patch_image_ids,
    }
