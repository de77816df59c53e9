"""ScienceWorld tools (`scienceworld_step`, `scienceworld_valid_actions`) and the `scienceworld_reward`."""

from __future__ import annotations

from typing import Any

from agentfly_jax.rewards import reward
from agentfly_jax.tools import tool
from environments.scienceworld.env import ScienceWorldEnv, score_to_reward

POOL = "scienceworld"
#: most valid actions one `scienceworld_valid_actions` call lists
MAX_LISTED_ACTIONS = 100


@tool(name="scienceworld_step", stateful=True, pool=POOL, timeout=120.0)
async def scienceworld_step(action: str, env: ScienceWorldEnv) -> dict[str, Any]:
    """Take one action in the ScienceWorld simulation (e.g. 'look around', 'open door to kitchen',
    'pick up thermometer', 'focus on water', 'wait1') and return what happens.

    Args:
      action: the action text.
    """
    result = await env.step(action)
    return {"observation": result.observation, "score": result.info.get("score"), "done": result.done,
            "invalid": result.info.get("invalid", False)}


@tool(name="scienceworld_valid_actions", stateful=True, pool=POOL, timeout=120.0)
async def scienceworld_valid_actions(env: ScienceWorldEnv, contains: str = "") -> str:
    """List the actions that are valid in the current state (at most 100; narrow the list with `contains`).

    Args:
      contains: only list actions containing this text (e.g. 'open', 'thermometer').
    """
    actions = sorted(await env.valid_actions())
    needle = contains.strip().lower()
    if needle:
        actions = [a for a in actions if needle in a.lower()]
    if not actions:
        return f"No valid action contains {contains!r}." if needle else "No valid actions."
    listed = actions[:MAX_LISTED_ACTIONS]
    more = len(actions) - len(listed)
    note = f"\n... and {more} more; narrow the list with `contains`." if more else ""
    return f"{len(actions)} valid actions:\n" + "\n".join(listed) + note


@reward(name="scienceworld_reward", pool=POOL)
async def scienceworld_reward(env: ScienceWorldEnv) -> dict[str, Any]:
    """The episode's ScienceWorld score (the package's scoring) scaled to [0, 1]."""
    return {"reward": score_to_reward(env.score), "score": round(100 * env.score), "completed": env.done
            and env.score >= 1.0, "moves": env.moves}
