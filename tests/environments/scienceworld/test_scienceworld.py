"""ScienceWorld on the real simulator: gold paths through the tools reach reward 1, wrong play does not, a pool
of JVMs is reused across episodes, and a killed JVM is replaced without failing the rollout.

JVMs are shared per module (one env for the direct tests, one pool for the rollouts) and capped at 384 MB.
"""

import asyncio
import os
import signal

import pytest

pytest.importorskip("scienceworld", reason="needs the envs extra: pip install -e '.[envs]'")

from agentfly_jax.envs import ResourceManager, StepResult  # noqa: E402
from environments import scienceworld as sw  # noqa: E402
from environments.evaluation import evaluate, scripted_agent, scripted_calls, scripted_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

# Two tasks with short gold paths (from the test split: variation = the split's first).
GOLD_TASKS = ("find-living-thing", "use-thermometer")


@pytest.fixture(scope="module")
def tokenizer():
    return scripted_tokenizer()


@pytest.fixture(scope="module")
def gold_rows():
    rows = []
    for name in GOLD_TASKS:
        variation = sw.variations(name, "test")[0]
        description, gold = sw.describe(name, variation, True)
        rows.append({"task_name": name, "variation": variation, "question": description,
                     "gold_actions": list(gold)})
    return rows


@pytest.fixture(scope="module")
def env():
    environment = sw.ScienceWorldEnv()
    yield environment
    asyncio.run(environment.close())


def _spec(**overrides):
    spec = sw.env_spec(pool_size=2)
    for key, value in overrides.items():
        setattr(spec, key, value)
    return spec


def test_catalog_splits_and_rows_are_deterministic():
    assert len(sw.task_names()) == 30
    train, test = set(sw.variations("boil", "train")), set(sw.variations("boil", "test"))
    assert train and test and not train & test
    rows = sw.build_tasks("test", 3, seed=1, task_names=list(GOLD_TASKS))
    assert rows == sw.build_tasks("test", 3, seed=1, task_names=list(GOLD_TASKS))
    assert {r["task_name"] for r in rows} == set(GOLD_TASKS)
    assert all(r["variation"] in sw.variations(r["task_name"], "test") for r in rows)
    assert all(r["question"].startswith("Your task is") for r in rows)
    with pytest.raises(ValueError, match="unknown ScienceWorld split"):
        sw.build_tasks("validation", 1)


def test_spec_rows_are_lazy_and_match_the_trainer_rows():
    """600 train rows cost no simulator load until a row is used; they are the rows the ScienceWorld experiment
    built (`build_tasks("train", 600, seed, lazy=True)`), and the held-out rows are the eager ones."""
    spec = sw.env_spec(task_names="all")
    assert spec.agent == "react" and spec.splits == ("train", "dev", "test")
    before = sw.describe.cache_info()
    train, held_out = spec.split_tasks("train", 600, 0), spec.split_tasks("test", 60, 0)
    assert isinstance(train, sw.TaskRows) and len(train) == 600 and len(held_out) == 60
    assert sw.describe.cache_info().misses == before.misses  # nothing described yet
    assert train.pairs == sw.build_tasks("train", 600, 0, lazy=True).pairs
    row = train[599]
    assert row["split"] == "train" and row["variation"] in sw.variations(row["task_name"], "train")
    assert row["question"].startswith("Your task is")
    assert row["task_id"] == f"{row['task_name']}/{row['variation']}"
    assert train[599] == row and train[599] is not row  # a fresh dict each time, same content
    assert held_out[:2] == sw.build_tasks("test", 2, seed=0)  # the eager rows (a prefix: same order)
    assert len(set(train.pairs)) == 600 and not set(train.pairs) & set(held_out.pairs)
    with pytest.raises(IndexError):
        train[600]
    # num <= 0: every variation of the split; task names as a comma-separated option
    two = sw.env_spec(task_names="boil, melt")
    assert len(two.split_tasks("dev", 0, 0)) == len(sw.variations("boil", "dev")) + len(sw.variations("melt", "dev"))
    with pytest.raises(ValueError, match="no split 'validation'"):
        two.split_tasks("validation", 1, 0)


def test_env_interface_invalid_action_and_done(env, gold_rows):
    row = gold_rows[0]

    async def play():
        observation = await env.reset({"task_name": row["task_name"], "variation": row["variation"]})
        assert isinstance(observation, str) and "Your task is" in observation and "art studio" in observation
        bad = await env.step("fly to the moon")
        assert isinstance(bad, StepResult) and bad.info["invalid"] and not bad.done and bad.reward == 0.0
        results = [await env.step(action) for action in row["gold_actions"]]
        assert results[-1].done and results[-1].reward == 1.0 and "[The task is completed" in results[-1].observation
        after = await env.step("look around")
        assert after.done and "episode is over" in after.observation
        assert env.stats["invalid_actions"] == 1
        with pytest.raises(ValueError, match="variation"):
            await env.reset({"task_name": "boil"})

    asyncio.run(play())


def test_gold_paths_reach_reward_1_through_the_tools(tokenizer, gold_rows):
    spec = _spec()
    summary = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "oracle", m, tokenizer=tokenizer), gold_rows))
    assert summary["success"] == 1.0, summary["per_task"]
    assert [row["reward"] for row in summary["per_task"]] == [1.0, 1.0]
    assert summary["tool_errors_total"] == 0
    # every action went through the scienceworld_step tool
    assert summary["per_task"][0]["tool_calls"] == len(gold_rows[0]["gold_actions"])


def test_a_wrong_action_sequence_does_not(tokenizer, gold_rows):
    # Task 0 played with task 1's gold path, and task 0's gold path with its focus on the wrong thing.
    wrong_focus = [a if not a.startswith("focus on") else "focus on air" for a in gold_rows[0]["gold_actions"]]
    plans = {0: gold_rows[1]["gold_actions"], 1: wrong_focus}
    rows = [dict(gold_rows[0], plan=0), dict(gold_rows[0], plan=1)]
    spec = _spec(oracle_policy=lambda task, rng: scripted_calls(
        [{"name": "scienceworld_step", "arguments": {"action": a}} for a in plans[task["plan"]]], "Done."))
    summary = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "oracle", m, tokenizer=tokenizer), rows))
    rewards = [row["reward"] for row in summary["per_task"]]
    assert rewards[0] < 1.0 and rewards[1] == 0.0, summary["per_task"]
    assert summary["success"] == 0.0


def test_pool_four_concurrent_chains_reuse_their_jvms(tokenizer, gold_rows):
    """4 chains at once on a pool of 4, two rounds: 4 JVMs started, reused (reset, not respawned)."""
    created = []

    def factory(**kwargs):
        env = sw.ScienceWorldEnv(**kwargs)
        created.append(env)
        return env

    spec = _spec(pools={sw.POOL: dict(sw.POOL_CONFIG, factory=factory, max_size=4)})
    rows = [gold_rows[0], gold_rows[1]]

    async def rounds():
        manager = ResourceManager(spec.pools)
        try:
            pids, summaries = [], []
            for _ in range(2):
                agent = scripted_agent(spec, "oracle", manager, tokenizer=tokenizer)
                trajectories = await agent.run(rows, num_chains=2, progress=False)
                summaries.append([t.reward for t in trajectories])
                assert agent.last_run_stats["envs_in_use_peak"] == 4.0  # 4 chains ran concurrently
                while manager.metrics(sw.POOL)["recycling"]:
                    await asyncio.sleep(0.05)
                pids.append(sorted(env.engine.pid for env in created))
            return pids, summaries, manager.metrics(sw.POOL)
        finally:
            await manager.close()

    pids, summaries, metrics = asyncio.run(rounds())
    assert summaries == [[1.0] * 4, [1.0] * 4]
    assert metrics["created"] == 4 and metrics["acquires"] == 8 and metrics["destroyed"] == 0
    assert pids[0] == pids[1] and len(set(pids[0])) == 4  # the same 4 JVMs served both rounds
    assert all(env.stats["engine_starts"] == 1 for env in created)
    assert sum(env.stats["resets"] for env in created) == 8


def test_killed_jvm_is_replaced_without_failing_the_rollout(tokenizer, gold_rows):
    """The JVM is SIGKILLed mid-episode: the chain is told, the episode is restored, the gold path still wins."""
    created = []

    def factory(**kwargs):
        env = sw.ScienceWorldEnv(**kwargs)
        created.append(env)
        return env

    def killing_oracle(task, rng):
        gold = task["gold_actions"]
        for i, action in enumerate(gold):
            if i == 3:
                os.kill(created[0].engine.pid, signal.SIGKILL)
            observation = yield {"name": "scienceworld_step", "arguments": {"action": action}}
            if observation.startswith("[environment restarted]"):
                observation = yield {"name": "scienceworld_step", "arguments": {"action": action}}
        return "Done."

    spec = _spec(pools={sw.POOL: dict(sw.POOL_CONFIG, factory=factory, max_size=1)}, oracle_policy=killing_oracle)
    summary = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "oracle", m, tokenizer=tokenizer),
                                   [gold_rows[0]]))
    row = summary["per_task"][0]
    assert row["reward"] == 1.0 and row["finish_reason"] == "stop", row
    assert row["tool_calls"] == len(gold_rows[0]["gold_actions"]) + 1  # the lost action was sent again
    env = created[0]
    assert env.stats["engine_crashes"] == 1 and env.stats["engine_restarts"] == 1 and env.stats["engine_starts"] == 2
    assert summary["pools"][sw.POOL]["created"] == 1  # replaced inside the instance; the pool saw no failure


def test_dead_idle_instance_is_replaced_by_the_pool():
    async def run():
        manager = ResourceManager({sw.POOL: dict(sw.POOL_CONFIG, max_size=1)})
        try:
            async with manager.acquire(sw.POOL) as env:
                await env.reset({"task_name": "find-plant", "variation": 0})
                first = env
            while manager.metrics(sw.POOL)["recycling"]:
                await asyncio.sleep(0.05)
            os.kill(first.engine.pid, signal.SIGKILL)
            first.engine.process.wait(timeout=10)
            async with manager.acquire(sw.POOL) as env:
                observation = await env.reset({"task_name": "find-plant", "variation": 0})
                assert "Your task is" in observation
            return manager.metrics(sw.POOL), first, env
        finally:
            await manager.close()

    metrics, first, second = asyncio.run(run())
    # Either the instance restarted its own JVM on reset, or the pool replaced it after a failed health check.
    assert (second is first and first.stats["engine_starts"] == 2) or metrics["unhealthy"] + metrics["failures"] >= 1


def test_memory_per_instance_is_capped(env):
    asyncio.run(env.reset({"task_name": "boil", "variation": 0}))
    rss_mb = env.engine.rss_bytes() / 2**20
    assert 50 < rss_mb < 450, rss_mb  # -Xmx384m -XX:+UseSerialGC: ≈ 250-300 MB resident
