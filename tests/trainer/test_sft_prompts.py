"""SFT demonstrations are trained on the prompt the agent will see in RL, and demonstrations recorded from an
environment's scripted policies have the agent's message format, real observations and its observation limit."""
import random

import pytest

from agentfly_jax.rollout import encode_conversation
from agentfly_jax.rollout.agents import ReactAgent, ToolCallingAgent
from agentfly_jax.rollout.templates import ConversationEncoder
from agentfly_jax.rollout.tokenizers import build_qwen2_5_tokenizer
from agentfly_jax.tools import calculator
from agentfly_jax.trainer.loop import _as_agent_prompts
from environments.arithmetic.tasks import demonstration
from tests.rollout.fakes import FakeScriptedBackend


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_qwen2_5_tokenizer(tmp_path_factory.mktemp("qwen"))


@pytest.mark.parametrize("agent_class,system_prompt", [(ToolCallingAgent, None), (ToolCallingAgent, "Be exact."),
                                                       (ReactAgent, None)])
def test_sft_demonstration_starts_with_the_agents_rollout_prompt(tokenizer, agent_class, system_prompt):
    agent = agent_class(FakeScriptedBackend(tokenizer, lambda p: ""), tokenizer, tools=[calculator],
                        chat_template="qwen2.5", system_prompt=system_prompt)
    task = {"question": "What is 417 * 38?", "expression": "417*38", "answer": "15846"}
    encoder = ConversationEncoder(tokenizer, chat_template="qwen2.5")
    rollout_prompt = encoder.start(agent.build_messages(task), tools=agent.template_tools())

    demo = demonstration(task, use_tool=True, rng=random.Random(0))  # user, assistant call, tool, assistant
    encoded = encode_conversation(tokenizer, _as_agent_prompts(agent, demo), tools=agent.template_tools(),
                                  chat_template="qwen2.5")
    # what the policy learns to continue is exactly what it is given in RL (system text, tool list, question)
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert encoded.token_ids[:len(rollout_prompt)] == rollout_prompt
    assert rollout_prompt[-len(header):] == header and sum(encoded.action_mask[:len(rollout_prompt)]) == 0
    # a demonstration with its own system message keeps it
    own = [{"role": "system", "content": "Mine."}] + demo
    assert _as_agent_prompts(agent, own) == own


def test_recorded_demonstrations_from_the_scripted_shoppers(tokenizer):
    from environments.webshop.evaluation import env_spec

    spec = env_spec(num_products=200, pool_size=4, demo_tasks=6)
    tasks = spec.split_tasks("train", 10, 0)
    demos = spec.demonstrations(tasks, random.Random(1), 1.0, tokenizer=tokenizer, max_observation_chars=600)
    assert len(demos) == 6  # demo_tasks of the 10, every oracle chain solved its goal
    for conversation in demos:
        roles = [m["role"] for m in conversation]
        assert roles[0] == "user" and roles[-1] == "assistant" and "system" not in roles
        calls = [m for m in conversation if m.get("tool_calls")]
        tools = [m for m in conversation if m["role"] == "tool"]
        assert len(calls) == len(tools) >= 2  # search, then clicks through to "Buy Now"
        assert calls[0]["tool_calls"][0]["function"]["name"] == "webshop_search"
        assert calls[-1]["tool_calls"][0]["function"]["arguments"] == {"target": "Buy Now"}
        # observations are the real shop pages, cut where the RL agent's would be (plus the truncation note)
        assert all(len(m["content"]) <= 600 + 120 for m in tools)
    assert any("observation truncated" in m["content"] for d in demos for m in d if m["role"] == "tool")
    weaker = spec.demonstrations(tasks, random.Random(1), 0.0, tokenizer=tokenizer)
    assert len(weaker) == 6 and all(m.get("tool_calls") is None or m["tool_calls"][0]["function"]["name"]
                                    in ("webshop_search", "webshop_click") for d in weaker for m in d)
    # a demonstration must show the task solved: pages cut too short for the oracle leave none, and it says so
    with pytest.raises(ValueError, match="below the reward threshold"):
        spec.demonstrations(tasks, random.Random(1), 1.0, tokenizer=tokenizer, max_observation_chars=150)


class _Writer:
    def __init__(self):
        self.rows = []

    def scalars(self, step, values):
        self.rows.append((step, values))


def _stage(tokenizer, *, cut_long=False, count=40):
    """A stage of `count` arithmetic demonstrations, alternately with the tool (4 messages) and a guess (2); its
    `longest` lies between their lengths, so every demonstration with the tool is too long."""
    from types import SimpleNamespace

    from agentfly_jax.trainer.loop import _Demonstrations

    agent = ToolCallingAgent(FakeScriptedBackend(tokenizer, lambda p: ""), tokenizer, tools=[calculator],
                             chat_template="qwen2.5")
    rng = random.Random(3)
    tasks = [{"question": f"What is {a} * 7?", "expression": f"{a}*7", "answer": str(a * 7)} for a in range(count)]
    demos = [demonstration(t, use_tool=i % 2 == 0, rng=rng) for i, t in enumerate(tasks)]
    lengths = [len(encode_conversation(tokenizer, _as_agent_prompts(agent, d), tools=agent.template_tools(),
                                       chat_template="qwen2.5").token_ids) for d in demos]
    longest = max(lengths[1::2])
    assert longest < min(lengths[0::2])
    run = SimpleNamespace(tokenizer=tokenizer, agent=agent, writer=_Writer(),
                          config=SimpleNamespace(chat_template="qwen2.5", sft=SimpleNamespace(cut_long=cut_long)))
    return _Demonstrations(run, demos, 1, longest), demos, agent, run


def test_demonstrations_are_encoded_when_drawn_and_drawn_as_if_encoded_first(tokenizer):
    """A stage whose demonstrations all fit draws exactly what drawing from all of them encoded up front drew
    (the same rng calls), and encodes only those drawn."""
    import numpy as np

    stage, demos, agent, _ = _stage(tokenizer)
    stage.longest = 10_000  # all fit
    rng, reference_rng = np.random.default_rng(5), np.random.default_rng(5)
    for _ in range(3):
        drawn = stage.draw(rng, 4)
        expected = reference_rng.choice(len(demos), size=4, replace=False)
        assert drawn == [encode_conversation(tokenizer, _as_agent_prompts(agent, demos[j]),
                                             tools=agent.template_tools(), chat_template="qwen2.5")
                         for j in expected]
    assert len(stage.encoded) <= 12 < len(demos)
    stage.report(3)
    assert stage.dropped == 0 and stage.run.writer.rows == []


def test_demonstrations_too_long_are_never_drawn_and_are_counted(tokenizer, caplog):
    import numpy as np

    stage, demos, _, run = _stage(tokenizer)
    rng = np.random.default_rng(0)
    with caplog.at_level("WARNING"):
        drawn = [e for _ in range(15) for e in stage.draw(rng, 2)]
    assert all(len(e.token_ids) <= stage.longest for e in drawn)
    too_long = [j for j, e in stage.encoded.items() if e is None]
    assert too_long and all(j % 2 == 0 for j in too_long) and stage.dropped == len(too_long)
    assert not set(too_long) & set(stage.drawable.tolist())
    stage.report(30)
    assert run.writer.rows == [(30, {"sft/stage1_dropped_too_long": float(len(too_long))})]
    assert "sft stage 1: demonstrations longer than the largest bucket" in caplog.text
    assert f"{len(too_long)} of the {len(stage.encoded)} demonstrations it encoded (of 40)" in caplog.text


def test_a_batch_larger_than_the_demonstrations_that_fit_is_refused_with_their_count(tokenizer):
    import numpy as np

    from agentfly_jax.trainer.config import ConfigError

    stage, *_ = _stage(tokenizer)
    with pytest.raises(ConfigError, match=r"batch_size=21 but only 20 of the 40 demonstrations of sft stage 1 fit"):
        stage.draw(np.random.default_rng(0), 21)
    stage, *_ = _stage(tokenizer)
    stage.longest = 3
    with pytest.raises(ConfigError, match=r"sft stage 1: every one of the 40 demonstrations is longer than the "
                                          r"largest bucket \(3 tokens\)"):
        stage.draw(np.random.default_rng(0), 2)


def test_cut_long_cuts_instead_of_leaving_out(tokenizer):
    import numpy as np

    stage, *_ = _stage(tokenizer, cut_long=True)
    rng = np.random.default_rng(1)
    drawn = [e for _ in range(10) for e in stage.draw(rng, 4)]
    assert stage.dropped == 0 and max(len(e.token_ids) for e in drawn) == stage.longest
