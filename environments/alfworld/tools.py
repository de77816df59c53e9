"""ALFWorld tools (`alfworld_step`, `alfworld_admissible_commands`) and the `alfworld_reward`."""

from __future__ import annotations

from typing import Any

from agentfly_jax.rewards import reward
from agentfly_jax.tools import tool
from environments.alfworld.env import ALFWorldEnv

POOL = "alfworld"


@tool(name="alfworld_step", stateful=True, pool=POOL, timeout=60.0)
async def alfworld_step(action: str, env: ALFWorldEnv) -> dict[str, Any]:
    """Do one thing in the household (e.g. 'go to countertop 1', 'take apple 1 from countertop 1', 'open fridge 1',
    'heat apple 1 with microwave 1', 'move apple 1 to diningtable 1') and return what happens.

    Args:
      action: the command text.
    """
    result = await env.step(action)
    return {"observation": result.observation, "won": result.info.get("won", False), "done": result.done,
            "admissible": result.info.get("admissible", False)}


@tool(name="alfworld_admissible_commands", stateful=True, pool=POOL, timeout=60.0)
async def alfworld_admissible_commands(env: ALFWorldEnv) -> str:
    """List the commands that are possible right now."""
    commands = await env.admissible_commands()
    if not commands:
        return "No commands are possible (no game is running)."
    return "Admissible commands:\n" + "\n".join(commands)


@reward(name="alfworld_reward", pool=POOL)
async def alfworld_reward(env: ALFWorldEnv) -> dict[str, Any]:
    """1.0 when the game's goal was reached, else 0.0."""
    return {"reward": float(env.won), "won": env.won, "steps": env.steps}
