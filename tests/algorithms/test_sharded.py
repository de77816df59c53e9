"""The algorithms give the same numbers with the batch sharded over the 8 fake devices as on one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentfly_jax import algorithms
from tests.algorithms import numpy_reference as ref

RTOL, ATOL = 1e-5, 1e-6
BATCH, SEQ, EMBED, VOCAB = 16, 24, 8, 32


def test_batch_sharded_results_equal_single_device():
    assert jax.device_count() == 8
    rng = np.random.default_rng(0)
    mask = ref.multi_turn_mask(rng, BATCH, SEQ, empty_rows=(3,))
    group_ids = np.repeat(np.array([40, -2, 7, 999, 12, 5, 31, 8]), 2)[rng.permutation(BATCH)]
    group_ids[0] = 123456  # a group of one
    rewards = rng.normal(size=BATCH).astype(np.float32)
    per_token = {
        name: rng.normal(scale=0.3, size=(BATCH, SEQ)).astype(np.float32)
        for name in ("logprobs", "old_logprobs", "values", "token_kl")
    }
    hidden = rng.normal(size=(BATCH, SEQ, EMBED)).astype(np.float32)
    targets = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32)
    weight = rng.normal(size=(EMBED, VOCAB)).astype(np.float32)

    def everything(rewards, group_ids, mask, per_token, hidden, targets, weight):
        out = {}
        for name in ("grpo", "rloo", "reinforce_pp"):
            out[name] = algorithms.compute_advantages(
                name, rewards=rewards, group_ids=group_ids, action_mask=mask, token_kl=per_token["token_kl"]
            )[0]
        out["gae"] = algorithms.compute_advantages(
            "gae", rewards=rewards, action_mask=mask, values=per_token["values"], gamma=0.99, lam=0.95
        )

        def policy_loss(logprobs):
            return algorithms.ppo_policy_loss(logprobs, per_token["old_logprobs"], out["grpo"], mask)[0]

        out["ppo"] = jax.value_and_grad(policy_loss)(per_token["logprobs"])
        out["logprobs"] = algorithms.token_logprobs_and_entropy(
            hidden, targets, functools.partial(jnp.matmul, b=weight), chunk_size=5
        )
        return out

    inputs = (rewards, group_ids, mask, per_token, hidden, targets, weight)
    single = jax.jit(everything)(*inputs)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    by_batch = NamedSharding(mesh, PartitionSpec("data"))
    sharded_inputs = jax.device_put(inputs[:-1], by_batch) + (inputs[-1],)
    assert sharded_inputs[2].sharding.spec == PartitionSpec("data")
    sharded = jax.jit(everything)(*sharded_inputs)

    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(sharded), jax.tree.leaves(single)):
        # Cross-device reductions add in another order, hence fp32 rounding differences of an ulp or two.
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))
