"""WebShop's EnvSpec (agentfly_jax.envs.spec): goal rows by split, the tools, the reward, the pool, and the
oracle / random shoppers as scripted policies.

Splits: "train" (train goals) and "dev" / "test" (the held-out goals, first and second half): held-out goals
ask for products no train goal names. `num` rows are a seeded sample of the split (`num <= 0`: all of it, in
a seeded order; more than the split holds: all of it).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from environments.webshop.catalog import Goal
from environments.webshop.oracle import OracleShopper, RandomShopper
from environments.webshop.shop import parse_action
from environments.webshop.tasks import goal_row

SYSTEM_PROMPT = (
    "You are a shopping assistant in an online store. Find the product the instruction describes: search on "
    "the search page with webshop_search, open products, pick the options the instruction asks for and buy "
    "with webshop_click (targets are the texts shown in brackets: product ids, option values, Next >, "
    "< Prev, "
    "Back to Search, Description, Features, Reviews, Buy Now). Buying ends the episode."
)


def _call(action: str) -> dict[str, Any]:
    parsed = parse_action(action)
    if parsed is None:  # the scripted shoppers only write well-formed actions
        raise ValueError(f"scripted shopper wrote a malformed action {action!r}")
    kind, argument = parsed
    if kind == "search":
        return {"name": "webshop_search", "arguments": {"query": argument}}
    return {"name": "webshop_click", "arguments": {"target": argument}}


def _shop_until_done(shopper, max_actions: int):
    observation = "[Search page]"  # the page every episode starts on
    for _ in range(max_actions):
        observation = yield _call(shopper.act(observation))
        if "The episode is over" in observation or "episode is over" in observation:
            break
    return "I have finished shopping."


def oracle_policy(task: Mapping[str, Any], rng: random.Random, max_actions: int = 40):
    """Searches, pages, opens the goal's product, selects its options and buys (see OracleShopper)."""
    return (yield from _shop_until_done(OracleShopper(Goal.from_dict(task["goal"])), max_actions))


def random_policy(task: Mapping[str, Any], rng: random.Random, max_actions: int = 15):
    """Random available actions until it buys or runs out of actions."""
    return (yield from _shop_until_done(RandomShopper(rng.randrange(2**31)), max_actions))


def env_spec(
    *,
    source: str = "generated",
    seed: int = 0,
    num_products: int = 1000,
    items_path: str = "",
    attributes_path: str = "",
    human_goals_path: str = "",
    max_actions: int = 50,
    max_turns: int = 45,
    pool_size: int = 64,
    random_steps: int = 15,
    demo_tasks: int = 256,
):
    """The WebShop environment's spec. The options name the catalog: source "generated" (seed, num_products)
    or "official" (items_path, attributes_path, human_goals_path: the WebShop data files); the pool's shops
    use the same catalog. max_actions: shop actions per episode; random_steps: the random shopper's actions; demo_tasks: train goals the oracle and random shoppers are
    recorded on for SFT demonstrations (`environments.evaluation.recorded_demonstrations`)."""
    options = dict(locals())  # this spec's options: recorded demonstrations rebuild the same spec
    from environments.evaluation import recorded_demonstrations
    from agentfly_jax.envs.spec import EnvSpec
    from environments.webshop import POOL_CONFIG
    from environments.webshop.rewards import webshop_reward
    from environments.webshop.shop import get_shop
    from environments.webshop.tasks import catalog_config
    from environments.webshop.tools import webshop_click, webshop_search

    catalog = catalog_config(
        {
            "source": source,
            "seed": seed,
            "num_products": num_products,
            "items_path": items_path,
            "attributes_path": attributes_path,
            "human_goals_path": human_goals_path,
        }
    )
    pool = dict(POOL_CONFIG, kwargs=dict(catalog, max_actions=max_actions), max_size=pool_size)

    def tasks(split: str, num: int, task_seed: int) -> list[dict]:
        shop = get_shop(**catalog)
        heldout = list(shop.catalog.heldout_goals)
        goals = {
            "train": list(shop.catalog.train_goals),
            "dev": heldout[: len(heldout) // 2],
            "test": heldout[len(heldout) // 2 :],
        }
        if split not in goals:
            raise ValueError(f"unknown WebShop split {split!r}; expected one of {sorted(goals)}")
        rows = goals[split]
        size = len(rows) if num <= 0 else min(num, len(rows))
        chosen = random.Random(f"webshop-{split}-{task_seed}").sample(rows, size)
        return [goal_row(goal) for goal in chosen]

    return EnvSpec(
        name="webshop",
        tasks=tasks,
        tools=[webshop_search, webshop_click],
        reward=webshop_reward,
        pools={"webshop": pool},
        oracle_policy=lambda task, rng: oracle_policy(task, rng, max_actions=max_turns - 1),
        random_policy=lambda task, rng: random_policy(task, rng, random_steps),
        demonstrations=recorded_demonstrations(lambda: env_spec(**options), max_tasks=demo_tasks),
        system_prompt=SYSTEM_PROMPT,
        agent="tool_calling",
        max_turns=max_turns,
        success_threshold=1.0,
        splits=("train", "dev", "test"),
    )
