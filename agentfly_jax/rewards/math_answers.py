"""Math answer checking: exact match after LaTeX normalisation, or numeric match (fractions, commas, %)."""

from __future__ import annotations

import math
import re
from typing import Any

from agentfly_jax.rewards.decorator import reward
from agentfly_jax.rewards.extract import extract_answer

_TEXT_COMMANDS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\quad|\\qquad|\\displaystyle|\\left|\\right")
_FRACTION = re.compile(r"^(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")
_SHORT_FRACTION = re.compile(r"^(-?)\\frac(\d)(\d)$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\w*\s*=\s*(?=\S)")

# Numbers within this relative (or absolute) tolerance count as equal.
RELATIVE_TOLERANCE = 1e-6
ABSOLUTE_TOLERANCE = 1e-9


def normalize_math_answer(text: str) -> str:
    """A canonical string form: no $/\\( \\)/spacing/\\text{}/units of degrees or %, `\\dfrac` -> `\\frac`."""
    answer = str(text).strip()
    for opening, closing in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(opening) and answer.endswith(closing) and len(answer) >= len(opening) + len(closing):
            answer = answer[len(opening) : len(answer) - len(closing)].strip()
    answer = _SPACING.sub("", answer)
    previous = None
    while previous != answer:
        previous, answer = answer, _TEXT_COMMANDS.sub(r"\1", answer)
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
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


def math_answers_equal(predicted: str, gold: Any) -> bool:
    """Whether `predicted` equals `gold` as numbers (within tolerance) or as normalised strings."""
    predicted_number, gold_number = parse_number(predicted), parse_number(str(gold))
    if predicted_number is not None and gold_number is not None:
        return math.isclose(predicted_number, gold_number, rel_tol=RELATIVE_TOLERANCE, abs_tol=ABSOLUTE_TOLERANCE)
    return normalize_math_answer(predicted) == normalize_math_answer(str(gold))


def _gold_answers(answer: Any) -> list[Any]:
    if isinstance(answer, (list, tuple)):
        return list(answer)
    return [answer]


@reward
def math_match(prediction: str, answer: Any) -> dict[str, Any]:
    """1.0 when the predicted answer equals the dataset's `answer` (numerically or after normalisation).

    The predicted answer is the last `\\boxed{}`, else an `<answer>` tag, else a `Final Answer:` line, else
    the whole prediction when it is a bare number. `answer` may be a list of accepted answers.
    """
    extracted = extract_answer(prediction)
    if extracted is None and parse_number(prediction) is not None:
        extracted = prediction.strip()
    if extracted is None:
        return {"reward": 0.0, "extracted": None}
    correct = any(math_answers_equal(extracted, gold) for gold in _gold_answers(answer))
    return {"reward": float(correct), "extracted": extracted}

