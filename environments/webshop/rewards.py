"""The `webshop_reward` reward: the WebShop score of what the chain bought (0 when it bought nothing)."""

from __future__ import annotations

from typing import Any

from agentfly_jax.rewards import reward
from environments.webshop.env import WebShopEnv


@reward(name="webshop_reward", pool="webshop")
def webshop_reward(env: WebShopEnv) -> dict[str, Any]:
    """r = r_type · (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[y_price ≤ u_price]) / (|U_att| + |U_opt| + 1) of
    the chain's purchase, with its components as extras; 0.0 with `bought=False` when nothing was bought."""
    purchase = env.purchase
    if purchase is None:
        return {
            "reward": 0.0,
            "bought": False,
            "actions": env.session.actions,
            "invalid_actions": env.session.invalid_actions,
        }
    score = dict(purchase.get("score") or {})
    if "reward" not in score:
        raise ValueError(
            "the chain bought a product but its WebShop session has no goal to score against; "
            "the agent must reset the environment with a dataset row that has a 'goal'"
        )
    return {
        **score,
        "bought": True,
        "bought_asin": purchase["asin"],
        "actions": env.session.actions,
        "invalid_actions": env.session.invalid_actions,
    }
