"""Trajectory validation and its conversion to unpacked batch arrays."""

import math

import numpy as np
import pytest

from agentfly_jax.rollout.templates import ConversationEncoder
from agentfly_jax.rollout.trajectory import ToolCallRecord, Trajectory, trajectories_to_batch


def make_trajectory(length=5, sampled=(2, 3), **fields):
    mask = [1 if i in sampled else 0 for i in range(length)]
    logprobs = [-0.5 * (i + 1) if bit else 0.0 for i, bit in enumerate(mask)]
    values = dict(token_ids=list(range(10, 10 + length)), action_mask=mask, sampler_logprobs=logprobs)
    values.update(fields)
    return Trajectory(**values)


def test_valid_trajectory_keeps_its_fields():
    record = ToolCallRecord(turn=1, name="calculator", arguments={"expression": "1+1"}, observation="2")
    trajectory = make_trajectory(
        reward=1.5,
        reward_extras={"em": 1.0},
        group_id=3,
        num_turns=2,
        tool_calls=1,
        tool_call_records=[record],
        policy_version=7,
        finish_reason="length",
        metrics={"env_steps": 2},
        flags={"reward_failed"},
        messages=[{"role": "user", "content": "hi"}],
    )
    assert trajectory.length == 5
    assert trajectory.num_action_tokens == 2
    assert trajectory.reward == 1.5 and trajectory.group_id == 3 and trajectory.policy_version == 7
    assert "reward_failed" in trajectory.flags
    assert trajectory.tool_call_records[0].name == "calculator"


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(token_ids=[]), "token_ids is empty"),
        (dict(action_mask=[0, 0, 1]), "action_mask has 3 entries but token_ids has 5"),
        (dict(sampler_logprobs=[0.0] * 4), "sampler_logprobs has 4 entries but token_ids has 5"),
        (dict(action_mask=[0, 0, 2, 1, 0]), "action_mask must be 0 or 1, got 2 at position 2"),
        (dict(sampler_logprobs=[0.0, 0.0, -1.0, math.nan, 0.0]), "not finite at position 3"),
        (dict(sampler_logprobs=[-0.1, 0.0, -1.0, -1.0, 0.0]), "-0.1 at position 0 where action_mask is 0"),
        (dict(token_ids=[1, 2, -3, 4, 5]), "negative id at position 2"),
        (dict(reward=math.inf), "reward must be finite"),
        (dict(group_id=-1), "group_id must be a non-negative int"),
        (dict(num_turns=1.5), "num_turns must be a non-negative int"),
        (dict(policy_version=True), "policy_version must be a non-negative int"),
        (
            dict(tool_calls=2, tool_call_records=[ToolCallRecord(0, "a", {})]),
            "tool_calls is 2 but tool_call_records has 1",
        ),
        (dict(finish_reason=""), "finish_reason must be a non-empty string"),
    ],
)
def test_invalid_trajectory_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_trajectory(**fields)


def test_batch_arrays_are_padded_rows_with_positions_and_segments():
    short = make_trajectory(length=3, sampled=(1, 2), reward=1.0, group_id=0, policy_version=4)
    long = make_trajectory(length=70, sampled=(60, 61, 69), reward=-1.0, group_id=5, policy_version=5)
    batch = trajectories_to_batch([short, long], pad_id=99)
    assert batch["tokens"].shape == (2, 128)  # 70 rounded up to a multiple of 64
    expected_dtypes = {
        "tokens": np.int32,
        "positions": np.int32,
        "segment_ids": np.int32,
        "action_mask": np.float32,
        "sampler_logprobs": np.float32,
        "rewards": np.float32,
        "group_ids": np.int32,
        "lengths": np.int32,
        "policy_versions": np.int32,
        "policy_versions_max": np.int32,
    }
    assert {key: value.dtype for key, value in batch.items()} == expected_dtypes
    np.testing.assert_array_equal(batch["tokens"][0], [10, 11, 12] + [99] * 125)
    np.testing.assert_array_equal(batch["tokens"][1, :70], np.arange(10, 80))
    np.testing.assert_array_equal(batch["positions"][0], [0, 1, 2] + [0] * 125)
    np.testing.assert_array_equal(batch["positions"][1, :70], np.arange(70))
    np.testing.assert_array_equal(batch["segment_ids"].sum(axis=1), [3, 70])
    np.testing.assert_array_equal(batch["segment_ids"][1, 69:71], [1, 0])
    np.testing.assert_array_equal(batch["action_mask"][0, :4], [0, 1, 1, 0])
    np.testing.assert_array_equal(np.flatnonzero(batch["action_mask"][1]), [60, 61, 69])
    np.testing.assert_array_equal(batch["sampler_logprobs"][0, :4], np.float32([0, -1.0, -1.5, 0]))
    assert batch["sampler_logprobs"][1, 69] == np.float32(-35.0)
    assert batch["sampler_logprobs"][1, 70:].sum() == 0
    np.testing.assert_array_equal(batch["rewards"], [1.0, -1.0])
    np.testing.assert_array_equal(batch["group_ids"], [0, 5])
    np.testing.assert_array_equal(batch["lengths"], [3, 70])
    np.testing.assert_array_equal(batch["policy_versions"], [4, 5])
    np.testing.assert_array_equal(batch["policy_versions_max"], [4, 5])  # no token_versions: one version each


def test_bucket_and_pad_to():
    assert trajectories_to_batch([make_trajectory(length=64)])["tokens"].shape == (1, 64)
    assert trajectories_to_batch([make_trajectory(length=65)])["tokens"].shape == (1, 128)
    assert trajectories_to_batch([make_trajectory(length=5)], pad_to=7)["tokens"].shape == (1, 7)
    with pytest.raises(ValueError, match="trajectory 1 \\(group 4\\) has 9 tokens, more than pad_to=8"):
        trajectories_to_batch([make_trajectory(length=5), make_trajectory(length=9, group_id=4)], pad_to=8)
    with pytest.raises(ValueError, match="got no trajectories"):
        trajectories_to_batch([])


def test_trajectory_from_a_token_in_token_out_rollout(qwen_tokenizer):
    """The encoder's ids and mask become a Trajectory whose batch row reproduces them."""
    encoder = ConversationEncoder(qwen_tokenizer, chat_template="qwen2.5")
    encoder.start([{"role": "user", "content": "2+2?"}])
    sampled = qwen_tokenizer.encode("4<|im_end|>", add_special_tokens=False)
    sampled_logprobs = [-0.25, -0.01]
    encoder.append_assistant(sampled)
    encoded = encoder.encoded()
    logprobs = [0.0] * (len(encoded.token_ids) - len(sampled)) + sampled_logprobs
    trajectory = Trajectory(
        token_ids=encoded.token_ids,
        action_mask=encoded.action_mask,
        sampler_logprobs=logprobs,
        reward=1.0,
        num_turns=1,
        messages=encoder.messages,
    )
    batch = trajectories_to_batch([trajectory])
    row = batch["tokens"][0, : trajectory.length]
    assert qwen_tokenizer.decode(row[batch["action_mask"][0, : trajectory.length] == 1]) == "4<|im_end|>"
    np.testing.assert_allclose(batch["sampler_logprobs"][0][batch["action_mask"][0] == 1], sampled_logprobs)
