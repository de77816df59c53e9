"""scripts/eval_env.py --agent model: the environment's agent type (ALFWorld's spec names a ReAct agent),
sampling from a checkpoint on the embedded JAX sampler, plays ALFWorld's held-out games through the real rollout
(pooled engines, the environment's reward). The checkpoint is what the trainer writes as `final_policy`: the
alfworld_grpo config's tiny random policy with the offline Qwen2.5 tokenizer."""

import json
from pathlib import Path

import pytest

pytest.importorskip("alfworld", reason="needs the envs extra: pip install -e '.[envs]'")

from agentfly_jax.models import save_pretrained  # noqa: E402
from agentfly_jax.trainer import builders  # noqa: E402
from agentfly_jax.trainer.config import TrainConfig  # noqa: E402
from tests.script_modules import load_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def eval_env():
    return load_script("eval_env", "eval_env_script")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import importlib

    config = TrainConfig.build(importlib.import_module("experiments.alfworld_grpo").get_config())
    directory = tmp_path_factory.mktemp("final_policy")
    tokenizer = builders.build_tokenizer(config, builders.build_task_setup(config), str(directory / "build"))
    model, params = builders.build_policy(config, tokenizer)
    save_pretrained(model, params, str(directory))
    tokenizer.save_pretrained(str(directory))
    return str(directory)


# A 2 + 2-game suite (built once, cached): the default 240 + 60 games take minutes to generate.
ARGS = ["--env", "alfworld", "--agent", "model", "--backend", "jax", "--num", "2", "--max-turns", "2",
        "--max-new-tokens", "16", "--max-context", "1024", "--option", "num_train_games=2",
        "--option", "num_test_games=2"]


@pytest.mark.slow
def test_model_agent_on_the_jax_sampler(eval_env, checkpoint, tmp_path, capsys):
    out = tmp_path / "summary.json"
    summary = eval_env.main([*ARGS, "--model", checkpoint, "--chat-template", "qwen2.5", "--json", str(out)])
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert headline["agent"] == "model" and headline["env"] == "alfworld" and headline["tasks"] == 2
    assert summary["chains"] == 2 and 0.0 <= summary["success"] <= 1.0
    assert summary["chain_errors"] == 0 and summary["reward_failures"] == 0
    assert sum(summary["finish_reasons"].values()) == 2
    # every chain ran on a pooled ALFWorld engine, reset with its game, and was scored by alfworld_reward
    assert summary["rollout"]["envs_acquired"] == 2
    assert summary["pools"]["alfworld"]["acquires"] == 2 and summary["pools"]["alfworld"]["failures"] == 0
    rows = json.loads(out.read_text())["per_task"]
    assert [row["task"]["task_type"] for row in rows] and all(row["turns"] >= 1 for row in rows)


@pytest.mark.slow
def test_model_agent_needs_a_chat_template(eval_env, checkpoint):
    with pytest.raises(SystemExit, match="--chat-template qwen2.5"):
        eval_env.main([*ARGS, "--model", checkpoint])
    with pytest.raises(SystemExit, match="no config.json"):
        eval_env.main([*ARGS, "--model", str(Path(checkpoint) / "missing")])


@pytest.mark.slow
def test_model_agent_is_the_type_the_environment_names(eval_env, checkpoint):
    # arithmetic's spec names a tool-calling agent: Hermes-style <tool_call> turns, tool results as tool messages
    from agentfly_jax.rollout.agents import ToolCallingAgent

    summary = eval_env.main(["--env", "arithmetic", "--agent", "model", "--backend", "jax", "--num", "2",
                             "--max-new-tokens", "8", "--max-context", "1024", "--model", checkpoint,
                             "--chat-template", "qwen2.5"])
    assert summary["env"] == "arithmetic" and summary["chains"] == 2 and summary["chain_errors"] == 0
    assert eval_env.agent_class(eval_env.load_spec("arithmetic", {})) is ToolCallingAgent
