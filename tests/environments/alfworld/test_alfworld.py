"""ALFWorld on the real engine (TextWorld PDDL + ALFWorld's domain, grammar and demangler): every generated task
type is solved by the engine planner's expert plan through our tools, a random policy mostly fails, and the
builder is deterministic per seed."""

import asyncio
import filecmp
import json
import os

import pytest

pytest.importorskip("alfworld", reason="needs the envs extra: pip install -e '.[envs]'")

from agentfly_jax.envs import StepResult  # noqa: E402
from environments import alfworld  # noqa: E402
from environments.alfworld import build  # noqa: E402
from environments.evaluation import evaluate, scripted_agent, scripted_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("alfworld_suite")
    build.main(["--out", str(out), "--seed", "7", "--num", "12", "--test-fraction", "0.5"])
    return str(out)


@pytest.fixture(scope="module")
def tokenizer():
    return scripted_tokenizer()


def test_manifest_covers_every_task_type_in_both_splits(suite_dir):
    manifest = alfworld.load_manifest(suite_dir)
    assert len(manifest) == 12
    for split in ("train", "test"):
        assert {m["task_type"] for m in manifest if m["split"] == split} == set(alfworld.TASK_TYPES)
    for entry in manifest:
        assert set(entry) >= {"game_file", "task_type", "split", "expert_plan"}
        assert os.path.isfile(entry["game_file"]) and entry["expert_plan"]
    # held-out goals differ from the train goals
    goals = {split: {(m["task_type"], m["object"], m["receptacle"]) for m in manifest if m["split"] == split}
             for split in ("train", "test")}
    assert not goals["train"] & goals["test"]


def test_builder_is_deterministic_per_seed(suite_dir, tmp_path):
    build.main(["--out", str(tmp_path), "--seed", "7", "--num", "12", "--test-fraction", "0.5"])
    first, second = alfworld.load_manifest(suite_dir), alfworld.load_manifest(str(tmp_path))

    def relative(manifest, root):
        return [dict(m, game_file=os.path.relpath(m["game_file"], root)) for m in manifest]

    assert relative(first, suite_dir) == relative(second, str(tmp_path))
    for a, b in zip(first, second):
        assert filecmp.cmp(a["game_file"], b["game_file"], shallow=False)
    other = tmp_path / "other"
    build.main(["--out", str(other), "--seed", "8", "--num", "6"])
    assert [m["expert_plan"] for m in alfworld.load_manifest(str(other))] != [m["expert_plan"] for m in first[:6]]


def test_env_interface(suite_dir):
    entry = alfworld.load_manifest(suite_dir)[0]
    env = alfworld.ALFWorldEnv()

    async def play():
        try:
            observation = await env.reset({"game_file": entry["game_file"]})
            assert "Your task is to:" in observation and "Welcome to TextWorld, ALFRED" in observation
            assert entry["expert_plan"][0] in await env.admissible_commands()
            bad = await env.step("dance with the fridge")
            assert isinstance(bad, StepResult) and not bad.info["admissible"] and bad.reward == 0.0
            for command in entry["expert_plan"]:
                result = await env.step(command)
            assert result.done and result.reward == 1.0 and result.info["won"]
            with pytest.raises(ValueError, match="does not exist"):
                await env.reset({"game_file": "no/such/game.tw-pddl"})
        finally:
            await env.close()

    asyncio.run(play())


def test_expert_solves_every_task_type_through_the_tools(suite_dir, tokenizer):
    spec = alfworld.env_spec(suite_dir=suite_dir, pool_size=3)
    assert spec.agent == "react" and spec.splits == ("train", "test")
    rows = alfworld.task_rows(alfworld.load_manifest(suite_dir), "test") + \
        alfworld.task_rows(alfworld.load_manifest(suite_dir), "train")
    summary = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "oracle", m, tokenizer=tokenizer), rows))
    assert summary["success"] == 1.0, summary["per_task"]
    assert {row["task"]["task_type"] for row in summary["per_task"] if row["reward"] == 1.0} == set(alfworld.TASK_TYPES)
    assert summary["tool_errors_total"] == 0
    assert summary["pools"][alfworld.POOL]["created"] <= 3  # 12 chains on 3 reused instances


def test_random_policy_mostly_fails(suite_dir, tokenizer):
    spec = alfworld.env_spec(suite_dir=suite_dir, pool_size=3, random_steps=15)
    rows = alfworld.task_rows(alfworld.load_manifest(suite_dir), "test")
    summary = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "random", m, tokenizer=tokenizer, seed=1),
                                   rows))
    assert summary["success"] <= 0.34, summary["per_task"]
    assert summary["tool_calls_mean"] > 10  # it did play


def test_spec_rows_of_a_built_and_of_a_generated_suite(suite_dir):
    spec = alfworld.env_spec(suite_dir=suite_dir)
    assert spec.split_tasks("test", 0, 0) == alfworld.task_rows(alfworld.load_manifest(suite_dir), "test")  # all 6
    assert spec.split_tasks("train", 2, 0) == alfworld.task_rows(alfworld.load_manifest(suite_dir), "train")[:2]
    with pytest.raises(ValueError, match="has 6 test games, fewer than the 7"):
        spec.split_tasks("test", 7, 0)
    with pytest.raises(ValueError, match="no split 'dev'"):
        spec.split_tasks("dev", 1, 0)
    # Without suite_dir: the seed's generated suite of num_train_games + num_test_games games (cached), the
    # rows the trainer's "alfworld" task family built before EnvSpec for num_train=3, num_eval=2.
    generated = alfworld.env_spec(num_train_games=3, num_test_games=2)
    train, test = generated.split_tasks("train", 0, 0), generated.split_tasks("test", 0, 0)
    assert (len(train), len(test)) == (3, 2)
    manifest = alfworld.suite(3, 0, num_test=2)
    assert (train, test) == (alfworld.task_rows(manifest, "train")[:3], alfworld.task_rows(manifest, "test")[:2])
    with pytest.raises(ValueError, match="raise the option num_train_games"):
        generated.split_tasks("train", 4, 0)


def test_builder_cli_writes_manifest(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cli"
    result = subprocess.run([sys.executable, "-m", "environments.alfworld.build", "--out", str(out), "--seed", "1",
                             "--num", "2"], capture_output=True, text=True, timeout=300,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest) == 2 and all(m["expert_plan"] for m in manifest)
