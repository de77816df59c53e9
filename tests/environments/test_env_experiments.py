"""The WebShop and search experiment configs wire up: task rows, tools and reward by import path, and the
resource manager of `config.envs`; a ToolCallingAgent built from each config by the trainer's builders runs
chains end to end (a scripted model writes the oracle's tool calls in Qwen2.5's format), reward 1.0."""

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

from agentfly_jax.envs import ResourceManager
from agentfly_jax.trainer import builders
from environments.search.evaluation import _answer_shown
from environments.webshop import Goal
from environments.webshop.oracle import OracleShopper
from environments.webshop.shop import parse_action
from tests.rollout.conftest import qwen_tokenizer  # noqa: F401  (session fixture)
from tests.rollout.fakes import FakeScriptedBackend, tool_call_text

ROOT = Path(__file__).resolve().parents[2]


def load_config(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def last_tool_output(prompt_text: str) -> str:
    """The content of the last tool message in a Qwen2.5 prompt ("" before the first call)."""
    if "<tool_response>" not in prompt_text:
        return ""
    return prompt_text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]


@pytest.mark.slow
def test_webshop_grpo_config_runs_oracle_chains(qwen_tokenizer):  # noqa: F811
    config = load_config("webshop_grpo")
    train, heldout = builders.build_tasks(config)
    assert len(heldout) == 64 and len(train) > 500
    goals = {row["instruction"]: Goal.from_dict(row["goal"]) for row in heldout}
    shoppers = {}

    def script(prompt):
        instruction = prompt.question.split("Instruction: ", 1)[1].split("\n", 1)[0]
        if prompt.turn == 0:  # one chain per goal: the goal's instruction names its shopper
            shoppers[instruction] = OracleShopper(goals[instruction])
        observation = last_tool_output(prompt.text) or "[Search page]"
        if "episode is over" in observation:
            return "I bought it."
        kind, argument = parse_action(shoppers[instruction].act(observation))
        if kind == "search":
            return tool_call_text("webshop_search", {"query": argument})
        return tool_call_text("webshop_click", {"target": argument})

    backend = FakeScriptedBackend(qwen_tokenizer, script)
    agent = builders.build_agent(config, backend, qwen_tokenizer)
    assert isinstance(agent.env_provider, ResourceManager) and agent.env_provider.pool_names == ["webshop"]
    assert (
        sorted(agent.tools) == ["webshop_click", "webshop_search"]
        and agent.reward_fn.name == "webshop_reward"
    )

    async def main():
        try:
            return await agent.run(heldout[:6], num_chains=1, progress=False)
        finally:
            await agent.env_provider.close()

    trajectories = asyncio.run(main())
    assert [t.reward for t in trajectories] == [1.0] * 6
    assert all(t.tool_calls >= 4 and t.reward_extras["asin_match"] for t in trajectories)


@pytest.mark.slow
def test_search_reinforce_pp_config_runs_oracle_chains(qwen_tokenizer):  # noqa: F811
    config = load_config("search_reinforce_pp")
    train, heldout = builders.build_tasks(config)
    assert len(heldout) == 64 and len(train) > 5000
    rows = {row["question"]: row for row in heldout}

    def script(prompt):
        row = rows[prompt.question]
        observation = last_tool_output(prompt.text)
        if not observation:
            return tool_call_text("search", {"query": row["raw_question"]})
        shown = _answer_shown(row["answer"], observation)
        if shown is None and prompt.turn == 1:
            return tool_call_text("search", {"query": row["gold_titles"][0], "k": 3})
        return f"<answer>{shown or 'unknown'}</answer>"

    backend = FakeScriptedBackend(qwen_tokenizer, script)
    agent = builders.build_agent(config, backend, qwen_tokenizer)
    assert list(agent.tools) == ["search"] and agent.reward_fn.name == "qa_exact_match"

    async def main():
        try:
            return await agent.run(heldout[:16], num_chains=1, progress=False)
        finally:
            await agent.env_provider.close()

    trajectories = asyncio.run(main())
    assert sum(t.reward for t in trajectories) == 16, [t.reward_extras for t in trajectories]
    assert json.dumps(config.to_dict())  # the config serialises (the trainer writes config.json)
