"""The WebShop and search experiment configs wire up through their environment plugins (`config.env`): task
rows, tools, reward and the resource manager of the spec's pools; a ToolCallingAgent built from each config by
the trainer's builders runs chains end to end (a scripted model writes the oracle's tool calls in Qwen2.5's
format), reward 1.0.

The ALFWorld and ScienceWorld configs train: each config's `:cpu` variant runs two GRPO steps of the tiny random
model through `python -m agentfly_jax.train`, on the real engines' pools."""

import asyncio
import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentfly_jax.envs import ResourceManager
from agentfly_jax.trainer import builders
from agentfly_jax.trainer.config import TrainConfig
from agentfly_jax.trainer.metrics import read_scalars
from environments.search.evaluation import _answer_shown
from environments.webshop import Goal
from environments.webshop.oracle import OracleShopper
from environments.webshop.shop import parse_action
from tests.rollout.conftest import qwen_tokenizer  # noqa: F401  (session fixture)
from tests.rollout.fakes import FakeScriptedBackend, tool_call_text

ROOT = Path(__file__).resolve().parents[2]


def load_config(name, **overrides):
    """experiments/<name>.py's config, typed, with `overrides` ({"section.key": value}) applied first."""
    config = importlib.import_module(f"experiments.{name}").get_config()
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        node = config
        for part in section.split("."):
            node = node[part]
        node[field] = value
    return TrainConfig.build(config)


def build_agent(config, backend, tokenizer):
    """(agent, train rows, held-out rows) as the trainer builds them, with the spec's pools in a manager."""
    setup = builders.build_task_setup(config)
    train, heldout = builders.build_tasks(config, setup)
    agent = builders.build_agent(config, setup, backend, tokenizer, env_provider=builders.build_env_manager(setup))
    return agent, train, heldout


def last_tool_output(prompt_text: str) -> str:
    """The content of the last tool message in a Qwen2.5 prompt ("" before the first call)."""
    if "<tool_response>" not in prompt_text:
        return ""
    return prompt_text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]


@pytest.mark.slow
def test_webshop_grpo_config_runs_oracle_chains(qwen_tokenizer):  # noqa: F811
    config = load_config("webshop_grpo")
    shoppers, goals = {}, {}

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
    agent, train, heldout = build_agent(config, backend, qwen_tokenizer)
    assert len(heldout) == 53 and len(train) > 500  # the held-out "test" half
    goals.update({row["instruction"]: Goal.from_dict(row["goal"]) for row in heldout})
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
    rows = {}

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
    agent, train, heldout = build_agent(config, backend, qwen_tokenizer)
    assert len(heldout) == 64 and len(train) > 5000
    rows.update({row["question"]: row for row in heldout})
    assert list(agent.tools) == ["search"] and agent.reward_fn.name == "qa_exact_match"

    async def main():
        try:
            return await agent.run(heldout[:16], num_chains=1, progress=False)
        finally:
            await agent.env_provider.close()

    trajectories = asyncio.run(main())
    assert sum(t.reward for t in trajectories) == 16, [t.reward_extras for t in trajectories]
    assert json.dumps(dataclasses.asdict(config))  # the config serialises (the trainer writes config.json)


# ---------------------------------------------------------------------------------------------------------
# ALFWorld and ScienceWorld: the ReAct agent each config builds plays expert plans through its tools and pool,
# and the configs' CPU plumbing-check commands train for two GRPO steps end to end
# ---------------------------------------------------------------------------------------------------------


def _expert_plan(pool: str, row: dict) -> list[str]:
    if pool == "alfworld":
        return row["expert_plan"]
    from environments.scienceworld import describe

    return list(describe(row["task_name"], row["variation"], True)[1])


@pytest.mark.slow
@pytest.mark.parametrize("name, pool", [("alfworld_grpo", "alfworld"), ("scienceworld_grpo", "scienceworld")])
def test_react_config_plays_expert_plans_through_its_tools_and_pool(name, pool, qwen_tokenizer):  # noqa: F811
    pytest.importorskip(pool, reason="needs the envs extra: pip install -e '.[envs]'")
    from environments.evaluation import render_react_turn

    overrides = {"task.num_train": 4, "task.num_eval": 2, "eval.num_tasks": 2}
    if pool == "scienceworld":  # two tasks with short gold paths (the held-out rows take one of each)
        overrides["env.options.task_names"] = "lifespan-longest-lived,find-plant"
    else:
        overrides.update({"env.options.num_train_games": 4, "env.options.num_test_games": 2})
    config = load_config(name, **overrides)
    plans = {}
    step_tool = f"{pool}_step"

    def script(prompt):
        plan = plans[prompt.question]
        if prompt.turn < len(plan):
            call = {"name": step_tool, "arguments": {"action": plan[prompt.turn]}}
            return render_react_turn(call, None, prompt.turn)
        return render_react_turn(None, "Done.", prompt.turn)

    backend = FakeScriptedBackend(qwen_tokenizer, script)
    agent, train, heldout = build_agent(config, backend, qwen_tokenizer)
    assert len(train) == 4 and len(heldout) == 2
    rows = heldout[:2]
    plans.update({row["question"]: _expert_plan(pool, row) for row in rows})
    assert len(plans) == 2 and all(0 < len(p) < config.agent.max_turns for p in plans.values())
    assert isinstance(agent.env_provider, ResourceManager) and agent.env_provider.pool_names == [pool]
    assert step_tool in agent.tools and agent.reward_fn.name == f"{pool}_reward"

    async def main():
        try:
            return await agent.run(rows, num_chains=1, progress=False)
        finally:
            await agent.env_provider.close()

    trajectories = asyncio.run(main())
    assert [t.reward for t in trajectories] == [1.0, 1.0], [t.reward_extras for t in trajectories]
    assert [t.tool_calls for t in trajectories] == [len(plans[row["question"]]) for row in rows]
    assert all(t.finish_reason == "stop" and not t.metrics.get("tool_errors") for t in trajectories)


def run_train(args: list[str], workdir: Path) -> dict:
    cmd = [sys.executable, "-m", "agentfly_jax.train", *args, f"--config.workdir={workdir}",
           "--config.progress=False"]
    env = {**os.environ}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((workdir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name, pool", [("alfworld_grpo", "alfworld"), ("scienceworld_grpo", "scienceworld")])
def test_plumbing_check_trains_two_grpo_steps_on_the_env_pool(name, pool, tmp_path):
    pytest.importorskip(pool, reason="needs the envs extra: pip install -e '.[envs]'")
    steps, chains = 2, 2  # what the :cpu variant asks for (1 task x 2 chains a step)
    cpu = TrainConfig.build(importlib.import_module(f"experiments.{name}").get_config("cpu"))
    assert (cpu.rl.steps, cpu.rl.tasks_per_step * cpu.rl.chains_per_task) == (steps, chains)
    summary = run_train(["--config", f"experiments/{name}.py:cpu"], tmp_path)
    assert summary["algorithm"] == "grpo" and summary["steps"] == steps and summary["backend"] == "jax"
    assert 0.0 <= summary["success_before"] <= 1.0 and 0.0 <= summary["success_after"] <= 1.0
    assert (Path(summary["final_policy"]) / "model.safetensors").is_file()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["env"]["name"] == pool and config["envs"] == {}  # the pool comes from the env plugin

    scalars = read_scalars(str(tmp_path / "tensorboard"))
    expected = ["reward/mean", "success/rate", "rollout/tool_calls_mean", "rollout/turns_mean",
                "rollout/envs_acquired", "rollout/envs_in_use_peak", "rollout/chain_errors",
                "rollout/reward_failures", "policy/grad_norm", "policy/entropy", "time/rollout_s",
                "time/update_s", "eval/success"]
    missing = [tag for tag in expected if tag not in scalars]
    assert not missing, f"TensorBoard lacks {missing}"
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2]
    assert [s for s, _ in scalars["eval/success"]] == [0, 2]  # before and after training, on held-out rows
    # The env pool served every chain: each took an environment (reset with its task's game / variation) and
    # was scored by the environment-backed reward without failures.
    assert [v for _, v in scalars["rollout/envs_acquired"]] == [chains] * steps
    assert all(1 <= v <= chains for _, v in scalars["rollout/envs_in_use_peak"])
    assert all(v == 0 for _, v in scalars["rollout/chain_errors"] + scalars["rollout/reward_failures"])
    assert all(v >= 0 for _, v in scalars["rollout/tool_calls_mean"])
    assert all(0.0 <= v <= 1.0 for _, v in scalars["reward/mean"])
