"""`optimizer.fused`: the fused clip + AdamW step (trainer/fused_adamw.py) against optax's
chain(clip_by_global_norm, adamw): bit for bit in fp32 when the global norm is exact (integer gradients times a
power of two, so the sum of squares does not depend on its order), with clipping on and off, a weight-decay
mask and a warmup + cosine schedule; in the trainer's step, under an fsdp x tensor mesh (no gathers), for LoRA
adapters, across an orbax checkpoint, and the non-finite skip."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from agentfly_jax.models import CausalLM, ModelConfig, init_params
from agentfly_jax.models import lora
from agentfly_jax.models import sharding as shd
from agentfly_jax.trainer import OptimizerConfig, create_train_state, make_optimizer, state_shardings
from agentfly_jax.trainer.config import ConfigError, TrainConfig
from agentfly_jax.trainer.fused_adamw import FusedAdamWState, FusedClipAdamW, fused_clip_adamw, plan
from agentfly_jax.trainer.state import learning_rate_schedule
from agentfly_jax.trainer.update import _apply
from experiments import quickstart

SCHEDULE = OptimizerConfig(learning_rate=1e-2, warmup_steps=2, decay_steps=6, schedule="cosine", end_lr_ratio=0.1)


def _params(rng):
    """A layered tree: two layers of the same roles, an embedding and a final norm."""
    def layer():
        return {"attn": {"kernel": rng.normal(size=(8, 4, 2)), "bias": rng.normal(size=(4, 2))},
                "mlp": {"kernel": rng.normal(size=(8, 12))}, "norm": {"scale": 1 + rng.normal(size=(8,))}}
    tree = {"embed": rng.normal(size=(20, 8)), "layers_0": layer(), "layers_1": layer(), "final_norm": np.ones(8)}
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _grads(rng, like, scale):
    """Integers in [-8, 8] times a power of two: every square and partial sum is exact in fp32."""
    return jax.tree.map(lambda x: jnp.asarray(rng.integers(-8, 9, x.shape) * scale, jnp.float32), like)


def _no_bias_or_norm(params):
    return jax.tree_util.tree_map_with_path(lambda path, x: x.ndim > 1 and "norm" not in jax.tree_util.keystr(path),
                                            params)


def _unstacked(fused_state, params, stack_max_size):
    """The fused state's moments as per-leaf trees (optax's layout)."""
    treedef, groups = plan(params, None, stack_max_size)
    out = []
    for moments in (fused_state.mu, fused_state.nu):
        leaves = [None] * treedef.num_leaves
        for g, m in zip(groups, moments):
            for j, i in enumerate(g.leaves):
                leaves[i] = m if len(g.leaves) == 1 else m[j]
        out.append(jax.tree.unflatten(treedef, leaves))
    return out


# stack_max_size -> groups: None stacks every role (embed, final norm, 4 roles x 2 layers: 6 groups), 0 none
# (10 leaves), 20 only the biases and norm scales (8 values each: 8 groups)
@pytest.mark.parametrize("stack_max_size,n_groups,max_norm,weight_decay,mask", [
    (None, 6, 1.0, 0.1, _no_bias_or_norm), (0, 10, 1.0, 0.1, _no_bias_or_norm), (20, 8, 1.0, 0.1, _no_bias_or_norm),
    (None, 6, 0.0, 0.1, None),  # no clipping
    (20, 8, 3.0, 0.0, None),  # no weight decay
])
def test_equals_optax_clip_adamw_bit_for_bit(stack_max_size, n_groups, max_norm, weight_decay, mask):
    rng = np.random.default_rng(0)
    params = _params(rng)
    lr = learning_rate_schedule(SCHEDULE)
    adamw = optax.adamw(lr, b1=0.9, b2=0.99, eps=1e-8, weight_decay=weight_decay, mask=mask)
    ref = optax.chain(optax.clip_by_global_norm(max_norm), adamw) if max_norm > 0 else adamw
    fused = fused_clip_adamw(lr, b1=0.9, b2=0.99, eps=1e-8, weight_decay=weight_decay, max_grad_norm=max_norm,
                             mask=mask, stack_max_size=stack_max_size, update_norm="exact")

    @jax.jit
    def ref_step(g, s, p):
        u, s = ref.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    fused_step = jax.jit(fused.fused_step)
    fused_update = jax.jit(fused.update)
    p_ref, p_fused = params, params
    s_ref, s_fused = ref.init(params), fused.init(params)
    assert len(s_fused.mu) == n_groups
    clipped = []
    for t in range(7):
        g = _grads(rng, params, 4.0 if t % 2 else 2.0 ** -10)  # global norm ~150 on odd steps, ~0.04 on even
        norm = float(optax.tree.norm(g))
        clipped.append(norm > max_norm > 0)
        updates, _ = fused_update(g, s_fused, p_fused)
        p_ref, s_ref, u_ref = ref_step(g, s_ref, p_ref)
        p_fused, s_fused, stats = fused_step(g, s_fused, p_fused)
        jax.tree.map(np.testing.assert_array_equal, updates, u_ref)
        jax.tree.map(np.testing.assert_array_equal, p_fused, p_ref)
        adam = s_ref[1][0] if max_norm > 0 else s_ref[0]
        mu, nu = _unstacked(s_fused, params, stack_max_size)
        jax.tree.map(np.testing.assert_array_equal, (mu, nu), (adam.mu, adam.nu))
        assert int(s_fused.count) == int(adam.count) == t + 1
        assert float(stats.grad_norm) == norm and bool(stats.finite)
        np.testing.assert_allclose(float(stats.update_norm), float(optax.tree.norm(u_ref)), rtol=1e-6)
    assert (max_norm > 0) == any(clipped) and not all(clipped)  # clipping both active and inactive
    assert float(jnp.max(jnp.abs(p_fused["layers_1"]["mlp"]["kernel"] - params["layers_1"]["mlp"]["kernel"]))) > 1e-3


def test_groups_stack_same_role_across_layers():
    params = _params(np.random.default_rng(0))
    state = fused_clip_adamw(1e-3, max_grad_norm=1.0).init(params)
    # each role's two layers stacked; the embedding and the final norm alone
    assert sorted(tuple(m.shape) for m in state.mu) == sorted([(20, 8), (8,), (2, 4, 2), (2, 8, 4, 2), (2, 8, 12),
                                                               (2, 8)])
    # a decay mask splits a role group only where it differs between layers
    mask = jax.tree_util.tree_map_with_path(lambda p, x: "layers_0" in jax.tree_util.keystr(p), params)
    assert len(plan(params, mask)[1]) == len(plan(params)[1]) + 4


def test_config_switch_builds_the_fused_optimizer():
    assert isinstance(make_optimizer(OptimizerConfig(fused="stacked")), FusedClipAdamW)
    assert isinstance(make_optimizer(OptimizerConfig()), FusedClipAdamW)  # the default: "hybrid"
    assert not isinstance(make_optimizer(OptimizerConfig(fused="off")), FusedClipAdamW)
    config = quickstart.get_config().to_dict()
    config["optimizer"]["fused"] = "per_leaf"
    assert TrainConfig.build(config).optimizer.fused == "per_leaf"
    config["optimizer"]["fused"] = "yes"
    with pytest.raises(ConfigError, match=r"config\.optimizer\.fused='yes' is out of range"):
        TrainConfig.build(config)
    with pytest.raises(ValueError, match="b1"):
        fused_clip_adamw(1e-3, b1=1.0)


def _jitted_apply(optimizer, trainable=None):
    return jax.jit(lambda ms, g: _apply(ms, g, optimizer, trainable))


def test_trainer_apply_matches_and_skips_nonfinite():
    rng = np.random.default_rng(1)
    params = _params(rng)
    cfg = OptimizerConfig(learning_rate=1e-2, warmup_steps=2, decay_steps=6, weight_decay=0.05, max_grad_norm=1.0)
    fused, ref = make_optimizer(OptimizerConfig(**{**cfg.__dict__, "fused": "stacked"})), make_optimizer(cfg)
    ms_f, ms_r = create_train_state(params, fused).policy, create_train_state(params, ref).policy
    apply_f, apply_r = _jitted_apply(fused), _jitted_apply(ref)
    for t in range(3):
        g = _grads(rng, params, 1.0)
        (ms_f, m_f), (ms_r, m_r) = apply_f(ms_f, g), apply_r(ms_r, g)
        jax.tree.map(np.testing.assert_array_equal, ms_f.params, ms_r.params)
        for k in ("grad_norm", "update_norm", "param_norm"):
            np.testing.assert_allclose(float(m_f[k]), float(m_r[k]), rtol=1e-6, err_msg=k)
        assert float(m_f["nonfinite"]) == 0.0
    bad = _grads(rng, params, 1.0)
    bad["layers_1"]["mlp"]["kernel"] = bad["layers_1"]["mlp"]["kernel"].at[0, 0].set(jnp.nan)
    before = jax.tree.map(np.asarray, ms_f)
    ms_f, m_f = apply_f(ms_f, bad)
    assert float(m_f["nonfinite"]) == 1.0
    jax.tree.map(np.testing.assert_array_equal, ms_f, before)  # params, moments and count unchanged


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fused", ["hybrid", "off"])
def test_update_norm_settings(fused, dtype):
    """optimizer.update_norm on both paths: "applied" is the norm of the stored parameters' change (float64 from
    the parameters before and after), "exact" optax's norm of the fp32 update, "off" leaves the metric out; a
    skipped (non-finite) step changed nothing, so its applied norm is 0."""
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda x: x.astype(dtype), _params(rng))
    cfg = OptimizerConfig(learning_rate=1e-2, weight_decay=0.05, max_grad_norm=1.0, fused=fused)
    runs = {}
    for update_norm in ("applied", "exact", "off"):
        optimizer = make_optimizer(OptimizerConfig(**{**cfg.__dict__, "update_norm": update_norm}))
        ms = create_train_state(params, optimizer).policy
        runs[update_norm] = _jitted_apply(optimizer)(ms, jax.tree.map(lambda x: x.astype(dtype),
                                                                      _grads(rng, params, 1.0)))
        rng = np.random.default_rng(3)  # the same gradients for every setting
        _params(rng)
    (new, metrics), (new_exact, exact), (new_off, off) = runs["applied"], runs["exact"], runs["off"]
    jax.tree.map(np.testing.assert_array_equal, new.params, new_exact.params)  # the step itself is the same
    jax.tree.map(np.testing.assert_array_equal, new.params, new_off.params)
    change = np.sqrt(sum(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
                         for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(params))))
    np.testing.assert_allclose(float(metrics["update_norm"]), change, rtol=1e-5)
    assert "update_norm" not in off and set(off) == {"grad_norm", "param_norm", "nonfinite"}
    if dtype == jnp.float32:  # the update is the change, up to the rounding of p + u
        np.testing.assert_allclose(float(exact["update_norm"]), change, rtol=1e-4)
    else:  # bf16: the fp32 update is not what was stored
        assert float(exact["update_norm"]) != pytest.approx(change, rel=1e-3)
    optimizer = make_optimizer(cfg)
    bad = jax.tree.map(lambda x: x.astype(dtype), _grads(rng, params, 1.0))
    bad["layers_1"]["mlp"]["kernel"] = bad["layers_1"]["mlp"]["kernel"].at[0, 0].set(jnp.nan)
    _, skipped = _jitted_apply(optimizer)(create_train_state(params, optimizer).policy, bad)
    assert float(skipped["nonfinite"]) == 1.0 and float(skipped["update_norm"]) == 0.0
    with pytest.raises(ValueError, match="update_norm"):
        fused_clip_adamw(1e-3, update_norm="approx")


def test_lora_adapters_only():
    """With `trainable` the optimiser sees the adapters alone; the frozen kernels pass through unchanged."""
    rng = np.random.default_rng(2)
    layer = lambda: {"q": {"kernel": rng.normal(size=(8, 8)), "lora_a": rng.normal(size=(8, 2)),  # noqa: E731
                           "lora_b": rng.normal(size=(2, 8))}}
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), {"layers_0": layer(), "layers_1": layer()})
    cfg = OptimizerConfig(learning_rate=1e-2, weight_decay=0.1, max_grad_norm=1.0)
    fused, ref = make_optimizer(OptimizerConfig(**{**cfg.__dict__, "fused": "stacked"})), make_optimizer(cfg)
    ms_f = create_train_state(params, fused, trainable=lora.is_adapter).policy
    ms_r = create_train_state(params, ref, trainable=lora.is_adapter).policy
    assert sorted(m.shape for m in ms_f.opt_state.mu) == [(2, 2, 8), (2, 8, 2)]  # adapters only, stacked
    apply_f, apply_r = _jitted_apply(fused, lora.is_adapter), _jitted_apply(ref, lora.is_adapter)
    for _ in range(2):
        g = _grads(rng, lora.split_trainable(params, lora.is_adapter)[0], 1.0)
        (ms_f, _), (ms_r, _) = apply_f(ms_f, g), apply_r(ms_r, g)
        jax.tree.map(np.testing.assert_array_equal, ms_f.params, ms_r.params)
    np.testing.assert_array_equal(ms_f.params["layers_1"]["q"]["kernel"], params["layers_1"]["q"]["kernel"])
    assert not np.array_equal(ms_f.params["layers_1"]["q"]["lora_b"], params["layers_1"]["q"]["lora_b"])


def test_sharded_mesh_no_gathers_and_same_result(tmp_path):
    """fsdp=4 x tensor=2 on the 8 CPU devices: stacked moments are sharded like their leaves (stacking axis
    unsharded), the compiled step moves no parameter data between devices (only the norms' all-reduces), and the
    result equals the single-device step bit for bit. The sharded state survives an orbax save and restore."""
    assert jax.device_count() == 8
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, qkv_bias=True, family="qwen2")
    model = CausalLM(config)
    rng = np.random.default_rng(3)
    shapes = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))  # traced only: no compile
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2, weight_decay=0.1, fused="stacked"))
    grads = [_grads(rng, params, 2.0 ** -4) for _ in range(2)]
    single = create_train_state(jax.tree.map(jnp.asarray, params), optimizer).policy
    step = jax.jit(lambda ms, g: _apply(ms, g, optimizer), donate_argnums=0)
    for g in grads:
        single, _ = step(single, g)

    mesh = shd.make_mesh({"fsdp": 4, "tensor": 2})
    state = create_train_state(jax.tree.map(jnp.asarray, params), optimizer)
    sharding = state_shardings(state, mesh, policy_model=model, policy_opt=optimizer)
    state = jax.device_put(state, sharding)
    _, groups = plan(params)
    kernel = jax.tree_util.tree_flatten_with_path(params)[0]
    gate = next(k for k, g in enumerate(groups)
                if "layers_0']['mlp']['gate_proj']['kernel" in jax.tree_util.keystr(kernel[g.leaves[0]][0]))
    assert len(groups[gate].leaves) == 2
    assert state.policy.opt_state.mu[gate].sharding.spec == P(None, "fsdp", "tensor")
    ms = state.policy
    sharded_grads = [jax.device_put(g, sharding.policy.params) for g in grads]
    sharded_step = jax.jit(lambda ms, g: _apply(ms, g, optimizer), donate_argnums=0,
                           out_shardings=(sharding.policy, None))
    compiled = sharded_step.lower(ms, sharded_grads[0]).compile()
    hlo = compiled.as_text()
    assert "all-reduce" in hlo
    for collective in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert collective not in hlo, collective
    for g in sharded_grads:
        ms, _ = compiled(ms, g)
    jax.tree.map(np.testing.assert_array_equal, ms, single)
    assert ms.opt_state.mu[gate].sharding.spec == P(None, "fsdp", "tensor")

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "opt", ms.opt_state)
    ckpt.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, ms.opt_state)
    restored = ckpt.restore(tmp_path / "opt", abstract)
    assert isinstance(restored, FusedAdamWState)
    jax.tree.map(np.testing.assert_array_equal, restored, ms.opt_state)
    assert restored.mu[gate].sharding.spec == P(None, "fsdp", "tensor")
