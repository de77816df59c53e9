"""The built-in `calculator` tool: safe arithmetic by walking the expression's syntax tree (no `eval`)."""

from __future__ import annotations

import ast
import math
import operator

from agentfly_jax.tools.decorator import tool

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "log2": math.log2,
    "log10": math.log10,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "floor": math.floor,
    "ceil": math.ceil,
    "factorial": math.factorial,
    "gcd": math.gcd,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}

# Bounds that keep one expression cheap: no 9**9**9, no factorial(10**6), no megabyte-long input.
MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 10_000
MAX_FACTORIAL = 1_000
MAX_INTEGER_DIGITS = 4_300


_MAX_BITS = int(MAX_INTEGER_DIGITS * 3.33)


def _check_size(value: float) -> float | int:
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, int) and abs(value).bit_length() > _MAX_BITS:
        raise ValueError(f"result has more than {MAX_INTEGER_DIGITS} digits")
    return value


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is too large (limit {MAX_EXPONENT})")
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                # Check the size before computing: (10**4000)**10000 would take minutes.
                _check_size(1 << min(abs(left).bit_length() * abs(right), _MAX_BITS + 1) - 1)
        return _check_size(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.Name):
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        raise ValueError(f"unknown name '{node.id}'; known constants: {', '.join(_CONSTANTS)}")
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS or node.keywords:
            shown = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
            raise ValueError(f"unknown function '{shown}'; known functions: {', '.join(_FUNCTIONS)}")
        arguments = [_evaluate(argument) for argument in node.args]
        if node.func.id == "factorial" and arguments and arguments[0] > MAX_FACTORIAL:
            raise ValueError(f"factorial argument is too large (limit {MAX_FACTORIAL})")
        return _check_size(_FUNCTIONS[node.func.id](*arguments))
    raise ValueError(f"'{ast.unparse(node)}' is not arithmetic; use numbers, + - * / // % ** and functions")


def evaluate_arithmetic(expression: str) -> float | int:
    """The value of an arithmetic expression; raises ValueError (or ZeroDivisionError) with the reason."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    cleaned = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(cleaned, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"cannot parse {expression!r} as arithmetic ({error.msg})") from None
    return _evaluate(tree)


def format_number(value: float) -> str:
    """Integers as integers, integral floats without '.0', other floats with up to 12 significant digits."""
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: The expression, e.g. "(12 + 7) * 3 / 4". Supports + - * / // % ** (or ^), parentheses,
            pi, e and the functions abs, round, min, max, sqrt, exp, log, log2, log10, sin, cos, tan,
            floor, ceil, factorial, gcd.
    """
    return format_number(evaluate_arithmetic(expression))
