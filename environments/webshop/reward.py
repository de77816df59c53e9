"""The WebShop reward, as the WebShop paper defines it (Yao et al., 2022):

    r = r_type · (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[y_price ≤ u_price]) / (|U_att| + |U_opt| + 1)

U: the goal (attributes U_att, options U_opt, price bound u_price); Y: the bought product and the options
selected when buying. r_type ∈ {0, 0.1, 0.5, 1} says how well the bought product's type matches the goal's,
from product-type text matching (see `type_reward`). Pure functions; every component is returned so it can
be logged (`info`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from environments.webshop.catalog import Goal, Product

_STOPWORDS = frozenset(
    "a an and the of for with in on to by from or is are that this it its s men women womens mens "
    "set pack count".split()
)
_TOKEN = re.compile(r"[a-z0-9]+(?:\.[0-9]+)?")


def normalize(text: str) -> str:
    """Lower case, punctuation to spaces, single spaces."""
    return " ".join(_TOKEN.findall(str(text).lower().replace("'", "")))


def content_tokens(text: str) -> set[str]:
    """Content words of `text`, singularised crudely (a trailing 's' dropped), stopwords removed."""
    tokens = set()
    for token in _TOKEN.findall(str(text).lower().replace("'", "")):
        if token in _STOPWORDS:
            continue
        if len(token) > 3 and token.endswith("s") and not token.endswith("ss"):
            token = token[:-1]
        tokens.add(token)
    return tokens


def type_reward(goal: Goal, product: Product) -> dict[str, Any]:
    """r_type from product-type text matching.

    1.0 when the product's type equals the goal's, or every content word of the goal's type is in the
    product's type or title; 0.5 when at least half of them are; 0.1 when some are, or when the product
    is in the goal's category without sharing a type word; 0.0 otherwise (a different kind of product).
    """
    goal_type = content_tokens(goal.product_type) or content_tokens(goal.title)
    product_words = content_tokens(product.product_type) | content_tokens(product.title)
    overlap = len(goal_type & product_words) / len(goal_type) if goal_type else 0.0
    same_type = bool(goal.product_type) and normalize(goal.product_type) == normalize(product.product_type)
    same_category = bool(goal.category) and normalize(goal.category) == normalize(product.category)
    if same_type or overlap == 1.0:
        r_type = 1.0
    elif overlap >= 0.5:
        r_type = 0.5
    elif overlap > 0 or same_category:
        r_type = 0.1
    else:
        r_type = 0.0
    return {"r_type": r_type, "type_overlap": overlap, "same_type": same_type, "same_category": same_category}


def attribute_matched(attribute: str, product: Product) -> bool:
    """A goal attribute is matched when the product lists it, or its title or features say it as a phrase
    ("fragrance free" in "Fragrance-Free Face Moisturizer")."""
    wanted = normalize(attribute)
    if not wanted:
        return False
    if wanted in {normalize(a) for a in product.attributes}:
        return True
    return any(f" {wanted} " in f" {normalize(text)} " for text in (product.title, *product.features))


def option_matched(value: str, selected: Iterable[str]) -> bool:
    """A goal option value is matched by a selected value that is equal after normalisation, or nearly so
    (difflib ratio ≥ 0.9, e.g. "3.4 fl oz" vs "3.4 fl. oz")."""
    wanted = normalize(value)
    for chosen in selected:
        chosen = normalize(chosen)
        if chosen == wanted or difflib.SequenceMatcher(None, chosen, wanted).ratio() >= 0.9:
            return True
    return False


def webshop_score(goal: Goal, product: Product, selected_options: Mapping[str, str]) -> dict[str, Any]:
    """The reward of buying `product` with `selected_options` ({group: value}) for `goal`, with components.

    Returns {"reward", "r_type", "r_att", "r_option", "r_price", "matched_attributes", "missing_attributes",
    "matched_options", "missing_options", "type_overlap", "same_type", "same_category", "asin_match"}; r_att,
    r_option and r_price are the matched fractions (r_price is 0 or 1), None where the goal has none.
    """
    matched_attributes = [a for a in goal.attributes if attribute_matched(a, product)]
    selected = list(selected_options.values())
    matched_options = [f"{g}: {v}" for g, v in goal.options.items() if option_matched(v, selected)]
    price_ok = product.price <= goal.price_upper
    type_part = type_reward(goal, product)
    numerator = len(matched_attributes) + len(matched_options) + int(price_ok)
    denominator = len(goal.attributes) + len(goal.options) + 1
    reward = type_part["r_type"] * numerator / denominator
    return {
        "reward": reward,
        "r_type": type_part["r_type"],
        "r_att": len(matched_attributes) / len(goal.attributes) if goal.attributes else None,
        "r_option": len(matched_options) / len(goal.options) if goal.options else None,
        "r_price": float(price_ok),
        "matched_attributes": matched_attributes,
        "missing_attributes": [a for a in goal.attributes if a not in matched_attributes],
        "matched_options": matched_options,
        "missing_options": [
            f"{g}: {v}" for g, v in goal.options.items() if f"{g}: {v}" not in matched_options
        ],
        "type_overlap": type_part["type_overlap"],
        "same_type": type_part["same_type"],
        "same_category": type_part["same_category"],
        "asin_match": product.asin == goal.asin,
    }
