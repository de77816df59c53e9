"""Host side of a persistent Python session running inside a sandbox (either backend).

The session process (inside.py, mode "session") reads one JSON request per line and answers one JSON reply
per line. This module sends cells, enforces the hard time limit (timeout + grace: if the in-sandbox
interrupt did not stop the cell, the whole sandbox is killed) and turns every way a session can die into a
CellResult that says what happened.
"""

from __future__ import annotations

import abc
import asyncio
import json
import time

from agentfly_jax.envs.sandbox.common import CellResult, SandboxError, SandboxLimits, join_head_tail


class Transport(abc.ABC):
    """A running session process: a line channel to it and a way to kill its whole sandbox."""

    @abc.abstractmethod
    async def write(self, data: bytes) -> None:
        """Sends bytes to the session's stdin."""

    @abc.abstractmethod
    async def readline(self) -> bytes:
        """The next line of the session's stdout; b"" at EOF; ValueError when a line is too long."""

    @abc.abstractmethod
    async def terminate(self) -> None:
        """Kills the session and everything it started, and frees the sandbox; idempotent."""

    @abc.abstractmethod
    def terminate_soon(self) -> None:
        """Starts `terminate` without waiting (for cancellation paths); idempotent."""

    @abc.abstractmethod
    async def death_reason(self) -> str:
        """Why the process ended (exit status, signal, memory limit, what it printed)."""


class PythonSession:
    """A notebook-like Python session in a sandbox: variables and imports persist across `run_cell` calls."""

    def __init__(self, transport: Transport, limits: SandboxLimits, *, grace_s: float = 1.0):
        self._transport = transport
        self.limits = limits
        self.grace_s = grace_s
        self._lock = asyncio.Lock()
        self._ended: str | None = None
        self.cells = 0

    @property
    def alive(self) -> bool:
        return self._ended is None

    async def run_cell(
        self, code: str, timeout: float = 10.0, max_output_bytes: int | None = None
    ) -> CellResult:
        """Executes `code` in the session; never raises for anything the code does."""
        if self._ended is not None:
            raise SandboxError(f"this Python session has ended ({self._ended}); open a new one")
        if not timeout > 0:
            raise ValueError(f"timeout={timeout!r}; expected positive seconds")
        cap = max_output_bytes or self.limits.max_output_bytes
        request = json.dumps({"code": code, "timeout": timeout, "head": cap - cap // 4, "tail": cap // 4})
        start = time.monotonic()
        async with self._lock:
            self.cells += 1
            try:
                await self._transport.write(request.encode() + b"\n")
                line = await asyncio.wait_for(self._transport.readline(), timeout + self.grace_s)
            except asyncio.TimeoutError:
                await self._end("killed after a time-out")
                return CellResult(
                    timed_out=True,
                    restarted=True,
                    elapsed_s=time.monotonic() - start,
                    crash=f"the code ignored the {timeout:g} s time limit, so the session was killed",
                )
            except asyncio.CancelledError:
                self._ended = "cancelled while running a cell"
                self._transport.terminate_soon()
                raise
            except (OSError, ValueError) as e:  # broken pipe / reset / a reply longer than the line limit
                reason = (
                    await self._transport.death_reason()
                    if isinstance(e, OSError)
                    else f"its reply exceeded the size limit ({e})"
                )
                await self._end(reason)
                return CellResult(restarted=True, crash=reason, elapsed_s=time.monotonic() - start)
            if not line:
                reason = await self._transport.death_reason()
                await self._end(reason)
                return CellResult(restarted=True, crash=reason, elapsed_s=time.monotonic() - start)
            try:
                reply = json.loads(line)
            except ValueError:
                reason = "its reply was unreadable (the code wrote into the session's control channel)"
                await self._end(reason)
                return CellResult(restarted=True, crash=reason, elapsed_s=time.monotonic() - start)
        return CellResult(
            stdout=join_head_tail(*reply["stdout"]),
            stderr=join_head_tail(*reply["stderr"]),
            value=reply["value"],
            error=reply["error"],
            timed_out=reply["timed_out"],
            elapsed_s=time.monotonic() - start,
        )

    async def _end(self, reason: str) -> None:
        self._ended = reason
        await self._transport.terminate()

    async def close(self) -> None:
        """Kills the session's process tree and frees its sandbox; idempotent."""
        if self._ended is None:
            self._ended = "closed"
        await self._transport.terminate()

    def close_soon(self) -> None:
        """Starts closing without waiting (from synchronous or cancelled code)."""
        if self._ended is None:
            self._ended = "closed"
        self._transport.terminate_soon()
