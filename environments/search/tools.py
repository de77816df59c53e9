"""The `search` tool: top-k Wikipedia summaries (titles + snippets) for a query, in the chain's search env."""

from __future__ import annotations

from typing import Any

from agentfly_jax.tools import tool
from environments.search.env import MAX_K, SearchEnv


@tool(name="search", stateful=True, pool="search")
async def search(query: str, env: SearchEnv, k: int = 5) -> dict[str, Any]:
    """Search Wikipedia (article summaries). Returns the best-matching article titles with the start of
    each summary.

    Args:
      query: what to look for, e.g. "painter of the Mona Lisa".
      k: how many results to return (1 to 20).
    """
    if not 1 <= k <= MAX_K:
        return {"observation": f"Error: k must be from 1 to {MAX_K}, got {k}.", "error": "bad_k"}
    result = await env.step({"query": query, "k": k})
    return {"observation": result.observation, **result.info}
