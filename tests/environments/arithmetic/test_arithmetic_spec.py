"""The arithmetic EnvSpec: the quickstart's task rows and SFT demonstrations exactly as the trainer built them
before environments were plugins, and its oracle / random agents through the real rollout."""

import asyncio
import random

import pytest

from agentfly_jax.envs.spec import load_env_spec
from environments.arithmetic import ArithmeticTaskConfig, demonstration, env_spec, generate_tasks
from environments.evaluation import evaluate, scripted_agent, scripted_tokenizer


def test_rows_equal_the_trainer_construction():
    # What agentfly_jax/trainer/builders.py `_arithmetic_tasks` built for the quickstart (num_train=4000,
    # num_eval=64, seed 0): held-out with seed + 1, train with the seed, avoiding the held-out expressions.
    family = ArithmeticTaskConfig(operand_min=10, operand_max=999, ops="*+-")
    old_eval = generate_tasks(64, 0 + 1, family)
    old_train = generate_tasks(4000, 0, family, exclude={t["expression"] for t in old_eval})
    spec = env_spec(operand_min=10, operand_max=999, ops="*+-", num_heldout=64)
    assert spec.split_tasks("train", 4000, 0) == old_train
    assert spec.split_tasks("test", 64, 0) == old_eval
    assert spec.split_tasks("test", 0, 0) == old_eval  # num <= 0: the whole held-out pool
    assert spec.split_tasks("test", 10, 0) == old_eval[:10]
    assert not {t["expression"] for t in old_train} & {t["expression"] for t in old_eval}


def test_demonstrations_equal_the_trainer_ones():
    spec = env_spec()
    rows = spec.split_tasks("train", 50, 3)
    old_rng, new_rng = random.Random(7), random.Random(7)
    old = [demonstration(t, use_tool=old_rng.random() < 0.4, rng=old_rng) for t in rows]
    assert spec.demonstrations(rows, new_rng, 0.4) == old
    assert any(len(d) == 2 for d in old) and any(len(d) == 4 for d in old)  # both guesses and tool calls


def test_spec_contents_and_errors():
    spec = load_env_spec("environments.arithmetic:env_spec", {"num_heldout": 8})
    assert spec.name == "arithmetic" and spec.agent == "tool_calling" and spec.system_prompt == ""
    assert [t.name for t in spec.tools] == ["calculator"] and spec.reward.name == "math_match"
    assert spec.max_turns == 3 and spec.success_threshold == 1.0 and spec.pools == {}
    assert spec.splits == ("train", "test") and spec.tokenizer is not None
    with pytest.raises(ValueError, match="num_heldout=8"):
        spec.split_tasks("test", 9, 0)
    with pytest.raises(ValueError, match="no split 'dev'"):
        spec.split_tasks("dev", 1, 0)
    with pytest.raises(ValueError, match="num > 0"):
        spec.split_tasks("train", 0, 0)
    with pytest.raises(ValueError, match="ops="):
        env_spec(ops="/")


def test_tokenizer_is_the_quickstart_one(tmp_path):
    from environments.arithmetic import build_tokenizer

    tokenizer = env_spec().tokenizer(str(tmp_path / "tok"), 0)
    reference = build_tokenizer(None, seed=0)
    assert tokenizer.get_vocab() == reference.get_vocab()
    assert (tmp_path / "tok" / "tokenizer.json").is_file()


def test_oracle_solves_and_random_guesses_through_the_rollout():
    spec = env_spec()
    tasks = spec.split_tasks("test", 8, 0)
    tokenizer = scripted_tokenizer()
    oracle = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "oracle", m, tokenizer=tokenizer), tasks))
    assert oracle["success"] == 1.0 and oracle["tool_calls_mean"] == 1.0 and oracle["tool_errors_total"] == 0
    rand = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "random", m, tokenizer=tokenizer), tasks))
    assert rand["success"] == 0.0 and rand["tool_calls_mean"] == 0.0
