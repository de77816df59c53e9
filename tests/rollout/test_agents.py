"""Agents end to end on a scripted fake backend with the real Qwen2.5 tokenizer and template.

The trajectories are checked against an independent encoding of the same conversation
(`encode_conversation`) and against what the fake backend actually returned, token by token.
"""

import asyncio
import logging
from typing import Any

import pytest

from agentfly_jax.rewards import RewardBindingError, math_match, reward
from agentfly_jax.rollout import encode_conversation
from agentfly_jax.rollout.agents import BaseAgent, CodeAgent, ReactAgent, ToolCallingAgent
from agentfly_jax.tools import TOOL_ERROR_KINDS, calculator, tool
from tests.rollout.fakes import FakeEnvProvider, FakeScriptedBackend, fake_logprob, tool_call_text

QWEN = "qwen2.5"


def run(agent, tasks, num_chains=1, **kwargs):
    kwargs.setdefault("progress", False)
    return asyncio.run(agent.run(tasks, num_chains=num_chains, **kwargs))


def scripted(replies):
    """A script giving the reply for each turn from a list (the last one repeats)."""
    return lambda prompt: replies[min(prompt.turn, len(replies) - 1)]


@tool
def add(a: int, b: int = 0) -> str:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return str(a + b)


@tool
async def explode(reason: str) -> str:
    """Always raises."""
    raise RuntimeError(f"boom: {reason}")


@tool(timeout=0.05)
async def hang() -> str:
    """Never finishes on its own."""
    await asyncio.sleep(30)
    return ""


@tool(max_observation_chars=50)
def huge() -> str:
    """A very long output."""
    return "y" * 500


@tool(stateful=True, pool="broken_pool")
async def broken_env_tool(env: Any) -> str:
    """Needs an environment from a pool that always fails."""
    return "never"


@tool
def broken_image() -> list:
    """Returns an image whose bytes are not an image."""
    return [{"type": "text", "text": "here:"}, {"type": "image", "image": b"not an image"}]


# --------------------------------------------------------------------------------------------------
# Token-in/token-out trajectories
# --------------------------------------------------------------------------------------------------


def test_trajectory_is_exactly_the_sampled_tokens_with_masks_and_logprobs(qwen_tokenizer):
    replies = [
        "I will compute it.\n" + tool_call_text("calculator", {"expression": "2+3"}),
        "So the answer is \\boxed{5}.",
    ]
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(replies))
    agent = ToolCallingAgent(
        backend, qwen_tokenizer, tools=[calculator], reward_fn=math_match, chat_template=QWEN, system_prompt="Be exact."
    )
    [trajectory] = run(agent, [{"question": "What is 2+3?", "answer": "5"}])

    assert (trajectory.finish_reason, trajectory.num_turns, trajectory.tool_calls) == ("stop", 2, 1)
    assert trajectory.reward == 1.0 and trajectory.reward_extras == {"extracted": "5"}
    record = trajectory.tool_call_records[0]
    assert (record.turn, record.name, record.arguments, record.observation, record.error) == (
        0, "calculator", {"expression": "2+3"}, "5", None,
    )
    # Independent reference: the whole conversation encoded in one go (it ends with Qwen's "\n").
    reference = encode_conversation(
        qwen_tokenizer, trajectory.messages, tools=[calculator.schema], chat_template=QWEN
    )
    assert trajectory.token_ids == reference.token_ids[:-1]
    assert trajectory.action_mask == reference.action_mask[:-1]
    assert trajectory.messages[0] == {"role": "system", "content": "Be exact."}
    assert trajectory.messages[2]["content"] == replies[0]
    assert trajectory.messages[3] == {"role": "tool", "content": "5"}

    # Each generate call saw the trajectory so far; what it returned follows with mask 1 and its logprobs.
    for call, reply in zip(backend.calls, replies):
        start = len(call["prompt_ids"])
        assert trajectory.token_ids[:start] == call["prompt_ids"]
        sampled = qwen_tokenizer.encode(reply, add_special_tokens=False) + [backend.stop_id]
        assert trajectory.token_ids[start : start + len(sampled)] == sampled
        assert trajectory.action_mask[start : start + len(sampled)] == [1] * len(sampled)
        assert trajectory.sampler_logprobs[start : start + len(sampled)] == pytest.approx(
            [fake_logprob(i) for i in range(len(sampled))]
        )
    sampled_total = sum(len(qwen_tokenizer.encode(r, add_special_tokens=False)) + 1 for r in replies)
    assert trajectory.num_action_tokens == sampled_total
    assert all(lp == 0.0 for lp, bit in zip(trajectory.sampler_logprobs, trajectory.action_mask) if not bit)


def test_jinja_template_gives_the_same_trajectory_as_the_named_one(qwen_tokenizer):
    replies = [tool_call_text("add", {"a": 1, "b": 2}), "\\boxed{3}"]
    trajectories = []
    for template in (QWEN, None):  # None: the tokenizer's own Jinja template
        backend = FakeScriptedBackend(qwen_tokenizer, scripted(replies))
        agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[add], chat_template=template)
        trajectories.append(run(agent, [{"question": "1+2?"}])[0])
    named, jinja = trajectories
    assert named.token_ids == jinja.token_ids and named.action_mask == jinja.action_mask
    assert named.finish_reason == jinja.finish_reason == "stop"


def test_group_ids_seeds_and_order(qwen_tokenizer):
    backend = FakeScriptedBackend(qwen_tokenizer, lambda prompt: f"answer to {prompt.question}")
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[add], chat_template=QWEN)
    tasks = [{"question": "first"}, {"question": "second", "id": 17}, {"question": "third", "id": "abc"}]
    trajectories = run(agent, tasks, num_chains=2, seed=7)
    assert [t.group_id for t in trajectories] == [0, 0, 17, 17, 2, 2]
    assert trajectories[4].metrics["task_id"] == "abc"
    questions = [t.messages[-2]["content"] for t in trajectories]
    assert questions == ["first", "first", "second", "second", "third", "third"]
    seeds = [call["seed"] for call in backend.calls]
    assert len(set(seeds)) == 6 and all(isinstance(seed, int) for seed in seeds)
    run(agent, tasks, num_chains=2, seed=7)
    assert sorted(call["seed"] for call in backend.calls[6:]) == sorted(seeds)  # reproducible
    run(agent, tasks, num_chains=2)
    assert [call["seed"] for call in backend.calls[12:]] == [None] * 6


def test_policy_version_of_the_first_turn_with_min_max_in_metrics(qwen_tokenizer):
    def script(prompt):
        backend.weight_version += 1  # new weights arrive while each turn is sampled
        return tool_call_text("add", {"a": 1}) if prompt.turn < 2 else "done"

    backend = FakeScriptedBackend(qwen_tokenizer, script)
    backend.weight_version = 4
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[add], chat_template=QWEN)
    [trajectory] = run(agent, [{"question": "q"}])
    assert trajectory.policy_version == 4
    assert (trajectory.metrics["policy_version_min"], trajectory.metrics["policy_version_max"]) == (4, 6)

    # A backend that reports the version that sampled each completion is believed over the one read before.
    backend = FakeScriptedBackend(qwen_tokenizer, script, report_weight_version=True)
    backend.weight_version = 4
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[add], chat_template=QWEN)
    [trajectory] = run(agent, [{"question": "q"}])
    assert trajectory.policy_version == 5
    assert (trajectory.metrics["policy_version_min"], trajectory.metrics["policy_version_max"]) == (5, 7)


# --------------------------------------------------------------------------------------------------
# Failures are data: every tool error kind, and the chain keeps going
# --------------------------------------------------------------------------------------------------

ERROR_TURNS = [
    ("unknown_tool", tool_call_text("teleport", {"to": "moon"}), "unknown tool 'teleport'"),
    ("bad_json", '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "not valid JSON"),
    ("parse_error", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', "tool call has no name"),
    ("bad_arguments", tool_call_text("add", {"a": "one"}), "argument 'a' must be integer"),
    ("tool_exception", tool_call_text("explode", {"reason": "test"}), "raised RuntimeError: boom: test"),
    ("timeout", tool_call_text("hang", {}), "did not finish within 0.05 s"),
    ("oversized", tool_call_text("huge", {}), "[observation truncated"),
    ("env_error", tool_call_text("broken_env_tool", {}), "pool 'broken_pool' is full"),
    ("bad_image", tool_call_text("broken_image", {}), "returned an image that cannot be used (part 1)"),
]


def test_chain_keeps_going_after_every_tool_error_kind(qwen_tokenizer, caplog):
    assert {kind for kind, _, _ in ERROR_TURNS} == set(TOOL_ERROR_KINDS)
    replies = [text for _, text, _ in ERROR_TURNS] + ["Recovered: \\boxed{3}"]
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(replies))
    agent = ToolCallingAgent(
        backend,
        qwen_tokenizer,
        tools=[add, explode, hang, huge, broken_env_tool, broken_image],
        reward_fn=math_match,
        chat_template=QWEN,
        env_provider=FakeEnvProvider(fail_pools={"broken_pool"}),
        max_turns=20,
        max_context_tokens=16384,
    )
    with caplog.at_level("WARNING", logger="agentfly_jax.rollout.chain"):
        [trajectory] = run(agent, [{"question": "1+2?", "answer": 3}])
    assert trajectory.finish_reason == "stop" and trajectory.num_turns == len(replies)
    assert trajectory.reward == 1.0
    assert [record.error.split(":")[0] for record in trajectory.tool_call_records] == [k for k, _, _ in ERROR_TURNS]
    # the user's tool raising is logged (its first time in a rollout); the model's own bad calls are only counted
    raised = [r.getMessage() for r in caplog.records if "raised RuntimeError: boom: test" in r.getMessage()]
    assert len(raised) == 1 and "tool 'explode' raised" in raised[0], caplog.text
    for kind in TOOL_ERROR_KINDS:
        assert trajectory.metrics[f"tool_errors/{kind}"] == 1
        assert agent.last_run_stats[f"tool_errors/{kind}"] == 1
    assert trajectory.metrics["tool_errors"] == len(ERROR_TURNS)
    # The model saw each failure as an observation in its next prompt.
    for turn, (_, _, fragment) in enumerate(ERROR_TURNS):
        next_prompt = qwen_tokenizer.decode(backend.calls[turn + 1]["prompt_ids"])
        assert fragment in next_prompt.rsplit("<tool_response>", 1)[1]


def test_several_calls_in_a_turn_return_in_order(qwen_tokenizer):
    replies = [
        "\n".join(tool_call_text("add", {"a": i, "b": 10}) for i in range(3)) + "\n" + tool_call_text("nope", {}),
        "fine",
    ]
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(replies))
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[add], chat_template=QWEN)
    [trajectory] = run(agent, [{"question": "q"}])
    assert [m["content"] for m in trajectory.messages if m["role"] == "tool"][:3] == ["10", "11", "12"]
    assert trajectory.tool_calls == 4 and trajectory.metrics["tool_errors/unknown_tool"] == 1


# --------------------------------------------------------------------------------------------------
# Finish reasons
# --------------------------------------------------------------------------------------------------


def test_max_turns(qwen_tokenizer):
    backend = FakeScriptedBackend(qwen_tokenizer, lambda prompt: tool_call_text("add", {"a": prompt.turn}))
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[add], chat_template=QWEN, max_turns=5)
    [three] = run(agent, [{"question": "q"}], max_turns=3)
    assert (three.finish_reason, three.num_turns, three.tool_calls) == ("max_turns", 3, 3)
    # The last turn's calls still ran (side effects count); their results close the conversation.
    assert three.messages[-1] == {"role": "tool", "content": "2"}
    [five] = run(agent, [{"question": "q"}])
    assert (five.finish_reason, five.num_turns) == ("max_turns", 5)


def test_length_and_max_context(qwen_tokenizer):
    long_reply = "word " * 60
    backend = FakeScriptedBackend(qwen_tokenizer, scripted([long_reply]))
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[add], chat_template=QWEN, max_new_tokens=20)
    [cut] = run(agent, [{"question": "q"}])
    assert cut.finish_reason == "length" and cut.num_action_tokens == 20

    prompt_length = len(backend.calls[0]["prompt_ids"])
    agent = ToolCallingAgent(
        backend, qwen_tokenizer, tools=[add], chat_template=QWEN, max_context_tokens=prompt_length + 10
    )
    [full] = run(agent, [{"question": "q"}])
    assert full.finish_reason == "max_context" and full.length == prompt_length + 10
    assert backend.calls[-1]["max_tokens"] == 10

    # An observation that does not fit ends the chain at its last sampled turn.
    @tool
    def flood() -> str:
        """Floods the context."""
        return "z " * 400

    backend = FakeScriptedBackend(qwen_tokenizer, scripted([tool_call_text("flood", {}), "done"]))
    agent = ToolCallingAgent(
        backend, qwen_tokenizer, tools=[flood], chat_template=QWEN, max_context_tokens=prompt_length + 300
    )
    [flooded] = run(agent, [{"question": "q"}])
    assert flooded.finish_reason == "max_context" and flooded.num_turns == 1
    assert flooded.length <= prompt_length + 300
    assert flooded.token_ids[-1] == backend.stop_id and flooded.action_mask[-1] == 1


def test_a_failing_chain_is_flagged_and_the_others_finish(qwen_tokenizer, caplog):
    def script(prompt):
        if "fail" in prompt.question:
            raise ConnectionError("engine went away")
        return "\\boxed{1}"

    backend = FakeScriptedBackend(qwen_tokenizer, script)
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[add], reward_fn=math_match, chat_template=QWEN)
    with caplog.at_level(logging.WARNING):
        good, bad = run(agent, [{"question": "ok", "answer": 1}, {"question": "fail", "answer": 1}])
    assert (good.finish_reason, good.reward) == ("stop", 1.0)
    assert bad.finish_reason == "error" and "chain_error" in bad.flags
    assert bad.metrics["error"] == "ConnectionError: engine went away"
    assert bad.num_turns == 0 and bad.num_action_tokens == 0 and bad.reward == 0.0
    assert agent.last_run_stats["chain_errors"] == 1 and agent.last_run_stats["finish/error"] == 1
    assert "engine went away" in caplog.text


def test_reward_failure_is_flagged_and_counted(qwen_tokenizer):
    @reward
    def fragile(prediction: str, answer: int) -> float:
        if answer < 0:
            raise ValueError("negative answers are not supported")
        return 1.0

    backend = FakeScriptedBackend(qwen_tokenizer, scripted(["42"]))
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[add], reward_fn=fragile, chat_template=QWEN)
    ok, failed = run(agent, [{"question": "a", "answer": 1}, {"question": "b", "answer": -1}])
    assert ok.reward == 1.0 and "reward_failed" not in ok.flags
    assert failed.reward == 0.0 and "reward_failed" in failed.flags
    assert (failed.reward_extras["reward_error"]
            == "reward 'fragile' raised ValueError: negative answers are not supported")
    assert agent.last_run_stats["reward_failures"] == 1 and agent.last_run_stats["reward_mean"] == 1.0


def test_reward_gets_the_last_assistant_turn_and_trajectory(qwen_tokenizer):
    seen = {}

    @reward
    def spy(prediction: str, trajectory, answer: str) -> float:
        seen.update(prediction=prediction, turns=trajectory.num_turns, tools=trajectory.tool_calls)
        return 0.5

    replies = [tool_call_text("add", {"a": 1}), "It is <answer>1</answer>"]
    agent = ToolCallingAgent(
        FakeScriptedBackend(qwen_tokenizer, scripted(replies)), qwen_tokenizer, tools=[add], reward_fn=spy,
        chat_template=QWEN,
    )
    [trajectory] = run(agent, [{"question": "q", "answer": "1"}])
    assert seen == {"prediction": "It is <answer>1</answer>", "turns": 2, "tools": 1}
    assert trajectory.reward == 0.5


# --------------------------------------------------------------------------------------------------
# Reward binding, constructor checks
# --------------------------------------------------------------------------------------------------


def test_reward_naming_a_missing_field_fails_before_the_first_rollout(qwen_tokenizer):
    @reward
    def needs_solution(prediction: str, solution: str) -> float:
        return 1.0

    backend = FakeScriptedBackend(qwen_tokenizer, scripted(["x"]))
    provider = FakeEnvProvider()
    agent = ToolCallingAgent(
        backend, qwen_tokenizer, tools=[add], reward_fn=needs_solution, chat_template=QWEN, env_provider=provider
    )
    tasks = [{"question": "a", "solution": "1"}, {"question": "b", "soluton": "2"}]
    with pytest.raises(RewardBindingError) as info:
        run(agent, tasks, num_chains=4)
    assert str(info.value).startswith(
        "reward 'needs_solution' takes a parameter 'solution', but task 1 has no field 'solution' "
        "(fields: question, soluton). Did you mean 'soluton'?"
    )
    assert backend.calls == [] and provider.acquired == []


def test_bad_tasks_fail_before_the_first_rollout(qwen_tokenizer):
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(["x"]))
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[add], chat_template=QWEN)
    with pytest.raises(ValueError, match=r"tasks\[1\] needs a non-empty string 'question' field \(fields: prompt\)"):
        run(agent, [{"question": "fine"}, {"prompt": "wrong key"}])
    with pytest.raises(ValueError, match="tasks is empty"):
        run(agent, [])
    with pytest.raises(ValueError, match="num_chains must be a positive int"):
        run(agent, [{"question": "q"}], num_chains=0)
    assert backend.calls == []


def test_constructor_checks(qwen_tokenizer):
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(["x"]))

    @tool(stateful=True, pool="box")
    def stateful(env: Any) -> str:
        """Uses the box."""
        return ""

    with pytest.raises(ValueError, match=r"tool 'stateful' \(pool 'box'\) needs an environment but no env_provider"):
        ToolCallingAgent(backend, qwen_tokenizer, tools=[stateful], chat_template=QWEN)
    with pytest.raises(ValueError, match="CodeAgent runs python blocks with the 'code_interpreter' tool"):
        CodeAgent(backend, qwen_tokenizer, tools=[add], chat_template=QWEN)
    with pytest.raises(ValueError, match="unknown chat template 'qwen9'"):
        ToolCallingAgent(backend, qwen_tokenizer, tools=[add], chat_template="qwen9")
    with pytest.raises(ValueError, match="max_turns must be a positive int"):
        ToolCallingAgent(backend, qwen_tokenizer, tools=[add], chat_template=QWEN, max_turns=0)
    with pytest.raises(TypeError):
        BaseAgent(backend, qwen_tokenizer, chat_template=QWEN)  # abstract: subclasses define parse()
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=["calculator", add], chat_template=QWEN)
    assert sorted(agent.tools) == ["add", "calculator"]
    assert agent.stop_token_ids == [qwen_tokenizer.convert_tokens_to_ids("<|im_end|>"), 151643]


# --------------------------------------------------------------------------------------------------
# ReAct and code agents
# --------------------------------------------------------------------------------------------------


def test_react_agent(qwen_tokenizer):
    replies = [
        'Thought: add them\nAction: add\nAction Input: {"a": 2, "b": 5}\nObservation: (hallucinated)',
        "Thought: bad input\nAction: add\nAction Input: {a: 2}",
        "Thought: I know it\nFinal Answer: \\boxed{7}",
    ]
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(replies))
    agent = ReactAgent(backend, qwen_tokenizer, tools=[add, calculator], reward_fn=math_match, chat_template=QWEN)
    [trajectory] = run(agent, [{"question": "2+5?", "answer": 7}])
    assert (trajectory.finish_reason, trajectory.num_turns, trajectory.reward) == ("stop", 3, 1.0)
    system = trajectory.messages[0]["content"]
    assert "- add: Add two integers. Arguments:" in system and "- calculator:" in system
    assert "Action: the tool to use, one of [add, calculator]" in system
    assert "<tools>" not in qwen_tokenizer.decode(trajectory.token_ids)  # ReAct describes tools itself
    assert trajectory.messages[3] == {"role": "user", "content": "Observation: 7"}
    assert trajectory.messages[5]["content"].startswith("Observation: Error: Action Input of 'add' is not valid JSON")
    assert [r.error and r.error.split(":")[0] for r in trajectory.tool_call_records] == [None, "bad_json"]


def test_code_agent_keeps_one_environment_across_turns(qwen_tokenizer):
    @tool(name="code_interpreter", stateful=True, pool="python")
    async def run_code(code: str, env: Any) -> str:
        """Runs Python code in this chain's session.

        Args:
            code: The code.
        """
        env.history.append(code)
        return f"ran {len(env.history)} blocks in {env.key}; task {env.task['question']}"

    replies = [
        "Let me compute.\n```python\nx = 2\n```",
        "```python\nprint(x * 3)\n```\nand some text",
        "The result is \\boxed{6}.",
    ]
    provider = FakeEnvProvider()
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(replies))
    agent = CodeAgent(
        backend, qwen_tokenizer, tools=[run_code], env_provider=provider, reward_fn=math_match, chat_template=QWEN
    )
    [trajectory] = run(agent, [{"question": "2*3?", "answer": 6}])
    assert (trajectory.finish_reason, trajectory.num_turns, trajectory.reward) == ("stop", 3, 1.0)
    observations = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    key = provider.acquired[0][1]
    assert observations == [f"ran 1 blocks in {key}; task 2*3?", f"ran 2 blocks in {key}; task 2*3?"]
    assert [r.arguments for r in trajectory.tool_call_records] == [{"code": "x = 2"}, {"code": "print(x * 3)"}]
    assert len(provider.acquired) == 1 and provider.released == provider.acquired and not provider.active
    assert "```python" in trajectory.messages[0]["content"]


def test_environment_is_reset_with_the_task_once_per_chain(qwen_tokenizer):
    envs = []

    @tool(stateful=True, pool="game")
    async def act(action: str, env: Any) -> str:
        """Acts in the game."""
        envs.append(env)
        return f"did {action}"

    replies = [tool_call_text("act", {"action": "look"}), tool_call_text("act", {"action": "go"}), "won"]
    agent = ToolCallingAgent(
        FakeScriptedBackend(qwen_tokenizer, scripted(replies)), qwen_tokenizer, tools=[act],
        env_provider=FakeEnvProvider(), chat_template=QWEN,
    )
    run(agent, [{"question": "play", "game_file": "g1.tw"}])
    assert envs[0] is envs[1] and envs[0].resets == 1
    assert envs[0].task == {"question": "play", "game_file": "g1.tw"}


def test_progress_bar_shows_live_counts(qwen_tokenizer, capsys):
    backend = FakeScriptedBackend(qwen_tokenizer, scripted([tool_call_text("add", {"a": 1}), "done"]))
    agent = ToolCallingAgent(backend, qwen_tokenizer, tools=[add], chat_template=QWEN)
    asyncio.run(agent.run([{"question": "q"}], num_chains=3, progress=True))
    err = capsys.readouterr().err
    assert "rollout" in err and "3/3" in err
    assert "turns=6 tools=3 tool_errors=0" in err


def test_last_run_stats(qwen_tokenizer):
    backend = FakeScriptedBackend(qwen_tokenizer, scripted([tool_call_text("add", {"a": 1}), "\\boxed{1}"]))
    agent = ToolCallingAgent(
        backend, qwen_tokenizer, tools=[add], reward_fn=math_match, chat_template=QWEN,
    )
    run(agent, [{"question": "q", "answer": 1}, {"question": "r", "answer": 2}], num_chains=2)
    stats = agent.last_run_stats
    assert stats["chains"] == 4 and stats["chains_finished"] == 4 and stats["finish/stop"] == 4
    assert stats["turns"] == 8 and stats["generation_calls"] == 8 and stats["turns_per_chain"] == 2
    assert stats["tool_calls"] == 4 and stats["tool_errors"] == 0
    assert stats["reward_mean"] == 0.5 and stats["wall_time_s"] > 0
    assert all(isinstance(value, float) for value in stats.values())


def test_code_agent_with_the_real_code_interpreter_and_resource_manager(qwen_tokenizer):
    """CodeAgent + the code-interpreter environment (bubblewrap sandbox) pooled by the resource manager."""
    from agentfly_jax.envs import ResourceManager
    from environments.code_interpreter import POOL_CONFIG
    from environments.code_interpreter.tools import code_interpreter

    replies = ["```python\nx = 6 * 7\n```", "```python\nprint(x + 1)\n```", "So it is \\boxed{43}."]
    backend = FakeScriptedBackend(qwen_tokenizer, scripted(replies))

    async def scenario():
        manager = ResourceManager({"code_interpreter": POOL_CONFIG})
        agent = CodeAgent(
            backend, qwen_tokenizer, tools=[code_interpreter], env_provider=manager, reward_fn=math_match,
            chat_template=QWEN,
        )
        try:
            trajectories = await agent.run([{"question": "6*7+1?", "answer": 43}], num_chains=2, progress=False)
            return trajectories, manager.metrics("code_interpreter")
        finally:
            await manager.close()
            await asyncio.sleep(0.05)  # let the sandbox's subprocess transports finish closing

    trajectories, metrics = asyncio.run(scenario())
    for trajectory in trajectories:
        observations = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
        # `x` from the first block is still defined in the second: one session per chain across turns.
        assert observations == ["(no output)", "43"], observations
        assert (trajectory.finish_reason, trajectory.reward) == ("stop", 1.0)
    assert metrics["acquires"] == 2 and metrics["created"] == 2 and metrics["in_use"] == 0
