"""The jitted update step: micro-batching, packing and sharding leave the update unchanged; it learns."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from agentfly_jax.models import CausalLM, ModelConfig, ValueModel, init_params
from agentfly_jax.models import sharding as shd
from agentfly_jax.trainer import (
    LossConfig,
    OptimizerConfig,
    build_update_batch,
    create_train_state,
    make_logprob_fn,
    make_optimizer,
    make_train_step,
    make_value_fn,
    state_shardings,
)

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  qkv_bias=True, family="qwen2")
T = 24


@pytest.fixture(scope="module")
def policy():
    model = CausalLM(CFG)
    return model, init_params(model, jax.random.PRNGKey(0))


def _multi_turn_batch(seed, n=8):
    """Ragged multi-turn trajectories: prompt, then action spans separated by observation spans."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(T // 2 + 1, T + 1, n)  # > T/2: at most one per row of T tokens
    tokens = np.zeros((n, T), np.int32)
    mask = np.zeros((n, T), np.float32)
    for i, length in enumerate(lengths):
        tokens[i, :length] = rng.integers(1, CFG.vocab_size, length)
        pos = 3  # prompt
        while pos < length:
            span = rng.integers(2, 5)
            mask[i, pos:min(pos + span, length)] = 1.0  # action tokens
            pos += span + rng.integers(1, 4)  # observation tokens
    advantages = (rng.normal(size=(n, 1)) * mask).astype(np.float32)
    return {"tokens": tokens, "action_mask": mask, "advantages": advantages}, lengths


def _with_old_logprobs(model, params, arrays, lengths, noise_seed=0):
    """Adds old logprobs (the policy's own, perturbed so some ratios clip) and sampler logprobs."""
    packed_one, packed = build_update_batch(arrays, lengths, agg="token-mean", row_len=T)
    lp = make_logprob_fn(model)(params, jax.tree.map(lambda x: x[0], packed_one))
    old = packed.unpack(np.asarray(lp), T)
    rng = np.random.default_rng(noise_seed)
    arrays = dict(arrays)
    arrays["old_logprobs"] = (old + 0.3 * rng.normal(size=old.shape) * arrays["action_mask"]).astype(np.float32)
    arrays["sampler_logprobs"] = (old + 0.1 * rng.normal(size=old.shape) * arrays["action_mask"]).astype(np.float32)
    arrays["ref_logprobs"] = (old - 0.2 * arrays["action_mask"]).astype(np.float32)
    return arrays


LOSS = LossConfig(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05, entropy_coef=0.01, is_cap=2.0)


def _fresh(params):
    return jax.tree.map(jnp.copy, params)  # the train step donates its state


def _step(model, params, micro, optimizer, loss_cfg=LOSS, **kw):
    state = create_train_state(_fresh(params), optimizer)
    step = make_train_step(model, loss_cfg, optimizer, **kw)
    new_state, metrics = step(state, jax.tree.map(jnp.asarray, micro))
    return new_state, jax.device_get(metrics)


def _max_diff(a, b):
    return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_two_micro_batches_equal_one_full_batch(policy, agg):
    model, params = policy
    arrays, lengths = _multi_turn_batch(0)
    arrays = _with_old_logprobs(model, params, arrays, lengths)
    sgd = optax.sgd(1.0)  # the update is the gradient itself: differences are not hidden by Adam's sign
    full, _ = build_update_batch(arrays, lengths, agg=agg, row_len=T, micro_batches=1, num_rows=8)
    split, _ = build_update_batch(arrays, lengths, agg=agg, row_len=T, micro_batches=2, num_rows=8)
    s1, m1 = _step(model, params, full, sgd)
    s2, m2 = _step(model, params, split, sgd)
    assert _max_diff(s1.policy.params, s2.policy.params) <= 1e-5
    assert _max_diff(s1.policy.params, params) > 1e-3  # the step did something
    for k in ("policy/loss", "policy/clip_fraction", "policy/entropy", "policy/approx_kl", "policy/ratio_max",
              "policy/is_weight_mean", "policy/kl_ref", "policy/grad_norm"):
        assert abs(m1[k] - m2[k]) <= 1e-5 * max(1.0, abs(m1[k])), k
    assert 0.0 < m1["policy/clip_fraction"] < 1.0


def test_packed_rows_equal_one_trajectory_per_row(policy):
    model, params = policy
    arrays, lengths = _multi_turn_batch(1)
    arrays = _with_old_logprobs(model, params, arrays, lengths)
    sgd = optax.sgd(1.0)
    unpacked, p1 = build_update_batch(arrays, lengths, agg="seq-mean-token-mean", row_len=T)
    packed, p2 = build_update_batch(arrays, lengths, agg="seq-mean-token-mean", row_len=4 * T)
    assert p1.shape[0] == 8 and p2.shape[0] < 8  # really packed
    s1, m1 = _step(model, params, unpacked, sgd)
    s2, m2 = _step(model, params, packed, sgd)
    assert _max_diff(s1.policy.params, s2.policy.params) <= 1e-5
    assert abs(m1["policy/loss"] - m2["policy/loss"]) <= 1e-6


@pytest.mark.parametrize("axes", [{"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 2}])
def test_sharded_update_equals_single_device(policy, axes):
    model, params = policy
    arrays, lengths = _multi_turn_batch(2, n=16)
    arrays = _with_old_logprobs(model, params, arrays, lengths)
    opt_cfg = OptimizerConfig(learning_rate=1e-3, warmup_steps=2, decay_steps=10, weight_decay=0.01)
    optimizer = make_optimizer(opt_cfg)
    micro, _ = build_update_batch(arrays, lengths, agg="token-mean", row_len=T, micro_batches=2, rows_multiple=4)
    reference, ref_metrics = _step(model, params, micro, optimizer)
    reference, _ = make_train_step(model, LOSS, optimizer)(reference, jax.tree.map(jnp.asarray, micro))

    mesh = shd.make_mesh(axes)
    state = create_train_state(shd.shard_params(model, _fresh(params), mesh), optimizer)
    sharding = state_shardings(state, mesh, policy_model=model, policy_opt=optimizer)
    state = jax.device_put(state, sharding)
    mu = state.policy.opt_state[1][0].mu["model"]["layers_0"]["mlp"]["gate_proj"]["kernel"]
    assert mu.sharding.spec == P("fsdp", "tensor")  # Adam moments sharded like their params
    batch_sh = NamedSharding(mesh, P(None, ("data", "fsdp")))
    micro_sharded = {k: jax.device_put(v, batch_sh if v.ndim == 3 else NamedSharding(mesh, P()))
                     for k, v in micro.items()}
    with jax.set_mesh(mesh), shd.axis_rules():
        step = make_train_step(model, LOSS, optimizer, state_sharding=sharding)
        state, metrics = step(state, micro_sharded)
        state, _ = step(state, micro_sharded)
    assert _max_diff(state.policy.params, reference.policy.params) <= 1e-5
    assert abs(float(metrics["policy/loss"]) - float(ref_metrics["policy/loss"])) <= 1e-5
    assert state.policy.params["model"]["layers_0"]["mlp"]["gate_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")


def test_update_raises_logprob_of_positive_advantage_tokens(policy):
    """A bandit-style batch: one prompt, responses with +1 and -1 advantages. Twenty on-policy updates must
    raise the log-probability of the +1 responses and lower that of the -1 responses."""
    model, params = policy
    rng = np.random.default_rng(3)
    n = 8
    prompt = rng.integers(1, CFG.vocab_size, 6)
    tokens = np.zeros((n, 16), np.int32)
    mask = np.zeros((n, 16), np.float32)
    for i in range(n):
        tokens[i] = np.concatenate([prompt, rng.integers(1, CFG.vocab_size, 10)])
        mask[i, 6:] = 1.0
    sign = np.array([1, -1] * (n // 2), np.float32)
    arrays = {"tokens": tokens, "action_mask": mask, "advantages": sign[:, None] * mask}
    lengths = np.full(n, 16)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=3e-3))
    state = create_train_state(_fresh(params), optimizer)
    step = make_train_step(model, LossConfig(), optimizer)
    logprob_fn = make_logprob_fn(model)

    def seq_logprobs(p):
        micro, packed = build_update_batch(arrays, lengths, agg="token-mean", row_len=16)
        lp = packed.unpack(np.asarray(logprob_fn(p, jax.tree.map(lambda x: x[0], micro))), 16)
        return (lp * mask).sum(1)

    before = seq_logprobs(params)
    for _ in range(20):
        micro, packed = build_update_batch(arrays, lengths, agg="token-mean", row_len=16)
        old = logprob_fn(state.policy.params, jax.tree.map(lambda x: jnp.asarray(x[0]), micro))
        micro["old_logprobs"] = np.asarray(old)[None]  # on-policy: old = current policy
        micro["sampler_logprobs"] = micro["old_logprobs"]
        state, metrics = step(state, jax.tree.map(jnp.asarray, micro))
    after = seq_logprobs(state.policy.params)
    gain = after - before
    assert (gain[sign > 0] > 1.0).all(), gain
    assert (gain[sign < 0] < -1.0).all(), gain


def test_ppo_critic_fits_returns(policy):
    model, params = policy
    critic = ValueModel(CFG)
    critic_params = init_params(critic, jax.random.PRNGKey(1))
    arrays, lengths = _multi_turn_batch(4)
    arrays = _with_old_logprobs(model, params, arrays, lengths)
    arrays["returns"] = (arrays["action_mask"] * 0.7).astype(np.float32)
    arrays["old_values"] = np.zeros_like(arrays["returns"])
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    loss_cfg = LossConfig(value_clip_eps=None)
    state = create_train_state(_fresh(params), opt, critic_params=critic_params, critic_opt=opt)
    step = make_train_step(model, loss_cfg, opt, critic_model=critic, critic_opt=opt)
    micro, packed = build_update_batch(arrays, lengths, agg="token-mean", row_len=T)
    micro = jax.tree.map(jnp.asarray, micro)
    losses = []
    for _ in range(15):
        state, metrics = step(state, micro)
        losses.append(float(metrics["critic/loss"]))
    assert losses[0] == pytest.approx(0.5 * 0.49, rel=1e-4)  # zero-initialised head predicts 0
    assert losses[-1] < 0.1 * losses[0]
    values = packed.unpack(np.asarray(make_value_fn(critic)(state.critic.params,
                                                            jax.tree.map(lambda x: x[0], micro))), T)
    on = arrays["action_mask"] > 0
    assert abs(values[on].mean() - 0.7) < 0.1
