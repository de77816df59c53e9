"""Sandboxes for running untrusted Python: bubblewrap (default, no daemon) and Docker (production).

One-shot:

    result = await run_python(code, backend="bwrap", timeout=10.0)
    result.stdout, result.stderr, result.exit_code, result.timed_out

Persistent (notebook-like) sessions, used by the code interpreter environment:

    session = await get_sandbox("docker").open_session()
    cell = await session.run_cell("x = 1\\nx + 1", timeout=5)   # cell.value == "2"
    await session.close()

Each backend has a default instance (`get_sandbox`), configured with `configure_sandbox(backend, **options)`
before first use; a bwrap sandbox is shared by every event loop of the process, a Docker sandbox (its pool of
warm containers) belongs to one event loop. `await close_sandboxes()` releases this loop's sandboxes.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from typing import Any

from agentfly_jax.envs.sandbox.common import (
    CellResult,
    ExecResult,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
)
from agentfly_jax.envs.sandbox.session import PythonSession

BACKENDS = ("bwrap", "docker")

__all__ = [
    "run_python",
    "get_sandbox",
    "configure_sandbox",
    "close_sandboxes",
    "ExecResult",
    "CellResult",
    "SandboxLimits",
    "SandboxError",
    "SandboxUnavailable",
    "PythonSession",
    "BACKENDS",
]

_lock = threading.Lock()
_options: dict[str, dict[str, Any]] = {"bwrap": {}, "docker": {}}
_bwrap: Any = None
_docker: dict[asyncio.AbstractEventLoop, Any] = {}


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {backend!r}; expected one of {BACKENDS}")


def configure_sandbox(backend: str, **options: Any) -> None:
    """Sets the options of `backend`'s default sandbox (BwrapSandbox / DockerSandbox keyword arguments).

    Takes effect for sandboxes created afterwards; call it before the first run, or after close_sandboxes().
    """
    _check_backend(backend)
    with _lock:
        _options[backend] = dict(options)


def get_sandbox(backend: str = "bwrap"):
    """The default sandbox of `backend` (created on first use; Docker ones per event loop)."""
    global _bwrap
    _check_backend(backend)
    if backend == "bwrap":
        with _lock:
            if _bwrap is None:
                from agentfly_jax.envs.sandbox.bwrap import BwrapSandbox

                _bwrap = BwrapSandbox(**_options["bwrap"])
            return _bwrap
    loop = asyncio.get_running_loop()
    with _lock:
        for stale in [lp for lp in _docker if lp.is_closed()]:  # a finished asyncio.run left it behind
            _docker.pop(stale).close_sync()
        if loop not in _docker:
            from agentfly_jax.envs.sandbox.docker_backend import DockerSandbox

            _docker[loop] = DockerSandbox(**_options["docker"])
        return _docker[loop]


async def run_python(code: str, *, backend: str = "bwrap", timeout: float = 10.0) -> ExecResult:
    """Runs `code` as a fresh Python program in a sandbox and returns its stdout, stderr, exit code and
    whether it timed out. The code cannot reach the network, the host's files or other sandboxes; it gets a
    private /tmp and the limits of the backend's SandboxLimits (memory, processes, file size, output)."""
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r}; expected positive seconds")
    return await get_sandbox(backend).run(code, timeout=timeout)


async def close_sandboxes() -> None:
    """Closes this event loop's Docker sandbox (its containers) and finishes bwrap slot releases."""
    global _bwrap
    loop = asyncio.get_running_loop()
    with _lock:
        docker_sandbox = _docker.pop(loop, None)
        bwrap_sandbox = _bwrap
    if docker_sandbox is not None:
        await docker_sandbox.close()
    if bwrap_sandbox is not None:
        await bwrap_sandbox.close()


@atexit.register
def _remove_containers_at_exit() -> None:
    """Removes the default Docker sandboxes' containers at a normal exit. Exits that skip this (kill -9, a
    crash, os._exit) and sandboxes made without get_sandbox are covered by the containers themselves: each
    one's PID 1 exits when the process that created it is gone, and Docker then removes it."""
    with _lock:
        sandboxes = list(_docker.values())
        _docker.clear()
    for sandbox in sandboxes:
        sandbox.close_sync()
