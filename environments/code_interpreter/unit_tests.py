"""Scoring code against a dataset's unit tests (HumanEval-style), in a sandbox.

A HumanEval-style row has `prompt` (signature + docstring), `test` (a program defining `check(candidate)`)
and `entry_point` (the function name). MBPP-style rows with `test_list` (assert statements) work too.

The score comes from the tests, never from the exit status: the sandbox runs the judge of
`environments.code_interpreter.judge`, which runs the tests in its own process and calls the solution in
another one, and reports one result per test behind a random token (see that module for why the solution
cannot write or fake the report, and what it can still do). A run passes only with exactly one report
carrying the token, as many results as the task has tests, all passed, and a clean exit.
"""

from __future__ import annotations

import json
import pathlib
import re
import secrets
from collections.abc import Mapping
from typing import Any

from agentfly_jax.envs.sandbox import run_python
from environments.code_interpreter.env import extract_code
from environments.code_interpreter.judge import REPORT_MARK, count_tests

#: Source of the judge (standard library only), sent into the sandbox with each run.
JUDGE_SOURCE = pathlib.Path(__file__).with_name("judge.py").read_text()


def solution_code(completion: str, task: Mapping[str, Any]) -> str:
    """The code the solution process runs: the completion, after the prompt (HumanEval: a completion
    that defines the entry point itself follows the prompt, whose imports it may need; otherwise it is the
    function's body, as in HumanEval) or after the row's `test_setup_code` (MBPP)."""
    count_tests(task)  # a ValueError naming the row's keys when it is neither style
    code = extract_code(completion)
    if "test" in task and "entry_point" in task:
        prompt = task.get("prompt", "") or ""
        entry_point = task["entry_point"]
        defines = re.search(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE)
        return f"{prompt}\n\n{code}" if defines else prompt + code
    setup = task.get("test_setup_code", "") or ""
    return f"{setup}\n\n{code}\n"


def build_test_program(completion: str, task: Mapping[str, Any], token: str | None = None) -> str:
    """The judge program that runs `task`'s tests against `completion` and reports behind `token`."""
    total = count_tests(task)
    config: dict[str, Any] = {
        "token": token or secrets.token_hex(16),
        "total": total,
        "code": solution_code(completion, task),
        "child_source": JUDGE_SOURCE + "\nrun_child()\n",
    }
    if "test" in task and "entry_point" in task:
        config.update(
            style="humaneval",
            prompt=task.get("prompt", "") or "",
            test=task["test"],
            entry_point=task["entry_point"],
        )
    else:
        config.update(
            style="mbpp", setup=task.get("test_setup_code", "") or "", cases=list(task["test_list"])
        )
    return f"{JUDGE_SOURCE}\n\nrun_judge({json.dumps(config)!r})\n"


def read_report(stdout: str, token: str, total: int) -> tuple[dict | None, str | None]:
    """The judge's report in `stdout`, or None and why there is no acceptable one."""
    lines = [line for line in stdout.splitlines() if line.startswith(REPORT_MARK)]
    if not lines:
        return None, "the tests reported no result (the program ended or was killed before they finished)"
    if len(lines) > 1:
        return None, f"{len(lines)} test reports were printed where the judge prints one"
    _, _, rest = lines[0].partition(" ")
    got_token, _, body = rest.partition(" ")
    if not secrets.compare_digest(got_token, token):
        return None, "the test report does not carry this run's token"
    try:
        report = json.loads(body)
    except ValueError:
        return None, "the test report is unreadable"
    results = report.get("results") if isinstance(report, dict) else None
    if not isinstance(results, list) or not all(isinstance(r, bool) for r in results):
        return None, "the test report has no per-test results"
    if len(results) != total:
        return None, f"the test report has {len(results)} results for {total} tests"
    return report, None


async def run_unit_tests(
    completion: str, task: Mapping[str, Any], *, backend: str = "bwrap", timeout: float = 10.0
) -> dict[str, Any]:
    """Runs the task's tests against `completion` in a fresh sandbox.

    Returns {"reward": 1.0 or 0.0, "passed", "tests_passed", "tests_total", "timed_out", "exit_code",
    "error"}: reward 1.0 only when every test passed (see the module docstring); `error` says what failed
    (the judge's first failures, else the tail of stderr) when the tests did not pass.
    """
    token = secrets.token_hex(16)
    total = count_tests(task)
    result = await run_python(build_test_program(completion, task, token), backend=backend, timeout=timeout)
    report, problem = read_report(result.stdout, token, total)
    results = report["results"] if report is not None else []
    passed = (
        report is not None
        and report.get("completed") is True
        and all(results)
        and result.exit_code == 0
        and not result.timed_out
    )
    if passed:
        error = None
    elif report is not None and report.get("failures"):
        error = "\n".join(str(f) for f in report["failures"])[-1000:]
    else:
        error = "\n".join(filter(None, [problem, result.stderr[-1000:]]))
    return {
        "reward": 1.0 if passed else 0.0,
        "passed": passed,
        "tests_passed": sum(results),
        "tests_total": total,
        "timed_out": result.timed_out,
        "exit_code": result.exit_code,
        "error": error,
    }
