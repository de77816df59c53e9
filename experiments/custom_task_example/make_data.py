"""Writes the example task's train.jsonl and eval.jsonl (deterministic): `python -m experiments.custom_task_example.make_data`."""
import json
import os
import random

from experiments.custom_task_example.tools import FACTORS, convert

HERE = os.path.dirname(os.path.abspath(__file__))


def rows(n: int, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        i = len(out)
        table = FACTORS[rng.choice(sorted(FACTORS))]
        src, dst = rng.sample(sorted(table), 2)
        value = round(rng.uniform(0.5, 500.0), rng.choice([0, 1, 2]))
        question = f"How many {dst} are in {value:g} {src}?"
        if question not in exclude:  # held-out questions never appear in training
            out.append({"id": f"units-{seed}-{i}", "question": question, "answer": round(convert(value, src, dst), 6)})
    return out


def main() -> None:
    heldout = rows(64, 1)
    train = rows(400, 0, exclude={r["question"] for r in heldout})
    for name, data in (("train.jsonl", train), ("eval.jsonl", heldout)):
        with open(os.path.join(HERE, name), "w") as fh:
            for row in data:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
