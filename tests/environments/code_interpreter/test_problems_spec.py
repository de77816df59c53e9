"""The code_interpreter EnvSpec: generated computation problems (deterministic, splits disjoint by construction,
answers checked against independent reference programs), the exact integer reward, and the oracle / random
agents through the real rollout on the bubblewrap sandbox."""

import contextlib
import io

import pytest

from agentfly_jax.envs.spec import load_env_spec
from environments.code_interpreter import env_spec
from environments.code_interpreter.problems import FAMILIES, generate_problems, reference_program, split_of
from environments.code_interpreter.rewards import integer_answer_match, parse_integer
from environments.evaluation import evaluate, scripted_agent, scripted_tokenizer
from tests.envs import sandbox_helpers


def _keys(rows):
    return {(r["family"], tuple(sorted(r["params"].items()))) for r in rows}


def test_splits_are_disjoint_deterministic_and_prefix_stable():
    spec = env_spec()
    train = spec.split_tasks("train", 0, 0)  # num <= 0: the whole split (train_size rows)
    dev, test = spec.split_tasks("dev", 0, 0), spec.split_tasks("test", 0, 0)
    assert (len(train), len(dev), len(test)) == (4000, 200, 200)
    other_seed = spec.split_tasks("test", 0, 1)
    assert not _keys(train) & (_keys(dev) | _keys(test) | _keys(other_seed)) and not _keys(dev) & _keys(test)
    assert _keys(test) != _keys(other_seed)  # the seed draws other problems of the same split
    assert all(split_of(r["family"], r["params"]) == "test" for r in test + other_seed)
    assert spec.split_tasks("test", 0, 0) == test and spec.split_tasks("test", 30, 0) == test[:30]
    assert len({r["question"] for r in train}) == len(train)
    assert {r["family"] for r in test} == set(FAMILIES) and all(r["answer"].lstrip("-").isdigit() for r in test)


def test_reference_programs_print_the_generated_answers():
    rows = generate_problems("dev", 3 * len(FAMILIES), seed=5)
    for row in rows:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(reference_program(row), {})
        assert printed.getvalue().strip() == row["answer"], row


def test_integer_reward_is_exact():
    assert integer_answer_match.func(prediction="\\boxed{2168207306}", answer="2168207306")["reward"] == 1.0
    assert integer_answer_match.func(prediction="Final Answer: 2,168,207,306.", answer="2168207306")["reward"] == 1.0
    assert integer_answer_match.func(prediction=" 42 ", answer="42")["reward"] == 1.0
    # math_match's relative tolerance would accept this near miss
    assert integer_answer_match.func(prediction="\\boxed{2168207307}", answer="2168207306")["reward"] == 0.0
    assert integer_answer_match.func(prediction="about 42", answer="42")["reward"] == 0.0
    assert parse_integer("$-17$") == -17 and parse_integer("1.5") is None


def test_spec_contents_and_errors():
    spec = load_env_spec("environments.code_interpreter:env_spec", {"families": "collatz_steps,prime_sum",
                                                                     "test_size": 10})
    assert spec.agent == "tool_calling" and [t.name for t in spec.tools] == ["code_interpreter"]
    assert spec.pools["code_interpreter"]["kwargs"]["backend"] == "bwrap" and "code_interpreter" in spec.system_prompt
    assert {r["family"] for r in spec.split_tasks("test", 0, 0)} == {"collatz_steps", "prime_sum"}
    with pytest.raises(ValueError, match="test_size=10"):
        spec.split_tasks("test", 11, 0)
    with pytest.raises(ValueError, match="unknown code_interpreter problem families"):
        env_spec(families="sudoku")


def test_oracle_solves_and_random_fails_through_the_sandbox(loop):
    sandbox_helpers.require_backend(loop, "bwrap")
    spec = env_spec(pool_size=4)
    tasks = spec.split_tasks("test", 2 * len(FAMILIES), 0)  # two problems of every family
    tokenizer = scripted_tokenizer()
    oracle = loop.run_until_complete(
        evaluate(spec, lambda m: scripted_agent(spec, "oracle", m, tokenizer=tokenizer), tasks))
    assert oracle["success"] == 1.0, [row for row in oracle["per_task"] if row["reward"] < 1.0]
    assert oracle["tool_calls_mean"] == 1.0 and oracle["tool_errors_total"] == 0
    assert oracle["pools"]["code_interpreter"]["created"] <= 4
    rand = loop.run_until_complete(
        evaluate(spec, lambda m: scripted_agent(spec, "random", m, tokenizer=tokenizer), tasks))
    assert rand["success"] == 0.0 and rand["tool_calls_mean"] == 1.0 and rand["chain_errors"] == 0
