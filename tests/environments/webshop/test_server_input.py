"""The WebShop HTTP app against bad input, through aiohttp's test client on the real app: every malformed request
gets a 4xx whose body names what was wrong (never a 500), session ids are bounded in length and in number
(least recently used dropped), and a slow search runs off the event loop, so other requests are answered while it
runs."""

import asyncio
import json
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer

from environments.webshop import get_shop
from environments.webshop.server import (
    MAX_ACTION_CHARS,
    MAX_BODY_BYTES,
    MAX_SESSION_ID_CHARS,
    STORE,
    make_app,
)

CATALOG = {"source": "generated", "seed": 0, "num_products": 1000}


@pytest.fixture(scope="module")
def shop():
    return get_shop(**CATALOG)


def serve(shop, test, max_sessions=1000):
    """Runs `test(client, app)` against a fresh app on a real local HTTP server."""

    async def main():
        app = make_app(shop, max_sessions=max_sessions)
        async with TestClient(TestServer(app)) as client:
            await test(client, app)

    asyncio.run(main())


async def expect(response, status, *needles):
    """The reply has `status` and its body mentions every needle (what was wrong)."""
    body = await response.text()
    assert response.status == status, (response.status, body)
    for needle in needles:
        assert needle in body, (needle, body)
    return body


# (body sent to /api/reset, text the error must contain)
BAD_RESETS = [
    ([1, 2], "JSON object"),
    ("just a string", "JSON object"),
    (None, "JSON object"),
    ({"index": "abc"}, "'index' must be an integer"),
    ({"index": 1.5}, "'index' must be an integer"),
    ({"index": True}, "'index' must be an integer"),
    ({"index": [0]}, "'index' must be an integer"),
    ({"index": -1}, "out of range"),
    ({"index": 10**30}, "out of range"),
    ({"split": "nope"}, "split must be"),
    ({"split": ["train"]}, "'split' must be a string"),
    ({"session": 5}, "'session' must be a string"),
    ({"session": {"a": 1}}, "'session' must be a string"),
    ({"session": ""}, "'session' must be 1 to"),
    ({"session": "x" * (MAX_SESSION_ID_CHARS + 1)}, "'session' must be 1 to"),
    ({"session": "s", "indx": 0}, "unknown field 'indx'"),
]


def test_bad_json_bodies_get_400_naming_the_problem(shop):
    async def test(client, app):
        for body, needle in BAD_RESETS:
            await expect(await client.post("/api/reset", data=json.dumps(body)), 400, needle)
        raw = [
            (b"{not json", "not valid JSON"),
            (b"", "not valid JSON"),
            (b'{"index": 1e400}', "'index' must be an integer"),  # parses to inf
            (b'{"index": NaN}', "'index' must be an integer"),
            (b"\xff\xfe\x00garbage", "not valid JSON"),
        ]
        for data, needle in raw:
            await expect(await client.post("/api/reset", data=data), 400, needle)
        deep = b"[" * 30_000 + b"]" * 30_000  # under the body limit, deeper than the parser's recursion limit
        assert len(deep) <= MAX_BODY_BYTES
        await expect(await client.post("/api/reset", data=deep), 400, "not valid JSON")
        await client.post("/api/reset", json={"session": "s"})
        bad_steps = [
            ({"session": "s"}, "needs"),
            ({"session": "s", "action": 3}, "'action' must be a string"),
            ({"session": "s", "action": None}, "'action' must be a string"),
            ({"session": "s", "action": "search[" + "a" * MAX_ACTION_CHARS + "]"}, "at most"),
            ({"session": ["s"], "action": "x"}, "'session' must be a string"),
            ({"session": "s", "action": "x", "extra": 1}, "unknown field 'extra'"),
            ([{"session": "s", "action": "x"}], "JSON object"),
        ]
        for body, needle in bad_steps:
            await expect(await client.post("/api/step", data=json.dumps(body)), 400, needle)
        # The session still works after all that.
        ok = await client.post("/api/step", json={"session": "s", "action": "search[dress]"})
        assert ok.status == 200 and (await ok.json())["page"] == "results"

    serve(shop, test)


def test_oversized_bodies_get_413(shop):
    async def test(client, app):
        huge = json.dumps({"session": "s", "action": "search[" + "a" * (2 * MAX_BODY_BYTES) + "]"})
        await expect(await client.post("/api/step", data=huge), 413, "body size")
        await expect(await client.post("/api/reset", data=b" " * (MAX_BODY_BYTES + 1)), 413, "body size")

    serve(shop, test)


def test_bad_query_strings_and_paths_get_4xx(shop):
    async def test(client, app):
        for index, needle in [("abc", "must be an integer"), ("1e400", "must be an integer"),
                              ("1.5", "must be an integer"), (" 3", "must be an integer"),
                              ("-1", "out of range"), ("9" * 5000, "out of range"), ("", "must be an integer")]:
            await expect(await client.get("/session/b/reset", params={"index": index}), 400, needle)
        await expect(await client.get("/session/b/reset", params={"index": "0", "split": "x"}), 400, "split must be")
        await expect(await client.get("/", params={"split": "x"}), 400, "split must be")
        long_sid = "x" * (MAX_SESSION_ID_CHARS + 1)
        for path in (f"/session/{long_sid}/reset", f"/session/{long_sid}", f"/session/{long_sid}/search"):
            await expect(await client.get(path, params={"index": "0", "q": "x"}), 400, "'session' must be 1 to")
        await expect(await client.get("/session/nobody/search", params={"q": "dress"}), 404, "no session")
        resp = await client.get("/session/b/reset", params={"index": "0"}, allow_redirects=False)
        assert resp.status == 302
        await expect(await client.get("/session/b/search", params={"q": "a" * (MAX_ACTION_CHARS + 1)}), 400,
                     "at most")
        assert (await client.get("/session/b/search", params={"q": "dress"})).status == 200

    serve(shop, test)


def test_live_sessions_are_capped_least_recently_used_first(shop):
    async def test(client, app):
        store = app[STORE]
        for i in range(3):
            assert (await client.post("/api/reset", json={"session": f"s{i}"})).status == 200
        # s0 is used again: s1 is now the least recently used and goes when s3 arrives.
        assert (await client.post("/api/step", json={"session": "s0", "action": "search[dress]"})).status == 200
        assert (await client.post("/api/reset", json={"session": "s3"})).status == 200
        assert len(store) == 3 and store.evicted == 1
        await expect(await client.post("/api/step", json={"session": "s1", "action": "x"}), 404, "no session 's1'")
        for sid in ("s0", "s2", "s3"):
            assert (await client.post("/api/step", json={"session": sid, "action": "x"})).status == 200
        for i in range(50):
            await client.post("/api/reset", json={"session": f"flood{i}"})
        assert len(store) == 3 and store.evicted == 51

    serve(shop, test, max_sessions=3)


def test_a_slow_search_does_not_block_other_requests(shop, monkeypatch):
    """The search waits on an event this test controls: while it waits, another session's request is answered
    (and a second step on the same session waits its turn)."""
    entered, release = threading.Event(), threading.Event()
    search = shop.search

    def gated_search(query, limit=50):
        if query.startswith("slow"):
            entered.set()
            release.wait(timeout=20)  # bounded: a blocked event loop fails the asserts below instead of hanging
        return search(query, limit)

    monkeypatch.setattr(shop, "search", gated_search)

    async def test(client, app):
        for sid in ("slow", "fast"):
            await client.post("/api/reset", json={"session": sid})
        try:
            slow = asyncio.ensure_future(
                client.post("/api/step", json={"session": "slow", "action": "search[slow dress]"}))
            assert await asyncio.to_thread(entered.wait, 20), "the slow search never started"
            same_session = asyncio.ensure_future(
                client.post("/api/step", json={"session": "slow", "action": "click[Next >]"}))
            fast = await client.post("/api/step", json={"session": "fast", "action": "search[dress]"})
            page = await client.get("/")
            assert fast.status == 200 and (await fast.json())["page"] == "results" and page.status == 200
            assert not slow.done() and not same_session.done()  # both still wait for the gated search
            release.set()
            slow_reply = await (await slow).json()
            assert slow_reply["page"] == "results"
            # the same-session step ran after the search finished, on the results page it produced
            assert "page 2 of" in (await (await same_session).json())["observation"]
        finally:
            release.set()  # a failed assert must not leave the search waiting for the 20 s timeout

    try:
        serve(shop, test)
    finally:
        release.set()
