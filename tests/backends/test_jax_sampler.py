"""JaxSampler: logprob parity with the trainer, continuous batching, stops, seeds, weight swaps, shutdown."""
import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentfly_jax.rollout.backends import Completion, JaxSampler
from agentfly_jax.rollout.backends.jax_sampler import filter_top_k_top_p
from tests.backends.conftest import trainer_logprobs

VOCAB = 1024


def prompts(count, seed=0, lo=1, hi=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(lo, hi))).tolist() for _ in range(count)]


def make_sampler(tiny_model, **options):
    model, params = tiny_model
    return JaxSampler(model, params, **{"max_slots": 8, "max_len": 128, "steps_per_call": 4, **options})


@pytest.fixture(scope="module")
def sampler(tiny_model):
    """One sampler (8 slots, 128 tokens) shared by the tests that keep its weights: compiled programs are reused.
    Each test drives it from its own event loop (asyncio.run); it follows to the new loop."""
    shared = make_sampler(tiny_model)
    yield shared
    asyncio.run(shared.close())


# --------------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("temperature,top_p,top_k",
                         [(1.0, 1.0, -1), (0.7, 1.0, -1), (0.7, 0.9, 20), (0.0, 1.0, -1)])
def test_logprobs_equal_trainer_recompute(tiny_model, sampler, temperature, top_p, top_k):
    """Every sampled token's logprob is log_softmax(logits / T) of the trainer's forward (before truncation)."""
    model, params = tiny_model

    async def run():
        return await asyncio.gather(*[
            sampler.generate(p, max_tokens=24, temperature=temperature, top_p=top_p, top_k=top_k, n=2, seed=i)
            for i, p in enumerate(prompts(6, seed=1))])

    results = asyncio.run(run())
    recompute_t = temperature if temperature > 0 else 1.0  # greedy reports logprobs at temperature 1
    checked = 0
    for prompt, completions in zip(prompts(6, seed=1), results):
        assert len(completions) == 2
        for c in completions:
            assert c.finish_reason == "length" and len(c.token_ids) == 24
            expected = trainer_logprobs(model, params, prompt, c.token_ids, recompute_t)
            np.testing.assert_allclose(c.logprobs, expected, atol=1e-4, rtol=0)
            checked += len(c.token_ids)
    assert checked == 6 * 2 * 24


def test_top_k_top_p_restrict_candidates_but_not_logprobs(tiny_model, sampler):
    """top_k=1 and a tiny top_p both reduce sampling to greedy; the logprobs stay the untruncated ones."""
    prompt = prompts(1, seed=2)[0]

    async def run():
        greedy = await sampler.generate(prompt, max_tokens=12, temperature=0.0)
        top1 = await sampler.generate(prompt, max_tokens=12, temperature=1.0, top_k=1, n=3)
        tiny_p = await sampler.generate(prompt, max_tokens=12, temperature=1.0, top_p=1e-6, n=3)
        plain = await sampler.generate(prompt, max_tokens=12, temperature=1.0)
        return greedy[0], top1, tiny_p, plain[0]

    greedy, top1, tiny_p, plain = asyncio.run(run())
    for c in [*top1, *tiny_p]:
        assert c.token_ids == greedy.token_ids
        np.testing.assert_allclose(c.logprobs, greedy.logprobs, atol=1e-5)
        assert all(lp < 0 for lp in c.logprobs)  # untruncated: the kept token's probability is not 1
    assert plain.token_ids != greedy.token_ids


def test_filter_top_k_top_p_against_numpy():
    rng = np.random.default_rng(0)
    scaled = rng.normal(size=(5, 50)).astype(np.float32) * 2
    top_k = np.array([0, 1, 5, 0, 7], np.int32)
    top_p = np.array([1.0, 1.0, 1.0, 0.5, 0.8], np.float32)
    got = np.asarray(filter_top_k_top_p(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(top_p)))
    for row in range(5):
        order = np.argsort(-scaled[row], kind="stable")
        keep = order[:top_k[row]] if top_k[row] > 0 else order
        probs = np.exp(scaled[row, keep] - scaled[row, keep].max())
        probs /= probs.sum()
        above = np.cumsum(probs) - probs
        keep = keep[above < top_p[row]]
        expected = np.full(50, -np.inf, np.float32)
        expected[keep] = scaled[row, keep]
        np.testing.assert_array_equal(got[row], expected)


def test_sampling_follows_the_tempered_distribution(tiny_model):
    """First tokens of 512 samples: empirical frequencies match softmax(logits / T) (4 sigma), top-k respected."""
    model, params = tiny_model
    prompt = [5, 17, 300]
    temperature = 0.3
    logits = np.asarray(model.apply({"params": params}, jnp.asarray([prompt]))[0, -1], np.float64) / temperature
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    sampler = make_sampler(tiny_model, max_slots=64, max_len=16)

    async def run():
        async with sampler:
            plain = await sampler.generate(prompt, max_tokens=1, temperature=temperature, n=512, seed=7)
            top3 = await sampler.generate(prompt, max_tokens=1, temperature=temperature, top_k=3, n=128, seed=8)
            return plain, top3

    plain, top3 = asyncio.run(run())
    first = np.array([c.token_ids[0] for c in plain])
    counts = np.bincount(first, minlength=VOCAB)
    sigma = np.sqrt(512 * probs * (1 - probs))
    assert np.all(np.abs(counts - 512 * probs) <= 4 * sigma + 1), (counts[probs > 0.01], 512 * probs[probs > 0.01])
    assert {c.token_ids[0] for c in top3} <= set(np.argsort(-probs)[:3].tolist())
    np.testing.assert_allclose([c.logprobs[0] for c in plain], np.log(probs[first]), atol=1e-4)


# ----------------------------------------------------------------------------------- continuous batching
def test_32_concurrent_requests_equal_each_alone_with_their_stops(tiny_model, sampler):
    """32 greedy requests of different prompt lengths, budgets and stop tokens through 8 slots: each equals its
    run alone, ends at its first stop token (finish 'stop') or at max_tokens (finish 'length')."""
    ps = prompts(32, seed=3, lo=1, hi=70)
    budgets = [8 + (7 * i) % 40 for i in range(32)]

    async def alone():
        return [(await sampler.generate(p, max_tokens=m, temperature=0.0))[0] for p, m in zip(ps, budgets)]

    solo = asyncio.run(alone())
    stops, expected = [], []
    for i, c in enumerate(solo):
        assert c.finish_reason == "length" and len(c.token_ids) == budgets[i]
        if i % 4 == 3:  # no stop token: runs to max_tokens
            stops.append([])
            expected.append((c.token_ids, c.logprobs, "length"))
            continue
        cut = (5 * i) % len(c.token_ids)
        stop = c.token_ids[cut]
        first = c.token_ids.index(stop)
        other = next(t for t in range(VOCAB) if t not in c.token_ids)  # a stop that never fires
        stops.append([other, stop])
        expected.append((c.token_ids[:first + 1], c.logprobs[:first + 1], "stop"))

    async def together():
        return await asyncio.gather(*[sampler.generate(p, max_tokens=m, temperature=0.0, stop_token_ids=s)
                                      for p, m, s in zip(ps, budgets, stops)])

    results = asyncio.run(together())
    for i, ((c,), (tokens, logprobs, finish)) in enumerate(zip(results, expected)):
        assert c.token_ids == tokens, i
        assert c.finish_reason == finish, i
        np.testing.assert_allclose(c.logprobs, logprobs, atol=1e-5, rtol=0)
    # slots were shared: more requests than slots, and every slot is free again
    assert sampler.max_slots < 32 and not sampler._cfg["alive"].any()


def test_seeded_requests_reproduce_alone_or_in_a_crowd(tiny_model, sampler):
    prompt = prompts(1, seed=4)[0]

    async def run():
        first = await sampler.generate(prompt, max_tokens=16, temperature=1.0, n=3, seed=123)
        crowd = await asyncio.gather(
            sampler.generate(prompt, max_tokens=16, temperature=1.0, n=3, seed=123),
            *[sampler.generate(p, max_tokens=20, temperature=1.0) for p in prompts(10, seed=5)])
        other = await sampler.generate(prompt, max_tokens=16, temperature=1.0, n=3, seed=124)
        return first, crowd[0], other

    first, again, other = asyncio.run(run())
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) == 3  # n samples differ
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


def test_context_limit_ends_with_length(sampler):
    prompt = prompts(1, seed=6, lo=120, hi=121)[0]

    async def run():
        return (await sampler.generate(prompt, max_tokens=50, temperature=1.0))[0]

    c = asyncio.run(run())
    assert c.finish_reason == "length" and len(prompt) + len(c.token_ids) == sampler.max_len


# --------------------------------------------------------------------------------------------- weights
def test_update_weights_changes_outputs_without_recompiling(tiny_model, tiny_params_b):
    model, params_a = tiny_model
    sampler = make_sampler(tiny_model)
    prompt = prompts(1, seed=7)[0]

    async def run():
        async with sampler:
            a = (await sampler.generate(prompt, max_tokens=16, temperature=0.0))[0]
            compiles = dict(sampler.compile_counts)
            assert compiles["decode"] >= 1 and compiles["prefill"] >= 1
            await sampler.update_weights(tiny_params_b, version=1)
            b = (await sampler.generate(prompt, max_tokens=16, temperature=0.0))[0]
            await sampler.update_weights(params_a, version=2)
            a_again = (await sampler.generate(prompt, max_tokens=16, temperature=0.0))[0]
            return a, b, a_again, compiles

    a, b, a_again, compiles = asyncio.run(run())
    assert dict(sampler.compile_counts) == compiles  # same shapes: nothing traced again
    assert (a.weight_version, b.weight_version, a_again.weight_version) == (0, 1, 2)
    assert sampler.weight_version == 2
    assert b.token_ids != a.token_ids
    expected_b = trainer_logprobs(model, tiny_params_b, prompt, b.token_ids, 1.0)
    np.testing.assert_allclose(b.logprobs, expected_b, atol=1e-4)
    assert a_again.token_ids == a.token_ids
    np.testing.assert_allclose(a_again.logprobs, a.logprobs, atol=1e-6)


def test_update_weights_while_sequences_run(tiny_model, tiny_params_b):
    """A swap between decode calls (interrupt=True): running sequences go on (on the new weights), nothing is
    recompiled, and a request started afterwards is sampled entirely by the new weights."""
    model, _ = tiny_model
    sampler = make_sampler(tiny_model, max_len=256, steps_per_call=2)
    prompt = prompts(1, seed=9)[0]

    async def run():
        async with sampler:
            await sampler.generate(prompt, max_tokens=150, temperature=0.0)  # compiles every bucket used below
            compiles = dict(sampler.compile_counts)
            running = asyncio.create_task(sampler.generate(prompt, max_tokens=150, temperature=1.0, n=4))
            while sampler.stats["tokens"] < 150 + 8:
                await asyncio.sleep(0.005)
            await sampler.update_weights(tiny_params_b, version=7, interrupt=True)
            after = (await sampler.generate(prompt, max_tokens=16, temperature=0.0))[0]
            return await running, after, compiles

    running, after, compiles = asyncio.run(run())
    assert dict(sampler.compile_counts) == compiles
    assert [c.weight_version for c in running] == [0] * 4 and after.weight_version == 7
    assert all(c.finish_reason == "length" and len(c.token_ids) == 150 for c in running)
    expected = trainer_logprobs(model, tiny_params_b, prompt, after.token_ids, 1.0)
    np.testing.assert_allclose(after.logprobs, expected, atol=1e-4)
    health = asyncio.run(sampler.health())
    assert health["ok"] is False and health["weight_version"] == 7  # closed by `async with`


def test_sampler_keeps_its_own_params_when_the_trainer_donates_them(tiny_model):
    """The trainer's jitted step donates its params; the sampler must not share those buffers."""
    model, params = tiny_model
    mine = jax.device_put(params, jax.devices()[0], may_alias=False)
    sampler = JaxSampler(model, mine, max_slots=2, max_len=32, steps_per_call=2)
    step = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.0, p), donate_argnums=0)
    newer = step(mine)  # the buffers the sampler was built from are gone
    assert jax.tree.leaves(mine)[0].is_deleted()

    async def run():
        async with sampler:
            first = await sampler.generate([1, 2, 3], max_tokens=3, temperature=0.0)
            await sampler.update_weights(newer, version=1)
            step(newer)  # and again for the updated ones
            return first, await sampler.generate([1, 2, 3], max_tokens=3, temperature=0.0)

    first, second = asyncio.run(run())
    assert first[0].token_ids == second[0].token_ids and second[0].weight_version == 1


def test_a_failing_loop_answers_every_waiting_request(tiny_model):
    """An error inside the decode loop reaches every caller (none hangs), and the sampler then refuses work."""
    sampler = make_sampler(tiny_model)

    def broken_prefill(*args):
        raise RuntimeError("device on fire")

    sampler._prefill = broken_prefill

    async def run():
        results = await asyncio.wait_for(asyncio.gather(
            *[sampler.generate(p, max_tokens=4) for p in prompts(5, seed=13)], return_exceptions=True), 30)
        with pytest.raises(RuntimeError, match="failed earlier"):
            await sampler.generate([1], max_tokens=1)
        return results, await sampler.health()

    results, health = asyncio.run(run())
    assert all(isinstance(r, RuntimeError) and "device on fire" in str(r) for r in results)
    assert health["ok"] is False and "device on fire" in health["error"]


def test_update_weights_rejects_other_shapes(tiny_model):
    sampler = make_sampler(tiny_model)
    bad = jax.tree.map(lambda x: x, tiny_model[1])
    bad["model"]["norm"]["scale"] = jnp.ones(7)
    with pytest.raises(ValueError, match=r"model.*norm.*scale.*shape \(7,\)"):
        asyncio.run(sampler.update_weights(bad, version=1))


def test_compiles_a_handful_of_programs(tiny_model):
    """Many prompt lengths and budgets share a few bucketed programs."""
    sampler = make_sampler(tiny_model, max_len=256)

    async def run():
        async with sampler:
            await asyncio.gather(*[sampler.generate(p, max_tokens=40, temperature=0.8)
                                   for p in prompts(40, 8, 1, 200)])

    asyncio.run(run())
    # prompt passes: one per prompt bucket (16..256: 5); decode: one per attention window (16, 24, 32, ..., 256: 9)
    assert sampler.compile_counts["prefill"] <= 5 and sampler.compile_counts["insert"] <= 5
    assert len(sampler.window_buckets) == 9 and sampler.compile_counts["decode"] <= 9


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prompt_passes_hold_no_more_rows_than_the_slots(tiny_model, prefix_caching):
    """A prompt pass's rows come from prefill_tokens (16 rows of a 16-token bucket here) but never exceed the slots
    rounded up to a power of two: no more prompts than slots are admitted at once, and each padding row would cost
    a whole row of compute (on a CPU, a 135M model's 2-prompt rollout spent most of its time on 14 such rows).
    The completions are those of a sampler with more slots, whose passes are 16 rows."""
    batch = [p[:12] for p in prompts(3, 4, 9, 13)]  # one 16-token bucket
    outputs, rows = {}, {}
    for slots in (3, 16):
        sampler = make_sampler(tiny_model, max_slots=slots, prefix_caching=prefix_caching)
        name = "_prefill" if prefix_caching else "_prefill_fresh"
        compiled, seen = getattr(sampler, name), []

        def recording(params, cache_or_tokens, *rest, compiled=compiled, seen=seen):
            seen.append((rest[0] if prefix_caching else cache_or_tokens).shape[0])
            return compiled(params, cache_or_tokens, *rest)

        setattr(sampler, name, recording)

        async def run(sampler=sampler):
            async with sampler:
                return await asyncio.gather(*[sampler.generate(p, max_tokens=6, temperature=0.0) for p in batch])

        outputs[slots] = [c[0].token_ids for c in asyncio.run(run())]
        rows[slots] = seen
    assert rows == {3: [4], 16: [16]}, rows  # 16 tokens a row fit 16 rows in prefill_tokens: the slots cap them
    assert outputs[3] == outputs[16]


def test_decode_windows_are_half_an_octave_apart_and_change_nothing(tiny_model):
    """Decode calls attend over the smallest window of `window_buckets` (powers of two and the midpoints 1.5x between
    them) that holds every live position; greedy tokens and logprobs equal those over power-of-two windows only."""
    from agentfly_jax.rollout.backends.jax_sampler import _window_buckets

    assert _window_buckets(16, 2048) == (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
    assert _window_buckets(16, 300) == (16, 24, 32, 48, 64, 96, 128, 192, 256, 300)
    assert _window_buckets(1, 3) == (1, 2, 3) and _window_buckets(16, 16) == (16,)

    def run(windows):
        sampler = make_sampler(tiny_model, max_len=128, prefix_caching=False)
        if windows is not None:
            sampler.window_buckets = windows
        used, decode = [], sampler._decode

        def recording(*args):
            used.append(args[4])  # kv_len, the call's window
            return decode(*args)

        sampler._decode = recording

        async def go():
            async with sampler:
                return await asyncio.gather(*[sampler.generate(p, max_tokens=30, temperature=0.0)
                                              for p in prompts(6, 3, 5, 40)])

        return asyncio.run(go()), used, sampler

    finer, used, sampler = run(None)
    assert set(used) <= set(sampler.window_buckets) and {24, 48} & set(used), used
    coarse, used_pow2, _ = run(sampler.buckets)
    assert set(used_pow2) <= {16, 32, 64, 128} and len(used) >= len(used_pow2)
    for a, b in zip(finer, coarse):
        assert a[0].token_ids == b[0].token_ids
        np.testing.assert_allclose(a[0].logprobs, b[0].logprobs, atol=1e-5)


# --------------------------------------------------------------------------------------------- lifecycle
def test_errors_name_the_problem(tiny_model):
    sampler = make_sampler(tiny_model, max_len=64)

    async def run(**kw):
        return await sampler.generate(**{"prompt_token_ids": [1, 2], "max_tokens": 4, **kw})

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(run(prompt_token_ids=[]))
    with pytest.raises(ValueError, match="max_len=64"):
        asyncio.run(run(prompt_token_ids=[1] * 64))
    with pytest.raises(ValueError, match=r"\[0, 1024\)"):
        asyncio.run(run(prompt_token_ids=[1, 5000]))
    with pytest.raises(ValueError, match="max_stop_tokens"):
        asyncio.run(run(stop_token_ids=list(range(9))))
    with pytest.raises(ValueError, match="max_tokens"):
        asyncio.run(run(max_tokens=0))


def test_close_aborts_running_requests_and_stops_the_loop(tiny_model):
    sampler = make_sampler(tiny_model, max_len=1024, steps_per_call=2)

    async def run():
        task = asyncio.create_task(sampler.generate([1, 2, 3], max_tokens=1000, temperature=1.0, n=2))
        while sampler.stats["tokens"] == 0:
            await asyncio.sleep(0.01)
        loop_task = sampler._task
        await sampler.close()
        result = await asyncio.wait_for(task, 5)
        assert loop_task.done()
        with pytest.raises(RuntimeError, match="closed"):
            await sampler.generate([1], max_tokens=1)
        return result

    result = asyncio.run(run())
    assert [c.finish_reason for c in result] == ["abort", "abort"]
    assert all(isinstance(c, Completion) and 0 < len(c.token_ids) < 1000 for c in result)


def test_cancelled_request_frees_its_slots(tiny_model):
    sampler = make_sampler(tiny_model, max_slots=2, max_len=1024, steps_per_call=2)

    async def run():
        async with sampler:
            hog = asyncio.create_task(sampler.generate([1, 2, 3], max_tokens=1000, temperature=1.0, n=2))
            while sampler.stats["tokens"] == 0:
                await asyncio.sleep(0.01)
            hog.cancel()
            # both slots were taken by the cancelled request: this one runs only if they were freed
            return await asyncio.wait_for(sampler.generate([4, 5], max_tokens=3, temperature=0.0), 30)

    (c,) = asyncio.run(run())
    assert c.finish_reason == "length" and len(c.token_ids) == 3
