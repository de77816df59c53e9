"""Per-chain context for tools and rewards: the dataset row and the chain's environments.

An environment provider is anything with `acquire(pool: str, key: str)` returning an async context
manager that yields an environment instance (the resource manager in `agentfly_jax.envs` is one). A
chain acquires an environment lazily, on the first stateful tool call (or environment-backed reward) for
that pool, keeps it until the chain ends, and releases it on finish, error or cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol


class EnvironmentProvider(Protocol):
    """Hands out environment instances: `async with provider.acquire(pool, key) as env: ...`."""

    def acquire(self, pool: str, key: str) -> contextlib.AbstractAsyncContextManager[Any]:
        """An async context manager yielding the environment of `pool` for `key` (one chain)."""
        ...


class EnvironmentUnavailableError(RuntimeError):
    """A chain could not get an environment (no provider, pool full past its timeout, a failed setup)."""


class ToolContext:
    """What one chain's tools and rewards may use: its dataset row (`task`) and its environments.

    Use as `async with ToolContext(...) as context:`; leaving the block releases every environment the
    chain acquired, whatever the reason (finish, error, cancellation). Calls on one pool's environment
    are serialised (`env_lock`) so that concurrent tool calls of a turn never interleave on one instance.
    """

    def __init__(
        self,
        task: Mapping[str, Any] | None = None,
        *,
        env_provider: EnvironmentProvider | None = None,
        key: str = "",
        setup_env: Callable[[str, Any], Awaitable[None]] | None = None,
        on_acquire: Callable[[str], None] | None = None,
        on_release: Callable[[str], None] | None = None,
    ):
        self.task: Mapping[str, Any] = types.MappingProxyType(dict(task or {}))
        self.key = key
        self._provider = env_provider
        self._setup_env = setup_env
        self._on_acquire = on_acquire
        self._on_release = on_release
        self._stack = contextlib.AsyncExitStack()
        self._envs: dict[str, Any] = {}
        self._acquire_locks: dict[str, asyncio.Lock] = {}
        self._use_locks: dict[str, asyncio.Lock] = {}
        self._releases = 0  # environments put on _stack to release
        self._closed = False

    @property
    def acquired_pools(self) -> list[str]:
        """Pools this chain currently holds an environment of."""
        return list(self._envs)

    def env_lock(self, pool: str) -> asyncio.Lock:
        """The lock that serialises use of this chain's environment of `pool`."""
        return self._use_locks.setdefault(pool, asyncio.Lock())

    async def env(self, pool: str) -> Any:
        """This chain's environment of `pool`, acquired on first use and kept until the context closes."""
        if pool in self._envs:
            return self._envs[pool]
        if self._closed:
            raise EnvironmentUnavailableError(f"the chain has ended; environment pool '{pool}' is released")
        if self._provider is None:
            raise EnvironmentUnavailableError(
                f"environment pool '{pool}' is needed but no env_provider was given: pass "
                "env_provider= (e.g. the resource manager) to the agent"
            )
        async with self._acquire_locks.setdefault(pool, asyncio.Lock()):
            if pool in self._envs:
                return self._envs[pool]
            env_stack = contextlib.AsyncExitStack()
            try:
                env = await env_stack.enter_async_context(self._provider.acquire(pool, self.key))
                if self._on_acquire is not None:
                    self._on_acquire(pool)
                    if self._on_release is not None:
                        env_stack.callback(self._on_release, pool)
                if self._setup_env is not None:
                    await self._setup_env(pool, env)
            except BaseException:
                await env_stack.aclose()
                raise
            self._stack.push_async_callback(env_stack.aclose)
            self._releases += 1
            self._envs[pool] = env
            return env

    async def aclose(self) -> None:
        """Release every environment this chain acquired (in reverse order); idempotent.

        The release runs to completion even if the caller is cancelled (again) meanwhile; the
        cancellation is re-raised once everything is released.
        """
        self._closed = True
        self._envs.clear()
        if not self._releases:
            return  # nothing acquired (most chains of tool-only agents): no task to run
        self._releases = 0
        closing = asyncio.ensure_future(self._stack.aclose())
        cancelled = False
        while not closing.done():
            try:
                await asyncio.shield(closing)
            except asyncio.CancelledError:
                cancelled = True
        closing.result()  # re-raises a failure of the release itself
        if cancelled:
            raise asyncio.CancelledError()

    async def __aenter__(self) -> ToolContext:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
