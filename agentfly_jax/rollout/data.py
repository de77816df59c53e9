"""Datasets as AgentFly users know them: a JSON list (or JSONL lines) of objects with `question` + any fields.

Fields other than `question` flow to rewards (by parameter name) and to tools that take `task`.
Every error names the file and line of the offending row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentfly_jax.rewards.decorator import Reward, as_reward

JSONL_SUFFIXES = (".jsonl", ".ndjson")


class DatasetError(ValueError):
    """A dataset file is malformed; the message names the file and line."""


def _line_of(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1


def _skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _parse_json_list(text: str, source: str) -> tuple[list[Any], list[int]]:
    """The elements of a top-level JSON array and the line each starts on."""
    decoder = json.JSONDecoder()
    position = _skip_whitespace(text, 0)
    if position >= len(text) or text[position] != "[":
        raise DatasetError(
            f"{source}:{_line_of(text, position)}: a JSON dataset is a list of objects `[{{...}}, ...]`; "
            "for one object per line use the .jsonl suffix"
        )
    rows: list[Any] = []
    lines: list[int] = []
    position = _skip_whitespace(text, position + 1)
    if position < len(text) and text[position] == "]":
        return rows, lines
    while True:
        try:
            row, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{source}:{error.lineno}: invalid JSON: {error.msg} (column {error.colno})") from None
        rows.append(row)
        lines.append(_line_of(text, position))
        position = _skip_whitespace(text, end)
        if position < len(text) and text[position] == ",":
            position = _skip_whitespace(text, position + 1)
            continue
        if position < len(text) and text[position] == "]":
            break
        raise DatasetError(f"{source}:{_line_of(text, position)}: invalid JSON: expected ',' or ']' after a row")
    trailing = _skip_whitespace(text, position + 1)
    if trailing < len(text):
        raise DatasetError(f"{source}:{_line_of(text, trailing)}: unexpected text after the closing ']'")
    return rows, lines


def _parse_jsonl(text: str, source: str) -> tuple[list[Any], list[int]]:
    rows: list[Any] = []
    lines: list[int] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise DatasetError(
                f"{source}:{number}: invalid JSON: {error.msg} (column {error.colno}); a JSONL dataset has "
                "one JSON object per line"
            ) from None
        lines.append(number)
    return rows, lines


def load_tasks(path: str | Path, *, reward: Reward | Any = None, limit: int | None = None) -> list[dict[str, Any]]:
    """The rows of a JSON (list of objects) or JSONL (one object per line) dataset file, validated.

    Every row must be an object with a non-empty string `question`. When `reward` is given, its
    dataset fields are checked against every row too (a misspelt field fails here, naming the line).
    `limit` keeps only the first rows. `.json` files hold a JSON list, `.jsonl`/`.ndjson` files one object
    per line; other files are read as a JSON list when they start with `[` and as JSONL otherwise.
    """
    path = Path(path)
    source = str(path)
    if path.is_dir():
        raise DatasetError(f"{source}: a directory, not a dataset file (a .json or .jsonl file)")
    if not path.is_file():
        raise DatasetError(f"{source}: no such dataset file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is not part of the first row
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise DatasetError(f"{source}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES or (suffix != ".json" and not text.lstrip().startswith("[")):
        rows, lines = _parse_jsonl(text, source)
    else:
        rows, lines = _parse_json_list(text, source)
    if limit is not None:
        rows, lines = rows[:limit], lines[:limit]
    if not rows:
        raise DatasetError(f"{source}: the dataset has no rows")
    for row, line in zip(rows, lines):
        if not isinstance(row, Mapping):
            raise DatasetError(f"{source}:{line}: each row must be a JSON object, got {type(row).__name__}")
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            got = ("missing" if "question" not in row else
                   f"got {type(question).__name__} {question!r}"[:80] if not isinstance(question, str) else "empty")
            raise DatasetError(
                f"{source}:{line}: the row needs a non-empty string 'question' field ({got}; "
                f"fields: {', '.join(sorted(row)) or 'none'})"
            )
    reward_fn = as_reward(reward)
    if reward_fn is not None:
        reward_fn.check_tasks(rows, where=lambda index: f"{source}:{lines[index]}")
    return [dict(row) for row in rows]
