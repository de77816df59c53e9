"""The WebShop environment: one shopper session per chain over a shared, process-wide shop.

    env = WebShopEnv(source="generated", seed=0, num_products=1000)
    first = await env.reset({"goal": goal.to_dict(), "question": ...})   # the search page
    result = await env.step("search[face moisturizer paraben free]")     # StepResult
    ...
    result = await env.step("click[Buy Now]")  # done=True, the WebShop reward, its components in info

The shop (catalog + BM25 product search) is built once per process per catalog config and shared
read-only; an env holds only its session. Environments come from a resource-manager pool (`POOL_CONFIG`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentfly_jax.envs.base import Environment, StepResult
from environments.webshop.shop import Shop, ShopSession, get_shop, goal_of


class WebShopEnv(Environment):
    """A WebShop session; `reset(task)` starts a goal (the dataset row's `goal`), `step(action)` acts.

    Catalog options (the same ones build the dataset's goals): source ("generated" | "official"), seed,
    num_products, goals_per_product, heldout_fraction, items_path, attributes_path, human_goals_path.
    max_actions: actions after which the episode ends without a purchase (reward 0).
    """

    def __init__(self, *, max_actions: int = 50, shop: Shop | None = None, **catalog_config: Any):
        if max_actions < 1:
            raise ValueError(f"max_actions={max_actions}; expected at least 1")
        self.max_actions = max_actions
        self.shop = shop if shop is not None else get_shop(**catalog_config)
        self.session = ShopSession(self.shop)
        self.episodes = 0

    async def reset(self, task: Any = None) -> str:
        """A new session on the search page, for the goal in `task` (None: no goal, e.g. between chains)."""
        goal = goal_of(task)
        if goal is not None and goal.asin and goal.asin not in self.shop.by_asin:
            raise ValueError(f"goal product {goal.asin!r} is not in this environment's catalog: the tasks and the "
                             "webshop pool were built from different catalogs (config.task and "
                             "config.envs.webshop.kwargs must name the same one)")
        self.session = ShopSession(self.shop, goal)
        self.episodes += task is not None
        return self.session.observation()

    async def step(self, action: Any) -> StepResult:
        """One `search[...]` / `click[...]` action (a dict {"action": ...} works too)."""
        text = action.get("action", "") if isinstance(action, dict) else str(action)
        if self.session.actions >= self.max_actions and self.session.page != "done":
            return StepResult(
                observation=f"The action limit ({self.max_actions}) is reached; the episode is over without "
                "a purchase.",
                reward=0.0,
                done=True,
                info={"page": self.session.page, "action_limit": True},
            )
        outcome = self.session.act(text)
        return StepResult(outcome.observation, outcome.reward, outcome.done, outcome.info)

    @property
    def purchase(self) -> dict[str, Any] | None:
        """What was bought in this episode ({"asin", "title", "price", "options", "score"}), else None."""
        return self.session.purchase

    async def health(self) -> bool:
        return True


async def create_webshop_env(**kwargs: Any) -> WebShopEnv:
    """Pool factory: builds the shared shop in a worker thread the first time, so the event loop runs on."""
    return await asyncio.to_thread(WebShopEnv, **kwargs)
