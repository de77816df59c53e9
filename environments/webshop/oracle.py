"""Scripted shoppers that read only the page text (the oracle also the goal): baselines and test drivers.

- `OracleShopper(goal)`: searches for the goal's product type, pages through the results looking for the
  goal's product, falls back to searching its title, selects the goal's options and buys. It knows which
  product the goal was written from, so it reaches reward 1.0 whenever the shop works as specified.
- `RandomShopper(seed)`: a uniformly random available action on each page (a lower bound).
"""

from __future__ import annotations

import random
import re

from environments.webshop.catalog import Goal
from environments.webshop.shop import BACK_TO_SEARCH, BUY_NOW, DETAIL_PAGES, NEXT_PAGE, PREV_PAGE, page_asins


def page_kind(observation: str) -> str:
    """Which page an observation shows: search | results | item | detail | done | invalid."""
    if observation.startswith("Invalid action"):
        return "invalid"
    if "[Search page]" in observation:
        return "search"
    if observation.startswith("Thank you for shopping") or "The episode is over" in observation:
        return "done"
    if f"[{BUY_NOW}]" in observation:
        return "item"
    if "Results for " in observation or "No results for " in observation:
        return "results"
    return "detail"


def selected_options(observation: str) -> dict[str, str]:
    """{group: value} from an item page's "Selected: g = v, ..." line."""
    match = re.search(r"^Selected: (.*)$", observation, re.MULTILINE)
    if not match:
        return {}
    pairs = [part.split(" = ", 1) for part in match.group(1).split(", ") if " = " in part]
    return {group: value for group, value in pairs}


class OracleShopper:
    """Finds and buys the goal's product with the goal's options; see the module docstring."""

    def __init__(self, goal: Goal, queries: list[str] | None = None):
        self.goal = goal
        self.queries = queries or [goal.product_type or goal.title, goal.title]
        self.query_index = 0
        self.pages_turned = 0
        self.searches = 0

    def act(self, observation: str) -> str:
        """The next action (`search[...]` / `click[...]`) given the current page text."""
        kind = page_kind(observation)
        if kind == "invalid":  # the page follows the error message
            kind = page_kind(observation.split("\n\n", 1)[-1])
        if kind == "search":
            query = self.queries[min(self.query_index, len(self.queries) - 1)]
            self.query_index += 1
            self.searches += 1
            return f"search[{query}]"
        if kind == "results":
            if self.goal.asin in page_asins(observation):
                return f"click[{self.goal.asin}]"
            if f"[{NEXT_PAGE}]" in observation:
                self.pages_turned += 1
                return f"click[{NEXT_PAGE}]"
            return f"click[{BACK_TO_SEARCH}]"
        if kind == "item":
            chosen = selected_options(observation)
            for group, value in self.goal.options.items():
                if chosen.get(group) != value:
                    return f"click[{value}]"
            return f"click[{BUY_NOW}]"
        if kind == "detail":
            return f"click[{PREV_PAGE}]"
        return f"click[{BUY_NOW}]"  # done: any action; the shop answers that the episode is over


class RandomShopper:
    """A random available action per page (searching with random words from the instruction)."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def act(self, observation: str) -> str:
        kind = page_kind(observation)
        if kind == "invalid":
            kind = page_kind(observation.split("\n\n", 1)[-1])
        if kind == "search":
            match = re.search(r"^Instruction: (.*)$", observation, re.MULTILINE)
            words = (match.group(1) if match else "product").split()
            return f"search[{' '.join(self.rng.sample(words, min(3, len(words))))}]"
        buttons = re.findall(r"\[([^\[\]\n]+)\]", observation.split("\n", 1)[-1])
        buttons = [b for b in buttons if b not in ("Search page",)] or [BACK_TO_SEARCH]
        if kind == "item" and self.rng.random() < 0.3:
            return f"click[{BUY_NOW}]"
        return f"click[{self.rng.choice(buttons)}]"


__all__ = ["OracleShopper", "RandomShopper", "page_kind", "selected_options", "DETAIL_PAGES"]
