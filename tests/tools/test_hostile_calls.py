"""Hostile tool calls and hostile tools: each becomes an observation with its error kind, never an exception.

Calls go through the real parsers and `execute_tool_call`; the tools are real `@tool` functions that misbehave
on purpose (return values with no text, lone surrogates, SystemExit, swallowed cancellation, hung threads).
"""

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agentfly_jax.tools import (
    TOOL_ERROR_KINDS,
    ToolCall,
    execute_tool_call,
    execute_tool_calls,
    parse_error_result,
    tool,
)
from agentfly_jax.tools import execute as execute_module
from agentfly_jax.tools.parsers import (
    decode_arguments,
    load_json,
    lone_surrogate_in,
    parse_hermes_tool_calls,
    parse_react,
)
from tests.tools.hostile_tools import (
    DIGITS,
    Counter,
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


@tool
def circular_inside() -> dict:
    """Returns an observation object holding a cycle deeper down."""
    inner: dict = {"name": "loop"}
    inner["self"] = inner
    return {"observation": {"found": [inner]}}


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text for this")


@tool
def unprintable() -> dict:
    """Returns an object whose str() raises."""
    return {"observation": {"thing": Unprintable()}}


@tool
def raises_with_surrogate() -> str:
    """Raises an error whose message holds a lone surrogate."""
    raise ValueError("bad byte \udcff here")


@tool
async def interrupts_async() -> str:
    """Raises KeyboardInterrupt on the event loop."""
    raise KeyboardInterrupt


TOOLS = [
    echo,
    number,
    huge_int,
    circular_list,
    circular_observation,
    circular_inside,
    unprintable,
    lone_surrogate,
    raises_with_surrogate,
    exits_sync,
    exits_async,
    interrupts_sync,
    interrupts_async,
]


def run(call, tools=TOOLS, **kwargs):
    """execute_tool_call in a fresh loop; a BaseException escaping it fails the test (and nothing else)."""
    try:
        return asyncio.run(execute_tool_call(call, tools, **kwargs))
    except BaseException as error:  # noqa: BLE001 - KeyboardInterrupt would otherwise stop the whole session
        pytest.fail(f"execute_tool_call let {type(error).__name__}({error}) through")


def assert_failure(result, kind, *fragments):
    assert result.ok is False and result.error_kind == kind and kind in TOOL_ERROR_KINDS, result
    for fragment in fragments:
        assert fragment in result.observation, result.observation
    result.observation.encode("utf-8")  # what the tokenizer is given must be encodable
    result.error.encode("utf-8")


# --------------------------------------------------------------------------------------------------
# Integers longer than Python converts, in the model's calls
# --------------------------------------------------------------------------------------------------

HUGE_CALLS = {
    "hermes": '<tool_call>{"name": "number", "arguments": {"x": ' + DIGITS + "}}</tool_call>",
    "hermes_negative": '<tool_call>{"name": "number", "arguments": {"x": -' + DIGITS + "}}</tool_call>",
    "hermes_string_arguments": '<tool_call>{"name": "number", "arguments": "{\\"x\\": ' + DIGITS + '}"}</tool_call>',
}


@pytest.mark.parametrize("name", sorted(HUGE_CALLS))
def test_hermes_call_with_a_5000_digit_integer_is_bad_json(name):
    parsed = parse_hermes_tool_calls(HUGE_CALLS[name])
    assert parsed.tool_calls == [] and len(parsed.errors) == 1
    assert "not valid JSON" in parsed.errors[0].message and "more than 4300 digits" in parsed.errors[0].message
    assert_failure(parse_error_result(parsed.errors[0]), "bad_json", "more than 4300 digits")
    assert_failure(run(HUGE_CALLS[name]), "bad_json", "more than 4300 digits")


def test_react_call_with_a_5000_digit_integer_is_bad_json():
    parsed = parse_react('Thought: big.\nAction: number\nAction Input: {"x": ' + DIGITS + "}")
    assert parsed.tool_calls == [] and len(parsed.errors) == 1
    assert "Action Input of 'number' is not valid JSON (an integer in it has more than 4300 digits)" in (
        parsed.errors[0].message
    )
    assert_failure(parse_error_result(parsed.errors[0]), "bad_json", "more than 4300 digits")


def test_arguments_string_with_a_5000_digit_integer_given_as_a_dict():
    message = decode_arguments("number", '{"x": ' + DIGITS + "}")
    assert isinstance(message, str) and "more than 4300 digits" in message
    assert_failure(run({"name": "number", "arguments": '{"x": ' + DIGITS + "}"}), "bad_json", "4300 digits")


def test_a_long_integer_within_the_limit_still_works():
    digits = "9" * 4000
    result = run('<tool_call>{"name": "number", "arguments": {"x": ' + digits + "}}</tool_call>")
    assert result.ok and result.observation == f"got {digits}"


# --------------------------------------------------------------------------------------------------
# Lone surrogates in the model's calls
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        '<tool_call>{"name": "echo", "arguments": {"text": "a\\ud800b"}}</tool_call>',
        '<tool_call>{"name": "echo", "arguments": {"te\\udfffxt": "a"}}</tool_call>',
        '<tool_call>{"name": "ech\\udc00o", "arguments": {"text": "a"}}</tool_call>',
        '<tool_call>{"name": "echo", "arguments": "{\\"text\\": \\"a\\\\ud800\\"}"}</tool_call>',
        '<tool_call>{"name": "echo", "arguments": {"text": ["x", {"deep": "\\ud800"}]}}</tool_call>',
    ],
)
def test_hermes_call_with_a_lone_surrogate_is_bad_json(raw):
    parsed = parse_hermes_tool_calls(raw)
    assert parsed.tool_calls == [] and len(parsed.errors) == 1, parsed
    assert "half of a surrogate pair" in parsed.errors[0].message
    assert_failure(run(raw), "bad_json", "half of a surrogate pair")


def test_react_call_with_a_lone_surrogate_is_bad_json():
    parsed = parse_react('Action: echo\nAction Input: {"text": "a\\ud800b"}')
    assert parsed.tool_calls == [] and "holds \\ud800, half of a surrogate pair" in parsed.errors[0].message
    assert_failure(parse_error_result(parsed.errors[0]), "bad_json", "\\ud800")


def test_a_valid_surrogate_pair_escape_is_a_character_and_passes():
    result = run('<tool_call>{"name": "echo", "arguments": {"text": "smile \\ud83d\\ude00"}}</tool_call>')
    assert result.ok and result.observation == "smile \U0001f600"


def test_calls_built_in_python_with_a_lone_surrogate_are_bad_arguments():
    direct = run(ToolCall(name="echo", arguments={"text": "x\ud800"}, raw=""))
    assert_failure(direct, "bad_arguments", "\\ud800")
    as_dict = run({"name": "echo", "arguments": {"text": "x\udfff"}})
    assert_failure(as_dict, "bad_arguments", "\\udfff")


def test_lone_surrogates_are_found_in_keys_values_and_nested_values():
    assert lone_surrogate_in({"a": "b", "c": "d"}) is None and lone_surrogate_in({1: "b"}) is None
    assert lone_surrogate_in({"x\ud800": "b"}) == "\\ud800"  # a flat dict of strings: its keys too
    assert lone_surrogate_in({"a": "b\udc01"}) == "\\udc01"
    assert lone_surrogate_in({1: "b", "a": ["\ud801"]}) == "\\ud801"  # other keys, nested values: walked
    assert lone_surrogate_in("plain") is None and lone_surrogate_in("a\udfffb") == "\\udfff"
    # JSON text: a surrogate written as it is, or escaped; an escaped backslash before "ud800" is no escape
    assert "holds \\ud800" in load_json('{"a": "x\ud800"}')
    assert "holds \\ud800" in load_json('{"a": "x\\ud800"}')
    assert load_json('{"a": "x\\\\ud800"}') == ({"a": "x\\ud800"}, 17)


# --------------------------------------------------------------------------------------------------
# Tools returning values with no text
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, fragments",
    [
        ("huge_int", ["returned a int that cannot be written as text", "4300"]),
        ("circular_list", ["returned a list that cannot be written as text", "Circular reference"]),
        ("circular_observation", ["returned a dict that cannot be written as text", "Circular reference"]),
        ("circular_inside", ["returned a dict that cannot be written as text", "Circular reference"]),
        ("unprintable", ["cannot be written as text", "RuntimeError: no text for this"]),
    ],
)
def test_a_tool_returning_a_value_with_no_text_is_a_tool_exception(name, fragments):
    assert_failure(run({"name": name, "arguments": {}}), "tool_exception", f"tool '{name}'", *fragments)


# --------------------------------------------------------------------------------------------------
# Lone surrogates in what tools return or raise
# --------------------------------------------------------------------------------------------------


def test_a_tool_returning_a_lone_surrogate_is_shown_escaped_as_a_tool_exception():
    result = run({"name": "lone_surrogate", "arguments": {}})
    assert_failure(result, "tool_exception", "before \\ud800 after", "1 lone surrogate")
    assert result.observation.startswith("before \\ud800 after\n[")


def test_an_error_message_holding_a_lone_surrogate_is_escaped():
    result = run({"name": "raises_with_surrogate", "arguments": {}})
    assert_failure(result, "tool_exception", "ValueError: bad byte \\udcff here")


def test_an_unknown_tool_name_holding_a_lone_surrogate_is_rejected_encodably():
    # A name with a lone surrogate cannot come from the parsers; a caller in Python can still pass one.
    result = run(ToolCall(name="ech\ud800", arguments={}, raw=""))
    assert result.error_kind == "bad_arguments"
    result.observation.encode("utf-8")
    result.name.encode("utf-8")


# --------------------------------------------------------------------------------------------------
# SystemExit, KeyboardInterrupt
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, shown",
    [
        ("exits_sync", "raised SystemExit: 2"),
        ("exits_async", "raised SystemExit: 3"),
        ("interrupts_sync", "raised KeyboardInterrupt"),
        ("interrupts_async", "raised KeyboardInterrupt"),
    ],
)
def test_system_exit_and_keyboard_interrupt_from_a_tool_are_tool_exceptions(name, shown):
    assert_failure(run({"name": name, "arguments": {}}), "tool_exception", f"tool '{name}' {shown}")


def test_a_process_whose_tool_calls_sys_exit_carries_on():
    """In a child process, so that the failure without the fix (the process exits with code 2) is seen as such."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        from agentfly_jax.tools import execute_tool_call, tool

        @tool
        def leave() -> str:
            '''Exits.'''
            sys.exit(2)

        @tool
        async def leave_async() -> str:
            '''Exits from the loop.'''
            raise SystemExit(3)

        async def main():
            first = await execute_tool_call({"name": "leave", "arguments": {}}, [leave])
            second = await execute_tool_call({"name": "leave_async", "arguments": {}}, [leave_async])
            return first.error_kind, second.error_kind

        print("RESULT", *asyncio.run(main()))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RESULT tool_exception tool_exception" in done.stdout


# --------------------------------------------------------------------------------------------------
# Timeouts that hold
# --------------------------------------------------------------------------------------------------


def test_an_async_tool_that_swallows_cancellation_times_out_at_its_limit_and_is_abandoned():
    release = threading.Event()
    ended = threading.Event()
    stubborn = stubborn_tool(release, 0.3, ended)

    async def scenario():
        total_before, running_before = execute_module.abandoned_calls()
        started = time.monotonic()
        result = await execute_tool_call({"name": "stubborn", "arguments": {}}, [stubborn])
        elapsed = time.monotonic() - started
        total, running = execute_module.abandoned_calls()
        release.set()
        for _ in range(200):  # the runaway ends on its own once released, and is forgotten
            if execute_module.abandoned_calls()[1] == running_before:
                break
            await asyncio.sleep(0.01)
        return result, elapsed, total - total_before, running - running_before, running_before

    result, elapsed, new_total, new_running, running_before = asyncio.run(scenario())
    assert_failure(result, "timeout", "did not finish within 0.3 s", "abandoned")
    assert result.abandoned is True
    # reported at the limit (+ the cancellation grace), not when the tool chose to end
    assert elapsed < 0.3 + execute_module.CANCEL_GRACE_S + 1.0, elapsed
    assert 0.3 <= result.latency_s < 0.3 + execute_module.CANCEL_GRACE_S + 1.0
    assert new_total == 1 and new_running == 1
    assert ended.is_set() and execute_module.abandoned_calls()[1] == running_before  # ended, and forgotten


def test_an_async_tool_that_honours_cancellation_is_not_counted_as_abandoned():
    @tool(timeout=0.1)
    async def polite() -> str:
        """Sleeps too long but stops when cancelled."""
        await asyncio.sleep(30)
        return "late"

    total_before, _ = execute_module.abandoned_calls()
    result = run({"name": "polite", "arguments": {}}, tools=[polite])
    assert_failure(result, "timeout", "did not finish within 0.1 s")
    assert result.abandoned is False and execute_module.abandoned_calls()[0] == total_before


def test_hung_sync_tools_give_their_worker_slot_back(monkeypatch):
    """One slot: a hung sync tool is abandoned at its limit and its slot goes to the next call."""
    monkeypatch.setattr(execute_module, "_sync_slots", execute_module._Slots(1))
    release = threading.Event()

    @tool(timeout=0.2)
    def blocks() -> str:
        """Blocks its thread until released."""
        release.wait(30)
        return "late"

    @tool(timeout=2.0)
    def quick() -> str:
        """Answers at once."""
        return "quick answer"

    try:
        hung = run({"name": "blocks", "arguments": {}}, tools=[blocks, quick])
        assert_failure(hung, "timeout", "did not finish within 0.2 s", "abandoned")
        assert hung.abandoned is True
        after = run({"name": "quick", "arguments": {}}, tools=[blocks, quick])
        assert after.ok and after.observation == "quick answer", after
    finally:
        release.set()


def test_sync_calls_waiting_for_a_slot_hold_no_thread(monkeypatch):
    """Two slots, twelve concurrent sync calls: only two worker threads exist while the first two block; the
    rest wait without a thread and run in order as slots free up; every call returns its own answer."""
    monkeypatch.setattr(execute_module, "_sync_slots", execute_module._Slots(2))
    gate = threading.Event()
    started = []

    @tool(timeout=30.0)
    def slow(i: int) -> str:
        """Waits for the gate, then answers.

        Args:
            i: The call's number.
        """
        started.append(i)
        gate.wait(20)
        return f"answer {i}"

    # an abandoned call of an earlier test may still be ending on its own thread: count this test's threads only
    earlier = {t for t in threading.enumerate() if t.name == "agentfly-sync-call"}

    def workers():
        return sum(t.name == "agentfly-sync-call" and t.is_alive() and t not in earlier
                   for t in threading.enumerate())

    async def main():
        calls = [asyncio.ensure_future(execute_tool_call({"name": "slow", "arguments": {"i": i}}, [slow]))
                 for i in range(12)]
        for _ in range(200):
            await asyncio.sleep(0.01)
            if len(started) == 2:
                break
        seen = (workers(), sorted(started))
        gate.set()
        return seen, await asyncio.gather(*calls)

    before = workers()
    (threads, first), results = asyncio.run(main())
    assert threads - before == 2 and first == [0, 1]
    assert [r.observation for r in results] == [f"answer {i}" for i in range(12)]
    assert started[:2] == [0, 1] and sorted(started) == list(range(12))


def test_an_abandoned_call_retires_its_environment():
    """A stateful tool abandoned at its limit may still be changing its environment: the real resource manager
    destroys that instance at release instead of handing it to the next chain; a call that ended normally
    leaves its instance to be reused."""
    from agentfly_jax.envs.manager import PoolConfig, ResourceManager
    from agentfly_jax.tools.context import ToolContext

    gate = threading.Event()

    @tool(stateful=True, pool="counters", timeout=0.2)
    def bump(env, hang: bool) -> str:
        """Adds one to the counter (and, if asked, keeps changing it after its limit).

        Args:
            hang: Keep running past the limit.
        """
        env.value += 1
        while hang and not gate.wait(0.01):
            env.value += 1
        return str(env.value)

    async def scenario():
        manager = ResourceManager({"counters": PoolConfig(factory=Counter, max_size=4)})
        try:
            results = []
            for i, hang in enumerate((False, True)):
                async with ToolContext({}, env_provider=manager, key=f"chain-{i}") as context:
                    results.append(await execute_tool_call({"name": "bump", "arguments": {"hang": hang}},
                                                           [bump], context=context))
            return results, manager.metrics("counters")
        finally:
            gate.set()
            await manager.close()

    (fine, hung), metrics = asyncio.run(scenario())
    assert fine.ok and fine.observation == "1"
    assert_failure(hung, "timeout", "abandoned", "its environment will not be reused")
    assert metrics["retired"] == 1  # only the instance of the abandoned call; the other went back to the pool


def test_a_process_with_a_hung_sync_tool_still_exits():
    """A sync call abandoned at its limit runs on a daemon thread: the process ends when its work is done."""
    script = textwrap.dedent(
        """
        import asyncio, time
        from agentfly_jax.tools import execute_tool_call, tool

        @tool(timeout=0.2)
        def forever() -> str:
            '''Never returns.'''
            time.sleep(3600)
            return ""

        result = asyncio.run(execute_tool_call({"name": "forever", "arguments": {}}, [forever]))
        print("RESULT", result.error_kind, result.abandoned, flush=True)
        """
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RESULT timeout True" in done.stdout
    assert time.monotonic() - started < 60


def test_observation_json_of_an_ordinary_list_is_unchanged():
    @tool
    def listing() -> list:
        """Returns a list."""
        return [1, "two", {"three": 3.0}]

    result = run({"name": "listing", "arguments": {}}, tools=[listing])
    assert result.ok and json.loads(result.observation) == [1, "two", {"three": 3.0}]


# --------------------------------------------------------------------------------------------------
# A turn's calls run together (execute_tool_calls): each keeps its own limit, outcome and latency
# --------------------------------------------------------------------------------------------------


def test_calls_of_a_turn_settle_each_under_its_own_limit_in_call_order():
    release = threading.Event()
    cancelled = []

    @tool(timeout=0.2)
    async def polite(seconds: float) -> str:
        """Sleeps; stops when cancelled."""
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            cancelled.append(seconds)
            raise
        return f"slept {seconds}"

    @tool
    def blocking(seconds: float) -> str:
        """Sleeps in its thread."""
        time.sleep(seconds)
        return "woke"

    @tool
    async def fails() -> str:
        """Raises."""
        await asyncio.sleep(0.01)
        raise RuntimeError("broken on purpose")

    tools = [polite, blocking, fails, stubborn_tool(release, 0.3), echo]
    calls = [
        {"name": "polite", "arguments": {"seconds": 0.05}},
        {"name": "stubborn", "arguments": {}},
        {"name": "polite", "arguments": {"seconds": 5}},  # past its 0.2 s limit: cancelled, not abandoned
        {"name": "fails", "arguments": {}},
        {"name": "nope", "arguments": {}},
        {"name": "blocking", "arguments": {"seconds": 0.1}},
        {"name": "polite", "arguments": {"seconds": "soon"}},
        {"name": "echo", "arguments": {"text": "x\ud800"}},
    ]

    async def scenario():
        total_before, _ = execute_module.abandoned_calls()
        started = time.monotonic()
        results = await execute_tool_calls(calls, tools, timeout=2)
        elapsed = time.monotonic() - started
        abandoned = execute_module.abandoned_calls()[0] - total_before
        release.set()
        return results, elapsed, abandoned

    results, elapsed, abandoned = asyncio.run(scenario())
    assert [r.name for r in results] == ["polite", "stubborn", "polite", "fails", "nope", "blocking", "polite", "echo"]
    fast, stubborn, slow, failing, unknown, blocked, bad, surrogate = results
    assert fast.ok and fast.observation == "slept 0.05" and 0.04 <= fast.latency_s < 0.2  # its own time
    assert_failure(stubborn, "timeout", "did not finish within 0.3 s", "abandoned")
    assert stubborn.abandoned and abandoned == 1
    assert 0.3 <= stubborn.latency_s < 0.3 + execute_module.CANCEL_GRACE_S + 0.5
    assert_failure(slow, "timeout", "did not finish within 0.2 s")
    assert not slow.abandoned and cancelled == [5] and 0.2 <= slow.latency_s < 1.0
    assert_failure(failing, "tool_exception", "RuntimeError: broken on purpose")
    assert_failure(unknown, "unknown_tool", "unknown tool 'nope'")
    assert blocked.ok and blocked.observation == "woke" and 0.09 <= blocked.latency_s < 0.5
    assert_failure(bad, "bad_arguments", "argument 'seconds'")
    assert_failure(surrogate, "bad_arguments", "\\ud800")
    # all together: the turn lasts as long as its longest call (the abandoned one: limit + grace), not their sum
    assert elapsed < 0.3 + execute_module.CANCEL_GRACE_S + 0.5, elapsed


def test_cancelling_the_caller_stops_every_call_of_the_turn_and_propagates():
    release = threading.Event()
    cancelled = []

    @tool
    async def wait_forever(name: str) -> str:
        """Waits."""
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise
        return ""

    tools = [wait_forever, stubborn_tool(release, 30)]
    calls = [{"name": "wait_forever", "arguments": {"name": "a"}}, {"name": "stubborn", "arguments": {}},
             {"name": "wait_forever", "arguments": {"name": "b"}}]

    async def scenario():
        total_before, _ = execute_module.abandoned_calls()
        task = asyncio.create_task(execute_tool_calls(calls, tools))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        elapsed = time.monotonic() - started
        abandoned = execute_module.abandoned_calls()[0] - total_before
        release.set()
        return elapsed, abandoned

    elapsed, abandoned = asyncio.run(scenario())
    assert sorted(cancelled) == ["a", "b"]  # every call was cancelled
    assert abandoned == 1  # the one that swallows cancellation, after the grace period, not waited for
    assert elapsed < execute_module.CANCEL_GRACE_S + 0.5, elapsed
