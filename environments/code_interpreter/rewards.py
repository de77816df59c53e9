"""The `code_unit_tests` reward: 1.0 when the final answer's code passes the task's unit tests."""

from __future__ import annotations

from typing import Any

from agentfly_jax.rewards import reward
from environments.code_interpreter.unit_tests import run_unit_tests


@reward(name="code_unit_tests")
async def code_unit_tests(prediction: str, task: Any) -> dict[str, Any]:
    """Runs the dataset row's tests (HumanEval `test` + `entry_point`, or MBPP `test_list`) against the code
    in `prediction` in a bubblewrap sandbox (10 s limit)."""
    return await run_unit_tests(prediction, task, backend="bwrap", timeout=10.0)
