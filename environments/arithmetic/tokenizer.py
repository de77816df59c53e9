"""A small byte-level BPE tokenizer trained on the arithmetic chats, with a compact ChatML template.

Numbers are written in chunks of up to three digits, each chunk one token ("1278" -> "127", "8"), as
Llama 3's and GPT-4's tokenizers split digit runs; the chat markers and the tool-call tags are single tokens,
as in Qwen2.5. Any text still encodes (byte-level fallback).
"""
from __future__ import annotations

import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from environments.arithmetic.tasks import ArithmeticTaskConfig, demonstration, generate_tasks

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML without a default system prompt or a tools listing: short sequences for CPU training. Tool calls are
# rendered Hermes-style (<tool_call>{json}</tool_call>), which the tool-calling agent parses.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{ '<tool_call>' }}{{ {'name': fn.name, 'arguments': fn.arguments} | tojson }}{{ '</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>' }}{{ message.content }}{{ '</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message.role + '\\n' }}{{ message.content }}{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def _corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = ["user\n", "assistant\n", "system\n", "tool\n"] * 200  # role headers merge into single tokens
    for task in generate_tasks(n, seed, ArithmeticTaskConfig()):
        for message in demonstration(task, use_tool=rng.random() < 0.5, rng=rng):
            texts.append(message.get("content") or "")
            for call in message.get("tool_calls", []):
                texts.append(json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]}))
    return texts


def build_tokenizer(save_dir: str | None = None, *, vocab_size: int = 384, seed: int = 0):
    """The quickstart tokenizer as a transformers PreTrainedTokenizerFast (saved to `save_dir` if given;
    loaded from there when it already exists)."""
    # PreTrainedTokenizerFast itself, not AutoTokenizer: the saved tokenizer is this class, and importing
    # transformers' auto classes takes 9 s more on a 2-core CPU (they import its generation code, torch, sklearn)
    from transformers import PreTrainedTokenizerFast

    if save_dir and os.path.isfile(os.path.join(save_dir, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(save_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(2000, seed), trainer=trainer)
    # Number chunks 0..999 as whole tokens; the tokenizer matches them longest-first, left to right.
    tok.add_tokens(TOOL_TOKENS + [str(i) for i in range(1000)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    if save_dir:
        fast.save_pretrained(save_dir)
    return fast
