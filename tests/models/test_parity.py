"""Our Flax decoder against transformers (torch CPU) on tiny random checkpoints, fp32."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from agentfly_jax.models import ModelConfig, load_pretrained, load_value_model, save_pretrained
from tests.models import hf_reference as ref

TOL = 1e-4


def _ids(batch, seq, vocab, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq), dtype=np.int32)


@pytest.fixture(scope="module", params=["qwen2", "llama3"])
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    cfg = ref.qwen2_config() if request.param == "qwen2" else ref.llama3_config()
    return request.param, path, ref.build(cfg, path)


def test_config_reads_family_features(checkpoint):
    name, path, _ = checkpoint
    model, params = load_pretrained(path)
    c = model.config
    if name == "qwen2":
        assert (c.family, c.qkv_bias, c.tie_word_embeddings, c.rope_scaling) == ("qwen2", True, True, None)
        assert "lm_head" not in params
        assert params["model"]["layers_0"]["self_attn"]["q_proj"]["bias"].shape == (4, 16)
    else:
        assert (c.family, c.qkv_bias, c.tie_word_embeddings) == ("llama", False, False)
        assert c.rope_scaling["rope_type"] == "llama3" and c.num_kv_heads == 1
        assert params["lm_head"]["kernel"].shape == (64, 211)


def test_logits_match_transformers(checkpoint):
    # seq 48 > original_max_position_embeddings=16, so the llama3 low/medium/high-frequency bands all matter.
    _, path, hf_model = checkpoint
    ids = _ids(3, 48, 211)
    model, params = load_pretrained(path)
    ours = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids)))
    theirs = ref.hf_logits(hf_model, ids)
    assert ours.shape == (3, 48, 211)
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    assert np.abs(theirs).max() > 1.0  # the comparison is not between two near-zero tensors


def test_explicit_positions_match_transformers_position_ids(checkpoint):
    _, path, hf_model = checkpoint
    ids = _ids(2, 20, 211, seed=3)
    positions = np.stack([np.arange(20) + 7, np.arange(20) * 2]).astype(np.int32)
    model, params = load_pretrained(path)
    ours = np.asarray(model.apply({"params": params}, jnp.asarray(ids), positions=jnp.asarray(positions)))
    theirs = ref.hf_logits(hf_model, ids, position_ids=torch.as_tensor(positions, dtype=torch.long))
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)


def test_save_pretrained_round_trip_through_transformers(checkpoint, tmp_path):
    _, path, hf_model = checkpoint
    model, params = load_pretrained(path)
    # Perturb the params so the test cannot pass by copying the input files.
    params = jax.tree.map(lambda p: p * 1.01, params)
    save_pretrained(model, params, str(tmp_path))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(reloaded) is type(hf_model)
    ids = _ids(2, 32, 211, seed=5)
    ours = np.asarray(model.apply({"params": params}, jnp.asarray(ids)))
    np.testing.assert_allclose(ref.hf_logits(reloaded, ids), ours, atol=TOL, rtol=0)
    assert np.abs(ref.hf_logits(hf_model, ids) - ours).max() > 1e-3  # perturbation visible
    # and our own loader reads our files back to identical params
    _, params2 = load_pretrained(str(tmp_path))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def test_sharded_checkpoint_with_index(checkpoint, tmp_path):
    _, path, hf_model = checkpoint
    model, params = load_pretrained(path)
    save_pretrained(model, params, str(tmp_path), max_shard_bytes=40_000)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 2
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = _ids(1, 16, 211)
    np.testing.assert_allclose(ref.hf_logits(reloaded, ids), ref.hf_logits(hf_model, ids), atol=1e-6, rtol=0)
    _, params2 = load_pretrained(str(tmp_path))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def test_transformers_sharded_checkpoint_loads(tmp_path):
    hf_model = ref.build(ref.qwen2_config(), str(tmp_path / "src"))
    hf_model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="50KB")
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    model, params = load_pretrained(str(tmp_path / "sharded"))
    ids = _ids(2, 12, 211)
    np.testing.assert_allclose(np.asarray(model.apply({"params": params}, jnp.asarray(ids))),
                               ref.hf_logits(hf_model, ids), atol=TOL, rtol=0)


def test_bf16_params_and_compute(checkpoint):
    _, path, hf_model = checkpoint
    model, params = load_pretrained(path, dtype=jnp.bfloat16)
    assert model.config.dtype == jnp.bfloat16
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    ids = _ids(2, 24, 211)
    ours = model.apply({"params": params}, jnp.asarray(ids))
    assert ours.dtype == jnp.bfloat16
    theirs = ref.hf_logits(hf_model, ids)
    # bf16 has 8 mantissa bits: compare loosely against fp32 and check the ranking of tokens mostly agrees.
    err = np.abs(np.asarray(ours, np.float32) - theirs)
    assert err.mean() < 0.05 * np.abs(theirs).mean()
    agree = (np.asarray(ours, np.float32).argmax(-1) == theirs.argmax(-1)).mean()
    assert agree > 0.9


def test_value_model_from_policy_checkpoint_and_round_trip(checkpoint, tmp_path):
    name, path, _ = checkpoint
    model, params = load_value_model(path)
    ids = _ids(2, 10, 211)
    values = model.apply({"params": params}, jnp.asarray(ids))
    assert values.shape == (2, 10) and values.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(values), 0.0)  # zero-initialised head
    # trunk equals the policy trunk
    policy, pparams = load_pretrained(path)
    jax.tree.map(np.testing.assert_array_equal, params["model"], pparams["model"])
    # a trained head is saved as a token-classification checkpoint that transformers evaluates identically
    rng = np.random.default_rng(0)
    params["value_head"] = {"kernel": jnp.asarray(rng.normal(size=(64, 1)), jnp.float32),
                            "bias": jnp.asarray([0.3], jnp.float32)}
    save_pretrained(model, params, str(tmp_path))
    hf_value = transformers.AutoModelForTokenClassification.from_pretrained(str(tmp_path), dtype=torch.float32)
    theirs = ref.hf_logits(hf_value.eval(), ids)[..., 0]
    ours = np.asarray(model.apply({"params": params}, jnp.asarray(ids)))
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    _, params2 = load_value_model(str(tmp_path))
    np.testing.assert_array_equal(np.asarray(params2["value_head"]["bias"]), np.float32([0.3]))


def test_fresh_model_config_round_trip(tmp_path):
    from agentfly_jax.models import CausalLM, init_params
    cfg = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, qkv_bias=True, tie_word_embeddings=True, family="qwen2")
    model = CausalLM(cfg)
    params = init_params(model, jax.random.PRNGKey(0))
    save_pretrained(model, params, str(tmp_path))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = _ids(2, 9, 97)
    np.testing.assert_allclose(np.asarray(model.apply({"params": params}, jnp.asarray(ids))),
                               ref.hf_logits(hf_model, ids), atol=1e-5, rtol=0)
    assert cfg.num_params == sum(p.numel() for p in hf_model.parameters())


def test_fresh_parameters_compiled_as_a_run_once_program_equal_the_default_compilation(monkeypatch):
    """init_params compiles the random initialisation at XLA's CPU optimisation level 0 (a threefry hash per
    parameter made it the slowest compilation of a short run): the values are those of the default compilation up
    to float rounding of the normal transform (a few ulp of 0.02-scale weights), the zero and one initialisers
    exactly; inside a caller's trace it compiles with the caller's program; other backends keep XLA's defaults."""
    from flax import linen as nn

    from agentfly_jax.models.config import run_once_compiler_options
    from agentfly_jax.models.transformer import CausalLM, init_params

    assert run_once_compiler_options() == {"xla_backend_optimization_level": 0}  # this CPU
    model = CausalLM(ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=2,
                                 num_kv_heads=1, qkv_bias=True))
    fast = init_params(model, jax.random.PRNGKey(3))
    default = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(3), jnp.zeros((1, 8), jnp.int32)))["params"]
    assert jax.tree.structure(fast) == jax.tree.structure(default)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(fast), jax.tree.leaves(default)):
        a, b = np.asarray(a), np.asarray(b)
        if not b.any() or (b == 1).all():  # zeros (biases), ones (norms)
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=4 * np.spacing(np.float32(0.1)),
                                       err_msg=jax.tree_util.keystr(path))
            assert 0.015 < b.std() < 0.025
    # staged into a caller's trace (where JAX refuses compiler options on an inner jit) it is a plain jit
    shapes = jax.eval_shape(lambda key: init_params(model, key), jax.random.PRNGKey(3))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(lambda x: (x.shape, x.dtype), fast)
    inner = jax.jit(lambda key: init_params(model, key))(jax.random.PRNGKey(3))
    assert all(np.allclose(a, b, rtol=0, atol=4 * np.spacing(np.float32(0.1)))
               for a, b in zip(jax.tree.leaves(inner), jax.tree.leaves(default)))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert run_once_compiler_options() is None
