"""Host side of a persistent Python session running inside a sandbox (either backend).

The session program (inside.py, mode "session") reads one JSON request per line and answers one JSON reply
per line. This module sends cells, enforces the hard time limit (timeout + grace: if the in-sandbox
interrupt did not stop the cell, the whole sandbox is killed) and turns every way a session can die into a
CellResult that says what happened.

Why a cell cannot forge a reply. In-process user code can do anything its process can: write to every fd
it holds, find any object through `gc` or frames, replace sys.stdout, close fds, fork, `os._exit`. So the
process that runs cells must never hold the host channel, and must not be able to reach the one that
does:

- The program the host starts is a *relay*: it owns the host channel (stdin/stdout of the bwrap process or
  of the `docker exec`, the same transport on both backends), never runs user code, and makes itself
  undumpable (prctl PR_SET_DUMPABLE 0) before the first request. Same-uid processes then cannot open its
  /proc/PID/fd/N, read or write its memory, ptrace it or take its fds with pidfd_getfd; nothing in a
  sandbox has CAP_SYS_PTRACE. Under bwrap it is also PID 1 of the sandbox, which user code cannot signal.
- Cells run in a forked *kernel* whose fds 0/1/2 are /dev/null and two memory files, and whose only link
  to the relay is a unix socket the relay shut down for reading: the kernel can receive requests on it
  but can never send.
- For each cell the relay creates a fresh result pipe and passes its write end to the kernel with the
  request (SCM_RIGHTS). The kernel writes one result line tagged with the request's sequence number and
  closes the pipe; the relay reads it to EOF and takes it only if it holds exactly that one line. A pipe
  closed without a result while the kernel lives, garbage, a second line, a wrong sequence number or a
  flood end the session with a reply whose "crash" says what the cell did. The relay reads stdout and
  stderr from the memory files itself and measures the time.
- Each reply carries the request's id, checked here: a reply for another request ends the session.

So bytes a cell writes to fd 1, to sys.__stdout__ or to any fd it can find are its own output or a
detected tampering, never a reply, and each later cell gets its own reply. What a cell can still do is
limited to its own process: it can make *its own* cell report any value or error (as a custom `__repr__`
or exception can anyway), and since it owns the kernel it can also rewrite the kernel's runner for later
cells of the same session (e.g. a thread that takes their requests off the socket); answers that come from
a session are the model's own statements, not something a reward should trust. A cell that closes its
result pipe after writing a result of its own is caught one cell later (the kernel notes it and the
relay ends the session). Killing or stopping the relay (possible under docker, where it is not PID 1)
ends the session like any crash.
"""

from __future__ import annotations

import abc
import asyncio
import json
import time

from agentfly_jax.envs.sandbox.common import CellResult, SandboxError, SandboxLimits, join_head_tail

_REPLY_TYPES = {
    "id": int,
    "stdout": list,
    "stderr": list,
    "value": (str, type(None)),
    "error": (str, type(None)),
    "timed_out": bool,
}


def _check_reply(line: bytes, request_id: int) -> dict | str:
    """The reply as a dict when it is well formed and answers request `request_id`, else why not."""
    try:
        reply = json.loads(line)
    except ValueError:
        return "its reply was unreadable (the session program wrote something else than a reply)"
    if not isinstance(reply, dict):
        return "its reply was unreadable (not a JSON object)"
    for key, kind in _REPLY_TYPES.items():
        if not isinstance(reply.get(key, ...), kind):
            return f"its reply was unreadable (field {key!r} is missing or has the wrong type)"
    if reply["id"] != request_id:
        return f"it answered request {reply['id']} when request {request_id} was due; the session was ended"
    for key in ("stdout", "stderr"):
        stream = reply[key]
        if not (
            len(stream) == 3
            and isinstance(stream[0], str)
            and isinstance(stream[1], str)
            and isinstance(stream[2], int)
        ):
            return f"its reply was unreadable ({key!r} is not [head, tail, size])"
    if not isinstance(reply.get("crash", ""), str):
        return "its reply was unreadable ('crash' is not text)"
    return reply


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
        start = time.monotonic()
        async with self._lock:
            self.cells += 1
            request = json.dumps(
                {"id": self.cells, "code": code, "timeout": timeout, "head": cap - cap // 4, "tail": cap // 4}
            )
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
            reply = _check_reply(line, self.cells)
            if isinstance(reply, str):
                await self._end(reply)
                return CellResult(restarted=True, crash=reply, elapsed_s=time.monotonic() - start)
            if "crash" in reply:  # the session program ended the session (e.g. the cell tampered with it)
                await self._end(reply["crash"])
        return CellResult(
            stdout=join_head_tail(*reply["stdout"]),
            stderr=join_head_tail(*reply["stderr"]),
            value=reply["value"],
            error=reply["error"],
            timed_out=reply["timed_out"],
            restarted="crash" in reply,
            crash=reply.get("crash"),
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
