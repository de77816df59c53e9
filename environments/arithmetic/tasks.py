"""Arithmetic questions a tiny model cannot answer in its head but can with the `calculator` tool."""
from __future__ import annotations

import dataclasses
import random
from typing import Any

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclasses.dataclass(frozen=True)
class ArithmeticTaskConfig:
    operand_min: int = 10
    operand_max: int = 999
    ops: str = "*+-"


def generate_tasks(n: int, seed: int, cfg: ArithmeticTaskConfig = ArithmeticTaskConfig(),
                   exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """`n` distinct tasks {"id", "question", "expression", "answer"}; `exclude` holds expressions to avoid
    (held-out tasks never appear in training)."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    tasks = []
    max_tries = 50 * n + 1000
    for _ in range(max_tries):
        if len(tasks) == n:
            break
        a = rng.randint(cfg.operand_min, cfg.operand_max)
        b = rng.randint(cfg.operand_min, cfg.operand_max)
        op = rng.choice(cfg.ops)
        expression = f"{a} {op} {b}"
        if expression in seen:
            continue
        seen.add(expression)
        tasks.append({"id": f"arith-{seed}-{len(tasks)}", "question": f"What is {expression}?",
                      "expression": expression, "answer": str(_OPS[op](a, b))})
    if len(tasks) < n:
        raise ValueError(f"could only generate {len(tasks)} distinct tasks of {n}; widen the operand range")
    return tasks


def _guess(answer: str, rng: random.Random) -> str:
    """A wrong answer of plausible size (what a model that does not use the tool writes)."""
    value = int(answer)
    while True:
        guess = value + rng.choice([-1, 1]) * rng.randint(1, max(10, abs(value) // 3))
        if guess != value:
            return str(guess)


def demonstration(task: dict[str, Any], *, use_tool: bool, rng: random.Random) -> list[dict[str, Any]]:
    """A chat for SFT: call the calculator and copy its result, or answer with a guess."""
    messages = [{"role": "user", "content": task["question"]}]
    if not use_tool:
        return messages + [{"role": "assistant", "content": _guess(task["answer"], rng)}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": task["expression"]}}}
    return messages + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": task["answer"]},
        {"role": "assistant", "content": task["answer"]},
    ]
