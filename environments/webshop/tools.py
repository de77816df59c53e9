"""WebShop tools: `webshop_search(query)` and `webshop_click(target)` act in the chain's shop session."""

from __future__ import annotations

from typing import Any

from agentfly_jax.tools import tool
from environments.webshop.env import WebShopEnv


def _result(step) -> dict[str, Any]:
    extras = {"page": step.info.get("page"), "done": step.done}
    if step.reward is not None:
        extras["reward"] = step.reward
    return {"observation": step.observation, **extras}


@tool(name="webshop_search", stateful=True, pool="webshop")
async def webshop_search(query: str, env: WebShopEnv) -> dict[str, Any]:
    """Search the shop for products (only on the search page). Returns a page of results with product ids.

    Args:
      query: what to search for, e.g. "paraben free face moisturizer".
    """
    return _result(await env.step(f"search[{query}]"))


@tool(name="webshop_click", stateful=True, pool="webshop")
async def webshop_click(target: str, env: WebShopEnv) -> dict[str, Any]:
    """Click a button or link shown in brackets on the current page: a product id, an option value,
    "Next >", "< Prev", "Back to Search", "Description", "Features", "Reviews" or "Buy Now". Buying ends
    the episode.

    Args:
      target: the text inside the brackets, e.g. "B07XK3M2QP", "2 ounce" or "Buy Now".
    """
    return _result(await env.step(f"click[{target}]"))
