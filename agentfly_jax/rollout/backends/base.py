"""The one async interface agents use to sample tokens, whatever engine is behind it.

Token ids in, token ids out: a backend never sees or returns text, so the trainer trains on exactly the
tokens that were sampled, with the engine's log-probabilities kept for importance correction.
"""
from __future__ import annotations

import abc
import dataclasses
import numbers
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
      backend does not know it). Given token_versions, it is their first entry (filled in from them when None).
    token_versions: the weight version that sampled each token, one per token id (None when the backend does not
      track it). They differ within one completion only when the weights were swapped while it was being sampled
      (`update_weights(..., interrupt=True)`): the tokens before the swap carry the old version, those after it
      the new one.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int | None = None
    token_versions: tuple[int, ...] | list[int] | None = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"Completion has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason={self.finish_reason!r}; expected one of {FINISH_REASONS}")
        if self.token_versions is None:
            return
        if len(self.token_versions) != len(self.token_ids):
            raise ValueError(f"Completion has {len(self.token_ids)} token ids but {len(self.token_versions)} "
                             "token_versions: give one weight version per sampled token (or None)")
        bad = next((v for v in self.token_versions
                    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0), None)
        if bad is not None:
            raise ValueError(f"Completion.token_versions must be non-negative ints (weight versions), got {bad!r}")
        if self.token_versions:
            first = int(self.token_versions[0])
            if self.weight_version is None:
                object.__setattr__(self, "weight_version", first)  # frozen: fill in the derived field once
            elif self.weight_version != first:
                raise ValueError(f"Completion.weight_version={self.weight_version} but its first token was sampled "
                                 f"by version {first} (token_versions[0]); weight_version is the first token's "
                                 "version")


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
    async def update_weights(self, params: Any, version: int, *, interrupt: bool = False) -> None:
        """Serves `params` (our Flax param tree) as weight version `version` from now on.

        interrupt=False: sequences already in flight finish on the OLD weights; sequences not started yet wait
          (are not admitted) until the swap is done and are then sampled by the new weights from their first token.
          Returns once the new weights serve, i.e. after the sequences in flight have finished; at once when none
          are in flight. Every completion is then sampled by one version.
        interrupt=True (partial rollouts): swaps as soon as the engine allows (between two decode steps) without
          waiting; sequences in flight go on with the new weights, and their tokens sampled after the swap carry the
          new version in `Completion.token_versions`. Whether the engine keeps what it computed for those sequences
          (the JAX sampler keeps their KV cache) or recomputes it with the new weights (vLLM, on resume), each
          token's recorded logprob is that of the distribution that actually sampled it, so an importance correction
          against the recorded logprobs stays exact.

        No decode step ever mixes old and new weights; `weight_version` reads `version` once this returns.
        """

    async def health(self) -> dict:
        """A small dict describing the backend's state (e.g. {"ok": True, "weight_version": 3})."""
        return {"ok": True, "weight_version": self.weight_version}

    async def close(self) -> None:
        """Releases engine resources; idempotent."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
