"""Packed rows handed to cuDNN as segment starts and lengths (`ModelConfig.attention_segments`).

cuDNN runs only on a GPU; here the layout is checked against the segment mask it replaces, and the model's
plumbing (which kernel a batch takes, row splits, sharding, gradients) runs with two FAKE kernels standing in for
cuDNN's: einsum attention over the mask that cuDNN's documented packed semantics give (a query attends to the
keys of its own segment up to itself), and over the dense mask. `scripts/bench_train_attention.py` compares the
real kernels with the einsum path on a GPU.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentfly_jax.models import CausalLM, ModelConfig, init_params
from agentfly_jax.models import sharding as shd
from agentfly_jax.models import transformer
from agentfly_jax.models.transformer import SegmentMask, attention_mask, segment_layout


def packed_rows(rng, rows: int, length: int, max_sequences: int) -> np.ndarray:
    """Segment ids as the trainer packs them: 1, 2, ... contiguous, then padding (0) on some rows."""
    out = np.zeros((rows, length), np.int32)
    for r in range(rows):
        n = int(rng.integers(1, max_sequences + 1))
        used = length if r % 2 else int(rng.integers(n, length + 1))
        cuts = np.sort(rng.choice(np.arange(1, used), size=n - 1, replace=False)) if n > 1 else []
        bounds = [0, *cuts, used]
        for s in range(n):
            out[r, bounds[s]:bounds[s + 1]] = s + 1
    return out


def runs_reference(row: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each run of equal ids, by a plain loop."""
    runs, start = [], 0
    for t in range(1, len(row) + 1):
        if t == len(row) or row[t] != row[t - 1]:
            runs.append((start, t - start))
            start = t
    return runs


def mask_from_layout(lengths: np.ndarray, offsets: np.ndarray, length: int) -> np.ndarray:
    """[B, T, T] what cuDNN's packed causal attention lets a query see: keys of its own segment, up to itself."""
    b = lengths.shape[0]
    mask = np.zeros((b, length, length), bool)
    for r in range(b):
        for j in range(lengths.shape[1]):
            if lengths[r, j] < 0:
                assert offsets[r, j] == -1 and (lengths[r, j:] == -1).all()
                break
            o, n = offsets[r, j], lengths[r, j]
            mask[r, o:o + n, o:o + n] = np.tril(np.ones((n, n), bool))
    return mask


def test_segment_layout_against_a_loop():
    rng = np.random.default_rng(0)
    seg = packed_rows(rng, 16, 40, 5)
    seg[0] = 7  # one run filling the row
    seg[1, :] = [1] * 10 + [2] * 10 + [1] * 10 + [0] * 10  # an id coming back later is a new run
    lengths, offsets, most = map(np.asarray, segment_layout(jnp.asarray(seg), 6))
    assert lengths.shape == (16, 6) and offsets.shape == (16, 7) and lengths.dtype == offsets.dtype == np.int32
    for r in range(16):
        runs = runs_reference(seg[r])
        assert [(int(o), int(n)) for o, n in zip(offsets[r], lengths[r]) if n >= 0] == runs
        assert (lengths[r, len(runs):] == -1).all() and (offsets[r, len(runs):] == -1).all()
    assert int(most) == max(len(runs_reference(row)) for row in seg)


def test_layout_describes_the_segment_mask():
    rng = np.random.default_rng(1)
    seg = packed_rows(rng, 12, 48, 4)
    lengths, offsets, _ = map(np.asarray, segment_layout(jnp.asarray(seg), 5))
    np.testing.assert_array_equal(mask_from_layout(lengths, offsets, 48), np.asarray(attention_mask(jnp.asarray(seg))))


def test_too_many_runs_are_reported_not_dropped():
    seg = jnp.asarray(np.repeat(np.arange(1, 9), 3)[None].astype(np.int32))  # 8 runs of 3
    lengths, offsets, most = segment_layout(seg, 4)
    assert int(most) == 8  # more than the 4 described: the caller must take the dense path
    assert np.asarray(lengths)[0].tolist() == [3, 3, 3, 3]


# ------------------------------------------------------------------------------------------ model plumbing
CFG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  qkv_bias=True, family="qwen2", attention_impl="cudnn")


@pytest.fixture
def fake_cudnn(monkeypatch):
    """FAKE cuDNN kernels (einsum attention) and a backend choice that takes them; records which kernel ran."""
    class Ran(list):
        shapes: list  # the queries' shapes the packed kernel was traced with
        bounds: list  # the bound (layout slots) of each packed call that ran

    ran = Ran()
    ran.shapes, ran.bounds = [], []

    def einsum(q, k, v, mask, label):
        jax.debug.callback(lambda: ran.append(label))
        return transformer.dot_product_attention(q, k, v, mask, "xla")

    def packed(q, k, v, lengths, offsets):
        ran.shapes.append(q.shape)
        jax.debug.callback(lambda: ran.bounds.append(lengths.shape[1]))
        # the mask cuDNN's documented packed semantics give, built from the layout alone
        t = q.shape[1]
        pos = jnp.arange(t)
        start = offsets[:, :-1, None]  # [B, M, 1]
        inside = (pos >= start) & (pos < start + lengths[:, :, None]) & (lengths[:, :, None] >= 0)  # [B, M, T]
        same = jnp.einsum("bmt,bms->bts", inside.astype(jnp.int32), inside.astype(jnp.int32)) > 0
        return einsum(q, k, v, same & (pos[None, :, None] >= pos[None, None, :]), "packed")

    monkeypatch.setattr(transformer, "_packed_kernel", packed)
    monkeypatch.setattr(transformer, "_dense_kernel", lambda q, k, v, mask: einsum(q, k, v, mask, "dense"))
    monkeypatch.setattr(transformer, "resolve_attention_impl", lambda impl, dtype: "cudnn" if impl != "xla" else "xla")
    return ran


def _batch(rng, rows=8, length=24, max_sequences=3):
    seg = packed_rows(rng, rows, length, max_sequences)
    ids = rng.integers(1, CFG.vocab_size, (rows, length)).astype(np.int32) * (seg > 0)
    positions = np.zeros_like(seg)
    for r in range(rows):
        for start, n in runs_reference(seg[r]):
            positions[r, start:start + n] = np.arange(n)
    return jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(seg)


@pytest.mark.parametrize("splits", [1, 2])
def test_model_takes_the_packed_kernel_and_matches_the_einsum_path(fake_cudnn, splits):
    rng = np.random.default_rng(2)
    ids, positions, seg = _batch(rng)
    reference_model = CausalLM(CFG.replace(attention_impl="xla"))
    params = init_params(reference_model, jax.random.PRNGKey(0))
    model = CausalLM(CFG.replace(attention_segments=4, layer_row_splits=splits))

    def value_and_grad(m):
        def loss(p):
            logits = m.apply({"params": p}, ids, positions, seg)
            return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * (seg > 0))
        return jax.jit(jax.value_and_grad(loss))(params)

    want, want_grad = value_and_grad(reference_model)
    fake_cudnn.clear()
    got, got_grad = value_and_grad(model)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5),
                 got_grad, want_grad)
    assert set(fake_cudnn) == {"packed"}, fake_cudnn  # forward and backward of both layers (and row groups)


def test_a_row_with_more_runs_takes_the_dense_kernel(fake_cudnn):
    rng = np.random.default_rng(3)
    ids, positions, seg = _batch(rng, max_sequences=5)
    assert int(segment_layout(seg, 3)[2]) > 3
    params = init_params(CausalLM(CFG.replace(attention_impl="xla")), jax.random.PRNGKey(0))
    want = CausalLM(CFG.replace(attention_impl="xla")).apply({"params": params}, ids, positions, seg)
    got = jax.jit(CausalLM(CFG.replace(attention_segments=3)).apply)({"params": params}, ids, positions, seg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert fake_cudnn and set(fake_cudnn) == {"dense"}


@pytest.mark.parametrize("max_sequences,bound", [(3, 4), (5, 5)])
def test_sharded_packed_path_equals_one_device(fake_cudnn, max_sequences, bound):
    """Under fsdp 4 x tensor 2 (8 CPU devices) the packed path runs per shard and gives the one-device einsum
    path's loss and gradients; with (5, 5) some shards hold a row of more runs than the bound and take the dense
    kernel on their own rows while others take the packed one."""
    rng = np.random.default_rng(4)
    ids, positions, seg = _batch(rng, max_sequences=max_sequences)
    model, einsum_model = CausalLM(CFG.replace(attention_segments=bound)), CausalLM(CFG.replace(attention_impl="xla"))
    params = init_params(einsum_model, jax.random.PRNGKey(0))

    def loss(m):
        def fn(p, ids, positions, seg):
            logits = m.apply({"params": p}, ids, positions, seg)
            return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * (seg > 0))
        return jax.jit(jax.value_and_grad(fn))

    want, want_grad = loss(einsum_model)(params, ids, positions, seg)
    mesh = shd.make_mesh({"fsdp": 4, "tensor": 2})
    sharded = shd.shard_params(einsum_model, params, mesh)  # the same tree (its init runs causal attention)
    rows = shd.batch_sharding(mesh)
    with jax.set_mesh(mesh), shd.axis_rules():
        got, got_grad = loss(model)(sharded, *(jax.device_put(a, rows) for a in (ids, positions, seg)))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5),
                 got_grad, want_grad)
    shard_runs = [int(segment_layout(seg[i:i + 2], 8)[2]) for i in range(0, 8, 2)]  # each fsdp shard's 2 rows
    mixed = min(shard_runs) <= bound < max(shard_runs)
    assert mixed == (max_sequences == 5), shard_runs  # the batch this test needs
    assert set(fake_cudnn) == ({"packed", "dense"} if mixed else {"packed"}), (fake_cudnn, shard_runs)
    # each device runs the kernel on its own 8/4 rows and 4/2 heads (shard_map), not on gathered q, k, v
    assert set(fake_cudnn.shapes) == {(2, 24, 2, 16)}, fake_cudnn.shapes


def test_einsum_path_ignores_the_setting():
    rng = np.random.default_rng(5)
    ids, positions, seg = _batch(rng)
    base = CausalLM(CFG.replace(attention_impl="xla"))
    params = init_params(base, jax.random.PRNGKey(0))
    with_setting = CausalLM(CFG.replace(attention_impl="xla", attention_segments=4))
    np.testing.assert_array_equal(np.asarray(with_setting.apply({"params": params}, ids, positions, seg)),
                                  np.asarray(base.apply({"params": params}, ids, positions, seg)))
    mask = SegmentMask(seg, 4)  # handed straight to the einsum path: its dense mask
    q = jax.random.normal(jax.random.key(0), (8, 24, 4, 16))
    kv = jax.random.normal(jax.random.key(1), (8, 24, 2, 16))
    np.testing.assert_array_equal(np.asarray(transformer.dot_product_attention(q, kv, kv, mask, "xla")),
                                  np.asarray(transformer.dot_product_attention(q, kv, kv, attention_mask(seg), "xla")))


def test_default_takes_the_packed_kernel_and_zero_the_mask(fake_cudnn):
    """The default bound (8, the trainer's too) hands cuDNN the packed layout; 0 keeps the dense mask."""
    from agentfly_jax.trainer.config import ModelSection
    assert ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                       num_kv_heads=1).attention_segments == ModelSection().attention_segments == 8
    rng = np.random.default_rng(9)
    ids, positions, seg = _batch(rng)
    params = init_params(CausalLM(CFG.replace(attention_impl="xla")), jax.random.PRNGKey(0))
    want = np.asarray(CausalLM(CFG.replace(attention_impl="xla")).apply({"params": params}, ids, positions, seg))
    for bound, kernel in ((CFG.attention_segments, "packed"), (0, "dense")):
        fake_cudnn.clear()
        got = CausalLM(CFG.replace(attention_segments=bound)).apply({"params": params}, ids, positions, seg)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
        assert set(fake_cudnn) == {kernel}


def test_a_bound_above_the_row_length_is_lowered_to_it(fake_cudnn, monkeypatch):
    """A row of T tokens has at most T runs: a larger bound (say 10**6) describes T slots, not a [B, T, 10**6]
    layout."""
    rng = np.random.default_rng(10)
    ids, positions, seg = _batch(rng)  # rows of 24
    seen = []
    layout = transformer.segment_layout
    monkeypatch.setattr(transformer, "segment_layout", lambda s, m: seen.append(m) or layout(s, m))
    params = init_params(CausalLM(CFG.replace(attention_impl="xla")), jax.random.PRNGKey(0))
    want = CausalLM(CFG.replace(attention_impl="xla")).apply({"params": params}, ids, positions, seg)
    got = CausalLM(CFG.replace(attention_segments=10**6)).apply({"params": params}, ids, positions, seg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert seen and max(seen) == 24 and set(fake_cudnn) == {"packed"}


def test_packed_bounds():
    assert transformer.packed_bounds(8) == (2, 8)
    assert transformer.packed_bounds(2) == (2,)
    assert transformer.packed_bounds(1) == (1,)


def test_a_batch_takes_the_smallest_bound_that_holds_its_rows(fake_cudnn):
    """cuDNN's backward zeroes a workspace that grows with the bound on every call: a batch whose fullest row has
    r runs is described with 2 slots where r <= 2 (one sequence and its padding), else with the bound, 8, forward
    and backward, with the same result as the einsum path. One program each, three batches through it."""
    params = init_params(CausalLM(CFG.replace(attention_impl="xla")), jax.random.PRNGKey(0))

    def value_and_grad(m):
        def loss(p, ids, positions, seg):
            logits = m.apply({"params": p}, ids, positions, seg)
            return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * (seg > 0))
        return jax.jit(jax.value_and_grad(loss))

    reference, packed = (value_and_grad(CausalLM(CFG.replace(attention_impl="xla"))),
                         value_and_grad(CausalLM(CFG.replace(attention_segments=8))))
    rng = np.random.default_rng(11)
    taken = {}
    for max_sequences in (1, 2, 3):
        ids, positions, seg = _batch(rng, max_sequences=max_sequences)
        if max_sequences == 1:  # one sequence filling each row: a single run
            seg, ids = jnp.ones_like(seg), jnp.maximum(ids, 1)
            positions = jnp.broadcast_to(jnp.arange(seg.shape[1]), seg.shape)
        runs = int(segment_layout(seg, 8)[2])
        want, want_grad = reference(params, ids, positions, seg)
        fake_cudnn.clear()
        fake_cudnn.bounds.clear()
        got, got_grad = packed(params, ids, positions, seg)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5),
                     got_grad, want_grad)
        assert set(fake_cudnn) == {"packed"}, fake_cudnn
        taken[runs] = set(fake_cudnn.bounds)
    assert taken == {1: {2}, 2: {2}, 4: {8}}, taken  # the fullest row's runs -> the bounds that ran


def test_config_rejects_a_negative_bound():
    with pytest.raises(ValueError, match="attention_segments"):
        CFG.replace(attention_segments=-1)
