"""JaxSampler weight updates during generation: per-token versions, interrupt=True (partial rollouts) and
interrupt=False (drain the sequences in flight first), and updates that must never hang."""
import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentfly_jax.models import decode
from agentfly_jax.rollout.backends import JaxSampler
from tests.backends.conftest import trainer_logprobs

MAX_LEN = 128
SAMPLER_OPTIONS = {"max_len": MAX_LEN, "steps_per_call": 2, "min_bucket": 64}  # 2 attention windows
LONG = 100  # tokens of the request in flight
PROMPT = [11, 523, 87, 300, 9, 1000, 42, 77, 5, 610]
OTHER_PROMPT = [3, 99, 250, 17, 801, 64]


@pytest.fixture(scope="module")
def sampler(tiny_model):
    """One sampler shared by the tests that leave it usable (each puts weights A back as version 0 first)."""
    model, params = tiny_model
    shared = JaxSampler(model, params, max_slots=4, **SAMPLER_OPTIONS)
    yield shared
    asyncio.run(shared.close())


async def _reset(sampler, params_a):
    await sampler.update_weights(params_a, version=0)


async def _wait_for_tokens(sampler, count):
    while sampler.stats["tokens"] < count:
        await asyncio.sleep(0.001)


_STEP = {}


def reference_greedy(model, params_by_version, prompt, versions):
    """Greedy decoding of `prompt` where token i is sampled by params_by_version[versions[i]] and every key/value
    stays as the params of its own step computed it (the prompt's by versions[0]'s): (tokens, logprobs at T=1)."""
    if id(model) not in _STEP:  # the module is not hashable: close over it, once
        _STEP[id(model)] = (model, jax.jit(lambda params, cache, token, position: decode.decode_step(
            model, params, cache, token, position)))
    step = _STEP[id(model)][1]
    cache = decode.init_cache(model.config, 1, MAX_LEN)
    prefix = jnp.asarray([prompt[:-1]], jnp.int32)
    _, cache = decode.extend(model, params_by_version[versions[0]], cache, prefix,
                             jnp.arange(len(prompt) - 1, dtype=jnp.int32)[None])
    token, position, tokens, logprobs = prompt[-1], len(prompt) - 1, [], []
    for version in versions:
        logits, cache = step(params_by_version[version], cache, jnp.asarray([token], jnp.int32),
                             jnp.asarray([position], jnp.int32))
        row = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32)))
        token, position = int(np.argmax(row)), position + 1
        tokens.append(token)
        logprobs.append(float(row[token]))
    return tokens, np.asarray(logprobs)


def test_interrupting_update_switches_sequences_in_flight_at_a_decode_call(tiny_model, tiny_params_b, sampler):
    """interrupt=True mid-sequence: the tokens before the swap carry version 0, those after it version 1, and
    each token is exactly what the params of its version produce on the KV cache as it stood (not recomputed):
    a greedy reference that switches params at the same token reproduces tokens and logprobs."""
    model, params_a = tiny_model

    async def run():
        await _reset(sampler, params_a)
        start = sampler.stats["tokens"]
        interrupted = sampler.stats["interrupted_sequences"]
        running = asyncio.create_task(sampler.generate(PROMPT, max_tokens=LONG, temperature=0.0))
        await _wait_for_tokens(sampler, start + 12)
        await sampler.update_weights(tiny_params_b, version=1, interrupt=True)
        assert sampler.weight_version == 1
        return (await running)[0], sampler.stats["interrupted_sequences"] - interrupted

    completion, interrupted = asyncio.run(run())
    versions = list(completion.token_versions)
    switch = versions.index(1)
    assert 12 <= switch < len(versions) == LONG
    assert versions == [0] * switch + [1] * (LONG - switch)
    assert completion.weight_version == 0 and completion.finish_reason == "length"
    assert interrupted == 1

    tokens, logprobs = reference_greedy(model, {0: params_a, 1: tiny_params_b}, PROMPT, versions)
    assert completion.token_ids == tokens
    np.testing.assert_allclose(completion.logprobs, logprobs, atol=1e-4, rtol=0)
    # the swap changed what was sampled: weights A alone continue differently
    tokens_a, _ = reference_greedy(model, {0: params_a}, PROMPT, [0] * LONG)
    assert tokens_a[:switch] == tokens[:switch] and tokens_a[switch:] != tokens[switch:]


def test_update_without_interrupt_lets_sequences_in_flight_finish_on_the_old_weights(
        tiny_model, tiny_params_b, sampler):
    """interrupt=False: the sequence in flight finishes on version 0; a request sent while the update waits is
    not admitted before the swap and is sampled (prompt included) by version 1 only; the update returns only
    after the sequence in flight finished."""
    model, params_a = tiny_model

    async def run():
        await _reset(sampler, params_a)
        start, waited = sampler.stats["tokens"], sampler.stats["drained_sequences"]
        running = asyncio.create_task(sampler.generate(PROMPT, max_tokens=LONG, temperature=0.0))
        await _wait_for_tokens(sampler, start + 6)

        async def update():
            await sampler.update_weights(tiny_params_b, version=1)
            return sampler.stats["tokens"] - start  # tokens handed out by the time the update returned

        updating = asyncio.create_task(update())
        await asyncio.sleep(0)  # the update starts and waits
        assert (await sampler.health())["admission_paused"] and not updating.done()
        late = asyncio.create_task(sampler.generate(OTHER_PROMPT, max_tokens=10, temperature=0.0))
        tokens_at_update = await asyncio.wait_for(updating, 30)
        assert not (await sampler.health())["admission_paused"]
        return ((await running)[0], (await late)[0], tokens_at_update,
                sampler.stats["drained_sequences"] - waited)

    running, late, tokens_at_update, drained = asyncio.run(run())
    assert tokens_at_update == LONG  # every token of the sequence in flight, none of the late request
    assert drained == 1
    assert running.finish_reason == "length" and list(running.token_versions) == [0] * LONG
    np.testing.assert_allclose(running.logprobs, trainer_logprobs(model, params_a, PROMPT, running.token_ids, 1.0),
                               atol=1e-4, rtol=0)
    assert late.weight_version == 1 and list(late.token_versions) == [1] * 10
    np.testing.assert_allclose(late.logprobs, trainer_logprobs(model, tiny_params_b, OTHER_PROMPT, late.token_ids,
                                                               1.0), atol=1e-4, rtol=0)


def test_update_with_nothing_in_flight_returns_at_once(tiny_model, tiny_params_b, sampler):
    """Never started, or idle after a request: the update does not wait (it swaps and returns)."""
    model, params_a = tiny_model
    fresh = JaxSampler(model, params_a, max_slots=1, max_len=32, steps_per_call=2)  # no decode loop yet

    async def run():
        await asyncio.wait_for(fresh.update_weights(tiny_params_b, version=3), 5)
        await _reset(sampler, params_a)
        before = await sampler.generate(OTHER_PROMPT, max_tokens=4, temperature=0.0)  # the loop is idle after
        waited = sampler.stats["drain_wait_s"]
        await asyncio.wait_for(sampler.update_weights(tiny_params_b, version=4), 5)
        after = await sampler.generate(OTHER_PROMPT, max_tokens=4, temperature=0.0)
        return before[0], after[0], sampler.stats["drain_wait_s"] - waited

    before, after, waited = asyncio.run(run())
    assert fresh.weight_version == 3 and waited == 0
    assert list(before.token_versions) == [0] * 4 and list(after.token_versions) == [4] * 4
    np.testing.assert_allclose(after.logprobs, trainer_logprobs(model, tiny_params_b, OTHER_PROMPT, after.token_ids,
                                                                1.0), atol=1e-4, rtol=0)


@pytest.mark.parametrize("how", ["close", "decode_failure"])
def test_a_waiting_update_never_hangs(tiny_model, tiny_params_b, how):
    """close() or a decode-loop failure while an interrupt=False update waits for a sequence in flight: the
    update ends (close: the new weights are installed; failure: RuntimeError naming it) instead of hanging."""
    model, params_a = tiny_model
    sampler = JaxSampler(model, params_a, max_slots=2, **SAMPLER_OPTIONS)

    def broken_decode(*args):
        raise RuntimeError("device on fire")

    async def run():
        running = asyncio.create_task(sampler.generate(PROMPT, max_tokens=LONG, temperature=1.0))
        await _wait_for_tokens(sampler, 1)
        updating = asyncio.create_task(sampler.update_weights(tiny_params_b, version=1))
        await asyncio.sleep(0)
        assert (await sampler.health())["admission_paused"] and not updating.done()
        if how == "close":
            await sampler.close()
        else:
            sampler._decode = broken_decode
        update_error = None
        try:
            await asyncio.wait_for(updating, 10)
        except RuntimeError as error:
            update_error = error
        running_result = (await asyncio.gather(asyncio.wait_for(running, 10), return_exceptions=True))[0]
        await sampler.close()
        return update_error, running_result

    update_error, running_result = asyncio.run(run())
    if how == "close":
        assert update_error is None and sampler.weight_version == 1
        assert running_result[0].finish_reason == "abort" and 0 < len(running_result[0].token_ids) < LONG
    else:
        assert "decode loop failed while update_weights waited" in str(update_error)
        assert "device on fire" in str(update_error) and sampler.weight_version == 0
        assert isinstance(running_result, RuntimeError) and "device on fire" in str(running_result)


def test_weights_replicated_on_a_mesh_are_copied_so_the_trainer_may_donate_them(tiny_model):
    """The trainer's params replicated over a mesh that includes the sampler's device, served, then donated by the
    trainer's next update (asynchronous training decodes meanwhile): the sampler's copy must not be the donated
    buffer."""
    model, params = tiny_model
    devices = jax.devices()
    assert len(devices) >= 2  # tests run with 8 CPU devices (tests/conftest.py)
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    # from a copy: device_put onto a mesh holding the fixture's device may alias the shared fixture's buffers too
    own = jax.tree.map(jnp.copy, params)
    replicated = jax.device_put(own, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    sampler = JaxSampler(model, params, max_slots=2, device=devices[0], **SAMPLER_OPTIONS)

    async def main():
        await sampler.update_weights(replicated, version=1)
        jax.block_until_ready(jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)(replicated))
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(replicated))  # the trainer's buffers are gone
        [completion] = await sampler.generate(PROMPT, max_tokens=4, temperature=0.0)
        return completion

    try:
        completion = asyncio.run(main())
    finally:
        asyncio.run(sampler.close())
    assert len(completion.token_ids) == 4 and completion.token_versions == [1, 1, 1, 1]
