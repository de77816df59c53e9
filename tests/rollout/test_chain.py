"""The rollout runner: chains overlap, limits hold, and cancellation releases everything."""

import asyncio
import time
from typing import Any

import pytest

from agentfly_jax.envs import Environment, ResourceManager, StepResult
from agentfly_jax.rollout.agents import ToolCallingAgent
from agentfly_jax.tools import tool
from tests.rollout.fakes import FakeEnvProvider, FakeScriptedBackend, tool_call_text

QWEN = "qwen2.5"
GENERATION_S = 0.1


def test_64_chains_of_3_turns_run_their_tool_calls_concurrently(qwen_tokenizer):
    """64 chains x 3 turns x 3 tool calls: every chain's first-turn calls are in flight at the same time.

    Checked structurally, not by wall-clock: each first-turn call waits until all 64 x 3 of them have
    started. A runner that ran chains, or one turn's calls, one after another would never get there and
    the test would fail on the timeout instead of depending on how busy the machine is."""
    expected = 64 * 3
    started = {"count": 0, "peak_running": 0, "running": 0}
    everyone_started = asyncio.Event()

    @tool
    async def gated_lookup(item: str) -> str:
        """Looks something up, waiting for the other chains on the first turn.

        Args:
            item: What to look up.
        """
        started["count"] += 1
        started["running"] += 1
        started["peak_running"] = max(started["peak_running"], started["running"])
        if started["count"] >= expected:
            everyone_started.set()
        try:
            if started["count"] <= expected:
                await asyncio.wait_for(everyone_started.wait(), timeout=60)
            return f"{item}: found"
        finally:
            started["running"] -= 1

    def script(prompt):
        return "Looking up.\n" + "\n".join(tool_call_text("gated_lookup", {"item": f"k{i}"}) for i in range(3))

    backend = FakeScriptedBackend(qwen_tokenizer, script, latency_s=GENERATION_S)
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[gated_lookup], chat_template=QWEN, max_turns=3)
    tasks = [{"question": f"Look up batch {i}."} for i in range(16)]
    trajectories = asyncio.run(agent.run(tasks, num_chains=4, progress=False))
    assert len(trajectories) == 64
    assert all(t.finish_reason == "max_turns" and t.tool_calls == 9 for t in trajectories)
    errors = [r.error for t in trajectories for r in t.tool_call_records if r.error]
    assert not errors, f"a first-turn call timed out waiting for the others: {errors[:3]}"
    assert started["count"] == 64 * 9 and started["peak_running"] == expected
    assert backend.peak_in_flight == 64  # every chain's turn was being sampled at the same time


def test_max_concurrency_bounds_running_chains_and_environments(qwen_tokenizer):
    @tool(stateful=True, pool="box")
    async def poke(env: Any) -> str:
        """Pokes the box."""
        await asyncio.sleep(0.02)
        return "poked"

    def script(prompt):
        return tool_call_text("poke", {}) if prompt.turn == 0 else "done"

    provider = FakeEnvProvider()
    backend = FakeScriptedBackend(qwen_tokenizer, script, latency_s=0.01)
    agent = ToolCallingAgent(
        backend, qwen_tokenizer, tools=[poke], env_provider=provider, chat_template=QWEN, max_concurrency=3
    )
    trajectories = asyncio.run(agent.run([{"question": f"q{i}"} for i in range(5)], num_chains=2, progress=False))
    assert all(t.finish_reason == "stop" for t in trajectories)
    assert backend.peak_in_flight <= 3 and provider.peak_active <= 3
    assert len(provider.acquired) == 10 and not provider.active
    assert agent.last_run_stats["envs_in_use_peak"] <= 3 and agent.last_run_stats["envs_acquired"] == 10


def test_environment_acquired_lazily_and_kept_for_the_chain(qwen_tokenizer):
    @tool(stateful=True, pool="box")
    async def poke(env: Any) -> str:
        """Pokes the box."""
        env.history.append("poke")
        return f"poked {len(env.history)} times"

    def script(prompt):
        if "no tools" in prompt.question:
            return "answer"
        return tool_call_text("poke", {}) if prompt.turn < 3 else "answer"

    provider = FakeEnvProvider()
    agent = ToolCallingAgent(
        FakeScriptedBackend(qwen_tokenizer, script), qwen_tokenizer, tools=[poke], env_provider=provider,
        chat_template=QWEN,
    )
    poker, idle = asyncio.run(agent.run([{"question": "poke"}, {"question": "no tools"}], progress=False))
    assert [m["content"] for m in poker.messages if m["role"] == "tool"] == [
        "poked 1 times", "poked 2 times", "poked 3 times",
    ]
    assert len(provider.acquired) == 1 and provider.acquired[0][1].endswith("/0/0")
    assert provider.released == provider.acquired and idle.tool_calls == 0


def test_resource_manager_as_the_environment_provider(qwen_tokenizer):
    """The real resource manager plugs in as env_provider: one instance per chain, kept across turns."""

    class Counter(Environment):
        def __init__(self):
            self.count = 0
            self.task = None

        async def reset(self, task=None):
            self.count, self.task = 0, task

        async def step(self, action):
            self.count += 1
            return StepResult(observation=str(self.count))

    @tool(stateful=True, pool="counter")
    async def bump(env: Any) -> str:
        """Bumps the counter."""
        result = await env.step("bump")
        return f"{env.task['question']}={result.observation}"

    def script(prompt):
        return tool_call_text("bump", {}) if prompt.turn < 2 else "done"

    async def scenario():
        manager = ResourceManager({"counter": {"factory": Counter, "max_size": 8}})
        agent = ToolCallingAgent(
            FakeScriptedBackend(qwen_tokenizer, script), qwen_tokenizer, tools=[bump], env_provider=manager,
            chat_template=QWEN,
        )
        try:
            trajectories = await agent.run([{"question": "a"}, {"question": "b"}], num_chains=2, progress=False)
            return trajectories, manager.metrics("counter")
        finally:
            await manager.close()

    trajectories, metrics = asyncio.run(scenario())
    for trajectory in trajectories:
        question = trajectory.messages[0]["content"]
        tool_outputs = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
        assert tool_outputs == [f"{question}=1", f"{question}=2"]
    assert metrics["acquires"] == 4 and metrics["in_use"] == 0


# --------------------------------------------------------------------------------------------------
# Cancellation
# --------------------------------------------------------------------------------------------------


class Tracker:
    """Counts tool calls that started, finished and were cancelled."""

    def __init__(self):
        self.started = 0
        self.finished = 0
        self.cancelled = 0
        self.all_started = asyncio.Event()


@pytest.mark.parametrize("cancellations", [1, 3])
def test_cancelling_mid_tool_leaves_no_tasks_and_releases_every_environment(qwen_tokenizer, cancellations):
    """Cancelling mid-tool (once, or again while environments are being released) releases everything."""
    chains = 12

    async def scenario():
        tracker = Tracker()

        @tool(stateful=True, pool="sandbox")
        async def long_job(env: Any) -> str:
            """A job that takes long."""
            tracker.started += 1
            if tracker.started == chains:
                tracker.all_started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                tracker.cancelled += 1
                raise
            tracker.finished += 1
            return "done"

        @tool
        async def side_job() -> str:
            """Runs next to the long job."""
            await asyncio.sleep(30)
            return "done"

        provider = FakeEnvProvider(acquire_delay_s=0.001, release_delay_s=0.01)
        reply = tool_call_text("long_job", {}) + "\n" + tool_call_text("side_job", {})
        agent = ToolCallingAgent(
            FakeScriptedBackend(qwen_tokenizer, lambda prompt: reply, latency_s=0.01),
            qwen_tokenizer, tools=[long_job, side_job], env_provider=provider, chat_template=QWEN,
        )
        rollout = asyncio.create_task(agent.run([{"question": "q"}], num_chains=chains, progress=False))
        await asyncio.wait_for(tracker.all_started.wait(), 10)
        assert len(provider.active) == chains
        rollout.cancel()
        for _ in range(cancellations - 1):
            await asyncio.sleep(0.005)  # releases take 0.01 s each: cancel again while they run
            rollout.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rollout
        # Checked inside the loop, right away: asyncio.run's shutdown would finalise leaked context managers.
        leftover = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        snapshot = (dict(provider.active), list(provider.acquired), list(provider.released))
        return tracker, leftover, snapshot, agent.last_run_stats

    tracker, leftover, (active, acquired, released), stats = asyncio.run(scenario())
    assert leftover == [] and stats["finish/cancelled"] == chains
    assert tracker.cancelled == chains and tracker.finished == 0
    assert active == {} and len(acquired) == chains and sorted(released) == sorted(acquired)


def test_deadline_cancels_slow_chains_and_returns_them_flagged(qwen_tokenizer):
    @tool(stateful=True, pool="sandbox")
    async def job(seconds: float, env: Any) -> str:
        """Works for a while."""
        await asyncio.sleep(seconds)
        return "ok"

    def script(prompt):
        if prompt.turn > 0:
            return "\\boxed{1}"
        seconds = 30 if "slow" in prompt.question else 0.01
        return tool_call_text("job", {"seconds": seconds})

    provider = FakeEnvProvider(release_delay_s=0.01)

    @tool
    def unused() -> str:
        """Unused."""
        return ""

    agent = ToolCallingAgent(
        FakeScriptedBackend(qwen_tokenizer, script), qwen_tokenizer, tools=[job, unused], env_provider=provider,
        chat_template=QWEN, reward_fn=lambda prediction: 1.0,
    )
    async def scenario():
        trajectories = await agent.run(
            [{"question": "fast"}, {"question": "slow"}], num_chains=2, progress=False, timeout=0.5
        )
        leftover = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        return trajectories, leftover, dict(provider.active)

    started = time.perf_counter()
    trajectories, leftover, active = asyncio.run(scenario())
    assert time.perf_counter() - started < 5
    assert leftover == [] and active == {}
    fast, slow = trajectories[::2]
    assert (fast.finish_reason, fast.reward) == ("stop", 1.0)
    assert slow.finish_reason == "cancelled" and "cancelled" in slow.flags and slow.reward == 0.0
    assert slow.num_turns == 1 and slow.num_action_tokens > 0  # what it had sampled is kept
    assert not provider.active and len(provider.released) == len(provider.acquired) == 4
    assert agent.last_run_stats["finish/cancelled"] == 2
