"""WebShop dataset rows for agents and experiments: one row per goal.

A row is {"question": <what the agent is told>, "goal": <Goal dict>, "goal_id": ..., "instruction": ...};
the environment starts the goal from the row (`WebShopEnv.reset(row)`), and `webshop_reward` scores the
purchase against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from environments.webshop.catalog import Goal
from environments.webshop.shop import get_shop

QUESTION_TEMPLATE = (
    "You are shopping in an online store. Instruction: {instruction}\n"
    "Use webshop_search to search (on the search page) and webshop_click to click anything shown in "
    "brackets: a product id, an option, Next >, < Prev, Back to Search, Description, Features, Reviews "
    "or Buy Now. Pick the options the instruction asks for, then click Buy Now."
)

#: The catalog keys of a task config, passed to the environment as pool kwargs too.
CATALOG_KEYS = (
    "source",
    "seed",
    "num_products",
    "goals_per_product",
    "heldout_fraction",
    "items_path",
    "attributes_path",
    "human_goals_path",
)


def goal_row(goal: Goal) -> dict[str, Any]:
    """The dataset row of one goal."""
    return {
        "question": QUESTION_TEMPLATE.format(instruction=goal.instruction),
        "goal": goal.to_dict(),
        "goal_id": goal.goal_id,
        "instruction": goal.instruction,
    }


def catalog_config(task_config: Mapping[str, Any]) -> dict[str, Any]:
    """The catalog options in a task config (unset paths dropped)."""
    return {k: task_config[k] for k in CATALOG_KEYS if k in task_config and task_config[k] not in (None, "")}


def build_tasks(task_config: Mapping[str, Any], seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) for a task config: the catalog options plus num_train / num_eval
    (0 or absent: all goals of that split). The trainer's task family "webshop" calls this."""
    shop = get_shop(**catalog_config(task_config))
    train = [goal_row(goal) for goal in shop.catalog.train_goals]
    heldout = [goal_row(goal) for goal in shop.catalog.heldout_goals]
    num_train, num_eval = (
        task_config.get("num_train") or len(train),
        task_config.get("num_eval") or len(heldout),
    )
    return train[:num_train], heldout[:num_eval]
