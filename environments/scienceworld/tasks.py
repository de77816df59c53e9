"""ScienceWorld task rows: task names and variations by split (as the `scienceworld` package defines them),
with each variation's task description (the agent's question) and, when asked, the package's gold path.

    rows = build_tasks("test", num=10, seed=0)                     # round-robin over the 30 tasks
    rows = build_tasks("train", num=200, seed=0, task_names=["boil", "melt"], with_gold=True)
    rows = build_tasks("train", num=600, seed=0, lazy=True)        # TaskRows: descriptions read on first use
    row = {"task_name": "boil", "variation": 21, "split": "test", "task_id": "boil/21",
           "question": "Your task is to boil water. ...", "gold_actions": [...]}   # gold only when asked

The catalog (task names and each task's train/dev/test variations) is listed by the simulator once (one JVM,
≈ 5 s) and cached per package version under ~/.cache/agentfly_jax/scienceworld, so choosing rows is
instant afterwards. A row's description needs its variation loaded in the catalog JVM (≈ 0.15 s; ≈ 0.6 s
with the gold path): `build_tasks` loads every chosen row, `lazy=True` returns `TaskRows`, which loads a row
only when it is first indexed (the trainer indexes the few rows of each step). Splits and descriptions come
from the simulator itself, so they match the package version.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import os
import random
import threading
from collections.abc import Sequence

from environments.scienceworld.engine import DEFAULT_JVM_OPTIONS, Engine

log = logging.getLogger(__name__)

SPLITS = ("train", "dev", "test")

#: Where the catalog of each package version is cached (one small JSON file).
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "agentfly_jax", "scienceworld")

# The catalog JVM is used from whichever thread builds or indexes rows: one call sequence at a time.
_CATALOG_LOCK = threading.RLock()


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


def _package_key() -> str:
    """Names the installed simulator: the package version and the size of its jar."""
    from importlib.metadata import version

    from environments.scienceworld.engine import _import_scienceworld

    jar = os.path.join(os.path.dirname(_import_scienceworld().__file__), "scienceworld.jar")
    return f"{version('scienceworld')}-{os.path.getsize(jar)}"


def _list_catalog() -> dict:
    with _CATALOG_LOCK:
        engine = _catalog_engine()
        names = engine.task_names()
        splits = {}
        for name in names:
            engine.load(name, 0)
            splits[name] = {split: engine.variations(split) for split in SPLITS}
    return {"task_names": names, "variations": splits}


@functools.lru_cache(maxsize=1)
def catalog() -> dict:
    """{"task_names": [...], "variations": {task: {split: [variation, ...]}}} of the installed simulator,
    from the cache file when it exists (else listed by the simulator and written there)."""
    path = os.path.join(CACHE_DIR, f"catalog-{_package_key()}.json")
    try:
        with open(path) as fh:
            cached = json.load(fh)
        if set(cached) == {"task_names", "variations"} and set(cached["variations"]) == set(cached["task_names"]):
            return cached
        log.warning("ScienceWorld catalog cache %s is malformed; listing the catalog again", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as error:
        log.warning("ScienceWorld catalog cache %s is unreadable (%s); listing the catalog again", path, error)
    listed = _list_catalog()
    try:
        os.makedirs(CACHE_DIR, exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as fh:
            json.dump(listed, fh)
        os.replace(partial, path)  # atomic: concurrent processes never read half a file
    except OSError as error:
        log.warning("could not cache the ScienceWorld catalog at %s: %s", path, error)
    return listed


def task_names() -> tuple[str, ...]:
    """The simulator's task names (30 in scienceworld 1.2.3)."""
    return tuple(catalog()["task_names"])


def variations(task_name: str, split: str) -> tuple[int, ...]:
    """The variation indices of `task_name` in `split`."""
    _check_split(split)
    if task_name not in task_names():
        raise ValueError(f"unknown ScienceWorld task {task_name!r}; known: {', '.join(task_names())}")
    return tuple(catalog()["variations"][task_name][split])


@functools.lru_cache(maxsize=None)
def describe(task_name: str, variation: int, with_gold: bool = False) -> tuple[str, tuple[str, ...]]:
    """(task description, gold actions or ()) of one variation, from the simulator."""
    with _CATALOG_LOCK:
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


class TaskRows(Sequence):
    """Task rows of (task_name, variation) pairs whose description (and gold path, with `with_gold`) is read
    from the simulator when a row is first indexed, then kept; each indexing returns a fresh dict.

    Behaves as a read-only list of rows (len, int indices, slices -> lists, iteration) for the trainer.
    """

    def __init__(self, pairs: Sequence[tuple[str, int]], split: str, *, with_gold: bool = False,
                 simplifications: str = ""):
        _check_split(split)
        self.pairs = [(str(name), int(variation)) for name, variation in pairs]
        self.split = split
        self.with_gold = with_gold
        self.simplifications = simplifications

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._row(name, variation) for name, variation in self.pairs[index]]
        name, variation = self.pairs[operator.index(index)]
        return self._row(name, variation)

    def _row(self, name: str, variation: int) -> dict:
        description, gold = describe(name, variation, self.with_gold)
        row = {"task_name": name, "variation": variation, "split": self.split, "task_id": f"{name}/{variation}",
               "question": description}
        if self.simplifications:
            row["simplifications"] = self.simplifications
        if self.with_gold:
            row["gold_actions"] = list(gold)
        return row

    def __repr__(self) -> str:
        return f"TaskRows({self.split!r}, {len(self.pairs)} rows, with_gold={self.with_gold})"


def build_tasks(split: str, num: int, seed: int = 0, *, task_names: Sequence[str] | None = None,
                with_gold: bool = False, simplifications: str = "", lazy: bool = False) -> list[dict] | TaskRows:
    """Task rows (see the module docstring); deterministic per (split, num, seed, task_names).

    lazy: return `TaskRows` (descriptions read when a row is first indexed) instead of a list of dicts.
    """
    rows = TaskRows(choose_variations(split, num, seed, task_names), split, with_gold=with_gold,
                    simplifications=simplifications)
    return rows if lazy else list(rows)
