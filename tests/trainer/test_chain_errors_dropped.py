"""Chains that end in a runtime error (chain_error) are not trained on: the loop's rollout drops and counts them,
groups go on with the chains that remain, and a step with none left stops with the first error.

The rollouts are the real ToolCallingAgent and chain runner; the model is `FakeScriptedBackend` (a fake that
replays scripted text as tokens of the real Qwen tokenizer), whose script raises for the chains meant to fail.
"""

import asyncio
import collections
import types
from pathlib import Path

import numpy as np
import pytest

from agentfly_jax import algorithms
from agentfly_jax.rewards import reward
from agentfly_jax.rollout import Trajectory, trajectories_to_batch
from agentfly_jax.rollout.agents import ToolCallingAgent
from agentfly_jax.rollout.tokenizers import build_qwen2_5_tokenizer
from agentfly_jax.tools import calculator
from agentfly_jax.trainer import loop
from agentfly_jax.trainer.batch import NoChainsLeftError, drop_failed_chains
from agentfly_jax.trainer.config import TrainConfig
from experiments import quickstart
from tests.rollout.fakes import FakeScriptedBackend

TEMPLATE = Path(__file__).resolve().parent.parent / "rollout" / "data" / "qwen2_5.jinja"


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    return build_qwen2_5_tokenizer(tmp_path_factory.mktemp("qwen2_5_tokenizer"), TEMPLATE.read_text())


@reward
def says_yes(prediction: str) -> float:
    return 1.0 if "yes" in prediction else 0.0


# Per task, what each successive generate call does: a reply, or an error (the chain ends as chain_error).
PLANS = {
    "one fails": ["error", "yes"],  # a group that loses one of its two chains
    "signal": ["yes", "no"],
    "both fail": ["error", "error"],  # a group that loses both
    "flat": ["no", "no"],
}


def plan_script(plans):
    calls = collections.Counter()

    def script(prompt):
        step = plans[prompt.question][calls[prompt.question] % len(plans[prompt.question])]
        calls[prompt.question] += 1
        if step == "error":
            raise ConnectionError(f"engine lost the request for {prompt.question!r}")
        return step

    return script


def make_run(tokenizer, plans, **rl):
    c = quickstart.get_config()
    c.rl.update({"tasks_per_step": len(plans), "chains_per_task": 2, **rl})
    c.progress = False
    backend = FakeScriptedBackend(tokenizer, plan_script(plans))
    agent = ToolCallingAgent(backend, tokenizer, tools=[calculator], reward_fn=says_yes, chat_template="qwen2.5")
    return types.SimpleNamespace(config=TrainConfig.build(c), train_tasks=[{"question": q} for q in plans],
                                 agent=agent, runner=asyncio.Runner())


def by_question(trajectories):
    out = collections.defaultdict(list)
    for t in trajectories:
        out[next(m["content"] for m in t.messages if m["role"] == "user")].append(t)
    return out


def test_drop_failed_chains_splits_on_the_chain_error_flag_and_finish_reason():
    def trajectory(**fields):
        return Trajectory(token_ids=[1, 2], action_mask=[0, 1], sampler_logprobs=[0.0, -0.5], **fields)

    ok, flagged, errored, reward_failed = (trajectory(), trajectory(flags={"chain_error"}),
                                           trajectory(finish_reason="error"), trajectory(flags={"reward_failed"}))
    kept, dropped = drop_failed_chains([ok, flagged, errored, reward_failed])
    assert kept == [ok, reward_failed] and dropped == [flagged, errored]


def test_rollout_drops_and_counts_chains_that_ended_in_chain_error(qwen_tokenizer):
    run = make_run(qwen_tokenizer, PLANS)
    train_on, sampled, metrics = loop.rollout(run, step=0)
    assert run.agent.last_run_stats["chain_errors"] == 3  # the chain runner saw three errors ...
    assert metrics["rollout/chain_errors_dropped"] == 3.0  # ... and the loop dropped all three
    assert not any(t.chain_error for t in train_on + sampled)
    groups = by_question(train_on)
    assert sorted((q, len(ts)) for q, ts in groups.items()) == [("flat", 2), ("one fails", 1), ("signal", 2)]
    assert [t.reward for t in groups["one fails"]] == [1.0]


def test_the_group_baseline_uses_the_chains_that_remain(qwen_tokenizer):
    run = make_run(qwen_tokenizer, {"a": ["error", "yes", "no"], "b": ["no", "yes"]}, chains_per_task=3)
    train_on, _, metrics = loop.rollout(run, step=0)
    assert metrics["rollout/chain_errors_dropped"] == 1.0
    arrays = trajectories_to_batch(train_on)
    advantages = np.asarray(algorithms.grpo(arrays["rewards"], arrays["group_ids"], arrays["action_mask"]))
    for trajectories in by_question(train_on).values():
        rows = [train_on.index(t) for t in trajectories]
        rewards = arrays["rewards"][rows]
        expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)  # over the remaining chains only
        got = [advantages[row][arrays["action_mask"][row] > 0][0] for row in rows]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # the group that lost a chain: +-0.707 over its two remaining chains (the dropped chain's 0.0 reward would
    # have made the baseline 1/3 and the scores 1.15 / -0.58 / -0.58)
    assert sorted(len(ts) for ts in by_question(train_on).values()) == [2, 3]


def test_dynamic_sampling_never_trains_on_a_failed_chain(qwen_tokenizer):
    run = make_run(qwen_tokenizer, PLANS, dynamic_sampling=True, dynamic_sampling_max_rounds=0)
    train_on, sampled, metrics = loop.rollout(run, step=0)
    assert metrics["rollout/chain_errors_dropped"] == 3.0
    assert not any(t.chain_error for t in train_on + sampled)
    # "one fails" has one chain left: no reward signal, so it is a dropped group that fills the batch
    assert metrics["dynamic_sampling/groups_kept"] == 1.0 and metrics["dynamic_sampling/groups_dropped"] == 2.0


def test_a_step_whose_every_chain_failed_stops_with_the_first_error(qwen_tokenizer):
    run = make_run(qwen_tokenizer, {"x": ["error"], "y": ["error"]})
    with pytest.raises(NoChainsLeftError, match=r"RL step 5: all 4 chains ended in a runtime error .*ConnectionError: "
                                                r"engine lost the request"):
        loop.rollout(run, step=5)


def test_the_cli_says_a_step_without_chains_in_one_line(faked_cli, capsys):
    """agentfly-train ends such a run with status 1 and the error in one line ("training stopped: ..."), as it
    does a run stopped by non-finite steps (the run itself is faked: the test above checks the error)."""
    reason = ("RL step 0: all 4 chains ended in a runtime error (chain_error), so there is nothing to train on; "
              "the first error: the prompt has 6266 tokens")

    def no_chains(_config):
        raise NoChainsLeftError(reason)

    with pytest.raises(SystemExit) as stopped:
        faked_cli(no_chains)
    assert stopped.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"agentfly-train: training stopped: {reason}"


def test_fewer_chains_left_than_mini_batches_make_no_empty_mini_batch(qwen_tokenizer):
    """Four chains for four mini-batches, one fails: the step is split into three mini-batches of one
    trajectory each, not four with an empty one (whose zero gradient Adam's momentum would still apply)."""
    from agentfly_jax.trainer import builders

    run = make_run(qwen_tokenizer, {"one fails": ["error", "yes"], "signal": ["yes", "no"]}, mini_batches=4)
    try:
        train_on, _, metrics = loop.rollout(run, 0)
    finally:
        run.runner.close()
    assert len(train_on) == 3 and metrics["rollout/chain_errors_dropped"] == 1.0
    run.mesh, run.rules, run.state = builders.build_mesh(run.config), builders.sharding_rules(run.config), None
    run.policy, _ = builders.build_policy(run.config, qwen_tokenizer)  # make_batch reads its attention settings
    run.prepare_fn = lambda state, batch: (batch, {})  # the packed batch as prepare would receive it
    batch, _ = loop.make_batch(run, train_on, 0)
    assert batch.num_minibatches == 3
    assert sorted(np.bincount(np.asarray(batch.minibatch), minlength=3).tolist()) == [1, 1, 1]


def test_the_runner_closes_around_a_task_that_ignores_cancellation(tmp_path):
    """An abandoned call that swallows every cancellation would make `asyncio.Runner.close` wait forever; the
    trainer's close gives it a bounded time and closes the loop around it (a separate process: a regression
    hangs there, not here)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import asyncio, time
        from agentfly_jax.trainer.loop import close_runner

        async def stubborn():
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    continue

        async def start():
            asyncio.get_running_loop().create_task(stubborn())
            await asyncio.sleep(0.05)

        runner = asyncio.Runner()
        runner.run(start())
        t0 = time.monotonic()
        close_runner(runner, timeout_s=0.5)
        print("closed after", round(time.monotonic() - t0, 2))
        """
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seconds = float(proc.stdout.split()[-1])
    assert 0.4 <= seconds < 5.0, proc.stdout
    assert "ignored cancellation" in proc.stderr
