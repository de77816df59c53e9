"""WebShop-compatible environment: the reward against hand-computed cases, the page/action grammar, the
catalog and goals, the official-file loader, and an oracle shopper buying held-out goals through the tools
and the resource manager (64 concurrent chains) and through a ToolCallingAgent."""

import asyncio
import html
import json

import pytest

from agentfly_jax.envs import ResourceManager
from agentfly_jax.tools import ToolContext, execute_tool_call
from environments.webshop import (
    POOL_CONFIG,
    Goal,
    Product,
    ShopSession,
    WebShopEnv,
    generate_catalog,
    get_shop,
    load_official_catalog,
    parse_action,
    type_reward,
    webshop_score,
)
from environments.webshop.oracle import OracleShopper, RandomShopper, page_kind
from environments.webshop.rewards import webshop_reward
from environments.webshop.shop import MAX_RESULTS, RESULTS_PER_PAGE, page_asins
from environments.webshop.tasks import build_tasks, goal_row
from environments.webshop.tools import webshop_click, webshop_search

CATALOG = {"source": "generated", "seed": 0, "num_products": 1000}


@pytest.fixture(scope="module")
def shop():
    return get_shop(**CATALOG)


# ------------------------------------------------------------------------------------------------- reward

GOAL = Goal(
    goal_id="g",
    instruction="i need a face moisturizer ...",
    asin="B000000001",
    product_type="face moisturizer",
    category="Beauty › Skin Care › Face",
    title="Acme Face Moisturizer",
    attributes=("paraben free", "long lasting", "fragrance free"),
    options={"size": "2 ounce", "scent": "lavender"},
    price_upper=30.0,
)


def product(**changes):
    fields = dict(
        asin="B000000001",
        title="Acme Hydrating Face Moisturizer",
        product_type="face moisturizer",
        category="Beauty › Skin Care › Face",
        attributes=("fragrance free", "long lasting", "paraben free"),
        options={"size": ("1 ounce", "2 ounce"), "scent": ("lavender", "rose")},
        price=25.0,
        features=("Gentle on skin.",),
    )
    fields.update(changes)
    return Product(**fields)


def test_reward_all_matched_is_one_with_components():
    score = webshop_score(GOAL, product(), {"size": "2 ounce", "scent": "lavender"})
    assert score["reward"] == 1.0
    assert (score["r_type"], score["r_att"], score["r_option"], score["r_price"]) == (1.0, 1.0, 1.0, 1.0)
    assert score["missing_attributes"] == [] and score["missing_options"] == [] and score["asin_match"]


def test_reward_wrong_option():
    # (3 attributes + 1 of 2 options + price) / (3 + 2 + 1)
    score = webshop_score(GOAL, product(), {"size": "2 ounce", "scent": "rose"})
    assert score["reward"] == pytest.approx(5 / 6)
    assert score["r_option"] == 0.5 and score["missing_options"] == ["scent: lavender"]
    # Options not selected at all count as unmatched too: (3 + 0 + 1) / 6.
    assert webshop_score(GOAL, product(), {})["reward"] == pytest.approx(4 / 6)


def test_reward_wrong_type():
    headphones = product(
        title="Sonaro Bluetooth Headphones, Wireless",
        product_type="bluetooth headphones",
        category="Electronics › Headphones",
    )
    score = webshop_score(GOAL, headphones, {"size": "2 ounce", "scent": "lavender"})
    assert score["r_type"] == 0.0 and score["reward"] == 0.0
    # Half of the type's words match (a face wash for a face moisturizer): r_type 0.5, the rest all matched.
    face_wash = product(
        title="Acme Foaming Face Wash", product_type="face wash", category="Beauty › Skin Care › Face"
    )
    assert type_reward(GOAL, face_wash)["r_type"] == 0.5
    assert webshop_score(GOAL, face_wash, {"size": "2 ounce", "scent": "lavender"})["reward"] == 0.5
    # Same category, no shared type word: 0.1.
    serum = product(title="Acme Vitamin C Serum", product_type="vitamin c serum")
    assert type_reward(GOAL, serum)["r_type"] == 0.1


def test_reward_over_budget():
    score = webshop_score(GOAL, product(price=35.0), {"size": "2 ounce", "scent": "lavender"})
    assert score["r_price"] == 0.0 and score["reward"] == pytest.approx(5 / 6)
    assert (
        webshop_score(GOAL, product(price=30.0), {"size": "2 ounce", "scent": "lavender"})["r_price"] == 1.0
    )


def test_reward_attribute_matching_and_option_normalisation():
    missing = product(attributes=("long lasting", "paraben free"))
    score = webshop_score(GOAL, missing, {"size": "2 ounce", "scent": "lavender"})
    assert score["reward"] == pytest.approx(5 / 6) and score["missing_attributes"] == ["fragrance free"]
    # An attribute the listing does not tag but names in its title or features counts (WebShop matches text).
    in_title = product(
        attributes=("long lasting", "paraben free"), title="Acme Fragrance-Free Face Moisturizer"
    )
    assert webshop_score(GOAL, in_title, {"size": "2 ounce", "scent": "lavender"})["r_att"] == 1.0
    fl_oz = Goal(**{**GOAL.__dict__, "options": {"size": "3.4 fl oz"}})
    assert webshop_score(fl_oz, product(), {"size": "3.4 Fl. Oz"})["r_option"] == 1.0
    assert webshop_score(fl_oz, product(), {"size": "4 fl oz"})["r_option"] == 0.0


# --------------------------------------------------------------------------------------- pages and actions


def test_action_grammar():
    assert parse_action("search[paraben free moisturizer]") == ("search", "paraben free moisturizer")
    assert parse_action("  CLICK[ Buy Now ] ") == ("click", "Buy Now")
    assert parse_action("click[< Prev]") == ("click", "< Prev")
    for bad in ("buy now", "search paraben", "click(Buy Now)", "", "search[x"):
        assert parse_action(bad) is None


def test_invalid_actions_give_a_readable_observation_and_change_nothing(shop):
    goal = shop.catalog.heldout_goals[0]
    session = ShopSession(shop, goal)
    cases = [
        ("buy it now", "actions are written search[<query>] or click[<button>]"),
        ("click[Buy Now]", "there is nothing to click on the search page"),
        ("search[]", "the search query is empty"),
    ]
    for action, why in cases:
        outcome = session.act(action)
        assert outcome.observation.startswith(f"Invalid action {action!r}: {why}")
        assert "Available actions: search[<query>]" in outcome.observation
        assert outcome.observation.endswith(session.observation()) and session.page == "search"
        assert not outcome.done and outcome.reward is None and outcome.info["invalid"]
    session.act(f"search[{goal.product_type}]")
    outcome = session.act("search[something else]")
    assert "search is only available on the search page; click [Back to Search] first" in outcome.observation
    listed = page_asins(session.observation())
    stranger = next(p.asin for p in shop.products if p.asin not in listed)
    outcome = session.act(f"click[{stranger}]")
    assert f"'{stranger}' is not a button or a product on this results page" in outcome.observation
    assert f"click[{listed[0]}]" in outcome.observation and session.page == "results"
    session.act(f"click[{listed[0].lower()}]")  # product ids match case-insensitively
    assert session.page == "item"
    outcome = session.act("click[purple polka dots]")
    assert (
        "is not an option or a button of this item" in outcome.observation
        and "click[Buy Now]" in outcome.observation
    )
    assert session.invalid_actions == 6
    session.act("click[Buy Now]")
    after = session.act("click[Back to Search]")
    assert after.done and "the episode is over" in after.observation


def test_paging_item_and_detail_pages(shop):
    goal = shop.catalog.heldout_goals[0]
    session = ShopSession(shop, goal)
    page1 = session.act("search[dress]").observation
    assert page_kind(page1) == "results" and f"page 1 of {MAX_RESULTS // RESULTS_PER_PAGE}" in page1
    assert "[Next >]" in page1 and "[< Prev]" not in page1 and len(page_asins(page1)) == RESULTS_PER_PAGE
    assert "(total results: 50)" in page1
    page2 = session.act("click[Next >]").observation
    assert "page 2 of 5" in page2 and "[< Prev] [Next >]" in page2
    assert not set(page_asins(page1)) & set(page_asins(page2))
    for _ in range(3):
        last = session.act("click[Next >]").observation
    assert "page 5 of 5" in last and "[Next >]" not in last
    assert session.act("click[Next >]").info["invalid"]  # no page 6
    asin = page_asins(last)[0]
    item = session.act(f"click[{asin}]").observation
    assert page_kind(item) == "item" and shop.by_asin[asin].title in item and "Price: $" in item
    for detail in ("Description", "Features", "Reviews"):
        text = session.act(f"click[{detail}]").observation
        assert page_kind(text) == "detail" and f"— {detail}" in text
        session.act("click[< Prev]")
        assert session.page == "item"
    assert session.act("click[< Prev]").observation == last  # back to the same results page
    assert page_kind(session.act("click[Back to Search]").observation) == "search"
    nothing = session.act("search[qqqqzzzz]").observation
    assert 'No results for "qqqqzzzz"' in nothing


def test_option_selection_and_purchase_info(shop):
    goal = shop.catalog.heldout_goals[1]
    session = ShopSession(shop, goal)
    session.act(f"search[{goal.title}]")
    session.act(f"click[{goal.asin}]")
    product = shop.by_asin[goal.asin]
    group, values = next(iter(product.options.items()))
    wrong = next(v for v in values if v != goal.options[group])
    session.act(f"click[{wrong}]")
    assert f"Selected: {group} = {wrong}" in session.observation()
    for value in goal.options.values():
        session.act(f"click[{value}]")
    outcome = session.act("click[Buy Now]")
    assert (
        outcome.done and outcome.reward == 1.0 and outcome.info["purchase"]["options"] == dict(goal.options)
    )
    assert {"r_type", "r_att", "r_option", "r_price", "matched_attributes"} <= set(outcome.info)


# ------------------------------------------------------------------------------------------ catalog/goals


def test_generated_catalog_is_deterministic_and_every_goal_is_satisfiable():
    a, b = generate_catalog(seed=3, num_products=200), generate_catalog(seed=3, num_products=200)
    assert a == b and generate_catalog(seed=4, num_products=200) != a
    assert len({p.asin for p in a.products}) == 200
    assert len({p.product_type for p in a.products}) >= 15
    by_asin = a.by_asin()
    train_asins = {g.asin for g in a.train_goals}
    heldout_asins = {g.asin for g in a.heldout_goals}
    assert heldout_asins and not train_asins & heldout_asins  # held-out goals name other products
    for goal in a.train_goals + a.heldout_goals:
        product = by_asin[goal.asin]
        assert set(goal.attributes) <= set(product.attributes)
        assert all(value in product.options[group] for group, value in goal.options.items())
        assert product.price <= goal.price_upper
        assert webshop_score(goal, product, goal.options)["reward"] == 1.0
        assert f"price lower than {goal.price_upper:.2f} dollars" in goal.instruction
        assert all(attribute in goal.instruction for attribute in goal.attributes)
        assert all(value in goal.instruction for value in goal.options.values())
        assert Goal.from_dict(json.loads(json.dumps(goal.to_dict()))) == goal


def test_official_webshop_files_load(tmp_path):
    items = [
        {
            "asin": "B078GWRC1J",
            "name": "Bright Citrus Deodorant by Earth Mama",
            "query": "deodorant",
            "product_category": "Beauty & Personal Care › Personal Care › Deodorants",
            "pricing": "$10.99",
            "customization_options": {
                "size": [
                    {"value": "3 Ounce (Pack of 1)", "image": None},
                    {"value": "3 ounce (pack of 2)", "image": None},
                ]
            },
            "small_description": ["Natural and safe for sensitive skin"],
            "full_description": "A deodorant.",
            "Reviews": [],
            "average_rating": "4.5",
        },
        {
            "asin": "B08KBVJ4XN",
            "name": "Barrel and Oak - Aluminum-Free Deodorant",
            "query": "deodorant",
            "product_category": "Beauty & Personal Care › Personal Care › Deodorants",
            "pricing": ["$15.95", "$29.95"],
            "customization_options": {},
        },
        {"asin": "B0BROKEN01", "name": "no price at all"},
    ]
    attributes = {
        "B078GWRC1J": {
            "attributes": ["fluoride free", "natural ingredients"],
            "instruction": "i need a natural deodorant that is fluoride free",
            "instruction_attributes": ["fluoride free"],
            "instruction_options": ["3 ounce (pack of 2)"],
        },
        "B08KBVJ4XN": {
            "attributes": ["aluminum free"],
            "instruction": "find aluminum free deodorant",
            "instruction_attributes": ["aluminum free"],
            "instruction_options": [],
        },
    }
    (tmp_path / "items_shuffle_1000.json").write_text(json.dumps(items))
    (tmp_path / "items_ins_v2_1000.json").write_text(json.dumps(attributes))
    catalog = load_official_catalog(
        tmp_path / "items_shuffle_1000.json", tmp_path / "items_ins_v2_1000.json", heldout_fraction=0.0
    )
    assert [p.asin for p in catalog.products] == ["B078GWRC1J", "B08KBVJ4XN"]
    assert "1 skipped" in catalog.source
    deodorant = catalog.by_asin()["B078GWRC1J"]
    assert deodorant.price == 10.99 and deodorant.product_type == "deodorant" and deodorant.rating == 4.5
    assert deodorant.options == {"size": ("3 ounce (pack of 1)", "3 ounce (pack of 2)")}
    assert catalog.by_asin()["B08KBVJ4XN"].price == 15.95
    goal = next(g for g in catalog.train_goals if g.asin == "B078GWRC1J")
    assert goal.options == {"size": "3 ounce (pack of 2)"} and goal.attributes == ("fluoride free",)
    assert goal.price_upper > 10.99 and "price lower than" in goal.instruction
    session = ShopSession(
        get_shop(
            source="official",
            items_path=str(tmp_path / "items_shuffle_1000.json"),
            attributes_path=str(tmp_path / "items_ins_v2_1000.json"),
            heldout_fraction=0.0,
        ),
        goal,
    )
    oracle = OracleShopper(goal)
    observation = session.observation()
    while session.page != "done":
        outcome = session.act(oracle.act(observation))
        observation = outcome.observation
    assert outcome.reward == 1.0
    with pytest.raises(FileNotFoundError, match="items_path"):
        load_official_catalog(tmp_path / "missing.json", tmp_path / "items_ins_v2_1000.json")


# --------------------------------------------------------------------------- oracle through tools / manager


async def oracle_chain(manager, row, key):
    """One chain: the oracle reads each tool observation and picks the next tool call, then the chain is
    scored by `webshop_reward` in the same context (what the agent runtime does)."""
    goal = Goal.from_dict(row["goal"])
    oracle = OracleShopper(goal)

    async def setup(pool, env):
        await env.reset(row)

    async with ToolContext(row, env_provider=manager, key=key, setup_env=setup) as context:
        observation = "[Search page]"
        for _ in range(60):
            action = oracle.act(observation)
            kind, argument = parse_action(action)
            call = (
                {"name": "webshop_search", "arguments": {"query": argument}}
                if kind == "search"
                else {"name": "webshop_click", "arguments": {"target": argument}}
            )
            result = await execute_tool_call(call, [webshop_search, webshop_click], context=context)
            assert result.ok, result.error
            observation = result.observation
            if result.extras["done"]:
                break
        scored = await webshop_reward.score(prediction="", task=row, context=context)
    return scored, oracle


def test_oracle_buys_heldout_goals_through_the_tools_with_64_concurrent_chains(shop):
    rows = [goal_row(goal) for goal in shop.catalog.heldout_goals[:64]]
    assert len(rows) == 64

    async def main():
        config = dict(POOL_CONFIG, kwargs=dict(CATALOG, max_actions=60))
        async with ResourceManager({"webshop": config}) as manager:
            outcomes = await asyncio.gather(
                *(oracle_chain(manager, row, f"chain-{i}") for i, row in enumerate(rows))
            )
            metrics = manager.metrics("webshop")
            return outcomes, metrics

    outcomes, metrics = asyncio.run(main())
    assert [scored.reward for scored, _ in outcomes] == [1.0] * 64
    assert all(
        scored.ok and scored.extras["asin_match"] and scored.extras["bought"] for scored, _ in outcomes
    )
    assert sum(oracle.pages_turned > 0 for _, oracle in outcomes) >= 10  # many targets are past page 1
    assert metrics["created"] == 64 and metrics["in_use"] == 0 and metrics["failures"] == 0


def test_env_interface_action_limit_and_reward_without_purchase(shop):
    async def main():
        env = WebShopEnv(shop=shop, max_actions=3)
        row = goal_row(shop.catalog.heldout_goals[0])
        first = await env.reset(row)
        assert first.startswith("Instruction: ") and "[Search page]" in first
        await env.step("search[dress]")
        await env.step({"action": "click[Next >]"})
        await env.step("click[Next >]")
        limited = await env.step("click[Next >]")
        assert limited.done and limited.reward == 0.0 and "action limit" in limited.observation
        nothing = webshop_reward.func(env=env)
        assert nothing["reward"] == 0.0 and not nothing["bought"]
        await env.reset(None)  # what the manager does between chains
        assert env.session.goal is None and await env.health()

    asyncio.run(main())


def test_random_shopper_scores_below_the_oracle(shop):
    rewards = []
    for i, goal in enumerate(shop.catalog.heldout_goals[:40]):
        session, shopper = ShopSession(shop, goal), RandomShopper(seed=i)
        observation = session.observation()
        for _ in range(25):
            outcome = session.act(shopper.act(observation))
            observation = outcome.observation
            if outcome.done:
                break
        rewards.append(outcome.reward or 0.0)
    assert 0.0 < sum(rewards) / len(rewards) < 0.8


def test_task_rows(shop):
    train, heldout = build_tasks(dict(CATALOG, num_train=100, num_eval=0))
    assert len(train) == 100 and len(heldout) == len(shop.catalog.heldout_goals)
    row = heldout[0]
    assert row["instruction"] in row["question"] and "webshop_search" in row["question"]
    assert Goal.from_dict(row["goal"]) == shop.catalog.heldout_goals[0]


def test_env_spec_splits_and_contents(shop):
    from agentfly_jax.envs.spec import load_env_spec

    spec = load_env_spec("webshop", dict(CATALOG))
    assert spec.agent == "tool_calling" and spec.splits == ("train", "dev", "test")
    assert {t.name for t in spec.tools} == {"webshop_search", "webshop_click"} and spec.reward.name == "webshop_reward"
    assert spec.pools["webshop"]["kwargs"]["num_products"] == 1000
    train, dev, test = (spec.split_tasks(split, 0, 0) for split in spec.splits)  # num <= 0: every goal
    assert len(train) == len(shop.catalog.train_goals) and len(dev) + len(test) == len(shop.catalog.heldout_goals)
    ids = [{row["goal_id"] for row in rows} for rows in (train, dev, test)]
    assert not ids[0] & ids[1] and not ids[0] & ids[2] and not ids[1] & ids[2]
    assert spec.split_tasks("test", 5, 3) == spec.split_tasks("test", 5, 3) and len(spec.split_tasks("test", 5, 3)) == 5
    assert len(spec.split_tasks("test", 10_000, 0)) == len(test)  # more than the split holds: all of it
    with pytest.raises(ValueError, match="has no option 'num_product'"):
        load_env_spec("webshop", {"num_product": 10})


# ----------------------------------------------------------------------------------------------- HTTP app


def test_http_app_json_api_and_html_pages(shop):
    from aiohttp.test_utils import TestClient, TestServer

    from environments.webshop.server import make_app

    async def main():
        async with TestClient(TestServer(make_app(shop, max_sessions=2))) as client:
            reply = await (await client.post("/api/reset", json={"session": "s1", "index": 2})).json()
            goal = Goal.from_dict(reply["goal"])
            assert goal == shop.catalog.heldout_goals[2] and reply["page"] == "search"
            oracle, observation, state = OracleShopper(goal), reply["observation"], {}
            for _ in range(40):
                action = oracle.act(observation)
                state = await (
                    await client.post("/api/step", json={"session": "s1", "action": action})
                ).json()
                observation = state["observation"]
                if state["done"]:
                    break
            assert state["reward"] == 1.0 and state["info"]["asin_match"] and state["available_actions"] == []
            bad = await client.post("/api/step", json={"session": "nobody", "action": "search[x]"})
            assert bad.status == 404 and "no session" in await bad.text()
            assert (await client.post("/api/reset", json={"session": "s2", "index": 10**6})).status == 400
            # Browser pages: the goal list, then a search form, result links, and a click through a link.
            assert "/session/g0/reset?index=0" in await (await client.get("/")).text()
            page = await (await client.get("/session/b1/reset?index=0")).text()
            assert '<form action="/session/b1/search">' in page
            results = await (await client.get("/session/b1/search", params={"q": "dress"})).text()
            asin = page_asins(ShopSession(shop).act("search[dress]").observation)[0]
            assert f'<a href="/session/b1/click?target={asin}">[{asin}]</a>' in results
            item = await (await client.get("/session/b1/click", params={"target": asin})).text()
            assert "Buy%20Now" in item and html.escape(shop.by_asin[asin].title) in item
            await client.post("/api/reset", json={"session": "s3"})  # 3 sessions > max 2: the oldest goes
            assert (await client.post("/api/step", json={"session": "s1", "action": "x"})).status == 404

    asyncio.run(main())
