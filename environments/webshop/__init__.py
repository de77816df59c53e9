"""WebShop-compatible shopping environment: a text-mode shop over a product catalog, with WebShop's pages,
actions and reward.

No WebShop data can be had offline here, so the catalog is generated (`generate_catalog`: categories, titles,
attributes, option groups, prices, and train / held-out goals with verifiable targets); the official
`items_*.json` and goal files are loaded instead when configured (`load_official_catalog`, task/pool option
`source="official"`). The shop: `Shop`, `ShopSession` (pages and the `search[...]` / `click[...]` grammar),
`WebShopEnv` (the async environment); the reward: `webshop_score` (pure) and the `webshop_reward` @reward;
the tools `webshop_search` and `webshop_click` (in `environments.webshop.tools`); scripted shoppers in
`environments.webshop.oracle`; dataset rows in `environments.webshop.tasks`; an HTTP front end in
`environments.webshop.server`; the environment's EnvSpec, `env_spec(**options)`, in
`environments.webshop.evaluation`.
"""

from environments.webshop.catalog import (
    Catalog,
    Goal,
    Product,
    build_goals,
    generate_catalog,
    generate_products,
    load_official_catalog,
)
from environments.webshop.env import WebShopEnv, create_webshop_env
from environments.webshop.evaluation import env_spec
from environments.webshop.reward import type_reward, webshop_score
from environments.webshop.shop import Shop, ShopSession, get_shop, parse_action

#: Resource-manager pool config for this environment (override any field, or the catalog kwargs, in the
#: experiment config; the kwargs must name the same catalog as the task config).
POOL_CONFIG = {
    "factory": "environments.webshop.env:create_webshop_env",
    "kwargs": {"source": "generated", "seed": 0, "num_products": 1000, "max_actions": 50},
    "min_size": 0,
    "max_size": 64,
    "idle_timeout": 300.0,
    "acquire_timeout": 300.0,
}

__all__ = [
    "Catalog",
    "Goal",
    "POOL_CONFIG",
    "Product",
    "Shop",
    "ShopSession",
    "WebShopEnv",
    "build_goals",
    "create_webshop_env",
    "env_spec",
    "generate_catalog",
    "generate_products",
    "get_shop",
    "load_official_catalog",
    "parse_action",
    "type_reward",
    "webshop_score",
]
