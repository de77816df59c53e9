"""scripts/eval_env.py on the WebShop and search environments: the oracle agent succeeds on every held-out
task through the real rollout (ReAct turns, pooled environments, the environment's reward), the random
agent scores below it."""

import json
from pathlib import Path

import pytest

from tests.script_modules import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def eval_env():
    return load_script("eval_env", "eval_env_script")


@pytest.mark.slow
@pytest.mark.parametrize("env, num", [("webshop", 24), ("search", 40)])
def test_oracle_and_random_agents(eval_env, env, num, tmp_path, capsys):
    out = tmp_path / "oracle.json"
    oracle = eval_env.main(
        ["--env", env, "--agent", "oracle", "--split", "test", "--num", str(num), "--json", str(out)]
    )
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert headline["success"] == 1.0 and oracle["reward_mean"] == 1.0 and oracle["tasks"] == num
    assert oracle["tool_errors_total"] == 0 and oracle["chain_errors"] == 0 and oracle["reward_failures"] == 0
    assert oracle["pools"][env]["failures"] == 0 and oracle["tool_calls_mean"] >= 1
    assert len(json.loads(out.read_text())["per_task"]) == num
    random_agent = eval_env.main(["--env", env, "--agent", "random", "--split", "test", "--num", str(num)])
    assert random_agent["reward_mean"] < 0.5 and random_agent["chain_errors"] == 0


@pytest.mark.slow
def test_fanoutqa_oracle(eval_env):
    summary = eval_env.main(
        ["--env", "search", "--agent", "oracle", "--num", "8", "--option", "question_set=fanoutqa"]
    )
    assert summary["success"] == 1.0 and summary["tasks"] == 8
    assert summary["tool_calls_mean"] > 2  # multi-hop: it searches several evidence articles
