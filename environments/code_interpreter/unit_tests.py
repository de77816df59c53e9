"""Scoring code against a dataset's unit tests (HumanEval-style), in a sandbox.

A HumanEval-style row has `prompt` (signature + docstring), `test` (a program defining `check(candidate)`)
and `entry_point` (the function name). MBPP-style rows with `test_list` (assert statements) work too.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from agentfly_jax.envs.sandbox import run_python
from environments.code_interpreter.env import extract_code


def build_test_program(completion: str, task: Mapping[str, Any]) -> str:
    """The program that passes iff `completion` solves `task`.

    A completion that defines the entry point itself is appended to the prompt (whose imports it may need);
    otherwise it is taken as the function body and appended to the prompt, as in HumanEval.
    """
    code = extract_code(completion)
    prompt = task.get("prompt", "") or ""
    if "test" in task and "entry_point" in task:
        entry_point = task["entry_point"]
        defines = re.search(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE)
        solution = f"{prompt}\n\n{code}" if defines else prompt + code
        return f"{solution}\n\n{task['test']}\n\ncheck({entry_point})\n"
    if "test_list" in task:
        setup = task.get("test_setup_code", "") or ""
        return "\n\n".join([setup, code, *task["test_list"]]) + "\n"
    raise ValueError(
        "task has neither 'test' + 'entry_point' (HumanEval-style) nor 'test_list' (MBPP-style); "
        f"its keys are {sorted(task)}"
    )


async def run_unit_tests(
    completion: str, task: Mapping[str, Any], *, backend: str = "bwrap", timeout: float = 10.0
) -> dict[str, Any]:
    """Runs the task's tests against `completion` in a fresh sandbox.

    Returns {"reward": 1.0 or 0.0, "passed", "timed_out", "exit_code", "error"} where `error` is the tail of
    stderr (what failed) when the tests did not pass.
    """
    result = await run_python(build_test_program(completion, task), backend=backend, timeout=timeout)
    passed = result.ok
    return {
        "reward": 1.0 if passed else 0.0,
        "passed": passed,
        "timed_out": result.timed_out,
        "exit_code": result.exit_code,
        "error": None if passed else result.stderr[-1000:],
    }
