"""LoRA adapters: fresh adapters change nothing, the merged plain model computes what the adapters compute, a
training step moves only the adapters (and the optimiser keeps moments for them alone), and the exported
checkpoint is a plain one that transformers loads to the same logits."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers
from flax import traverse_util

from agentfly_jax.models import CausalLM, ModelConfig, init_params, load_pretrained, lora, save_pretrained
from agentfly_jax.trainer.batch import pack_step
from agentfly_jax.trainer.state import create_train_state
from agentfly_jax.trainer.update import accumulate_gradients, make_sft_step, sft_loss, take_minibatch
from tests.models import hf_reference as ref

RANK = 4


def _random_adapters(params, seed=3, scale=0.2):
    """Adapters with non-zero B (as after training), so that the adapters really change the outputs."""
    rng = np.random.default_rng(seed)
    flat = traverse_util.flatten_dict(params)
    for path in flat:
        if lora.is_adapter(path):
            flat[path] = jnp.asarray(rng.normal(scale=scale, size=flat[path].shape), jnp.float32)
    return traverse_util.unflatten_dict(flat)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("base"))
    ref.build(ref.qwen2_config(), path)
    base_model, base = load_pretrained(path)
    lora_model, _ = load_pretrained(path, lora_rank=RANK, lora_alpha=8.0)
    return path, base_model, base, lora_model


def _ids(seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 211, size=(2, 24), dtype=np.int32))


def test_fresh_adapters_leave_the_model_unchanged(qwen2):
    _, base_model, base, lora_model = qwen2
    params = lora.lora_init_fn(lora_model)(base, jax.random.PRNGKey(0))
    adapters = [p for p in traverse_util.flatten_dict(params) if lora.is_adapter(p)]
    # 2 layers x 7 projections x (A, B); nothing else is added and the base is untouched
    assert len(adapters) == 2 * 7 * 2
    assert lora.split_trainable(params)[1] == base or jax.tree.all(
        jax.tree.map(lambda a, b: bool((a == b).all()), lora.split_trainable(params)[1], base))
    q = params["model"]["layers_0"]["self_attn"]["q_proj"]
    assert q["lora_a"].shape == (64, RANK) and q["lora_b"].shape == (RANK, 4, 16)
    assert float(jnp.abs(q["lora_a"]).max()) <= 1 / np.sqrt(64) and float(jnp.abs(q["lora_b"]).max()) == 0.0
    o = params["model"]["layers_1"]["self_attn"]["o_proj"]
    assert o["lora_a"].shape == (4, 16, RANK) and o["lora_b"].shape == (RANK, 64)
    ids = _ids()
    np.testing.assert_array_equal(lora_model.apply({"params": params}, ids), base_model.apply({"params": base}, ids))


def test_merged_plain_model_equals_the_adapter_forward(qwen2):
    _, base_model, base, lora_model = qwen2
    params = _random_adapters(lora.lora_init_fn(lora_model)(base, jax.random.PRNGKey(0)))
    ids = _ids(1)
    with_adapters = np.asarray(lora_model.apply({"params": params}, ids))
    merged = lora.merge_lora(params, lora_model.config.lora_scale)
    assert not lora.has_adapters(merged)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    plain = np.asarray(base_model.apply({"params": merged}, ids))
    np.testing.assert_allclose(plain, with_adapters, atol=1e-5, rtol=0)
    # the adapters matter: the base model's logits are far from both
    assert np.abs(np.asarray(base_model.apply({"params": base}, ids)) - plain).max() > 0.1


@pytest.mark.parametrize("kernel,a,b", [((6, 3, 5), (6, 2), (2, 3, 5)), ((3, 5, 6), (3, 5, 2), (2, 6)),
                                        ((6, 7), (6, 2), (2, 7))])
def test_merged_kernel_matches_numpy(kernel, a, b):
    rng = np.random.default_rng(0)
    w, la, lb = (rng.normal(size=s).astype(np.float32) for s in (kernel, a, b))
    want = w + 0.5 * np.tensordot(la.astype(np.float64), lb.astype(np.float64), axes=1)
    np.testing.assert_allclose(lora.merged_kernel(w, la, lb, 0.5), want, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="do not make the kernel's"):
        lora.merged_kernel(w, la, lb[..., :1], 0.5)


def _sft_rows(vocab, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(4, 32)).astype(np.int32)
    mask = np.zeros((4, 32), np.float32)
    mask[:, 8:] = 1.0
    lengths = np.full(4, 32)
    batch = pack_step(tokens, mask, np.zeros_like(mask), lengths, rewards=np.zeros(4, np.float32),
                      group_ids=np.arange(4), minibatch=np.zeros(4, np.int32), num_minibatches=1, micro_batches=2,
                      row_len=32)
    return jax.tree.map(jnp.asarray, take_minibatch(batch.rows, 0))


def test_a_lora_step_trains_only_the_adapters(qwen2):
    _, _, base, lora_model = qwen2
    params = _random_adapters(lora.lora_init_fn(lora_model)(base, jax.random.PRNGKey(0)), scale=0.05)
    rows = _sft_rows(211)
    # gradients are taken for the adapters only
    grads, _ = jax.jit(lambda p, r: accumulate_gradients(lambda q, b: sft_loss(q, b, lora_model), p, r,
                                                         lora.is_adapter))(params, rows)
    assert all(lora.is_adapter(path) for path in traverse_util.flatten_dict(grads))
    assert lora.adapter_count(grads) == lora.adapter_count(params)

    adam = optax.adam(1e-2)
    state = create_train_state(jax.tree.map(jnp.copy, params), adam, trainable=lora.is_adapter)
    # the optimiser's moments cover the adapters alone: 2 moments x adapter values (+ scalar counters)
    moments = sum(int(x.size) for x in jax.tree.leaves(state.policy.opt_state) if x.ndim > 0)
    assert moments == 2 * lora.adapter_count(params)
    step = make_sft_step(lora_model, adam, trainable=lora.is_adapter)
    new_state, metrics = step(state, rows)
    before = {p: np.asarray(v) for p, v in traverse_util.flatten_dict(params).items()}
    after = {p: np.asarray(v) for p, v in traverse_util.flatten_dict(new_state.policy.params).items()}  # copies:
    changed = {p for p in before if not np.array_equal(before[p], after[p])}  # the next step donates the state
    assert changed and all(lora.is_adapter(p) for p in changed)
    assert len(changed) == len([p for p in before if lora.is_adapter(p)])  # every adapter moved
    assert float(metrics["sft/grad_norm"]) > 0
    # a second step keeps working on the carried (adapter-only) optimiser state
    newer, _ = step(new_state, rows)
    assert float(jnp.abs(newer.policy.params["model"]["layers_0"]["mlp"]["up_proj"]["lora_b"]
                         - after[("model", "layers_0", "mlp", "up_proj", "lora_b")]).max()) > 0


def test_export_is_a_plain_checkpoint_transformers_loads(qwen2, tmp_path):
    _, _, base, lora_model = qwen2
    params = _random_adapters(lora.lora_init_fn(lora_model)(base, jax.random.PRNGKey(1)))
    out = str(tmp_path / "merged")
    save_pretrained(lora_model, params, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="float32")
    assert not any("lora" in name for name, _ in hf.named_parameters())
    ids = np.asarray(_ids(2))
    ours = np.asarray(lora_model.apply({"params": params}, jnp.asarray(ids)))
    np.testing.assert_allclose(ref.hf_logits(hf, ids), ours, atol=1e-4, rtol=0)
    reloaded, merged = load_pretrained(out)  # and it is a plain checkpoint for us too
    assert reloaded.config.lora_rank == 0 and not lora.has_adapters(merged)
    # adapters handed to a plain model's writer are refused, not dropped
    with pytest.raises(ValueError, match="params hold LoRA adapters but the model config has lora_rank=0"):
        save_pretrained(reloaded, params, str(tmp_path / "wrong"))


def test_targets_and_rank_are_checked():
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"lora_targets \['qkv'\] are not projections"):
        ModelConfig(**base, lora_rank=2, lora_targets=("qkv",))
    with pytest.raises(ValueError, match="lora_rank must be >= 0"):
        ModelConfig(**base, lora_rank=-1)
    only_attention = CausalLM(ModelConfig(**base, lora_rank=2, lora_targets=("q_proj", "v_proj")))
    params = init_params(only_attention, jax.random.PRNGKey(0))
    with_adapters = {p[-2] for p in traverse_util.flatten_dict(params) if lora.is_adapter(p)}
    assert with_adapters == {"q_proj", "v_proj"}
