"""ALFWorld on its real engine (TextWorld's PDDL engine with ALFWorld's domain, grammar, demangler and
admissible commands): `ALFWorldEnv`, the task-suite builder (`python -m environments.alfworld.build`), the
`alfworld_step` / `alfworld_admissible_commands` tools, the `alfworld_reward`, and `env_spec` (the environment's
EnvSpec).

    from environments.alfworld import ALFWorldEnv
    env = ALFWorldEnv()
    obs = await env.reset({"game_file": "suite/test/pick_and_place_simple-0000/game.tw-pddl"})
    result = await env.step("go to countertop 1")      # StepResult(observation, reward, done, info)
    await env.close()
"""

from __future__ import annotations

import json
import os

from environments.alfworld.env import ALFWorldEnv, parse_task
from environments.alfworld.scenes import TASK_TYPES
from environments.alfworld.tools import POOL, alfworld_admissible_commands, alfworld_reward, alfworld_step

#: Resource-manager pool config (override any field in the experiment config).
POOL_CONFIG = {
    "factory": "environments.alfworld.env:ALFWorldEnv",
    "kwargs": {"max_steps": 50},
    "min_size": 0,
    "max_size": 16,
    "idle_timeout": 600.0,
    "acquire_timeout": 600.0,
}

SYSTEM_PROMPT = (
    "You are an agent in a text-based household (ALFWorld). Complete the task by acting with alfworld_step, one "
    "command per call: 'go to <receptacle>', 'open <receptacle>', 'take <object> from <receptacle>', "
    "'move <object> to <receptacle>', 'heat/cool/clean <object> with <appliance>', 'use <lamp>', 'examine "
    "<thing>', 'look', 'inventory'. alfworld_admissible_commands lists what is possible now. When the task is "
    "done, give a short final answer."
)

DEFAULT_SUITE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "agentfly_jax", "alfworld")


def load_manifest(directory: str) -> list[dict]:
    """DIR/manifest.json written by the builder."""
    path = os.path.join(directory, "manifest.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist; build it: python -m environments.alfworld.build --out "
                                f"{directory} --seed 0 --num 60")
    with open(path) as fh:
        return json.load(fh)


def suite(num_per_split: int, seed: int, root: str = DEFAULT_SUITE_DIR, *,
          num_test: int | None = None) -> list[dict]:
    """A generated suite with `num_per_split` train games and `num_test` (default: as many) test games, built
    once (≈ 0.6 s a game: each is verified by the engine's planner), then read from `root`."""
    from environments.alfworld.build import build_generated, official_data_dir

    num_test = num_per_split if num_test is None else num_test
    if num_per_split < 1 or num_test < 0:
        raise ValueError(f"an ALFWorld suite needs at least 1 train game and no negative count; got "
                         f"{num_per_split} train, {num_test} test")
    official = official_data_dir()
    if official:
        name = f"official-n{max(num_per_split, num_test)}"
    elif num_test == num_per_split:
        name = f"seed{seed}-n{num_per_split}"
    else:
        name = f"seed{seed}-train{num_per_split}-test{num_test}"
    directory = os.path.join(root, name)
    if not os.path.isfile(os.path.join(directory, "manifest.json")):
        if official:
            from environments.alfworld.build import build_official

            manifest = build_official(official, max(num_per_split, num_test))
        else:
            total = num_per_split + num_test
            manifest = build_generated(directory, seed, total, test_fraction=num_test / total)
        os.makedirs(directory, exist_ok=True)
        partial = os.path.join(directory, f"manifest.json.{os.getpid()}.tmp")
        with open(partial, "w") as fh:
            json.dump(manifest, fh, indent=1)
        os.replace(partial, os.path.join(directory, "manifest.json"))  # readers never see half a manifest
    return load_manifest(directory)


def task_rows(manifest: list[dict], split: str) -> list[dict]:
    """Task rows of one split: the game, its task type, its expert plan and the question (the goal text)."""
    rows = []
    for entry in manifest:
        if entry["split"] != split:
            continue
        goal = entry.get("goal") or entry["task_type"].replace("_", " ")
        rows.append({"game_file": entry["game_file"], "task_type": entry["task_type"],
                     "expert_plan": list(entry["expert_plan"]), "task_id": os.path.relpath(entry["game_file"]),
                     "question": f"Your task is to: {goal}."})
    return rows


def oracle_policy(task, rng):
    """Plays the engine planner's expert plan of the game."""
    for command in task["expert_plan"]:
        observation = yield {"name": "alfworld_step", "arguments": {"action": command}}
        if "[You completed the task.]" in observation:
            break
    return "Done."


def random_policy(task, rng, steps: int = 25):
    """Random admissible commands (`steps` of them), asking for the list before each."""
    for _ in range(steps):
        listing = yield {"name": "alfworld_admissible_commands", "arguments": {}}
        commands = [c for c in listing.split("\n")[1:] if c and c != "help"]
        observation = yield {"name": "alfworld_step", "arguments": {"action": rng.choice(commands or ["look"])}}
        if "[You completed the task.]" in observation or "[Step limit" in observation:
            break
    return "Done."


def env_spec(*, suite_dir: str = "", num_train_games: int = 240, num_test_games: int = 60, max_steps: int = 50,
             max_turns: int = 51, pool_size: int = 4, random_steps: int = 25, demo_tasks: int = 128):
    """The ALFWorld environment's spec.

    suite_dir: a built suite (DIR with manifest.json, `python -m environments.alfworld.build`). Without it, each
    seed has its own generated suite of `num_train_games` train and `num_test_games` held-out games, built on
    first use (≈ 0.6 s a game) and cached under ~/.cache/agentfly_jax/alfworld: the held-out games avoid the
    goals of that suite's train games, so the sizes are fixed by options rather than by how many rows a call
    asks for. max_steps: moves per game; max_turns: assistant turns per chain; pool_size: engines at once;
    random_steps: the random policy's moves; demo_tasks: train games the scripted policies are recorded on for
    SFT demonstrations (`environments.evaluation.recorded_demonstrations`).
    """
    options = dict(locals())  # this spec's options: recorded demonstrations rebuild the same spec
    from environments.evaluation import recorded_demonstrations
    from agentfly_jax.envs.spec import EnvSpec

    if not suite_dir and (num_train_games < 1 or num_test_games < 0):
        raise ValueError(f"num_train_games={num_train_games}, num_test_games={num_test_games}: a generated ALFWorld "
                         "suite needs at least one train game and no negative count")
    if suite_dir:
        splits = tuple(s for s in ("train", "dev", "test") if any(e["split"] == s for e in load_manifest(suite_dir)))
    else:
        from environments.alfworld.build import official_data_dir

        splits = ("train", "dev", "test") if official_data_dir() else ("train", "test")

    def tasks(split: str, num: int, seed: int) -> list[dict]:
        manifest = load_manifest(suite_dir) if suite_dir else suite(num_train_games, seed, num_test=num_test_games)
        rows = task_rows(manifest, split)
        if num > len(rows):
            where = f"the suite in {suite_dir}" if suite_dir else "the generated suite"
            more = "" if suite_dir else f" (raise the option num_{'train' if split == 'train' else 'test'}_games)"
            raise ValueError(f"{where} has {len(rows)} {split} games, fewer than the {num} asked for{more}")
        return rows if num <= 0 else rows[:num]

    pool = dict(POOL_CONFIG, kwargs={"max_steps": max_steps}, max_size=pool_size)
    return EnvSpec(
        name="alfworld",
        tasks=tasks,
        tools=[alfworld_step, alfworld_admissible_commands],
        reward=alfworld_reward,
        pools={POOL: pool},
        oracle_policy=oracle_policy,
        random_policy=lambda task, rng: random_policy(task, rng, random_steps),
        demonstrations=recorded_demonstrations(lambda: env_spec(**options), max_tasks=demo_tasks),
        system_prompt=SYSTEM_PROMPT,
        agent="react",
        max_turns=max_turns,
        success_threshold=1.0,
        splits=splits,
    )


__all__ = [
    "ALFWorldEnv",
    "POOL",
    "POOL_CONFIG",
    "SYSTEM_PROMPT",
    "TASK_TYPES",
    "alfworld_admissible_commands",
    "alfworld_reward",
    "alfworld_step",
    "env_spec",
    "load_manifest",
    "oracle_policy",
    "parse_task",
    "random_policy",
    "suite",
    "task_rows",
]
