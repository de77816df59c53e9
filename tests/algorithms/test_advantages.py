"""Advantage estimators against the loop-based float64 references in numpy_reference.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentfly_jax import algorithms
from tests.algorithms import numpy_reference as ref

RTOL, ATOL = 1e-5, 1e-6
BATCH, SEQ = 12, 40
# Arbitrary, non-contiguous, interleaved ids (negative and large too); 1000 and -7 are groups of one.
GROUP_IDS = np.array([17, 3, 17, -4, 1000, 3, 17, -4, 3, 2**30, -7, 2**30], np.int32)
EMPTY_ROW = 9  # a chain whose policy produced no tokens: it still belongs to group 2**30


def make_batch(seed):
    rng = np.random.default_rng(seed)
    mask = ref.multi_turn_mask(rng, BATCH, SEQ, empty_rows=(EMPTY_ROW,))
    assert sum(ref.num_spans(row) >= 2 for row in mask) >= BATCH // 2, "the batch must be multi-turn"
    rewards = rng.normal(size=BATCH).astype(np.float32)
    return rng, rewards, mask


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_matches_reference(seed, normalize_std):
    _, rewards, mask = make_batch(seed)
    fn = jax.jit(functools.partial(algorithms.grpo, normalize_std=normalize_std))
    got = fn(rewards, GROUP_IDS, mask)
    want = ref.grpo(rewards, GROUP_IDS, mask, normalize_std=normalize_std)
    assert got.dtype == jnp.float32 and got.shape == (BATCH, SEQ)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(got)[[4, 10]] == 0.0), "groups of one get 0"


def test_grpo_equal_rewards_give_exactly_zero():
    # 0.3 is not representable; a naive fp32 mean leaves ~1e-8 which 1 / (0 + eps) would blow up to ~1e-2.
    rewards = np.array([0.3, 0.3, 0.3, 0.7, 0.7, 0.7, 0.7], np.float32)
    group_ids = np.array([5, 5, 5, 8, 8, 8, 8])
    got = jax.jit(algorithms.grpo)(rewards, group_ids, np.ones((7, 3), bool))
    assert np.all(np.asarray(got) == 0.0)


def test_grpo_bool_float_and_int_masks_agree():
    _, rewards, mask = make_batch(2)
    expected = algorithms.grpo(rewards, GROUP_IDS, mask)
    for variant in (mask.astype(bool), mask.astype(np.int32), mask * 1.0):
        np.testing.assert_array_equal(algorithms.grpo(rewards, GROUP_IDS, variant), expected)


def test_drgrpo_is_registered_as_unnormalised_grpo():
    _, rewards, mask = make_batch(3)
    got = algorithms.get_advantage_estimator("drgrpo")(rewards, GROUP_IDS, mask)
    np.testing.assert_allclose(
        got, ref.grpo(rewards, GROUP_IDS, mask, normalize_std=False), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_rloo_matches_reference(seed):
    _, rewards, mask = make_batch(seed)
    got = jax.jit(algorithms.rloo)(rewards, GROUP_IDS, mask)
    np.testing.assert_allclose(got, ref.rloo(rewards, GROUP_IDS, mask), rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(got)[[4, 10]] == 0.0)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_matches_reference(seed, kl_coef):
    rng, rewards, mask = make_batch(seed)
    token_kl = rng.normal(scale=0.5, size=(BATCH, SEQ)).astype(np.float32)
    fn = jax.jit(functools.partial(algorithms.reinforce_pp, kl_coef=kl_coef))
    got = fn(rewards, mask, token_kl=token_kl)
    np.testing.assert_allclose(got, ref.reinforce_pp(rewards, mask, token_kl, kl_coef), rtol=RTOL, atol=ATOL)
    action = np.asarray(mask) > 0
    np.testing.assert_allclose(np.asarray(got)[action].std(ddof=1), 1.0, rtol=1e-5)  # sample-std whitening


def test_reinforce_pp_ignores_non_action_kl_even_if_inf():
    rng, rewards, mask = make_batch(4)
    token_kl = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    garbage = np.where(mask > 0, token_kl, np.inf).astype(np.float32)
    clean = algorithms.reinforce_pp(rewards, mask, token_kl=token_kl, kl_coef=0.05)
    np.testing.assert_array_equal(
        algorithms.reinforce_pp(rewards, mask, token_kl=garbage, kl_coef=0.05), clean
    )


def test_reinforce_pp_reward_sits_on_last_action_token_of_the_last_turn():
    # One chain, two turns: every action token's undiscounted return is the final reward, so all are equal and
    # whiten to 0 -- unless the reward were placed elsewhere (end of the first turn, end of the sequence).
    mask = np.array([[0, 1, 1, 0, 0, 1, 1, 0, 0]], np.float32)
    got = algorithms.reinforce_pp(np.array([2.0], np.float32), mask)
    np.testing.assert_array_equal(got, np.zeros_like(mask))
    token_rewards = algorithms.token_level_rewards(np.array([2.0], np.float32), mask)
    np.testing.assert_array_equal(token_rewards, [[0, 0, 0, 0, 0, 0, 2, 0, 0]])


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_baseline_matches_reference(seed, kl_coef):
    rng, rewards, mask = make_batch(seed)
    token_kl = rng.normal(scale=0.5, size=(BATCH, SEQ)).astype(np.float32)
    fn = jax.jit(functools.partial(algorithms.reinforce_pp_baseline, kl_coef=kl_coef))
    got = np.asarray(fn(rewards, GROUP_IDS, mask, token_kl=token_kl))
    want = ref.reinforce_pp_baseline(rewards, GROUP_IDS, mask, token_kl, kl_coef)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    action = mask > 0
    np.testing.assert_allclose(got[action].std(ddof=1), 1.0, rtol=1e-5)
    assert np.abs(got[action].mean()) < 1e-6
    # one value per chain: the baseline is the group's, not a token's return-to-go
    for b in range(BATCH):
        if action[b].any():
            assert np.ptp(got[b][action[b]]) == 0.0
    # groups of one (rows 4 and 10) carry no signal: only the whitening's shift is left on them
    assert got[4][action[4]][0] == got[10][action[10]][0]


def test_reinforce_pp_baseline_equal_group_rewards_give_zero():
    rewards = np.array([0.3, 0.3, 0.3, 0.3], np.float32)
    got = algorithms.reinforce_pp_baseline(rewards, np.array([1, 1, 2, 2]), np.ones((4, 3), bool))
    assert np.all(np.asarray(got) == 0.0)


def test_gae_whiten_is_the_whitened_gae_and_keeps_the_returns():
    rng, _, mask = make_batch(6)
    token_rewards = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    values = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    advantages, returns = jax.jit(functools.partial(algorithms.gae, gamma=0.99, lam=0.95, whiten=True))(
        token_rewards, values, mask)
    raw, want_returns = ref.gae(token_rewards, values, mask, 0.99, 0.95)
    np.testing.assert_allclose(advantages, ref.whiten(raw, mask), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(returns, want_returns, rtol=RTOL, atol=ATOL)  # the critic's targets: unwhitened


def test_overlong_penalty_matches_reference():
    lengths = np.array([0, 10, 99, 100, 101, 125, 149, 150, 151, 1000])
    got = np.asarray(jax.jit(functools.partial(algorithms.overlong_penalty, max_len=150, buffer_len=50))(lengths))
    want = [ref.overlong_penalty(n, 150, 50) for n in lengths]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got[3] == 0.0 and got[5] == -0.5 and got[7] == -1.0 and got[-1] == -1.0
    with pytest.raises(ValueError, match=r"buffer_len must be in \(0, max_len=150\], got 0"):
        algorithms.overlong_penalty(lengths, max_len=150, buffer_len=0)
    with pytest.raises(ValueError, match="buffer_len must be in"):
        algorithms.overlong_penalty(lengths, max_len=150, buffer_len=151)
    with pytest.raises(TypeError, match="must be ints"):
        algorithms.overlong_penalty(lengths, max_len=150.0, buffer_len=10)


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.9, 0.5), (1.0, 1.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_reference(seed, gamma, lam):
    rng, _, mask = make_batch(seed)
    token_rewards = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    values = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    fn = jax.jit(functools.partial(algorithms.gae, gamma=gamma, lam=lam))
    advantages, returns = fn(token_rewards, values, mask)
    want_advantages, want_returns = ref.gae(token_rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(advantages, want_advantages, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(returns, want_returns, rtol=RTOL, atol=ATOL)


def test_gae_with_gamma_lambda_one_is_return_to_go_minus_value():
    rng, _, mask = make_batch(5)
    token_rewards = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    values = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    advantages, returns = algorithms.gae(token_rewards, values, mask, gamma=1.0, lam=1.0)
    for b in range(BATCH):
        positions = ref.action_positions(mask[b])
        for k, t in enumerate(positions):
            return_to_go = sum(float(token_rewards[b, s]) for s in positions[k:])
            assert returns[b, t] == pytest.approx(return_to_go, rel=RTOL, abs=ATOL)
            assert advantages[b, t] == pytest.approx(return_to_go - float(values[b, t]), rel=RTOL, abs=ATOL)


def test_gae_hand_computed_two_turns():
    # Turn 1 = tokens 0,1; tool output = tokens 2,3; turn 2 = token 4. gamma 0.9, lam 0.8 (gamma*lam = 0.72).
    # t=4: delta = 1 + 0.9*0 - 0.6 = 0.4                  A = 0.4              R = 1.0
    # t=1: delta = 0.5 + 0.9*0.6 - 0.4 = 0.64 (V of t=4)  A = 0.64+0.72*0.4    R = A + 0.4
    # t=0: delta = 0 + 0.9*0.4 - 0.2 = 0.16               A = 0.16+0.72*0.928  R = A + 0.2
    mask = np.array([[1, 1, 0, 0, 1, 0]], np.float32)
    token_rewards = np.array([[0.0, 0.5, 9.0, 9.0, 1.0, 9.0]], np.float32)
    values = np.array([[0.2, 0.4, 5.0, 5.0, 0.6, 5.0]], np.float32)
    advantages, returns = jax.jit(functools.partial(algorithms.gae, gamma=0.9, lam=0.8))(
        token_rewards, values, mask
    )
    np.testing.assert_allclose(advantages, [[0.82816, 0.928, 0, 0, 0.4, 0]], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(returns, [[1.02816, 1.328, 0, 0, 1.0, 0]], rtol=RTOL, atol=ATOL)


def test_gae_observation_tokens_do_not_leak():
    rng, _, mask = make_batch(6)
    token_rewards = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    values = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    noise = rng.normal(scale=100.0, size=(BATCH, SEQ)).astype(np.float32)
    off = mask == 0
    clean = algorithms.gae(token_rewards, values, mask, gamma=0.95, lam=0.9)
    leaky = algorithms.gae(
        np.where(off, noise, token_rewards), np.where(off, -noise, values), mask, gamma=0.95, lam=0.9
    )
    for got, want in zip(leaky, clean):
        np.testing.assert_array_equal(got, want)
        assert np.all(np.asarray(got)[off] == 0.0)


# --------------------------------------------------------------------------------------- registry + adapter
def test_compute_advantages_dispatches_by_name():
    rng, rewards, mask = make_batch(7)
    token_kl = rng.normal(scale=0.3, size=(BATCH, SEQ)).astype(np.float32)
    values = rng.normal(size=(BATCH, SEQ)).astype(np.float32)
    batch = {
        "rewards": rewards,
        "group_ids": GROUP_IDS,
        "action_mask": mask,
        "token_kl": token_kl,
        "values": values,
    }

    @functools.partial(jax.jit, static_argnames="name")
    def run(name, batch, **cfg):
        return algorithms.compute_advantages(name, **batch, **cfg)

    advantages, returns = run("grpo", batch)
    np.testing.assert_allclose(advantages, ref.grpo(rewards, GROUP_IDS, mask), rtol=RTOL, atol=ATOL)
    assert returns is None
    advantages, _ = run("drgrpo", batch)
    np.testing.assert_allclose(advantages, ref.grpo(rewards, GROUP_IDS, mask, False), rtol=RTOL, atol=ATOL)
    advantages, _ = run("rloo", batch)
    np.testing.assert_allclose(advantages, ref.rloo(rewards, GROUP_IDS, mask), rtol=RTOL, atol=ATOL)
    advantages, _ = run("reinforce_pp", batch, kl_coef=0.2)
    np.testing.assert_allclose(
        advantages, ref.reinforce_pp(rewards, mask, token_kl, 0.2), rtol=RTOL, atol=ATOL
    )

    # GAE without token rewards: scalar reward on each chain's last action token, minus kl_coef * token_kl.
    advantages, returns = run("gae", batch, gamma=0.99, lam=0.95, kl_coef=0.2)
    token_rewards = -0.2 * token_kl * mask
    for b in range(BATCH):
        positions = ref.action_positions(mask[b])
        if positions:
            token_rewards[b, positions[-1]] += rewards[b]
    want_advantages, want_returns = ref.gae(token_rewards, values, mask, 0.99, 0.95)
    np.testing.assert_allclose(advantages, want_advantages, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(returns, want_returns, rtol=RTOL, atol=ATOL)


def test_unknown_estimator_error_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo_gae'.*drgrpo, gae, grpo"):
        algorithms.get_advantage_estimator("ppo_gae")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        algorithms.compute_advantages("nope", rewards=np.zeros(2), action_mask=np.ones((2, 3)))


def test_compute_advantages_rejects_missing_inputs_and_unknown_config():
    rewards, mask = np.zeros(2, np.float32), np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="'grpo' needs `group_ids`"):
        algorithms.compute_advantages("grpo", rewards=rewards, action_mask=mask)
    with pytest.raises(ValueError, match="'gae' needs `values`"):
        algorithms.compute_advantages("gae", rewards=rewards, action_mask=mask, gamma=1.0, lam=1.0)
    with pytest.raises(TypeError, match=r"'rloo' got unknown config \['gamma'\]"):
        algorithms.compute_advantages(
            "rloo", rewards=rewards, group_ids=np.zeros(2, int), action_mask=mask, gamma=0.9
        )


def test_registering_a_taken_name_fails():
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        algorithms.register_advantage_estimator("grpo")(lambda rewards, action_mask: rewards)
