"""Packing, bucketing and loss weights (numpy)."""
import numpy as np
import pytest

import jax.numpy as jnp

from agentfly_jax import algorithms
from agentfly_jax.trainer import batching


def _ragged(rng, n=9, t=20):
    lengths = rng.integers(3, t + 1, n)
    tokens = np.zeros((n, t), np.int32)
    mask = np.zeros((n, t), np.float32)
    for i, n_i in enumerate(lengths):
        tokens[i, :n_i] = rng.integers(1, 50, n_i)
        mask[i, 2:n_i] = rng.integers(0, 2, n_i - 2)
    return tokens, mask, lengths


def test_pack_unpack_round_trip_and_segments():
    rng = np.random.default_rng(0)
    tokens, mask, lengths = _ragged(rng)
    packed = batching.pack({"tokens": tokens, "action_mask": mask}, lengths, row_len=32, rows_multiple=4)
    r, length = packed.shape
    assert length == 32 and r % 4 == 0
    assert packed.arrays["tokens"].size >= lengths.sum()
    np.testing.assert_array_equal(packed.unpack(packed.arrays["tokens"], 20), tokens)
    np.testing.assert_array_equal(packed.unpack(packed.arrays["action_mask"], 20), mask)
    for i, (row, off, n) in enumerate(zip(packed.row, packed.offset, lengths)):
        seg = packed.arrays["segment_ids"][row, off:off + n]
        assert len(set(seg)) == 1 and seg[0] > 0
        np.testing.assert_array_equal(packed.arrays["positions"][row, off:off + n], np.arange(n))
    # every real token is covered exactly once; the rest is padding with segment 0
    assert (packed.arrays["segment_ids"] > 0).sum() == lengths.sum()


def test_first_fit_uses_few_rows():
    row, offset, used = batching.first_fit_decreasing(np.array([6, 5, 4, 3, 2, 2, 2]), row_len=8)
    assert used == 3  # 6+2, 5+3, 4+2+2
    with pytest.raises(ValueError, match="longer than row length"):
        batching.first_fit_decreasing(np.array([9]), row_len=8)


def test_choose_bucket():
    assert batching.choose_bucket(300, [256, 512, 1024]) == 512
    with pytest.raises(ValueError, match="largest bucket 1024"):
        batching.choose_bucket(2000, [256, 512, 1024])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_weights_reproduce_aggregate_loss(mode):
    rng = np.random.default_rng(1)
    _, mask, _ = _ragged(rng)
    mask[3] = 0  # a sequence without action tokens does not count
    per_token = rng.normal(size=mask.shape).astype(np.float32)
    w = batching.loss_token_weights(mask, mode)
    expected = float(algorithms.aggregate_loss(jnp.asarray(per_token), jnp.asarray(mask), mode))
    assert abs(float((w * per_token).sum()) - expected) < 1e-5
    # split the batch in two halves: the weighted sums add up to the full-batch aggregate
    halves = (w[:4] * per_token[:4]).sum() + (w[4:] * per_token[4:]).sum()
    assert abs(halves - expected) < 1e-5


def test_build_update_batch_shapes():
    rng = np.random.default_rng(2)
    tokens, mask, lengths = _ragged(rng, n=12)
    micro, packed = batching.build_update_batch({"tokens": tokens, "action_mask": mask}, lengths,
                                                agg="token-mean", row_len=32, micro_batches=2, rows_multiple=2)
    m, r, length = micro["tokens"].shape
    assert (m, length) == (2, 32) and r % 2 == 0
    assert micro["num_action_tokens"].tolist() == [mask.sum()] * 2
    assert abs(micro["loss_weights"].sum() - 1.0) < 1e-5
    with pytest.raises(KeyError, match="unknown per-token arrays"):
        batching.pack({"token": tokens}, lengths, row_len=32)
