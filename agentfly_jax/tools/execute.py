"""Running tool calls: every failure comes back as an observation the model can read, never an exception.

`execute_tool_call` takes a parsed `ToolCall` (or the raw text/JSON the model wrote), finds the tool,
checks the arguments against its schema, gives stateful tools their chain's environment, runs the tool
(sync tools in a worker thread) under its timeout, and truncates long observations. The outcome is a
`ToolResult`; a failed call has `ok=False`, an `error` message and an `error_kind` from `TOOL_ERROR_KINDS`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import math
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agentfly_jax.tools.context import ToolContext
from agentfly_jax.tools.decorator import ENV_PARAMETER, TASK_PARAMETER, Tool, as_tool_table
from agentfly_jax.tools.parsers import ParseError, ToolCall, decode_arguments, parse_hermes_tool_calls
from agentfly_jax.tools.schema import validate_arguments

#: Every way a tool call can fail; each ToolResult with ok=False carries one of these.
TOOL_ERROR_KINDS = (
    "unknown_tool",  # the model named a tool that does not exist
    "bad_json",  # the call (or its arguments) is not valid JSON
    "parse_error",  # the call is malformed otherwise (unclosed tag, no name, no call at all, ...)
    "bad_arguments",  # missing, unknown or wrongly typed arguments
    "tool_exception",  # the tool raised (or returned something that is not an observation)
    "timeout",  # the tool ran past its timeout and was stopped
    "oversized",  # the observation was longer than the limit and was truncated
    "env_error",  # the chain could not get the tool's environment
)

#: Defaults used when neither the tool nor the caller sets a limit.
DEFAULT_TOOL_TIMEOUT_S = 60.0
DEFAULT_MAX_OBSERVATION_CHARS = 8192

# Sync tools run here, so that a slow or hung one blocks neither the event loop nor the other tools.
_SYNC_TOOL_WORKERS = 64
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _sync_executor() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=_SYNC_TOOL_WORKERS, thread_name_prefix="agentfly-sync-call"
            )
        return _executor


async def run_sync(function: Any, /, **kwargs: Any) -> Any:
    """Run a sync callable in the runtime's worker threads (tools and rewards share them)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_sync_executor(), lambda: function(**kwargs))


@dataclasses.dataclass
class ToolResult:
    """The outcome of one tool call.

    observation: what the model sees next (the tool's output, or a readable error).
    ok: False when anything went wrong (then `error` and `error_kind` say what).
    extras: fields other than `observation` of a dict the tool returned (logged, not shown to the model).
    """

    observation: str
    ok: bool
    error: str | None = None
    error_kind: str | None = None
    name: str = ""
    arguments: dict[str, Any] = dataclasses.field(default_factory=dict)
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    latency_s: float = 0.0


def _failure(kind: str, message: str, name: str = "", arguments: Any = None, **fields: Any) -> ToolResult:
    assert kind in TOOL_ERROR_KINDS, kind
    return ToolResult(
        observation=f"Error: {message}",
        ok=False,
        error=message,
        error_kind=kind,
        name=name,
        arguments=dict(arguments) if isinstance(arguments, Mapping) else {},
        **fields,
    )


_NAME_IN_RAW = re.compile(r'"name"\s*:\s*"([^"\\]{1,100})"')


def parse_error_result(error: ParseError) -> ToolResult:
    """The ToolResult for a malformed call a parser reported: `bad_json` or `parse_error`."""
    # The parsers say "is not valid JSON" for undecodable JSON and describe other problems otherwise.
    kind = "bad_json" if "not valid JSON" in error.message else "parse_error"
    name_match = _NAME_IN_RAW.search(error.raw)
    return _failure(
        kind,
        f"{error.message}. Your call was: {error.raw[:300]}",
        name=name_match.group(1) if name_match else "",
    )


def _call_from_raw(raw: str | Mapping[str, Any]) -> ToolCall | ToolResult:
    """A ToolCall from raw model output (a `<tool_call>` block or a bare JSON object), or the failure."""
    if isinstance(raw, Mapping):
        name, arguments = raw.get("name"), raw.get("arguments", {})
        if isinstance(name, str) and isinstance(arguments, str):
            decoded = decode_arguments(name, arguments)  # a JSON-encoded string, the OpenAI convention
            if isinstance(decoded, str):
                kind = "bad_json" if "not valid JSON" in decoded else "parse_error"
                return _failure(kind, f"{decoded}. Your call was: {repr(raw)[:300]}", name=name)
            arguments = decoded
        if not isinstance(name, str) or not isinstance(arguments, Mapping):
            return _failure(
                "parse_error", 'a tool call is {"name": <tool name>, "arguments": {...}}; got ' + repr(raw)[:200]
            )
        return ToolCall(name=name, arguments=dict(arguments), raw=json.dumps(raw, default=str))
    text = raw.strip()
    if "<tool_call>" not in text and "</tool_call>" not in text:
        text = f"<tool_call>{text}</tool_call>"
    parsed = parse_hermes_tool_calls(text)
    if parsed.errors:
        return parse_error_result(parsed.errors[0])
    if len(parsed.tool_calls) != 1:
        return _failure(
            "parse_error",
            f"expected exactly one tool call, found {len(parsed.tool_calls)}; "
            'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
        )
    return parsed.tool_calls[0]


def _observation_of(tool: Tool, result: Any) -> tuple[str, dict[str, Any]]:
    """(observation, extras) from what a tool returned; raises TypeError for anything unusable."""
    if isinstance(result, str):
        return result, {}
    if isinstance(result, Mapping):
        if "observation" not in result:
            raise TypeError(
                f"tool '{tool.name}' returned a dict without an 'observation' key "
                f"(keys: {sorted(map(str, result))}); return a string or {{'observation': ..., ...}}"
            )
        observation = result["observation"]
        if not isinstance(observation, str):
            observation = json.dumps(observation, default=str, ensure_ascii=False)
        return observation, {key: value for key, value in result.items() if key != "observation"}
    if result is None:
        raise TypeError(f"tool '{tool.name}' returned None; return a string or {{'observation': ...}}")
    if isinstance(result, (int, float, bool, list, tuple)):
        return json.dumps(result, default=str, ensure_ascii=False), {}
    raise TypeError(
        f"tool '{tool.name}' returned {type(result).__name__}; return a string or {{'observation': ...}}"
    )


async def _invoke(tool: Tool, arguments: dict[str, Any]) -> Any:
    function = tool.bound_function
    if tool.is_async:
        return await function(**arguments)
    return await run_sync(function, **arguments)


async def execute_tool_call(
    call: ToolCall | str | Mapping[str, Any],
    tools: Mapping[str, Tool] | Iterable[Any],
    *,
    timeout: float | None = None,
    max_observation_chars: int | None = None,
    context: ToolContext | None = None,
) -> ToolResult:
    """Run one tool call; any failure comes back as `ToolResult(ok=False, error_kind=...)`, never raised.

    call: a parsed ToolCall, the raw text the model wrote (`<tool_call>{...}</tool_call>` or bare JSON),
      or a {"name", "arguments"} dict; the arguments may be an object or a string holding one (OpenAI's
      convention), in the text and in the dict alike.
    tools: {name: Tool}, or a list of Tools / functions / registered names.
    timeout, max_observation_chars: used for tools that do not set their own (defaults
      DEFAULT_TOOL_TIMEOUT_S and DEFAULT_MAX_OBSERVATION_CHARS; `math.inf` timeout means none).
    context: the calling chain's ToolContext (dataset row + environments); stateful tools need one.
    Cancellation is not a failure: cancelling the caller cancels the tool and propagates.
    """
    if not isinstance(call, ToolCall):
        parsed = _call_from_raw(call)
        if isinstance(parsed, ToolResult):
            return parsed
        call = parsed
    table = tools if isinstance(tools, dict) and all(isinstance(t, Tool) for t in tools.values()) else None
    table = table if table is not None else as_tool_table(tools)
    tool = table.get(call.name)
    if tool is None:
        available = ", ".join(sorted(table)) or "none"
        return _failure(
            "unknown_tool",
            f"unknown tool '{call.name}'. Available tools: {available}",
            name=call.name,
            arguments=call.arguments,
        )
    try:
        arguments = validate_arguments(
            tool.name, tool.parameters, call.arguments, accepts_extra=tool.accepts_extra_arguments
        )
    except ValueError as error:
        return _failure("bad_arguments", str(error), name=tool.name, arguments=call.arguments)

    if tool.wants_task:
        arguments_in = {**arguments, TASK_PARAMETER: context.task if context is not None else {}}
    else:
        arguments_in = dict(arguments)
    limit_s = tool.timeout if tool.timeout is not None else timeout
    limit_s = DEFAULT_TOOL_TIMEOUT_S if limit_s is None else limit_s
    started = time.perf_counter()
    try:
        if tool.stateful:
            if context is None:
                return _failure(
                    "env_error",
                    f"tool '{tool.name}' is stateful (pool '{tool.pool}') and needs the calling chain's "
                    "environment: run it through an agent with an env_provider, or pass context=",
                    name=tool.name,
                    arguments=arguments,
                )
            async with context.env_lock(tool.pool):
                try:
                    arguments_in[ENV_PARAMETER] = await context.env(tool.pool)
                except Exception as error:  # noqa: BLE001 - any provider failure is shown to the model
                    return _failure(
                        "env_error",
                        f"tool '{tool.name}' could not get its environment (pool '{tool.pool}'): "
                        f"{type(error).__name__}: {error}",
                        name=tool.name,
                        arguments=arguments,
                    )
                started = time.perf_counter()
                result = await _run_with_timeout(tool, arguments_in, limit_s)
        else:
            result = await _run_with_timeout(tool, arguments_in, limit_s)
    except _ToolTimedOut:
        return _failure(
            "timeout",
            f"tool '{tool.name}' did not finish within {limit_s:g} s and was stopped",
            name=tool.name,
            arguments=arguments,
            latency_s=time.perf_counter() - started,
        )
    except Exception as error:  # noqa: BLE001 - a raising tool becomes an observation
        return _failure(
            "tool_exception",
            f"tool '{tool.name}' raised {type(error).__name__}: {error}",
            name=tool.name,
            arguments=arguments,
            latency_s=time.perf_counter() - started,
        )
    latency_s = time.perf_counter() - started
    try:
        observation, extras = _observation_of(tool, result)
    except TypeError as error:
        return _failure("tool_exception", str(error), name=tool.name, arguments=arguments, latency_s=latency_s)

    max_chars = tool.max_observation_chars or max_observation_chars or DEFAULT_MAX_OBSERVATION_CHARS
    if len(observation) > max_chars:
        note = (
            f"\n[observation truncated: the tool returned {len(observation)} characters, "
            f"the limit is {max_chars}]"
        )
        message = f"tool '{tool.name}' returned {len(observation)} characters, more than the limit {max_chars}"
        return ToolResult(
            observation=observation[:max_chars] + note,
            ok=False,
            error=message,
            error_kind="oversized",
            name=tool.name,
            arguments=arguments,
            extras=extras,
            latency_s=latency_s,
        )
    return ToolResult(
        observation=observation,
        ok=True,
        name=tool.name,
        arguments=arguments,
        extras=extras,
        latency_s=latency_s,
    )


class _ToolTimedOut(Exception):
    """Our own timeout fired (as opposed to a TimeoutError the tool raised itself)."""


async def _run_with_timeout(tool: Tool, arguments: dict[str, Any], limit_s: float) -> Any:
    if limit_s is None or math.isinf(limit_s):
        return await _invoke(tool, arguments)
    scope = asyncio.timeout(limit_s)
    try:
        async with scope:
            return await _invoke(tool, arguments)
    except TimeoutError:
        if scope.expired():
            raise _ToolTimedOut() from None
        raise


async def execute_tool_calls(
    calls: Sequence[ToolCall | str | Mapping[str, Any]],
    tools: Mapping[str, Tool] | Iterable[Any],
    *,
    parallel: bool = True,
    timeout: float | None = None,
    max_observation_chars: int | None = None,
    context: ToolContext | None = None,
) -> list[ToolResult]:
    """Run several calls, concurrently by default (results in call order); see `execute_tool_call`."""
    table = as_tool_table(tools)
    options = {"timeout": timeout, "max_observation_chars": max_observation_chars, "context": context}
    if not parallel:
        return [await execute_tool_call(call, table, **options) for call in calls]
    return list(await asyncio.gather(*(execute_tool_call(call, table, **options) for call in calls)))
