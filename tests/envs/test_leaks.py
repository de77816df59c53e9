"""Leak tests: 100 chains cancelled in the middle of executing code leave 0 sandbox processes and, once the
sandbox is closed, 0 containers; the same for 100 cancelled one-shot runs."""

import asyncio

import pytest

from agentfly_jax.envs import ResourceManager
from agentfly_jax.envs.sandbox import close_sandboxes, configure_sandbox, get_sandbox, run_python
from environments.code_interpreter import CodeInterpreterEnv
from tests.envs.sandbox_helpers import our_containers, sandbox_processes, wait_until

CHAINS = 100
DOCKER_CONTAINERS = 16  # chains beyond this wait for a container, and are cancelled while waiting


@pytest.fixture(scope="module", autouse=True)
def docker_pool_size():
    configure_sandbox("docker", max_containers=DOCKER_CONTAINERS, warm=2)
    yield
    configure_sandbox("docker")


async def wait_for_count(items, target, timeout):
    for _ in range(int(timeout / 0.05)):
        if len(items) >= target:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"only {len(items)} of {target} chains got going within {timeout} s")


async def cancel_chains_mid_cell(backend):
    manager = ResourceManager(
        {
            "code": {
                "factory": CodeInterpreterEnv,
                "max_size": CHAINS,
                "acquire_timeout": 120,
                "kwargs": {"backend": backend, "timeout": 60.0},
            }
        }
    )
    executing = set()

    async def chain(i):
        async with manager.acquire("code", f"chain-{i}") as env:
            await env.step("import time")
            executing.add(i)
            await env.step("while True:\n    time.sleep(0.05)")

    tasks = [asyncio.create_task(chain(i)) for i in range(CHAINS)]
    await wait_for_count(executing, CHAINS if backend == "bwrap" else DOCKER_CONTAINERS, timeout=90)
    await asyncio.sleep(0.3)  # every started chain is now inside its endless cell
    for task in tasks:
        task.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), [o for o in outcomes][:3]
    await manager.close()
    metrics = manager.metrics("code")
    assert metrics["in_use"] == 0 and metrics["size"] == 0 and metrics["created"] == metrics["destroyed"]
    return len(executing)


async def cancel_runs_mid_execution(backend):
    tasks = [
        asyncio.create_task(
            run_python(f"print({i}, flush=True)\nwhile True:\n    pass", backend=backend, timeout=60.0)
        )
        for i in range(CHAINS)
    ]
    await asyncio.sleep(3.0)
    assert not any(t.done() for t in tasks)
    for task in tasks:
        task.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)


def test_cancelled_chains_leave_nothing(loop, backend):
    started = loop.run_until_complete(cancel_chains_mid_cell(backend))
    assert started == (CHAINS if backend == "bwrap" else DOCKER_CONTAINERS)
    check_nothing_left(loop, backend)


def test_cancelled_runs_leave_nothing(loop, backend):
    loop.run_until_complete(cancel_runs_mid_execution(backend))
    check_nothing_left(loop, backend)


def check_nothing_left(loop, backend):
    if backend == "bwrap":
        loop.run_until_complete(get_sandbox_close("bwrap"))
        assert wait_until(lambda: not sandbox_processes(), 5.0), f"left behind: {sandbox_processes()}"
    else:
        pool = loop.run_until_complete(get_pool_metrics())
        assert pool["in_use"] == 0  # only idle warm containers may remain before the sandbox closes
        loop.run_until_complete(close_sandboxes())
        assert our_containers() == []


async def get_sandbox_close(backend):
    await get_sandbox(backend).close()


async def get_pool_metrics():
    sandbox = get_sandbox("docker")
    for _ in range(100):  # destroyed containers are replaced in the background
        metrics = sandbox.pool.metrics("containers")
        if metrics["in_use"] == 0 and metrics["recycling"] == 0:
            break
        await asyncio.sleep(0.05)
    return sandbox.pool.metrics("containers")
