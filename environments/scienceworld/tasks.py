"""ScienceWorld task rows: task names and variations by split (as the `scienceworld` package defines them),
with each variation's task description (the agent's question) and, when asked, the package's gold path.

    rows = build_tasks("test", num=10, seed=0)                     # round-robin over the 30 tasks
    rows = build_tasks("train", num=200, seed=0, task_names=["boil", "melt"], with_gold=True)
    row = {"task_name": "boil", "variation": 21, "split": "test", "task_id": "boil/21",
           "question": "Your task is to boil water. ...", "gold_actions": [...]}   # gold only when asked

Building rows starts one JVM (≈ 5 s) and loads every chosen variation (≈ 0.15 s each; ≈ 0.6 s with the gold
path). The splits and descriptions come from the simulator itself, so they match the package version.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

from environments.scienceworld.engine import DEFAULT_JVM_OPTIONS, Engine

SPLITS = ("train", "dev", "test")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown ScienceWorld split {split!r}; expected one of {SPLITS}")


@functools.lru_cache(maxsize=1)
def _catalog_engine() -> Engine:
    """The JVM used to list tasks, variations and descriptions (one per process, closed at exit)."""
    import atexit

    engine = Engine(DEFAULT_JVM_OPTIONS)
    atexit.register(engine.close)
    return engine


@functools.lru_cache(maxsize=None)
def task_names() -> tuple[str, ...]:
    """The simulator's task names (30 in scienceworld 1.2.3)."""
    return tuple(_catalog_engine().task_names())


@functools.lru_cache(maxsize=None)
def variations(task_name: str, split: str) -> tuple[int, ...]:
    """The variation indices of `task_name` in `split`."""
    _check_split(split)
    if task_name not in task_names():
        raise ValueError(f"unknown ScienceWorld task {task_name!r}; known: {', '.join(task_names())}")
    engine = _catalog_engine()
    engine.load(task_name, 0)
    return tuple(engine.variations(split))


@functools.lru_cache(maxsize=None)
def describe(task_name: str, variation: int, with_gold: bool = False) -> tuple[str, tuple[str, ...]]:
    """(task description, gold actions or ()) of one variation, from the simulator."""
    engine = _catalog_engine()
    engine.load(task_name, variation, "", with_gold)
    return engine.task_description(), tuple(engine.gold_actions()) if with_gold else ()


def choose_variations(split: str, num: int, seed: int,
                      names: Sequence[str] | None = None) -> list[tuple[str, int]]:
    """`num` distinct (task_name, variation) pairs of `split`, round-robin over `names` (default: all tasks),
    each task's variations drawn without replacement in a seed-determined order."""
    _check_split(split)
    if num < 1:
        raise ValueError(f"num={num}; expected at least 1 task")
    names = list(names) if names else list(task_names())
    rng = random.Random(f"scienceworld/{split}/{seed}")
    pools = {}
    for name in names:
        order = list(variations(name, split))
        rng.shuffle(order)
        pools[name] = order
    available = sum(len(v) for v in pools.values())
    if num > available:
        raise ValueError(f"asked for {num} ScienceWorld {split} tasks, but {names} have only {available}")
    start = rng.randrange(len(names))
    chosen, turn = [], 0
    while len(chosen) < num:
        name = names[(start + turn) % len(names)]
        turn += 1
        if pools[name]:
            chosen.append((name, pools[name].pop()))
    return chosen


def build_tasks(split: str, num: int, seed: int = 0, *, task_names: Sequence[str] | None = None,
                with_gold: bool = False, simplifications: str = "") -> list[dict]:
    """Task rows (see the module docstring); deterministic per (split, num, seed, task_names)."""
    rows = []
    for name, variation in choose_variations(split, num, seed, task_names):
        description, gold = describe(name, variation, with_gold)
        row = {"task_name": name, "variation": variation, "split": split, "task_id": f"{name}/{variation}",
               "question": description}
        if simplifications:
            row["simplifications"] = simplifications
        if with_gold:
            row["gold_actions"] = list(gold)
        rows.append(row)
    return rows
