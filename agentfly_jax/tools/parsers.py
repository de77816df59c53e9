"""The tool-call format: parsers for calls as models write them (Hermes/Qwen tags, ReAct, fenced python).

Every parser takes the decoded assistant text and returns a `ParseResult`; malformed output becomes
`ParseError` values in it (for the agent to show the model), never an exception.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import sys
from collections.abc import Callable
from typing import Any

CODE_INTERPRETER_TOOL = "code_interpreter"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed call: tool name, its arguments, and the exact text it was parsed from."""

    name: str
    arguments: dict[str, Any]
    raw: str


@dataclasses.dataclass(frozen=True)
class ParseError:
    """Why a piece of model output is not a valid call, and that piece's text."""

    message: str
    raw: str


@dataclasses.dataclass(frozen=True)
class ParseResult:
    """Parsed calls in order, the free text around them, and errors for malformed parts.

    `final_answer` is set by formats that have one (ReAct's "Final Answer:").
    """

    text: str
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    errors: list[ParseError] = dataclasses.field(default_factory=list)
    final_answer: str | None = None

    @property
    def ok(self) -> bool:
        """True when nothing in the output was malformed."""
        return not self.errors


# A UTF-16 surrogate code point: JSON's "\\ud800" escapes decode to one when not part of a valid pair, and
# such a string cannot be encoded (tokenizer, UTF-8 logs), so a call holding one is refused.
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_in(value: Any) -> str | None:
    """The first lone surrogate in the strings (and keys) of a value made of dicts, lists and tuples, written as
    an escape like `\\ud800`; None when there is none. Walks without recursion (any depth, cycles too)."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return f"\\u{ord(found.group()):04x}" if found else None
    # The common case, a flat dict of strings (a call's arguments): one search over its keys and values (the
    # separator is no surrogate: a match lies inside one of them); the walk below finds which when one does.
    if (
        isinstance(value, dict)
        and all(isinstance(item, str) for item in itertools.chain(value, value.values()))
        and not _SURROGATE.search("\0".join(itertools.chain(value, value.values())))
    ):
        return None
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found:
                return f"\\u{ord(found.group()):04x}"
        elif isinstance(item, (dict, list, tuple)) and id(item) not in seen:
            seen.add(id(item))  # a container reached twice (or holding itself) is walked once
            stack.extend(item.keys() if isinstance(item, dict) else ())
            stack.extend(item.values() if isinstance(item, dict) else item)
    return None


def load_json(text: str, *, prefix: bool = False) -> tuple[Any, int] | str:
    """(value, end) of the JSON in `text` (with `prefix`, of the JSON value it starts with), or why it cannot be
    read, phrased to follow "... is not valid JSON": a syntax error, nesting too deep, an integer longer than
    Python reads (`sys.get_int_max_str_digits()`), or a lone surrogate escape. Never raises."""
    try:
        if prefix:
            value, end = json.JSONDecoder().raw_decode(text)
        else:
            value, end = json.loads(text), len(text)
    except (json.JSONDecodeError, RecursionError) as error:
        return str(error)
    except ValueError:
        # json raises a plain ValueError only from int(): the number has more digits than Python converts.
        return f"an integer in it has more than {sys.get_int_max_str_digits()} digits"
    # A decoded string holds a surrogate only from the text's own characters or a \\u escape: text with neither
    # (nearly every call) needs no walk of what it decoded to.
    if "\\u" in text or _SURROGATE.search(text):
        surrogate = lone_surrogate_in(value)
        if surrogate is not None:
            return f"a string in it holds {surrogate}, half of a surrogate pair, which is not a character"
    return value, end


def _call_from_json_object(payload: Any, raw: str) -> ToolCall | ParseError:
    """A ToolCall from a decoded `{"name": ..., "arguments": {...}}` object, or why it is not one.

    `arguments` may also be a string holding a JSON object (`decode_arguments`).
    """
    if not isinstance(payload, dict):
        return ParseError(
            f"a tool call must be a JSON object with name and arguments, got {type(payload).__name__}", raw
        )
    unknown = sorted(set(payload) - {"name", "arguments"})
    if unknown:
        return ParseError(
            f"unknown field(s) {', '.join(map(repr, unknown))} in tool call; expected: name, arguments", raw
        )
    name = payload.get("name")
    if not isinstance(name, str) or not name.strip():
        return ParseError('tool call has no name: write {"name": <tool name>, "arguments": {...}}', raw)
    if "arguments" not in payload:
        return ParseError(
            f'tool call {name!r} has no arguments: write "arguments": {{...}} (empty if none)', raw
        )
    arguments = decode_arguments(name, payload["arguments"])
    if isinstance(arguments, str):
        return ParseError(arguments, raw)
    return ToolCall(name=name, arguments=arguments, raw=raw)


def decode_arguments(name: str, arguments: Any) -> dict[str, Any] | str:
    """A call's arguments as a dict, or the message saying why they are not an object.

    Arguments may be a JSON object, or a string holding one (the OpenAI convention, which vLLM's Hermes
    parser also accepts): `"{\\"expression\\": \\"1+2\\"}"` is decoded. A string that is not valid JSON, or
    holds something other than an object, gives the message.
    """
    if isinstance(arguments, str):
        loaded = load_json(arguments)
        if isinstance(loaded, str):
            return (
                f"arguments of tool call {name!r} are a string that is not valid JSON ({loaded}); "
                'write "arguments": {...}, or a string holding one JSON object'
            )
        decoded = loaded[0]
        if not isinstance(decoded, dict):
            return (
                f"arguments of tool call {name!r} are a JSON string holding {type(decoded).__name__}, "
                'not an object; write "arguments": {...}'
            )
        return decoded
    if not isinstance(arguments, dict):
        return f"arguments of tool call {name!r} must be a JSON object, got {type(arguments).__name__}"
    return arguments


def _join_text(pieces: list[str]) -> str:
    return "\n".join(piece.strip() for piece in pieces if piece.strip())


# --------------------------------------------------------------------------------------------------
# Hermes / Qwen: <tool_call>{json}</tool_call>
# --------------------------------------------------------------------------------------------------

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def parse_hermes_tool_calls(text: str) -> ParseResult:
    """Calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn.

    The arguments may also be a JSON-encoded string (`"arguments": "{\\"x\\": 1}"`, the OpenAI convention).
    """
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    free_text: list[str] = []
    cursor = 0
    while True:
        open_at = text.find(TOOL_CALL_OPEN, cursor)
        close_at = text.find(TOOL_CALL_CLOSE, cursor)
        if close_at >= 0 and (open_at < 0 or close_at < open_at):
            free_text.append(text[cursor:close_at])
            errors.append(
                ParseError(f"{TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}", TOOL_CALL_CLOSE)
            )
            cursor = close_at + len(TOOL_CALL_CLOSE)
            continue
        if open_at < 0:
            free_text.append(text[cursor:])
            break
        free_text.append(text[cursor:open_at])
        body_start = open_at + len(TOOL_CALL_OPEN)
        next_open = text.find(TOOL_CALL_OPEN, body_start)
        if close_at < 0 or 0 <= next_open < close_at:
            # Unclosed: the broken block runs to the next opening tag, or to the end of the output.
            block_end = next_open if next_open >= 0 else len(text)
            errors.append(
                ParseError(
                    f"{TOOL_CALL_OPEN} is not closed: end each call with {TOOL_CALL_CLOSE}",
                    text[open_at:block_end],
                )
            )
            cursor = block_end
            continue
        raw = text[open_at : close_at + len(TOOL_CALL_CLOSE)]
        body = text[body_start:close_at].strip()
        loaded = load_json(body)
        if isinstance(loaded, str):
            errors.append(ParseError(f"tool call is not valid JSON ({loaded})", raw))
        else:
            result = _call_from_json_object(loaded[0], raw)
            (calls if isinstance(result, ToolCall) else errors).append(result)
        cursor = close_at + len(TOOL_CALL_CLOSE)
    return ParseResult(text=_join_text(free_text), tool_calls=calls, errors=errors)


# --------------------------------------------------------------------------------------------------
# ReAct: Thought / Action / Action Input (/ Final Answer)
# --------------------------------------------------------------------------------------------------

_REACT_LABEL = re.compile(
    r"^[ \t]*(Thought|Action Input|Action|Observation|Final Answer)[ \t]*:[ \t]*", re.MULTILINE
)


def parse_react(text: str) -> ParseResult:
    """ReAct steps: `Action: <tool>` followed by `Action Input: <JSON object>`, or `Final Answer: ...`.

    The free text is the thought (text outside Action/Action Input/Final Answer). Anything from an
    "Observation:" line on is ignored: observations come from the environment, not the model.
    """
    labels = list(_REACT_LABEL.finditer(text))
    observation = next((match for match in labels if match.group(1) == "Observation"), None)
    end_of_output = observation.start() if observation else len(text)
    labels = [match for match in labels if match.start() < end_of_output]
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    thought: list[str] = [text[: labels[0].start()] if labels else text[:end_of_output]]
    final_answer: str | None = None
    pending_action: tuple[str, int] | None = None  # (tool name, start of its "Action:" line)
    wrote_action = False

    for position, label in enumerate(labels):
        value_end = labels[position + 1].start() if position + 1 < len(labels) else end_of_output
        value = text[label.end() : value_end]
        kind = label.group(1)
        if kind != "Action Input" and pending_action is not None:
            errors.append(
                ParseError(
                    f"Action {pending_action[0]!r} has no Action Input: "
                    "follow it with 'Action Input: {...}'",
                    text[pending_action[1] : label.start()],
                )
            )
            pending_action = None
        if kind == "Thought":
            thought.append(value)
        elif kind == "Final Answer":
            final_answer = value.strip()
        elif kind == "Action":
            wrote_action = True
            name = value.strip()
            if not name or "\n" in name:
                errors.append(
                    ParseError(
                        "Action must name one tool on its line: 'Action: <tool name>'",
                        text[label.start() : value_end],
                    )
                )
            else:
                pending_action = (name, label.start())
        else:  # Action Input
            if pending_action is None:
                errors.append(
                    ParseError(
                        "Action Input without an Action line before it", text[label.start() : value_end]
                    )
                )
                continue
            name, action_start = pending_action
            pending_action = None
            raw = text[action_start:value_end].rstrip()
            stripped = value.strip()
            if not stripped.startswith("{"):
                errors.append(
                    ParseError(f'Action Input of {name!r} must be a JSON object like {{"key": value}}', raw)
                )
                continue
            loaded = load_json(stripped, prefix=True)
            if isinstance(loaded, str):
                errors.append(ParseError(f"Action Input of {name!r} is not valid JSON ({loaded})", raw))
                continue
            arguments, consumed = loaded
            if stripped[consumed:].strip():
                errors.append(ParseError(f"unexpected text after the Action Input JSON of {name!r}", raw))
            else:
                calls.append(ToolCall(name=name, arguments=arguments, raw=raw))
    if pending_action is not None:
        errors.append(
            ParseError(
                f"Action {pending_action[0]!r} has no Action Input: follow it with 'Action Input: {{...}}'",
                text[pending_action[1] : end_of_output],
            )
        )
    if final_answer is not None and wrote_action:
        errors.append(
            ParseError("output has both an Action and a Final Answer: give one of them", text[:end_of_output])
        )
    return ParseResult(text=_join_text(thought), tool_calls=calls, errors=errors, final_answer=final_answer)


# --------------------------------------------------------------------------------------------------
# Code agents: fenced python blocks
# --------------------------------------------------------------------------------------------------

_FENCE_OPEN = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+-]*)[ \t]*$", re.MULTILINE)
_FENCE_CLOSE = re.compile(r"^[ \t]*```[ \t]*$", re.MULTILINE)
PYTHON_FENCE_LANGUAGES = ("python", "py", "python3")


def parse_python_code_blocks(
    text: str, *, languages: tuple[str, ...] = PYTHON_FENCE_LANGUAGES
) -> ParseResult:
    """Each ```python fenced block becomes a call to `code_interpreter` with argument `code`.

    Fences in other languages stay in the free text.
    """
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    free_text: list[str] = []
    cursor = 0
    while True:
        opening = _FENCE_OPEN.search(text, cursor)
        if opening is None:
            free_text.append(text[cursor:])
            break
        closing = _FENCE_CLOSE.search(text, opening.end())
        language = opening.group(1).lower()
        if language not in languages:
            # Not code to run: keep the whole block as text and continue after it.
            block_end = closing.end() if closing else len(text)
            free_text.append(text[cursor:block_end])
            cursor = block_end
            if closing is None:
                break
            continue
        free_text.append(text[cursor : opening.start()])
        if closing is None:
            errors.append(
                ParseError("code block is not closed: end it with a ``` line", text[opening.start() :])
            )
            break
        raw = text[opening.start() : closing.end()]
        code = text[opening.end() + 1 : closing.start()].rstrip("\n")
        if not code.strip():
            errors.append(ParseError("code block is empty", raw))
        else:
            calls.append(ToolCall(name=CODE_INTERPRETER_TOOL, arguments={"code": code}, raw=raw))
        cursor = closing.end()
    return ParseResult(text=_join_text(free_text), tool_calls=calls, errors=errors)


TOOL_CALL_PARSERS: dict[str, Callable[[str], ParseResult]] = {
    "hermes": parse_hermes_tool_calls,
    "react": parse_react,
    "python_code": parse_python_code_blocks,
}


def parse_tool_calls(text: str, format: str) -> ParseResult:
    """Parse `text` with the parser registered as `format` ("hermes", "react" or "python_code")."""
    if format not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call format {format!r}; expected one of {sorted(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[format](text)
