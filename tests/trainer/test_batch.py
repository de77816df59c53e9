"""The one batch path on the host (numpy): pack_step's packed rows, index maps, bucketing, loss weights."""
import jax.numpy as jnp
import numpy as np
import pytest

from agentfly_jax import algorithms
from agentfly_jax.trainer import batch as batch_lib
from agentfly_jax.trainer.batch import choose_bucket, first_fit_decreasing, pack_step, unpack_rows
from tests.algorithms import numpy_reference as ref

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _ragged(rng, n=9, t=20):
    lengths = rng.integers(3, t + 1, n)
    tokens = np.zeros((n, t), np.int32)
    mask = np.zeros((n, t), np.float32)
    sampler = np.zeros((n, t), np.float32)
    for i, n_i in enumerate(lengths):
        tokens[i, :n_i] = rng.integers(1, 50, n_i)
        mask[i, 2:n_i] = rng.integers(0, 2, n_i - 2)
        sampler[i, :n_i] = -rng.exponential(size=n_i) * mask[i, :n_i]
    return tokens, mask, sampler, lengths


def _pack(tokens, mask, sampler, lengths, *, minibatch=None, num_minibatches=1, rewards=None, **kw):
    n = len(lengths)
    minibatch = np.zeros(n, np.int32) if minibatch is None else minibatch
    rewards = np.arange(n, dtype=np.float32) if rewards is None else rewards
    return pack_step(tokens, mask, sampler, lengths, rewards=rewards, group_ids=np.arange(n) // 3,
                     minibatch=minibatch, num_minibatches=num_minibatches, **kw)


def _pack_like(per_trajectory, batch):
    """Host-side [N, T] -> [K, M, R, L] through pack_index (0 on padding), as the device's _pack does."""
    flat = np.concatenate([np.asarray(per_trajectory).reshape(-1), np.zeros(1, per_trajectory.dtype)])
    return flat[np.asarray(batch.pack_index)]


def _check_segments(batch, lengths):
    """Each trajectory is one contiguous segment (id > 0, positions 0..n-1) of one row; the rest is padding."""
    rows = batch.rows
    seg, pos = rows.segment_ids.reshape(-1), rows.positions.reshape(-1)
    row_len = rows.tokens.shape[-1]
    for i, n_i in enumerate(lengths):
        slots = batch.unpack_index[i, :n_i]
        assert (slots >= 0).all() and (batch.unpack_index[i, n_i:] == -1).all()
        np.testing.assert_array_equal(np.diff(slots), 1)  # contiguous ...
        assert slots[0] // row_len == slots[-1] // row_len  # ... within one row
        assert len(set(seg[slots])) == 1 and seg[slots[0]] > 0
        np.testing.assert_array_equal(pos[slots], np.arange(n_i))
    # every real token is covered exactly once; the rest is padding with segment 0
    assert (rows.segment_ids > 0).sum() == lengths.sum()
    assert (rows.action_mask[rows.segment_ids == 0] == 0).all()


def test_pack_unpack_round_trip_and_segments():
    rng = np.random.default_rng(0)
    tokens, mask, sampler, lengths = _ragged(rng)
    batch = _pack(tokens, mask, sampler, lengths, row_len=32, rows_multiple=4)
    k, m, r, length = batch.rows.tokens.shape
    assert (k, m, length) == (1, 1, 32) and r % 4 == 0
    assert batch.rows.tokens.size >= lengths.sum()
    np.testing.assert_array_equal(unpack_rows(batch.rows.tokens, batch), tokens)
    np.testing.assert_array_equal(unpack_rows(batch.rows.action_mask, batch), mask)
    np.testing.assert_array_equal(unpack_rows(batch.rows.sampler_logprobs, batch), sampler)
    _check_segments(batch, lengths)


@pytest.mark.parametrize("num_minibatches,micro_batches,rows_multiple,row_len",
                         [(3, 2, 2, 40), (2, 4, 1, 20), (4, 1, 3, 64)])
def test_pack_step_round_trip_with_mini_and_micro_batches(num_minibatches, micro_batches, rows_multiple, row_len):
    rng = np.random.default_rng(1)
    tokens, mask, sampler, lengths = _ragged(rng, n=23)
    minibatch = batch_lib.assign_minibatches(len(lengths), num_minibatches, rng)
    assert sorted(np.bincount(minibatch)) in ([5, 6, 6, 6], [11, 12], [7, 8, 8])  # near-equal parts
    batch = _pack(tokens, mask, sampler, lengths, minibatch=minibatch, num_minibatches=num_minibatches,
                  micro_batches=micro_batches, rows_multiple=rows_multiple, row_len=row_len)
    k, m, r, length = batch.rows.tokens.shape
    assert (k, m, length) == (num_minibatches, micro_batches, row_len)
    assert (m * r) % (micro_batches * rows_multiple) == 0
    assert batch.num_minibatches == num_minibatches
    for leaf in (batch.rows.positions, batch.rows.segment_ids, batch.rows.action_mask,
                 batch.rows.sampler_logprobs, batch.pack_index):
        assert leaf.shape == (k, m, r, length)
    for name, want in (("tokens", tokens), ("action_mask", mask), ("sampler_logprobs", sampler)):
        np.testing.assert_array_equal(unpack_rows(getattr(batch.rows, name), batch), want, err_msg=name)
    _check_segments(batch, lengths)
    # each trajectory lands in its own mini-batch's block [k]
    block = m * r * length
    for i, n_i in enumerate(lengths):
        assert (batch.unpack_index[i, :n_i] // block == minibatch[i]).all()
    # rows are no more than the fullest mini-batch needs, rounded up to the multiple
    used = max(first_fit_decreasing(lengths[minibatch == j], row_len)[2] for j in range(num_minibatches))
    assert m * r == batch_lib.round_up(used, micro_batches * rows_multiple)


def test_index_maps_are_inverse():
    rng = np.random.default_rng(2)
    tokens, mask, sampler, lengths = _ragged(rng, n=17)
    n, t = tokens.shape
    minibatch = batch_lib.assign_minibatches(n, 3, rng)
    batch = _pack(tokens, mask, sampler, lengths, minibatch=minibatch, num_minibatches=3, micro_batches=2,
                  row_len=48)
    pack_index = np.asarray(batch.pack_index).reshape(-1)
    unpack_index = np.asarray(batch.unpack_index)
    assert unpack_index.shape == (n, t)
    real = pack_index < n * t
    assert (pack_index[~real] == n * t).all()  # padding points past the end
    assert real.sum() == lengths.sum() == (unpack_index >= 0).sum()
    # pack then unpack: every real slot maps back to itself
    slots = np.flatnonzero(real)
    np.testing.assert_array_equal(unpack_index.reshape(-1)[pack_index[slots]], slots)
    # unpack then pack: every trajectory token maps back to itself
    flat_nt = np.flatnonzero(unpack_index.reshape(-1) >= 0)
    np.testing.assert_array_equal(pack_index[unpack_index.reshape(-1)[flat_nt]], flat_nt)
    np.testing.assert_array_equal(flat_nt, np.flatnonzero(np.arange(t)[None, :] < lengths[:, None]))
    # and a per-trajectory array survives the trip [N, T] -> packed -> [N, T] (0 past each end)
    values = rng.normal(size=(n, t)).astype(np.float32)
    np.testing.assert_array_equal(unpack_rows(_pack_like(values, batch), batch),
                                  np.where(np.arange(t)[None, :] < lengths[:, None], values, 0.0))


def test_pack_step_refuses_bad_inputs():
    rng = np.random.default_rng(3)
    tokens, mask, sampler, lengths = _ragged(rng)
    with pytest.raises(ValueError, match=r"mini-batch ids must be in \[0, 2\)"):
        _pack(tokens, mask, sampler, lengths, minibatch=np.full(len(lengths), 2), num_minibatches=2)
    with pytest.raises(ValueError, match="9 trajectories but 8 lengths"):
        _pack(tokens, mask, sampler, lengths[:-1], minibatch=np.zeros(len(lengths), np.int32))
    with pytest.raises(ValueError, match="longer than row length"):
        _pack(tokens, mask, sampler, lengths, row_len=8)


def test_first_fit_uses_few_rows():
    row, offset, used = first_fit_decreasing(np.array([6, 5, 4, 3, 2, 2, 2]), row_len=8)
    assert used == 3  # 6+2, 5+3, 4+2+2
    fill = np.zeros(used, int)
    for r, o, n in zip(row, offset, [6, 5, 4, 3, 2, 2, 2]):
        assert o == fill[r]  # no overlap, no gap
        fill[r] += n
    assert (fill <= 8).all()
    with pytest.raises(ValueError, match="longer than row length"):
        first_fit_decreasing(np.array([9]), row_len=8)


def test_choose_bucket():
    assert choose_bucket(300, [256, 512, 1024]) == 512
    assert choose_bucket(256, [1024, 256, 512]) == 256
    with pytest.raises(ValueError, match="largest bucket 1024"):
        choose_bucket(2000, [256, 512, 1024])


@pytest.mark.parametrize("mode", MODES)
def test_loss_weights_reproduce_aggregate_loss(mode):
    """Weights of the whole batch, packed into micro-batches: the weighted sums of the micro-batches add up to
    the float64 reference aggregate of the whole batch."""
    rng = np.random.default_rng(4)
    tokens, mask, sampler, lengths = _ragged(rng)
    mask[3] = 0  # a sequence without action tokens does not count
    per_token = rng.normal(size=mask.shape).astype(np.float32)
    w = np.asarray(algorithms.aggregation_weights(jnp.asarray(mask), mode))
    expected = ref.aggregate(per_token, mask, mode)
    np.testing.assert_allclose(float((w * per_token).sum()), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(algorithms.aggregate_loss(jnp.asarray(per_token), jnp.asarray(mask), mode)),
                               expected, rtol=1e-5, atol=1e-6)
    batch = _pack(tokens, mask, sampler, lengths, row_len=24, micro_batches=3)
    packed_w, packed_x = _pack_like(w, batch), _pack_like(per_token, batch)
    micro = [float((packed_w[0, j] * packed_x[0, j]).sum()) for j in range(3)]
    assert sum(abs(x) > 0 for x in micro) >= 2  # the batch is really split
    np.testing.assert_allclose(sum(micro), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("budget,rows_multiple,micro_batches", [(80, 1, 1), (60, 2, 1), (200, 1, 2), (10, 2, 1)])
def test_micro_batch_token_budget(budget, rows_multiple, micro_batches):
    """With `micro_batch_tokens`, a micro-batch holds at most the budget's rows (at least `rows_multiple`), the
    count is at least `micro_batches` and one of 1, 2, 3, 4, 6, 8, 12, ... above it, and nothing is lost."""
    rng = np.random.default_rng(3)
    tokens, mask, sampler, lengths = _ragged(rng, n=31)
    row_len = 20
    batch = _pack(tokens, mask, sampler, lengths, micro_batches=micro_batches, rows_multiple=rows_multiple,
                  row_len=row_len, micro_batch_tokens=budget)
    _, m, r, _ = batch.rows.tokens.shape
    used = first_fit_decreasing(lengths, row_len)[2]
    cap = max(rows_multiple, (budget // row_len) // rows_multiple * rows_multiple)
    assert r <= cap and r % rows_multiple == 0 and m * r >= used
    assert m >= micro_batches and (m == micro_batches or m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32))
    assert m == micro_batches or -(-used // cap) > micro_batches  # more only when the budget needs it
    for name, want in (("tokens", tokens), ("action_mask", mask), ("sampler_logprobs", sampler)):
        np.testing.assert_array_equal(unpack_rows(getattr(batch.rows, name), batch), want, err_msg=name)
    _check_segments(batch, lengths)
    # without a budget the same call keeps the given count
    plain = _pack(tokens, mask, sampler, lengths, micro_batches=micro_batches, rows_multiple=rows_multiple,
                  row_len=row_len)
    assert plain.rows.tokens.shape[1] == micro_batches


def test_packing_metrics_of_a_step():
    """update/* scalars of the packed rows, against plain loops over the rows; the dense-attention share only
    where cuDNN reads the rows as packed segments."""
    from agentfly_jax.models import ModelConfig
    from agentfly_jax.trainer.loop import packing_metrics

    rng = np.random.default_rng(11)
    tokens, mask, sampler, lengths = _ragged(rng, n=30, t=10)
    batch = _pack(tokens, mask, sampler, lengths, row_len=40, micro_batches=2, rows_multiple=2)
    seg = batch.rows.segment_ids.reshape(-1, 40)
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, attention_segments=3, attention_impl="cudnn")
    got = packing_metrics(batch, config)
    slots = seg.size
    assert got["update/packed_rows"] == len(seg)
    assert got["update/padding_fraction"] == pytest.approx((slots - lengths.sum()) / slots)
    assert got["update/max_sequences_per_row"] == max(len({int(i) for i in row if i}) for row in seg)

    def runs(row):
        return sum(1 for t in range(len(row)) if t == 0 or row[t] != row[t - 1])

    per_micro = batch.rows.segment_ids.reshape(-1, *batch.rows.segment_ids.shape[-2:])  # [K * M, R, L]
    assert len(per_micro) == 2
    fuller = [any(runs(row) > 3 for row in micro) for micro in per_micro]
    assert 0 < sum(fuller) and got["update/dense_attention_fraction"] == pytest.approx(sum(fuller) / len(fuller))
    # two devices split each micro-batch's rows: each half decides for itself (transformer._cudnn_packed)
    halves = [any(runs(row) > 3 for row in half) for micro in per_micro for half in np.split(micro, 2)]
    assert len(halves) == 4 and sum(halves) < 2 * sum(fuller)  # a case where shards and micro-batches differ
    assert packing_metrics(batch, config, row_shards=2)["update/dense_attention_fraction"] == pytest.approx(
        sum(halves) / 4)
    r = per_micro.shape[1]
    assert packing_metrics(batch, config, row_shards=r + 1)["update/dense_attention_fraction"] == pytest.approx(
        sum(fuller) / len(fuller))  # not a divisor of the rows: whole micro-batches
    assert "update/dense_attention_fraction" not in packing_metrics(batch, config.replace(attention_impl="xla"))
    assert "update/dense_attention_fraction" not in packing_metrics(batch, config.replace(attention_segments=0))
    assert packing_metrics(batch, config.replace(attention_segments=100))["update/dense_attention_fraction"] == 0
