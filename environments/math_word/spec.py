"""The math_word environment's EnvSpec: reasoning-gym `gsm_symbolic` word problems solved by running Python with
the code interpreter's `code_interpreter` tool (same sandbox and per-chain session pool), graded by
`math_verify_match`."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from environments.math_word.tasks import SEED_SPAN, demonstration, generate_split

SYSTEM_PROMPT = (
    "Solve the math word problem with Python: write a short program that computes the answer and run it with "
    "the code_interpreter tool (print the result; variables persist between calls). Do not guess: run the code. "
    "Then reply with the final answer in \\boxed{}, e.g. \\boxed{42}."
)


def oracle_policy(task: Mapping[str, Any], rng: random.Random):
    """An upper bound, not a solver: prints the gold answer through the tool, then boxes what it printed (it
    checks that the tool, the sandbox and the reward agree on every row)."""
    observation = yield {"name": "code_interpreter", "arguments": {"code": f"print({str(task['answer'])!r})"}}
    return f"\\boxed{{{observation.strip()}}}"


def random_policy(task: Mapping[str, Any], rng: random.Random):
    """The floor: runs a random program on the question's numbers (their sum, product or largest) and boxes
    what it printed: a tool user who does not read the problem."""
    numbers = [float(n) if "." in n else int(n) for n in re.findall(r"\d+(?:\.\d+)?", task["question"])] or [0]
    operation = rng.choice(["sum", "math.prod", "max"])
    observation = yield {"name": "code_interpreter", "arguments": {"code": f"import math\nprint({operation}({numbers}))"}}
    return f"\\boxed{{{observation.strip()}}}"


def env_spec(*, train_size: int = 5000, dev_size: int = 200, test_size: int = 300, backend: str = "bwrap",
             timeout: float = 10.0, pool_size: int = 16, max_turns: int = 3):
    """gsm_symbolic word problems answered by running Python with the `code_interpreter` tool.

    train_size / dev_size / test_size: rows of each split (`num <= 0` asks for all of them); the splits use
    disjoint generator seeds and share no question text (`environments.math_word.tasks`).
    backend / timeout: the sandbox ("bwrap" or "docker") and seconds per cell; pool_size: sessions at once.
    """
    from agentfly_jax.envs.spec import EnvSpec
    from agentfly_jax.rewards.math_verify import math_verify_match
    from environments.code_interpreter import POOL_CONFIG
    from environments.code_interpreter.tools import code_interpreter

    sizes = {"train": train_size, "dev": dev_size, "test": test_size}
    for split, size in sizes.items():
        if not 1 <= size < SEED_SPAN // 4:
            raise ValueError(f"{split}_size={size}; expected 1 to {SEED_SPAN // 4 - 1} problems per split")
    pool = dict(POOL_CONFIG, kwargs=dict(POOL_CONFIG["kwargs"], backend=backend, timeout=timeout),
                max_size=pool_size)

    def split_rows(split: str, num: int, seed: int) -> list[dict]:
        # held-out first: dev avoids test's questions, train avoids both
        held_out: list[dict] = []
        for name in ("test", "dev", "train"):
            count = sizes[name] if name != split else num
            rows = generate_split(name, count, seed, exclude={r["question"] for r in held_out})
            if name == split:
                return rows
            held_out += rows
        raise AssertionError(split)

    def tasks(split: str, num: int, seed: int) -> list[dict]:
        if split not in sizes:
            raise ValueError(f"unknown math_word split {split!r}; expected one of {sorted(sizes)}")
        if num > sizes[split]:
            raise ValueError(f"asked for {num} {split} problems but the split has {split}_size={sizes[split]}; "
                             f"raise the option {split}_size or ask for fewer")
        return split_rows(split, num if num > 0 else sizes[split], seed)

    def demonstrations(rows, rng: random.Random, expert_fraction: float) -> list[list[dict]]:
        return [demonstration(t, use_tool=rng.random() < expert_fraction, rng=rng, system_prompt=SYSTEM_PROMPT)
                for t in rows]

    return EnvSpec(
        name="math_word",
        tasks=tasks,
        tools=[code_interpreter],
        reward=math_verify_match,
        pools={"code_interpreter": pool},
        system_prompt=SYSTEM_PROMPT,
        agent="tool_calling",
        max_turns=max_turns,
        success_threshold=1.0,
        max_observation_chars=2000,
        splits=("train", "dev", "test"),
        demonstrations=demonstrations,
        oracle_policy=oracle_policy,
        random_policy=random_policy,
    )
