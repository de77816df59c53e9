"""Code interpreter environment: a sandboxed, persistent Python session per chain, plus unit-test scoring.

The `code_interpreter` tool and the `code_unit_tests` / `integer_answer_match` rewards (decorated for the agent
runtime) live in `environments.code_interpreter.tools` and `environments.code_interpreter.rewards`;
`env_spec(**options)` is the environment's EnvSpec: generated computation problems
(`environments.code_interpreter.problems`) solved by running Python.
"""

from environments.code_interpreter.env import (
    CodeInterpreterEnv,
    extract_code,
    format_observation,
    truncate_middle,
)
from environments.code_interpreter.spec import env_spec
from environments.code_interpreter.unit_tests import build_test_program, run_unit_tests

#: Resource-manager pool config for this environment (override any field in the experiment config).
POOL_CONFIG = {
    "factory": "environments.code_interpreter.env:CodeInterpreterEnv",
    "kwargs": {"backend": "bwrap", "timeout": 10.0, "max_output_chars": 4000},
    "min_size": 0,
    "max_size": 64,
    "idle_timeout": 300.0,
    "acquire_timeout": 300.0,
}

__all__ = [
    "CodeInterpreterEnv",
    "extract_code",
    "format_observation",
    "truncate_middle",
    "build_test_program",
    "run_unit_tests",
    "POOL_CONFIG",
    "env_spec",
]
