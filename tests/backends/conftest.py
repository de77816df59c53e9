"""Shared pieces of the generation-backend tests: tiny fp32 Qwen2 checkpoints and the trainer's logprobs.

The checkpoints have head_dim 32 (vLLM's CPU attention needs head_dim >= 32) and are written by transformers
itself, so the JAX side loads them through `load_pretrained` exactly as users do.
"""
import jax
import numpy as np
import pytest
import transformers

from agentfly_jax.models import load_pretrained
from agentfly_jax.trainer.update import token_logprobs
from tests.models.hf_reference import build

TINY_QWEN2 = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=True, rope_theta=1e6)


def build_tiny_qwen2(path, seed=0):
    build(transformers.Qwen2Config(**TINY_QWEN2), path, seed=seed)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The test model (weights A)."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_a"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory):
    """Same architecture, other random weights (B): the 'trained' weights of weight-sync tests."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_b"), seed=1)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    return load_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_params_b(tiny_model_dir_b):
    return load_pretrained(tiny_model_dir_b)[1]


_JITTED = {}


def _jitted_token_logprobs(model, params, batch, temperature):
    key = (id(model), temperature)
    if key not in _JITTED:  # the module is not hashable (its config carries a dict): close over it
        _JITTED[key] = (model, jax.jit(lambda p, b: token_logprobs(model, p, b, temperature=temperature)[0]))
    return _JITTED[key][1](params, batch)


def trainer_logprobs(model, params, prompt, completion, temperature, pad_to=512):
    """The trainer's recomputed logprobs (trainer.update.token_logprobs) of `completion` after `prompt`.

    The row is padded to `pad_to` tokens as the trainer pads its batches (segment id 0: attends to nothing real),
    so one compiled program serves every test sequence.
    """
    sequence = list(prompt) + list(completion)
    length = max(pad_to, len(sequence))
    tokens = np.zeros((1, length), np.int32)
    tokens[0, :len(sequence)] = sequence
    segment_ids = (np.arange(length) < len(sequence)).astype(np.int32)[None]
    batch = {"tokens": tokens, "positions": np.arange(length, dtype=np.int32)[None], "segment_ids": segment_ids}
    logprobs = _jitted_token_logprobs(model, params, batch, float(temperature))
    return np.asarray(logprobs)[0, len(prompt):len(sequence)]
