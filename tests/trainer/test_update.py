"""The jitted RL step: `prepare` fills the packed batch exactly as the reference estimators would on the
unpacked trajectories; micro-batching, packing and sharding leave the update unchanged; it learns."""
import collections
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from agentfly_jax import algorithms
from agentfly_jax.algorithms.recipes import get_recipe
from agentfly_jax.models import CausalLM, ModelConfig, ValueModel, init_params
from agentfly_jax.models import sharding as shd
from agentfly_jax.trainer import (
    OptimizerConfig,
    create_train_state,
    make_optimizer,
    make_prepare_fn,
    make_train_step,
    pack_step,
    state_shardings,
    take_minibatch,
    token_logprobs,
    unpack_rows,
)
from agentfly_jax.trainer.update import values_of
from tests.algorithms import numpy_reference as ref

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  qkv_bias=True, family="qwen2")
T = 24
RTOL, ATOL = 1e-5, 1e-6
TIGHT = {"rtol": 1e-6, "atol": 1e-7}  # where it holds: logprobs and the group estimators (no long fp32 sums)


@pytest.fixture(scope="module")
def policy():
    model = CausalLM(CFG)
    return model, init_params(model, jax.random.PRNGKey(0))


def _alg(name="grpo", advantage=None, **loss):
    return get_recipe(name).resolve(advantage or {}, loss)


# The knobs every policy-loss term runs with: clip-higher, KL in the loss, entropy bonus, truncated IS.
ALG = _alg(clip_eps=0.2, clip_eps_high=0.28, kl_loss_coef=0.05, entropy_coef=0.01, is_cap=2.0)


def _multi_turn_batch(seed, n=8, min_len=T // 2 + 1):
    """Ragged multi-turn trajectories: prompt, then action spans separated by observation spans. Lengths
    > T/2 by default: at most one per row of T tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, T + 1, n)
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
    return {"tokens": tokens, "action_mask": mask, "advantages": advantages,
            "sampler_logprobs": np.zeros((n, T), np.float32)}, lengths


def _pack(arrays, lengths, *, row_len=T, rewards=None, group_ids=None, minibatch=None, num_minibatches=1, **kw):
    n = len(lengths)
    return pack_step(arrays["tokens"], arrays["action_mask"], arrays["sampler_logprobs"], lengths,
                     rewards=np.zeros(n, np.float32) if rewards is None else rewards,
                     group_ids=np.arange(n) if group_ids is None else group_ids,
                     minibatch=np.zeros(n, np.int32) if minibatch is None else minibatch,
                     num_minibatches=num_minibatches, row_len=row_len, **kw)


def _pack_like(per_trajectory, batch):
    """[N, T] -> packed [K, M, R, L] through the batch's pack_index (0 on padding)."""
    flat = np.concatenate([np.asarray(per_trajectory).reshape(-1), np.zeros(1, np.float32)])
    return flat[np.asarray(batch.pack_index)]


def _packed_apply(fn, batch):
    """fn(rows [R, L]) -> [R, L] on every micro-batch of batch.rows [K, M, R, L], unpacked to [N, T]."""
    rows = batch.rows
    out = np.stack([np.stack([np.asarray(fn(jax.tree.map(lambda x: jnp.asarray(x[k, m]), rows)))
                              for m in range(rows.tokens.shape[1])]) for k in range(rows.tokens.shape[0])])
    return unpack_rows(out, batch)


def _policy_logprobs(model, params, arrays, lengths):
    batch = _pack(arrays, lengths)
    return _packed_apply(lambda rows: token_logprobs(model, params, rows)[0], batch)


def _with_old_logprobs(model, params, arrays, lengths, noise_seed=0):
    """Adds old logprobs (the policy's own, perturbed so some ratios clip), sampler and reference logprobs."""
    old = _policy_logprobs(model, params, arrays, lengths)
    rng = np.random.default_rng(noise_seed)
    arrays = dict(arrays)
    mask = arrays["action_mask"]
    arrays["old_logprobs"] = (old + 0.3 * rng.normal(size=old.shape) * mask).astype(np.float32)
    arrays["sampler_logprobs"] = (old + 0.1 * rng.normal(size=old.shape) * mask).astype(np.float32)
    arrays["ref_logprobs"] = (old - 0.2 * mask).astype(np.float32)
    return arrays


def _filled_minibatch(arrays, lengths, agg, **pack_kw):
    """One mini-batch of rows [M, R, L] filled on the host as `prepare` would: the given old/reference
    logprobs and advantages, and the `agg` loss weights of the whole batch."""
    batch = _pack(arrays, lengths, **pack_kw)
    weights = np.asarray(algorithms.aggregation_weights(jnp.asarray(arrays["action_mask"]), agg))
    rows = batch.rows.replace(**{k: _pack_like(arrays[k], batch)
                                 for k in ("old_logprobs", "ref_logprobs", "advantages")},
                              loss_weights=_pack_like(weights, batch))
    return jax.tree.map(jnp.asarray, take_minibatch(rows, 0))


def _fresh(params):
    return jax.tree.map(jnp.copy, params)  # the train step donates its state


def _step(model, params, micro, optimizer, alg=ALG, **kw):
    state = create_train_state(_fresh(params), optimizer)
    step = make_train_step(model, alg, optimizer, **kw)
    new_state, metrics = step(state, micro)
    return new_state, jax.device_get(metrics)


def _max_diff(a, b):
    return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ========================================================================================= micro, packed, sharded
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_two_micro_batches_equal_one_full_batch(policy, agg):
    model, params = policy
    arrays, lengths = _multi_turn_batch(0)
    arrays = _with_old_logprobs(model, params, arrays, lengths)
    sgd = optax.sgd(1.0)  # the update is the gradient itself: differences are not hidden by Adam's sign
    full = _filled_minibatch(arrays, lengths, agg, micro_batches=1)
    split = _filled_minibatch(arrays, lengths, agg, micro_batches=2)
    assert full.tokens.shape == (1, 8, T) and split.tokens.shape == (2, 4, T)
    s1, m1 = _step(model, params, full, sgd)
    s2, m2 = _step(model, params, split, sgd)
    assert _max_diff(s1.policy.params, s2.policy.params) <= 1e-5
    assert _max_diff(s1.policy.params, params) > 1e-3  # the step did something
    for k in ("policy/loss", "policy/clip_fraction", "policy/entropy", "policy/approx_kl", "policy/ratio_max",
              "policy/is_weight_mean", "policy/kl_ref", "policy/grad_norm"):
        assert abs(m1[k] - m2[k]) <= 1e-5 * max(1.0, abs(m1[k])), k
    assert 0.0 < m1["policy/clip_fraction"] < 1.0


def test_gspo_step_packed_and_micro_batched_equals_one_trajectory_per_row(policy):
    """GSPO's sequence ratio through the train step: packed rows (the loss finds sequences by segment id) and
    two micro-batches give the update of one trajectory per row in one micro-batch."""
    model, params = policy
    arrays, lengths = _multi_turn_batch(4)
    arrays = _with_old_logprobs(model, params, arrays, lengths)
    alg = _alg("gspo", clip_eps=0.05, clip_eps_high=0.08)
    sgd = optax.sgd(1.0)
    unpacked = _filled_minibatch(arrays, lengths, "seq-mean-token-mean", row_len=T)
    packed = _filled_minibatch(arrays, lengths, "seq-mean-token-mean", row_len=4 * T, micro_batches=2)
    assert unpacked.tokens.shape[1] == 8 and packed.tokens.shape[0] == 2  # two micro-batches
    assert packed.tokens.shape[0] * packed.tokens.shape[1] < 8 and packed.segment_ids.max() >= 3  # really packed
    s1, m1 = _step(model, params, unpacked, sgd, alg=alg)
    s2, m2 = _step(model, params, packed, sgd, alg=alg)
    assert _max_diff(s1.policy.params, params) > 1e-4  # the step did something
    assert _max_diff(s1.policy.params, s2.policy.params) <= 1e-5
    for k in ("policy/loss", "policy/clip_fraction", "policy/ratio_mean", "policy/ratio_max"):
        assert abs(m1[k] - m2[k]) <= 1e-5 * max(1.0, abs(m1[k])), k
    assert 0.0 < m1["policy/clip_fraction"] < 1.0
    # the loss is GSPO's: the numpy reference on the unpacked trajectories (old logprobs = the rows' own)
    logprobs = _policy_logprobs(model, params, arrays, lengths)
    want, _, _ = ref.gspo(logprobs, arrays["old_logprobs"], arrays["advantages"], arrays["action_mask"],
                          clip_eps=0.05, clip_eps_high=0.08)
    np.testing.assert_allclose(m1["policy/pg_loss"], want, rtol=1e-4, atol=1e-6)


def test_packed_rows_equal_one_trajectory_per_row(policy):
    model, params = policy
    arrays, lengths = _multi_turn_batch(1)
    arrays = _with_old_logprobs(model, params, arrays, lengths)
    sgd = optax.sgd(1.0)
    unpacked = _filled_minibatch(arrays, lengths, "seq-mean-token-mean", row_len=T)
    packed = _filled_minibatch(arrays, lengths, "seq-mean-token-mean", row_len=4 * T)
    assert unpacked.tokens.shape[1] == 8 and packed.tokens.shape[1] < 8  # really packed
    s1, m1 = _step(model, params, unpacked, sgd)
    s2, m2 = _step(model, params, packed, sgd)
    assert _max_diff(s1.policy.params, s2.policy.params) <= 1e-5
    assert abs(m1["policy/loss"] - m2["policy/loss"]) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("axes", [{"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 2}])
def test_sharded_update_equals_single_device(policy, axes):
    assert jax.device_count() == 8  # tests/conftest.py: XLA_FLAGS=--xla_force_host_platform_device_count=8
    model, params = policy
    arrays, lengths = _multi_turn_batch(2, n=16)
    arrays = _with_old_logprobs(model, params, arrays, lengths)
    opt_cfg = OptimizerConfig(learning_rate=1e-3, warmup_steps=2, decay_steps=10, weight_decay=0.01)
    optimizer = make_optimizer(opt_cfg)
    micro = _filled_minibatch(arrays, lengths, "token-mean", micro_batches=2, rows_multiple=4)
    reference, ref_metrics = _step(model, params, micro, optimizer)
    reference, _ = make_train_step(model, ALG, optimizer)(reference, micro)

    mesh = shd.make_mesh(axes)
    state = create_train_state(shd.shard_params(model, _fresh(params), mesh), optimizer)
    sharding = state_shardings(state, mesh, policy_model=model, policy_opt=optimizer)
    state = jax.device_put(state, sharding)
    # Adam moments sharded like their params: under the default optimizer.fused="hybrid" these small kernels are
    # stacked over the 2 layers (gate_proj and up_proj, both [32, 64] and sharded alike), the stacking axis unsplit
    stacked = [m for m in state.policy.opt_state.mu if m.shape == (2, 32, 64)]
    assert len(stacked) == 2 and all(m.sharding.spec == P(None, "fsdp", "tensor") for m in stacked)
    micro_sharded = jax.device_put(micro, NamedSharding(mesh, P(None, ("data", "fsdp"))))
    assert micro_sharded.tokens.sharding.spec == P(None, ("data", "fsdp"))
    with jax.set_mesh(mesh), shd.axis_rules():
        step = make_train_step(model, ALG, optimizer, state_sharding=sharding)
        state, metrics = step(state, micro_sharded)
        state, _ = step(state, micro_sharded)
    assert _max_diff(state.policy.params, reference.policy.params) <= 1e-5
    assert abs(float(metrics["policy/loss"]) - float(ref_metrics["policy/loss"])) <= 1e-5
    assert state.policy.params["model"]["layers_0"]["mlp"]["gate_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")


# =============================================================================================== it learns
def test_update_raises_logprob_of_positive_advantage_tokens(policy):
    """A bandit-style batch: one prompt, responses rewarded +1 and -1 (GRPO without std division: advantages
    exactly +1 and -1). Twenty on-policy steps (prepare, then update) must raise the log-probability of the
    +1 responses and lower that of the -1 responses."""
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
    batch = pack_step(tokens, mask, np.zeros_like(mask), np.full(n, 16), rewards=sign, group_ids=np.zeros(n),
                      minibatch=np.zeros(n, np.int32), num_minibatches=1)
    alg = _alg("grpo", {"normalize_std": False})
    optimizer = make_optimizer(OptimizerConfig(learning_rate=3e-3))
    state = create_train_state(_fresh(params), optimizer)
    prepare = make_prepare_fn(model, alg)
    step = make_train_step(model, alg, optimizer)

    def seq_logprobs(p):
        return (_packed_apply(lambda rows: token_logprobs(model, p, rows)[0], batch) * mask).sum(1)

    before = seq_logprobs(params)
    for i in range(20):
        filled, _ = prepare(state, batch)  # on-policy: old = the current policy
        if i == 0:
            np.testing.assert_array_equal(unpack_rows(filled.rows.advantages, batch), sign[:, None] * mask)
            np.testing.assert_allclose(unpack_rows(filled.rows.old_logprobs, batch) * mask,
                                       _packed_apply(lambda r: token_logprobs(model, params, r)[0], batch) * mask,
                                       rtol=RTOL, atol=ATOL)
        state, metrics = step(state, take_minibatch(filled.rows, 0))
    after = seq_logprobs(state.policy.params)
    gain = after - before
    assert (gain[sign > 0] > 1.0).all(), gain
    assert (gain[sign < 0] < -1.0).all(), gain


def test_a_non_finite_step_is_skipped_and_counted(policy):
    """NaN in the batch (here: the advantages) makes the loss and gradients NaN: that optimiser step leaves the
    parameters and the optimiser state exactly as they were and reports policy/nonfinite = 1; the next finite
    step trains normally (Adam's moments were not poisoned)."""
    model, params = policy
    arrays, lengths = _multi_turn_batch(5)
    batch = _pack(arrays, lengths, rewards=np.arange(8, dtype=np.float32), group_ids=np.repeat(np.arange(2), 4))
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    state = create_train_state(_fresh(params), optimizer)
    alg = _alg("grpo")
    filled, _ = make_prepare_fn(model, alg)(state, batch)
    step = make_train_step(model, alg, optimizer)
    poisoned = filled.rows.replace(advantages=filled.rows.advantages.at[0, 0, 0].set(jnp.nan))
    before = jax.tree.map(np.asarray, (state.policy.params, state.policy.opt_state))
    state, metrics = step(state, take_minibatch(poisoned, 0))
    assert float(metrics["policy/nonfinite"]) == 1.0 and not np.isfinite(float(metrics["policy/grad_norm"]))
    jax.tree.map(np.testing.assert_array_equal, (state.policy.params, state.policy.opt_state), before)
    assert int(state.step) == 0  # the step count stays the optimiser's (the schedule's) count
    state, metrics = step(state, take_minibatch(filled.rows, 0))
    assert float(metrics["policy/nonfinite"]) == 0.0 and int(state.step) == 1
    assert _max_diff(state.policy.params, before[0]) > 1e-4
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.policy.opt_state))


def test_traces_count_one_program_per_batch_shape(policy):
    """`traces` counts the programs prepare and train_step trace (the trainer logs them as update/compiles): a
    second batch of the same shape [K, M, R, L] reuses both programs, a batch packed into more rows traces both
    again."""
    model, params = policy
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    alg = _alg("grpo")
    traces = collections.Counter()
    prepare = make_prepare_fn(model, alg, traces=traces)
    step = make_train_step(model, alg, optimizer, traces=traces)
    state = create_train_state(_fresh(params), optimizer)
    seen = []
    for seed, rows_multiple in ((5, 2), (6, 2), (5, 16)):
        arrays, lengths = _multi_turn_batch(seed)
        batch = _pack(arrays, lengths, rewards=np.arange(8, dtype=np.float32), group_ids=np.repeat(np.arange(2), 4),
                      rows_multiple=rows_multiple)
        filled, _ = prepare(state, batch)
        state, _ = step(state, take_minibatch(filled.rows, 0))
        seen.append((batch.rows.tokens.shape, dict(traces)))
    assert seen[0][0] == seen[1][0] != seen[2][0]  # 8 trajectories of > T/2 tokens: 8 rows, then 16
    assert [counts for _, counts in seen] == [{"prepare": 1, "train_step": 1}] * 2 + [{"prepare": 2, "train_step": 2}]


def test_ppo_critic_fits_returns(policy):
    """PPO through prepare: reward 0.7 for every trajectory, gamma = lam = 1, no KL: the returns are 0.7 on
    every action token, and fifteen steps fit the zero-initialised critic to them."""
    model, params = policy
    critic = ValueModel(CFG)
    critic_params = init_params(critic, jax.random.PRNGKey(1))
    arrays, lengths = _multi_turn_batch(4)
    n = len(lengths)
    batch = _pack(arrays, lengths, rewards=np.full(n, 0.7, np.float32))
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    alg = _alg("ppo")
    assert alg.needs_critic and not alg.needs_reference
    state = create_train_state(_fresh(params), opt, critic_params=critic_params, critic_opt=opt)
    filled, _ = make_prepare_fn(model, alg, critic_model=critic)(state, batch)
    mask = arrays["action_mask"]
    np.testing.assert_allclose(unpack_rows(filled.rows.returns, batch), 0.7 * mask, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(unpack_rows(filled.rows.old_values, batch), 0.0)  # zero-initialised head
    step = make_train_step(model, alg, opt, critic_model=critic, critic_opt=opt, value_clip_eps=None)
    micro = take_minibatch(filled.rows, 0)
    losses = []
    for _ in range(15):
        state, metrics = step(state, micro)
        losses.append(float(metrics["critic/loss"]))
    assert losses[0] == pytest.approx(0.5 * 0.49, rel=1e-4)  # zero-initialised head predicts 0
    assert losses[-1] < 0.1 * losses[0]
    values = _packed_apply(lambda rows: values_of(critic, state.critic.params, rows), batch)
    on = mask > 0
    assert abs(values[on].mean() - 0.7) < 0.1


# ============================================================================ old log-probs from the train step
IN_STEP_CASES = {  # (recipe, advantage knobs, loss knobs)
    "grpo": ("grpo", {}, dict(clip_eps=0.2, clip_eps_high=0.28, kl_loss_coef=0.05, entropy_coef=0.01, is_cap=2.0)),
    "gspo": ("gspo", {}, {"is_cap": 2.0}),
    "ppo": ("ppo", {"gamma": 0.99, "lam": 0.95}, {"kl_loss_coef": 0.05}),
}


@pytest.mark.parametrize("case", list(IN_STEP_CASES))
def test_old_logprobs_taken_in_the_train_step_give_the_prepared_update(policy, case):
    """`old_logprobs_in_step` (config.rl.old_logprobs="auto" with one epoch of one mini-batch): prepare runs no
    pass of the policy (its rows carry no old log-probs; reference log-probs, values and advantages as before)
    and the train step takes them from its own forward pass. One step over 2 micro-batches gives the parameters,
    critic and scalars of the prepared path, whose old log-probs come from a pass of their own, and the ratio is
    exactly 1 (the KL loss, entropy bonus, truncated IS and clipping terms run as in a real step)."""
    model, params = policy
    name, advantage, loss = IN_STEP_CASES[case]
    prepared_alg = _alg(name, advantage, **loss)
    in_step_alg = dataclasses.replace(prepared_alg, old_logprobs_in_step=True)
    arrays, lengths = _multi_turn_batch(8, n=12, min_len=6)
    arrays = _with_old_logprobs(model, params, arrays, lengths)  # sampler log-probs near the policy's own
    rng = np.random.default_rng(8)
    batch = _pack(arrays, lengths, row_len=2 * T, rewards=rng.normal(size=12).astype(np.float32),
                  group_ids=np.arange(12) // 3, micro_batches=2)
    assert batch.rows.tokens.shape[:2] == (1, 2)
    critic = critic_params = None
    if prepared_alg.needs_critic:
        critic = ValueModel(CFG)
        critic_params = init_params(critic, jax.random.PRNGKey(1))
    ref_params = init_params(model, jax.random.PRNGKey(7)) if prepared_alg.needs_reference else None
    sgd = optax.sgd(1.0)  # the update is the gradient itself
    results = []
    for alg in (prepared_alg, in_step_alg):
        state = create_train_state(_fresh(params), sgd, critic_params=critic and _fresh(critic_params),
                                   critic_opt=sgd if critic else None, ref_params=ref_params and _fresh(ref_params))
        filled, prepared = make_prepare_fn(model, alg, critic_model=critic)(state, batch)
        step = make_train_step(model, alg, sgd, critic_model=critic, critic_opt=sgd if critic else None)
        state, metrics = step(state, take_minibatch(filled.rows, 0))
        results.append((jax.device_get(filled.rows), jax.device_get({**prepared, **metrics}), state))
    (rows_p, got_p, state_p), (rows_s, got_s, state_s) = results

    assert rows_p.old_logprobs is not None and rows_s.old_logprobs is None
    for field in ("advantages", "loss_weights", "ref_logprobs", "old_values", "returns"):
        jax.tree.map(np.testing.assert_array_equal, getattr(rows_s, field), getattr(rows_p, field))
    assert _max_diff(state_p.policy.params, params) > 1e-3  # the step did something
    assert _max_diff(state_s.policy.params, state_p.policy.params) <= 1e-5
    if critic is not None:
        assert _max_diff(state_s.critic.params, state_p.critic.params) <= 1e-6
    keys = {k for k in got_p if k.startswith("policy/") or k.startswith("mismatch/")} - {"policy/nonfinite"}
    assert keys == {k for k in got_s if k.startswith("policy/") or k.startswith("mismatch/")} - {"policy/nonfinite"}
    assert "mismatch/sampler_vs_trainer_logprob_abs" in keys and got_p["mismatch/sampler_vs_trainer_logprob_abs"] > 0.01
    for k in sorted(keys):
        assert abs(got_s[k] - got_p[k]) <= 1e-5 * max(1.0, abs(got_p[k])), (k, got_s[k], got_p[k])
    assert got_s["policy/ratio_max"] == 1.0 and got_s["policy/clip_fraction"] == 0.0


# ====================================================================================== prepare vs reference
def _unpacked_logprobs(model, params, tokens):
    """float64 reference [N, T]: an unpacked forward pass (causal, no segments) on the trajectory view, then
    the loop-based log-softmax; position t is log p(token t | tokens < t), position 0 is 0."""
    logits = np.asarray(model.apply({"params": params}, jnp.asarray(tokens)), np.float64)  # [N, T, V]
    logprobs, _ = ref.logprobs_and_entropy(logits[:, :-1], tokens[:, 1:])
    return np.pad(logprobs, ((0, 0), (1, 0)))


def _unpacked_values(critic, params, tokens):
    values = np.asarray(critic.apply({"params": params}, jnp.asarray(tokens)), np.float64)  # [N, T]
    return np.pad(values[:, :-1], ((0, 0), (1, 0)))  # values[t]: the state in which token t is chosen


def _token_rewards(rewards, mask, token_kl, kl_coef):
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        positions = ref.action_positions(mask[b])
        for t in positions:
            out[b, t] = -kl_coef * token_kl[b, t] if token_kl is not None else 0.0
        if positions:
            out[b, positions[-1]] += rewards[b]
    return out


def _prepare_problem(seed=5):
    """12 trajectories in 4 groups (arbitrary ids; one group of equal rewards; one trajectory without action
    tokens), packed two to a row where they fit, 2 mini-batches of 2 micro-batches."""
    arrays, lengths = _multi_turn_batch(seed, n=12, min_len=6)
    rng = np.random.default_rng(seed)
    arrays["action_mask"][7] = 0.0
    group_ids = np.repeat(np.array([40, -2, 7, 999]), 3)[rng.permutation(12)]
    rewards = rng.normal(size=12).astype(np.float32)
    rewards[group_ids == 7] = 0.3
    minibatch = np.array([0, 1] * 6, np.int32)[rng.permutation(12)]
    arrays["sampler_logprobs"] = (-rng.exponential(size=(12, T)) * arrays["action_mask"]).astype(np.float32)
    batch = _pack(arrays, lengths, row_len=2 * T, rewards=rewards, group_ids=group_ids, minibatch=minibatch,
                  num_minibatches=2, micro_batches=2)
    assert batch.rows.tokens.shape[:2] == (2, 2)
    assert (batch.rows.segment_ids.max(axis=-1) >= 2).any()  # some rows hold two trajectories
    return arrays, lengths, batch


PREPARE_CASES = {
    "grpo": ("grpo", {}, {}),
    "rloo": ("rloo", {}, {}),
    "reinforce_pp": ("reinforce_pp", {"kl_in_reward_coef": 0.1}, {}),
    "drgrpo": ("drgrpo", {}, {"norm_len": 100}),
    "gspo": ("gspo", {}, {}),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", {"kl_in_reward_coef": 0.1}, {}),
    "ppo": ("ppo", {"gamma": 0.99, "lam": 0.95, "kl_in_reward_coef": 0.05, "kl_in_reward_estimator": "k3"}, {}),
    "ppo_whiten": ("ppo", {"gamma": 0.99, "lam": 0.95, "whiten": True}, {}),
}


@pytest.mark.parametrize("case", list(PREPARE_CASES))
def test_prepare_matches_reference_estimators_on_the_unpacked_view(policy, case):
    model, params = policy
    name, advantage, loss = PREPARE_CASES[case]
    alg = _alg(name, advantage, **loss)
    arrays, lengths, batch = _prepare_problem()
    tokens, mask = arrays["tokens"], arrays["action_mask"]
    rewards, group_ids, minibatch = batch.rewards, batch.group_ids, batch.minibatch
    n = len(lengths)

    ref_params = init_params(model, jax.random.PRNGKey(7)) if alg.needs_reference else None
    critic, critic_params = None, None
    if alg.needs_critic:
        critic = ValueModel(CFG)
        critic_params = init_params(critic, jax.random.PRNGKey(1))
        head_rng = np.random.default_rng(9)  # a non-zero head, so values (and GAE) are not trivial
        critic_params["value_head"] = {
            "kernel": jnp.asarray(head_rng.normal(scale=0.3, size=(CFG.hidden_size, 1)), jnp.float32),
            "bias": jnp.asarray([0.2], jnp.float32)}
    sgd = optax.sgd(0.0)
    state = create_train_state(params, sgd, critic_params=critic_params, critic_opt=sgd if critic else None,
                               ref_params=ref_params)
    filled, metrics = make_prepare_fn(model, alg, critic_model=critic)(state, batch)
    rows = jax.device_get(filled.rows)

    # --- old (and reference) logprobs: the unpacked forward pass, on every predicted token -------------------
    predicted = (np.arange(T)[None, :] < lengths[:, None]) & (np.arange(T)[None, :] > 0)
    old_ref = _unpacked_logprobs(model, params, tokens)
    np.testing.assert_allclose(unpack_rows(rows.old_logprobs, batch)[predicted], old_ref[predicted], **TIGHT)
    token_kl = None
    if alg.needs_reference:
        ref_lp = _unpacked_logprobs(model, ref_params, tokens)
        np.testing.assert_allclose(unpack_rows(rows.ref_logprobs, batch)[predicted], ref_lp[predicted], **TIGHT)
        assert np.abs(old_ref - ref_lp)[mask > 0].mean() > 0.05  # the reference really differs
        token_kl = ref.kl(old_ref, ref_lp, alg.kl_in_reward_estimator, clamp=10.0)
    else:
        assert rows.ref_logprobs is None

    # --- advantages (and returns): the numpy reference estimator on [N, T] ----------------------------------
    want_returns = None
    if name in ("grpo", "gspo"):
        want = ref.grpo(rewards, group_ids, mask)
    elif name == "drgrpo":
        want = ref.grpo(rewards, group_ids, mask, normalize_std=False)
    elif name == "rloo":
        want = ref.rloo(rewards, group_ids, mask)
    elif name == "reinforce_pp":
        want = ref.reinforce_pp(rewards, mask, token_kl=token_kl, kl_coef=alg.kl_in_reward_coef)
    elif name == "reinforce_pp_baseline":
        want = ref.reinforce_pp_baseline(rewards, group_ids, mask, token_kl=token_kl, kl_coef=alg.kl_in_reward_coef)
    else:
        values = _unpacked_values(critic, critic_params, tokens) * mask
        np.testing.assert_allclose(unpack_rows(rows.old_values, batch), values, rtol=RTOL, atol=ATOL)
        want, want_returns = ref.gae(_token_rewards(rewards, mask, token_kl, alg.kl_in_reward_coef), values, mask,
                                     gamma=0.99, lam=0.95)
        if alg.estimator_kwargs["whiten"]:
            want = ref.whiten(want, mask)
    advantages = unpack_rows(rows.advantages, batch)
    assert np.abs(want[mask > 0]).min() < np.abs(want[mask > 0]).max()  # not all one value
    # whitening (reinforce_pp) and the GAE scan accumulate fp32 sums over many tokens: RTOL/ATOL there
    np.testing.assert_allclose(advantages, want, **(TIGHT if name in ("grpo", "gspo", "rloo", "drgrpo")
                                                    else {"rtol": RTOL, "atol": ATOL}))
    assert (rows.advantages[rows.action_mask == 0] == 0).all()
    if want_returns is not None:
        np.testing.assert_allclose(unpack_rows(rows.returns, batch), want_returns, rtol=RTOL, atol=ATOL)
    else:
        assert rows.returns is None and rows.old_values is None and rows.value_weights is None
    on = mask > 0
    np.testing.assert_allclose(metrics["advantages/mean"], want[on].mean(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(metrics["advantages/std"], want[on].std(), rtol=RTOL, atol=ATOL)

    # --- loss weights: the recipe's aggregation over each mini-batch ----------------------------------------
    weights = unpack_rows(rows.loss_weights, batch)
    per_token = np.random.default_rng(11).normal(size=mask.shape)
    for k in range(2):
        members = minibatch == k
        assert rows.loss_weights[k].sum() == pytest.approx(float(weights[members].sum()), rel=1e-6)
        got = float((weights[members] * per_token[members]).sum())
        want_loss = ref.aggregate(per_token[members], mask[members], alg.aggregation, norm_len=alg.norm_len)
        np.testing.assert_allclose(got, want_loss, rtol=RTOL, atol=ATOL)
        if name == "drgrpo":  # each sequence's token sum / (norm_len * sequences with actions in the mini-batch)
            assert alg.aggregation == "seq-mean-token-sum-norm" and alg.norm_len == 100
            n_seqs = int((mask[members].sum(1) > 0).sum())
            np.testing.assert_allclose(weights[members], mask[members] / (100 * n_seqs), rtol=1e-6, atol=0)
        elif name == "gspo":  # each sequence's tokens weigh 1 / (its action tokens * sequences with actions)
            assert alg.aggregation == "seq-mean-token-mean"
            n_seqs = int((mask[members].sum(1) > 0).sum())
            per_seq = np.maximum(mask[members].sum(1, keepdims=True), 1)
            np.testing.assert_allclose(weights[members], mask[members] / (per_seq * n_seqs), rtol=1e-6, atol=0)
        else:
            assert alg.aggregation == "token-mean"
            np.testing.assert_allclose(rows.loss_weights[k].sum(), 1.0, rtol=1e-6)
        if critic is not None:
            np.testing.assert_allclose(rows.value_weights[k].sum(), 1.0, rtol=1e-6)
    assert (rows.loss_weights[rows.action_mask == 0] == 0).all()
    assert unpack_rows(rows.tokens, batch).shape == (n, T)


@pytest.mark.slow
def test_prepare_and_update_sharded_equal_single_device(policy):
    """One whole PPO step (critic, KL in the reward, 2 mini-batches of 2 micro-batches): the batch placed on
    the mesh as the loop places it gives the prepared rows and updated state of one device."""
    from agentfly_jax.trainer.loop import _put_batch

    model, params = policy
    critic = ValueModel(CFG)
    critic_params = init_params(critic, jax.random.PRNGKey(1))
    alg = _alg("ppo", {"kl_in_reward_coef": 0.05})
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3, weight_decay=0.01))
    arrays, lengths = _multi_turn_batch(6, n=16, min_len=6)
    rng = np.random.default_rng(6)
    batch = _pack(arrays, lengths, row_len=2 * T, rewards=rng.normal(size=16).astype(np.float32),
                  group_ids=np.arange(16) // 4, minibatch=np.arange(16) % 2, num_minibatches=2, micro_batches=2,
                  rows_multiple=4)

    def new_state():
        return create_train_state(_fresh(params), optimizer, critic_params=_fresh(critic_params),
                                  critic_opt=optimizer, ref_params=init_params(model, jax.random.PRNGKey(7)))

    def run(state, batch, prepare, step):
        filled, _ = prepare(state, batch)
        for k in range(2):
            state, metrics = step(state, take_minibatch(filled.rows, k))
        return filled, state, metrics

    kw = dict(critic_model=critic, critic_opt=optimizer)
    single = run(new_state(), batch, make_prepare_fn(model, alg, critic_model=critic),
                 make_train_step(model, alg, optimizer, **kw))

    mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state = new_state()
    sharding = state_shardings(state, mesh, policy_model=model, policy_opt=optimizer, critic_model=critic,
                               critic_opt=optimizer)
    state = jax.device_put(state, sharding)
    placed = _put_batch(types.SimpleNamespace(mesh=mesh), batch)
    assert placed.rows.tokens.sharding.spec == P(None, None, ("data", "fsdp"))
    with jax.set_mesh(mesh), shd.axis_rules():
        sharded = run(state, placed, make_prepare_fn(model, alg, critic_model=critic),
                      make_train_step(model, alg, optimizer, state_sharding=sharding, **kw))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(sharded[0].rows),
                                 jax.tree.leaves(single[0].rows)):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))
    assert _max_diff(sharded[1].policy.params, single[1].policy.params) <= 1e-5
    assert _max_diff(sharded[1].critic.params, single[1].critic.params) <= 1e-5
    for key in ("policy/loss", "critic/loss", "policy/grad_norm"):
        assert abs(float(sharded[2][key]) - float(single[2][key])) <= 1e-5 * max(1.0, abs(float(single[2][key]))), key


def test_gpu_compiler_options_send_gemms_to_cublas_only_on_a_gpu(monkeypatch):
    """config.model.gpu_gemm (and the sampler's): "cublas" turns XLA's Triton GEMMs off on a GPU backend,
    "triton_exhaustive" turns its exhaustive tiling search on; XLA's defaults elsewhere and for "triton"; anything
    else is refused by name."""
    from agentfly_jax.models.config import gpu_compiler_options
    from agentfly_jax.trainer.config import ConfigError, TrainConfig

    assert gpu_compiler_options("cublas") is None  # this CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert gpu_compiler_options("cublas") == {"xla_gpu_enable_triton_gemm": False}
    assert gpu_compiler_options("triton") is None
    assert gpu_compiler_options("triton_exhaustive") == {"xla_gpu_exhaustive_tiling_search": True}
    with pytest.raises(ValueError, match="gpu_gemm='cutlass'"):
        gpu_compiler_options("cutlass")
    with pytest.raises(ConfigError, match="model.gpu_gemm"):
        TrainConfig.build({"model": {"gpu_gemm": "cutlass"}})
    with pytest.raises(ConfigError, match="jax_sampler.gpu_gemm"):
        TrainConfig.build({"jax_sampler": {"gpu_gemm": "cutlass"}})
