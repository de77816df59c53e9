"""Hostile tool calls, tools and rewards in the chain runner: every chain goes on and finishes, the model sees
an error observation, the error kinds are counted, and nothing ends the process.

The model is `FakeScriptedBackend` (a fake: it replays scripted text as tokens of the real Qwen tokenizer); the
parsers, tool execution, chain runner, template and rewards are the real ones.
"""

import asyncio
import sys
import threading
import time

import pytest

from agentfly_jax.rewards import reward
from agentfly_jax.rollout.agents import ReactAgent, ToolCallingAgent
from agentfly_jax.tools import tool
from tests.rollout.fakes import FakeEnvProvider, FakeScriptedBackend
from tests.tools.hostile_tools import (
    DIGITS,
    circular_list,
    circular_observation,
    echo,
    exits_async,
    exits_sync,
    huge_int,
    interrupts_sync,
    lone_surrogate,
    number,
    stubborn_tool,
)

QWEN = "qwen2.5"


RELEASE_STUBBORN = threading.Event()


stubborn = stubborn_tool(RELEASE_STUBBORN, 0.3)


TOOLS = [echo, number, huge_int, circular_list, circular_observation, lone_surrogate, exits_sync, exits_async,
         interrupts_sync, stubborn]

# question -> (first-turn text of the Hermes-format model, the error kind its call gets)
HERMES_CASES = {
    "big int argument": ('<tool_call>{"name": "number", "arguments": {"x": ' + DIGITS + "}}</tool_call>", "bad_json"),
    "big int in string arguments": (
        '<tool_call>{"name": "number", "arguments": "{\\"x\\": ' + DIGITS + '}"}</tool_call>',
        "bad_json",
    ),
    "surrogate argument": ('<tool_call>{"name": "echo", "arguments": {"text": "a\\ud800b"}}</tool_call>', "bad_json"),
    "surrogate name": ('<tool_call>{"name": "ech\\ud800", "arguments": {}}</tool_call>', "bad_json"),
    "big int returned": ('<tool_call>{"name": "huge_int", "arguments": {}}</tool_call>', "tool_exception"),
    "circular list returned": ('<tool_call>{"name": "circular_list", "arguments": {}}</tool_call>', "tool_exception"),
    "circular dict returned": ('<tool_call>{"name": "circular_observation", "arguments": {}}</tool_call>', "tool_exception"),
    "surrogate returned": ('<tool_call>{"name": "lone_surrogate", "arguments": {}}</tool_call>', "tool_exception"),
    "sys.exit in a thread": ('<tool_call>{"name": "exits_sync", "arguments": {}}</tool_call>', "tool_exception"),
    "SystemExit on the loop": ('<tool_call>{"name": "exits_async", "arguments": {}}</tool_call>', "tool_exception"),
    "KeyboardInterrupt": ('<tool_call>{"name": "interrupts_sync", "arguments": {}}</tool_call>', "tool_exception"),
    "swallowed cancellation": ('<tool_call>{"name": "stubborn", "arguments": {}}</tool_call>', "timeout"),
}

REACT_CASES = {
    "big int argument": ('Thought: big.\nAction: number\nAction Input: {"x": ' + DIGITS + "}", "bad_json"),
    "surrogate argument": ('Thought: odd.\nAction: echo\nAction Input: {"text": "a\\ud800b"}', "bad_json"),
    "surrogate returned": ("Thought: look.\nAction: lone_surrogate\nAction Input: {}", "tool_exception"),
    "circular list returned": ("Thought: look.\nAction: circular_list\nAction Input: {}", "tool_exception"),
}


def run_agent(agent, tasks, **kwargs):
    """agent.run in a fresh loop; a BaseException escaping it fails the test (and nothing else)."""
    try:
        return asyncio.run(agent.run(tasks, num_chains=1, progress=False, **kwargs))
    except BaseException as error:  # noqa: BLE001 - KeyboardInterrupt would otherwise stop the whole session
        pytest.fail(f"the rollout let {type(error).__name__}({error}) through")


def script_for(cases, final="Final Answer: done"):
    def script(prompt):
        if prompt.turn == 1 and prompt.question == "swallowed cancellation":
            RELEASE_STUBBORN.set()  # its chain went on past the timeout: let the abandoned call end now
        return cases[prompt.question][0] if prompt.turn == 0 else final

    return script


def check_chains(agent, trajectories, cases):
    stats = agent.last_run_stats
    assert stats["chain_errors"] == 0, [t.metrics.get("error") for t in trajectories]
    for question, trajectory in zip(cases, trajectories):
        kind = cases[question][1]
        assert trajectory.finish_reason == "stop" and trajectory.num_turns == 2, (question, trajectory.metrics)
        [record] = trajectory.tool_call_records
        assert record.error is not None and record.error.startswith(f"{kind}: "), (question, record.error)
        assert trajectory.metrics[f"tool_errors/{kind}"] == 1
        # the model saw the error: the observation message after its first turn is the record's observation
        assert record.observation in trajectory.messages[-2]["content"]
        assert trajectory.messages[-1]["role"] == "assistant"
    expected = {}
    for _, kind in cases.values():
        expected[kind] = expected.get(kind, 0) + 1
    for kind, count in expected.items():
        assert stats[f"tool_errors/{kind}"] == count, (kind, stats)


def test_hostile_calls_and_tools_end_as_observations_in_a_tool_calling_chain(qwen_tokenizer):
    RELEASE_STUBBORN.clear()
    backend = FakeScriptedBackend(qwen_tokenizer, script_for(HERMES_CASES, final="done"))
    agent = ToolCallingAgent(
        backend, qwen_tokenizer, tools=TOOLS, chat_template=QWEN, max_new_tokens=8192, max_context_tokens=16384
    )
    started = time.monotonic()
    trajectories = run_agent(agent, [{"question": question} for question in HERMES_CASES])
    elapsed = time.monotonic() - started
    check_chains(agent, trajectories, HERMES_CASES)
    assert agent.last_run_stats["tools_abandoned"] == 1  # the tool that swallowed its cancellation
    assert elapsed < 8
    by_question = dict(zip(HERMES_CASES, trajectories))
    surrogate = by_question["surrogate returned"]
    assert "before \\ud800 after" in surrogate.messages[-2]["content"]
    stubborn_record = by_question["swallowed cancellation"].tool_call_records[0]
    assert stubborn_record.latency_s < 0.3 + 1.5  # reported at the limit, not when the tool chose to end
    exits_record = by_question["sys.exit in a thread"].tool_call_records[0]
    assert "raised SystemExit: 2" in exits_record.observation


def test_hostile_calls_and_tools_end_as_observations_in_a_react_chain(qwen_tokenizer):
    backend = FakeScriptedBackend(qwen_tokenizer, script_for(REACT_CASES))
    agent = ReactAgent(
        backend, qwen_tokenizer, tools=TOOLS, chat_template=QWEN, max_new_tokens=8192, max_context_tokens=16384
    )
    trajectories = run_agent(agent, [{"question": question} for question in REACT_CASES])
    check_chains(agent, trajectories, REACT_CASES)
    observation = dict(zip(REACT_CASES, trajectories))["big int argument"].messages[-2]["content"]
    assert observation.startswith("Observation: Error: Action Input of 'number' is not valid JSON")
    assert "more than 4300 digits" in observation


def test_hostile_rewards_score_zero_with_their_kind_and_the_run_goes_on(qwen_tokenizer):
    release = threading.Event()

    @reward
    def moody(prediction: str, mood: str) -> float:
        if mood == "exit":
            sys.exit(2)
        if mood == "interrupt":
            raise KeyboardInterrupt
        if mood == "hang":
            release.wait(3600)  # no @reward(timeout=...): the agent's reward_timeout stops it
        return 1.0

    backend = FakeScriptedBackend(qwen_tokenizer, lambda prompt: "done")
    agent = ToolCallingAgent(
        backend, qwen_tokenizer, tools=[echo], reward_fn=moody, chat_template=QWEN, reward_timeout=0.3
    )
    tasks = [{"question": f"q {mood}", "mood": mood} for mood in ("fine", "exit", "interrupt", "hang")]
    try:
        started = time.monotonic()
        fine, exited, interrupted, hung = run_agent(agent, tasks)
        elapsed = time.monotonic() - started
    finally:
        release.set()
    assert elapsed < 30
    assert (fine.reward, fine.flags) == (1.0, set())
    for trajectory, kind, fragment in (
        (exited, "exception", "raised SystemExit: 2"),
        (interrupted, "exception", "raised KeyboardInterrupt"),
        (hung, "timeout", "did not finish within 0.3 s"),
    ):
        assert trajectory.finish_reason == "stop" and trajectory.reward == 0.0
        assert "reward_failed" in trajectory.flags
        assert trajectory.reward_extras["reward_error_kind"] == kind
        assert fragment in trajectory.reward_extras["reward_error"]
    stats = agent.last_run_stats
    assert stats["reward_failures"] == 3 and stats["chain_errors"] == 0
    assert stats["reward_failures/exception"] == 2 and stats["reward_failures/timeout"] == 1
    assert stats["rewards_abandoned"] == 1  # the blocked thread runs on


def test_rewards_without_a_timeout_get_the_default(qwen_tokenizer, monkeypatch):
    from agentfly_jax.rewards import decorator as reward_module

    monkeypatch.setattr(reward_module, "DEFAULT_REWARD_TIMEOUT_S", 0.3)

    @reward
    async def never(prediction: str) -> float:
        await asyncio.sleep(3600)
        return 1.0

    backend = FakeScriptedBackend(qwen_tokenizer, lambda prompt: "done")
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[echo], reward_fn=never, chat_template=QWEN)
    started = time.monotonic()
    [trajectory] = run_agent(agent, [{"question": "q"}])
    assert time.monotonic() - started < 30
    assert trajectory.reward_extras["reward_error_kind"] == "timeout"
    assert agent.last_run_stats["reward_failures/timeout"] == 1


def test_reward_timeout_must_be_positive(qwen_tokenizer):
    backend = FakeScriptedBackend(qwen_tokenizer, lambda prompt: "done")
    for bad in (0, -1.0, "5"):
        with pytest.raises(ValueError, match="reward_timeout must be positive seconds"):
            ToolCallingAgent(backend, qwen_tokenizer, tools=[echo], chat_template=QWEN, reward_timeout=bad)


def test_system_exit_from_an_environment_setup_is_an_env_error_observation(qwen_tokenizer):
    """An environment's code is no tool's, but a SystemExit in its setup must not end the process either: the
    call that needed it gets an env_error observation and the chain goes on."""

    @tool(stateful=True, pool="box")
    async def poke(env) -> str:
        """Pokes the box."""
        return "poked"

    class ExitingAgent(ToolCallingAgent):
        async def setup_env(self, pool, env, task):
            if task["question"] == "bad":
                raise SystemExit(4)

    def script(prompt):
        return '<tool_call>{"name": "poke", "arguments": {}}</tool_call>' if prompt.turn == 0 else "done"

    backend = FakeScriptedBackend(qwen_tokenizer, script)
    provider = FakeEnvProvider()
    agent = ExitingAgent(backend, qwen_tokenizer, tools=[poke], env_provider=provider, chat_template=QWEN)
    good, bad = run_agent(agent, [{"question": "good"}, {"question": "bad"}])
    assert good.finish_reason == bad.finish_reason == "stop"
    assert good.tool_call_records[0].observation == "poked"
    assert bad.tool_call_records[0].error.startswith("env_error: ")
    assert "SystemExit: 4" in bad.tool_call_records[0].observation
    assert agent.last_run_stats["tool_errors/env_error"] == 1 and not provider.active


def test_system_exit_from_the_backend_ends_only_its_chain_as_a_chain_error(qwen_tokenizer):
    def script(prompt):
        if prompt.question == "bad":
            raise SystemExit(5)
        return "done"

    backend = FakeScriptedBackend(qwen_tokenizer, script)
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[echo], chat_template=QWEN)
    good, bad = run_agent(agent, [{"question": "good"}, {"question": "bad"}])
    assert good.finish_reason == "stop" and not good.chain_error
    assert bad.finish_reason == "error" and bad.chain_error and bad.metrics["error"] == "SystemExit: 5"
    assert agent.last_run_stats["chain_errors"] == 1
