"""The one small async interface every environment follows (code interpreter, ScienceWorld, ALFWorld, ...).

An environment is a long-lived, stateful object owned by the `ResourceManager`: a chain acquires one, calls
`reset(task)` and `step(action)` across its turns, and releases it; the manager then resets it, checks
`health()` and either keeps it warm for the next chain or destroys it.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from typing import Any


@dataclasses.dataclass
class StepResult:
    """What one `step` returns.

    observation: what the agent sees next (usually text).
    reward: a reward for this step when the environment defines one, else None.
    done: True when the episode is over (the chain should stop acting in this environment).
    info: free-form details for metrics and rewards (never shown to the model by the framework).
    """

    observation: Any
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class Environment(abc.ABC):
    """Async environment interface.

    `reset`, `step` and `close` are coroutines. `health` may be a plain method or a coroutine returning a
    bool; the manager accepts both (a failing or slow health check counts as unhealthy).
    """

    @abc.abstractmethod
    async def reset(self, task: Any = None) -> Any:
        """Starts a new episode (for `task` when given) and returns the first observation."""

    @abc.abstractmethod
    async def step(self, action: Any) -> StepResult:
        """Applies `action` and returns the resulting `StepResult`."""

    async def close(self) -> None:
        """Releases everything the environment holds (processes, containers, files); idempotent."""

    async def health(self) -> bool:
        """True when the instance can serve another episode."""
        return True


async def maybe_await(value: Any) -> Any:
    """Awaits `value` when it is awaitable, so sync and async implementations are both accepted."""
    if inspect.isawaitable(value):
        return await value
    return value
