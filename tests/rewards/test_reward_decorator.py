"""@reward: fields by parameter name, binding errors before any rollout, sync/async/env-backed, failures as data."""

import asyncio
import math
from typing import Any

import pytest

from agentfly_jax.rewards import REWARD_REGISTRY, Reward, RewardBindingError, as_reward, reward
from agentfly_jax.tools import ToolContext
from tests.rollout.fakes import FakeEnvProvider


def score(reward_fn, prediction="", trajectory=None, task=None, context=None):
    return asyncio.run(reward_fn.score(prediction=prediction, trajectory=trajectory, task=task or {}, context=context))


def test_fields_by_parameter_name_and_runtime_values():
    seen = {}

    @reward
    def graded(prediction: str, trajectory, answer: str, difficulty: int = 1, task=None) -> float:
        seen.update(prediction=prediction, trajectory=trajectory, answer=answer, difficulty=difficulty, task=task)
        return 0.75

    assert graded.required_fields == ["answer"] and graded.optional_fields == ["difficulty"]
    assert REWARD_REGISTRY["graded"] is graded
    row = {"question": "q", "answer": "a", "unused": 1}
    result = score(graded, "pred", "TRAJ", row)
    assert (result.reward, result.ok, result.error) == (0.75, True, None)
    assert seen == {"prediction": "pred", "trajectory": "TRAJ", "answer": "a", "difficulty": 1, "task": row}
    score(graded, "p", None, {"question": "q", "answer": "a", "difficulty": 3})
    assert seen["difficulty"] == 3


def test_kwargs_reward_receives_every_field():
    @reward
    def everything(prediction, **fields):
        return {"reward": float(len(fields)), "names": sorted(fields)}

    result = score(everything, "x", task={"question": "q", "answer": 1})
    assert result.reward == 2.0 and result.extras == {"names": ["answer", "question"]}


def test_binding_names_the_missing_field_and_suggests_a_fix():
    @reward
    def misspelt(prediction: str, anwser: str) -> float:
        return 1.0

    with pytest.raises(RewardBindingError) as info:
        misspelt.bind({"question", "answer"})
    message = str(info.value)
    assert "reward 'misspelt' takes a parameter 'anwser'" in message
    assert "has no field 'anwser' (fields: answer, question)" in message
    assert "Did you mean 'answer'?" in message
    with pytest.raises(RewardBindingError, match="task 1 has no field 'anwser'"):
        misspelt.check_tasks([{"question": "q", "anwser": 1}, {"question": "q2", "answer": 2}])
    misspelt.check_tasks([{"question": "q", "anwser": 1}])

    @reward
    def optional_only(prediction: str, hint: str = "") -> float:
        return 1.0

    optional_only.bind({"question"})  # a parameter with a default is optional


def test_async_reward_and_dict_extras():
    @reward
    async def judged(prediction: str, answer: str) -> dict:
        await asyncio.sleep(0.01)
        return {"reward": 1.0 if prediction == answer else 0.0, "judge": "exact"}

    result = score(judged, "yes", task={"answer": "yes"})
    assert result.reward == 1.0 and result.extras == {"judge": "exact"} and result.ok


@pytest.mark.parametrize(
    "returned, fragment",
    [
        ("1.0", "returned str"),
        (None, "returned NoneType"),
        ({"score": 1.0}, "without a 'reward' key"),
        (math.nan, "returned nan"),
        (math.inf, "returned inf"),
    ],
)
def test_unusable_returns_give_zero_and_a_reason(returned, fragment):
    result = score(Reward(lambda prediction: returned, name="bad_return"), "x")
    assert (result.reward, result.ok) == (0.0, False)
    assert fragment in result.error


def test_raising_and_hanging_rewards_give_zero_not_an_exception():
    @reward
    def raises(prediction: str) -> float:
        raise KeyError("no such thing")

    result = score(raises, "x")
    assert (result.reward, result.ok) == (0.0, False)
    assert result.error == "reward 'raises' raised KeyError: 'no such thing'"

    @reward(timeout=0.05)
    async def hangs(prediction: str) -> float:
        await asyncio.sleep(10)
        return 1.0

    result = score(hangs, "x")
    assert (result.reward, result.ok) == (0.0, False) and "did not finish within 0.05 s" in result.error


def test_bool_and_numpy_like_returns_are_floats():
    class Scalar:
        def __float__(self):
            return 0.25

    assert score(Reward(lambda prediction: True), "x").reward == 1.0
    assert score(Reward(lambda prediction: Scalar()), "x").reward == 0.25


def test_env_backed_reward_scores_in_the_chains_environment():
    @reward(pool="sandbox")
    async def passes_tests(prediction: str, env: Any, tests: str) -> float:
        env.history.append(f"run {tests}")
        return 1.0 if prediction == "def f(): return 1" else 0.0

    provider = FakeEnvProvider()

    async def scenario():
        async with ToolContext({"tests": "t1"}, env_provider=provider, key="c") as context:
            env = await context.env("sandbox")
            env.history.append("tool call")
            result = await passes_tests.score(prediction="def f(): return 1", task=context.task, context=context)
            return result, env

    result, env = asyncio.run(scenario())
    assert result.reward == 1.0 and env.history == ["tool call", "run t1"]
    assert provider.acquired == provider.released == [("sandbox", "c")]
    no_context = score(passes_tests, "x", task={"tests": "t"})
    assert not no_context.ok and "needs the chain's context" in no_context.error


def test_definition_errors():
    with pytest.raises(TypeError, match="has an 'env' parameter but no pool"):
        reward(lambda prediction, env: 0.0)
    with pytest.raises(TypeError, match="no 'env' parameter"):
        reward(pool="p")(lambda prediction: 0.0)
    with pytest.raises(TypeError, match="cannot be passed by name"):
        reward(lambda prediction, *rest: 0.0)
    with pytest.raises(KeyError, match="no reward named 'nope'"):
        as_reward("nope")
    assert as_reward("math_match").name == "math_match"
    plain = as_reward(lambda prediction, answer: 1.0)
    assert isinstance(plain, Reward) and plain.required_fields == ["answer"]
