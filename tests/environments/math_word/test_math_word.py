"""The math_word EnvSpec: gsm_symbolic rows split by seed with no shared question, math-verify on real rows,
the oracle / random agents through the real rollout on the bubblewrap sandbox, and the SFT demonstrations
(programs that print the gold, rendered with the qwen2.5 template, tool calls masked as actions)."""

import contextlib
import io
import itertools
import random

import pytest

pytest.importorskip("reasoning_gym")
pytest.importorskip("math_verify")

from agentfly_jax.envs.spec import load_env_spec
from environments.evaluation import evaluate, scripted_agent, scripted_tokenizer
from environments.math_word import env_spec, program_output, solution_program
from environments.math_word.tasks import SEED_SPAN, dataset_seed, generate_split, solvable_fraction
from tests.envs import sandbox_helpers


def _questions(rows):
    return {r["question"] for r in rows}


def test_splits_are_disjoint_deterministic_and_prefix_stable():
    spec = env_spec()
    train, dev, test = (spec.split_tasks(s, 0, 0) for s in ("train", "dev", "test"))
    assert (len(train), len(dev), len(test)) == (5000, 200, 300)
    assert not _questions(train) & (_questions(dev) | _questions(test)) and not _questions(dev) & _questions(test)
    assert len(_questions(train)) == len(train) and len(_questions(test)) == len(test)
    assert spec.split_tasks("test", 0, 0) == test and spec.split_tasks("test", 30, 0) == test[:30]
    assert spec.split_tasks("train", 100, 0) == train[:100]
    other_seed = spec.split_tasks("test", 0, 1)
    assert _questions(other_seed) != _questions(test)
    # generator seeds: each (split, seed) owns a disjoint block
    blocks = sorted(dataset_seed(s, seed) for s in ("train", "dev", "test") for seed in (0, 1, 2))
    assert all(b - a >= SEED_SPAN for a, b in itertools.pairwise(blocks))
    row = test[0]
    assert row["question"] and row["answer"] and isinstance(row["template"], int) and "####" in row["solution"]
    assert len({r["template"] for r in train}) > 50  # the templates are mixed, not one family


def test_reward_on_real_rows():
    spec = env_spec()
    rows = spec.split_tasks("dev", 20, 0)
    for row in rows:
        assert spec.reward.func(prediction=f"The total is \\boxed{{{row['answer']}}}.", answer=row["answer"])[
            "reward"] == 1.0
        wrong = str(float(row["answer"]) + 1)
        assert spec.reward.func(prediction=f"\\boxed{{{wrong}}}", answer=row["answer"])["reward"] == 0.0
        assert spec.reward.func(prediction="I am not sure.", answer=row["answer"])["reward"] == 0.0
    spec.reward.check_tasks(rows)


def test_solution_programs_print_the_gold():
    rows = generate_split("dev", 300, 3)
    assert solvable_fraction(rows) > 0.85
    for row in rows:
        program = solution_program(row)
        if program is None:
            continue
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(program, {})  # noqa: S102 - plain arithmetic assignments and one print
        assert printed.getvalue().strip() == row["answer"] == program_output(program), (program, row)


def test_demonstrations_render_with_tool_calls_as_actions():
    from agentfly_jax.rollout.templates import encode_conversation
    from agentfly_jax.rollout.tokenizers import build_qwen2_5_tokenizer

    spec = env_spec()
    rows = spec.split_tasks("train", 40, 0)
    demos = spec.demonstrations(rows, random.Random(0), 1.0)
    assert len(demos) == len(rows)
    with_tool = [d for d in demos if any(m.get("tool_calls") for m in d)]
    assert len(with_tool) >= 0.8 * len(demos)
    assert spec.demonstrations(rows, random.Random(0), 1.0) == demos  # deterministic in the rng
    guesses = spec.demonstrations(rows, random.Random(0), 0.0)
    assert not any(m.get("tool_calls") for d in guesses for m in d)
    assert sum(spec.reward.func(prediction=d[-1]["content"], answer=r["answer"])["reward"]
               for d, r in zip(guesses, rows)) == 0
    tokenizer = build_qwen2_5_tokenizer()
    for demo, row in zip(with_tool[:5], rows):
        demo_row = rows[demos.index(demo)]
        assert demo[0] == {"role": "system", "content": spec.system_prompt}
        code = demo[2]["tool_calls"][0]["function"]["arguments"]["code"]
        assert demo[3]["content"] == demo_row["answer"] and demo[-1]["content"].endswith(
            f"\\boxed{{{demo_row['answer']}}}")
        assert spec.reward.func(prediction=demo[-1]["content"], answer=demo_row["answer"])["reward"] == 1.0
        encoded = encode_conversation(tokenizer, demo, chat_template="qwen2.5")
        ids, mask = encoded.token_ids, encoded.action_mask
        action_text = tokenizer.decode([i for i, m in zip(ids, mask) if m])
        context_text = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
        assert "<tool_call>" in action_text and "code_interpreter" in action_text and "step1 =" in action_text
        assert code.splitlines()[-1].split("(")[0] == "print"
        assert demo_row["question"] in context_text and "<tool_response>" in context_text
        assert "<tool_response>" not in action_text and demo_row["question"] not in action_text
        assert f"\\boxed{{{demo_row['answer']}}}" in action_text


def test_spec_contents_and_errors():
    spec = load_env_spec("math_word", {"test_size": 10})
    assert spec.agent == "tool_calling" and [t.name for t in spec.tools] == ["code_interpreter"]
    assert spec.reward.name == "math_verify_match" and "\\boxed{}" in spec.system_prompt
    assert spec.pools["code_interpreter"]["kwargs"]["backend"] == "bwrap"
    with pytest.raises(ValueError, match="test_size=10"):
        spec.split_tasks("test", 11, 0)
    with pytest.raises(ValueError, match="no split"):
        spec.split_tasks("validation", 1, 0)
    with pytest.raises(ValueError, match="dev_size=0"):
        env_spec(dev_size=0)


def test_oracle_solves_and_random_is_lower_through_the_sandbox(loop):
    sandbox_helpers.require_backend(loop, "bwrap")
    spec = env_spec(pool_size=4)
    tasks = spec.split_tasks("test", 16, 0)
    tokenizer = scripted_tokenizer()
    oracle = loop.run_until_complete(
        evaluate(spec, lambda m: scripted_agent(spec, "oracle", m, tokenizer=tokenizer), tasks))
    assert oracle["success"] == 1.0, [row for row in oracle["per_task"] if row["reward"] < 1.0]
    assert oracle["tool_calls_mean"] == 1.0 and oracle["tool_errors_total"] == 0
    rand = loop.run_until_complete(
        evaluate(spec, lambda m: scripted_agent(spec, "random", m, tokenizer=tokenizer), tasks))
    assert rand["success"] <= 0.25 and rand["tool_calls_mean"] == 1.0 and rand["chain_errors"] == 0
