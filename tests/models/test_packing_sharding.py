"""Packed sequences (segment_ids) and sharded forward passes on a mesh of 8 fake CPU devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from agentfly_jax.models import CausalLM, ModelConfig, ValueModel, init_params
from agentfly_jax.models import sharding as shd

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, qkv_bias=True, family="qwen2")


@pytest.fixture(scope="module")
def model_params():
    model = CausalLM(CFG)
    params = init_params(model, jax.random.PRNGKey(0))
    params = jax.tree.map(lambda p: p * 3.0 if p.ndim > 1 else p, params)  # larger weights: sharper outputs
    return model, params


def test_packed_sequences_equal_separate(model_params):
    model, params = model_params
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 128, 11), rng.integers(0, 128, 7)
    packed = np.concatenate([a, b, np.zeros(6, int)])[None]  # [1, 24] with 6 padding tokens
    segments = np.array([[1] * 11 + [2] * 7 + [0] * 6])
    positions = np.array([list(range(11)) + list(range(7)) + [0] * 6])
    logits = model.apply({"params": params}, jnp.asarray(packed), positions=jnp.asarray(positions),
                         segment_ids=jnp.asarray(segments))
    alone_a = model.apply({"params": params}, jnp.asarray(a)[None])
    alone_b = model.apply({"params": params}, jnp.asarray(b)[None])
    np.testing.assert_allclose(logits[0, :11], alone_a[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[0, 11:18], alone_b[0], atol=1e-5, rtol=0)
    # without segment ids the second sequence would see the first: the test can tell the difference
    leaky = model.apply({"params": params}, jnp.asarray(packed), positions=jnp.asarray(positions))
    assert np.abs(np.asarray(leaky[0, 11:18] - alone_b[0])).max() > 1e-2


def test_attention_mask_blocks_other_segments_and_future():
    mask = np.asarray(__import__("agentfly_jax.models", fromlist=["attention_mask"]).attention_mask(
        jnp.array([[1, 1, 2, 2, 0]])))[0]
    expected = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]], bool)
    np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("axes", [{"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 2}, {"tensor": 8}])
def test_sharded_forward_equals_single_device(model_params, axes):
    assert len(jax.devices()) == 8, "tests/conftest.py sets 8 fake CPU devices"
    model, params = model_params
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 128, (8, 16)), jnp.int32)
    reference = jax.jit(model.apply)({"params": params}, ids)

    mesh = shd.make_mesh(axes)
    sharded = shd.shard_params(model, params, mesh)
    # the rules really split the big matrices (tensor=8 cannot split 4 heads: those stay replicated)
    q_kernel = sharded["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert q_kernel.sharding.spec == shd.spec_for_shape(P("embed", "heads", "head_dim"), q_kernel.shape, mesh)
    gate = sharded["model"]["layers_0"]["mlp"]["gate_proj"]["kernel"]  # [64, 128]: divisible by every axis
    assert gate.addressable_shards[0].data.size == gate.size // (mesh.shape["fsdp"] * mesh.shape["tensor"])
    ids_sharded = jax.device_put(ids, shd.batch_sharding(mesh))
    with jax.set_mesh(mesh), shd.axis_rules():
        out = jax.jit(model.apply)({"params": sharded}, ids_sharded)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference), atol=1e-5, rtol=0)


def test_uneven_dims_are_replicated_not_rejected():
    mesh = shd.make_mesh({"tensor": 8})
    spec = shd.spec_for_shape(P("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh)
    assert spec == P(None, None, None)
    spec = shd.spec_for_shape(P("embed", "mlp"), (64, 128), mesh)
    assert spec == P(None, "tensor")


def test_value_model_sharded(tmp_path):
    model = ValueModel(CFG)
    params = init_params(model, jax.random.PRNGKey(0))
    params["value_head"]["kernel"] = jnp.ones_like(params["value_head"]["kernel"])
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 128, (4, 8)), jnp.int32)
    reference = model.apply({"params": params}, ids)
    mesh = shd.make_mesh({"fsdp": 4, "tensor": 2})
    with jax.set_mesh(mesh), shd.axis_rules():
        out = jax.jit(model.apply)({"params": shd.shard_params(model, params, mesh)}, ids)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference), atol=1e-5, rtol=0)


def test_make_mesh_errors():
    with pytest.raises(ValueError, match="needs 6 devices"):
        shd.make_mesh({"fsdp": 3, "tensor": 2})
    with pytest.raises(ValueError, match="unknown mesh axes"):
        shd.make_mesh({"model": 8})
    assert shd.make_mesh({"fsdp": -1, "tensor": 2}).shape["fsdp"] == 4
