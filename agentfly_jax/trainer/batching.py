"""Host-side batching: per-trajectory arrays -> packed, bucketed rows the jitted update consumes.

Estimators run on unpacked arrays (one row per trajectory, `[N, T]`); the update runs on packed rows
(`[R, L]`, several trajectories per row separated by `segment_ids`). Shapes come from a few buckets
(row length from `seq_buckets`, row count rounded up to `rows_multiple`) so jit compiles a handful of
times, not once per batch. Everything here is numpy.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

# Per-token arrays carried through packing; padding value for each (missing keys are simply absent).
PER_TOKEN_KEYS = {
    "tokens": 0, "action_mask": 0.0, "sampler_logprobs": 0.0, "old_logprobs": 0.0, "ref_logprobs": 0.0,
    "advantages": 0.0, "returns": 0.0, "old_values": 0.0, "loss_weights": 0.0, "metric_weights": 0.0,
}
AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def choose_bucket(length: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= length; a clear error when even the largest is too small."""
    for b in sorted(buckets):
        if b >= length:
            return int(b)
    raise ValueError(f"a sequence of {length} tokens does not fit the largest bucket {max(buckets)}; raise "
                     f"config.seq_buckets or lower the rollout's max context length")


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


@dataclasses.dataclass
class PackedBatch:
    """Packed rows `arrays[k]: [R, L]` plus where each trajectory went (for unpacking per-token outputs)."""

    arrays: dict[str, np.ndarray]
    row: np.ndarray  # [N]
    offset: np.ndarray  # [N]
    lengths: np.ndarray  # [N]

    @property
    def shape(self) -> tuple[int, int]:
        return self.arrays["tokens"].shape

    def unpack(self, packed: np.ndarray, seq_len: int) -> np.ndarray:
        """A packed per-token array [R, L] back to one row per trajectory [N, seq_len] (zeros after length)."""
        out = np.zeros((len(self.lengths), seq_len), dtype=packed.dtype)
        for i, (r, o, n) in enumerate(zip(self.row, self.offset, self.lengths)):
            out[i, :n] = packed[r, o:o + n]
        return out


def pack(arrays: Mapping[str, np.ndarray], lengths: np.ndarray, *, row_len: int, rows_multiple: int = 1,
         num_rows: int | None = None) -> PackedBatch:
    """Packs per-trajectory arrays `[N, T]` (keys of PER_TOKEN_KEYS) into rows `[R, row_len]`.

    Adds `segment_ids` (1, 2, ... per row; 0 = padding) and `positions` (restarting at 0 per segment).
    R is the number of rows needed, rounded up to `rows_multiple` (a coarse multiple bounds the number of
    compiled shapes), or exactly `num_rows` if given.
    """
    unknown = set(arrays) - set(PER_TOKEN_KEYS)
    if unknown:
        raise KeyError(f"pack() got unknown per-token arrays {sorted(unknown)}; known: {sorted(PER_TOKEN_KEYS)}")
    lengths = np.asarray(lengths, np.int32)
    row, offset, used = first_fit_decreasing(lengths, row_len)
    n_rows = round_up(used, rows_multiple) if num_rows is None else num_rows
    if n_rows < used:
        raise ValueError(f"{len(lengths)} sequences need {used} rows of {row_len} tokens but num_rows={n_rows}")
    out = {k: np.full((n_rows, row_len), PER_TOKEN_KEYS[k], dtype=np.asarray(v).dtype) for k, v in arrays.items()}
    segment_ids = np.zeros((n_rows, row_len), np.int32)
    positions = np.zeros((n_rows, row_len), np.int32)
    next_segment = np.ones(n_rows, np.int32)
    for i in np.argsort(row * row_len + offset, kind="stable"):  # row-major so segment ids increase
        r, o, n = row[i], offset[i], lengths[i]
        for k, v in arrays.items():
            out[k][r, o:o + n] = np.asarray(v)[i, :n]
        segment_ids[r, o:o + n] = next_segment[r]
        next_segment[r] += 1
        positions[r, o:o + n] = np.arange(n)
    out["segment_ids"], out["positions"] = segment_ids, positions
    return PackedBatch(out, row, offset, lengths)


def loss_token_weights(action_mask: np.ndarray, mode: str, *, norm_len: int | None = None) -> np.ndarray:
    """Per-token weights w [N, T] such that sum(w * per_token_loss) is the `mode` aggregate over the batch.

    Weights make every aggregation mode a plain weighted sum, so it is exact under packing (a row holds
    several sequences) and under gradient accumulation (micro-batch sums add up to the full batch).
      token-mean:              mask / (action tokens in the batch)
      seq-mean-token-mean:     mask / (tokens of its sequence * sequences with an action token)
      seq-mean-token-sum-norm: mask / (norm_len * sequences with an action token)   (Dr.GRPO; norm_len
                               defaults to T, the padded length)
    """
    mask = np.asarray(action_mask, np.float64)
    per_seq = mask.sum(axis=1)
    n_seqs = max(int((per_seq > 0).sum()), 1)
    if mode == "token-mean":
        w = mask / max(mask.sum(), 1.0)
    elif mode == "seq-mean-token-mean":
        w = mask / np.maximum(per_seq, 1.0)[:, None] / n_seqs
    elif mode == "seq-mean-token-sum-norm":
        w = mask / float(norm_len or mask.shape[1]) / n_seqs
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATION_MODES}")
    return w.astype(np.float32)


def split_microbatches(arrays: Mapping[str, np.ndarray], num_micro: int) -> dict[str, np.ndarray]:
    """[R, L] -> [num_micro, R / num_micro, L] for the accumulation scan."""
    rows = next(iter(arrays.values())).shape[0]
    if rows % num_micro:
        raise ValueError(f"{rows} packed rows cannot be split into {num_micro} micro-batches; pack with "
                         f"rows_multiple divisible by micro_batches")
    return {k: v.reshape(num_micro, rows // num_micro, *v.shape[1:]) for k, v in arrays.items()}


def build_update_batch(arrays: Mapping[str, np.ndarray], lengths: np.ndarray, *, agg: str, row_len: int,
                       micro_batches: int = 1, rows_multiple: int = 1, norm_len: int | None = None,
                       num_rows: int | None = None) -> tuple[dict[str, np.ndarray], PackedBatch]:
    """One mini-batch for `train_step`: loss weights for `agg` over the whole mini-batch, packed rows split
    into `micro_batches`, and `num_action_tokens`. Returns (micro-batch arrays [M, R/M, L], the PackedBatch).

    `rows_multiple` should be the data-parallel size (rows are sharded over data x fsdp) so each micro-batch
    divides evenly over devices.
    """
    arrays = dict(arrays)
    arrays["loss_weights"] = loss_token_weights(arrays["action_mask"], agg, norm_len=norm_len)
    packed = pack(arrays, lengths, row_len=row_len, rows_multiple=micro_batches * rows_multiple,
                  num_rows=num_rows)
    micro = split_microbatches(packed.arrays, micro_batches)
    n_tokens = float((np.asarray(arrays["action_mask"]) > 0).sum())
    micro["num_action_tokens"] = np.full((micro_batches,), n_tokens, np.float32)
    return micro, packed
