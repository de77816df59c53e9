"""JaxSampler prefix caching: a finished sequence's KV stays in its slot ("parked") and a later prompt that starts
with its tokens continues it; identical prompts admitted together share one prompt pass.

The reference for every output is the same sampler built with prefix_caching=False (every prompt computed whole)
and, independently, the trainer's recompute (`trainer_logprobs`) or a decode written out by hand.
"""
import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentfly_jax.models import decode
from agentfly_jax.rollout.backends import JaxSampler
from tests.backends.conftest import trainer_logprobs
from tests.backends.test_jax_sampler_images import checkpoint as vl_checkpoint  # noqa: F401 (a fixture)
from tests.backends.test_jax_sampler_images import tokenizer as vl_tokenizer  # noqa: F401 (a fixture)
from tests.backends.test_jax_sampler_images import user_prompt

VOCAB = 1024
OPTIONS = {"max_slots": 16, "max_len": 256, "steps_per_call": 4, "prefix_min_tokens": 4}


def make(tiny_model, caching=True, **options):
    model, params = tiny_model
    return JaxSampler(model, params, **{**OPTIONS, "prefix_caching": caching, **options})


@pytest.fixture(scope="module")
def on(tiny_model):
    """The sampler with prefix caching, shared by the tests that leave weights A in it (compiled programs are
    reused); each test uses prompts of its own seeds, so nothing cached by another test matches, and reads
    counters as differences."""
    shared = make(tiny_model)
    yield shared
    asyncio.run(shared.close())


@pytest.fixture(scope="module")
def off(tiny_model):
    """The same sampler without prefix caching: every prompt computed whole, by the engine as it was before."""
    shared = make(tiny_model, caching=False)
    yield shared
    asyncio.run(shared.close())


class Delta:
    """Counters of a sampler's stats since this was made."""

    def __init__(self, sampler):
        self.sampler, self.start = sampler, dict(sampler.stats)

    def __getitem__(self, key):
        return self.sampler.stats[key] - self.start.get(key, 0)


def tokens_of(seed, length):
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


async def conversation(sampler, prompt, turns, chain, temperature, new_tokens=12):
    """A multi-turn chain as the agent runtime drives it: each turn's prompt is the conversation so far (the
    previous prompt, its completion, an observation of chain- and turn-dependent length)."""
    out = []
    for turn in range(turns):
        [c] = await sampler.generate(prompt, max_tokens=new_tokens, temperature=temperature,
                                     seed=1000 * chain + turn)
        out.append((list(prompt), c))
        prompt = prompt + c.token_ids + tokens_of(100 * chain + turn, 3 + (5 * chain + 7 * turn) % 11)
    return out


async def grpo(sampler, tasks=3, chains=4, turns=3, temperature=0.0, seed=0):
    """`tasks` prompts x `chains` chains, each chain its own requests (as chain.py sends them), all at once."""
    runs = [conversation(sampler, tokens_of(seed + task, 20 + 9 * task), turns, seed + task * chains + c,
                         temperature) for task in range(tasks) for c in range(chains)]
    return await asyncio.gather(*runs)


def run_workload(sampler, workload):
    """Runs `workload(sampler)` in a fresh event loop (the sampler follows it); leaves the sampler open."""
    return asyncio.run(workload(sampler))


def assert_same(results_on, results_off, tol=1e-5):
    for chain_on, chain_off in zip(results_on, results_off, strict=True):
        for (prompt_on, on), (prompt_off, off) in zip(chain_on, chain_off, strict=True):
            assert prompt_on == prompt_off
            assert on.token_ids == off.token_ids
            assert on.finish_reason == off.finish_reason
            np.testing.assert_allclose(on.logprobs, off.logprobs, atol=tol, rtol=0)


# ------------------------------------------------------------------------------------------- equality
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_multi_turn_groups_equal_without_caching(tiny_model, on, off, temperature):
    """3 tasks x 4 chains x 3 turns, interleaved: tokens equal and logprobs within 1e-5 of caching off (and of the
    trainer's recompute within 1e-4); far fewer prompt tokens computed."""
    model, params = tiny_model
    seed = 1000 + 100 * int(temperature)
    stats_on, stats_off = Delta(on), Delta(off)
    results_on = run_workload(on, lambda s: grpo(s, temperature=temperature, seed=seed))
    results_off = run_workload(off, lambda s: grpo(s, temperature=temperature, seed=seed))
    assert_same(results_on, results_off)
    for chain in results_on[::3]:
        for prompt, c in chain:
            expected = trainer_logprobs(model, params, prompt, c.token_ids, temperature or 1.0)
            np.testing.assert_allclose(c.logprobs, expected, atol=1e-4, rtol=0)
    assert stats_on["prompt_tokens"] == stats_off["prompt_tokens"]
    assert stats_off["prefix_hits"] == 0
    assert stats_off["prefill_tokens"] == stats_off["prompt_tokens"] - stats_off["prefix_tokens_reused"]
    # turn 1: one pass per task (its 4 chains share it); turns 2-3: only each chain's observation (the KV of the
    # prompt and completion is parked, up to the completion's last token, which the next turn's pass must run
    # anyway: the pass covers all of a prompt but its last token)
    first_turn = sum(20 + 9 * task - 1 for task in range(3))
    later = sum(3 + (5 * (seed + 4 * task + c) + 7 * turn) % 11
                for task in range(3) for c in range(4) for turn in range(2))
    assert stats_on["prefill_tokens"] == first_turn + later
    assert stats_on["prefix_hits"] >= 12 * 2  # every later turn continues its chain's parked slot
    assert stats_on["prefix_tokens_reused"] == stats_on["prompt_tokens"] - stats_on["prefill_tokens"]
    assert stats_on["prefill_tokens"] < stats_off["prefill_tokens"] / 2


def test_group_of_separate_requests_shares_one_prompt_pass(on, off):
    """8 identical prompts sent as 8 requests in one admission: one prompt pass, 7 slot copies; a 9th sent while
    they run continues a running sibling's KV (no pass at all). Greedy outputs equal one n=8 request without
    caching."""
    prompt = tokens_of(7, 40)
    late_prompt = tokens_of(8, 40)

    async def separate(sampler):
        group = await asyncio.gather(*[sampler.generate(prompt, max_tokens=30, temperature=0.0) for _ in range(8)])
        return [c for [c] in group]

    async def late(sampler):
        first = asyncio.create_task(sampler.generate(late_prompt, max_tokens=60, temperature=0.0))
        while sampler.stats["tokens"] < start + 8:
            await asyncio.sleep(0.001)
        passes = sampler.stats["prefill_calls"]
        [c] = await sampler.generate(late_prompt, max_tokens=20, temperature=0.0)
        return (await first)[0], c, sampler.stats["prefill_calls"] - passes

    stats = Delta(on)
    group = run_workload(on, separate)
    assert stats["prefill_calls"] == 1 and stats["prefill_tokens"] == 39
    assert stats["prefix_shared"] == 7 and stats["prefix_copies"] == 7
    reference = run_workload(off, lambda s: s.generate(prompt, max_tokens=30, temperature=0.0, n=8))
    for c in group:
        assert c.token_ids == reference[0].token_ids
        np.testing.assert_allclose(c.logprobs, reference[0].logprobs, atol=1e-5, rtol=0)

    stats, start = Delta(on), on.stats["tokens"]
    first, second, passes = run_workload(on, late)
    assert passes == 0 and stats["prefix_hits"] == 1 and stats["prefill_tokens"] == 39
    [reference] = run_workload(off, lambda s: s.generate(late_prompt, max_tokens=20, temperature=0.0))
    assert first.token_ids[:20] == second.token_ids == reference.token_ids
    np.testing.assert_allclose(second.logprobs, reference.logprobs, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------- slots
def test_parked_slots_are_reclaimed_least_recently_used_first(tiny_model):
    """2 slots: parked conversations never block admission; the least recently parked one is reclaimed first,
    a continuation of a reclaimed conversation is computed whole, one of a kept one only past its prefix."""
    a, b, c = tokens_of(1, 30), tokens_of(2, 30), tokens_of(3, 30)
    on, off = make(tiny_model, max_slots=2, max_len=64), make(tiny_model, caching=False, max_slots=2, max_len=64)

    async def workload(sampler):
        out = {}
        for name, prompt in (("a", a), ("b", b), ("c", c)):  # c takes a's slot: a was parked first
            [out[name]] = await sampler.generate(prompt, max_tokens=10, temperature=0.0)
        evictions = sampler.stats["prefix_evictions"]
        computed = sampler.stats["prefill_tokens"]
        [out["b2"]] = await sampler.generate(b + out["b"].token_ids + [5, 6, 7], max_tokens=10, temperature=0.0)
        b2_computed = sampler.stats["prefill_tokens"] - computed
        [out["a2"]] = await sampler.generate(a + out["a"].token_ids + [5, 6, 7], max_tokens=10, temperature=0.0)
        a2_computed = sampler.stats["prefill_tokens"] - computed - b2_computed
        two = await asyncio.gather(*[sampler.generate(tokens_of(9 + i, 25), max_tokens=5, temperature=0.0)
                                     for i in range(2)])  # both slots parked: both are admitted
        out["two"] = [x for [x] in two]
        return out, evictions, b2_computed, a2_computed, (await sampler.health())["parked_slots"]

    out_on, evictions, b2, a2, parked = run_workload(on, workload)
    out_off, *_ = run_workload(off, workload)
    assert evictions == 1 and b2 == 3 and a2 == 30 + 10 + 3 - 1
    assert parked == 2
    for key in ("a", "b", "c", "b2", "a2"):
        assert out_on[key].token_ids == out_off[key].token_ids
        np.testing.assert_allclose(out_on[key].logprobs, out_off[key].logprobs, atol=1e-5, rtol=0)
    assert [x.token_ids for x in out_on["two"]] == [x.token_ids for x in out_off["two"]]


def test_partial_match_and_max_len(on, off):
    """A sequence that ran to max_len parks too; a prompt sharing only its first part continues from there (the
    rest of the slot is overwritten), a shorter match than prefix_min_tokens is ignored."""
    prompt = tokens_of(4, 230)

    async def workload(sampler):
        [full] = await sampler.generate(prompt, max_tokens=500, temperature=0.0)
        computed = sampler.stats["prefill_tokens"]
        branch = (prompt + full.token_ids)[:240] + [1, 2, 3]
        [c] = await sampler.generate(branch, max_tokens=10, temperature=0.0)
        short = prompt[:3] + tokens_of(5, 20)  # 3 common tokens < prefix_min_tokens=4
        [d] = await sampler.generate(short, max_tokens=10, temperature=0.0)
        return full, c, d, sampler.stats["prefill_tokens"] - computed

    full_on, c_on, d_on, computed = run_workload(on, workload)
    full_off, c_off, d_off, _ = run_workload(off, workload)
    assert full_on.finish_reason == "length" and len(full_on.token_ids) == 256 - 230
    assert computed == (242 - 240) + 22  # the branch computes its 2 new prompt tokens; `short` all of its 22
    for x, y in ((full_on, full_off), (c_on, c_off), (d_on, d_off)):
        assert x.token_ids == y.token_ids
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------- weights
_STEP = {}


def greedy_reference(model, prefix_params, params, prefix, prompt, new_tokens):
    """Greedy decoding of `prompt` whose first len(prefix) keys/values are computed by `prefix_params` and the
    rest (and every token sampled) by `params`: (tokens, logprobs at T=1)."""
    if id(model) not in _STEP:  # the module is not hashable: close over it, once
        _STEP[id(model)] = (model, jax.jit(lambda p, cache, token, position: decode.decode_step(
            model, p, cache, token, position)))
    step = _STEP[id(model)][1]
    cache = decode.init_cache(model.config, 1, 256)
    positions = jnp.arange(len(prompt) - 1, dtype=jnp.int32)[None]
    _, cache = decode.extend(model, prefix_params, cache, jnp.asarray([prefix]), positions[:, :len(prefix)])
    _, cache = decode.extend(model, params, cache, jnp.asarray([prompt[len(prefix):-1]]),
                             positions[:, len(prefix):])
    token, position, tokens, logprobs = prompt[-1], len(prompt) - 1, [], []
    for _ in range(new_tokens):
        logits, cache = step(params, cache, jnp.asarray([token], jnp.int32), jnp.asarray([position], jnp.int32))
        row = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32)))
        token, position = int(np.argmax(row)), position + 1
        tokens.append(token)
        logprobs.append(float(row[token]))
    return tokens, np.asarray(logprobs)


@pytest.mark.parametrize("interrupt", [False, True])
def test_weight_update_invalidates_cached_prefixes(tiny_model, tiny_params_b, on, interrupt):
    """After update_weights the next turn is computed whole by the new weights (the trainer's recompute with
    them); keep_prefix_cache=True continues the old weights' KV instead, exactly as a hand-written decode with
    the prefix computed by the old weights and the rest by the new ones."""
    model, params_a = tiny_model
    prompt = tokens_of(10 + int(interrupt), 30)

    async def workload(sampler):
        [first] = await sampler.generate(prompt, max_tokens=10, temperature=0.0)
        turn2 = prompt + first.token_ids + [7, 8, 9]
        await sampler.update_weights(tiny_params_b, version=1, interrupt=interrupt)
        computed = sampler.stats["prefill_tokens"]
        [dropped] = await sampler.generate(turn2, max_tokens=10, temperature=0.0)
        dropped_computed = sampler.stats["prefill_tokens"] - computed
        await sampler.update_weights(params_a, version=2, interrupt=interrupt)
        [again] = await sampler.generate(prompt, max_tokens=10, temperature=0.0)
        await sampler.update_weights(tiny_params_b, version=3, interrupt=interrupt, keep_prefix_cache=True)
        computed = sampler.stats["prefill_tokens"]
        [kept] = await sampler.generate(turn2, max_tokens=10, temperature=0.0)
        kept_computed = sampler.stats["prefill_tokens"] - computed
        await sampler.update_weights(params_a, version=0)  # as the other tests expect it
        return first, turn2, dropped, dropped_computed, again, kept, kept_computed

    stats = Delta(on)
    first, turn2, dropped, dropped_computed, again, kept, kept_computed = run_workload(on, workload)
    assert dropped_computed == len(turn2) - 1 and stats["prefix_invalidated"] >= 3
    np.testing.assert_allclose(dropped.logprobs, trainer_logprobs(model, tiny_params_b, turn2, dropped.token_ids,
                                                                  1.0), atol=1e-4, rtol=0)
    assert again.token_ids == first.token_ids
    assert kept_computed == 3 and (dropped.weight_version, kept.weight_version) == (1, 3)
    stale = len(prompt) + len(first.token_ids) - 1  # the parked KV: the prompt and all but the last token
    tokens, logprobs = greedy_reference(model, params_a, tiny_params_b, turn2[:stale], turn2, 10)
    assert kept.token_ids == tokens
    np.testing.assert_allclose(kept.logprobs, logprobs, atol=1e-4, rtol=0)
    assert (on.weight_version, (asyncio.run(on.health()))["parked_slots"]) == (0, 0)


def test_sequences_running_through_an_interrupting_update_are_not_parked(tiny_model, tiny_params_b, on):
    """interrupt=True mid-sequence: its KV mixes both weights, so it is not kept for later prompts."""
    _, params_a = tiny_model
    prompt = tokens_of(12, 20)

    async def workload(sampler):
        start = sampler.stats["tokens"]
        running = asyncio.create_task(sampler.generate(prompt, max_tokens=80, temperature=0.0))
        while sampler.stats["tokens"] < start + 10:
            await asyncio.sleep(0.001)
        await sampler.update_weights(tiny_params_b, version=1, interrupt=True)
        [c] = await running
        parked = (await sampler.health())["parked_slots"]
        computed = sampler.stats["prefill_tokens"]
        await sampler.generate(prompt + c.token_ids[:30], max_tokens=4, temperature=0.0)
        computed = sampler.stats["prefill_tokens"] - computed
        await sampler.update_weights(params_a, version=0)
        return parked, computed

    parked, computed = run_workload(on, workload)
    assert parked == 0 and computed == 20 + 30 - 1


def test_cancelled_sequences_are_not_parked(on, tiny_model):
    async def workload(sampler):
        await sampler.update_weights(tiny_model[1], version=0)  # weights A again: drops what earlier tests parked
        start = sampler.stats["tokens"]
        task = asyncio.create_task(sampler.generate(tokens_of(13, 20), max_tokens=200, temperature=1.0))
        while sampler.stats["tokens"] < start + 4:
            await asyncio.sleep(0.001)
        task.cancel()
        await sampler.generate([1, 2, 3], max_tokens=2, temperature=0.0)  # admission releases the dead slot
        return (await sampler.health())["parked_slots"]

    assert run_workload(on, workload) == 1  # only [1, 2, 3]


# ------------------------------------------------------------------------------------------- compiles
def test_compiles_stay_bounded(tiny_model):
    """Many conversations of many lengths: prompt passes compile per (suffix bucket, window bucket) pair at most,
    the slot start once, decode once per window bucket; running the same again compiles nothing."""
    sampler = make(tiny_model)

    async def workload(sampler):
        runs = [conversation(sampler, tokens_of(50 + i, 5 + 9 * i), 3, 50 + i, 0.8, new_tokens=5 + 2 * i)
                for i in range(12)]
        return await asyncio.gather(*runs)

    async def twice(sampler):
        await workload(sampler)
        counts = dict(sampler.compile_counts)
        await workload(sampler)  # the same shapes again: nothing new
        await sampler.close()
        return counts

    first = run_workload(sampler, twice)
    assert dict(sampler.compile_counts) == first
    buckets = len(sampler.buckets)  # 16, 32, 64, 128, 256
    assert sampler.stats["prefix_hits"] >= 12 * 2
    assert sampler.compile_counts["prefill"] <= buckets * (buckets + 1) // 2
    assert sampler.compile_counts["start"] == 1 and sampler.compile_counts["insert"] == 0
    assert sampler.compile_counts["decode"] <= len(sampler.window_buckets)  # 16, 24, 32, ..., 256: 9


# ------------------------------------------------------------------------------------------- images
def test_vision_language_policy_caches_text_prompts_only(vl_checkpoint, vl_tokenizer):
    """A Qwen2.5-VL policy: a text conversation's next turn continues its parked KV; prompts with images are never
    matched nor parked (a turn after an image prompt is computed whole). Outputs equal caching off."""
    _, model, params = vl_checkpoint
    options = dict(max_slots=4, max_len=256, steps_per_call=4, min_patch_bucket=32, prefix_min_tokens=4)
    on = JaxSampler(model, params, **options)
    off = JaxSampler(model, params, prefix_caching=False, **options)
    text, _ = user_prompt(vl_tokenizer, ["no picture here, only a question about the weather?"])
    with_image, images = user_prompt(vl_tokenizer, ["wide", "what is in it?"])
    follow_up = user_prompt(vl_tokenizer, ["and then?"])[0][-8:]  # the tail of a user turn: plain text ids

    async def workload(sampler):
        out, counts = {}, {}
        [out["t1"]] = await sampler.generate(text, max_tokens=8, temperature=0.0)
        [out["t2"]] = await sampler.generate(text + out["t1"].token_ids + follow_up, max_tokens=8, temperature=0.0)
        counts["text"] = (sampler.stats["prefix_hits"], sampler.stats["prefill_tokens"])
        [out["i1"]] = await sampler.generate(with_image, images=images, max_tokens=8, temperature=0.0)
        [out["i2"]] = await sampler.generate(with_image + out["i1"].token_ids + follow_up, images=images,
                                             max_tokens=8, temperature=0.0)
        counts["images"] = (sampler.stats["prefix_hits"], sampler.stats["prefill_tokens"])
        counts["parked"] = (await sampler.health())["parked_slots"]
        await sampler.close()
        return out, counts

    out_on, counts = asyncio.run(workload(on))
    out_off, _ = asyncio.run(workload(off))
    for key in out_on:
        assert out_on[key].token_ids == out_off[key].token_ids, key
        np.testing.assert_allclose(out_on[key].logprobs, out_off[key].logprobs, atol=1e-5, rtol=0)
    # turn 2 computes len(follow_up) tokens: turn 1's last sampled token and all of follow_up but the last
    assert counts["text"] == (1, len(text) - 1 + len(follow_up))
    hits, computed = counts["images"]
    assert hits == 1  # no image prompt reused anything
    assert computed - counts["text"][1] == len(with_image) - 1 + len(with_image) + 8 + len(follow_up) - 1
    assert counts["parked"] == 1  # the text conversation only
    assert on.stats["images"] == 2 and on.compile_counts["prefill_images"] >= 1


# ------------------------------------------------------------------------------------------- config
def test_config_knobs_reach_the_sampler(tiny_model):
    """config.jax_sampler.prefix_caching (default on), prefix_min_tokens and max_len are the trainer's sampler's
    options."""
    from agentfly_jax.trainer import builders
    from agentfly_jax.trainer.config import ConfigError, TrainConfig
    from experiments.quickstart import get_config

    model, params = tiny_model
    config = get_config()
    assert TrainConfig.build(config).jax_sampler.prefix_caching is True
    config.jax_sampler.prefix_caching, config.jax_sampler.prefix_min_tokens = False, 7
    config.jax_sampler.max_slots, config.jax_sampler.max_len = 2, None
    sampler = builders.build_backend(TrainConfig.build(config), model, params)
    assert (sampler.prefix_caching, sampler.prefix_min_tokens) == (False, 7)
    assert sampler.max_len == config.agent.max_context_tokens == 256  # None: what a chain can grow to
    config.jax_sampler.max_len = 255  # a conversation of 256 tokens would not fit
    with pytest.raises(ConfigError, match=r"jax_sampler.max_len=255 is shorter than config.agent.max_context_tokens"):
        TrainConfig.build(config)
    config.backend, config.vllm.launch = "vllm", True  # the knob is the JAX sampler's: nothing to refuse there
    TrainConfig.build(config)
    config.jax_sampler.prefix_min_tokens = 0
    with pytest.raises(ConfigError, match="prefix_min_tokens"):
        TrainConfig.build(config)
