"""The code interpreter environment's EnvSpec: computation problems (`environments.code_interpreter.problems`)
solved by running Python in the chain's sandboxed session, scored by an exact integer match."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from environments.code_interpreter.problems import check_families, generate_problems, reference_program

SYSTEM_PROMPT = (
    "Solve the problem by computing it in Python: write a program and run it with the code_interpreter tool "
    "(print the result; variables and imports persist between calls). Do not guess: run the code. When you have "
    "the number, reply with the final answer as a bare integer in \\boxed{}, e.g. \\boxed{1234}."
)


def oracle_policy(task: Mapping[str, Any], rng: random.Random):
    """Runs the problem's reference program through the tool and answers what it printed."""
    observation = yield {"name": "code_interpreter", "arguments": {"code": reference_program(dict(task))}}
    return f"\\boxed{{{observation.strip()}}}"


def random_policy(task: Mapping[str, Any], rng: random.Random):
    """Runs a random program on the question's numbers (their sum, product or largest, modulo a random
    number) and answers what it printed: a tool user who does not understand the problem."""
    numbers = [int(n) for n in re.findall(r"\d+", task["question"])] or [0]
    operation = rng.choice(["sum", "math.prod", "max"])
    code = f"import math\nprint({operation}({numbers}) % {rng.randint(2, 10**6)})"
    observation = yield {"name": "code_interpreter", "arguments": {"code": code}}
    return f"\\boxed{{{observation.strip()}}}"


def env_spec(*, families: str | list[str] = "", train_size: int = 4000, dev_size: int = 200,
             test_size: int = 200, backend: str = "bwrap", timeout: float = 10.0, pool_size: int = 16,
             max_turns: int = 4):
    """Project-generated computation problems, answered by running Python with the `code_interpreter` tool.

    families: problem families (comma-separated or a list; empty: all of `problems.FAMILIES`).
    train_size / dev_size / test_size: rows of each split (`num <= 0` asks for all of them).
    backend / timeout: the sandbox ("bwrap" or "docker") and seconds per cell; pool_size: sessions at once.
    """
    from agentfly_jax.envs.spec import EnvSpec
    from environments.code_interpreter import POOL_CONFIG
    from environments.code_interpreter.rewards import integer_answer_match
    from environments.code_interpreter.tools import code_interpreter

    names = check_families([f.strip() for f in families.split(",") if f.strip()] if isinstance(families, str)
                           else list(families))
    sizes = {"train": train_size, "dev": dev_size, "test": test_size}
    for split, size in sizes.items():
        if size < 1:
            raise ValueError(f"{split}_size={size}; expected at least 1 problem per split")
    pool = dict(POOL_CONFIG, kwargs=dict(POOL_CONFIG["kwargs"], backend=backend, timeout=timeout),
                max_size=pool_size)

    def tasks(split: str, num: int, seed: int) -> list[dict]:
        if split not in sizes:
            raise ValueError(f"unknown code_interpreter split {split!r}; expected one of {sorted(sizes)}")
        if num > sizes[split]:
            raise ValueError(f"asked for {num} {split} problems but the split has {split}_size={sizes[split]}; "
                             f"raise the option {split}_size or ask for fewer")
        return generate_problems(split, num if num > 0 else sizes[split], seed, names)

    return EnvSpec(
        name="code_interpreter",
        tasks=tasks,
        tools=[code_interpreter],
        reward=integer_answer_match,
        pools={"code_interpreter": pool},
        system_prompt=SYSTEM_PROMPT,
        agent="tool_calling",
        max_turns=max_turns,
        success_threshold=1.0,
        max_observation_chars=4000,
        splits=("train", "dev", "test"),
        oracle_policy=oracle_policy,
        random_policy=random_policy,
    )
