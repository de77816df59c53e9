"""The one async interface agents use to sample tokens, whatever engine is behind it.

Token ids in, token ids out: a backend never sees or returns text, so the trainer trains on exactly the
tokens that were sampled, with the engine's log-probabilities kept for importance correction.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Sequence

FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled continuation.

    token_ids: the sampled ids, including the stop token when one ended the completion.
    logprobs: log-probability of each sampled id under the distribution it was sampled from (after
      temperature; before top-p/top-k truncation is the trainer's convention, see the backend's docs).
    finish_reason: "stop" (a stop token), "length" (max_tokens or the context limit) or "abort".
    weight_version: the backend's `weight_version` when the completion's first token was sampled (None when the
      backend does not know it).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int | None = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"Completion has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason={self.finish_reason!r}; expected one of {FINISH_REASONS}")


class GenerationBackend(abc.ABC):
    """Async sampling engine. Implementations: JaxSampler (embedded), VLLMBackend (server client)."""

    #: version of the weights currently served (bumped by update_weights)
    weight_version: int = 0

    @abc.abstractmethod
    async def generate(self, prompt_token_ids: Sequence[int], *, max_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = -1, stop_token_ids: Sequence[int] = (), n: int = 1,
                       seed: int | None = None) -> list[Completion]:
        """Samples `n` continuations of `prompt_token_ids`."""

    @abc.abstractmethod
    async def update_weights(self, params: Any, version: int) -> None:
        """Serves `params` (our Flax param tree) from now on; requests in flight finish on old or new weights
        but never on a mix within one decode step."""

    async def health(self) -> dict:
        """A small dict describing the backend's state (e.g. {"ok": True, "weight_version": 3})."""
        return {"ok": True, "weight_version": self.weight_version}

    async def close(self) -> None:
        """Releases engine resources; idempotent."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
