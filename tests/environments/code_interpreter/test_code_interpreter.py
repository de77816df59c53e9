"""Code interpreter environment: observations, persistent state, reset, the tool through the agent runtime's
ToolContext and the resource manager, and unit-test rewards (HumanEval- and MBPP-style)."""

import asyncio

import pytest

from agentfly_jax.envs import ResourceManager
from agentfly_jax.envs.sandbox import CellResult, SandboxError
from environments.code_interpreter import (
    POOL_CONFIG,
    CodeInterpreterEnv,
    build_test_program,
    extract_code,
    format_observation,
    run_unit_tests,
)


def test_extract_code_takes_fenced_blocks_or_the_whole_text():
    assert extract_code("x = 1") == "x = 1"
    text = "Let me compute.\n```python\na = 2\n```\nthen\n```py\nprint(a)\n```\ndone"
    assert extract_code(text) == "a = 2\n\nprint(a)"


def test_format_observation_parts_and_notes():
    cell = CellResult(stdout="hello\n", stderr="careful\n", value="42", error=None)
    assert format_observation(cell, timeout=5, max_chars=1000) == "hello\n[stderr]\ncareful\nOut: 42"
    assert format_observation(CellResult(), timeout=5, max_chars=1000) == "(no output)"
    interrupted = format_observation(CellResult(timed_out=True), timeout=5, max_chars=1000)
    assert "longer than 5 s" in interrupted and "kept" in interrupted
    killed = format_observation(
        CellResult(
            timed_out=True,
            restarted=True,
            crash="the code ignored the 5 s time limit, so the session was killed",
        ),
        timeout=5,
        max_chars=1000,
    )
    assert killed.startswith("[session restarted] The code ignored") and "are lost" in killed
    long = format_observation(CellResult(stdout="a" * 5000 + "END"), timeout=5, max_chars=200)
    assert len(long) < 260 and long.startswith("aaa") and long.endswith("END")
    assert "characters truncated" in long


def test_state_persists_and_reset_starts_fresh(loop, backend):
    async def main():
        env = CodeInterpreterEnv(backend, timeout=2.0, max_output_chars=500)
        try:
            assert (await env.step("import math\nr = 3")).observation == "(no output)"
            result = await env.step("```python\nprint('area')\nround(math.pi * r * r, 2)\n```")
            assert result.observation == "area\nOut: 28.27" and not result.done and result.reward is None
            assert result.info["value"] == "28.27"
            error = await env.step("r / 0")
            assert "ZeroDivisionError" in error.observation and error.info["error"]
            await env.reset()
            assert "NameError" in (await env.step("r")).observation
            timeout = await env.step("import time\ntime.sleep(30)")
            assert timeout.info["timed_out"] and "[timeout]" in timeout.observation
            assert env.stats == {"cells": 5, "timeouts": 1, "restarts": 0, "sandbox_errors": 0}
            assert await env.health()
        finally:
            await env.close()

    loop.run_until_complete(main())


def test_sandbox_failure_becomes_an_observation_and_marks_the_env_unhealthy(loop):
    class BrokenSandbox:
        async def open_session(self):
            raise SandboxError("no Docker daemon answers at unix:///nowhere")

    async def main():
        env = CodeInterpreterEnv(sandbox=BrokenSandbox())
        result = await env.step("1 + 1")
        assert result.observation.startswith("[sandbox error]") and "no Docker daemon" in result.observation
        assert not await env.health()
        await env.reset()
        assert await env.health()

    loop.run_until_complete(main())


def test_tool_keeps_one_session_per_chain_through_the_manager(loop, backend):
    from agentfly_jax.tools import ToolContext, execute_tool_call
    from environments.code_interpreter.tools import code_interpreter

    async def main():
        config = dict(POOL_CONFIG, kwargs={"backend": backend, "timeout": 5.0, "max_output_chars": 1000})
        async with ResourceManager({"code_interpreter": config}) as manager:

            async def chain(name, value):
                async with ToolContext(env_provider=manager, key=name) as context:
                    call = {"name": "code_interpreter", "arguments": {"code": f"secret = {value!r}"}}
                    await execute_tool_call(call, [code_interpreter], context=context)
                    call = {"name": "code_interpreter", "arguments": {"code": "print(secret)"}}
                    return await execute_tool_call(call, [code_interpreter], context=context)

            a, b = await asyncio.gather(chain("chain-a", "alpha"), chain("chain-b", "beta"))
            assert (a.ok, a.observation, b.observation) == (True, "alpha", "beta")
            metrics = manager.metrics("code_interpreter")
            assert metrics["created"] == 2 and metrics["in_use"] == 0

    loop.run_until_complete(main())


HUMAN_EVAL_TASK = {
    "prompt": "from typing import List\n\n\ndef running_max(numbers: List[int]) -> List[int]:\n"
    '    """Running maximum of a list."""\n',
    "entry_point": "running_max",
    "test": "def check(candidate):\n"
    "    assert candidate([1, 3, 2, 5]) == [1, 3, 3, 5]\n"
    "    assert candidate([]) == []\n",
}


@pytest.mark.parametrize(
    "completion, passed",
    [
        (
            "    out, best = [], None\n"
            "    for n in numbers:\n"
            "        best = n if best is None else max(best, n)\n"
            "        out.append(best)\n    return out\n",
            True,
        ),  # body only, as in HumanEval
        (
            "```python\ndef running_max(numbers):\n    import itertools\n"
            "    return list(itertools.accumulate(numbers, max))\n```",
            True,
        ),  # a whole function in a fence
        ("def running_max(numbers):\n    return sorted(numbers)\n", False),  # wrong
        ("def running_max(numbers)\n    return numbers\n", False),  # syntax error
    ],
)
def test_unit_test_reward(loop, backend, completion, passed):
    result = loop.run_until_complete(
        run_unit_tests(completion, HUMAN_EVAL_TASK, backend=backend, timeout=5.0)
    )
    assert result["passed"] is passed and result["reward"] == float(passed)
    assert (result["error"] is None) == passed


def test_unit_test_reward_times_out_and_supports_mbpp_rows(loop):
    slow = "def running_max(numbers):\n    while True:\n        pass\n"
    result = loop.run_until_complete(run_unit_tests(slow, HUMAN_EVAL_TASK, timeout=1.0))
    assert result["timed_out"] and result["reward"] == 0.0
    mbpp = {"test_list": ["assert square(3) == 9", "assert square(-2) == 4"]}
    assert loop.run_until_complete(run_unit_tests("def square(x):\n    return x * x", mbpp))["passed"]
    assert "assert square(3) == 9" in build_test_program("def square(x): return x", mbpp)
    with pytest.raises(ValueError, match="neither 'test'"):
        build_test_program("x", {"question": "?"})


def test_reward_is_registered_for_the_agent_runtime(loop):
    from agentfly_jax.rewards import REWARD_REGISTRY
    from environments.code_interpreter.rewards import code_unit_tests

    assert REWARD_REGISTRY["code_unit_tests"] is code_unit_tests
    good = "    return [max(numbers[:i + 1]) for i in range(len(numbers))]\n"
    result = loop.run_until_complete(code_unit_tests.func(prediction=good, task=HUMAN_EVAL_TASK))
    assert result["reward"] == 1.0
