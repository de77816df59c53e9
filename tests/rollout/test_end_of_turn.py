"""The chat template's end-of-turn token stops generation whatever the tokenizer marks as special.

A converted tokenizer (e.g. one transformers builds from a GGUF file) need not list `<|im_end|>` among its
special tokens, and may name another token as eos. Built here from the real SmolLM2 tokenizer made by set-up,
edited as such a converter leaves it.
"""
import asyncio
import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentfly_jax.rewards import math_match
from agentfly_jax.rollout import encode_conversation
from agentfly_jax.rollout.agents import ToolCallingAgent
from agentfly_jax.rollout.backends.base import Completion, GenerationBackend
from agentfly_jax.rollout.templates import ConversationEncoder, end_of_turn_ids
from agentfly_jax.tools import calculator
from tests.rollout.fakes import tool_call_text

CHECKPOINT = Path(__file__).resolve().parents[2] / ".cache" / "models" / "SmolLM2-135M-Instruct"
IM_END = 2


@pytest.fixture(scope="module")
def converted_tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer as a converter may leave it: `<|im_end|>` not special, eos `<|im_start|>`."""
    if not (CHECKPOINT / "tokenizer.json").is_file():
        pytest.fail("the SmolLM2 checkpoint is missing: run scripts/setup.sh (scripts/setup_models.sh builds it)")
    directory = tmp_path_factory.mktemp("converted")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(CHECKPOINT / name, directory / name)
    spec = json.loads((directory / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        if token["content"] == "<|im_end|>":
            token["special"] = False
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(eos_token="<|im_start|>", pad_token="<|im_start|>")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    assert "<|im_end|>" not in tokenizer.all_special_tokens and tokenizer.eos_token_id == 1
    return tokenizer


class RunOnModel(GenerationBackend):
    """A fake engine whose "model" writes each scripted reply, `<|im_end|>`, then repeats `<|im_end|>` forever
    (what the first SmolLM2 runs did): only the stop ids it is given end the completion, as in a real engine."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.calls = tokenizer, replies, []

    async def generate(self, prompt_token_ids, *, max_tokens, temperature=1.0, top_p=1.0, top_k=-1,
                       stop_token_ids=(), n=1, seed=None):
        reply = self.replies[min(len(self.calls), len(self.replies) - 1)]
        self.calls.append(list(stop_token_ids))
        stream = self.tokenizer.encode(reply, add_special_tokens=False) + [IM_END] * max_tokens
        for i, token in enumerate(stream[:max_tokens]):
            if token in stop_token_ids:
                ids, finish = stream[: i + 1], "stop"
                break
        else:
            ids, finish = stream[:max_tokens], "length"
        return [Completion(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason=finish) for _ in range(n)]

    async def update_weights(self, params, version, *, interrupt=False):
        pass


@pytest.mark.parametrize("template", ["qwen2.5", None])  # named, and the tokenizer's own Jinja template
def test_end_of_turn_id_comes_from_the_template(converted_tokenizer, template):
    assert end_of_turn_ids(converted_tokenizer, template) == [IM_END]


def test_agent_stops_at_the_templates_end_of_turn_and_the_tool_runs(converted_tokenizer):
    replies = [tool_call_text("calculator", {"expression": "12+7"}), "\\boxed{19}"]
    backend = RunOnModel(converted_tokenizer, replies)
    agent = ToolCallingAgent(backend, converted_tokenizer, tools=[calculator], reward_fn=math_match,
                             chat_template="qwen2.5", max_new_tokens=64)
    assert agent.stop_token_ids[0] == IM_END and 1 in agent.stop_token_ids  # the template's, then the eos
    [trajectory] = asyncio.run(agent.run([{"question": "What is 12 + 7?", "answer": "19"}], progress=False))
    assert all(IM_END in stops for stops in backend.calls)
    assert (trajectory.finish_reason, trajectory.num_turns, trajectory.tool_calls, trajectory.reward) == (
        "stop", 2, 1, 1.0)
    assert trajectory.tool_call_records[0].observation == "19"
    # each sampled turn ends with exactly one <|im_end|>, which is not part of the message content
    assert trajectory.messages[-1]["content"] == "\\boxed{19}"
    reference = encode_conversation(converted_tokenizer, trajectory.messages, tools=[calculator.schema],
                                    chat_template="qwen2.5")
    assert trajectory.token_ids == reference.token_ids[:-1]
    assert trajectory.action_mask == reference.action_mask[:-1]


def test_encoder_adds_a_missing_end_of_turn_with_mask_0(converted_tokenizer):
    encoder = ConversationEncoder(converted_tokenizer, chat_template="qwen2.5")
    encoder.start([{"role": "user", "content": "hi"}])
    cut_off = converted_tokenizer.encode("hello there", add_special_tokens=False)  # finish=length: no end token
    encoder.append_assistant(cut_off)
    encoder.append_messages([{"role": "user", "content": "again"}], add_generation_prompt=True)
    ids, mask = encoder.token_ids, encoder.action_mask
    end = len(ids) - ids[::-1].index(cut_off[-1])  # just after the sampled turn
    assert ids[end] == IM_END and mask[end] == 0 and mask[end - len(cut_off): end] == [1] * len(cut_off)


def test_a_token_added_after_the_first_probe_becomes_the_end_of_turn():
    """The end-of-turn probe and the added vocabulary are kept per tokenizer (a renderer is made for every
    conversation, and a fast tokenizer's added vocabulary costs milliseconds to build): asked again, the
    tokenizer is read once; a token added to it later is seen at once."""
    tokenizer = AutoTokenizer.from_pretrained(str(CHECKPOINT))  # its own copy: this test adds a token
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "{% if m['role'] == 'assistant' %}<|turn_over|>{% else %}<|im_end|>{% endif %}\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    reads = []
    get_added_vocab = tokenizer.get_added_vocab
    tokenizer.get_added_vocab = lambda: reads.append(1) or get_added_vocab()
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert end_of_turn_ids(tokenizer, template) == []  # "<|turn_over|>" is plain text here
    first = [encode_conversation(tokenizer, conversation, chat_template=template) for _ in range(20)]
    assert len(reads) == 1 and all(e == first[0] for e in first)
    # plain text: the turn's generated tokens run through "<|turn_over|>"'s pieces
    assert sum(first[0].action_mask) > len(tokenizer.encode("hello", add_special_tokens=False))

    tokenizer.add_tokens(["<|turn_over|>"], special_tokens=True)
    [turn_over] = tokenizer.encode("<|turn_over|>", add_special_tokens=False)
    assert end_of_turn_ids(tokenizer, template) == [turn_over]
    encoded = encode_conversation(tokenizer, conversation, chat_template=template)
    generated = [t for t, m in zip(encoded.token_ids, encoded.action_mask) if m]
    assert generated == tokenizer.encode("hello", add_special_tokens=False) + [turn_over]
    assert len(reads) == 2
