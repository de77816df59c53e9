"""BFCL multi-turn function calling (Berkeley Function Calling Leaderboard, `multi_turn_base`) on its real
executable backends: a file system, a math API, messaging, posting, tickets, a trading bot, travel booking and
vehicle control.

- tasks: the multi_turn_base tasks of bfcl-eval 2026.3.23 (199 of its 200: one whose ground truth breaks its
  function docs is left out); "train" (135) / "test" (64) held out by a salted hash of the task id
  (`environments.bfcl.data`). A row holds the user turns, the initial backend config, the
  involved classes, the tool schemas of their functions and the ground-truth calls per user turn.
- environment: `BFCLEnv`, one per chain from the pool "bfcl": fresh backend instances from the task's
  `initial_config`.
- tools: one @tool per backend function (128), schemas from BFCL's function docs; the agent shows the model
  those of the task's classes.
- agent: `environments.bfcl.agent:BFCLAgent`, a tool-calling agent that delivers the next user turn when the
  model answers without a tool call, until all turns are done.
- reward `bfcl_state_match`: the fraction of user turns after which the backend state (and the results read)
  match the ground truth's, BFCL's multi-turn check (`environments.bfcl.scoring`); success is 1.0.
- demonstrations: the ground truth as conversations (tool calls, real outputs, "Done." per turn).
"""

from __future__ import annotations

from environments.bfcl.agent import BFCLAgent, system_message_with_tools
from environments.bfcl.data import NUM_TEST, SPLITS, function_docs, task_rows
from environments.bfcl.env import BFCLEnv
from environments.bfcl.policies import make_demonstrations, oracle_policy, random_policy
from environments.bfcl.tools import MAX_OBSERVATION_CHARS, POOL, bfcl_state_match, make_tools

SYSTEM_PROMPT = (
    "You are an assistant that acts by calling functions. For each user request, call the functions you "
    "need (inside <tool_call></tool_call> tags) and use their results. When the request is done, reply with "
    "a short message and no function call; the user may then ask for more."
)

POOL_CONFIG = {
    "factory": "environments.bfcl.env:BFCLEnv",
    "min_size": 0,
    "max_size": 64,
    "idle_timeout": 600.0,
    "acquire_timeout": 600.0,
}


def env_spec(*, pool_size: int = 64, max_turns: int = 24, compact_descriptions: bool = True,
             max_observation_chars: int = MAX_OBSERVATION_CHARS, random_calls_per_turn: int = 2):
    """The BFCL multi-turn environment's spec.

    pool_size: backend environments at once (cheap Python objects). max_turns: assistant turns per chain, over
    all user turns (the longest task needs 17 with one call per turn). compact_descriptions: drop the system
    blurb BFCL repeats in front of every function description (shorter prompts). max_observation_chars:
    longest tool result shown. random_calls_per_turn: the random policy's calls per user turn.
    """
    from agentfly_jax.envs.spec import EnvSpec

    def tasks(split: str, num: int, seed: int) -> list[dict]:
        rows = task_rows(split, compact_descriptions)
        if split == "train":  # a seed-dependent order of the fixed train split
            import random

            random.Random(seed).shuffle(rows)
        if num > len(rows):
            raise ValueError(f"BFCL's {split} split has {len(rows)} tasks, fewer than the {num} asked for")
        return rows if num <= 0 else rows[:num]

    return EnvSpec(
        name="bfcl",
        tasks=tasks,
        tools=make_tools(compact_descriptions, max_observation_chars),
        reward=bfcl_state_match,
        pools={POOL: dict(POOL_CONFIG, max_size=pool_size)},
        system_prompt=SYSTEM_PROMPT,
        agent="environments.bfcl.agent:BFCLAgent",
        max_turns=max_turns,
        success_threshold=1.0,
        max_observation_chars=max_observation_chars,
        splits=SPLITS,
        demonstrations=make_demonstrations(SYSTEM_PROMPT, max_observation_chars),
        oracle_policy=oracle_policy,
        random_policy=lambda task, rng: random_policy(task, rng, random_calls_per_turn),
    )


__all__ = [
    "NUM_TEST",
    "POOL",
    "POOL_CONFIG",
    "SYSTEM_PROMPT",
    "BFCLAgent",
    "BFCLEnv",
    "bfcl_state_match",
    "env_spec",
    "function_docs",
    "make_tools",
    "oracle_policy",
    "random_policy",
    "system_message_with_tools",
    "task_rows",
]
