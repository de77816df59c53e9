"""Built-in rewards: answer extraction, math exact/numeric match, QA exact match and F1 (hand-computed)."""

import pytest

from agentfly_jax.rewards import (
    extract_answer,
    extract_boxed,
    math_match,
    normalize_qa_answer,
    parse_number,
    qa_exact_match,
    qa_f1,
    token_f1,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{1} then \boxed{\sqrt{\frac{3}{4}}}", r"\sqrt{\frac{3}{4}}"),
        (r"\fbox{7} and earlier", "7"),
        (r"\boxed 9 is it", "9"),
        (r"\boxed{unbalanced", None),
        ("no box", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_answer_order():
    assert extract_answer("<answer>Paris</answer>") == "Paris"
    assert extract_answer(r"<answer>It is \boxed{3}</answer>") == "3"
    assert extract_answer("Thought: done\nFinal Answer: 12 apples") == "12 apples"
    assert extract_answer(r"\boxed{1} <answer>2</answer>") == "1"
    assert extract_answer("nothing here") is None


@pytest.mark.parametrize(
    "prediction, answer, expected",
    [
        (r"The answer is \boxed{42}.", "42", 1.0),
        (r"\boxed{42.0}", 42, 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
        (r"\boxed{-\frac12}", "-0.5", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{50\%}", "50", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{x = 3}", "3", 1.0),
        (r"\boxed{\text{(B)}}", "(B)", 1.0),
        (r"$\boxed{ 2 + x }$", "2+x", 1.0),
        ("7", 7, 1.0),
        ("Final Answer: 7", "7", 1.0),
        (r"\boxed{43}", "42", 0.0),
        (r"\boxed{0.3333}", "1/3", 0.0),
        ("I think it is 7", "7", 0.0),  # no marked answer, and not a bare number
        (r"\boxed{3}", ["2", "3"], 1.0),
    ],
)
def test_math_match(prediction, answer, expected):
    assert math_match(prediction, answer)["reward"] == expected


def test_math_match_reports_what_it_extracted():
    assert math_match(r"\boxed{12}", "12") == {"reward": 1.0, "extracted": "12"}
    assert math_match("no answer", "12") == {"reward": 0.0, "extracted": None}
    assert parse_number(r"\frac{1}{0}") is None and parse_number("abc") is None


def test_qa_normalisation_and_exact_match():
    assert normalize_qa_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_qa_answer("An apple, a day") == "apple day"
    assert qa_exact_match("The Eiffel Tower.", "eiffel tower")["reward"] == 1.0
    assert qa_exact_match("<answer>Paris</answer> because...", ["Lyon", "paris"])["reward"] == 1.0
    assert qa_exact_match("Paris, France", "Paris")["reward"] == 0.0


def test_qa_f1_hand_computed():
    # prediction tokens: [eiffel, tower]; gold: [eiffel, tower, in, paris]
    # precision 2/2, recall 2/4 -> F1 = 2 * 1 * 0.5 / 1.5 = 2/3
    assert qa_f1("<answer>the Eiffel tower</answer>", "Eiffel Tower in Paris")["reward"] == pytest.approx(2 / 3)
    # repeated tokens count with multiplicity: pred [a1, a1, b] vs gold [a1, b, b]: overlap 2 -> P=R=2/3
    assert token_f1("a1 a1 b", "a1 b b") == pytest.approx(2 / 3)
    assert qa_f1("red", ["blue", "red"])["reward"] == 1.0
    assert qa_f1("green", "red")["reward"] == 0.0
    assert token_f1("", "") == 1.0 and token_f1("paris", "") == 0.0
