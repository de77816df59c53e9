"""Hostile rewards: SystemExit, hangs without a timeout, swallowed cancellation; each scores 0.0 with its kind."""

import asyncio
import math
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agentfly_jax.rewards import Reward, reward
from agentfly_jax.rewards import decorator as reward_module
from agentfly_jax.rewards.decorator import DEFAULT_REWARD_TIMEOUT_S, REWARD_ERROR_KINDS
from agentfly_jax.tools import execute as execute_module


def score(fn, prediction="x", **kwargs):
    """Reward.score in a fresh loop; a BaseException escaping it fails the test (and nothing else)."""
    try:
        return asyncio.run(fn.score(prediction=prediction, task={}, **kwargs))
    except BaseException as error:  # noqa: BLE001 - KeyboardInterrupt would otherwise stop the whole session
        pytest.fail(f"Reward.score let {type(error).__name__}({error}) through")


def assert_failed(result, kind, *fragments):
    assert (result.reward, result.ok, result.error_kind) == (0.0, False, kind), result
    assert kind in REWARD_ERROR_KINDS
    for fragment in fragments:
        assert fragment in result.error, result.error


def test_the_default_timeout_is_finite_and_documented():
    assert 0 < DEFAULT_REWARD_TIMEOUT_S < math.inf
    assert "DEFAULT_REWARD_TIMEOUT_S" in reward_module.__doc__ and "reward_timeout" in reward_module.__doc__


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("error, shown", [(SystemExit(2), "SystemExit: 2"), (KeyboardInterrupt(), "KeyboardInterrupt")])
def test_system_exit_and_keyboard_interrupt_from_a_reward_score_zero(asynchronous, error, shown):
    if asynchronous:

        async def leaves(prediction: str) -> float:
            raise error

    else:

        def leaves(prediction: str) -> float:
            raise error

    assert_failed(score(Reward(leaves, name="leaves")), "exception", f"reward 'leaves' raised {shown}")


def test_a_process_whose_reward_calls_sys_exit_carries_on():
    """In a child process, so that the failure without the fix (the process exits with code 2) is seen as such."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        from agentfly_jax.rewards import Reward

        def leaves(prediction):
            sys.exit(2)

        async def leaves_async(prediction):
            raise SystemExit(3)

        async def main():
            first = await Reward(leaves).score(prediction="x", task={})
            second = await Reward(leaves_async).score(prediction="x", task={})
            return first.error_kind, second.error_kind

        print("RESULT", *asyncio.run(main()))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RESULT exception exception" in done.stdout


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_hanging_reward_without_a_timeout_stops_at_the_default(monkeypatch, asynchronous):
    monkeypatch.setattr(reward_module, "DEFAULT_REWARD_TIMEOUT_S", 0.3)
    release = threading.Event()
    if asynchronous:

        async def hangs(prediction: str) -> float:
            await asyncio.sleep(3600)
            return 1.0

    else:

        def hangs(prediction: str) -> float:
            release.wait(3600)
            return 1.0

    started = time.monotonic()
    try:
        result = score(Reward(hangs, name="hangs"))
    finally:
        release.set()
    assert_failed(result, "timeout", "reward 'hangs' did not finish within 0.3 s")
    assert time.monotonic() - started < 5
    assert result.abandoned is (not asynchronous)  # a blocked thread runs on; a cancelled task ends


def test_the_limit_is_the_rewards_own_then_the_callers_then_the_default(monkeypatch):
    monkeypatch.setattr(reward_module, "DEFAULT_REWARD_TIMEOUT_S", 30.0)

    async def slow(prediction: str) -> float:
        await asyncio.sleep(0.5)
        return 1.0

    assert_failed(score(Reward(slow), timeout=0.1), "timeout", "within 0.1 s")  # the caller's beats the default
    assert score(Reward(slow), timeout=5.0).reward == 1.0
    assert_failed(score(Reward(slow, timeout=0.1), timeout=5.0), "timeout", "within 0.1 s")  # its own first
    assert score(Reward(slow, timeout=5.0), timeout=0.1).reward == 1.0
    assert score(Reward(slow), timeout=math.inf).reward == 1.0  # inf: no limit


def test_an_async_reward_that_swallows_cancellation_is_abandoned_at_its_limit():
    release = threading.Event()

    async def stubborn(prediction: str) -> float:
        give_up = time.monotonic() + 10  # a runtime that waits for it fails, not hangs
        while not release.is_set() and time.monotonic() < give_up:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass
        return 1.0

    async def scenario():
        started = time.monotonic()
        result = await Reward(stubborn, timeout=0.3).score(prediction="x", task={})
        elapsed = time.monotonic() - started
        release.set()
        await asyncio.sleep(0.05)
        return result, elapsed

    total_before, _ = execute_module.abandoned_calls()
    result, elapsed = asyncio.run(scenario())
    assert_failed(result, "timeout", "did not finish within 0.3 s and was abandoned still running")
    assert result.abandoned and elapsed < 0.3 + execute_module.CANCEL_GRACE_S + 1.0
    assert execute_module.abandoned_calls()[0] == total_before + 1


@pytest.mark.parametrize(
    "returned, kind",
    [("1.0", "bad_return"), ({"score": 1}, "bad_return"), (math.nan, "bad_return")],
)
def test_unusable_returns_are_bad_return(returned, kind):
    assert_failed(score(Reward(lambda prediction: returned, name="bad")), kind)


def test_a_return_whose_float_raises_is_bad_return():
    class Broken:
        def __float__(self):
            raise OverflowError("too big")

    assert_failed(score(Reward(lambda prediction: Broken(), name="broken")), "bad_return", "OverflowError: too big")


def test_decorated_reward_keeps_its_own_timeout():
    @reward(timeout=0.1)
    async def sleepy(prediction: str) -> float:
        await asyncio.sleep(1)
        return 1.0

    assert_failed(score(sleepy, timeout=10.0), "timeout", "within 0.1 s")


def test_an_abandoned_environment_backed_reward_retires_its_environment():
    """Like an abandoned tool call: a reward stopped at its limit while still changing its environment gets
    that instance destroyed by the real resource manager at release, not handed to the next chain."""
    from agentfly_jax.envs.manager import PoolConfig, ResourceManager
    from agentfly_jax.tools.context import ToolContext
    from tests.tools.hostile_tools import Counter

    gate = threading.Event()

    def counts(prediction: str, env) -> float:
        env.value += 1
        while prediction == "hang" and not gate.wait(0.01):
            env.value += 1
        return 1.0

    scorer = Reward(counts, pool="counters", timeout=0.2)

    async def scenario():
        manager = ResourceManager({"counters": PoolConfig(factory=Counter, max_size=4)})
        try:
            results = []
            for i, prediction in enumerate(("fine", "hang")):
                async with ToolContext({}, env_provider=manager, key=f"chain-{i}") as context:
                    results.append(await scorer.score(prediction=prediction, context=context))
            return results, manager.metrics("counters")
        finally:
            gate.set()
            await manager.close()

    (fine, hung), metrics = asyncio.run(scenario())
    assert fine.ok and fine.reward == 1.0
    assert_failed(hung, "timeout", "abandoned still running", "its environment will not be reused")
    assert metrics["retired"] == 1  # only the abandoned reward's instance
