"""Math answers graded by math-verify, with a LaTeX-normalising comparison where math-verify cannot parse.

`grade_math_answer(predicted, gold)` decides in this order:
1. a `\\boxed{}` (or `\\fbox{}`) around either side is taken off: a MATH-style gold `\\boxed{42}` matches a
   predicted `42` or `\\boxed{42}`;
2. answers that are the same string after `normalize_math_answer` (no `$`, spacing, `\\text{}`, units of
   degrees or %, `\\dfrac`/`\\tfrac`/`\\cfrac` as `\\frac`, ...) are equal, without asking math-verify;
3. math-verify (`rewards.math_verify`: SymPy in helper processes with hard timeouts) compares the two
   numerically and symbolically: `\\cfrac{1}{2}` equals `0.5`, `\\frac{\\sqrt{2}}{2}` equals
   `\\frac{1}{\\sqrt{2}}`, `\\{1,2\\}` equals `\\{2,1\\}`; its verdict is final when it parses both sides;
4. only where math-verify finds nothing to compare on a side (or is not installed) does the older comparison
   decide: numbers within RELATIVE_TOLERANCE / ABSOLUTE_TOLERANCE (`parse_number`), else equal normalised
   strings.
A math-verify timeout or a broken helper is a mismatch with the reason, never a fallback: the older comparison
would only repeat string matching on an answer that was too costly to grade.
"""

from __future__ import annotations

import math
import re
from typing import Any

from agentfly_jax.rewards.decorator import reward
from agentfly_jax.rewards.extract import extract_answer, extract_boxed
from agentfly_jax.rewards.math_verify import (
    STATUS_EQUAL,
    STATUS_NOT_EQUAL,
    STATUS_UNPARSABLE,
    grade_with_math_verify,
)

_TEXT_COMMANDS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\quad|\\qquad|\\displaystyle|\\left|\\right")
_FRACTION = re.compile(r"^(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")
_SHORT_FRACTION = re.compile(r"^(-?)\\frac(\d)(\d)$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\w*\s*=\s*(?=\S)")
_FRACTION_COMMANDS = re.compile(r"\\[dtc]frac(?![A-Za-z])")

# Numbers within this relative (or absolute) tolerance count as equal.
RELATIVE_TOLERANCE = 1e-6
ABSOLUTE_TOLERANCE = 1e-9


def normalize_math_answer(text: str) -> str:
    """A canonical string form: no $/\\( \\)/spacing/\\text{}/units of degrees or %; `\\dfrac`, `\\tfrac` and
    `\\cfrac` -> `\\frac`."""
    answer = str(text).strip()
    for opening, closing in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(opening) and answer.endswith(closing) and len(answer) >= len(opening) + len(closing):
            answer = answer[len(opening) : len(answer) - len(closing)].strip()
    answer = _SPACING.sub("", answer)
    previous = None
    while previous != answer:
        previous, answer = answer, _TEXT_COMMANDS.sub(r"\1", answer)
    answer = _FRACTION_COMMANDS.sub(r"\\frac", answer)
    for unit in ("^\\circ", "^{\\circ}", "°", "\\%", "%", "\\$"):
        answer = answer.replace(unit, "")
    answer = _ASSIGNMENT.sub("", answer)
    answer = answer.rstrip(".").strip()
    answer = re.sub(r"\s+", "", answer)
    if _THOUSANDS.match(answer):
        answer = answer.replace(",", "")
    return answer


def parse_number(text: str) -> float | None:
    """The value of a normalised answer that is a number: 12, -3.5, 1e-3, 3/4, \\frac{3}{4}, -\\frac12."""
    answer = normalize_math_answer(text)
    if not answer:
        return None
    try:
        value = float(answer)
        return value if math.isfinite(value) else None
    except ValueError:
        pass
    for pattern in (_FRACTION, _SHORT_FRACTION):
        match = pattern.match(answer)
        if match:
            numerator, denominator = parse_number(match.group(2)), parse_number(match.group(3))
            if numerator is None or not denominator:
                return None
            sign = -1.0 if match.group(1) else 1.0
            return sign * numerator / denominator
    if answer.count("/") == 1:
        numerator_text, denominator_text = answer.split("/")
        try:
            numerator, denominator = float(numerator_text), float(denominator_text)
        except ValueError:
            return None
        return numerator / denominator if denominator else None
    return None


def unbox(answer: str) -> str:
    """`answer` without a `\\boxed{...}` / `\\fbox{...}` around it: the content of its last box, if any."""
    text = str(answer).strip()
    boxed = extract_boxed(text)
    return boxed.strip() if boxed is not None else text


def _normalised_comparison(predicted: str, gold: str) -> bool:
    """The comparison math_match made before math-verify: numbers within tolerance, else normalised strings."""
    predicted_number, gold_number = parse_number(predicted), parse_number(gold)
    if predicted_number is not None and gold_number is not None:
        return math.isclose(predicted_number, gold_number, rel_tol=RELATIVE_TOLERANCE, abs_tol=ABSOLUTE_TOLERANCE)
    return normalize_math_answer(predicted) == normalize_math_answer(gold)


def _for_math_verify(answer: str) -> str:
    """Spellings math-verify misreads, rewritten: `\\cfrac` -> `\\frac`, `°` -> `^{\\circ}`, a final full stop."""
    text = _FRACTION_COMMANDS.sub(r"\\frac", answer).replace("°", "^{\\circ}").strip()
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1].rstrip()
    return text


def grade_math_answer(predicted: str, gold: Any) -> dict[str, Any]:
    """{"equal": bool, "reason": str | None, "method": str}: `predicted` graded against one `gold` answer.

    `method` says what decided (see the module docstring): "identical" (the same after normalisation),
    "math_verify", "fallback" (math-verify could not parse a side; the normalised comparison decided) or
    "refused" (an empty side, or math-verify timed out / failed: not equal). Never raises.
    """
    predicted_text = unbox(predicted)
    gold_text = unbox("" if gold is None else gold)
    if not predicted_text:
        return {"equal": False, "reason": "empty answer", "method": "refused"}
    if not gold_text:
        return {"equal": False, "reason": "empty gold answer", "method": "refused"}
    normalised = normalize_math_answer(predicted_text)
    if normalised and normalised == normalize_math_answer(gold_text):
        return {"equal": True, "reason": None, "method": "identical"}
    graded = grade_with_math_verify(_for_math_verify(gold_text), _for_math_verify(predicted_text), boxed=True)
    if graded["status"] in (STATUS_EQUAL, STATUS_NOT_EQUAL):
        return {"equal": graded["equal"], "reason": graded["reason"], "method": "math_verify"}
    if graded["status"] == STATUS_UNPARSABLE:
        equal = _normalised_comparison(predicted_text, gold_text)
        reason = None if equal else f"{graded['reason']}; the normalised answers differ"
        return {"equal": equal, "reason": reason, "method": "fallback"}
    return {"equal": False, "reason": graded["reason"], "method": "refused"}


def math_answers_equal(predicted: str, gold: Any) -> bool:
    """Whether `predicted` equals `gold` as math answers (`grade_math_answer`; either side may be boxed)."""
    return grade_math_answer(predicted, gold)["equal"]


def _gold_answers(answer: Any) -> list[Any]:
    if isinstance(answer, (list, tuple)):
        return list(answer)
    return [answer]


@reward
def math_match(prediction: str, answer: Any) -> dict[str, Any]:
    """1.0 when the predicted answer equals the dataset's `answer` (`grade_math_answer`: math-verify, with the
    normalised comparison where math-verify cannot parse).

    The predicted answer is the last `\\boxed{}`, else an `<answer>` tag, else a `Final Answer:` line, else a
    free-text "the answer is ..." / "final answer: ..." phrase, else the whole prediction when it is a bare
    number. `answer` may be boxed itself (`\\boxed{42}`, as MATH writes it) and may be a list of accepted
    answers. Extras: `extracted` (None when nothing was found), and `reason` when an extracted answer is wrong.
    """
    extracted = extract_answer(prediction)
    if extracted is None and parse_number(prediction) is not None:
        extracted = prediction.strip()
    if extracted is None:
        return {"reward": 0.0, "extracted": None}
    reason = None
    for gold in _gold_answers(answer):
        graded = grade_math_answer(extracted, gold)
        if graded["equal"]:
            return {"reward": 1.0, "extracted": extracted}
        reason = reason or graded["reason"]
    return {"reward": 0.0, "extracted": extracted, "reason": reason or "no gold answer"}
