"""Math word problems from reasoning-gym's `gsm_symbolic` (GSM8K templates with fresh names and numbers), split
by seed, and the SFT demonstrations built from each problem's worked solution.

Splits. reasoning-gym's item `i` of a dataset with seed `s` is drawn from `random.Random(s + i)`, so each
(split, seed) gets its own block of `SEED_SPAN` generator seeds: `dataset_seed(split, seed)`. No generator
seed is shared between splits (or between seeds). Templates with few free numbers can still repeat a question
text, so questions are also de-duplicated: "test" first, then "dev" without any test question, then "train"
without any dev or test question. Every split is deterministic in the seed and prefix-stable (the first `n`
rows of a split are the same for any larger `n`).

Rows: `question` (ends with reasoning-gym's "Give the result as your final answer. Do not include units."),
`answer` (the gold as text: an integer, or a decimal for the few templates whose answer is one), `template`
(the gsm_symbolic generator index), `solution` (the template's worked solution text, `answer_cot`).
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

SPLITS = ("train", "dev", "test")
#: Generator seeds per (split, seed); a split's size must stay below it.
SEED_SPAN = 10_000_000


def dataset_seed(split: str, seed: int) -> int:
    """The reasoning-gym dataset seed of a split: disjoint blocks of SEED_SPAN item seeds."""
    return (int(seed) * len(SPLITS) + SPLITS.index(split)) * SEED_SPAN


def _answer_text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def generate_split(split: str, num: int, seed: int, exclude: Iterable[str] = ()) -> list[dict]:
    """`num` rows of gsm_symbolic for `split`, no question repeated and none of `exclude`'s questions."""
    import reasoning_gym

    if split not in SPLITS:
        raise ValueError(f"unknown math_word split {split!r}; expected one of {list(SPLITS)}")
    excluded = set(exclude)
    capacity = min(SEED_SPAN, 2 * num + 1000)  # task draws are prefix-stable in the size
    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=capacity, seed=dataset_seed(split, seed))
    rows, seen = [], set()
    for index in range(capacity):
        if len(rows) == num:
            break
        item = dataset[index]
        question = item["question"]
        if question in seen or question in excluded:
            continue
        seen.add(question)
        metadata = item["metadata"]
        rows.append({
            "question": question,
            "answer": _answer_text(metadata.get("answer_value", item["answer"])),
            "template": int(dataset.task_indices[index]),
            "solution": metadata.get("answer_cot", ""),
        })
    if len(rows) < num:
        raise ValueError(f"only {len(rows)} distinct gsm_symbolic questions for {split} (asked for {num})")
    return rows


# ------------------------------------------------------------------------------ worked solution -> program
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_NUMBER = r"\d[\d,]*(?:\.\d+)?"
_CURRENCY = "$£€¥₹"
_RESULT = re.compile(r"=\s*[" + _CURRENCY + r"]?\s*(-?" + _NUMBER + r")\s*(%?)")
_UNIT_DIVISOR = re.compile(r"/\s*[A-Za-z]+")  # "yards/minute": a unit, not a division
_TIMES = re.compile(r"(?<=[\d\s)])[x×](?=[\s\d(])")


def _evaluate(node: ast.AST) -> Fraction:
    """Exact value of + - * / arithmetic on numbers (anything else raises ValueError)."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError("not plain arithmetic")


def _number(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def _step_expression(left: str, result_is_percent: bool) -> str | None:
    """The arithmetic in the text before an `=` ("4 batches * 7 minutes/batch" -> "4 * 7"), or None."""
    left = re.split(r"[:;=]|,(?!\d{3})|\b(?:so|because|is|are|was|has|of)\b", left)[-1]
    left = re.sub("[" + _CURRENCY + "]", " ", left).replace("÷", "/")
    left = _UNIT_DIVISOR.sub(" ", left)
    left = re.sub(r"(\d)\s*\(", r"\1 * (", left)  # 2(33+12)
    left = _TIMES.sub("*", left)
    percent = re.compile(r"(" + _NUMBER + r")\s*%")
    # "... * 100%" towards a percentage is "* 100"; elsewhere "15%" is 15 / 100
    left = percent.sub((lambda m: m.group(1)) if result_is_percent else (lambda m: f"({m.group(1)} / 100)"), left)
    left = re.sub(r"[A-Za-z'’]+", " ", left)
    left = re.sub(_NUMBER, lambda m: m.group(0).replace(",", ""), left)
    expression = " ".join(left.split()).strip(" +*/")
    return expression if re.search(r"\d\s*[-+*/]\s*\(?\s*\d", expression) else None


def solution_steps(solution: str) -> list[tuple[str, Fraction]]:
    """The worked solution's arithmetic steps `(expression, value)` whose expression evaluates to the stated
    result; steps that do not check out (prose, unknowns like "143 + T") are left out."""
    steps = []
    for line in solution.splitlines():
        if line.startswith("####"):
            continue
        start = 0
        for match in _RESULT.finditer(line):
            left, start = line[start:match.start()], match.end()
            expression = _step_expression(left, bool(match.group(2)))
            if expression is None:
                continue
            try:
                value = _evaluate(ast.parse(expression, mode="eval"))
            except (SyntaxError, ValueError, ZeroDivisionError):
                continue
            if abs(value - _number(match.group(1))) <= Fraction(1, 100):  # solutions round to cents
                steps.append((expression, value))
    return steps


def _format_value(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value))


def solution_program(task: Mapping[str, Any]) -> str | None:
    """A short Python program redoing the worked solution's arithmetic, each step's result reused by name in
    later steps, printing the last step; None when the solution's steps do not reach the gold answer."""
    steps = solution_steps(task.get("solution", ""))
    if not steps or _format_value(steps[-1][1]) != task["answer"]:
        return None
    names: dict[str, str] = {}  # a step's result as written -> its variable
    lines = []
    for index, (expression, value) in enumerate(steps, start=1):
        reused = re.sub(_NUMBER, lambda m: names.get(m.group(0), m.group(0)), expression)
        lines.append(f"step{index} = {reused}")
        names.setdefault(_format_value(value), f"step{index}")
    last, value = f"step{len(steps)}", steps[-1][1]
    if value.denominator == 1:
        lines.append(f"print(round({last}))")  # 4 * 7.0 prints 28, not 28.0
    elif (value * 100).denominator == 1:
        lines.append(f"print(round({last}, 2))")
    else:
        return None
    return "\n".join(lines)


def program_output(program: str) -> str:
    """What a `solution_program` program prints, evaluated exactly here (no exec)."""
    values: dict[str, Fraction] = {}
    printed = ""
    for line in program.splitlines():
        if line.startswith("print("):
            printed = _format_value(values[re.search(r"step\d+", line).group(0)])
            continue
        name, _, expression = line.partition(" = ")
        expression = re.sub(r"step\d+", lambda m: f"({values[m.group(0)]})", expression)
        values[name] = _evaluate(ast.parse(expression, mode="eval"))
    return printed


# ------------------------------------------------------------------------------------------ demonstrations
def _guess(answer: str, rng: random.Random) -> str:
    """A wrong answer of plausible size (what a model that does not compute writes)."""
    value = float(answer)
    while True:
        guess = round(value + rng.choice([-1, 1]) * rng.randint(1, max(5, int(abs(value)) // 3)))
        if guess != value:
            return str(guess)


def demonstration(task: Mapping[str, Any], *, use_tool: bool, rng: random.Random, system_prompt: str) -> list[dict]:
    """One SFT conversation: run the worked solution's arithmetic with the tool and box what it printed, or
    (use_tool False, or a solution that does not reach the gold) the weaker behaviour: a boxed guess."""
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": task["question"]}]
    program = solution_program(task) if use_tool else None
    if program is None:
        return messages + [{"role": "assistant", "content": f"\\boxed{{{_guess(task['answer'], rng)}}}"}]
    call = {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": program}}}
    printed = program_output(program)
    return messages + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "code_interpreter", "content": printed},
        {"role": "assistant", "content": f"The program printed {printed}.\n\\boxed{{{printed}}}"},
    ]


def solvable_fraction(rows: list[Mapping[str, Any]]) -> float:
    """Share of rows whose worked solution converts to a program that prints the gold answer."""
    return sum(solution_program(r) is not None for r in rows) / max(1, len(rows))


__all__ = [
    "SEED_SPAN",
    "SPLITS",
    "dataset_seed",
    "demonstration",
    "generate_split",
    "program_output",
    "solution_program",
    "solution_steps",
    "solvable_fraction",
]
