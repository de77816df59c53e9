"""Evaluation (environments/evaluation.py) of an EnvSpec on a small in-memory environment, and
scripts/eval_env.py on it through an import path.

A counter environment: the task names a target; `counter_add(n)` adds n; the reward is 1 when the counter
equals the target. The oracle adds the target in one call, the random policy adds random numbers.
"""

import asyncio
import importlib.util
import json
import random
from pathlib import Path

import pytest

from agentfly_jax.envs import Environment, StepResult
from agentfly_jax.envs.spec import EnvSpec
from agentfly_jax.rewards import reward
from agentfly_jax.tools import tool
from environments.evaluation import (
    ScriptedAgent,
    evaluate,
    scripted_agent,
    scripted_calls,
    summarize,
)


class CounterEnv(Environment):
    def __init__(self):
        self.value = 0
        self.resets = 0

    async def reset(self, task=None):
        self.value = 0
        self.resets += 1
        return "counter at 0"

    async def step(self, action):
        self.value += int(action)
        return StepResult(observation=f"counter at {self.value}", done=False)


@tool(name="counter_add", stateful=True, pool="counter")
async def counter_add(n: int, env: CounterEnv) -> str:
    """Add n to the counter.

    Args:
      n: the number to add.
    """
    return (await env.step(n)).observation


@reward(name="counter_reached", pool="counter")
def counter_reached(env: CounterEnv, target: int) -> float:
    return 1.0 if env.value == target else 0.0


def _tasks(split, num, seed):
    rng = random.Random(f"{split}/{seed}")
    return [{"question": f"Make the counter {t}.", "target": t} for t in (rng.randint(5, 50) for _ in range(num))]


def _oracle(task, rng):
    observation = yield {"name": "counter_add", "arguments": {"n": task["target"]}}
    assert observation == f"counter at {task['target']}", observation  # observations come back to the script
    return "done"


def _random(task, rng):
    for _ in range(2):
        yield {"name": "counter_add", "arguments": {"n": rng.randint(1, 3)}}
    return "done"


def _spec():
    return EnvSpec(name="counter", tasks=_tasks, tools=[counter_add], reward=counter_reached,
                   pools={"counter": {"factory": CounterEnv, "max_size": 2}}, oracle_policy=_oracle,
                   random_policy=_random, system_prompt="Reach the target.", agent="react", max_turns=5)


def counter_env_spec(*, with_random: bool = True):
    """The counter environment as an environment factory, for scripts/eval_env.py's import-path --env."""
    spec = _spec()
    if not with_random:
        spec.random_policy = None
    return spec


@pytest.fixture(scope="module")
def tokenizer():
    from environments.evaluation import scripted_tokenizer

    return scripted_tokenizer()


def test_oracle_and_random_through_the_real_rollout(tokenizer):
    spec = _spec()
    tasks = spec.tasks("test", 4, 0)
    oracle = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "oracle", m, tokenizer=tokenizer), tasks,
                                  num_chains=2))
    assert oracle["success"] == 1.0 and oracle["chains"] == 8
    assert oracle["turns_mean"] == 2.0 and oracle["tool_calls_mean"] == 1.0  # one call, one final answer
    assert oracle["tool_errors_total"] == 0
    # 8 chains through a pool of 2: instances are reused, never more than 2 alive.
    assert oracle["pools"]["counter"]["created"] <= 2 and oracle["pools"]["counter"]["acquires"] == 8
    rand = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "random", m, tokenizer=tokenizer), tasks))
    assert rand["success"] == 0.0  # two adds of 1..3 never reach a target >= 5


def test_unknown_tool_is_a_counted_tool_error(tokenizer):
    def bad(task, rng):
        yield {"name": "no_such_tool", "arguments": {}}
        return ""

    spec = _spec()
    spec.oracle_policy = bad
    summary = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "oracle", m, tokenizer=tokenizer),
                                   spec.tasks("test", 1, 0)))
    assert summary["tool_errors_total"] == 1 and summary["success"] == 0.0


def test_random_agent_is_reproducible_per_seed(tokenizer):
    spec = _spec()
    tasks = spec.tasks("test", 3, 0)

    def run(seed):
        out = asyncio.run(evaluate(spec, lambda m: scripted_agent(spec, "random", m, tokenizer=tokenizer,
                                                                   seed=seed), tasks))
        return [row["reward"] for row in out["per_task"]], out

    first, summary = run(5)
    assert run(5)[0] == first
    assert summary["per_task"][0]["tool_calls"] == 2


def test_spec_checks_pools_and_scripted_calls():
    with pytest.raises(ValueError, match="pool 'counter'"):
        EnvSpec(name="x", tasks=_tasks, tools=[counter_add], reward=counter_reached, pools={},
                oracle_policy=_oracle, random_policy=_random, system_prompt="")
    generator = scripted_calls([{"name": "a", "arguments": {}}], final_answer="42")
    assert next(generator) == {"name": "a", "arguments": {}}
    with pytest.raises(StopIteration) as stop:
        generator.send("obs")
    assert stop.value.value == "42"


def test_summarize_needs_trajectories():
    with pytest.raises(ValueError, match="no trajectories"):
        summarize([], 1.0)


def test_scripted_agent_needs_scripted_backend(tokenizer):
    with pytest.raises(TypeError, match="ScriptedBackend"):
        ScriptedAgent(_oracle, object(), tokenizer, tools=[counter_add], env_provider=object())


def test_scripted_agent_needs_the_policy(tokenizer):
    spec = counter_env_spec(with_random=False)
    with pytest.raises(ValueError, match="'counter' has no random policy"):
        scripted_agent(spec, "random", object(), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def eval_env():
    from tests.script_modules import load_script

    return load_script("eval_env", "eval_env_script")


ENV = "tests.environments.test_evaluation:counter_env_spec"


def test_eval_env_loads_an_environment_by_import_path(eval_env, capsys):
    summary = eval_env.main(["--env", ENV, "--agent", "oracle", "--num", "3", "--chains", "2"])
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert headline["env"] == "counter" and headline["success"] == 1.0 and summary["chains"] == 6
    summary = eval_env.main(["--env", ENV, "--agent", "random", "--num", "2", "--option", "with_random=true"])
    assert summary["success"] == 0.0 and summary["tool_calls_mean"] == 2.0


def test_eval_env_errors_name_what_was_wrong(eval_env):
    with pytest.raises(SystemExit, match="has no random policy"):
        eval_env.main(["--env", ENV, "--agent", "random", "--option", "with_random=false"])
    with pytest.raises(SystemExit, match="has no option 'with_randm'.*did you mean 'with_random'"):
        eval_env.main(["--env", ENV, "--option", "with_randm=false"])
    with pytest.raises(SystemExit, match="unknown environment 'no_such_env'"):
        eval_env.main(["--env", "no_such_env"])
    with pytest.raises(SystemExit, match="no split 'validation'"):
        eval_env.main(["--env", ENV, "--split", "validation"])


def test_eval_env_builds_the_agent_type_the_spec_names(eval_env):
    from agentfly_jax.rollout.agents import CodeAgent, ReactAgent, ToolCallingAgent

    spec = counter_env_spec()
    for name, cls in (("react", ReactAgent), ("tool_calling", ToolCallingAgent), ("code", CodeAgent),
                      ("environments.evaluation:ScriptedAgent", ScriptedAgent)):
        spec.agent = name
        assert eval_env.agent_class(spec) is cls
    spec.agent = "no_such_module:Agent"
    with pytest.raises(SystemExit, match="cannot be imported"):
        eval_env.agent_class(spec)
