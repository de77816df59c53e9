"""VLLMBackend: client of one or more vLLM OpenAI-compatible servers, token ids in and out, with weight sync.

    backend = VLLMBackend(["http://127.0.0.1:8000", "http://127.0.0.1:8001"], model=causal_lm)
    [completion] = await backend.generate(prompt_ids, max_tokens=256, temperature=1.0, stop_token_ids=[eos])
    await backend.update_weights(params, version=3)                    # in-flight sequences finish first
    await backend.update_weights(params, version=4, interrupt=True)    # in-flight sequences go on, new weights

Servers are started by scripts/start_vllm.sh, which turns on what this client relies on (its docstring lists
the flags): the dev endpoints for weight sync, our worker extension (`vllm_worker_ext.py`), processed logprobs,
logprobs keyed by token id (a tokenizer only when the model directory has one, for chat clients; this client
never needs it). Requests go to /v1/completions with the prompt as token ids and `return_token_ids`; the
completion's ids come back untouched, the stop token included, with one logprob per id.

Stopping: only `stop_token_ids` and `max_tokens` end a completion (`ignore_eos`; the server ignores the model's
generation_config), as in JaxSampler. `max_tokens` is clipped to the server's context (`max_model_len`).

Logprobs: the server runs with `--logprobs-mode processed_logprobs`, so each logprob is log_softmax(logits / T)
at the sampled token, what the trainer recomputes. Unlike JaxSampler, when top-p/top-k are active vLLM's
processed logprobs are of the truncated, renormalised distribution (slightly higher than the trainer's); the
trainer's importance correction (`is_cap`) absorbs the difference, or sample with top_p=1, top_k=-1 for RL.

HTTP: aiohttp, one pooled session per backend (keep-alive connections, at most `max_connections` per server).
Chosen over httpx for its native asyncio design and lower per-request overhead under hundreds of concurrent
long-polling requests, which is this client's whole workload. Each request goes to the server with the fewest
sequences in flight from this client (n counts n times); a failure (connection error, timeout, HTTP 5xx) marks
the server down for a backoff period and the request is retried elsewhere (or there) up to `max_retries` times
with exponential backoff, then `VLLMServerError` names the server(s) and the last error. Every call has a
timeout, so no coroutine waits forever on a lost server. Failures are counted in `stats` and per server, and
logged.

Images (a vision-language policy, e.g. Qwen2.5-VL; `supports_images`): `generate(prompt, ..., images=[PreparedImage,
...])` takes all of the prompt's images in order, one per run of `<|image_pad|>` ids, as the chain passes them.
vLLM 0.32's /v1/completions takes no images with a token prompt, so such a request goes to vLLM's token-in/token-out
endpoint `/inference/v1/generate` (registered by `--enable-scale-out`, which scripts/start_vllm.sh passes for a
vision-language model directory) with `token_ids` and `content_parts` [{"type": "image_url", "url": "data:image/png;
base64,..."}]: each image travels as a lossless PNG of its resized pixels (`PreparedImage.pixels`, 8-bit RGB, what
our own pixel values are computed from). vLLM's Qwen2-VL processor expands every `<|image_pad|>` of a token prompt
to the image's token count (it replaces each single pad, so an expanded run would be expanded again): the request
carries each image's run collapsed to one pad, and the server answers with the prompt ids it built
(`return_token_ids`). They must equal our prompt, id for id, else the request fails with `VLLMServerError` (the
server's image processor gave an image another grid: its preprocessor_config.json must admit the agent's
min_pixels/max_pixels). So the model sees exactly our ids. The pixels: an image that is already a multiple of 28 on
each side and within the processor's pixel range is not resized again (smart_resize keeps its size and a same-size
resize is the identity, in PIL and torchvision alike), and the server's processor rescales and normalises as
`PreparedImage.pixel_values()` does (start_vllm.sh keeps that in the processor: `--no-mm-device-do-normalize`;
tests/backends/test_vllm_images.py compares tokens and logprobs with our Flax model on our own pixel values).
Sources (vLLM 0.32): entrypoints/scale_out/token_in_token_out/{protocol,serving}.py (`GenerateRequest.token_ids`,
`content_parts`, `return_token_ids`), model_executor/models/qwen2_vl.py (`_get_prompt_updates`: a
`PromptReplacement` of the single `<|image_pad|>` token), multimodal/processing/processor.py (every match replaced). Whether the served model takes images: `multimodal=` (default: whether
`model` is a vision-language model, i.e. `model.config.vision` is set); a backend that does not serve one refuses
images before sending anything. Prompts without images go to /v1/completions as before, on any model.

Weight sync (`update_weights(params, version, interrupt=...)`): new `generate` calls wait (in this client) while
an update runs; with interrupt=False the weights are sent to every server while it still finishes its requests
(staged beside the model), with interrupt=True after the pause (see `_update_one`); then, on every server at once:
pause, load, `POST /reset_prefix_cache` (ALWAYS: cached KV blocks
were computed with the old weights and would otherwise be reused for matching prompt prefixes), `POST /resume`.
A vision-language server also gets `POST /reset_encoder_cache` after that reset: vLLM keeps the vision tower's
outputs per image (its encoder cache) and asks for this reset after a weight update. vLLM 0.32's `/pause` already
clears that cache, in both modes, before the load (its API documentation says `clear_cache` is ignored with
mode=keep; the engine does clear): the reset after the load keeps stale image features out whatever the pause did.
Loading: the params converted to HF names and layouts (`params_to_hf`; for Qwen2.5-VL `visual.*`, `model.*`,
`lm_head.*`, which vLLM's loader maps onto its `visual` and `language_model` modules) are pushed in memory as
safetensors chunks through `/collective_rpc` and loaded in one `reload_weights`; with `weight_sync="file"` they are written with
`save_pretrained` to `weight_dir` (a filesystem the servers can read) and the servers reload that directory (for
models too large to send through HTTP). The pause depends on `interrupt`, using the modes of vLLM's `/pause`:
  - interrupt=False: `/pause?mode=wait`: the server stops admitting requests and waits until the running ones have
    finished on the old weights; the update returns after them.
  - interrupt=True (partial rollouts): `/pause?mode=keep`: the engine freezes between two decode steps with its
    running requests kept (no waiting). It drops their KV blocks while pausing (vLLM's `clear_cache`, and the
    reset after the load is sent with `reset_running_requests=true` so no old block can survive either way): on
    `/resume` each one is recomputed from its prompt and the tokens sampled so far with the NEW weights and
    decoding goes on. So every token is sampled by exactly one weight version with a correct context, and each
    logprob is that of the distribution that sampled it. (The in-flight update is done by the server; nothing is
    aborted or resubmitted by this client.) Costs one prefill of each in-flight sequence per update.
The version is recorded by the backend (`weight_version`) and inside each server's worker. Each Completion carries
`token_versions`: the version that sampled each token, known exactly for completions that no update crossed
(one version) and, for an interrupt=True update, from the worker's own count of the tokens each in-flight
sequence had sampled when the engine froze (`vllm_worker_ext.IN_FLIGHT_LENGTHS`, matched to this client's
request through the `request_id` it sends). `token_versions` is None where that cannot be known: a sequence
the engine had not started yet (queued) or had already finished and dropped at the freeze, an interrupt=False
update whose pause the request raced (the server may have run it before or after the swap), or a server whose
request ids do not have vLLM's `[i_]cmpl-<id>-0-<suffix>` form; `weight_version` is then the version when the
request went out (the oldest its tokens can have), otherwise the first token's version. `stats` counts
`interrupted_requests`: for each interrupt=True swap on a server, the requests in flight there (one crossing two
swaps counts twice). Versions are those of the server that sampled: after an update that failed on another
server, a server that did load the new weights labels its tokens with the new version.

Failed updates: an update that fails on a server (it died, timed out after the retries, refused a step) drops the
staged weights where it can, resumes that server (with retries; a dead server's failure to resume is logged, the
original error is the one reported) and raises `VLLMServerError` naming the failed server(s); the backend's
`weight_version` stays the old one (servers where the update succeeded serve, and label, the new one). Every step has `update_timeout`, so a dead or hung server makes the update
fail in bounded time, never hang. `generate` calls that waited for the update then proceed as usual: to the
servers that are up, or through their own retries to `VLLMServerError` when none is; requests that were in flight
on a server that died fail over to another server (a fresh attempt) like any failed request.
"""
from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import io
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

from agentfly_jax.images import PreparedImage
from agentfly_jax.rollout.backends import vllm_worker_ext as ext
from agentfly_jax.rollout.backends.base import Completion, GenerationBackend

log = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class VLLMServerError(RuntimeError):
    """A vLLM server could not serve a request (after the retries), or answered something unusable."""

    def __init__(self, message: str, urls: Sequence[str] = ()):
        super().__init__(message)
        self.urls = list(urls)


class _RetryableError(Exception):
    """A failure worth retrying (server unreachable, overloaded or crashed), as opposed to a rejected request."""


@dataclasses.dataclass(eq=False)
class _Server:
    url: str
    in_flight: int = 0  # sequences this client has in flight there
    down_until: float = 0.0  # time.monotonic() before which other servers are preferred
    consecutive_failures: int = 0
    requests: int = 0
    failures: int = 0
    info: dict | None = None  # served model name and max_model_len, fetched once
    info_lock: asyncio.Lock | None = None
    weight_version: int | None = None  # last version this client loaded there (None: the backend's own)


@dataclasses.dataclass(eq=False)
class _Attempt:
    """One completion request on the wire, as weight updates need to see it."""

    request_id: str  # sent as the request's `request_id`; vLLM builds its engine ids from it
    server: _Server
    n: int
    version: int  # the backend's weight_version when the request went out
    # one entry per swap on its server while it was in flight: (tokens each choice had sampled before the swap, or
    # None where unknown; the version swapped in)
    swaps: list[tuple[list[int | None], int]] = dataclasses.field(default_factory=list)

    def token_versions(self, index: int, length: int) -> list[int] | None:
        """Version of each token of choice `index` (`length` tokens), or None when a swap's position is unknown."""
        versions, position, current = [], 0, self.version
        for boundaries, version in self.swaps:
            boundary = boundaries[index]
            if boundary is None or boundary < position:
                return None
            boundary = min(boundary, length)
            versions += [current] * (boundary - position)
            position, current = boundary, version
        return versions + [current] * (length - position)


# Engine request ids of an OpenAI completion request with `request_id` R in vLLM: "cmpl-R-0-<suffix>" (n=1) or
# "<i>_cmpl-R-0-<suffix>" for choice i of n > 1 (the -0 is the prompt's index within the request); of a
# /inference/v1/generate request (prompts with images): "[<i>_]generate-tokens-R-<suffix>".
_ENGINE_ID = re.compile(r"(?:(?P<index>\d+)_)?(?:cmpl-(?P<request>[0-9a-f]{32})-0|"
                        r"generate-tokens-(?P<generate>[0-9a-f]{32}))(?:-.*)?")

_GENERATE_PATH = "/inference/v1/generate"
_QWEN_IMAGE_PAD = 151655  # <|image_pad|> of the Qwen2-VL / Qwen2.5-VL tokenizers


def _image_part(image: PreparedImage) -> dict:
    """A `content_parts` entry carrying `image.pixels` as a lossless PNG data URL (8-bit RGB, the resized pixels
    our pixel values are computed from; compression level 1: fast, and still lossless)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image.pixels).save(buffer, format="PNG", compress_level=1)
    return {"type": "image_url", "url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")}


class VLLMBackend(GenerationBackend):
    """Async client of vLLM servers (see the module docstring).

    urls: server base URLs ("http://host:port"). model: the CausalLM whose params `update_weights` receives
    (needed for weight sync only). served_model_name: the name the servers serve (default: asked from
    /v1/models). sync_dtype: dtype the weights travel in (default: the params' own). weight_sync: "memory" or
    "file"; weight_dir: where "file" writes checkpoints (default: a temporary directory). chunk_bytes: raw bytes
    per in-memory chunk. Timeouts are in seconds: request_timeout for a whole generation, connect_timeout to
    open a connection, update_timeout for each step of a weight update (pausing waits for running requests).
    Retries: max_retries more attempts after the first, sleeping retry_backoff * 2**attempt (<= max_backoff);
    a failed server is avoided for down_time seconds (doubling per consecutive failure) while others are up.
    keepalive_timeout: seconds an idle pooled connection is kept (below the servers' own keep-alive, 5 s in vLLM).
    owned_servers: servers this backend was started with (e.g. a `LocalVLLMServers`); `close()` stops them. When
    they may still be starting (a `wait()` method: `LocalVLLMServers.start(wait=False)`), the first request waits
    for them and raises their start's error.
    multimodal: whether the servers serve a vision-language model that takes images with the prompt (sets
    `supports_images`); default: whether `model` is one (`model.config.vision` is set), False without `model`.
    image_token_id: the `<|image_pad|>` id (default: `model.config.vision.image_token_id`, else Qwen2-VL's 151655).
    """

    def __init__(self, urls: str | Sequence[str], model=None, *, served_model_name: str | None = None,
                 request_timeout: float = 600.0, connect_timeout: float = 5.0, update_timeout: float = 900.0,
                 max_retries: int = 3, retry_backoff: float = 0.5, max_backoff: float = 8.0,
                 down_time: float = 5.0, max_connections: int = 256, sync_dtype=None, weight_sync: str = "memory",
                 weight_dir: str | None = None, chunk_bytes: int = 256 << 20, owned_servers=None,
                 keepalive_timeout: float = 2.0, multimodal: bool | None = None, image_token_id: int | None = None):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("VLLMBackend needs at least one server URL")
        if weight_sync not in ("memory", "file"):
            raise ValueError(f"weight_sync={weight_sync!r}; expected 'memory' or 'file'")
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        self.model = model
        self.served_model_name = served_model_name
        self.request_timeout, self.connect_timeout = float(request_timeout), float(connect_timeout)
        self.update_timeout = float(update_timeout)
        self.max_retries, self.retry_backoff, self.max_backoff = int(max_retries), retry_backoff, max_backoff
        self.down_time = float(down_time)
        self.max_connections = int(max_connections)
        self.sync_dtype = sync_dtype
        self.weight_sync = weight_sync
        self.weight_dir = weight_dir
        self._own_weight_dir = None
        self.chunk_bytes = int(chunk_bytes)
        self.owned_servers = owned_servers
        self._servers_started = not callable(getattr(owned_servers, "wait", None))
        self.keepalive_timeout = float(keepalive_timeout)
        vision = getattr(getattr(model, "config", None), "vision", None)
        self.supports_images = bool(vision is not None if multimodal is None else multimodal)
        if image_token_id is None:
            image_token_id = vision.image_token_id if vision is not None else _QWEN_IMAGE_PAD
        self.image_token_id = int(image_token_id)
        self.weight_version = 0
        self.stats: collections.Counter = collections.Counter()
        self._session = None
        self._session_loop = None
        self._ready: asyncio.Event | None = None  # cleared while a weight update runs
        self._update_lock: asyncio.Lock | None = None
        self._attempts: dict[str, _Attempt] = {}  # requests on the wire, by request_id
        self._round_robin = 0
        self._closed = False

    # ---------------------------------------------------------------------------------------- HTTP plumbing
    def _loop_state(self):
        """The aiohttp session and asyncio primitives, (re)made for the running event loop."""
        import aiohttp

        if self._closed:
            raise RuntimeError("VLLMBackend is closed")
        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop:
            # Idle connections are dropped after keepalive_timeout, before the server's own keep-alive (vLLM: 5 s)
            # closes them: reusing a connection the server is closing fails the request with a broken pipe
            # (seen on a weight update after a 12 s update step).
            connector = aiohttp.TCPConnector(limit=self.max_connections * len(self.servers),
                                             limit_per_host=self.max_connections,
                                             keepalive_timeout=self.keepalive_timeout)
            self._session = aiohttp.ClientSession(connector=connector)
            self._session_loop = loop
            self._ready = asyncio.Event()
            self._ready.set()
            self._update_lock = asyncio.Lock()
            for server in self.servers:
                server.info_lock = asyncio.Lock()
        return self._session

    async def _call(self, server: _Server, method: str, path: str, body: Any = None, *,
                    timeout: float | None = None, hints: dict[int, str] | None = None) -> Any:
        """One HTTP call; returns the JSON answer (None when empty). Raises _RetryableError for a connection
        failure, timeout or 5xx; ValueError naming the server for a rejected (4xx) request, with `hints[status]`
        (what to do) appended when given."""
        import aiohttp

        if not self._servers_started:  # owned servers started in the background: up before the first request
            await asyncio.to_thread(self.owned_servers.wait)
            self._servers_started = True
        session = self._loop_state()
        timeout = aiohttp.ClientTimeout(total=timeout or self.request_timeout, sock_connect=self.connect_timeout)
        url = server.url + path
        try:
            async with session.request(method, url, json=body, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status >= 500:
                    raise _RetryableError(f"HTTP {resp.status}: {text[:500]}")
                if resp.status >= 400:
                    hint = (hints or {}).get(resp.status)
                    raise ValueError(f"vLLM server {server.url} rejected {method} {path}: HTTP {resp.status}: "
                                     f"{text[:1000]}" + (f"; {hint}" if hint else ""))
                return None if not text else await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            raise _RetryableError(f"{type(exc).__name__}: {exc}") from exc

    def _pick(self) -> _Server:
        """The least-loaded server among those not marked down (all down: the one that comes back first)."""
        now = time.monotonic()
        up = [s for s in self.servers if s.down_until <= now]
        if not up:
            return min(self.servers, key=lambda s: s.down_until)
        least = min(s.in_flight for s in up)
        candidates = [s for s in up if s.in_flight == least]
        self._round_robin += 1
        return candidates[self._round_robin % len(candidates)]

    def _backoff(self, attempt: int) -> float:
        return min(self.retry_backoff * 2 ** attempt, self.max_backoff)

    def _record_failure(self, server: _Server, exc: Exception, attempt: int):
        server.failures += 1
        server.consecutive_failures += 1
        # avoided while other servers are up: down_time, doubling with each consecutive failure (up to 60 s)
        server.down_until = time.monotonic() + min(self.down_time * 2 ** (server.consecutive_failures - 1), 60.0)
        self.stats["server_errors"] += 1
        log.warning("vLLM server %s failed (attempt %d of %d): %s", server.url, attempt + 1, self.max_retries + 1,
                    exc)

    async def _with_retries(self, what: str, fn, *, server: _Server | None = None, weight: int = 1):
        """Runs `fn(server)` on a routed server (or the given one), retrying failures with backoff."""
        tried = []
        for attempt in range(self.max_retries + 1):
            target = server or self._pick()
            tried.append(target.url)
            target.in_flight += weight
            target.requests += 1
            try:
                result = await fn(target)
                target.consecutive_failures = 0
                target.down_until = 0.0
                return result
            except _RetryableError as exc:
                self._record_failure(target, exc, attempt)
                last = exc
                if attempt < self.max_retries:
                    self.stats["retries"] += 1
                    await asyncio.sleep(self._backoff(attempt))
            finally:
                target.in_flight -= weight
        self.stats["failed_requests"] += 1
        servers = sorted(set(tried))
        message = (f"{what} failed on vLLM server(s) {', '.join(servers)} after {len(tried)} attempts; "
                   f"last error from {tried[-1]}: {last}")
        log.error(message)
        raise VLLMServerError(message, servers) from last

    async def _info(self, server: _Server) -> dict:
        """{"model": served name, "max_model_len": int} of a server, asked once."""
        if server.info is None:
            async with server.info_lock:
                if server.info is None:
                    answer = await self._call(server, "GET", "/v1/models", timeout=self.connect_timeout * 4)
                    models = answer.get("data") or []
                    if not models:
                        raise VLLMServerError(f"vLLM server {server.url} serves no model (/v1/models is empty)",
                                              [server.url])
                    entry = next((m for m in models if m["id"] == self.served_model_name), None) \
                        if self.served_model_name else models[0]
                    if entry is None:
                        raise VLLMServerError(f"vLLM server {server.url} does not serve "
                                              f"{self.served_model_name!r}; it serves {[m['id'] for m in models]}", [server.url])
                    server.info = {"model": entry["id"], "max_model_len": int(entry.get("max_model_len") or 0)}
        return server.info

    # ---------------------------------------------------------------------------------------- generation
    async def generate(self, prompt_token_ids: Sequence[int], *, max_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = -1, stop_token_ids: Sequence[int] = (), n: int = 1,
                       seed: int | None = None, images: Sequence[PreparedImage] = ()) -> list[Completion]:
        """Samples `n` continuations on the least-loaded server; see the module docstring for conventions.

        images: the prompt's images in order (`PreparedImage`), one per run of `<|image_pad|>` ids, for a
        vision-language model (`supports_images`); refused, before anything is sent, by a backend that does not
        serve one."""
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("prompt_token_ids is empty; a prompt needs at least one token")
        if max_tokens < 1 or n < 1:
            raise ValueError(f"max_tokens and n must be >= 1, got max_tokens={max_tokens}, n={n}")
        images = list(images or ())
        if images:
            request_prompt = self._collapse_image_runs(prompt, images)
            content_parts = await asyncio.to_thread(lambda: [_image_part(image) for image in images])
        self._loop_state()
        self.stats["requests"] += 1

        async def attempt(server: _Server):
            info = await self._info(server)
            limit = info["max_model_len"] - len(prompt) if info["max_model_len"] else max_tokens
            if limit < 1:
                raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in vLLM server {server.url}'s "
                                 f"max_model_len={info['max_model_len']}")
            sampling = {"max_tokens": min(int(max_tokens), limit), "temperature": float(temperature),
                        "top_p": float(top_p), "top_k": int(top_k) if top_k > 0 else -1, "n": int(n),
                        "stop_token_ids": [int(t) for t in stop_token_ids], "ignore_eos": True, "logprobs": 0}
            if seed is not None:
                sampling["seed"] = int(seed)
            if images:
                path, hints = _GENERATE_PATH, {404: "the server does not expose vLLM's token-in/token-out endpoint, "
                                                    "which prompts with images need: start it with "
                                                    "--enable-scale-out (scripts/start_vllm.sh passes it for a "
                                                    "vision-language model directory)"}
                body = {"model": info["model"], "token_ids": request_prompt, "content_parts": content_parts,
                        "sampling_params": {**sampling, "detokenize": False}, "return_token_ids": True,
                        "output_mode": "tokens"}
            else:
                path, hints = "/v1/completions", None
                body = {"model": info["model"], "prompt": prompt, **sampling, "return_token_ids": True,
                        "return_tokens_as_token_ids": True, "skip_special_tokens": False}
            while not self._ready.is_set():  # no attempt (retries included) starts during a weight update
                await self._ready.wait()
            # from here to the request's registration nothing awaits: an update that starts later sees it
            served = self.weight_version if server.weight_version is None else server.weight_version
            record = _Attempt(uuid.uuid4().hex, server, int(n), int(served))
            body["request_id"] = record.request_id
            self._attempts[record.request_id] = record
            try:
                answer = await self._call(server, "POST", path, body, hints=hints)
            finally:
                del self._attempts[record.request_id]
            if images:
                self._check_server_prompt(server, answer, prompt, images)
            return self._parse(server, answer, record)

        return await self._with_retries("generate", attempt, weight=n)

    def _collapse_image_runs(self, prompt: list[int], images: list) -> list[int]:
        """`prompt` with each image's run of `<|image_pad|>` ids cut to one pad, which the server's processor expands
        again (to the count of its own grid, checked against ours by `_check_server_prompt`). Raises ValueError
        when the backend takes no images or the images do not match the prompt's pads, run by run."""
        if not self.supports_images:
            raise ValueError(
                f"the prompt holds {len(images)} image(s) but this VLLMBackend does not serve a vision-language "
                "model (supports_images is False): nothing was sent. Build it with the Qwen2.5-VL policy as `model` "
                "(or multimodal=True) for servers that serve one, or send the prompt without images")
        vision = getattr(getattr(self.model, "config", None), "vision", None)
        for i, image in enumerate(images):
            if not isinstance(image, PreparedImage):
                raise TypeError(f"images[{i}] is a {type(image).__name__}; VLLMBackend takes PreparedImage "
                                "(agentfly_jax.images.prepare_image)")
            geometry = (image.patch_size, image.temporal_patch_size, image.merge_size)
            if vision is not None and geometry != (vision.patch_size, vision.temporal_patch_size,
                                                   vision.spatial_merge_size):
                raise ValueError(f"images[{i}] is cut into patches of (patch_size, temporal_patch_size, merge_size)"
                                 f" = {geometry} but the model's vision tower takes ({vision.patch_size}, "
                                 f"{vision.temporal_patch_size}, {vision.spatial_merge_size}); prepare the images "
                                 "with ImageSettings matching the model's vision config")
        pad, out, index, position = self.image_token_id, [], 0, 0
        while position < len(prompt):
            if prompt[position] != pad:
                out.append(prompt[position])
                position += 1
                continue
            if index == len(images):
                raise ValueError(f"the prompt has more image pad tokens (id {pad}) than its {len(images)} image(s) "
                                 f"take ({[im.num_tokens for im in images]}); pass all of the prompt's images, in "
                                 "order")
            need = images[index].num_tokens
            run = prompt[position:position + need]
            if len(run) != need or any(token != pad for token in run):
                have = next((k for k, token in enumerate(run) if token != pad), len(run))
                raise ValueError(f"image {index} ({images[index]!r}) takes {need} image pad tokens (id {pad}) but "
                                 f"its run in the prompt, at position {position}, has {have}; pass all of the "
                                 "prompt's images, in order, prepared with the settings the prompt was encoded with")
            out.append(pad)
            position += need
            index += 1
        if index != len(images):
            raise ValueError(f"the prompt has image pad runs for {index} image(s) but {len(images)} were given; "
                             "pass exactly the prompt's images, in order")
        return out

    def _check_server_prompt(self, server: _Server, answer: dict, prompt: list[int], images: list) -> None:
        """The prompt ids the server built from our collapsed prompt and the images must be ours, id for id."""
        built = (answer or {}).get("prompt_token_ids")
        if built is not None and [int(t) for t in built] == prompt:
            return
        ours = [image.num_tokens for image in images]
        theirs = [int(p.get("length", 0)) for p in ((answer or {}).get("mm_placeholders") or {}).get("image", [])]
        if built is None:
            detail = "did not return the prompt ids it built (return_token_ids); is it vLLM >= 0.32?"
        elif theirs != ours:
            detail = (f"expanded the images to {theirs} image tokens where ours take {ours}: its image processor "
                      "sized them differently. Its preprocessor_config.json (min_pixels/max_pixels) must admit "
                      "every size the agent's ImageSettings produce (config.agent.min_pixels/max_pixels)")
        else:
            first = next((i for i, (a, b) in enumerate(zip(built, prompt)) if int(a) != b), min(len(built), len(prompt)))
            detail = (f"built a prompt of {len(built)} ids that differs from ours ({len(prompt)} ids) from position "
                      f"{first} on")
        raise VLLMServerError(f"vLLM server {server.url} {detail}; the completion was dropped (the model did not "
                              "see our prompt)", [server.url])

    @staticmethod
    def _parse(server: _Server, answer: dict, record: _Attempt) -> list[Completion]:
        n = record.n
        choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != n:
            raise VLLMServerError(f"vLLM server {server.url} returned {len(choices)} choices for n={n}",
                                  [server.url])
        out = []
        for index, choice in enumerate(choices):
            token_ids = choice.get("token_ids")
            logprobs = choice.get("logprobs") or {}
            if "content" in logprobs:  # /inference/v1/generate: one entry per sampled token
                logprobs = [entry.get("logprob") for entry in logprobs["content"] or ()]
            else:  # /v1/completions
                logprobs = logprobs.get("token_logprobs")
            if token_ids is None or logprobs is None or len(token_ids) != len(logprobs) or None in logprobs:
                raise VLLMServerError(
                    f"vLLM server {server.url} returned no token ids or logprobs (token_ids={token_ids!r:.200}, "
                    f"logprobs={logprobs!r:.200}); was it started by scripts/start_vllm.sh (vLLM >= 0.10)?",
                    [server.url])
            finish = _FINISH.get(choice.get("finish_reason"), "abort")
            versions = record.token_versions(index, len(token_ids))
            first = versions[0] if versions else record.version  # unknown (or no token): when it went out
            out.append(Completion(token_ids=[int(t) for t in token_ids], logprobs=[float(x) for x in logprobs],
                                  finish_reason=finish, weight_version=first, token_versions=versions))
        return out

    # ---------------------------------------------------------------------------------------- weight sync
    async def update_weights(self, params, version: int, *, interrupt: bool = False) -> None:
        """Pushes `params` (our Flax tree) to every server without restarting it; see the module docstring.

        interrupt=False: requests in flight finish on the old weights first (`/pause?mode=wait`).
        interrupt=True: does not wait for them: the servers freeze them (`/pause?mode=keep`), load the weights and
        resume them, recomputed with the new weights; their tokens from then on carry `version`."""
        if self.model is None:
            raise ValueError("VLLMBackend was built without `model` (the CausalLM); weight sync needs its config "
                             "to map params to HF tensor names")
        if self.weight_sync == "file":
            path = await asyncio.to_thread(self._save_checkpoint, params, int(version))
            await self.update_weights_from_path(path, version, interrupt=interrupt)
            self._drop_old_checkpoints(keep=path)
            return
        self._loop_state()
        chunks = await asyncio.to_thread(self._serialize, params)

        async def stage(server: _Server):
            for payload in chunks:
                await self._rpc(server, ext.STAGE, payload=payload)

        async def commit(server: _Server):
            return await self._rpc(server, ext.COMMIT, version=str(int(version)))

        await self._update_all(commit, version, abort=True, interrupt=interrupt, stage=stage)

    async def update_weights_from_path(self, path: str, version: int, *, interrupt: bool = False) -> None:
        """Every server reloads the checkpoint directory `path` (config.json + safetensors, readable by them);
        `interrupt` as in `update_weights`."""
        path = os.path.abspath(path)

        async def reload(server: _Server):
            return await self._rpc(server, ext.RELOAD_FROM_PATH, path=path, version=str(int(version)))

        self._loop_state()
        await self._update_all(reload, version, abort=False, interrupt=interrupt)

    async def server_weight_versions(self) -> dict[str, int | None]:
        """The version each server's workers last loaded through this client (None: the startup weights)."""
        self._loop_state()
        out = {}
        for server in self.servers:
            results = await self._rpc(server, ext.WEIGHT_VERSION)
            versions = {r["version"] for r in results}
            out[server.url] = versions.pop() if len(versions) == 1 else sorted(versions, key=str)
        return out

    async def _rpc(self, server: _Server, method: str, **kwargs) -> list:
        answer = await self._call(server, "POST", "/collective_rpc", {"method": method, "kwargs": kwargs},
                                  timeout=self.update_timeout)
        return (answer or {}).get("results") or []

    async def _update_all(self, load, version: int, *, abort: bool, interrupt: bool, stage=None):
        async with self._update_lock:
            self._ready.clear()
            t0 = time.perf_counter()
            try:
                outcomes = await asyncio.gather(*[self._update_one(s, load, version, abort, interrupt, stage)
                                                  for s in self.servers], return_exceptions=True)
                failed = [(s.url, o) for s, o in zip(self.servers, outcomes) if isinstance(o, BaseException)]
                if failed:
                    self.stats["failed_weight_updates"] += 1
                    detail = "; ".join(f"{url}: {exc}" for url, exc in failed)
                    raise VLLMServerError(f"weight update to version {version} failed on {len(failed)} of "
                                          f"{len(self.servers)} vLLM server(s): {detail}", [u for u, _ in failed])
                self.weight_version = int(version)
                self.stats["weight_updates"] += 1
                log.info("vLLM weights now at version %d on %d server(s) (%.2f s%s)", version, len(self.servers),
                         time.perf_counter() - t0, ", in-flight requests kept" if interrupt else "")
            finally:
                self._ready.set()

    async def _update_one(self, server: _Server, load, version: int, abort: bool, interrupt: bool, stage=None):
        """[stage ->] pause -> [stage ->] load -> reset the prefix cache -> resume, on one server (see the module
        docstring). Without `interrupt`, `stage` sends the weights while the server still finishes its requests,
        so the pause lasts only the load. With it, the pause comes first: the point of an interrupting update is to
        swap now, and a vLLM CPU server answered a staging call only once its running requests had finished (10 s
        for 32 sequences of 1,800 tokens, against 0.05 s idle), which would let every one of them end on the old
        weights."""
        timeout = self.update_timeout
        mode = "keep" if interrupt else "wait"
        staged_first = stage is not None and not interrupt
        if staged_first:
            try:
                await stage(server)
            except BaseException:
                await self._drop_staged(server)
                raise
        await self._with_retries(f"pausing {server.url}",
                                 lambda s: self._call(s, "POST", f"/pause?mode={mode}", timeout=timeout),
                                 server=server)
        try:
            lengths = await self._in_flight_lengths(server) if interrupt else None
            try:
                if stage is not None and not staged_first:
                    await stage(server)
                results = await load(server)
            except BaseException:
                if abort:
                    await self._drop_staged(server)
                raise
            loaded = {r.get("version") for r in results}
            if loaded != {int(version)}:
                raise VLLMServerError(f"vLLM server {server.url} reports versions {loaded} after loading version "
                                      f"{version}", [server.url])
            await self._reset_prefix_cache(server, running=interrupt)
            if self.supports_images:
                await self._with_retries(
                    f"resetting the encoder cache of {server.url}",
                    lambda s: self._call(s, "POST", "/reset_encoder_cache", timeout=self.update_timeout),
                    server=server)
            server.weight_version = int(version)  # it serves them now, even if another server fails this update
            self._record_swap(server, int(version), lengths, interrupt)
        except BaseException:
            try:
                await self._resume(server)
            except (VLLMServerError, ValueError) as exc:  # e.g. it died: the update's own error is reported
                log.warning("could not resume %s after its failed weight update: %s", server.url, exc)
            raise
        await self._resume(server)

    async def _drop_staged(self, server: _Server):
        try:
            await self._rpc(server, ext.ABORT)
        except (_RetryableError, ValueError) as exc:  # the update's own error is the one to report
            log.warning("could not drop staged weights on %s: %s", server.url, exc)

    async def _resume(self, server: _Server):
        await self._with_retries(f"resuming {server.url}",
                                 lambda s: self._call(s, "POST", "/resume", timeout=self.update_timeout),
                                 server=server)

    async def _in_flight_lengths(self, server: _Server) -> dict[str, dict[int, int]] | None:
        """{request_id: {choice index: tokens sampled}} of this client's requests the paused engine holds; None
        (every position unknown) when the worker cannot tell."""
        try:
            results = await self._rpc(server, ext.IN_FLIGHT_LENGTHS)
        except (_RetryableError, ValueError) as exc:
            log.warning("vLLM server %s could not list its in-flight sequences (%s); the token versions of requests "
                        "this update interrupts there are unknown", server.url, exc)
            return None
        out: dict[str, dict[int, int]] = {}
        for engine_id, count in ((results[0] if results else {}).get("lengths") or {}).items():
            match = _ENGINE_ID.fullmatch(engine_id)
            request = match and (match["request"] or match["generate"])
            if request in self._attempts:
                out.setdefault(request, {})[int(match["index"] or 0)] = int(count)
        return out

    def _record_swap(self, server: _Server, version: int, lengths: dict | None, interrupt: bool):
        """Notes the swap on every request still on the wire to `server` (called before it resumes)."""
        for record in self._attempts.values():
            if record.server is not server:
                continue
            if interrupt:
                self.stats["interrupted_requests"] += 1
                counts = (lengths or {}).get(record.request_id, {})
                boundaries = [counts.get(i) for i in range(record.n)]
            else:  # it raced the pause: the server ran it wholly before or wholly after the swap
                boundaries = [None] * record.n
            record.swaps.append((boundaries, version))

    async def _reset_prefix_cache(self, server: _Server, attempts: int = 20, *, running: bool = False):
        """Drops every cached KV block; vLLM refuses while blocks are held, so retry a few times. running=True: the
        blocks of running (frozen) requests too; they are recomputed when they resume."""
        path = "/reset_prefix_cache?reset_running_requests=true" if running else "/reset_prefix_cache"
        for attempt in range(attempts):
            answer = await self._with_retries(
                f"resetting the prefix cache of {server.url}",
                lambda s: self._call(s, "POST", path, timeout=self.update_timeout), server=server)
            if answer is None or answer.get("success", True):
                return
            await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
        raise VLLMServerError(f"vLLM server {server.url} kept refusing to reset its prefix cache; its cached "
                              "blocks still hold the old weights", [server.url])

    def _serialize(self, params) -> list[str]:
        """HF-named tensors as base64 safetensors chunks of about `chunk_bytes` each."""
        import jax
        from safetensors.flax import save

        from agentfly_jax.models import params_to_hf

        chunks, current, size = [], {}, 0
        with jax.default_device(jax.devices("cpu")[0]):
            for name, tensor in params_to_hf(self.model.config, params, self.sync_dtype):
                nbytes = tensor.size * tensor.dtype.itemsize
                if current and size + nbytes > self.chunk_bytes:
                    chunks.append(base64.b64encode(save(current)).decode("ascii"))
                    current, size = {}, 0
                current[name] = tensor
                size += nbytes
            chunks.append(base64.b64encode(save(current)).decode("ascii"))
        return chunks

    def _save_checkpoint(self, params, version: int) -> str:
        from agentfly_jax.models import save_pretrained

        if self.weight_dir is None and self._own_weight_dir is None:
            self._own_weight_dir = tempfile.mkdtemp(prefix="agentfly_vllm_weights_")
        root = self.weight_dir or self._own_weight_dir
        path = os.path.join(root, f"version-{version}")
        save_pretrained(self.model, params, path, dtype=self.sync_dtype)
        return path

    def _drop_old_checkpoints(self, keep: str):
        root = self.weight_dir or self._own_weight_dir
        for name in os.listdir(root):
            full = os.path.join(root, name)
            if name.startswith("version-") and full != keep:
                shutil.rmtree(full, ignore_errors=True)

    # ---------------------------------------------------------------------------------------- lifecycle
    async def health(self) -> dict:
        """{"ok": all servers answer /health, "servers": {url: {...}}, "weight_version": ...}."""
        self._loop_state()
        servers = {}
        for server in self.servers:
            try:
                await self._call(server, "GET", "/health", timeout=self.connect_timeout * 2)
                ok, error = True, None
            except (_RetryableError, ValueError) as exc:
                ok, error = False, str(exc)
            servers[server.url] = {"ok": ok, "in_flight": server.in_flight, "requests": server.requests,
                                   "failures": server.failures, **({"error": error} if error else {})}
        return {"ok": all(s["ok"] for s in servers.values()), "servers": servers,
                "weight_version": self.weight_version, "stats": dict(self.stats)}

    async def close(self) -> None:
        """Closes the HTTP session; stops `owned_servers` (other servers keep running); idempotent."""
        if self._closed:
            return
        self._closed = True
        session, self._session = self._session, None
        try:
            if session is not None and not session.closed:
                await session.close()
        finally:
            if self._own_weight_dir:
                shutil.rmtree(self._own_weight_dir, ignore_errors=True)
            if self.owned_servers is not None:  # stopped even when closing the session failed
                await asyncio.to_thread(self.owned_servers.stop)


__all__ = ["VLLMBackend", "VLLMServerError"]
