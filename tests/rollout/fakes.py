"""Fakes for rollout tests: a scripted generation backend and an in-memory environment provider.

`FakeScriptedBackend` stands in for a model: it decodes the prompt it is given, asks a script function
what the assistant says next, and returns that text as token ids of the real tokenizer followed by the
stop token, after a configurable latency (asyncio.sleep, as a real engine's request would take).
`FakeEnvProvider` implements the environment-provider interface (`acquire(pool, key)` -> async context
manager) with in-memory environments and records every acquire and release.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from agentfly_jax.rollout.backends.base import Completion, GenerationBackend

ASSISTANT_HEADER = "<|im_start|>assistant"


@dataclasses.dataclass
class FakePrompt:
    """What the script sees for one generate call."""

    ids: list[int]  # the prompt's token ids
    turn: int  # 0 for the first assistant turn of a chain, 1 for the next, ...
    question: str  # the first user message's text (Qwen/ChatML prompts)
    tokenizer: Any = None

    @functools.cached_property
    def text(self) -> str:
        """The decoded prompt (decoded on first use: most scripts only need `turn` and `question`)."""
        return self.tokenizer.decode(self.ids, skip_special_tokens=False)


def fake_logprob(position: int) -> float:
    """The deterministic logprob the fake backend reports for the sampled token at `position`."""
    return -0.05 - 0.01 * (position % 13)


def _occurrences(ids: list[int], pattern: list[int]) -> list[int]:
    """Start positions of `pattern` in `ids` (searched with list.index: the backend's cost stays off the
    rollout benchmark, which times the runtime around this fake)."""
    found, position = [], -1
    while True:
        try:
            position = ids.index(pattern[0], position + 1)
        except ValueError:
            return found
        if ids[position : position + len(pattern)] == pattern:
            found.append(position)


class FakeScriptedBackend(GenerationBackend):
    """A GenerationBackend whose "model" is `script(FakePrompt) -> assistant text`.

    latency_s: seconds each generate call takes (a float, or a function of the FakePrompt).
    The returned ids are `tokenizer.encode(text) + [stop]`, truncated to max_tokens ("length") if longer.
    report_weight_version: set Completion.weight_version to the version current when the reply is made, and
      Completion.token_versions to that version for every token (the whole reply is "sampled" at once).
    Records every call (prompt ids, max_tokens, seed, images), the peak number of calls in flight and every
    update_weights call as (version, interrupt) in `weight_updates`. Takes images (`supports_images`): the
    script sees the prompt's text, the images are only recorded.
    """

    supports_images = True

    def __init__(
        self,
        tokenizer: Any,
        script: Callable[[FakePrompt], str],
        *,
        latency_s: float | Callable[[FakePrompt], float] = 0.0,
        stop_token: str = "<|im_end|>",
        report_weight_version: bool = False,
    ):
        self.tokenizer = tokenizer
        self.script = script
        self.latency_s = latency_s
        self.stop_id = tokenizer.convert_tokens_to_ids(stop_token)
        self._header_ids = tokenizer.encode(ASSISTANT_HEADER, add_special_tokens=False)
        self._user_ids = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False)
        self._encoded: dict[str, list[int]] = {}  # reply text -> ids (scripts repeat replies a lot)
        self.calls: list[dict[str, Any]] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.weight_version = 0
        self.report_weight_version = report_weight_version
        self.weight_updates: list[tuple[int, bool]] = []

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        stop_token_ids: Sequence[int] = (),
        n: int = 1,
        seed: int | None = None,
        images: Sequence[Any] = (),
    ) -> list[Completion]:
        """The script's reply to this prompt as token ids + stop token, after the configured latency."""
        prompt = self._prompt(list(prompt_token_ids))
        self.calls.append(
            {"prompt_ids": list(prompt_token_ids), "max_tokens": max_tokens, "seed": seed, "turn": prompt.turn,
             "images": list(images)}
        )
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            latency = self.latency_s(prompt) if callable(self.latency_s) else self.latency_s
            if latency:
                await asyncio.sleep(latency)
            reply = self.script(prompt)
        finally:
            self.in_flight -= 1
        if reply not in self._encoded:
            self._encoded[reply] = list(self.tokenizer.encode(reply, add_special_tokens=False))
        ids = self._encoded[reply] + [self.stop_id]
        finish_reason = "stop"
        if len(ids) > max_tokens:
            ids, finish_reason = ids[:max_tokens], "length"
        logprobs = [fake_logprob(position) for position in range(len(ids))]
        version = self.weight_version if self.report_weight_version else None
        token_versions = [version] * len(ids) if self.report_weight_version else None
        return [
            Completion(
                token_ids=ids,
                logprobs=logprobs,
                finish_reason=finish_reason,
                weight_version=version,
                token_versions=token_versions,
            )
            for _ in range(n)
        ]

    def _prompt(self, ids: list[int]) -> FakePrompt:
        """The FakePrompt of a ChatML prompt, found on token ids (decoding whole prompts would be slow)."""
        header, user = self._header_ids, self._user_ids
        headers = len(_occurrences(ids, header))
        question = ""
        for start in _occurrences(ids, user)[:1]:
            end = ids.index(self.stop_id, start) if self.stop_id in ids[start:] else len(ids)
            question = self.tokenizer.decode(ids[start + len(user) : end], skip_special_tokens=False)
        return FakePrompt(ids=ids, turn=headers - 1, question=question, tokenizer=self.tokenizer)

    async def update_weights(self, params: Any, version: int, *, interrupt: bool = False) -> None:
        """Only records the version (and the call): the script is the model, a reply is made all at once."""
        self.weight_updates.append((version, interrupt))
        self.weight_version = version


@dataclasses.dataclass
class FakeEnv:
    """An in-memory environment: remembers what was done in it (so state across turns is visible)."""

    pool: str
    key: str
    history: list[str] = dataclasses.field(default_factory=list)
    released: bool = False
    task: dict | None = None
    resets: int = 0

    async def reset(self, task: dict | None = None) -> str:
        """Starts an episode for `task` (the agent calls this once after acquiring)."""
        self.task, self.resets = task, self.resets + 1
        return "ready"


class FakeEnvProvider:
    """The environment-provider interface over in-memory FakeEnvs, counting acquires and releases.

    acquire_delay_s / release_delay_s: awaited inside acquire and release (release awaits even while
    its chain is being cancelled, like a real reset would). fail_pools: pools whose acquire raises.
    """

    def __init__(self, *, acquire_delay_s: float = 0.0, release_delay_s: float = 0.0, fail_pools=()):
        self.acquire_delay_s = acquire_delay_s
        self.release_delay_s = release_delay_s
        self.fail_pools = set(fail_pools)
        self.active: dict[tuple[str, str], FakeEnv] = {}
        self.acquired: list[tuple[str, str]] = []
        self.released: list[tuple[str, str]] = []
        self.peak_active = 0

    @contextlib.asynccontextmanager
    async def acquire(self, pool: str, key: str):
        """A fresh FakeEnv for (pool, key), released (after release_delay_s) when the block exits."""
        if pool in self.fail_pools:
            raise RuntimeError(f"pool '{pool}' is full")
        if (pool, key) in self.active:
            raise AssertionError(f"{(pool, key)} acquired twice without a release")
        await asyncio.sleep(self.acquire_delay_s)
        env = FakeEnv(pool=pool, key=key)
        self.active[(pool, key)] = env
        self.acquired.append((pool, key))
        self.peak_active = max(self.peak_active, len(self.active))
        try:
            yield env
        finally:
            await asyncio.sleep(self.release_delay_s)
            env.released = True
            del self.active[(pool, key)]
            self.released.append((pool, key))


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One Hermes/Qwen `<tool_call>` block as a Qwen2.5 model writes it."""
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
