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
