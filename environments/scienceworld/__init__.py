"""ScienceWorld on its real engine: `ScienceWorldEnv` (one JVM per instance), task rows by split, the
`scienceworld_step` / `scienceworld_valid_actions` tools, the `scienceworld_reward`, and `env_spec` (the
environment's EnvSpec).

    from environments.scienceworld import ScienceWorldEnv
    env = ScienceWorldEnv()
    obs = await env.reset({"task_name": "boil", "variation": 21})
    result = await env.step("look around")          # StepResult(observation, reward, done, info)
    await env.close()

Needs the `scienceworld` package and Java 17 (`pip install -e '.[envs]'`, `bash scripts/setup_envs.sh`).
"""

from __future__ import annotations

import re

from environments.scienceworld.engine import DEFAULT_JVM_OPTIONS, Engine, EngineCrashedError
from environments.scienceworld.env import ScienceWorldEnv, parse_task, score_to_reward
from environments.scienceworld.tasks import (
    TaskRows,
    build_tasks,
    catalog,
    choose_variations,
    describe,
    task_names,
    variations,
)
from environments.scienceworld.tools import (
    POOL,
    scienceworld_reward,
    scienceworld_step,
    scienceworld_valid_actions,
)

#: Resource-manager pool config (override any field in the experiment config). One JVM (≈ 250 MB) each.
POOL_CONFIG = {
    "factory": "environments.scienceworld.env:ScienceWorldEnv",
    "kwargs": {"jvm_options": DEFAULT_JVM_OPTIONS, "max_steps": 100},
    "min_size": 0,
    "max_size": 4,
    "idle_timeout": 600.0,
    "acquire_timeout": 600.0,
    "create_timeout": 120.0,
    "reset_timeout": 60.0,
}

SYSTEM_PROMPT = (
    "You are an agent in ScienceWorld, a text-based simulation of an elementary-school science lab and its "
    "surroundings. Complete the task by acting in the world with scienceworld_step (one action per call, e.g. "
    "'look around', 'open door to kitchen', 'go to kitchen', 'pick up thermometer', 'focus on <the thing the "
    "task names>', 'wait1'). Focus only on what the task asks you to focus on: focusing on the wrong thing "
    "fails the task. scienceworld_valid_actions lists what is possible now. When the task is done, give a "
    "short final answer."
)

#: Tasks whose package gold paths solve their test variations within 100 steps (checked by the tests and
#: `scripts/eval_env.py --env scienceworld --agent oracle`); the default evaluation set.
EVAL_TASK_NAMES = (
    "chemistry-mix-paint-secondary-color",
    "find-animal",
    "find-living-thing",
    "find-non-living-thing",
    "find-plant",
    "lifespan-longest-lived",
    "lifespan-shortest-lived",
    "power-component",
    "test-conductivity",
    "use-thermometer",
)

# Verbs the random policy draws from before picking one of the matching valid actions.
_RANDOM_VERBS = ("open", "close", "go to", "pick up", "move", "look at", "activate", "deactivate", "focus on",
                 "pour", "mix", "wait", "connect", "eat", "use")
_LISTED = re.compile(r"^\d+ valid actions:\n", re.MULTILINE)


def oracle_policy(task, rng):
    """Plays the package's gold path for the task (the row's `gold_actions`, else generated now)."""
    gold = task.get("gold_actions")
    if gold is None:
        gold = describe(task["task_name"], task["variation"], True)[1]
    for action in gold:
        observation = yield {"name": "scienceworld_step", "arguments": {"action": action}}
        if observation.startswith("[environment restarted]"):  # the action was not applied: send it again
            observation = yield {"name": "scienceworld_step", "arguments": {"action": action}}
        if "[The task is" in observation:
            break
    return "Done."


def random_policy(task, rng, steps: int = 20):
    """Random valid actions: a random verb, then a random valid action containing it (`steps` of them)."""
    for _ in range(steps):
        verb = rng.choice(_RANDOM_VERBS)
        listing = yield {"name": "scienceworld_valid_actions", "arguments": {"contains": verb}}
        actions = [line for line in listing.split("\n")[1:] if line and not line.startswith("...")]
        action = rng.choice(actions) if _LISTED.match(listing) and actions else "look around"
        observation = yield {"name": "scienceworld_step", "arguments": {"action": action}}
        if "[The task is" in observation:
            break
    return "Done."


def _task_name_list(task_names: str | list[str]) -> list[str] | None:
    """The task names an option names: "eval" (EVAL_TASK_NAMES), "all" (None: every task), comma-separated
    names ("boil,melt") or a list."""
    if task_names == "eval":
        return list(EVAL_TASK_NAMES)
    if task_names == "all":
        return None
    names = [n.strip() for n in task_names.split(",") if n.strip()] if isinstance(task_names, str) else list(task_names)
    if not names:
        raise ValueError("task_names is empty; give 'eval', 'all', comma-separated task names or a list")
    return names


def env_spec(*, task_names: str | list[str] = "eval", max_steps: int = 100, max_turns: int = 101,
             pool_size: int = 4, random_steps: int = 20, demo_tasks: int = 48):
    """The ScienceWorld environment's spec.

    task_names: "eval" (EVAL_TASK_NAMES), "all" (the simulator's 30 tasks), comma-separated names
    ("boil,melt") or a list. max_steps: moves per episode; max_turns: assistant turns per chain (the oracle
    needs gold length + 1); pool_size: simulators (JVMs) at once; random_steps: the random policy's moves;
    demo_tasks: train variations the scripted policies are recorded on for SFT demonstrations.

    Rows are `TaskRows` of (task, variation) pairs of the package's train / dev / test variations, round-robin
    over the tasks (`build_tasks`): a row's description is read from the simulator when it is first indexed,
    so asking for thousands of rows costs nothing up front. `num <= 0` asks for every variation of the split.
    """
    options = dict(locals())  # this spec's options: recorded demonstrations rebuild the same spec
    from environments.evaluation import recorded_demonstrations
    from agentfly_jax.envs.spec import EnvSpec

    names = _task_name_list(task_names)
    pool = dict(POOL_CONFIG, kwargs=dict(POOL_CONFIG["kwargs"], max_steps=max_steps), max_size=pool_size)

    def tasks(split: str, num: int, seed: int) -> TaskRows:
        if num <= 0:
            num = sum(len(variations(name, split)) for name in (names or catalog()["task_names"]))
        return build_tasks(split, num, seed, task_names=names, lazy=True)

    return EnvSpec(
        name="scienceworld",
        tasks=tasks,
        tools=[scienceworld_step, scienceworld_valid_actions],
        reward=scienceworld_reward,
        pools={POOL: pool},
        oracle_policy=oracle_policy,
        random_policy=lambda task, rng: random_policy(task, rng, random_steps),
        demonstrations=recorded_demonstrations(lambda: env_spec(**options), max_tasks=demo_tasks),
        system_prompt=SYSTEM_PROMPT,
        agent="react",
        max_turns=max_turns,
        success_threshold=1.0,
        splits=("train", "dev", "test"),
    )


__all__ = [
    "DEFAULT_JVM_OPTIONS",
    "EVAL_TASK_NAMES",
    "Engine",
    "EngineCrashedError",
    "POOL",
    "POOL_CONFIG",
    "SYSTEM_PROMPT",
    "ScienceWorldEnv",
    "TaskRows",
    "build_tasks",
    "catalog",
    "choose_variations",
    "describe",
    "env_spec",
    "oracle_policy",
    "parse_task",
    "random_policy",
    "score_to_reward",
    "scienceworld_reward",
    "scienceworld_step",
    "scienceworld_valid_actions",
    "task_names",
    "variations",
]
