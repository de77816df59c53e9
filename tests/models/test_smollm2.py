"""The real pretrained checkpoint set-up builds (.cache/models/SmolLM2-135M-Instruct, scripts/build_smollm2.py):
complete, normalised, and our Flax model + JaxSampler equal transformers on it in fp32 on the CPU."""
import asyncio
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from agentfly_jax.models import load_pretrained
from agentfly_jax.rollout.backends import JaxSampler

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
PROMPT = [{"role": "user", "content": "What is 12 + 7? Answer with the number."}]


def prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def checkpoint():
    if not (CHECKPOINT / "agentfly_build.json").is_file():
        pytest.fail(f"{CHECKPOINT.relative_to(ROOT)} is missing: run scripts/setup.sh (scripts/setup_models.sh builds it)")
    return CHECKPOINT


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return transformers.AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_pretrained(str(checkpoint), "float32")


def test_checkpoint_is_complete_and_normalised(checkpoint, tokenizer):
    manifest = json.loads((checkpoint / "agentfly_build.json").read_text())
    assert manifest["dequantised_from"] == "Q4_1" and manifest["parameters"] == 134_515_008
    assert "dequantised" in (checkpoint / "README.md").read_text()
    config = json.loads((checkpoint / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["num_hidden_layers"]) == ("llama", 49152, 30)
    assert "quantization_config" not in config and config["eos_token_id"] == 2
    assert json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"] == 2
    # whatever the converter made of the GGUF, <|im_end|> ends a turn and is special; the template is the model's
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert {"<|im_start|>", "<|im_end|>"} <= set(tokenizer.all_special_tokens)
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is 12 + 7?" in text


def test_logits_match_transformers(ours, hf_model, tokenizer):
    model, params = ours
    assert model.config.tie_word_embeddings and "lm_head" not in params
    chat = prompt_ids(tokenizer)
    prose = tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome. " * 3)
    ids = np.asarray([chat[:30], prose[:30]])
    theirs = hf_model(input_ids=torch.as_tensor(ids)).logits.detach().numpy()
    mine = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids, jnp.int32)))
    assert mine.shape == theirs.shape == (2, 30, 49152)
    # 30 layers of real weights in fp32: 1.3e-4 was measured; the tolerance leaves no room for a wrong layer
    np.testing.assert_allclose(mine, theirs, atol=5e-4, rtol=0)
    assert (mine.argmax(-1) == theirs.argmax(-1)).all()


def test_greedy_tokens_of_jax_sampler_match_transformers_generate(ours, hf_model, tokenizer):
    model, params = ours
    prompt = prompt_ids(tokenizer)
    with torch.no_grad():
        hf_out = hf_model.generate(torch.as_tensor([prompt]), max_new_tokens=24, do_sample=False,
                                   eos_token_id=2, pad_token_id=2)
    expected = hf_out[0, len(prompt):].tolist()

    async def sample():
        sampler = JaxSampler(model, params, max_slots=2, max_len=256, steps_per_call=8)
        try:
            return await sampler.generate(prompt, max_tokens=24, temperature=0.0, stop_token_ids=[2])
        finally:
            await sampler.close()

    (completion,) = asyncio.run(sample())
    assert completion.token_ids == expected, (tokenizer.decode(completion.token_ids), tokenizer.decode(expected))
    # the model is weak at arithmetic: this is the behaviour RL is meant to change (greedy says 12 + 7 = 9)
    assert tokenizer.decode(expected[:-1] if expected[-1] == 2 else expected).strip()
