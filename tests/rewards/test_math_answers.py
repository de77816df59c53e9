"""`math_match` / `grade_math_answer`: boxed gold answers, `\\cfrac`, symbolic equality through math-verify,
free-text answers ("the answer is 42."), the normalised comparison where math-verify cannot parse, and
bounded time.

The symbolic cases are in the spirit of math-verify's own suite (numbers, fractions, radicals, sets,
intervals, polynomials); each case was worked by hand.
"""

import asyncio
import time

import pytest

pytest.importorskip("math_verify")

from agentfly_jax.rewards import (
    extract_answer,
    extract_answer_phrase,
    grade_math_answer,
    math_answers_equal,
    math_match,
    normalize_math_answer,
)
from agentfly_jax.rewards import math_verify as mv


def score(prediction, answer):
    return math_match.func(prediction=prediction, answer=answer)


# ------------------------------------------------------------------------------------------------ boxed gold
@pytest.mark.parametrize(
    "prediction, gold",
    [
        ("So the total is \\boxed{42}.", "\\boxed{42}"),
        ("\\boxed{42}", "$\\boxed{42}$"),
        ("\\boxed{0.5}", "\\boxed{\\frac{1}{2}}"),
        ("\\boxed{\\frac{1}{2}}", "\\boxed{\\dfrac12}"),
        # a MATH solution as the gold: its last box is the answer
        ("The area is \\boxed{18}", "The base is 6 and the height 6, so the area is $\\boxed{18}$."),
        ("Final Answer: 7", "\\fbox{7}"),
    ],
)
def test_a_boxed_gold_matches_a_boxed_or_plain_prediction(prediction, gold):
    assert score(prediction, gold) == {"reward": 1.0, "extracted": extract_answer(prediction)}


def test_a_boxed_gold_still_rejects_wrong_answers():
    result = score("\\boxed{41}", "\\boxed{42}")
    assert result["reward"] == 0.0 and result["reason"] == "not equal to the gold answer"
    assert score("\\boxed{3}", ["\\boxed{2}", "\\boxed{3}"])["reward"] == 1.0


# ------------------------------------------------------------------------------------------------ \cfrac
def test_cfrac_is_a_fraction():
    assert normalize_math_answer("\\cfrac{1}{2}") == "\\frac{1}{2}"
    assert normalize_math_answer("-\\cfrac{3}{4}") == "-\\frac{3}{4}"
    graded = grade_math_answer("\\cfrac{1}{2}", "0.5")
    assert graded == {"equal": True, "reason": None, "method": "math_verify"}
    assert score("\\boxed{\\cfrac{1}{2}}", "0.5")["reward"] == 1.0
    assert score("\\boxed{\\cfrac{1}{3}}", "0.5")["reward"] == 0.0
    # continued fractions: 1 + 1/(1 + 1/2) = 5/3
    assert math_answers_equal("1+\\cfrac{1}{1+\\cfrac{1}{2}}", "\\frac{5}{3}")


# ------------------------------------------------------------------------------------------------ symbolic
@pytest.mark.parametrize(
    "predicted, gold",
    [
        ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
        ("\\sqrt{8}", "2\\sqrt{2}"),
        ("(x+1)^2", "x^2+2x+1"),
        ("\\frac{3}{4}", "0.75"),
        ("75\\%", "\\frac{3}{4}"),
        ("\\{3, 1, 2\\}", "\\{1,2,3\\}"),
        ("[0.5, 2)", "[\\frac{1}{2},2)"),
        ("\\frac{\\pi}{2}", "\\frac{2\\pi}{4}"),
    ],
)
def test_symbolically_equal_answers(predicted, gold):
    graded = grade_math_answer(predicted, gold)
    assert graded["equal"] and graded["method"] == "math_verify", graded


@pytest.mark.parametrize(
    "predicted, gold",
    [
        ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{2}"),
        ("(x+1)^2", "x^2+1"),
        ("(-\\infty, 2)", "(-\\infty,2]"),
        ("\\{1, 2\\}", "\\{1,2,3\\}"),
        ("0.3333", "\\frac{1}{3}"),
    ],
)
def test_symbolically_different_answers(predicted, gold):
    graded = grade_math_answer(predicted, gold)
    assert graded == {"equal": False, "reason": "not equal to the gold answer", "method": "math_verify"}


# ------------------------------------------------------------------------------------------------ free text
@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 42.", "42"),
        ("Adding them up, the final answer is 3.5.", "3.5"),
        ("Final answer: 42", "42"),
        ("So, final answer: $\\frac{1}{2}$. Done.", "$\\frac{1}{2}$"),
        ("**Final Answer:** 12", "12"),
        ("The correct answer is: x = 3", "x = 3"),
        ("At first the answer is 3? No. Checking again, the answer is 4.", "4"),  # the last statement counts
        ("I think it is 7", None),
        ("The answer is", None),
    ],
)
def test_answer_phrases(text, expected):
    assert extract_answer_phrase(text) == expected


def test_free_text_answers_are_graded():
    assert score("Nine plus three is twelve... The answer is 12.", "12") == {"reward": 1.0, "extracted": "12"}
    assert score("so the final answer is $\\frac{1}{2}$.", "0.5")["reward"] == 1.0
    assert score("The answer is 13.", "12")["reward"] == 0.0
    # a box still wins over a phrase, and without any marker nothing is extracted
    assert score("The answer is 5, i.e. \\boxed{6}", "6")["reward"] == 1.0
    assert score("I think it is 7", "7") == {"reward": 0.0, "extracted": None}


# ------------------------------------------------------------------------------------------------ fallback
def test_an_unparsable_pair_falls_back_to_the_normalised_comparison():
    # full-width digits (a gold answer as some datasets write it): math-verify finds no number in it
    gold = "４.５"
    assert mv.grade_with_math_verify(gold, "4.5")["status"] == mv.STATUS_UNPARSABLE
    assert grade_math_answer("4.5", gold) == {"equal": True, "reason": None, "method": "fallback"}
    assert grade_math_answer("\\cfrac{9}{2}", gold)["equal"]  # parse_number reads the fraction: 9/2 = 4.5
    wrong = grade_math_answer("4.6", gold)
    assert wrong["equal"] is False and wrong["method"] == "fallback"
    assert wrong["reason"] == "math-verify could not parse the gold answer; the normalised answers differ"


def test_without_math_verify_the_normalised_comparison_decides(monkeypatch):
    monkeypatch.setattr(mv, "_AVAILABLE", False)
    assert grade_math_answer("\\frac{1}{2}", "0.5") == {"equal": True, "reason": None, "method": "fallback"}
    wrong = grade_math_answer("\\frac{1}{3}", "0.5")
    assert wrong["equal"] is False and "math-verify is not installed" in wrong["reason"]
    assert score("\\boxed{\\dfrac{3}{4}}", "\\boxed{0.75}")["reward"] == 1.0


def test_identical_answers_need_no_math_verify(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("math-verify was asked about identical answers")

    monkeypatch.setattr("agentfly_jax.rewards.math_answers.grade_with_math_verify", refuse)
    assert grade_math_answer("$\\text{(B)}$", "(B)") == {"equal": True, "reason": None, "method": "identical"}
    # malformed, and math-verify would call it unequal to itself, but it is the same text
    assert grade_math_answer("\\frac{1}{ 2", "\\frac{1}{2")["method"] == "identical"


def test_empty_sides_are_refused():
    refused = {"equal": False, "method": "refused"}
    assert grade_math_answer("\\boxed{}", "5") == {**refused, "reason": "empty answer"}
    assert grade_math_answer("5", None) == {**refused, "reason": "empty gold answer"}
    assert score("\\boxed{5}", [])["reward"] == 0.0


# ------------------------------------------------------------------------------------------- bounded time
def test_a_pathological_answer_is_bounded_in_time(monkeypatch):
    monkeypatch.setattr(mv, "HARD_TIMEOUT_SECONDS", 1.0)
    start = time.monotonic()
    result = score("\\boxed{(10^{10^{10}})!}", "5")
    elapsed = time.monotonic() - start
    assert result["reward"] == 0.0 and "within 1 s" in result["reason"], result
    assert elapsed < 2.5, elapsed  # the helper was killed at the hard limit, below math-verify's own 3 s
    assert grade_math_answer("(10^{10^{10}})!", "5")["method"] == "refused"  # a timeout is not a fallback
    monkeypatch.undo()  # a fresh helper (it starts within the usual limit) grades the next answer
    assert score("\\boxed{\\frac{2}{4}}", "0.5")["reward"] == 1.0


def test_through_the_reward_runtime():
    scoring = math_match.score(prediction="The answer is \\cfrac{1}{2}.", task={"answer": "\\boxed{0.5}"})
    result = asyncio.run(scoring)
    assert result.ok and result.reward == 1.0 and result.extras == {"extracted": "\\cfrac{1}{2}"}
