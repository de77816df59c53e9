"""The text-mode shop: pages, the action grammar and one shopper's session.

Pages and actions are WebShop's:

- search page: `search[query]`;
- results page (10 per page, at most 50 results): `click[<asin>]`, `click[Next >]`, `click[< Prev]`,
  `click[Back to Search]`;
- item page: `click[<option value>]` (selects it in its group), `click[Description]`, `click[Features]`,
  `click[Reviews]`, `click[Buy Now]`, `click[< Prev]` (back to the results), `click[Back to Search]`;
- description / features / reviews pages: `click[< Prev]` (back to the item), `click[Back to Search]`;
- after `click[Buy Now]` the episode is over and the reward is computed (see `reward.webshop_score`).

Clickable things are shown in brackets. Button names match case-insensitively. An action that is not
available on the current page leaves the page as it is and the observation says why and what is available.

    shop = Shop(catalog)
    session = ShopSession(shop, goal)
    text = session.observation()
    outcome = session.act("search[face moisturizer]")   # ActionOutcome(observation, reward, done, info)
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections.abc import Sequence
from typing import Any

from environments.search.bm25 import Bm25
from environments.webshop.catalog import Catalog, Goal, Product
from environments.webshop.reward import webshop_score

RESULTS_PER_PAGE = 10
MAX_RESULTS = 50

BACK_TO_SEARCH = "Back to Search"
NEXT_PAGE = "Next >"
PREV_PAGE = "< Prev"
BUY_NOW = "Buy Now"
DETAIL_PAGES = ("Description", "Features", "Reviews")

_ACTION = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)


def parse_action(action: str) -> tuple[str, str] | None:
    """("search" | "click", argument) from `search[...]` / `click[...]`, or None when malformed."""
    match = _ACTION.match(str(action))
    if match is None:
        return None
    return match.group(1).lower(), match.group(2).strip()


def product_search_text(product: Product) -> str:
    """What the product search indexes: title, type, category, attributes, features and option values."""
    options = " ".join(value for values in product.options.values() for value in values)
    return " ".join(
        (
            product.title,
            product.product_type,
            product.category.replace("›", " "),
            " ".join(product.attributes),
            " ".join(product.features),
            options,
        )
    )


class Shop:
    """A catalog with its product search; shared (read-only) by every session of a process."""

    def __init__(self, catalog: Catalog):
        if not catalog.products:
            raise ValueError("the WebShop catalog has no products")
        self.catalog = catalog
        self.products = catalog.products
        self.by_asin = catalog.by_asin()
        self._asin_lookup = {asin.lower(): asin for asin in self.by_asin}
        self._index = Bm25.build([product_search_text(p) for p in self.products])

    def search(self, query: str, limit: int = MAX_RESULTS) -> list[str]:
        """Asins of the best-matching products (BM25), best first, at most `limit`."""
        return [self.products[i].asin for i, _ in self._index.search(query, k=limit)]

    def find_asin(self, text: str) -> str | None:
        return self._asin_lookup.get(text.strip().lower())


@dataclasses.dataclass
class ActionOutcome:
    """What one action did: the new observation, the reward (set when the episode ends), done, details."""

    observation: str
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class ShopSession:
    """One shopper's pass through the shop for one goal; `act(action)` moves between pages."""

    def __init__(self, shop: Shop, goal: Goal | None = None):
        self.shop = shop
        self.goal = goal
        self.page = "search"  # search | results | item | detail | done
        self.query = ""
        self.results: list[str] = []
        self.page_number = 1
        self.asin: str | None = None
        self.detail = ""
        self.selected: dict[str, str] = {}
        self.purchase: dict[str, Any] | None = None
        self.actions = 0
        self.invalid_actions = 0
        self.searches = 0

    # ------------------------------------------------------------------------------------------- pages

    @property
    def num_pages(self) -> int:
        return max(1, math.ceil(len(self.results) / RESULTS_PER_PAGE))

    def available_actions(self) -> list[str]:
        """Every action valid on the current page, written as the agent would write it."""
        if self.page == "search":
            return ["search[<query>]"]
        if self.page == "results":
            actions = [f"click[{BACK_TO_SEARCH}]"]
            if self.page_number > 1:
                actions.append(f"click[{PREV_PAGE}]")
            if self.page_number < self.num_pages:
                actions.append(f"click[{NEXT_PAGE}]")
            return actions + [f"click[{asin}]" for asin in self._page_asins()]
        if self.page == "item":
            product = self.shop.by_asin[self.asin]
            options = [f"click[{value}]" for values in product.options.values() for value in values]
            return (
                [f"click[{BACK_TO_SEARCH}]", f"click[{PREV_PAGE}]"]
                + options
                + [f"click[{name}]" for name in DETAIL_PAGES]
                + [f"click[{BUY_NOW}]"]
            )
        if self.page == "detail":
            return [f"click[{BACK_TO_SEARCH}]", f"click[{PREV_PAGE}]"]
        return []

    def _page_asins(self) -> list[str]:
        start = (self.page_number - 1) * RESULTS_PER_PAGE
        return self.results[start : start + RESULTS_PER_PAGE]

    def observation(self) -> str:
        """The current page as text."""
        head = f"Instruction: {self.goal.instruction}\n" if self.goal is not None else ""
        if self.page == "search":
            return head + "[Search page] Type search[<your query>] to look for products."
        if self.page == "results":
            lines = [f"[{BACK_TO_SEARCH}]"]
            if not self.results:
                lines.append(f'No results for "{self.query}". Click [{BACK_TO_SEARCH}] and try other words.')
                return head + "\n".join(lines)
            lines.append(
                f'Results for "{self.query}": page {self.page_number} of {self.num_pages} '
                f"(total results: {len(self.results)})"
            )
            buttons = []
            if self.page_number > 1:
                buttons.append(f"[{PREV_PAGE}]")
            if self.page_number < self.num_pages:
                buttons.append(f"[{NEXT_PAGE}]")
            if buttons:
                lines.append(" ".join(buttons))
            for asin in self._page_asins():
                product = self.shop.by_asin[asin]
                lines.append(f"[{asin}] {product.title}\n  ${product.price:.2f}")
            return head + "\n".join(lines)
        product = self.shop.by_asin[self.asin] if self.asin else None
        if self.page == "item":
            lines = [
                f"[{BACK_TO_SEARCH}] [{PREV_PAGE}]",
                product.title,
                f"Price: ${product.price:.2f}",
                f"Rating: {product.rating if product.rating is not None else 'N.A.'}",
            ]
            for group, values in product.options.items():
                lines.append(f"{group}: " + " ".join(f"[{value}]" for value in values))
            if self.selected:
                lines.append("Selected: " + ", ".join(f"{g} = {v}" for g, v in self.selected.items()))
            lines.append(" ".join(f"[{name}]" for name in (*DETAIL_PAGES, BUY_NOW)))
            return head + "\n".join(lines)
        if self.page == "detail":
            if self.detail == "Description":
                body = product.description or "(no description)"
            elif self.detail == "Features":
                body = "\n".join(f"- {feature}" for feature in product.features) or "(no features listed)"
            else:
                body = "\n".join(f"- {review}" for review in product.reviews) or "(no reviews yet)"
            return head + f"[{BACK_TO_SEARCH}] [{PREV_PAGE}]\n{product.title} — {self.detail}\n{body}"
        bought = self.purchase or {}
        options = ", ".join(f"{g} = {v}" for g, v in bought.get("options", {}).items()) or "no options"
        return (
            f"Thank you for shopping with us! You bought [{bought.get('asin')}] {bought.get('title')} "
            f"({options}) for ${bought.get('price', 0):.2f}. The episode is over."
        )

    # ----------------------------------------------------------------------------------------- actions

    def act(self, action: str) -> ActionOutcome:
        """Applies one `search[...]` / `click[...]` action; an unavailable one changes nothing."""
        self.actions += 1
        if self.page == "done":
            return self._invalid(action, "the episode is over: you already bought a product")
        parsed = parse_action(action)
        if parsed is None:
            return self._invalid(action, "actions are written search[<query>] or click[<button>]")
        kind, argument = parsed
        if kind == "search":
            if self.page != "search":
                return self._invalid(
                    action, f"search is only available on the search page; click [{BACK_TO_SEARCH}] first"
                )
            if not argument:
                return self._invalid(action, "the search query is empty")
            self.searches += 1
            self.query = argument
            self.results = self.shop.search(argument, MAX_RESULTS)
            self.page, self.page_number = "results", 1
            return self._moved()
        return self._click(action, argument)

    def _click(self, action: str, target: str) -> ActionOutcome:
        name = target.strip().lower()
        if self.page == "search":
            return self._invalid(action, "there is nothing to click on the search page; use search[<query>]")
        if name == BACK_TO_SEARCH.lower():
            self.page, self.asin, self.selected, self.detail = "search", None, {}, ""
            return self._moved()
        if self.page == "results":
            if name == NEXT_PAGE.lower() and self.page_number < self.num_pages:
                self.page_number += 1
                return self._moved()
            if name == PREV_PAGE.lower() and self.page_number > 1:
                self.page_number -= 1
                return self._moved()
            asin = self.shop.find_asin(target)
            if asin is not None and asin in self._page_asins():
                self.page, self.asin, self.selected = "item", asin, {}
                return self._moved()
            return self._invalid(action, f"'{target}' is not a button or a product on this results page")
        if self.page == "item":
            product = self.shop.by_asin[self.asin]
            if name == PREV_PAGE.lower():
                self.page, self.asin, self.selected = "results", None, {}
                return self._moved()
            if name == BUY_NOW.lower():
                return self._buy(product)
            for detail in DETAIL_PAGES:
                if name == detail.lower():
                    self.page, self.detail = "detail", detail
                    return self._moved()
            for group, values in product.options.items():
                for value in values:
                    if name == value.lower():
                        self.selected[group] = value
                        return self._moved()
            return self._invalid(action, f"'{target}' is not an option or a button of this item")
        if self.page == "detail" and name == PREV_PAGE.lower():
            self.page, self.detail = "item", ""
            return self._moved()
        return self._invalid(action, f"'{target}' is not a button on this page")

    def _buy(self, product: Product) -> ActionOutcome:
        self.purchase = {
            "asin": product.asin,
            "title": product.title,
            "price": product.price,
            "options": dict(self.selected),
        }
        self.page = "done"
        info: dict[str, Any] = {"purchase": dict(self.purchase)}
        reward = None
        if self.goal is not None:
            score = webshop_score(self.goal, product, self.selected)
            info.update(score)
            reward = score["reward"]
        self.purchase["score"] = {k: v for k, v in info.items() if k != "purchase"}
        return ActionOutcome(self.observation(), reward=reward, done=True, info=self._info(info))

    def _moved(self) -> ActionOutcome:
        return ActionOutcome(self.observation(), info=self._info({}))

    def _invalid(self, action: str, why: str) -> ActionOutcome:
        self.invalid_actions += 1
        available = ", ".join(self.available_actions()) or "none"
        shown = str(action).strip()
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        text = f"Invalid action {shown!r}: {why}. Available actions: {available}.\n\n{self.observation()}"
        return ActionOutcome(text, done=self.page == "done", info=self._info({"invalid": True, "why": why}))

    def _info(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "page": self.page,
            "actions": self.actions,
            "invalid_actions": self.invalid_actions,
            "searches": self.searches,
            **extra,
        }


# ----------------------------------------------------------------------------------------------------------
# One shop per catalog configuration per process
# ----------------------------------------------------------------------------------------------------------

_SHOPS: dict[tuple, Shop] = {}
_SHOPS_LOCK = threading.Lock()


def catalog_from_config(
    source: str = "generated",
    seed: int = 0,
    num_products: int = 1000,
    goals_per_product: int = 1,
    heldout_fraction: float = 0.1,
    items_path: str | None = None,
    attributes_path: str | None = None,
    human_goals_path: str | None = None,
) -> Catalog:
    """The catalog a config names: source "generated" (seeded) or "official" (the WebShop files)."""
    from environments.webshop.catalog import generate_catalog, load_official_catalog

    if source == "generated":
        return generate_catalog(seed, num_products, goals_per_product, heldout_fraction)
    if source == "official":
        if not items_path or not attributes_path:
            raise ValueError(
                "the official WebShop catalog needs items_path and attributes_path "
                "(items_shuffle*.json and items_ins_v2*.json)"
            )
        return load_official_catalog(
            items_path, attributes_path, human_goals_path, seed=seed, heldout_fraction=heldout_fraction
        )
    raise ValueError(f"unknown WebShop catalog source {source!r}; expected 'generated' or 'official'")


def get_shop(**catalog_config: Any) -> Shop:
    """The process-wide Shop for a catalog config (built once; thread-safe)."""
    key = tuple(sorted(catalog_config.items()))
    with _SHOPS_LOCK:
        shop = _SHOPS.get(key)
        if shop is None:
            shop = _SHOPS[key] = Shop(catalog_from_config(**catalog_config))
        return shop


def goal_of(task: Any) -> Goal | None:
    """The goal in a dataset row ({"goal": {...}}), a goal dict, a Goal, or None."""
    if task is None or isinstance(task, Goal):
        return task
    if isinstance(task, dict) and "goal" in task:
        task = task["goal"]
    if isinstance(task, dict):
        return Goal.from_dict(task)
    raise TypeError(
        f"a WebShop task is a dataset row with a 'goal' dict or a goal dict, got {type(task).__name__}"
    )


def page_asins(observation: str) -> Sequence[str]:
    """The product ids listed on a results-page observation (for agents and tests)."""
    return re.findall(r"^\[([A-Z0-9]{10})\] ", observation, re.MULTILINE)
