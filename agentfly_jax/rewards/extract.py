"""Pulling the final answer out of what a model wrote: \\boxed{...}, <answer>...</answer>, "Final Answer:", and
free text such as "the answer is 42." or "so the final answer is $\\frac{1}{2}$"."""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_FINAL_ANSWER = re.compile(r"^[ \t]*Final Answer[ \t]*:[ \t]*(.*)$", re.MULTILINE | re.IGNORECASE)
# "the answer is X", "the final answer is: X", "Final answer: X", "the correct answer is X", anywhere in a line;
# markdown emphasis around the phrase ("**Final Answer:** X") is allowed.
_ANSWER_PHRASE = re.compile(
    r"\b(?:the\s+(?:final\s+|correct\s+)?answer|final\s+answer)[ \t*]*(?:is\b[ \t]*:?|:)[ \t*]*", re.IGNORECASE
)
# The end of the answer's sentence: a full stop (or !, ;) followed by a space or the end, not a decimal point.
_SENTENCE_END = re.compile(r"[.!;](?=\s|$)")


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


def extract_answer_phrase(text: str) -> str | None:
    """The answer stated in free text: what follows the last "the answer is" / "final answer:" phrase that is
    followed by anything.

    The answer runs to the end of its sentence (a `.`, `!` or `;` before a space or the line's end; a decimal
    point does not end it) or line; surrounding `**` emphasis and a trailing full stop are dropped.
    "The answer is 42." gives "42"; "So the final answer is $\\frac{1}{2}$." gives "$\\frac{1}{2}$". None when
    no such phrase is followed by anything.
    """
    # Only the phrases are matched, so a phrase inside an earlier phrase's line is found too.
    for match in reversed(list(_ANSWER_PHRASE.finditer(text))):
        line_end = text.find("\n", match.end())
        value = text[match.end() : line_end if line_end >= 0 else len(text)]
        end = _SENTENCE_END.search(value)
        if end is not None:
            value = value[: end.start()]
        value = value.strip().strip("*").strip()
        if value:
            return value
    return None


EXTRACTORS = {
    "boxed": extract_boxed,
    "answer_tag": extract_answer_tag,
    "final_answer": extract_final_answer_line,
    "answer_phrase": extract_answer_phrase,
}


def extract_answer(
    text: str, *, order: tuple[str, ...] = ("boxed", "answer_tag", "final_answer", "answer_phrase")
) -> str | None:
    """The first answer found, trying `\\boxed{}`, then `<answer>` tags, then a `Final Answer:` line, then a
    free-text "the answer is ..." / "final answer: ..." phrase (`extract_answer_phrase`).

    Inside an `<answer>` tag, a Final Answer line or an answer phrase a `\\boxed{}` still wins (models write
    both). `order` picks and orders the extractors by name (the keys of `EXTRACTORS`).
    """
    unknown = [name for name in order if name not in EXTRACTORS]
    if unknown:
        raise ValueError(f"unknown answer extractor(s) {unknown}; expected names from {sorted(EXTRACTORS)}")
    extractors = EXTRACTORS
    for name in order:
        found = extractors[name](text)
        if found is not None:
            inner = extract_boxed(found) if name != "boxed" else None
            return inner if inner is not None else found
    return None
