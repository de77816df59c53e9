"""Per-token weight versions: Completion.token_versions through the chain into the Trajectory and its batch arrays.

The chains run on the scripted fake backend (tests/rollout/fakes.py) with the real Qwen2.5 tokenizer and template;
the expected versions come from what the backend returned for each turn, matched to the trajectory's sampled
segments token by token.
"""

import asyncio
import dataclasses

import numpy as np
import pytest

from agentfly_jax.rollout.agents import ToolCallingAgent
from agentfly_jax.rollout.backends.base import Completion
from agentfly_jax.rollout.trajectory import Trajectory, trajectories_to_batch
from agentfly_jax.tools import tool
from tests.rollout.fakes import FakeScriptedBackend, tool_call_text

QWEN = "qwen2.5"


def run(agent, tasks, num_chains=1):
    return asyncio.run(agent.run(tasks, num_chains=num_chains, progress=False))


def sampled_segments(trajectory):
    """(start, end) of every run of action_mask == 1, in order."""
    mask = np.asarray(trajectory.action_mask)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2], edges[1::2]))


class RecordingBackend(FakeScriptedBackend):
    """The fake backend, keeping every completion it returned; with `split_turn` set, that turn's completion
    reports weights swapped half-way through it (its second half sampled by version + 1), as a partial rollout
    does."""

    def __init__(self, *args, split_turn=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.split_turn = split_turn
        self.returned: list[Completion] = []

    async def generate(self, prompt_token_ids, **options):
        [completion] = await super().generate(prompt_token_ids, **options)
        if self._prompt(list(prompt_token_ids)).turn == self.split_turn:
            half = len(completion.token_ids) // 2
            old = completion.weight_version
            completion = dataclasses.replace(
                completion, token_versions=[old] * half + [old + 1] * (len(completion.token_ids) - half)
            )
        self.returned.append(completion)
        return [completion]


def test_a_chain_whose_weights_change_between_and_within_turns(qwen_tokenizer):
    """Three turns; a tool bumps the weights between turns (update_weights, as the trainer would) and the
    second turn's weights were swapped mid-turn: every sampled token carries the version the backend reported
    for it, every other token -1; policy_version is the oldest, policy_version_max the newest."""
    replies = [tool_call_text("bump", {}), tool_call_text("bump", {}), "done"]

    @tool
    async def bump() -> str:
        """Moves the served weights on by two versions."""
        await backend.update_weights(None, backend.weight_version + 2)
        return "ok"

    backend = RecordingBackend(
        qwen_tokenizer, lambda prompt: replies[prompt.turn], report_weight_version=True, split_turn=1
    )
    backend.weight_version = 3
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[bump], chat_template=QWEN)
    [trajectory] = run(agent, [{"question": "q"}])
    assert trajectory.num_turns == 3 and trajectory.finish_reason == "stop"
    assert backend.weight_updates == [(5, False), (7, False)]

    returned = backend.returned
    assert [c.weight_version for c in returned] == [3, 5, 7]
    assert set(returned[1].token_versions) == {5, 6}  # the split turn really has two versions
    expected = [-1] * trajectory.length
    segments = sampled_segments(trajectory)
    assert len(segments) == 3
    for (start, end), completion in zip(segments, returned):
        assert trajectory.token_ids[start:end] == completion.token_ids  # aligned with the tokens
        expected[start:end] = completion.token_versions
    assert trajectory.token_versions == expected
    assert (trajectory.policy_version, trajectory.policy_version_max) == (3, 7)
    assert (trajectory.metrics["policy_version_min"], trajectory.metrics["policy_version_max"]) == (3, 7)

    batch = trajectories_to_batch([trajectory])
    np.testing.assert_array_equal(batch["policy_versions"], [3])
    np.testing.assert_array_equal(batch["policy_versions_max"], [7])


def test_without_reported_versions_each_turn_gets_the_version_served_at_its_request(qwen_tokenizer):
    def script(prompt):
        backend.weight_version += 1  # new weights arrive while each turn is sampled
        return tool_call_text("noop", {}) if prompt.turn < 2 else "done"

    @tool
    def noop() -> str:
        """Does nothing."""
        return "ok"

    backend = RecordingBackend(qwen_tokenizer, script)
    backend.weight_version = 4
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[noop], chat_template=QWEN)
    [trajectory] = run(agent, [{"question": "q"}])
    assert all(c.token_versions is None for c in backend.returned)
    versions = np.asarray(trajectory.token_versions)
    for (start, end), served in zip(sampled_segments(trajectory), [4, 5, 6]):
        assert set(versions[start:end]) == {served}
    assert set(versions[np.asarray(trajectory.action_mask) == 0]) == {-1}
    assert (trajectory.policy_version, trajectory.policy_version_max) == (4, 6)


def test_versions_stay_aligned_when_an_overflowing_observation_is_cut(qwen_tokenizer):
    @tool
    def flood() -> str:
        """Floods the context."""
        return "z " * 400

    backend = RecordingBackend(
        qwen_tokenizer, lambda p: tool_call_text("flood", {}), report_weight_version=True
    )
    backend.weight_version = 9
    agent = ToolCallingAgent(
        backend, qwen_tokenizer, tools=[flood], chat_template=QWEN, max_context_tokens=300
    )
    [trajectory] = run(agent, [{"question": "q"}])
    assert trajectory.finish_reason == "max_context" and trajectory.num_turns == 1
    assert len(trajectory.token_versions) == trajectory.length <= 300
    [(start, end)] = sampled_segments(trajectory)
    assert end == trajectory.length  # the observation was cut off, the sampled turn kept
    assert trajectory.token_versions[start:] == [9] * (end - start)
    assert trajectory.token_versions[:start] == [-1] * start


# --------------------------------------------------------------------------------------------------
# Trajectory and Completion fields
# --------------------------------------------------------------------------------------------------


def make(token_versions=None, **fields):
    return Trajectory(
        token_ids=[10, 11, 12, 13, 14, 15],
        action_mask=[0, 1, 1, 0, 1, 1],
        sampler_logprobs=[0.0, -0.1, -0.2, 0.0, -0.3, -0.4],
        token_versions=token_versions,
        **fields,
    )


def test_trajectory_versions_are_derived_and_checked():
    mixed = make([-1, 4, 4, -1, 5, 6])
    assert (mixed.policy_version, mixed.policy_version_max) == (4, 6)
    assert dataclasses.replace(mixed) == mixed  # the derived fields validate when given back explicitly
    legacy = make(policy_version=7)  # no per-token versions: every sampled token is policy_version's
    assert legacy.token_versions == [-1, 7, 7, -1, 7, 7] and legacy.policy_version_max == 7
    prompt_only = Trajectory(
        token_ids=[1, 2], action_mask=[0, 0], sampler_logprobs=[0.0, 0.0], policy_version=3
    )
    assert prompt_only.token_versions == [-1, -1] and prompt_only.policy_version_max == 3

    batch = trajectories_to_batch([mixed, legacy, prompt_only])
    np.testing.assert_array_equal(batch["policy_versions"], [4, 7, 3])
    np.testing.assert_array_equal(batch["policy_versions_max"], [6, 7, 3])
    assert batch["policy_versions_max"].dtype == np.int32


@pytest.mark.parametrize(
    "token_versions, fields, message",
    [
        ([-1, 4, 4, -1, 5], {}, "token_versions has 5 entries but token_ids has 6"),
        ([-1, 4, -1, -1, 5, 5], {}, "token_versions is -1 at position 2 where action_mask is 1"),
        ([0, 4, 4, -1, 5, 5], {}, "token_versions is 0 at position 0 where action_mask is 0"),
        ([-1, 4, 4.5, -1, 5, 5], {}, "token_versions must be ints, got 4.5 at position 2"),
        ([-1, 4, 4, -1, 5, 6], {"policy_version": 5}, "policy_version is 5 but the oldest version"),
        ([-1, 4, 4, -1, 5, 6], {"policy_version_max": 5}, "policy_version_max is 5 but the newest version"),
        (
            None,
            {"policy_version": 4, "policy_version_max": 6},
            "policy_version_max is 6 but the newest version",
        ),
        (None, {"policy_version_max": -2}, "policy_version_max must be a non-negative int"),
    ],
)
def test_inconsistent_versions_name_the_problem(token_versions, fields, message):
    with pytest.raises(ValueError, match=message):
        make(token_versions, **fields)


def test_completion_token_versions():
    completion = Completion([5, 6, 7], [-0.1, -0.2, -0.3], "stop", token_versions=(2, 2, 3))
    assert completion.weight_version == 2  # the first token's, filled in
    assert Completion([5], [-0.1], "stop", weight_version=4).token_versions is None
    with pytest.raises(ValueError, match="3 token ids but 2 token_versions"):
        Completion([5, 6, 7], [-0.1, -0.2, -0.3], "stop", token_versions=[1, 1])
    with pytest.raises(ValueError, match="non-negative ints"):
        Completion([5], [-0.1], "stop", token_versions=[-1])
    with pytest.raises(ValueError, match="weight_version=1 but its first token was sampled by version 2"):
        Completion([5, 6], [-0.1, -0.2], "stop", weight_version=1, token_versions=[2, 2])
