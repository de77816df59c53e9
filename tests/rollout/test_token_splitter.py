"""TokenSplitter and EncoderCache: the same ids as `tokenizer.encode(text, add_special_tokens=False)`.

The reference is the tokenizer's own `encode`. The Qwen2.5 and Llama 3 (stand-in) tokenizers of conftest.py
are used read-only; tests that change a tokenizer (added tokens with other options, truncation left on the
backend, `split_special_tokens`, tokens added later) use a small byte-level BPE trained here, a real Hugging
Face fast tokenizer.
"""

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from agentfly_jax.rollout import templates
from agentfly_jax.rollout.templates import ConversationEncoder, EncoderCache, TextDecoder, TokenSplitter
from tests.rollout.conversations import CONVERSATIONS, TOOLS

# Pieces that make hard text: combining accents (NFC joins them across what would be piece boundaries),
# runs of whitespace and newlines, digits, emoji, CJK, and text that looks like added tokens.
PIECES = [
    "a",
    "b",
    " ",
    "\n",
    "\n\n",
    "\t",
    "  ",
    "<",
    "|",
    ">",
    "/",
    "_",
    '"',
    "{",
    "}",
    ":",
    ",",
    ".",
    "é",
    "e\u0301",
    "\u0301",
    "中文",
    "😀",
    "1234",
    "Hello",
    " world",
    "<tool_response>",
    "<|",
    "|>",
]


def random_texts(tokenizer, count, seed=0):
    """Texts mixing added tokens, halves of added tokens and the hard PIECES."""
    rng = random.Random(seed)
    added = sorted(tokenizer.get_added_vocab())
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 12)):
            draw = rng.random()
            if draw < 0.3:
                parts.append(rng.choice(added))
            elif draw < 0.4:
                token = rng.choice(added)
                cut = rng.randint(0, len(token))
                parts.append(token[:cut] if rng.random() < 0.5 else token[cut:])
            else:
                parts.append(rng.choice(PIECES))
        texts.append("".join(parts))
    return texts


def assert_like_encode(splitter, tokenizer, texts, cache=None):
    for text in texts:
        expected = tokenizer.encode(text, add_special_tokens=False)
        assert splitter.encode(text) == expected, text
        if cache is not None:
            assert splitter.encode(text, cache) == expected, text
        assert splitter.last_id(text) == (expected[-1] if expected else None), text


@pytest.mark.parametrize("fixture", ["qwen_tokenizer", "llama3_tokenizer"])
def test_splitter_gives_the_tokenizers_ids(fixture, request):
    tokenizer = request.getfixturevalue(fixture)
    splitter = TokenSplitter(tokenizer)
    assert splitter.uses_fast_path  # these tokenizers' added tokens match raw text only
    cache: dict[str, list[int]] = {}
    assert_like_encode(splitter, tokenizer, random_texts(tokenizer, 600), cache)
    assert len(cache) > 50  # pieces between added tokens were stored and looked up again
    assert_like_encode(splitter, tokenizer, random_texts(tokenizer, 300, seed=1), cache)


def small_tokenizer(added):
    """A byte-level BPE trained on a few sentences, with `added` (AddedTokens) on top."""
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(
        ["hello world, the tool said hello", "assistant user system tool"] * 10, trainer
    )
    backend.add_tokens(list(added))
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def plain(content, special=True):
    return AddedToken(content, special=special, normalized=False)


def test_overlapping_added_tokens_are_cut_leftmost_then_longest():
    # "<a>" and "<a><b>" start at the same place (the longer wins); "b><c" overlaps "<a><b>" (the leftmost
    # wins)
    tokenizer = small_tokenizer([plain("<a>"), plain("<a><b>"), plain("b><c", special=False), plain("<c>")])
    splitter = TokenSplitter(tokenizer)
    assert splitter.uses_fast_path
    texts = ["x<a><b>y", "<a><b><c>", "<a>b><c>", "b><c><a>", "<a><a><b><c>z"] + random_texts(tokenizer, 300)
    assert_like_encode(splitter, tokenizer, texts, cache={})
    assert splitter.encode("<a><b><c>") == [tokenizer.convert_tokens_to_ids(t) for t in ("<a><b>", "<c>")]


@pytest.mark.parametrize(
    "option", [{"lstrip": True}, {"rstrip": True}, {"single_word": True}, {"normalized": True}]
)
def test_other_added_token_options_go_through_encode(option):
    tokenizer = small_tokenizer(
        [plain("<a>"), AddedToken("<m>", special=True, **{"normalized": False, **option})]
    )
    splitter = TokenSplitter(tokenizer)
    assert not splitter.uses_fast_path
    assert_like_encode(
        splitter, tokenizer, ["x <m> y", "hello<m>", "<m>\n<a> <m>"] + random_texts(tokenizer, 50)
    )


def test_state_left_on_the_tokenizer_is_respected():
    tokenizer = small_tokenizer([plain("<a>"), plain("<b>")])
    splitter = TokenSplitter(tokenizer)
    text = "hello world <a> the tool said <b> hello"
    expected = tokenizer.encode(text, add_special_tokens=False)
    # truncation left on the backend (as a call with truncation=True leaves it): encode() would not truncate
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    assert splitter.encode(text) == expected and len(expected) > 3
    tokenizer.backend_tokenizer.enable_padding(length=80)
    assert splitter.encode(text) == expected
    # split_special_tokens: special tokens are tokenised as text
    tokenizer.split_special_tokens = True
    split = tokenizer.encode(text, add_special_tokens=False)
    assert (
        split != expected
        and splitter.encode(text, {}) == split
        and splitter.last_id("x<a>") == split_last(tokenizer, "x<a>")
    )
    tokenizer.split_special_tokens = False
    # a token added after the splitter was made
    tokenizer.add_tokens([plain("tool said", special=False)])
    assert splitter.encode(text, {}) == tokenizer.encode(text, add_special_tokens=False) != expected


def test_last_id_looks_past_pieces_that_give_no_ids():
    tokenizer = small_tokenizer([plain("<a>"), plain("<b>")])
    tokenizer.backend_tokenizer.normalizer = normalizers.Strip()  # a piece of spaces normalises to nothing
    splitter = TokenSplitter(tokenizer)
    assert splitter.uses_fast_path
    for text in ["hello<a>  ", "hello  <b>   ", "<a> ", "   ", "hello <a> world  <b>  "] + random_texts(
        tokenizer, 300
    ):
        expected = tokenizer.encode(text, add_special_tokens=False)
        assert splitter.last_id(text) == (expected[-1] if expected else None), text
    assert splitter.last_id("hello<a>  ") == tokenizer.convert_tokens_to_ids("<a>")
    assert splitter.last_id("   ") is None


def split_last(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)[-1]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_encoders_sharing_a_cache_give_the_ids_of_encoders_alone(qwen_tokenizer, name):
    messages = CONVERSATIONS[name]
    prompt = messages[: next(i for i, m in enumerate(messages) if m["role"] == "assistant")]
    cache = EncoderCache(qwen_tokenizer)
    for _ in range(2):  # the second encoder reads every prompt piece from the cache
        alone = ConversationEncoder(qwen_tokenizer, tools=TOOLS, chat_template="qwen2.5")
        shared = ConversationEncoder(qwen_tokenizer, tools=TOOLS, chat_template="qwen2.5", cache=cache)
        assert shared.start(prompt) == alone.start(prompt)
    assert cache.prompt_pieces


def test_a_cache_belongs_to_one_tokenizer(qwen_tokenizer, llama3_tokenizer):
    with pytest.raises(ValueError, match="another tokenizer"):
        ConversationEncoder(llama3_tokenizer, chat_template="llama3", cache=EncoderCache(qwen_tokenizer))


# ASCII text: quotes before letters in either case (the contractions), runs of white space of every kind, control
# characters, digits in runs (Llama 3 groups up to three), punctuation runs before newlines, escapes.
ASCII_PIECES = [
    "'s", "'S", "'re", "'LL", "'d", "'", "''t", " 's", "a", "Ab", " x", "  ", "   ", "\t", "\n", "\r", "\r\n", "\n\n",
    " \n", "\n ", " \t ", "\x0b", "\x0c", "\x00", "\x1f", "\x7f", "1", "1234", "12345", " 1", "!", " !", "?!\n", "</",
    "_", "...", '"', "\\u00e9", "value of k", "<tool_response>\n",
]


def ascii_texts(tokenizer, count, seed=0):
    rng = random.Random(seed)
    added = sorted(tokenizer.get_added_vocab())
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 14)):
            draw = rng.random()
            if draw < 0.55:
                parts.append(rng.choice(ASCII_PIECES))
            elif draw < 0.8:
                parts.append(chr(rng.randrange(128)))
            elif draw < 0.92:
                parts.append("".join(chr(rng.randrange(32, 127)) for _ in range(rng.randint(1, 8))))
            else:
                parts.append(rng.choice(added))
        texts.append("".join(parts))
    return texts


@pytest.mark.parametrize("fixture", ["qwen_tokenizer", "llama3_tokenizer"])
def test_ascii_text_cut_into_words_here_gives_the_tokenizers_ids(fixture, request, monkeypatch):
    tokenizer = request.getfixturevalue(fixture)
    splitter = TokenSplitter(tokenizer)
    assert splitter._words is not None  # their ASCII pieces are pre-tokenised here, each word's ids kept
    texts = ascii_texts(tokenizer, 1500, seed=len(fixture))
    assert all(text.isascii() for text in texts)
    monkeypatch.setattr(templates, "WORD_CACHE_SIZE", 40)  # a full word cache starts over
    assert_like_encode(splitter, tokenizer, texts, cache={})
    assert 0 < len(splitter._word_ids) <= 40
    assert_like_encode(splitter, tokenizer, random_texts(tokenizer, 200, seed=3))  # non-ASCII text: rust, whole


def test_other_pre_tokenizers_are_not_cut_here(qwen_tokenizer):
    # GPT-2's byte-level regex (not a known split pattern), and a known pattern after another normaliser
    assert TokenSplitter(small_tokenizer([plain("<a>")]))._words is None
    other = small_tokenizer([plain("<a>")])
    other.backend_tokenizer.pre_tokenizer = qwen_tokenizer.backend_tokenizer.pre_tokenizer
    assert TokenSplitter(other)._words is not None
    other.backend_tokenizer.normalizer = normalizers.Lowercase()
    splitter = TokenSplitter(other)
    assert splitter._words is None
    assert_like_encode(splitter, other, ["Hello World<a>X", "ABC 's"] + ascii_texts(other, 100))


@pytest.mark.parametrize("fixture", ["qwen_tokenizer", "llama3_tokenizer"])
def test_text_decoder_gives_the_tokenizers_text(fixture, request):
    tokenizer = request.getfixturevalue(fixture)
    decoder = TextDecoder(tokenizer)
    assert decoder._backend is not None  # transformers' per-call conversions are skipped
    rng = random.Random(1)
    special = sorted(tokenizer.get_added_vocab().values())
    for _ in range(300):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(120_000) for _ in range(rng.randint(0, 30))]
        assert decoder(ids) == tokenizer.decode(ids, skip_special_tokens=False)


def test_text_decoder_keeps_a_custom_decode_and_the_clean_up_flag():
    class Shouting(PreTrainedTokenizerFast):
        def decode(self, ids, **options):
            return super().decode(ids, **options).upper()

    shouting = Shouting(tokenizer_object=small_tokenizer([plain("<a>")]).backend_tokenizer)
    ids = shouting.encode("hello world<a>", add_special_tokens=False)
    assert TextDecoder(shouting)(ids) == "HELLO WORLD<A>"
    tokenizer = small_tokenizer([plain("<a>")])
    decoder = TextDecoder(tokenizer)
    tokenizer.clean_up_tokenization_spaces = True  # checked on every call: this one goes through decode
    calls = []
    tokenizer.decode = lambda ids, **options: calls.append(ids) or "decoded"
    assert decoder(ids) == "decoded" and calls == [ids]
