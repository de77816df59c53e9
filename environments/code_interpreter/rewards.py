"""Rewards of the code interpreter environment: `code_unit_tests` (the answer's code passes the task's unit
tests) and `integer_answer_match` (the final answer is the task's integer, exactly)."""

from __future__ import annotations

import re
from typing import Any

from agentfly_jax.rewards import extract_answer, reward
from environments.code_interpreter.unit_tests import run_unit_tests

_INTEGER = re.compile(r"[+-]?\d+")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+")


@reward(name="code_unit_tests")
async def code_unit_tests(prediction: str, task: Any) -> dict[str, Any]:
    """Runs the dataset row's tests (HumanEval `test` + `entry_point`, or MBPP `test_list`) against the code
    in `prediction` in a bubblewrap sandbox (10 s limit): 1.0 only when the judge reports every test passed
    (see environments.code_interpreter.judge: the tests run in a process the code cannot reach, so exiting
    early, patching builtins or printing fake results earns nothing); "tests_passed" / "tests_total" say
    how far it got."""
    return await run_unit_tests(prediction, task, backend="bwrap", timeout=10.0)


def parse_integer(text: str) -> int | None:
    """The integer `text` states ("1234", "1,234", "$1234$", "1234."), else None."""
    value = text.strip().strip("$").strip().rstrip(".").replace(" ", "")
    if _THOUSANDS.fullmatch(value):
        value = value.replace(",", "")
    return int(value) if _INTEGER.fullmatch(value) else None


# Not `math_match`: its relative tolerance (1e-6) and float conversion accept near misses on large integers
# (sums of primes run to billions), and these answers are exact.
@reward(name="integer_answer_match")
def integer_answer_match(prediction: str, answer: Any) -> dict[str, Any]:
    """1.0 when the final answer (the last `\\boxed{}`, else an `<answer>` tag, else a `Final Answer:` line,
    else the whole prediction) is exactly the dataset's integer `answer`."""
    extracted = extract_answer(prediction)
    if extracted is None:
        extracted = prediction
    value = parse_integer(extracted)
    return {"reward": float(value is not None and value == int(answer)), "extracted": extracted.strip()[:100]}
