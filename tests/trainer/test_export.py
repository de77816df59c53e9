"""The trained policy's export (`trainer.export.export_policy`, what the trainer writes as `final_policy/`):
config.json and generation_config.json carry the turn's stop tokens as eos and nothing that changes sampling, and
the tokenizer is saved with the chat template used in training; transformers loads all of it back."""
import json
import os

import jax
import pytest
import transformers
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from agentfly_jax.models import CausalLM, ModelConfig, init_params
from agentfly_jax.rollout.chat_templates import QWEN2_5_JINJA
from agentfly_jax.rollout.templates import render_conversation
from agentfly_jax.trainer.export import export_policy
from environments.arithmetic.tokenizer import CHAT_TEMPLATE, build_tokenizer

CONVERSATION = [
    {"role": "user", "content": "What is 417 * 38?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "417 * 38"}}}]},
    {"role": "tool", "content": "15846"},
    {"role": "assistant", "content": "15846"},
    {"role": "user", "content": "And 2 + 2?"},
]
CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                               "parameters": {"type": "object", "required": ["expression"],
                                                              "properties": {"expression": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("arithmetic_tokenizer")))


@pytest.fixture(scope="module")
def policy(tokenizer):
    model = CausalLM(ModelConfig(family="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                 num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, qkv_bias=True,
                                 tie_word_embeddings=True, max_position_embeddings=256))
    return model, jax.device_get(init_params(model, jax.random.PRNGKey(0)))


def stop_ids(tokenizer):
    return [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]


def rendered(tokenizer, chat_template, tools=None):
    return "".join(c.text for c in render_conversation(tokenizer, CONVERSATION, tools=tools,
                                                       chat_template=chat_template, add_generation_prompt=True))


@pytest.mark.parametrize("chat_template", [None, "qwen2.5"])
def test_export_carries_eos_generation_config_and_the_training_template(tmp_path, tokenizer, policy, chat_template):
    model, params = policy
    stops = stop_ids(tokenizer)
    out = str(tmp_path / "final_policy")
    export_policy(model, params, tokenizer, out, stop_token_ids=stops, chat_template=chat_template)
    assert tokenizer.chat_template == CHAT_TEMPLATE  # the run's tokenizer is left as it was

    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"):
        assert os.path.isfile(os.path.join(out, name)), name
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["eos_token_id"] == stops and config["pad_token_id"] == tokenizer.pad_token_id
    assert "bos_token_id" not in config  # this tokenizer has no bos token
    # generation_config.json: the special ids only, no sampling or length defaults
    generation = json.load(open(os.path.join(out, "generation_config.json")))
    assert set(generation) == {"eos_token_id", "pad_token_id", "transformers_version"}
    assert generation["eos_token_id"] == stops

    loaded = GenerationConfig.from_pretrained(out)
    assert loaded.eos_token_id == stops and loaded.pad_token_id == tokenizer.pad_token_id
    defaults = GenerationConfig()
    for key in ("do_sample", "temperature", "top_p", "top_k", "max_new_tokens", "max_length",
                "repetition_penalty"):
        assert getattr(loaded, key) == getattr(defaults, key), key
    assert AutoConfig.from_pretrained(out).eos_token_id == stops

    served = AutoTokenizer.from_pretrained(out)
    expected_template = CHAT_TEMPLATE if chat_template is None else QWEN2_5_JINJA
    assert served.chat_template == expected_template
    assert open(os.path.join(out, "chat_template.jinja")).read() == expected_template
    # the served tokenizer renders a conversation (with tools) to the text training rendered
    text = served.apply_chat_template(CONVERSATION, tools=[CALCULATOR], tokenize=False, add_generation_prompt=True)
    assert text == rendered(tokenizer, chat_template, tools=[CALCULATOR])
    assert served.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)


def test_transformers_generate_stops_at_the_exported_end_of_turn(tmp_path, tokenizer, policy):
    """AutoModelForCausalLM picks up generation_config.json: greedy generation of the (random) policy ends at
    an end-of-turn id or the length limit, never past a stop id."""
    torch = pytest.importorskip("torch")
    model, params = policy
    stops = stop_ids(tokenizer)
    out = str(tmp_path / "final_policy")
    export_policy(model, params, tokenizer, out, stop_token_ids=stops, chat_template="qwen2.5")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.generation_config.eos_token_id == stops
    prompt = AutoTokenizer.from_pretrained(out).apply_chat_template(
        CONVERSATION[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        generated = hf.generate(**prompt, max_new_tokens=24, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    ids = generated.tolist()
    hits = [i for i, t in enumerate(ids) if t in stops]
    assert hits in ([], [len(ids) - 1]), ids
    assert hits or len(ids) == 24, ids


def test_export_needs_a_stop_token(tmp_path, tokenizer, policy):
    model, params = policy
    with pytest.raises(ValueError, match="stop token"):
        export_policy(model, params, tokenizer, str(tmp_path / "p"), stop_token_ids=[])
