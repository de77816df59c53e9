"""The converted Qwen BPE is kept per process and on disk ($AGENTFLY_CACHE_DIR/tokenizers): a tokenizer built from
the disk cache is the one converted from the ranks file, a damaged cache file is converted again, and a cache
directory that cannot be written only costs the time."""
import importlib
import logging

import pytest

from agentfly_jax.rollout import tokenizers
from agentfly_jax.rollout.tokenizers import build_llama3_style_tokenizer, build_qwen2_5_tokenizer

TEXT = "What is 417 * 38?  Привет, 世界! <tool_call>{\"x\": 1}</tool_call>\n\n  done"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty disk cache and nothing converted in this process."""
    monkeypatch.setenv("AGENTFLY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizers, "_CONVERTED", {})
    return tmp_path / "cache" / "tokenizers"


def _forbid_converting(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("converted the ranks file again")

    # the module itself: `transformers.convert_slow_tokenizer` as an attribute can be transformers' function of
    # that name
    monkeypatch.setattr(importlib.import_module("transformers.convert_slow_tokenizer"), "TikTokenConverter", refuse)


@pytest.mark.parametrize("build", [build_qwen2_5_tokenizer, build_llama3_style_tokenizer])
def test_a_tokenizer_from_the_disk_cache_equals_the_converted_one(fresh, monkeypatch, build):
    converted = build()
    [cached_file] = fresh.glob("qwen-bpe-*.json")
    monkeypatch.setattr(tokenizers, "_CONVERTED", {})  # a new process: the disk only
    _forbid_converting(monkeypatch)
    from_disk = build()
    assert from_disk.get_vocab() == converted.get_vocab()
    assert from_disk.encode(TEXT) == converted.encode(TEXT)
    assert from_disk.get_added_vocab() == converted.get_added_vocab()
    again = build()  # from this process's memory: a new object each time (callers add tokens to it)
    assert again.encode(TEXT) == converted.encode(TEXT) and again.backend_tokenizer is not from_disk.backend_tokenizer
    assert list(fresh.glob("qwen-bpe-*.json")) == [cached_file]


def test_a_damaged_cache_file_is_converted_again(fresh, monkeypatch, caplog):
    reference = build_qwen2_5_tokenizer()
    [cached_file] = fresh.glob("qwen-bpe-*.json")
    cached_file.write_text('{"version": "1.0", "model": ')  # cut short
    monkeypatch.setattr(tokenizers, "_CONVERTED", {})
    with caplog.at_level(logging.WARNING):
        rebuilt = build_qwen2_5_tokenizer()
    assert "could not be read" in caplog.text and rebuilt.encode(TEXT) == reference.encode(TEXT)
    monkeypatch.setattr(tokenizers, "_CONVERTED", {})
    _forbid_converting(monkeypatch)
    assert build_qwen2_5_tokenizer().encode(TEXT) == reference.encode(TEXT)  # the file was written whole again


def test_a_cache_directory_that_cannot_be_written_only_costs_time(monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("AGENTFLY_CACHE_DIR", str(blocker))
    monkeypatch.setattr(tokenizers, "_CONVERTED", {})
    assert build_qwen2_5_tokenizer().encode("What is 417 * 38?")
