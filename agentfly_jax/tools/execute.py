"""Running tool calls: every failure comes back as an observation the model can read, never an exception.

`execute_tool_call` takes a parsed `ToolCall` (or the raw text/JSON the model wrote), finds the tool,
checks the arguments against its schema, gives stateful tools their chain's environment, runs the tool
(sync tools in a worker thread) under its timeout, and truncates long observations. The outcome is a
`ToolResult`; a failed call has `ok=False`, an `error` message and an `error_kind` from `TOOL_ERROR_KINDS`.

What a tool returns: a string (the observation); a dict with an `observation` (its other fields are extras);
other JSON-able values (shown as JSON); or content parts with images, a list of `{"type": "text", "text": str}`
and `{"type": "image", "image": <PIL image | numpy array | path | bytes>}` dicts in the order the model reads them
(also as a dict's `observation`). Images are checked and loaded with `agentfly_jax.images.load_image` (off the event
loop); one that cannot be used makes the call a `bad_image` failure naming the problem. The observation limit
counts the parts' text only.

`call_with_limit` is how tools and rewards run user code: under a limit that holds even for code that ignores
cancellation (it is abandoned, not awaited), with `SystemExit`, `KeyboardInterrupt` and the like raised by the
code turned into an ordinary exception, so that user code can neither hang a chain nor end the process.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import functools
import json
import logging
import math
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agentfly_jax.images import ImageError, load_image
from agentfly_jax.tools.context import ToolContext
from agentfly_jax.tools.decorator import ENV_PARAMETER, TASK_PARAMETER, Tool, as_tool_table
from agentfly_jax.tools.parsers import (
    ParseError,
    ToolCall,
    decode_arguments,
    lone_surrogate_in,
    parse_hermes_tool_calls,
)
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
    "bad_image",  # the tool returned an image that cannot be used (unreadable, empty, too large, bad array, ...)
)

#: Defaults used when neither the tool nor the caller sets a limit.
logger = logging.getLogger(__name__)

DEFAULT_TOOL_TIMEOUT_S = 60.0
DEFAULT_MAX_OBSERVATION_CHARS = 8192

class CallRaisedBaseException(Exception):
    """User code (a tool, a reward) raised a BaseException that is not cancellation: `SystemExit`,
    `KeyboardInterrupt`, `GeneratorExit`, a BaseExceptionGroup... Carried as an ordinary exception so that it
    becomes that call's failure instead of stopping the event loop (asyncio re-raises SystemExit and
    KeyboardInterrupt out of the loop). Under `asyncio.run` / `asyncio.Runner` a real Ctrl-C reaches the rollout
    as cancellation, not as a KeyboardInterrupt inside a tool, so this does not swallow it."""

    def __init__(self, error: BaseException):
        text = _text_of(error)
        super().__init__(f"{type(error).__name__}: {text}" if text else type(error).__name__)
        self.error = error


class CallTimedOut(Exception):
    """A call ran past its limit; `abandoned` is True when it was still running after being stopped."""

    def __init__(self, limit_s: float, abandoned: bool):
        super().__init__(f"did not finish within {limit_s:g} s")
        self.limit_s = limit_s
        self.abandoned = abandoned


def _text_of(error: BaseException) -> str:
    """str(error), or what it is when its message itself cannot be made (a raising __str__)."""
    try:
        return str(error)
    except Exception as problem:  # noqa: BLE001
        return f"<message not shown: {type(problem).__name__}>"


def _call_sync(function: Any, kwargs: dict[str, Any]) -> Any:
    try:
        return function(**kwargs)
    except Exception:
        raise
    except BaseException as error:  # in a worker thread, always the function's own (signals go to main)
        raise CallRaisedBaseException(error) from error


async def _call_async(function: Any, kwargs: dict[str, Any]) -> Any:
    try:
        return await function(**kwargs)
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as error:
        raise CallRaisedBaseException(error) from error


# At most this many sync calls run at once; more wait for a slot without a thread of their own (a thread is
# started only when a slot is handed to the call). An abandoned call gives its slot back, so hung code cannot
# use up the slots and stall every later call.
SYNC_CALL_SLOTS = 64


class _Slots:
    """Slots for sync calls, handed over first come, first served: `release` starts the oldest waiting call on
    the slot it frees (from whichever thread frees it)."""

    def __init__(self, count: int):
        self._free = count
        self._waiting: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def take(self, call: _SyncCall) -> bool:
        """True when a slot was free (now the call's); otherwise the call waits for `release` to start it."""
        with self._lock:
            if self._free > 0 and not self._waiting:
                self._free -= 1
                return True
            self._waiting.append(call)
            return False

    def release(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    self._free += 1
                    return
                call = self._waiting.popleft()
            if call._begin():  # a call stopped while it waited does not take the slot: try the next
                return

    def discard(self, call: _SyncCall) -> None:
        with self._lock:
            try:
                self._waiting.remove(call)
            except ValueError:
                pass


_sync_slots = _Slots(SYNC_CALL_SLOTS)


class _SyncCall:
    """One sync call on its own daemon thread (a hung one neither blocks the event loop nor keeps the process
    from exiting), started when it gets a slot, its outcome delivered to an asyncio future of the calling loop."""

    def __init__(self, function: Any, kwargs: dict[str, Any], loop: asyncio.AbstractEventLoop):
        self.future: asyncio.Future = loop.create_future()
        self._loop = loop
        self._lock = threading.Lock()
        self._state = "queued"  # -> running -> finished; queued -> dropped; running -> abandoned
        self._holds_slot = False
        self._function, self._kwargs = function, kwargs
        if _sync_slots.take(self):
            self._begin()

    def _begin(self) -> bool:
        """Starts the call on a slot just taken for it; False (the slot is not used) when it was stopped while
        it waited."""
        with self._lock:
            if self._state != "queued":
                return False
            self._state, self._holds_slot = "running", True
        try:
            threading.Thread(target=self._run, name="agentfly-sync-call", daemon=True).start()
        except RuntimeError as error:  # no thread to be had (the process's thread limit): the call fails
            self._finish(None, error)
        return True

    def _run(self) -> None:
        error: BaseException | None = None
        value = None
        try:
            value = _call_sync(self._function, self._kwargs)
        except BaseException as raised:  # noqa: BLE001 - handed to the caller
            error = raised
        self._finish(value, error)

    def _finish(self, value: Any, error: BaseException | None) -> None:
        with self._lock:
            give_back, self._holds_slot = self._holds_slot, False
            abandoned = self._state == "abandoned"
            self._state = "finished"
        if give_back:
            _sync_slots.release()
        if abandoned:
            _forget(self)
        try:
            self._loop.call_soon_threadsafe(self._deliver, value, error)
        except RuntimeError:
            pass  # the loop is closed: a call abandoned by a finished rollout has no one to report to

    def _deliver(self, value: Any, error: BaseException | None) -> None:
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(value)

    def stop(self) -> bool:
        """Stop waiting for the call: a queued one is dropped, a running one abandoned (its thread runs on,
        its slot is given back); True when abandoned."""
        self.future.cancel()
        with self._lock:
            if self._state == "queued":
                self._state = "dropped"
                dropped = True
            elif self._state != "running":
                return False
            else:
                dropped = False
                self._state = "abandoned"
                give_back, self._holds_slot = self._holds_slot, False
                _abandon(self)  # under the lock: the thread's `_forget` at its end comes after
        if dropped:
            _sync_slots.discard(self)
            return False
        if give_back:
            _sync_slots.release()
        return True


def retire_environment(env: Any) -> bool:
    """Marks the environment an abandoned call may still be using as used up (`retired = True`): the resource
    manager destroys it at release instead of handing it, still being changed, to another chain."""
    if env is None:
        return False
    try:
        env.retired = True
    except (AttributeError, TypeError):
        logger.warning("an abandoned call's environment %r cannot be marked retired; it may be reused", env)
        return False
    return True


async def run_sync(function: Any, /, **kwargs: Any) -> Any:
    """Run a sync callable on a worker thread, without a limit (see `call_with_limit` for one); a
    BaseException it raises (SystemExit, ...) comes back as CallRaisedBaseException."""
    return await call_with_limit(function, kwargs, is_async=False, limit_s=None)


# After a timeout, how long a cancelled async call gets to end (its cleanup in `finally`) before it is abandoned.
CANCEL_GRACE_S = 0.1
# Calls stopped at their limit that were still running: kept referenced until they end (an unreferenced task
# may be garbage-collected mid-run), their outcome consumed so nothing is logged as never retrieved.
_abandoned: set[Any] = set()
_abandoned_lock = threading.Lock()
_abandoned_total = 0


def abandoned_calls() -> tuple[int, int]:
    """(calls abandoned since the process started, those of them still running)."""
    with _abandoned_lock:
        return _abandoned_total, len(_abandoned)


def _abandon(running: Any) -> None:
    global _abandoned_total
    with _abandoned_lock:
        _abandoned_total += 1
        _abandoned.add(running)


def _forget(running: Any) -> None:
    with _abandoned_lock:
        _abandoned.discard(running)


def _abandon_task(task: asyncio.Task) -> None:
    _abandon(task)

    def ended(done: asyncio.Task) -> None:
        _forget(done)
        if not done.cancelled():
            done.exception()  # consumed: a runaway's late failure is nobody's to report

    task.add_done_callback(ended)


_NO_CONTEXT = contextvars.Context()


def _wake(waiter: asyncio.Future, _outcome: Any = None) -> None:
    """Wakes a waiter (a call settled), once."""
    if not waiter.done():
        waiter.set_result(None)


class _LimitedCall:
    """One call under its limit, kept by loop callbacks alone, so that no task has to wait on it (see
    `call_with_limit` for what happens at the limit). `on_settled()` is called once the outcome is known: the
    function ended ("done"), or its limit passed and it was stopped or abandoned ("timed_out"); `ended_at` is when
    (perf_counter). Its callbacks read no context variable: they run in one empty context, not a copy each."""

    __slots__ = ("abandoned", "ended_at", "limit_s", "loop", "on_settled", "outcome", "running", "state", "timer")

    def __init__(self, function: Any, arguments: dict[str, Any], is_async: bool, limit_s: float | None,
                 loop: asyncio.AbstractEventLoop, on_settled: Any):
        self.loop, self.limit_s, self.on_settled = loop, limit_s, on_settled
        self.state = "running"  # -> done; -> stopping (cancelled at the limit) -> timed_out; -> timed_out
        self.abandoned = False
        self.ended_at = 0.0
        if is_async:
            self.running: Any = loop.create_task(_call_async(function, arguments))
            self.outcome: asyncio.Future = self.running
        else:
            self.running = _SyncCall(function, arguments, loop)
            self.outcome = self.running.future
        self.outcome.add_done_callback(self._ended, context=_NO_CONTEXT)
        self.timer = None
        if limit_s is not None and not math.isinf(limit_s):
            self.timer = loop.call_later(limit_s, self._expired, context=_NO_CONTEXT)

    def _settle(self, state: str) -> None:
        self.state = state
        self.ended_at = time.perf_counter()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.on_settled()

    def _ended(self, _outcome: Any) -> None:
        if self.state == "running":
            self._settle("done")
        elif self.state == "stopping":  # it ended after being cancelled at its limit
            if not self.outcome.cancelled():
                self.outcome.exception()  # consumed: it came past the limit and is not used
            self._settle("timed_out")

    def _expired(self) -> None:
        self.timer = None
        if self.state != "running" or self.outcome.done():
            return  # it ended in time (its done callback settles it)
        if isinstance(self.running, _SyncCall):
            self.abandoned = self.running.stop()  # a thread cannot be stopped: abandoned when still running
            self._settle("timed_out")
        else:
            self.running.cancel()
            self.state = "stopping"
            self.timer = self.loop.call_later(CANCEL_GRACE_S, self._grace_over, context=_NO_CONTEXT)

    def _grace_over(self) -> None:
        self.timer = None
        if self.state == "stopping" and not self.running.done():  # it swallows cancellation: abandoned
            self.abandoned = True
            _abandon_task(self.running)
            self._settle("timed_out")

    def result(self) -> Any:
        """The function's value once settled; raises what it raised, or CallTimedOut."""
        if self.state == "timed_out":
            raise CallTimedOut(self.limit_s, abandoned=self.abandoned)
        return self.outcome.result()


async def _stop_calls(calls: Sequence[_LimitedCall]) -> None:
    """The caller is being cancelled: stop the calls not settled yet, together, as at their limit (async ones
    cancelled and given CANCEL_GRACE_S to end, then abandoned; sync ones abandoned at once when running)."""
    stopping = []
    for call in calls:
        if call.state == "done" and not call.outcome.cancelled():
            call.outcome.exception()  # its outcome is not used: consumed, so that nothing logs it as lost
        if call.state == "running":
            if call.timer is not None:
                call.timer.cancel()
                call.timer = None
            if isinstance(call.running, _SyncCall):
                call.state = "timed_out"
                call.abandoned = call.running.stop()
                continue
            call.running.cancel()
            call.state = "stopping"
        if call.state == "stopping":
            stopping.append(call)
    if not stopping:
        return
    try:
        await asyncio.wait([call.running for call in stopping], timeout=CANCEL_GRACE_S)
    finally:  # also when the caller is cancelled again meanwhile
        for call in stopping:
            if call.state == "stopping" and not call.running.done():
                call.abandoned = True
                _abandon_task(call.running)
                call._settle("timed_out")


async def call_with_limit(function: Any, arguments: dict[str, Any], *, is_async: bool, limit_s: float | None) -> Any:
    """`function(**arguments)`'s value (async functions in their own task, sync ones on their own thread).

    When `limit_s` (None or `math.inf`: no limit) passes first, the call is stopped: an async one is cancelled
    and, if it has not ended after CANCEL_GRACE_S (it swallows cancellation), abandoned; a sync one still
    running is abandoned at once (a thread cannot be stopped). Abandoned calls run on in the background and are
    counted (`abandoned_calls`); CallTimedOut is raised at the limit either way, so no call holds its caller
    past it. A SystemExit/KeyboardInterrupt/... the function raises comes back as CallRaisedBaseException.
    Cancelling the caller stops the call the same way and propagates.
    """
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    call = _LimitedCall(function, arguments, is_async, limit_s, loop, functools.partial(_wake, waiter))
    try:
        await waiter
    except asyncio.CancelledError:
        await _stop_calls([call])
        raise
    return call.result()


@dataclasses.dataclass
class ToolResult:
    """The outcome of one tool call.

    observation: the tool's text output (or a readable error); all that the model sees unless `parts` is set.
    ok: False when anything went wrong (then `error` and `error_kind` say what).
    extras: fields other than `observation` of a dict the tool returned (logged, not shown to the model).
    parts: when the tool returned images: its content parts in order, `{"type": "text", "text": str}` and
      `{"type": "image", "image": <RGB PIL image>}` (`observation` is then their text); None otherwise.
    """

    observation: str
    ok: bool
    error: str | None = None
    error_kind: str | None = None
    name: str = ""
    arguments: dict[str, Any] = dataclasses.field(default_factory=dict)
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    latency_s: float = 0.0
    abandoned: bool = False  # a timed-out call was still running when given up on (see call_with_limit)
    parts: list[dict[str, Any]] | None = None

    @property
    def images(self) -> list[Any]:
        """The images the tool returned, in order (RGB PIL images)."""
        return [part["image"] for part in self.parts or () if part["type"] == "image"]

    @property
    def content(self) -> str | list[dict[str, Any]]:
        """The tool message's content: the observation text, or the content parts when there are images."""
        return self.parts if self.parts is not None else self.observation


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
        return ToolCall(name=name, arguments=dict(arguments), raw=_shown(raw))
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


def _shown(value: Any) -> str:
    """`value` as JSON text for logs, or its type when it has none (cycles, over-long ints, ...)."""
    try:
        return json.dumps(value, default=str)
    except Exception as error:  # noqa: BLE001 - only text for a log
        return f"<{type(value).__name__} not shown: {type(error).__name__}: {error}>"


def _observation_of(tool: Tool, result: Any) -> tuple[str | list[Mapping[str, Any]], dict[str, Any]]:
    """(observation, extras) from what a tool returned, the observation as text or as content parts (a list of
    text and image parts, text parts checked); raises TypeError for anything unusable.

    A value with no JSON text (a list or dict holding itself, an int longer than Python converts, an object
    whose str() raises) is unusable too: the TypeError names the tool, the type and why."""
    try:
        return _observation_text(tool, result)
    except TypeError:
        raise
    except Exception as error:  # ValueError (a cycle, too many digits), RecursionError, a raising str()
        raise TypeError(
            f"tool '{tool.name}' returned a {type(result).__name__} that cannot be written as text "
            f"({type(error).__name__}: {error}); return a string or {{'observation': <string>, ...}}"
        ) from error


def _content_parts(value: Any) -> list[Mapping[str, Any]] | None:
    """`value` as content parts when it is a non-empty list of dicts typed "text" or "image", else None."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    if not all(isinstance(part, Mapping) and part.get("type") in ("text", "image") for part in value):
        return None
    return list(value)


def _checked_parts(tool: Tool, parts: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    for index, part in enumerate(parts):
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise TypeError(
                f"tool '{tool.name}' returned a text part without a string 'text' (part {index}: "
                f"{sorted(map(str, part))}); write {{'type': 'text', 'text': <string>}}"
            )
    return parts


def _observation_text(tool: Tool, result: Any) -> tuple[str | list[Mapping[str, Any]], dict[str, Any]]:
    if isinstance(result, str):
        return result, {}
    parts = _content_parts(result)
    if parts is not None:
        return _checked_parts(tool, parts), {}
    if isinstance(result, Mapping):
        if "observation" not in result:
            raise TypeError(
                f"tool '{tool.name}' returned a dict without an 'observation' key "
                f"(keys: {sorted(map(str, result))}); return a string or {{'observation': ..., ...}}"
            )
        observation = result["observation"]
        parts = _content_parts(observation)
        if parts is not None:
            observation = _checked_parts(tool, parts)
        elif not isinstance(observation, str):
            observation = json.dumps(observation, default=str, ensure_ascii=False)
        return observation, {key: value for key, value in result.items() if key != "observation"}
    if result is None:
        raise TypeError(f"tool '{tool.name}' returned None; return a string or {{'observation': ...}}")
    if isinstance(result, (int, float, bool, list, tuple)):
        return json.dumps(result, default=str, ensure_ascii=False), {}
    raise TypeError(
        f"tool '{tool.name}' returned {type(result).__name__}; return a string or {{'observation': ...}}"
    )


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
    A tool that does not stop when its timeout cancels it is abandoned (`ToolResult.abandoned`); a SystemExit
    or KeyboardInterrupt it raises is a `tool_exception`; no observation holds a lone surrogate.
    """
    return _encodable(
        await _execute_tool_call(
            call, tools, timeout=timeout, max_observation_chars=max_observation_chars, context=context
        )
    )


class _Plan:
    """A checked call, ready to run: its tool, checked arguments, what the function gets, and its limit."""

    __slots__ = ("arguments", "arguments_in", "limit_s", "started", "tool")

    def __init__(self, tool: Tool, arguments: dict[str, Any], arguments_in: dict[str, Any], limit_s: float):
        self.tool, self.arguments, self.arguments_in, self.limit_s = tool, arguments, arguments_in, limit_s
        self.started = 0.0


def _plan(
    call: ToolCall | str | Mapping[str, Any],
    tools: Mapping[str, Tool] | Iterable[Any],
    timeout: float | None,
    context: ToolContext | None,
) -> _Plan | ToolResult:
    """The call parsed, its tool found and its arguments checked; or the failure that ends it before it runs."""
    if not isinstance(call, ToolCall):
        parsed = _call_from_raw(call)
        if isinstance(parsed, ToolResult):
            return parsed
        call = parsed
    surrogate = lone_surrogate_in(call.arguments) or lone_surrogate_in(call.name)  # (as one walk of both finds)
    if surrogate is not None:  # the parsers refuse these; calls made in Python are checked here
        return _failure(
            "bad_arguments",
            f"the call holds {surrogate}, half of a UTF-16 surrogate pair, which is not a character",
            name=call.name,
        )
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
    return _Plan(tool, arguments, arguments_in, limit_s)


def _call_failure(plan: _Plan, error: Exception, latency_s: float) -> ToolResult:
    """The ToolResult of a call that timed out or raised (`error`: what `call_with_limit` raised)."""
    tool, arguments = plan.tool, plan.arguments
    if isinstance(error, CallTimedOut):
        retired = error.abandoned and retire_environment(plan.arguments_in.get(ENV_PARAMETER))
        return _failure(
            "timeout",
            f"tool '{tool.name}' did not finish within {plan.limit_s:g} s and was stopped"
            + (" (it ignored being cancelled and was abandoned)" if error.abandoned else "")
            + ("; its environment will not be reused after this episode" if retired else ""),
            name=tool.name,
            arguments=arguments,
            latency_s=latency_s,
            abandoned=error.abandoned,
        )
    if isinstance(error, CallRaisedBaseException):  # SystemExit, KeyboardInterrupt, ... from the tool's code
        return _failure(
            "tool_exception", f"tool '{tool.name}' raised {error}", name=tool.name, arguments=arguments,
            latency_s=latency_s,
        )
    return _failure(  # a raising tool becomes an observation
        "tool_exception",
        f"tool '{tool.name}' raised {type(error).__name__}: {_text_of(error)}",
        name=tool.name,
        arguments=arguments,
        latency_s=latency_s,
    )


async def _execute_tool_call(
    call: ToolCall | str | Mapping[str, Any],
    tools: Mapping[str, Tool] | Iterable[Any],
    *,
    timeout: float | None,
    max_observation_chars: int | None,
    context: ToolContext | None,
) -> ToolResult:
    plan = _plan(call, tools, timeout, context)
    if isinstance(plan, ToolResult):
        return plan
    tool, arguments, arguments_in, limit_s = plan.tool, plan.arguments, plan.arguments_in, plan.limit_s
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
                except (asyncio.CancelledError, KeyboardInterrupt):
                    raise
                except BaseException as error:  # noqa: BLE001 - any provider failure (SystemExit too) is shown
                    return _failure(
                        "env_error",
                        f"tool '{tool.name}' could not get its environment (pool '{tool.pool}'): "
                        f"{type(error).__name__}: {error}",
                        name=tool.name,
                        arguments=arguments,
                    )
                started = time.perf_counter()
                result = await call_with_limit(
                    tool.bound_function, arguments_in, is_async=tool.is_async, limit_s=limit_s
                )
        else:
            result = await call_with_limit(
                tool.bound_function, arguments_in, is_async=tool.is_async, limit_s=limit_s
            )
    except (CallTimedOut, CallRaisedBaseException, Exception) as error:  # noqa: BLE001 - an observation
        return _call_failure(plan, error, time.perf_counter() - started)
    return await _tool_result(tool, arguments, result, time.perf_counter() - started, max_observation_chars)


async def _tool_result(
    tool: Tool, arguments: dict[str, Any], result: Any, latency_s: float, max_observation_chars: int | None
) -> ToolResult:
    """The ToolResult of what a tool returned (its observation checked, images loaded, long text truncated)."""
    read = _read_result(tool, arguments, result, latency_s)
    if isinstance(read, ToolResult):
        return read
    observation, extras = read
    return await _with_images(tool, arguments, observation, extras, latency_s, max_observation_chars)


def _read_result(
    tool: Tool, arguments: dict[str, Any], result: Any, latency_s: float
) -> ToolResult | tuple[str | list[Mapping[str, Any]], dict[str, Any]]:
    """(observation, extras) of what a tool returned, or the failure when it is no observation."""
    try:
        return _observation_of(tool, result)
    except TypeError as error:
        return _failure("tool_exception", str(error), name=tool.name, arguments=arguments, latency_s=latency_s)


async def _with_images(
    tool: Tool,
    arguments: dict[str, Any],
    observation: list[Mapping[str, Any]],
    extras: dict[str, Any],
    latency_s: float,
    max_observation_chars: int | None,
) -> ToolResult:
    """The ToolResult of content parts, their images loaded off the event loop (text: `_text_result`)."""
    if isinstance(observation, str):
        return _text_result(tool, arguments, observation, extras, latency_s, max_observation_chars)
    try:
        parts = await asyncio.to_thread(_loaded_parts, observation)
    except _BadImage as bad:
        return _failure(
            "bad_image",
            f"tool '{tool.name}' returned an image that cannot be used (part {bad.index}): {bad.reason}",
            name=tool.name,
            arguments=arguments,
            extras=extras,
            latency_s=latency_s,
        )
    text = "".join(part["text"] for part in parts if part["type"] == "text")
    if not any(part["type"] == "image" for part in parts):
        parts = None  # text parts only: the same as returning their text
    return _text_result(tool, arguments, text, extras, latency_s, max_observation_chars, parts)


def _text_result(
    tool: Tool,
    arguments: dict[str, Any],
    observation: str,
    extras: dict[str, Any],
    latency_s: float,
    max_observation_chars: int | None,
    parts: list[dict[str, Any]] | None = None,
) -> ToolResult:
    """The ToolResult of an observation's text (and loaded parts), truncated past the limit."""
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
            parts=_truncated_parts(parts, max_chars, note) if parts is not None else None,
        )
    return ToolResult(
        observation=observation,
        ok=True,
        name=tool.name,
        arguments=arguments,
        extras=extras,
        latency_s=latency_s,
        parts=parts,
    )


class _BadImage(Exception):
    def __init__(self, index: int, reason: str):
        super().__init__(reason)
        self.index = index
        self.reason = reason


def _loaded_parts(parts: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Content parts with each image loaded as an RGB PIL image (`load_image`); _BadImage names the first bad one."""
    loaded: list[dict[str, Any]] = []
    for index, part in enumerate(parts):
        if part["type"] == "text":
            loaded.append({"type": "text", "text": part["text"]})
            continue
        try:
            loaded.append({"type": "image", "image": load_image(part)})
        except ImageError as error:
            raise _BadImage(index, str(error)) from error
        except Exception as error:  # whatever a strange image object raises is shown, not raised
            raise _BadImage(index, f"{type(error).__name__}: {_text_of(error)}") from error
    return loaded


def _truncated_parts(parts: list[dict[str, Any]], max_chars: int, note: str) -> list[dict[str, Any]]:
    """The parts with their text cut to `max_chars` characters in all (images kept), then `note`."""
    remaining, kept = max_chars, []
    for part in parts:
        if part["type"] == "text":
            text = part["text"][:remaining]
            remaining -= len(text)
            if not text:
                continue
            part = {"type": "text", "text": text}
        kept.append(part)
    return kept + [{"type": "text", "text": note}]


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_surrogates(text: str) -> tuple[str, int]:
    """`text` with each lone surrogate written as its escape (`\\ud800`), and how many there were: such text
    cannot be encoded (the tokenizer, UTF-8 logs), so no observation may hold one."""
    if not _LONE_SURROGATE.search(text):  # (a regex scan: observations are often long)
        return text, 0
    count = sum(1 for character in text if "\ud800" <= character <= "\udfff")
    return text.encode("utf-8", "backslashreplace").decode("utf-8"), count


def _encodable(result: ToolResult) -> ToolResult:
    """The result with no lone surrogate left in what is shown or logged; a successful call whose output held
    one becomes a `tool_exception` failure (its output kept, escaped, with a note saying so)."""
    observation, count = _without_surrogates(result.observation)
    if result.parts is not None:
        result.parts = [
            {"type": "text", "text": _without_surrogates(part["text"])[0]} if part["type"] == "text" else part
            for part in result.parts
        ]
    result.error = _without_surrogates(result.error)[0] if result.error is not None else None
    result.name = _without_surrogates(result.name)[0]
    if count and result.ok:
        message = (
            f"tool '{result.name}' returned text holding {count} lone surrogate(s) (half of a UTF-16 pair, not a "
            "character); they are shown escaped, like \\ud800"
        )
        observation = f"{observation}\n[{message}]"
        result.ok, result.error, result.error_kind = False, message, "tool_exception"
    result.observation = observation
    return result


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
    if not parallel or len(calls) < 2:  # (one call needs no task of its own)
        return [_encodable(await _execute_tool_call(call, table, **options)) for call in calls]
    plans = [_plan(call, table, timeout, context) for call in calls]
    if any(isinstance(plan, _Plan) and plan.tool.stateful for plan in plans):
        # a stateful call waits for its environment first: each call in a task of its own
        results = await asyncio.gather(*(_execute_tool_call(call, table, **options) for call in calls))
        return [_encodable(result) for result in results]
    return [_encodable(result) for result in await _run_concurrently(plans, max_observation_chars)]


async def _run_concurrently(plans: list[_Plan | ToolResult], max_observation_chars: int | None) -> list[ToolResult]:
    """Runs the planned calls together, each under its limit (`_LimitedCall`: the function's own task or thread and
    loop callbacks, no task per call to wait on it), and returns every call's ToolResult in order once all have
    settled. Cancelling the caller stops them all, as `call_with_limit` does, and propagates."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    started = [plan for plan in plans if isinstance(plan, _Plan)]
    unsettled = len(started)

    def settled() -> None:
        nonlocal unsettled
        unsettled -= 1
        if not unsettled and not waiter.done():
            waiter.set_result(None)

    calls: dict[int, _LimitedCall] = {}
    for plan in started:
        plan.started = time.perf_counter()
        calls[id(plan)] = _LimitedCall(
            plan.tool.bound_function, plan.arguments_in, plan.tool.is_async, plan.limit_s, loop, settled
        )
    try:
        await waiter
    except asyncio.CancelledError:
        await _stop_calls(list(calls.values()))
        raise
    results: list[Any] = []
    for plan in plans:
        if isinstance(plan, ToolResult):
            results.append(plan)
            continue
        call = calls[id(plan)]
        latency_s = call.ended_at - plan.started
        try:
            value = call.result()
        except (CallTimedOut, CallRaisedBaseException, Exception) as error:  # noqa: BLE001 - an observation
            results.append(_call_failure(plan, error, latency_s))
            continue
        read = _read_result(plan.tool, plan.arguments, value, latency_s)
        if isinstance(read, ToolResult):
            results.append(read)
        elif isinstance(read[0], str):
            results.append(_text_result(plan.tool, plan.arguments, *read, latency_s, max_observation_chars))
        else:  # content parts: their images are loaded (off the loop) for all such calls together, below
            results.append(_with_images(plan.tool, plan.arguments, *read, latency_s, max_observation_chars))
    pending = [index for index, result in enumerate(results) if not isinstance(result, ToolResult)]
    if pending:
        done = await asyncio.gather(*(results[index] for index in pending))
        for index, result in zip(pending, done):
            results[index] = result
    return results
