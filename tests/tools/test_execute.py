"""execute_tool_call: each failure kind comes back as an observation with ok=False and its error kind."""

import asyncio
import threading
import time
from typing import Any

import pytest

from agentfly_jax.tools.parsers import ParseError, ToolCall, parse_react
from agentfly_jax.tools import (
    DEFAULT_MAX_OBSERVATION_CHARS,
    TOOL_ERROR_KINDS,
    ToolContext,
    calculator,
    execute_tool_call,
    execute_tool_calls,
    parse_error_result,
    tool,
)
from tests.rollout.fakes import FakeEnvProvider


@tool
def add(a: int, b: int = 0) -> str:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return str(a + b)


@tool
async def explode(reason: str) -> str:
    """Always raises."""
    raise ValueError(f"boom: {reason}")


@tool(timeout=0.05)
async def hang() -> str:
    """Never finishes on its own."""
    await asyncio.sleep(30)
    return "unreachable"


stop_hanging_sync = threading.Event()


@tool(timeout=0.05)
def hang_sync() -> str:
    """A sync tool that blocks its thread."""
    stop_hanging_sync.wait(5)
    return "late"


@tool
def huge(size: int) -> str:
    """Returns a long text."""
    return "x" * size


@tool
async def structured(query: str) -> dict:
    """Returns an observation plus extras."""
    return {"observation": f"found {query}", "score": 0.5, "hits": 2}


@tool
def forgot_return(x: int) -> str:
    """Returns nothing by mistake."""


@tool
async def own_timeout_error() -> str:
    """Raises TimeoutError itself (not our timeout)."""
    raise TimeoutError("upstream service timed out")


TOOLS = [add, explode, hang, hang_sync, huge, structured, forgot_return, own_timeout_error, calculator]


def run(call, **kwargs):
    return asyncio.run(execute_tool_call(call, TOOLS, **kwargs))


def assert_failure(result, kind, *fragments):
    assert result.ok is False
    assert result.error_kind == kind and kind in TOOL_ERROR_KINDS
    assert result.observation.startswith("Error: ")
    for fragment in fragments:
        assert fragment in result.observation, result.observation


def test_successful_calls_from_parsed_raw_text_and_dict():
    parsed = run(ToolCall(name="add", arguments={"a": 2, "b": 3}, raw=""))
    assert (parsed.ok, parsed.observation, parsed.error, parsed.error_kind) == (True, "5", None, None)
    raw = run('<tool_call>\n{"name": "add", "arguments": {"a": 40, "b": 2}}\n</tool_call>')
    assert raw.ok and raw.observation == "42" and raw.arguments == {"a": 40, "b": 2}
    bare = run('{"name": "calculator", "arguments": {"expression": "6*7"}}')
    assert bare.ok and bare.observation == "42"
    as_dict = run({"name": "add", "arguments": {"a": 1}})
    assert as_dict.ok and as_dict.observation == "1"
    extras = run({"name": "structured", "arguments": {"query": "cats"}})
    assert extras.ok and extras.observation == "found cats" and extras.extras == {"score": 0.5, "hits": 2}


def test_arguments_as_a_json_encoded_string():
    as_dict = run({"name": "calculator", "arguments": '{"expression": "1+2"}'})
    assert as_dict.ok and as_dict.observation == "3" and as_dict.arguments == {"expression": "1+2"}
    as_text = run('<tool_call>{"name": "add", "arguments": "{\\"a\\": 40, \\"b\\": 2}"}</tool_call>')
    assert as_text.ok and as_text.observation == "42" and as_text.arguments == {"a": 40, "b": 2}
    # the decoded arguments are checked like any others
    wrong_type = run({"name": "add", "arguments": '{"a": "one"}'})
    assert_failure(wrong_type, "bad_arguments", "argument 'a' must be integer")


@pytest.mark.parametrize(
    "call, kind, fragment",
    [
        ({"name": "add", "arguments": '{"a": 1'}, "bad_json",
         "arguments of tool call 'add' are a string that is not valid JSON"),
        ({"name": "add", "arguments": "[1, 2]"}, "parse_error", "a JSON string holding list, not an object"),
        ({"name": "add", "arguments": '"{\\"a\\": 1}"'}, "parse_error", "a JSON string holding str"),
        ('<tool_call>{"name": "add", "arguments": "{a: 1}"}</tool_call>', "bad_json",
         "a string that is not valid JSON"),
        ('<tool_call>{"name": "add", "arguments": "7"}</tool_call>', "parse_error",
         "a JSON string holding int"),
    ],
)
def test_bad_json_encoded_arguments(call, kind, fragment):
    result = run(call)
    assert_failure(result, kind, fragment)
    assert result.name == "add"


def test_unknown_tool():
    result = run({"name": "teleport", "arguments": {}})
    assert_failure(result, "unknown_tool", "unknown tool 'teleport'", "Available tools: add, calculator")
    assert result.name == "teleport"


def test_bad_json():
    result = run('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>')
    assert_failure(result, "bad_json", "not valid JSON", '"name": "add"')
    assert result.name == "add"


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "is not closed"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', "has no name"),
        ('<tool_call>["add", 1]</tool_call>', "must be a JSON object"),
        ("just some words", "not valid JSON"),
        ('{"name": "add"}', "has no arguments"),
        ({"name": 3, "arguments": {}}, "a tool call is"),
        (
            (
                '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
                '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
            ),
            "expected exactly one tool call, found 2",
        ),
    ],
)
def test_malformed_calls(raw, fragment):
    result = run(raw)
    assert result.ok is False and result.error_kind in ("parse_error", "bad_json")
    assert fragment in result.observation


def test_parse_errors_of_every_parser_are_classified():
    react = parse_react("Action: add\nAction Input: {a: 1}")
    assert parse_error_result(react.errors[0]).error_kind == "bad_json"
    assert parse_error_result(ParseError("code block is not closed: end it", "```python")).error_kind == (
        "parse_error"
    )


@pytest.mark.parametrize(
    "arguments, fragments",
    [
        ({}, ["missing required argument 'a' (integer)"]),
        ({"a": 1, "c": 2}, ["unknown argument 'c'", "Expected arguments: a: integer, b: integer (optional)"]),
        ({"a": "one"}, ["argument 'a' must be integer, got 'one'"]),
    ],
)
def test_bad_arguments(arguments, fragments):
    assert_failure(run({"name": "add", "arguments": arguments}), "bad_arguments", *fragments)


def test_tool_exception():
    result = run({"name": "explode", "arguments": {"reason": "bad day"}})
    assert_failure(result, "tool_exception", "tool 'explode' raised ValueError: boom: bad day")
    returned_none = run({"name": "forgot_return", "arguments": {"x": 1}})
    assert_failure(returned_none, "tool_exception", "returned None")
    calculator_error = run({"name": "calculator", "arguments": {"expression": "1/0"}})
    assert_failure(calculator_error, "tool_exception", "ZeroDivisionError")
    # A TimeoutError the tool raises itself is the tool's exception, not our timeout.
    assert_failure(run({"name": "own_timeout_error", "arguments": {}}), "tool_exception", "upstream")


def test_timeout_async_and_sync():
    started = time.perf_counter()
    result = run({"name": "hang", "arguments": {}})
    assert time.perf_counter() - started < 2.0
    assert_failure(result, "timeout", "did not finish within 0.05 s")
    stop_hanging_sync.clear()
    started = time.perf_counter()
    result = run({"name": "hang_sync", "arguments": {}})
    assert time.perf_counter() - started < 2.0
    assert_failure(result, "timeout", "tool 'hang_sync' did not finish within 0.05 s")
    stop_hanging_sync.set()


def test_timeout_precedence_tool_then_call_then_with_options():
    slow = asyncio.sleep

    @tool
    async def nap(seconds: float) -> str:
        """Sleeps."""
        await slow(seconds)
        return "rested"

    call = {"name": "nap", "arguments": {"seconds": 0.2}}
    assert asyncio.run(execute_tool_call(call, [nap], timeout=0.05)).error_kind == "timeout"
    assert asyncio.run(execute_tool_call(call, [nap], timeout=5)).ok
    # The tool's own timeout wins over the call's default; with_options overrides the tool (e.g. config).
    assert asyncio.run(execute_tool_call(call, [nap.with_options(timeout=0.05)], timeout=5)).error_kind == "timeout"
    with pytest.raises(ValueError, match="unknown option"):
        nap.with_options(retries=3)


def test_oversized_is_truncated_with_a_note():
    result = run({"name": "huge", "arguments": {"size": 500}}, max_observation_chars=100)
    # The model still sees the output (cut), followed by a note; the call counts as failed.
    assert result.ok is False and result.error_kind == "oversized"
    assert result.observation.startswith("x" * 100 + "\n[observation truncated")
    assert "returned 500 characters, the limit is 100" in result.observation
    default = run({"name": "huge", "arguments": {"size": DEFAULT_MAX_OBSERVATION_CHARS + 1}})
    assert default.error_kind == "oversized"
    assert run({"name": "huge", "arguments": {"size": 100}}, max_observation_chars=100).ok


def test_stateful_tools_get_the_chains_env_serially_and_task_fields():
    order = []

    @tool(stateful=True, pool="notebook")
    async def cell(code: str, env: Any, task: dict) -> str:
        """Runs a cell."""
        order.append(("start", code))
        await asyncio.sleep(0.01)
        env.history.append(code)
        order.append(("end", code))
        return f"{task['question']}: ran {len(env.history)} cells"

    provider = FakeEnvProvider()

    async def scenario():
        async with ToolContext({"question": "q1"}, env_provider=provider, key="chain-0") as context:
            calls = [{"name": "cell", "arguments": {"code": f"x = {i}"}} for i in range(3)]
            results = await execute_tool_calls(calls, [cell], context=context)
            env = await context.env("notebook")
            assert env.history == ["x = 0", "x = 1", "x = 2"]
            assert provider.acquired == [("notebook", "chain-0")]
            return results

    results = asyncio.run(scenario())
    assert [r.observation for r in results] == ["q1: ran 1 cells", "q1: ran 2 cells", "q1: ran 3 cells"]
    # Calls on one chain's environment never interleave.
    assert order == [(edge, f"x = {i}") for i in range(3) for edge in ("start", "end")]
    assert provider.released == [("notebook", "chain-0")] and not provider.active

    no_context = asyncio.run(execute_tool_call({"name": "cell", "arguments": {"code": "1"}}, [cell]))
    assert_failure(no_context, "env_error", "needs the calling chain's environment")


def test_env_error_when_the_provider_fails():
    @tool(stateful=True, pool="full_pool")
    async def poke(env: Any) -> str:
        """Pokes."""
        return "ok"

    async def scenario():
        async with ToolContext({}, env_provider=FakeEnvProvider(fail_pools={"full_pool"}), key="k") as context:
            return await execute_tool_call({"name": "poke", "arguments": {}}, [poke], context=context)

    assert_failure(asyncio.run(scenario()), "env_error", "could not get its environment", "pool 'full_pool' is full")


def test_concurrent_calls_overlap_and_sequential_do_not():
    running = {"now": 0, "peak": 0}

    @tool
    async def nap(seconds: float) -> str:
        """Sleeps."""
        running["now"] += 1
        running["peak"] = max(running["peak"], running["now"])
        try:
            await asyncio.sleep(seconds)
        finally:
            running["now"] -= 1
        return "ok"

    calls = [{"name": "nap", "arguments": {"seconds": 0.05}}] * 5
    results = asyncio.run(execute_tool_calls(calls, [nap]))
    assert all(r.ok for r in results)
    assert running["peak"] == 5  # all five were sleeping at once
    running["peak"] = 0
    results = asyncio.run(execute_tool_calls(calls, [nap], parallel=False))
    assert all(r.ok for r in results) and running["peak"] == 1


def test_cancelling_the_caller_cancels_the_tool():
    cancelled = []

    @tool
    async def wait_forever() -> str:
        """Waits."""
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return ""

    async def scenario():
        task = asyncio.create_task(execute_tool_call({"name": "wait_forever", "arguments": {}}, [wait_forever]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert cancelled == [True]
