"""The Trajectory: what one rollout chain hands to the trainer, and its conversion to batch arrays."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from itertools import compress
from typing import Any

import numpy as np

# Unpacked batches are padded to a multiple of this, so jit sees a handful of sequence lengths.
SEQUENCE_BUCKET = 64

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

    def __post_init__(self):
        # The checks below run at C speed on valid input (a rollout builds one Trajectory per chain, all at
        # the end); the position of the first bad entry is searched for only to report it.
        self.token_ids = list(map(int, self.token_ids))
        self.action_mask = list(map(int, self.action_mask))
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
        # a non-zero logprob where the mask is 0 (bits are 0/1 here, logprobs finite: non-zero = truthy)
        if any(compress(self.sampler_logprobs, map(operator.not_, self.action_mask))):
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

    def _check_versions(self) -> None:
        """Fills token_versions / policy_version / policy_version_max in and checks that they agree."""
        if self.token_versions is None:
            version = 0 if self.policy_version is None else self.policy_version
            self.token_versions = [version if bit else -1 for bit in self.action_mask]
        else:
            if len(self.token_versions) != len(self.token_ids):
                raise ValueError(
                    f"Trajectory.token_versions has {len(self.token_versions)} entries but token_ids has "
                    f"{len(self.token_ids)}: both must have one entry per token"
                )
            if not set(map(type, self.token_versions)) <= {int}:  # plain ints pass without the per-entry test
                bad = _first(not _is_int(version) for version in self.token_versions)
                if bad is not None:
                    raise ValueError(
                        f"Trajectory.token_versions must be ints, got {self.token_versions[bad]!r} "
                        f"at position {bad}"
                    )
            self.token_versions = list(map(int, self.token_versions))
            if min(compress(self.token_versions, self.action_mask), default=0) < 0 or not set(
                compress(self.token_versions, map(operator.not_, self.action_mask))
            ) <= {-1}:
                bad = _first(
                    (version < 0) if bit else (version != -1)
                    for bit, version in zip(self.action_mask, self.token_versions)
                )
                raise ValueError(
                    f"Trajectory.token_versions is {self.token_versions[bad]} at position {bad} where action_mask "
                    f"is {self.action_mask[bad]}: sampled tokens carry the (non-negative) weight version that "
                    "sampled them, the others -1"
                )
        sampled = list(compress(self.token_versions, self.action_mask))
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


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _first(conditions) -> int | None:
    """Index of the first true condition, or None."""
    return next((index for index, condition in enumerate(conditions) if condition), None)


def bucketed_length(length: int, bucket: int = SEQUENCE_BUCKET) -> int:
    """`length` rounded up to a multiple of `bucket`."""
    return max(bucket, -(-length // bucket) * bucket)


def trajectories_to_batch(
    trajectories: Sequence[Trajectory], *, pad_to: int | None = None, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Unpacked, right-padded batch arrays, one row per trajectory.

    The row length T is `pad_to`, or the longest trajectory rounded up to a multiple of 64.
    Returns `tokens`, `positions` (0..len-1, 0 on padding), `segment_ids` (1 on tokens, 0 on padding),
    `action_mask`, `sampler_logprobs` [N, T]; `rewards`, `group_ids`, `lengths` [N]; `policy_versions` [N] (each
    trajectory's oldest sampled-token version, what staleness is measured from) and `policy_versions_max` [N]
    (its newest).
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
    return {
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
