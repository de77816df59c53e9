"""ALFWorld task suites: solvable household games for the six task types, generated from a seed.

    python -m environments.alfworld.build --out DIR --seed S --num N [--test-fraction 0.25]
    python -m environments.alfworld.build --out DIR --official ALFWORLD_DATA_DIR --num N

Writes DIR/<split>/<task type>-<index>/game.tw-pddl (the package's `alfred.pddl` domain, its `alfred.twl2`
grammar with the goal text filled in, and a generated PDDL problem) beside a minimal traj_data.json, and
DIR/manifest.json: a list of {"game_file", "task_type", "split", "expert_plan", ...} where `expert_plan` is
the action list that solves the game. Every game is verified before it is written: the engine's planner
(fast-downward through TextWorld) plans it and the plan, played through the same engine with ALFWorld's
demangler, must reach the goal. Scenes, objects and goals come from `--seed` only (same seed, same files);
the held-out ("test") split is drawn from its own seed stream and avoids the (task type, object, receptacle)
goals of the train split.

With `--official DIR` (or $ALFWORLD_DATA when it holds json_2.1.1/) pointing at the official ALFWorld data, those games
are used instead: train from json_2.1.1/train, test from valid_unseen, dev from valid_seen; their expert
plans come from the same planner.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from environments.alfworld import scenes

SPLITS = ("train", "test")


def game_data(scene: scenes.Scene, goal: scenes.Goal, description: str, name: str) -> dict:
    """The .tw-pddl content of one game (package domain and grammar + our problem)."""
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    with open(ALFRED_PDDL_PATH) as fh:
        domain = fh.read()
    with open(ALFRED_TWL2_PATH) as fh:
        grammar = fh.read().replace("UNKNOWN GOAL", description)
    return {"pddl_domain": domain, "grammar": grammar, "pddl_problem": scenes.problem_pddl(scene, goal, name),
            "solvable": True}


def traj_data(scene: scenes.Scene, goal: scenes.Goal, description: str) -> dict:
    """The minimal traj_data.json ALFWorld's loaders read (task type, goal parameters, goal text)."""
    return {"task_type": goal.task_type, "scene": {"room": scene.room},
            "pddl_params": {"object_target": goal.object_type, "parent_target": goal.receptacle_type,
                            "toggle_target": goal.toggle_type, "mrecep_target": "", "object_sliced": False},
            "turk_annotations": {"anns": [{"task_desc": description}]}}


def solve(game_file: str) -> list[str] | None:
    """The planner's plan for `game_file`, if playing it through the engine reaches the goal, else None."""
    from environments.alfworld.env import _ENGINE_LOCK, _start_engine

    with _ENGINE_LOCK:
        engine = _start_engine(game_file, expert=True)
        state = engine.reset()
    try:
        plan = list(state["policy_commands"] or [])
        for command in plan:
            if command not in state["admissible_commands"]:
                return None
            state, _, _ = engine.step(command)
        return plan if plan and state["won"] else None
    finally:
        engine.close()


def _sample(task_type: str, rng: random.Random, avoid: set) -> tuple[scenes.Scene, scenes.Goal]:
    for _ in range(200):
        scene = scenes.sample_scene(rng.choice(scenes.TASK_ROOMS[task_type]), rng)
        goal = scenes.sample_goal(task_type, scene, rng)
        if goal is not None and (goal.task_type, goal.object_type, goal.receptacle_type) not in avoid:
            return scene, goal
    raise RuntimeError(f"could not sample a new {task_type} goal in 200 tries; lower --num")


def build_generated(out: str, seed: int, num: int, test_fraction: float = 0.25, log=None) -> list[dict]:
    """Generates, verifies and writes `num` games (about `test_fraction` held out); returns the manifest."""
    if num < 1:
        raise ValueError(f"--num {num}: expected at least 1 game")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"--test-fraction {test_fraction}: expected a fraction in [0, 1)")
    num_test = round(num * test_fraction)
    counts = {"train": num - num_test, "test": num_test}
    manifest, seen = [], set()
    for split in SPLITS:
        for index in range(counts[split]):
            task_type = scenes.TASK_TYPES[index % len(scenes.TASK_TYPES)]
            rng = random.Random(f"alfworld/{seed}/{split}/{index}")
            avoid = seen if split == "test" else set()
            for attempt in range(20):
                scene, goal = _sample(task_type, rng, avoid)
                description = scenes.task_description(goal, rng)
                name = f"{task_type}-{index:04d}"
                directory = os.path.join(out, split, name)
                os.makedirs(directory, exist_ok=True)
                game_file = os.path.join(directory, "game.tw-pddl")
                with open(game_file, "w") as fh:
                    json.dump(game_data(scene, goal, description, name.replace("-", "_")), fh, indent=1)
                with open(os.path.join(directory, "traj_data.json"), "w") as fh:
                    json.dump(traj_data(scene, goal, description), fh, indent=1)
                plan = solve(game_file)
                if plan is not None:
                    break
                if log:
                    log(f"{split}/{name}: the planner found no winning plan (attempt {attempt + 1}); resampling")
            else:
                raise RuntimeError(f"{split}/{name}: no solvable {task_type} game in 20 attempts")
            if split == "train":
                seen.add((goal.task_type, goal.object_type, goal.receptacle_type))
            manifest.append({"game_file": os.path.abspath(game_file), "task_type": task_type, "split": split,
                             "expert_plan": plan, "room": scene.room, "goal": description,
                             "object": goal.object_type, "receptacle": goal.receptacle_type or goal.toggle_type})
    return manifest


def build_official(data_dir: str, num: int, log=None) -> list[dict]:
    """Manifest of the official ALFWorld games (up to `num` per split), with planner expert plans."""
    splits = {"train": "train", "dev": "valid_seen", "test": "valid_unseen"}
    manifest = []
    for split, folder in splits.items():
        root = os.path.join(data_dir, "json_2.1.1", folder)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{root} does not exist: --official must point at the ALFWorld data directory "
                                    "(the one holding json_2.1.1/)")
        taken = 0
        for directory, _, files in sorted(os.walk(root)):
            if taken >= num:
                break
            if "traj_data.json" not in files or "game.tw-pddl" not in files:
                continue
            if "movable" in directory or "Sliced" in directory:
                continue  # ALFWorld's own loader skips these too
            game_file = os.path.join(directory, "game.tw-pddl")
            with open(os.path.join(directory, "traj_data.json")) as fh:
                task_type = json.load(fh)["task_type"]
            with open(game_file) as fh:
                if not json.load(fh).get("solvable", False):
                    continue
            plan = solve(game_file)
            if plan is None:
                if log:
                    log(f"{game_file}: the planner found no winning plan; skipped")
                continue
            manifest.append({"game_file": os.path.abspath(game_file), "task_type": task_type, "split": split,
                             "expert_plan": plan})
            taken += 1
    return manifest


def official_data_dir() -> str:
    """$ALFWORLD_DATA when it holds the official data (json_2.1.1/), else ""."""
    data = os.environ.get("ALFWORLD_DATA", "")
    return data if data and os.path.isdir(os.path.join(data, "json_2.1.1")) else ""


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (manifest.json and the games)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num", type=int, default=60, help="games to generate (official: per split)")
    parser.add_argument("--test-fraction", type=float, default=0.25, help="share of held-out games")
    parser.add_argument("--official", default=official_data_dir(),
                        help="official ALFWorld data directory (holding json_2.1.1/); used instead of generating")
    args = parser.parse_args(argv)

    def log(message):
        print(f"[alfworld.build] {message}", file=sys.stderr)

    started = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    if args.official:
        manifest = build_official(args.official, args.num, log)
    else:
        manifest = build_generated(args.out, args.seed, args.num, args.test_fraction, log)
    with open(os.path.join(args.out, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
    by_split = {s: sum(1 for m in manifest if m["split"] == s) for s in ("train", "dev", "test")}
    log(f"wrote {len(manifest)} games ({by_split}) to {args.out} in {time.perf_counter() - started:.1f} s")
    return manifest


if __name__ == "__main__":
    main()
