"""Pulling the final answer out of what a model wrote: \\boxed{...}, <answer>...</answer>, "Final Answer:"."""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_FINAL_ANSWER = re.compile(r"^[ \t]*Final Answer[ \t]*:[ \t]*(.*)$", re.MULTILINE | re.IGNORECASE)


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`), nested braces included."""
    best_start: int = -1
    best: str | None = None
    for command in _BOX_COMMANDS:
        start = text.rfind(command)
        while start >= 0:
            content = _box_content(text, start + len(command))
            if content is not None:
                if start > best_start:
                    best_start, best = start, content
                break
            start = text.rfind(command, 0, start)
    return best


def _box_content(text: str, position: int) -> str | None:
    if position < len(text) and text[position] == " ":
        # `\boxed 5`: the argument is the next space-free run.
        match = re.match(r" +([^\s$]+)", text[position:])
        return match.group(1) if match else None
    if position >= len(text) or text[position] != "{":
        return None
    depth = 0
    for index in range(position, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[position + 1 : index]
    return None  # unbalanced


def extract_answer_tag(text: str) -> str | None:
    """Content of the last `<answer>...</answer>`."""
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None


def extract_final_answer_line(text: str) -> str | None:
    """The text after the last `Final Answer:` (ReAct style), to the end of that line."""
    matches = _FINAL_ANSWER.findall(text)
    return matches[-1].strip() if matches else None


def extract_answer(text: str, *, order: tuple[str, ...] = ("boxed", "answer_tag", "final_answer")) -> str | None:
    """The first answer found, trying `\\boxed{}`, then `<answer>` tags, then a `Final Answer:` line.

    Inside an `<answer>` tag or a Final Answer line a `\\boxed{}` still wins (models write both).
    """
    extractors = {
        "boxed": extract_boxed,
        "answer_tag": extract_answer_tag,
        "final_answer": extract_final_answer_line,
    }
    for name in order:
        found = extractors[name](text)
        if found is not None:
            inner = extract_boxed(found) if name != "boxed" else None
            return inner if inner is not None else found
    return None
