"""Shared by the sandbox tests: one event loop per test module, backend availability, leak counters.

Docker tests run against a real daemon (the test command's setup starts one). When the daemon or the
image is missing they FAIL with the reason; set AGENTFLY_SKIP_DOCKER_TESTS=1 to skip them on purpose.
"""

import asyncio
import os
import time

import pytest

from agentfly_jax.envs.sandbox import SandboxUnavailable, close_sandboxes, get_sandbox

SKIP_DOCKER_ENV = "AGENTFLY_SKIP_DOCKER_TESTS"


def new_loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(close_sandboxes())
    loop.close()


def require_backend(loop, backend: str):
    """The backend's default sandbox, ready; fails (or skips when opted out) with the reason otherwise."""
    if backend == "docker" and os.environ.get(SKIP_DOCKER_ENV) == "1":
        pytest.skip(f"{SKIP_DOCKER_ENV}=1: docker sandbox tests skipped on purpose")
    try:
        return loop.run_until_complete(_ready(backend))
    except SandboxUnavailable as e:
        reason = str(e)
    hint = f" (or set {SKIP_DOCKER_ENV}=1 to skip the docker tests)" if backend == "docker" else ""
    pytest.fail(f"{backend} sandbox unavailable: {reason}{hint}", pytrace=False)


async def _ready(backend):
    sandbox = get_sandbox(backend)
    if backend == "docker":
        await sandbox._ensure_ready()
    else:
        await (await sandbox._claim()).release()  # the first claim checks that a sandbox starts here
    return sandbox


def sandbox_processes() -> dict:
    """{pid: uid} of processes running as any bwrap sandbox uid."""
    from agentfly_jax.envs.sandbox.bwrap import processes_of_uids, sandbox_uids

    return processes_of_uids(uid for uid, _ in sandbox_uids())


def our_containers() -> list:
    """Sandbox containers owned by this test process."""
    from agentfly_jax.envs.sandbox.docker_backend import _owner, sandbox_containers

    return [c for c in sandbox_containers() if c["owner"] == _owner()]


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.05):
    """Polls `predicate` until true (returns True) or `timeout` seconds pass (returns False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


async def open_session(backend):
    return await get_sandbox(backend).open_session()


def cell(loop, session, code, timeout=5.0, **kwargs):
    """One cell of `session`, run to its end on `loop`."""
    return loop.run_until_complete(session.run_cell(code, timeout=timeout, **kwargs))
