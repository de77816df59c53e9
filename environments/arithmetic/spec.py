"""The arithmetic environment's EnvSpec: the quickstart's calculator task.

Splits: "test" is a fixed held-out pool of `num_heldout` tasks generated with seed + 1; "train" is generated
with the seed itself, avoiding every held-out expression. This is exactly the construction the trainer used
before environments were plugins (held-out `generate_tasks(64, seed + 1)`, train
`generate_tasks(num_train, seed, exclude=<held-out expressions>)`), so the quickstart's task rows, and the
figures measured on them, are unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from environments.arithmetic.tasks import ArithmeticTaskConfig, _guess, demonstration, generate_tasks


def oracle_policy(task: Mapping[str, Any], rng: random.Random):
    """Calls the calculator with the task's expression and answers what it returned."""
    observation = yield {"name": "calculator", "arguments": {"expression": task["expression"]}}
    return observation.strip()


def random_policy(task: Mapping[str, Any], rng: random.Random):
    """Answers a guess of plausible size without the tool (what an agent that never calls it does)."""
    return _guess(task["answer"], rng)
    yield  # a generator function: scripted agents drive every policy the same way


def env_spec(*, operand_min: int = 10, operand_max: int = 999, ops: str = "*+-", num_heldout: int = 64):
    """Arithmetic questions ("What is 417 * 38?") answered with the `calculator` tool, scored by `math_match`.

    operand_min / operand_max: the operand range; ops: the operators drawn from ("+", "-", "*");
    num_heldout: size of the held-out ("test") pool.
    """
    from agentfly_jax.envs.spec import EnvSpec
    from agentfly_jax.rewards import math_match
    from agentfly_jax.tools.calculator import calculator
    from environments.arithmetic.tokenizer import build_tokenizer

    if operand_min > operand_max:
        raise ValueError(f"operand_min={operand_min} > operand_max={operand_max}; give a non-empty operand range")
    unknown = sorted(set(ops) - set("+-*"))
    if not ops or unknown:
        raise ValueError(f"ops={ops!r}; expected a non-empty string of the operators '+', '-', '*'")
    if num_heldout < 1:
        raise ValueError(f"num_heldout={num_heldout}; expected at least 1 held-out task")
    family = ArithmeticTaskConfig(operand_min=operand_min, operand_max=operand_max, ops=ops)

    def heldout(seed: int) -> list[dict]:
        return generate_tasks(num_heldout, seed + 1, family)

    def tasks(split: str, num: int, seed: int) -> list[dict]:
        if split == "test":
            if num > num_heldout:
                raise ValueError(f"asked for {num} arithmetic test tasks but the held-out pool has "
                                 f"num_heldout={num_heldout}; raise the option num_heldout or ask for fewer")
            pool = heldout(seed)
            return pool if num <= 0 else pool[:num]
        if split == "train":
            if num <= 0:
                raise ValueError("the arithmetic train split is generated on demand and has no fixed size; "
                                 "ask for a number of tasks (num > 0)")
            return generate_tasks(num, seed, family, exclude={t["expression"] for t in heldout(seed)})
        raise ValueError(f"unknown arithmetic split {split!r}; expected 'train' or 'test'")

    def demonstrations(rows, rng: random.Random, expert_fraction: float) -> list[list[dict]]:
        # One rng draw per task decides tool or guess, then the guess draws from the same rng: the order the
        # trainer's demonstrations always used, so a given rng yields the same conversations.
        return [demonstration(t, use_tool=rng.random() < expert_fraction, rng=rng) for t in rows]

    return EnvSpec(
        name="arithmetic",
        tasks=tasks,
        tools=[calculator],
        reward=math_match,
        system_prompt="",  # the agent's default prompt: the quickstart was measured with it
        agent="tool_calling",
        max_turns=3,
        success_threshold=1.0,
        splits=("train", "test"),
        demonstrations=demonstrations,
        oracle_policy=oracle_policy,
        random_policy=random_policy,
        tokenizer=lambda directory, seed: build_tokenizer(directory, seed=seed),
    )
