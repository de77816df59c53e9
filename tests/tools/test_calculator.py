"""The built-in calculator: arithmetic by syntax tree, against Python's own arithmetic, and what it refuses."""

import asyncio
import math

import pytest

from agentfly_jax.tools import calculator, evaluate_arithmetic, execute_tool_call


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("1 + 2 * 3", 1 + 2 * 3),
        ("(12 + 7) * 3 / 4", (12 + 7) * 3 / 4),
        ("2 ** 10", 2**10),
        ("2 ^ 10", 2**10),
        ("-7 // 2", -7 // 2),
        ("-7 % 3", -7 % 3),
        ("sqrt(2) * sqrt(2)", math.sqrt(2) * math.sqrt(2)),
        ("max(3, 9, 4) - min(2, 8)", 7),
        ("round(pi, 3)", 3.142),
        ("factorial(6) / gcd(12, 18)", 120),
        ("log(e)", 1.0),
        ("3 × 4 ÷ 6", 2),
    ],
)
def test_matches_python_arithmetic(expression, expected):
    assert evaluate_arithmetic(expression) == pytest.approx(expected, rel=1e-12)


def test_formats_integral_results_as_integers():
    assert calculator(expression="7 / 7") == "1"
    assert calculator(expression="1 / 3") == "0.333333333333"
    assert calculator(expression="0.1 + 0.2") == "0.3"


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('true')", "unknown function '__import__\\("),
        ("(1).real", "is not arithmetic"),
        ("open('secret')", "unknown function 'open'"),
        ("x + 1", "unknown name 'x'"),
        ("[1, 2]", "is not arithmetic"),
        ("'a' * 3", "is not arithmetic"),
        ("lambda: 1", "is not arithmetic"),
        ("9 ** 9 ** 9", "exponent 387420489 is too large"),
        ("(10 ** 4000) ** 10000", "more than 4300 digits"),
        ("factorial(100000)", "factorial argument is too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "cannot parse"),
        ("1" * 600, "longer than 500"),
    ],
)
def test_refuses_anything_but_bounded_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        evaluate_arithmetic(expression)


def test_errors_reach_the_model_as_observations():
    result = asyncio.run(execute_tool_call({"name": "calculator", "arguments": {"expression": "x*2"}}, [calculator]))
    assert not result.ok and result.error_kind == "tool_exception"
    assert "unknown name 'x'" in result.observation
