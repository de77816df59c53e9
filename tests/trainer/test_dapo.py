"""DAPO in the loop: dynamic sampling keeps the groups with reward signal (rolling out more tasks until the batch
is full, with a cap) and overlong shaping lowers the rewards of chains that ran into the length limit.

The rollouts here come from `FakeScriptedAgent`, a fake agent that returns the rewards each task scripts for its
chains: what is under test is the loop's selection, not sampling (the real agent and sampler run with dynamic
sampling on in tests/trainer/test_train_loop.py)."""
import asyncio
import types

import numpy as np
import pytest

from agentfly_jax.rollout import Trajectory
from agentfly_jax.trainer import loop
from agentfly_jax.trainer.config import ConfigError, TrainConfig
from experiments import quickstart


class FakeScriptedAgent:
    """Fake agent: chain c of a task gets reward task["rewards"][c]; counts its runs."""

    def __init__(self):
        self.runs, self.last_run_stats = [], {}

    async def run(self, tasks, num_chains, seed, progress):
        self.runs.append([task["name"] for task in tasks])
        out = []
        for index, task in enumerate(tasks):
            for chain in range(num_chains):
                out.append(Trajectory(token_ids=[1, 2, 3], action_mask=[0, 1, 1], sampler_logprobs=[0.0, -1.0, -1.0],
                                      reward=task["rewards"][chain], group_id=index,
                                      reward_extras={"task": task["name"]}))
        self.last_run_stats = {"chains": float(len(out)), "envs_in_use_peak": float(len(tasks)),
                               "turns_per_chain": 1.0}
        return out


def _run(tasks, **rl):
    c = quickstart.get_config()
    c.rl.update(dict(tasks_per_step=4, chains_per_task=2, **rl))
    c.progress = False
    return types.SimpleNamespace(config=TrainConfig.build(c), train_tasks=tasks, agent=FakeScriptedAgent(),
                                 runner=asyncio.Runner())


def _signal(name):
    return {"name": name, "rewards": [0.0, 1.0]}


def _flat(name, value=1.0):
    return {"name": name, "rewards": [value, value]}


def test_dynamic_sampling_keeps_groups_with_signal_until_the_batch_is_full():
    tasks = [_signal(f"s{i}") if i % 3 == 0 else _flat(f"f{i}", float(i % 2)) for i in range(30)]
    run = _run(tasks, dynamic_sampling=True, dynamic_sampling_max_rounds=20)
    train_on, sampled, metrics = loop.rollout(run, step=0)
    rounds = len(run.agent.runs)
    assert rounds >= 2 and metrics["dynamic_sampling/rounds"] == rounds
    assert all(len(set(names)) == len(names) for names in run.agent.runs)  # no task twice in a round
    assert len(sampled) == rounds * 4 * 2 and metrics["dynamic_sampling/chains_sampled"] == len(sampled)
    assert metrics["dynamic_sampling/groups_kept"] + metrics["dynamic_sampling/groups_dropped"] == rounds * 4
    assert metrics["dynamic_sampling/groups_kept"] >= 4 and metrics["dynamic_sampling/groups_filled"] == 0
    # exactly tasks_per_step groups, renumbered 0..3 (a task drawn twice would otherwise merge two groups), and
    # every one of them has reward signal
    assert len(train_on) == 8 and sorted({t.group_id for t in train_on}) == [0, 1, 2, 3]
    for group in range(4):
        members = [t for t in train_on if t.group_id == group]
        assert len(members) == 2 and len({t.reward for t in members}) == 2
        assert all(t.reward_extras["task"].startswith("s") for t in members)
    # the agent's statistics cover every round: counts add up, peaks take the max
    assert run.agent.last_run_stats["chains"] == len(sampled)
    assert run.agent.last_run_stats["envs_in_use_peak"] == 4 and run.agent.last_run_stats["turns_per_chain"] == 1


def test_dynamic_sampling_stops_at_the_cap_and_fills_with_dropped_groups():
    run = _run([_flat(f"f{i}") for i in range(10)] + [_signal("s")], dynamic_sampling=True,
               dynamic_sampling_max_rounds=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "_step_tasks", lambda run, step, extra_round=0: run.train_tasks[:4])  # never the signal task
        train_on, sampled, metrics = loop.rollout(run, step=3)
    assert len(run.agent.runs) == 3  # the first round and at most 2 more
    assert metrics == {"dynamic_sampling/rounds": 3.0, "dynamic_sampling/groups_kept": 0.0,
                       "dynamic_sampling/groups_dropped": 12.0, "dynamic_sampling/groups_filled": 4.0,
                       "dynamic_sampling/chains_sampled": 24.0, "rollout/chain_errors_dropped": 0.0,
                       # the agent's counters of the three rounds, combined
                       "rollout/chains": 24.0, "rollout/envs_in_use_peak": 4.0, "rollout/turns_per_chain": 1.0}
    assert len(train_on) == 8 and len(sampled) == 24
    assert sorted({t.group_id for t in train_on}) == [0, 1, 2, 3]


def test_without_dynamic_sampling_one_round_is_trained_on_as_sampled():
    run = _run([_flat(f"f{i}") for i in range(8)])
    train_on, sampled, metrics = loop.rollout(run, step=0)
    assert train_on is sampled and len(train_on) == 8 and len(run.agent.runs) == 1
    counters = {f"rollout/{k}": v for k, v in run.agent.last_run_stats.items()}
    assert metrics == {"rollout/chain_errors_dropped": 0.0, **counters}
    assert metrics["rollout/chains"] == 8.0  # the agent's counters of this very call


def test_extra_rounds_are_reproducible_for_a_resumed_run():
    tasks = [_signal(f"s{i}") if i % 4 == 0 else _flat(f"f{i}") for i in range(40)]
    first, second = (_run(tasks, dynamic_sampling=True, dynamic_sampling_max_rounds=5) for _ in range(2))
    loop.rollout(first, step=7)
    loop.rollout(second, step=7)
    assert first.agent.runs == second.agent.runs and len(first.agent.runs) > 1


def test_overlong_shaping_lowers_rewards_of_long_chains():
    run = _run([_flat("f")], overlong_buffer_len=10, overlong_max_len=30, overlong_penalty_factor=0.5)
    mask = np.zeros((4, 40), np.float32)
    for row, sampled in enumerate([5, 20, 25, 35]):
        mask[row, 2:2 + sampled] = 1.0
    arrays = {"action_mask": mask, "rewards": np.array([1.0, 1.0, 0.0, 1.0], np.float32)}
    metrics = loop.overlong_shaping(run, arrays)
    np.testing.assert_allclose(arrays["rewards"], [1.0, 1.0, -0.25, 0.5])  # 0, 0, half-way, beyond max_len
    assert arrays["rewards"].dtype == np.float32
    assert metrics == {"reward/overlong_penalty_mean": pytest.approx(-1.5 / 4), "reward/overlong_fraction": 0.5}
    assert loop.overlong_shaping(_run([_flat("f")]), arrays) == {}  # off by default


@pytest.mark.parametrize("rl,message", [
    ({"dynamic_sampling": True, "chains_per_task": 1}, "config.rl.dynamic_sampling=True with config.rl.chains_per_task=1"),
    ({"overlong_max_len": 100}, "config.rl.overlong_max_len has no effect without config.rl.overlong_buffer_len"),
    ({"overlong_penalty_factor": 0.5}, "config.rl.overlong_penalty_factor has no effect without"),
    ({"overlong_buffer_len": 200}, "config.rl.overlong_buffer_len=200 is longer than the overlong max_len 144"),
])
def test_dapo_knobs_that_cannot_work_are_refused(rl, message):
    c = quickstart.get_config()
    c.algorithm = "reinforce_pp"  # chains_per_task=1 is fine for it: the dynamic-sampling rule is what is hit
    c.rl.update(rl)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig.build(c)


def test_group_baseline_algorithms_refuse_groups_of_one():
    c = quickstart.get_config()
    c.rl.chains_per_task = 1
    for algorithm in ("grpo", "drgrpo", "gspo", "rloo", "reinforce_pp_baseline"):
        c.algorithm = algorithm
        with pytest.raises(ConfigError, match=f"chains_per_task=1 with algorithm '{algorithm}'"):
            TrainConfig.build(c)
    for algorithm in ("reinforce_pp", "ppo"):
        c.algorithm = algorithm
        TrainConfig.build(c)
