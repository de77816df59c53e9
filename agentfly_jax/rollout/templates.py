"""Chat templates: conversations to token ids with an exact action mask, one-shot or incrementally.

A conversation is a list of message dicts (`role`, `content`, and for assistant turns optionally
`tool_calls`: `[{"type": "function", "function": {"name": ..., "arguments": {...}}}]` or the flat
`[{"name": ..., "arguments": {...}}]`), plus an optional list of tool JSON schemas.

Templates come in two kinds:
- named templates written in Python here: `"qwen2.5"` and `"llama3"`, reproducing the models' reference
  Jinja templates character for character;
- any Hugging Face Jinja chat template (the tokenizer's own by default, or Jinja text), rendered by the
  tokenizer; the assistant turns are found by rendering the conversation prefix by prefix.

Both kinds render to `TextChunk`s, pieces of text flagged `generated` when the model writes them.

Mask convention: the action mask is 1 exactly on what a model writes in an assistant turn, i.e. what it
samples after the generation prompt up to and including the end-of-turn token at which it stops (Qwen2.5:
content, `<tool_call>` blocks and `<|im_end|>`; Llama 3: content and `<|eot_id|>`). Role headers,
system/user/tool text, the generation prompt and template text after the end-of-turn token (Qwen's "\\n"
after `<|im_end|>`) are 0.

Tokenisation: text between mask changes is tokenised in one piece (so special tokens split it as they
do in `tokenizer.apply_chat_template`); generated text is tokenised on its own, exactly as a model that
continues the generation prompt produces it. This equals tokenising the whole rendered text except where
a BPE merge would cross the start of an assistant turn (e.g. assistant content that starts with a line
break right after Qwen's "assistant\\n" header): such a one-shot tokenisation is not something the model
could have sampled, and token-in/token-out training needs the sampled form.

Rollouts (`ConversationEncoder`) do as little as each turn needs: sampled ids are kept, named templates are
rendered from the last message already appended on, and only new text is tokenised. `TokenSplitter` gives
the ids of `tokenizer.encode` while cutting text at added tokens the way a fast tokenizer does, so that an
`EncoderCache` shared by a rollout's chains tokenises their common prompt pieces once.

Images (Qwen2-VL / Qwen2.5-VL): an image content part (`{"type": "image", "image": ...}`, see
`images.load_image`) in a user, system or tool message renders as `<|vision_start|><|image_pad|><|vision_end|>`,
as the model's Jinja template writes it; encoding then stands each image's `<|image_pad|>` for as many pad tokens
as the vision tower gives it (`PreparedImage.num_tokens`), in order of appearance, exactly as transformers'
`Qwen2_5_VLProcessor` expands the rendered text. `Encoded.images` (and `ConversationEncoder.images`) are the
prepared images in that order. Image tokens are never generated: their mask is 0. A template must write one
`<|image_pad|>` per image part (a mismatch is an error); assistant messages cannot hold images, and video parts
are not encoded yet.
"""

from __future__ import annotations

import dataclasses
import json
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from agentfly_jax.images import IMAGE_PAD, ImageSettings, PreparedImage, image_source, prepare_image
from agentfly_jax.rollout.tokenizers import LLAMA3_PRETOKENIZER_PATTERN, QWEN_PRETOKENIZER_PATTERN

Message = dict[str, Any]

#: Image settings used when none are given: transformers' Qwen2-VL image processor defaults.
DEFAULT_IMAGE_SETTINGS = ImageSettings()


@dataclasses.dataclass(frozen=True)
class Encoded:
    """Token ids of a conversation and the action mask aligned to them (1 = written by the model), and the
    conversation's images in order of appearance (each stands for a run of `<|image_pad|>` ids)."""

    token_ids: list[int]
    action_mask: list[int]
    images: list[PreparedImage] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class TextChunk:
    """A piece of rendered conversation text; `generated` when an assistant turn writes it."""

    text: str
    generated: bool


class TemplateNotAppendOnlyError(ValueError):
    """Rendering a longer conversation changed text that an earlier rendering had already produced."""

    def __init__(self, message: str, token_position: int, char_position: int):
        super().__init__(message)
        self.token_position = token_position
        self.char_position = char_position


# --------------------------------------------------------------------------------------------------
# Message helpers
# --------------------------------------------------------------------------------------------------

QWEN_VISION_PLACEHOLDERS = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}


def _content_part_kind(part: Any) -> str:
    """'text', 'image' or 'video' for one content part (Qwen2-VL conventions for media parts)."""
    if isinstance(part, str):
        return "text"
    if not isinstance(part, dict):
        raise ValueError(f"content part must be a dict like {{'type': 'text', 'text': ...}}, got {part!r}")
    part_type = part.get("type")
    if part_type == "image" or "image" in part or "image_url" in part or part_type == "image_url":
        return "image"
    if part_type == "video" or "video" in part:
        return "video"
    if part_type == "text" or (part_type is None and "text" in part):
        if not isinstance(part.get("text"), str):
            raise ValueError(f"text content part needs a string 'text' field, got {part!r}")
        return "text"
    raise ValueError(
        f"unknown content part type {part_type!r} in {part!r}; expected 'text', 'image' or 'video'"
    )


def _text_of_content(content: Any, template_name: str, media_placeholders: dict[str, str] | None) -> str:
    """Text of a message's content: a string, None (empty) or a list of text/media parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"message content must be a string, None or a list of parts, got {type(content).__name__}"
        )
    pieces = []
    for part in content:
        kind = _content_part_kind(part)
        if kind == "text":
            pieces.append(part if isinstance(part, str) else part["text"])
        elif media_placeholders is None:
            raise ValueError(
                f"template {template_name!r} has no placeholder for {kind} content parts: images need a "
                "vision-language template, chat_template='qwen2.5' (Qwen2.5-VL's format) or a Jinja template that "
                f"writes {QWEN_VISION_PLACEHOLDERS['image']} per image"
            )
        else:
            pieces.append(media_placeholders[kind])
    return "".join(pieces)


def _has_media(content: Any) -> bool:
    return isinstance(content, list) and any(_content_part_kind(part) != "text" for part in content)


def _image_parts(messages: Sequence[Message], first_index: int = 0) -> list[Any]:
    """The image content parts of `messages`, in order; a video part or an assistant's image is an error."""
    parts = []
    for offset, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = _content_part_kind(part)
            if kind == "text":
                continue
            index = first_index + offset
            if kind == "video":
                raise ValueError(
                    f"message {index}: video content parts cannot be encoded yet (only images are expanded to "
                    "their vision tokens): give the frames as images"
                )
            if message.get("role") == "assistant":
                raise ValueError(f"message {index}: assistant messages cannot contain image or video parts")
            parts.append(part)
    return parts


def _image_pad_id(tokenizer: Any) -> int:
    """The id of `<|image_pad|>`, which must be one added token of the tokenizer."""
    ids = _encode_text(tokenizer, IMAGE_PAD)
    if len(ids) != 1 or IMAGE_PAD not in _added_vocab(tokenizer):
        raise ValueError(
            f"the conversation has images but the tokenizer has no {IMAGE_PAD} token: images need a Qwen2-VL / "
            "Qwen2.5-VL tokenizer (its vision tokens) and template"
        )
    return int(ids[0])


def vision_pad_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of `<|image_pad|>` and `<|video_pad|>` that the tokenizer has as added tokens (empty for a
    tokenizer without vision tokens). Each stands for one slot of an image's (video's) features: a policy must
    not write them itself."""
    added = _added_vocab(tokenizer)
    ids = set()
    for token in (IMAGE_PAD, "<|video_pad|>"):
        encoded = _encode_text(tokenizer, token) if token in added else []
        if len(encoded) == 1:
            ids.add(int(encoded[0]))
    return frozenset(ids)


def _expand_images(
    text: str,
    images: Sequence[PreparedImage],
    used: int,
    pad_id: int,
    encode: Callable[[str], list[int]],
    starts: list[int],
    offset: int,
) -> tuple[list[int], int]:
    """Ids of `text` with its k-th `<|image_pad|>` standing for `images[used + k]` (`num_tokens` pad ids), and the
    count of images used so far. Appends to `starts` where each image's pad run starts (`offset` + its index)."""
    pieces = text.split(IMAGE_PAD)
    if used + len(pieces) - 1 > len(images):
        _raise_image_count(used + len(pieces) - 1, len(images))
    ids: list[int] = encode(pieces[0])
    for piece in pieces[1:]:
        starts.append(offset + len(ids))
        ids.extend([pad_id] * images[used].num_tokens)
        used += 1
        ids.extend(encode(piece))
    return ids, used


def _raise_image_count(placeholders: int, images: int) -> None:
    raise ValueError(
        f"the chat template wrote {placeholders} {IMAGE_PAD} placeholders for {images} image parts: images need a "
        f"template that writes {QWEN_VISION_PLACEHOLDERS['image']} once per image part (chat_template='qwen2.5' or "
        f"Qwen2.5-VL's own), and no text may contain {IMAGE_PAD} itself"
    )


def _tojson(value: Any) -> str:
    """JSON as Hugging Face's chat-template `tojson` filter writes it (non-ASCII kept, default separators)."""
    return json.dumps(value, ensure_ascii=False)


def _tool_schemas(tools: Sequence[Any] | None) -> list[dict] | None:
    """Tool JSON schemas; Python functions are converted the way `apply_chat_template` converts them."""
    if tools is None:
        return None
    schemas = []
    for tool in tools:
        if isinstance(tool, dict):
            schemas.append(tool)
        elif callable(tool):
            from transformers.utils import get_json_schema

            schemas.append(get_json_schema(tool))
        else:
            raise ValueError(f"each tool must be a JSON schema dict or a documented function, got {tool!r}")
    return schemas


def _role_of(message: Message, index: int) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"message {index} must be a dict with a string 'role', got {message!r}")
    return message["role"]


# --------------------------------------------------------------------------------------------------
# Named templates
# --------------------------------------------------------------------------------------------------


class _ChunkWriter:
    """Accumulates TextChunks, joining neighbours with the same `generated` flag."""

    def __init__(self):
        self._runs: list[tuple[bool, list[str]]] = []  # (generated, texts) of each run, joined at the end

    def add(self, text: str, generated: bool = False) -> None:
        if not text:
            return
        if self._runs and self._runs[-1][0] == generated:
            self._runs[-1][1].append(text)
        else:
            self._runs.append((generated, [text]))

    @property
    def chunks(self) -> list[TextChunk]:
        return [TextChunk("".join(texts), generated) for generated, texts in self._runs]


QWEN2_5_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_QWEN2_5_TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_QWEN2_5_TOOLS_EPILOGUE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def _qwen2_5_tool_call_block(tool_call: Any, message_index: int) -> str:
    if not isinstance(tool_call, dict):
        raise ValueError(f"message {message_index}: each tool call must be a dict, got {tool_call!r}")
    call = tool_call.get("function", tool_call)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        raise ValueError(
            f"message {message_index}: tool call {tool_call!r} needs a string 'name' and 'arguments' "
            "(directly or under 'function')"
        )
    return (
        '<tool_call>\n{"name": "'
        + call["name"]
        + '", "arguments": '
        + _tojson(call["arguments"])
        + "}\n</tool_call>"
    )


# A named template is written as parts: (index, text, generated) with index -1 for text before the first
# message's, i for message i's text and len(messages) for the generation prompt. A message's text depends on
# it and its neighbours' roles only, so a longer conversation changes at most the last message's text: the
# ConversationEncoder renders named templates from the last message it has on (`first`), not from the start.
Part = tuple[int, str, bool]


def _collect(parts: Iterable[Part]) -> tuple[list[TextChunk], dict[int, int]]:
    """The TextChunks of `parts` and where each index's text starts in their joined text."""
    # (_ChunkWriter's joining, written out: this runs for every append of every chain)
    runs: list[tuple[bool, list[str]]] = []
    texts: list[str] = []
    last_generated = None
    starts: dict[int, int] = {}
    offset = 0
    for index, text, generated in parts:
        if index not in starts:
            starts[index] = offset
        if text:
            if generated == last_generated:
                texts.append(text)
            else:
                texts, last_generated = [text], generated
                runs.append((generated, texts))
            offset += len(text)
    return [TextChunk("".join(texts), generated) for generated, texts in runs], starts


def _qwen2_5_parts(
    messages: Sequence[Message],
    tools: Sequence[dict] | None,
    add_generation_prompt: bool,
    tokenizer: Any = None,
    first: int = 0,
) -> Iterator[Part]:
    if not messages:
        raise ValueError("cannot render an empty conversation: give at least one message")
    # the roles of the messages rendered and of the one before them (consecutive tool results share a turn)
    low = max(first - 1, 0)
    roles = [""] * low + [_role_of(message, index) for index, message in enumerate(messages[low:], low)]

    def text_of(message: Message) -> str:
        return _text_of_content(message.get("content"), "qwen2.5", QWEN_VISION_PLACEHOLDERS)

    if first == 0:
        system_text = text_of(messages[0]) if roles[0] == "system" else QWEN2_5_DEFAULT_SYSTEM
        if tools:
            tool_lines = "".join("\n" + _tojson(tool) for tool in tools)
            yield (
                -1,
                "<|im_start|>system\n" + system_text + _QWEN2_5_TOOLS_PREAMBLE + tool_lines
                + _QWEN2_5_TOOLS_EPILOGUE,
                False,
            )
        else:
            yield -1, "<|im_start|>system\n" + system_text + "<|im_end|>\n", False

    for index in range(first, len(messages)):
        role, message = roles[index], messages[index]
        yield index, "", False  # marks where this message's text starts, even when it has none
        if role == "system" and index == 0:
            continue
        if role in ("user", "system"):
            yield index, f"<|im_start|>{role}\n" + text_of(message) + "<|im_end|>\n", False
        elif role == "assistant":
            if _has_media(message.get("content")):
                raise ValueError(f"message {index}: assistant messages cannot contain image or video parts")
            content = text_of(message)
            tool_calls = message.get("tool_calls") or []
            blocks = [_qwen2_5_tool_call_block(call, index) for call in tool_calls]
            if blocks:
                written = (content + "\n" if content else "") + "\n".join(blocks)
            else:
                written = content
            yield index, "<|im_start|>assistant\n", False
            yield index, written + "<|im_end|>", True
            yield index, "\n", False
        elif role == "tool":
            # Consecutive tool results share one user turn.
            if index == 0 or roles[index - 1] != "tool":
                yield index, "<|im_start|>user", False
            yield index, "\n<tool_response>\n" + text_of(message) + "\n</tool_response>", False
            if index == len(messages) - 1 or roles[index + 1] != "tool":
                yield index, "<|im_end|>\n", False
        else:
            raise ValueError(
                f"message {index} has role {role!r}; "
                "the qwen2.5 template knows system, user, assistant and tool"
            )
    if add_generation_prompt:
        yield len(messages), "<|im_start|>assistant\n", False


def render_qwen2_5(
    messages: Sequence[Message],
    tools: Sequence[dict] | None,
    add_generation_prompt: bool,
    tokenizer: Any = None,
) -> list[TextChunk]:
    """Qwen2.5-Instruct's chat format (ChatML with Hermes-style tools), as TextChunks.

    Content may be a list of parts; image/video parts become Qwen2.5-VL placeholders
    (`<|vision_start|><|image_pad|><|vision_end|>`); encoding expands each image's `<|image_pad|>` to its
    vision tokens (see the module docstring).
    """
    return _collect(_qwen2_5_parts(messages, tools, add_generation_prompt, tokenizer))[0]


LLAMA3_HEADER = "<|start_header_id|>{role}<|end_header_id|>\n\n"


def _llama3_parts(
    messages: Sequence[Message],
    tools: Sequence[dict] | None,
    add_generation_prompt: bool,
    tokenizer: Any = None,
    first: int = 0,
) -> Iterator[Part]:
    if not messages:
        raise ValueError("cannot render an empty conversation: give at least one message")
    bos_token = getattr(tokenizer, "bos_token", None)
    if not bos_token:
        raise ValueError(
            "the llama3 template starts with the tokenizer's bos_token, but the tokenizer has none"
        )
    for index in range(first, len(messages)):
        message = messages[index]
        role = _role_of(message, index)
        yield index, "", False
        content = message.get("content")
        text = "None" if content is None else _text_of_content(content, "llama3", None)
        header = LLAMA3_HEADER.format(role=role)
        if index == 0:
            header = bos_token + header
        yield index, header, False
        yield index, text.strip() + "<|eot_id|>", role == "assistant"
    if add_generation_prompt:
        yield len(messages), LLAMA3_HEADER.format(role="assistant"), False


def render_llama3(
    messages: Sequence[Message],
    tools: Sequence[dict] | None,
    add_generation_prompt: bool,
    tokenizer: Any = None,
) -> list[TextChunk]:
    """Llama 3 Instruct's chat format (the reference `llama3.jinja`), as TextChunks.

    Like the reference template, this renders each message's content only: `tools` and assistant
    `tool_calls` have no place in it, and a tool result is a turn with the role header `tool`. Content is
    stripped of surrounding whitespace and a None content prints as "None", both as the template does.
    The tokenizer's `bos_token` starts the conversation.
    """
    return _collect(_llama3_parts(messages, tools, add_generation_prompt, tokenizer))[0]


#: The parts of each named renderer, for rendering from a given message on.
_NAMED_PARTS: dict[Callable[..., list[TextChunk]], Callable[..., Iterator[Part]]] = {
    render_qwen2_5: _qwen2_5_parts,
    render_llama3: _llama3_parts,
}


NAMED_TEMPLATES: dict[str, Callable[..., list[TextChunk]]] = {
    "qwen2.5": render_qwen2_5,
    "llama3": render_llama3,
}

#: The token each named template writes to end an assistant turn (generation must stop there).
NAMED_END_OF_TURN: dict[str, str] = {"qwen2.5": "<|im_end|>", "llama3": "<|eot_id|>"}


# --------------------------------------------------------------------------------------------------
# The generic path: a Hugging Face Jinja chat template
# --------------------------------------------------------------------------------------------------


def _first_difference(before: str, after: str) -> int:
    """Index of the first character where `after` stops extending `before`."""
    limit = min(len(before), len(after))
    for position in range(limit):
        if before[position] != after[position]:
            return position
    return limit


def _raise_not_append_only(tokenizer: Any, before: str, after: str, what: str) -> None:
    char_position = _first_difference(before, after)
    ids_before = tokenizer.encode(before, add_special_tokens=False)
    ids_after = tokenizer.encode(after, add_special_tokens=False)
    token_position = next(
        (i for i, (a, b) in enumerate(zip(ids_before, ids_after)) if a != b),
        min(len(ids_before), len(ids_after)),
    )
    raise TemplateNotAppendOnlyError(
        f"chat template is not append-only: {what} changes earlier tokens; first difference at token "
        f"{token_position} (character {char_position}): "
        f"had {before[char_position : char_position + 40]!r}, "
        f"now {after[char_position : char_position + 40]!r}. "
        "Token-in/token-out rollouts need a template that only appends (templates that rewrite earlier "
        "turns, e.g. drop past reasoning, cannot be used as is).",
        token_position=token_position,
        char_position=char_position,
    )


def _generated_length(tokenizer: Any, turn_text: str, end_tokens: Sequence[str] = ()) -> int:
    """Length of what the model writes at the start of `turn_text`: through its last special token.

    A model stops at its end-of-turn token (a special token, or one of `end_tokens`: the template's end-of-turn
    token, which a converted tokenizer need not mark special); template text after it is not generated.
    A turn without such tokens counts as generated in full.
    """
    end = 0
    for token in {*tokenizer.all_special_tokens, *end_tokens}:
        found = turn_text.rfind(token)
        if found >= 0:
            end = max(end, found + len(token))
    return end if end else len(turn_text)


class JinjaRenderer:
    """Renders with a Hugging Face Jinja chat template and marks assistant turns by prefix diffs."""

    def __init__(self, tokenizer: Any, chat_template: str):
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError(
                "the Jinja template path needs a Hugging Face tokenizer (with apply_chat_template)"
            )
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._end_tokens: tuple[str, ...] | None = None

    @property
    def end_tokens(self) -> tuple[str, ...]:
        """The added token(s) this template writes right after an assistant turn's content."""
        if self._end_tokens is None:
            # a renderer is made for every conversation (resolve_template), so the probe's answer is kept per
            # tokenizer, template and vocabulary size (a token added later probes again)
            key = (self.chat_template, _vocab_size(self.tokenizer))
            known = _per_tokenizer(_END_TOKENS, self.tokenizer) if key[1] is not None else None
            if known is not None and key in known:
                self._end_tokens = known[key]
                return self._end_tokens
            mark = "\u2063agentfly-end-probe\u2063"
            try:
                text = self.render_text([{"role": "user", "content": "ping"},
                                         {"role": "assistant", "content": mark}], None, False)
            except Exception:  # noqa: BLE001 - a template that refuses this probe names no end token
                text = ""
            after = text[text.rfind(mark) + len(mark):] if mark in text else ""
            added = [t for t in _added_vocab(self.tokenizer) if t and after.startswith(t)]
            self._end_tokens = (max(added, key=len),) if added else ()
            if known is not None:
                known[key] = self._end_tokens
        return self._end_tokens

    def render_text(
        self, messages: Sequence[Message], tools: Sequence[dict] | None, add_generation_prompt: bool
    ) -> str:
        """The template's text for `messages` (as `apply_chat_template(..., tokenize=False)`)."""
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def __call__(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict] | None,
        add_generation_prompt: bool,
        tokenizer=None,
    ) -> list[TextChunk]:
        if not messages:
            raise ValueError("cannot render an empty conversation: give at least one message")
        full_text = self.render_text(messages, tools, add_generation_prompt)
        generated_spans = []
        for index, message in enumerate(messages):
            if _role_of(message, index) != "assistant":
                continue
            if index == 0:
                raise ValueError(
                    "the Jinja template path finds an assistant turn after its generation prompt, so the "
                    "conversation must not start with an assistant message"
                )
            prompt_text = self.render_text(messages[:index], tools, True)
            through_text = self.render_text(messages[: index + 1], tools, False)
            if not through_text.startswith(prompt_text):
                _raise_not_append_only(
                    self.tokenizer,
                    prompt_text,
                    through_text,
                    f"adding assistant message {index} after its generation prompt",
                )
            if not full_text.startswith(through_text):
                _raise_not_append_only(
                    self.tokenizer,
                    through_text,
                    full_text,
                    f"adding the messages after assistant message {index}",
                )
            turn_start = len(prompt_text)
            generated_spans.append(
                (turn_start,
                 turn_start + _generated_length(self.tokenizer, through_text[turn_start:], self.end_tokens))
            )
        out = _ChunkWriter()
        cursor = 0
        for start, end in generated_spans:
            out.add(full_text[cursor:start])
            out.add(full_text[start:end], generated=True)
            cursor = end
        out.add(full_text[cursor:])
        return out.chunks


# Per-tokenizer answers that cost milliseconds each time (a fast tokenizer's get_added_vocab builds a dict of every
# added token from the Rust side: ~3 ms for Qwen2.5's), asked for every conversation encoded or rendered. Keyed by
# the tokenizer object (weakly: a tokenizer dropped takes its entries along) and its vocabulary size with the added
# tokens, so that tokens added to it later are seen.
_ADDED_VOCAB: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_END_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vocab_size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except (TypeError, NotImplementedError):
        return None


def _per_tokenizer(table: weakref.WeakKeyDictionary, tokenizer: Any) -> dict | None:
    """`tokenizer`'s own dict in `table` (made on first use), or None for an object that cannot be a weak key."""
    try:
        return table.setdefault(tokenizer, {})
    except TypeError:
        return None


def _added_vocab(tokenizer: Any) -> dict[str, int]:
    """{token: id} of the tokenizer's added tokens (special or not), {} for tokenizers without any. The dict is
    shared between calls for the same tokenizer and vocabulary size: read it, do not change it."""
    getter = getattr(tokenizer, "get_added_vocab", None)
    if not getter:
        return {}
    known = _per_tokenizer(_ADDED_VOCAB, tokenizer)
    size = _vocab_size(tokenizer)
    if known is not None and size is not None and size in known:
        return known[size]
    try:
        added = dict(getter())
    except (NotImplementedError, TypeError):
        added = {}
    if known is not None and size is not None:
        known.clear()  # only the current size is ever asked for again
        known[size] = added
    return added


def end_of_turn_ids(tokenizer: Any, chat_template: str | None = None) -> list[int]:
    """Ids of the token that ends an assistant turn under `chat_template`, whatever the tokenizer marks special.

    Named templates know their end-of-turn text (`NAMED_END_OF_TURN`); a Jinja template (given or the
    tokenizer's own) is rendered once to find the added token it writes right after an assistant's content.
    [] when that text is not a single token of this tokenizer.
    """
    renderer = resolve_template(tokenizer, chat_template)
    if isinstance(renderer, JinjaRenderer):
        texts = renderer.end_tokens
    else:
        name = next(n for n, r in NAMED_TEMPLATES.items() if r is renderer)
        texts = (NAMED_END_OF_TURN[name],)
    ids = []
    for text in texts:
        encoded = _encode_text(tokenizer, text)
        if len(encoded) == 1 and encoded[0] not in ids:
            ids.append(int(encoded[0]))
    return ids


def _looks_like_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def resolve_template(tokenizer: Any, chat_template: str | None, tools: Sequence[dict] | None = None):
    """The renderer for `chat_template`: a named template, Jinja text, or None for the tokenizer's own.

    A name of one of the tokenizer's own templates (when its `chat_template` is a dict) also works.
    """
    if chat_template in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[chat_template]
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError(
            f"chat_template must be a template name or Jinja text, got {type(chat_template).__name__}"
        )
    if chat_template is not None and _looks_like_jinja(chat_template):
        return JinjaRenderer(tokenizer, chat_template)
    own_templates = getattr(tokenizer, "chat_template", None)
    if chat_template is not None and not (isinstance(own_templates, dict) and chat_template in own_templates):
        raise ValueError(
            f"unknown chat template {chat_template!r}: give one of {sorted(NAMED_TEMPLATES)}, Jinja text, "
            "or None for the tokenizer's own template"
        )
    if own_templates is None:
        raise ValueError(
            "the tokenizer has no chat_template: pass chat_template= one of "
            f"{sorted(NAMED_TEMPLATES)} or the Jinja text of a template"
        )
    return JinjaRenderer(tokenizer, tokenizer.get_chat_template(chat_template, tools))


# --------------------------------------------------------------------------------------------------
# Tokenisation
# --------------------------------------------------------------------------------------------------


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _stock_fast_backend(tokenizer: Any, public: str, private: str, backend_method: str) -> Any:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer whose `public` method (transformers' base
    class's) and `private` one (the fast tokenizer's) are the stock ones, neither overridden on the class nor on
    the instance, and whose backend has `backend_method`; else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, backend_method):
        return None
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or any(name in vars(tokenizer) for name in (public, private)):
        return None
    if getattr(cls, public) is not getattr(PreTrainedTokenizerBase, public, None) or (
        getattr(cls, private) is not getattr(PreTrainedTokenizerFast, private, None)
    ):
        return None
    return backend


def _plain_fast_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer with the stock `encode`, else None."""
    return _stock_fast_backend(tokenizer, "encode", "_encode_plus", "get_added_tokens_decoder")


def _plain_fast_decode_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer with the stock `decode`, else None."""
    return _stock_fast_backend(tokenizer, "decode", "_decode", "decode")


class TextDecoder:
    """`tokenizer.decode(ids, skip_special_tokens=False)`, exactly, with less work for a fast tokenizer.

    transformers' `decode` converts the ids (a pass over them in Python), calls the rust tokenizer's `decode` and
    then cleans up tokenization spaces when `clean_up_tokenization_spaces` is set. For a fast tokenizer with the
    stock `decode` and that flag off (Qwen2.5, Llama 3) the rust `decode` is called directly; otherwise (the flag
    on, checked on every call, a custom or slow tokenizer) everything goes through `tokenizer.decode`.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._backend = _plain_fast_decode_backend(tokenizer)

    def __call__(self, ids: list[int]) -> str:
        if self._backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", True):
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)


# The split patterns of the Qwen2.5 and Llama 3 pre-tokenizers (agentfly_jax.rollout.tokenizers spells them out)
# and what each one does on ASCII text, where \p{L} is [A-Za-z], \p{N} is [0-9], \s and \S are the ASCII ones and
# the (?i:...) contractions fold ASCII case only. Every ASCII character is a letter, a digit, white space or one
# of the rest, which the punctuation alternative takes: the matches tile any ASCII text.
_ASCII_SPLIT_PATTERNS = {
    QWEN_PRETOKENIZER_PATTERN: r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
    + r"| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    LLAMA3_PRETOKENIZER_PATTERN: r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}"
    + r"| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_byte_level_ascii: dict[int, str] | None = None
# Words (pre-tokenizer pieces) a TokenSplitter keeps the ids of; past this it starts over.
WORD_CACHE_SIZE = 100_000


def _ascii_byte_level() -> dict[int, str]:
    """str.translate table: each ASCII character as the byte-level pre-tokenizer writes it (`Ġ` for a space...)."""
    global _byte_level_ascii
    if _byte_level_ascii is None:
        from tokenizers import pre_tokenizers

        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        table = {}
        for code in range(128):
            [(mapped, _)] = byte_level.pre_tokenize_str(chr(code))
            table[code] = mapped
        _byte_level_ascii = table
    return _byte_level_ascii


def _ascii_word_splitter(backend: Any) -> Any:
    """A compiled `re` pattern that cuts ASCII text exactly as `backend`'s normalizer and pre-tokenizer do, when they
    are NFC (or none) and a Split by a known pattern (`_ASCII_SPLIT_PATTERNS`, isolated) then a byte-level mapping
    without its own regex or prefix space, with a BPE model without dropout; else None."""
    try:
        normalizer = backend.normalizer
        if normalizer is not None and json.loads(normalizer.__getstate__()) != {"type": "NFC"}:
            return None
        if backend.pre_tokenizer is None or type(backend.model).__name__ != "BPE" or backend.model.dropout:
            return None
        state = json.loads(backend.pre_tokenizer.__getstate__())
    except Exception:  # noqa: BLE001 - a backend that cannot say what it is takes the general path
        return None
    steps = state.get("pretokenizers") if state.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2:
        return None
    split, byte_level = steps
    pattern = split.get("pattern") if isinstance(split.get("pattern"), dict) else {}
    ascii_pattern = _ASCII_SPLIT_PATTERNS.get(pattern.get("Regex"))
    if (
        ascii_pattern is None
        or split != {"type": "Split", "pattern": pattern, "behavior": "Isolated", "invert": False}
        or {key: value for key, value in byte_level.items() if key != "trim_offsets"}
        != {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
    ):
        return None
    return re.compile(ascii_pattern, re.ASCII)


class TokenSplitter:
    """`tokenizer.encode(text, add_special_tokens=False)`, exactly, with less work for a fast tokenizer.

    A Hugging Face fast tokenizer first cuts text at its added tokens (`<|im_start|>`, `<tool_call>`, ...:
    the leftmost, then longest, match of their texts) and tokenises each piece between them on its own. When
    every added token matches its raw text only (not `normalized`, no `lstrip`/`rstrip`/`single_word`, as in
    the Qwen2.5 and Llama 3 tokenizers) this cut is reproduced here with the same result, which allows:

    - `encode(text, cache)`: pieces already in `cache` (a dict shared by whoever repeats them: a rollout's
      prompts share their system block and tool list, a task's chains their whole prompt) are not tokenised
      again;
    - `last_id(text)`: the last id of a text from its last piece only (none at all when it ends with an
      added token).

    The rust tokenizer is called directly, as transformers does, without its per-call bookkeeping. Every
    call checks that nothing that call would change is set: truncation or padding left on the backend by
    an earlier call, `split_special_tokens`, tokens added since. Otherwise, and for any other tokenizer (slow,
    custom `encode`, other added-token options), everything goes through `tokenizer.encode`.

    ASCII pieces of the Qwen2.5 and Llama 3 tokenizers (NFC or no normalizer, their split pattern, byte-level
    BPE) are cut into the pre-tokenizer's words here (`_ASCII_SPLIT_PATTERNS`: the rust regex is most of the
    cost of encoding a short text), and each word's ids come from the BPE model itself
    (`model.tokenize`), kept per word: ids are those of `tokenizer.encode`, which tokenises each word on its own.
    Other text goes to the rust tokenizer whole.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._backend = None
        self._pattern: Any = None
        self._token_ids: dict[str, int] = {}
        backend = _plain_fast_backend(tokenizer)
        if backend is None:
            return
        added = list(backend.get_added_tokens_decoder().values())
        if any(token.normalized or token.lstrip or token.rstrip or token.single_word for token in added):
            return
        # Longest first: at the leftmost position a match starts, the regex takes the longest added token.
        contents = sorted({token.content for token in added if token.content}, key=len, reverse=True)
        self._token_ids = {content: backend.token_to_id(content) for content in contents}
        if contents:
            self._pattern = re.compile("|".join(re.escape(content) for content in contents))
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._backend = backend
        self._words = _ascii_word_splitter(backend)  # None: every piece goes to the rust tokenizer
        self._word_ids: dict[str, list[int]] = {}
        self._model = backend.model
        self._byte_level = _ascii_byte_level() if self._words is not None else {}

    @property
    def uses_fast_path(self) -> bool:
        """Whether this tokenizer qualifies for the split (each call still checks the tokenizer's state)."""
        return self._backend is not None

    def _fast(self) -> bool:
        backend = self._backend
        return (
            backend is not None
            and backend.truncation is None
            and backend.padding is None
            and not backend.encode_special_tokens
            and not getattr(self.tokenizer, "split_special_tokens", False)
            and backend.get_vocab_size(with_added_tokens=True) == self._vocab_size
        )

    def _pieces(self, text: str) -> list[tuple[str, int | None]]:
        """(text, id) of the added tokens and (text, None) of the pieces between them, in order."""
        if self._pattern is None:
            return [(text, None)]
        pieces, cursor = [], 0
        for match in self._pattern.finditer(text):
            if match.start() > cursor:
                pieces.append((text[cursor : match.start()], None))
            pieces.append((match.group(), self._token_ids[match.group()]))
            cursor = match.end()
        if cursor < len(text):
            pieces.append((text[cursor:], None))
        return pieces

    def _piece_ids(self, piece: str) -> list[int]:
        """The ids of a piece that holds no added token (a new list)."""
        if self._words is None or not piece.isascii():
            return self._backend.encode(piece, add_special_tokens=False).ids
        word_ids, ids = self._word_ids, []
        for word in self._words.findall(piece):
            known = word_ids.get(word)
            if known is None:
                if len(word_ids) >= WORD_CACHE_SIZE:
                    word_ids.clear()
                mapped = word.translate(self._byte_level)
                known = word_ids[word] = [token.id for token in self._model.tokenize(mapped)]
            ids += known
        return ids

    def encode(self, text: str, cache: dict[str, list[int]] | None = None) -> list[int]:
        """The ids of `text`; with `cache`, the text and the pieces between its added tokens are looked up there
        (and stored)."""
        if not text:
            return []
        if not self._fast():
            return _encode_text(self.tokenizer, text)
        if cache is None:
            if self._words is None or not text.isascii():
                return self._backend.encode(text, add_special_tokens=False).ids
            ids = []
            for piece, token_id in self._pieces(text):
                if token_id is not None:
                    ids.append(token_id)
                else:
                    ids += self._piece_ids(piece)
            return ids
        # The whole text first (the chains of a task repeat their prompt's chunks), then its pieces. One dict
        # serves both: each key maps to the ids of that very text.
        known = cache.get(text)
        if known is not None:
            return list(known)
        ids: list[int] = []
        for piece, token_id in self._pieces(text):
            if token_id is not None:
                ids.append(token_id)
                continue
            piece_ids = cache.get(piece)
            if piece_ids is None:
                piece_ids = cache[piece] = self._piece_ids(piece)
            ids.extend(piece_ids)
        cache[text] = list(ids)
        return ids

    def last_id(self, text: str) -> int | None:
        """The last of `text`'s ids (None for no ids)."""
        if not text:
            return None
        if not self._fast():
            ids = _encode_text(self.tokenizer, text)
            return ids[-1] if ids else None
        end = len(text)
        while end:
            last = None  # the last added token before `end` (the cut runs left to right)
            for match in self._pattern.finditer(text, 0, end) if self._pattern is not None else ():
                last = match
            if last is not None and last.end() == end:
                return self._token_ids[last.group()]
            start = last.end() if last is not None else 0
            ids = self._piece_ids(text[start:end])
            if ids:
                return ids[-1]
            end = start  # the piece gave no ids: the last id is further back (the token before it, if any)
        return None


class EncoderCache:
    """What the ConversationEncoders of one rollout share: a TokenSplitter, tokenised prompt pieces, end ids.

    Every chain of a task starts from the same prompt and every task from the same system block and tool
    list; with one cache per rollout those pieces are tokenised once. Made for one rollout (one tokenizer
    that does not change meanwhile); it keeps every prompt piece it saw.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.splitter = TokenSplitter(tokenizer)
        self.prompt_pieces: dict[str, list[int]] = {}
        self._end_ids: dict[str | None, frozenset[int]] = {}
        self._image_pad_id: int | None = None
        self._vision_pad_ids: frozenset[int] | None = None
        # prompt images prepared once per rollout: (settings, source key) -> (source, PreparedImage); the source is
        # kept so that an id() key is not reused by another object meanwhile
        self._prompt_images: dict[tuple, tuple[Any, PreparedImage]] = {}

    @property
    def vision_pad_ids(self) -> frozenset[int]:
        """`vision_pad_ids(tokenizer)`, worked out once per rollout."""
        if self._vision_pad_ids is None:
            self._vision_pad_ids = vision_pad_ids(self.tokenizer)
        return self._vision_pad_ids

    @property
    def image_pad_id(self) -> int:
        """The tokenizer's `<|image_pad|>` id (an error naming the problem when it has none)."""
        if self._image_pad_id is None:
            self._image_pad_id = _image_pad_id(self.tokenizer)
        return self._image_pad_id

    def prompt_image(self, part: Any, settings: ImageSettings) -> PreparedImage:
        """The prepared image of a prompt's content part, prepared once for all chains that share the object (or
        the path, bytes or data URL)."""
        source = image_source(part)
        if isinstance(source, (str, Path, bytes)):
            key = (settings, type(source).__name__, source)
        else:
            key = (settings, "object", id(source))
        if key not in self._prompt_images:
            self._prompt_images[key] = (source, prepare_image(source, settings))
        return self._prompt_images[key][1]

    def end_ids(self, chat_template: str | None) -> frozenset[int]:
        """Ids that end a turn: the tokenizer's special tokens and `chat_template`'s end-of-turn token."""
        if chat_template not in self._end_ids:
            self._end_ids[chat_template] = frozenset(self.tokenizer.all_special_ids) | frozenset(
                end_of_turn_ids(self.tokenizer, chat_template)
            )
        return self._end_ids[chat_template]


def encode_chunks(
    tokenizer: Any, chunks: Sequence[TextChunk], images: Sequence[PreparedImage] = ()
) -> Encoded:
    """Token ids and action mask of rendered chunks; each run of same-flag text is tokenised in one piece.

    `images`: the conversation's images in order; each `<|image_pad|>` of the text stands for the next one's
    pad tokens (there must be exactly one per image, none in generated text).
    """
    token_ids: list[int] = []
    action_mask: list[int] = []
    if not images:
        for chunk in chunks:
            ids = _encode_text(tokenizer, chunk.text)
            token_ids.extend(ids)
            action_mask.extend([int(chunk.generated)] * len(ids))
        return Encoded(token_ids=token_ids, action_mask=action_mask)
    pad_id, used, starts = _image_pad_id(tokenizer), 0, []
    for chunk in chunks:
        if chunk.generated and IMAGE_PAD in chunk.text:
            raise ValueError(f"generated (assistant) text cannot hold {IMAGE_PAD}: images go in other messages")
        ids, used = _expand_images(
            chunk.text, images, used, pad_id, lambda text: _encode_text(tokenizer, text), starts, len(token_ids)
        )
        token_ids.extend(ids)
        action_mask.extend([int(chunk.generated)] * len(ids))
    if used != len(images):
        _raise_image_count(used, len(images))
    return Encoded(token_ids=token_ids, action_mask=action_mask, images=list(images))


def render_conversation(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    tools: Sequence[Any] | None = None,
    chat_template: str | None = None,
    add_generation_prompt: bool = False,
) -> list[TextChunk]:
    """The conversation's text as TextChunks (generated or not), with the chosen template."""
    schemas = _tool_schemas(tools)
    renderer = resolve_template(tokenizer, chat_template, schemas)
    return renderer(messages, schemas, add_generation_prompt, tokenizer)


def encode_conversation(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    tools: Sequence[Any] | None = None,
    chat_template: str | None = None,
    add_generation_prompt: bool = False,
    image_settings: ImageSettings | None = None,
) -> Encoded:
    """Token ids of a whole conversation and the action mask (1 on every assistant turn's generated tokens).

    `chat_template` is "qwen2.5", "llama3", Jinja text, or None for the tokenizer's own Jinja template.
    `tools` is a list of tool JSON schemas (or documented functions), rendered where the template puts them.
    Image parts are loaded and resized with `image_settings` (default: the Qwen2-VL processor's) and expanded to
    their vision tokens; `Encoded.images` holds them in order.
    """
    chunks = render_conversation(
        tokenizer,
        messages,
        tools=tools,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
    )
    settings = image_settings if image_settings is not None else DEFAULT_IMAGE_SETTINGS
    images = [prepare_image(part, settings) for part in _image_parts(messages)]
    return encode_chunks(tokenizer, chunks, images)


# --------------------------------------------------------------------------------------------------
# Incremental encoding for rollouts
# --------------------------------------------------------------------------------------------------


class ConversationEncoder:
    """Token-in/token-out encoding of one rollout: sampled ids are kept, the rest is rendered incrementally.

    Usage: `prompt_ids = enc.start(messages)` (ids up to and including the generation prompt), then per turn
    `enc.append_assistant(sampled_ids, message)` and `new_ids = enc.append_messages(tool_or_user_messages)`
    (the observation and the next generation prompt). `enc.encoded()` gives all ids and the action mask.

    Every append renders the conversation again and checks that the earlier text is unchanged
    (`TemplateNotAppendOnlyError` names the first differing token otherwise); only the new text is
    tokenised. A Jinja template renders the whole conversation each time; a named template renders from the
    last message appended before on (the only earlier message whose text a longer conversation can change),
    so messages already appended are not read again. `cache`: an `EncoderCache` shared by the encoders of one
    rollout, so that prompt pieces they have in common are tokenised once (each encoder makes its own
    otherwise).

    Images in the prompt and in appended messages are prepared with `image_settings` (default: the Qwen2-VL
    processor's) and expanded to their pad tokens (see the module docstring); `images` lists them in order and
    `image_starts` where each one's pad run starts in `token_ids`. The prompt's images are prepared once per
    `cache` (the chains of a task share them).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Sequence[Any] | None = None,
        chat_template: str | None = None,
        cache: EncoderCache | None = None,
        image_settings: ImageSettings | None = None,
    ):
        if cache is not None and cache.tokenizer is not tokenizer:
            raise ValueError("the EncoderCache was made for another tokenizer: make one per tokenizer")
        self.tokenizer = tokenizer
        self.tools = _tool_schemas(tools)
        self._chat_template = chat_template
        self._render = resolve_template(tokenizer, chat_template, self.tools)
        self._parts = _NAMED_PARTS.get(self._render)  # None for a Jinja template
        self._cache = cache if cache is not None else EncoderCache(tokenizer)
        self._splitter = self._cache.splitter
        # ids that end a turn: the tokenizer's special tokens and the template's end-of-turn token
        self._end_ids = self._cache.end_ids(chat_template)
        self.messages: list[Message] = []
        self.token_ids: list[int] = []
        self.action_mask: list[int] = []
        self._rendered_text = ""  # the template's text for self.messages (ids may hold sampled forms of it)
        self._starts: list[int] = []  # named templates: where each message's text starts in _rendered_text
        self._pending_text = ""  # template text after the last assistant turn, not yet tokenised
        self._awaiting_assistant = False
        self._started = False
        self.image_settings = image_settings if image_settings is not None else DEFAULT_IMAGE_SETTINGS
        self.images: list[PreparedImage] = []
        self.image_starts: list[int] = []  # where each image's <|image_pad|> run starts in token_ids

    def _encode_with_images(
        self, texts: Sequence[str], images: Sequence[PreparedImage], cache: dict[str, list[int]] | None = None
    ) -> list[list[int]]:
        """The ids of each of `texts` (new text, tokenised each on its own) whose `<|image_pad|>`s stand for
        `images` (all of them, in order); records the images and where each one's pad run starts."""
        pad_id, used, offset = self._cache.image_pad_id, 0, len(self.token_ids)
        starts: list[int] = []
        out = []
        for text in texts:
            ids, used = _expand_images(
                text, images, used, pad_id, lambda piece: self._splitter.encode(piece, cache), starts, offset
            )
            offset += len(ids)
            out.append(ids)
        if used != len(images):
            _raise_image_count(used, len(images))
        self.images.extend(images)
        self.image_starts.extend(starts)
        return out

    def _render_named(
        self, messages: Sequence[Message], add_generation_prompt: bool
    ) -> tuple[str, list[TextChunk], int, list[int]]:
        """A named template's text for `messages` (self.messages and what follows), rendered from the last of
        self.messages on (from the start before start()); with the chunks of that rendered part, where it
        starts and where each message's text starts."""
        first = max(len(self.messages) - 1, 0)
        prefix_length = self._starts[first] if first else 0  # from message 0 on, the text before it too
        parts = self._parts(messages, self.tools, add_generation_prompt, self.tokenizer, first)
        chunks, starts = _collect(parts)
        text = self._rendered_text[:prefix_length] + "".join(chunk.text for chunk in chunks)
        message_starts = self._starts[:first] + [prefix_length + starts[i] for i in range(first, len(messages))]
        return text, chunks, prefix_length, message_starts

    def _text(self, messages: Sequence[Message], add_generation_prompt: bool) -> tuple[str, list[int]]:
        # The Jinja path renders text directly: marking every earlier assistant turn is not needed here.
        if self._parts is None:
            return self._render.render_text(messages, self.tools, add_generation_prompt), []
        text, _, _, message_starts = self._render_named(messages, add_generation_prompt)
        return text, message_starts

    def _render_turn(self, message: Message) -> tuple[str, int, list[int]]:
        """Text of the conversation through assistant `message`, where that turn's generated text ends, and
        (named templates) where each message's text starts."""
        turn_start = len(self._rendered_text)
        if self._parts is None:
            through_text = self._render.render_text(self.messages + [message], self.tools, False)
            self._check_extends(through_text, f"adding assistant message {len(self.messages)}")
            return through_text, turn_start + _generated_length(self.tokenizer, through_text[turn_start:],
                                                                self._render.end_tokens), []
        through_text, chunks, offset, message_starts = self._render_named(self.messages + [message], False)
        self._check_extends(through_text, f"adding assistant message {len(self.messages)}")
        generated_end = turn_start
        for chunk in chunks:
            offset += len(chunk.text)
            if chunk.generated and offset > turn_start:
                generated_end = offset
        return through_text, generated_end, message_starts

    def _check_extends(self, new_text: str, what: str) -> None:
        if not new_text.startswith(self._rendered_text):
            _raise_not_append_only(self.tokenizer, self._rendered_text, new_text, what)

    def start(self, messages: Sequence[Message], tools: Sequence[Any] | None = None) -> list[int]:
        """Encode the prompt messages plus the generation prompt; returns those ids (all with mask 0).

        `tools`, when given, replaces the tools passed to the constructor for this rollout.
        Assistant messages inside the prompt (e.g. few-shot turns) were not sampled by the policy: mask 0.
        """
        if self._started:
            raise ValueError(
                "start() was already called on this ConversationEncoder; make a new one per rollout"
            )
        if tools is not None:
            self.tools = _tool_schemas(tools)
            self._render = resolve_template(self.tokenizer, self._chat_template, self.tools)
            self._parts = _NAMED_PARTS.get(self._render)
        if self._parts is None:
            chunks, message_starts = self._render(messages, self.tools, True, self.tokenizer), []
        else:
            _, chunks, _, message_starts = self._render_named(messages, True)
        # As encode_chunks: each chunk on its own (the pieces of the prompt's chunks repeat across chains).
        token_ids: list[int] = []
        image_parts = _image_parts(messages)
        if image_parts:
            images = [self._cache.prompt_image(part, self.image_settings) for part in image_parts]
            texts = [chunk.text for chunk in chunks]
            for ids in self._encode_with_images(texts, images, self._cache.prompt_pieces):
                token_ids.extend(ids)
        else:
            for chunk in chunks:
                token_ids.extend(self._splitter.encode(chunk.text, self._cache.prompt_pieces))
        self.messages = list(messages)
        self.token_ids = token_ids
        self.action_mask = [0] * len(token_ids)
        self._rendered_text = "".join(chunk.text for chunk in chunks)
        self._starts = message_starts
        self._awaiting_assistant = True
        self._started = True
        return list(self.token_ids)

    def _message_from_sampled(self, sampled_ids: Sequence[int]) -> Message:
        ids = list(sampled_ids)
        if ids and ids[-1] in self._end_ids:
            ids = ids[:-1]  # the end-of-turn token is not part of the content
        return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=False)}

    def append_assistant(self, sampled_ids: Sequence[int], message: Message | None = None) -> None:
        """Append the ids the policy sampled for this assistant turn (mask 1), exactly as sampled.

        `message` (role assistant, with content and optionally tool_calls) is what later renderings of the
        conversation show for this turn; by default the decoded sampled text. If the sampled ids do not end
        with the template's end-of-turn token (cut off by a length limit or a stop string), that token is
        added before the next messages, with mask 0.
        """
        if not self._awaiting_assistant:
            raise ValueError(
                "append_assistant() needs a generation prompt first: call start() or append_messages(..., "
                "add_generation_prompt=True) before it"
            )
        if message is None:
            message = self._message_from_sampled(sampled_ids)
        if message.get("role") != "assistant":
            raise ValueError(
                f"append_assistant() takes an assistant message, got role {message.get('role')!r}"
            )
        if _has_media(message.get("content")):
            raise ValueError("append_assistant(): assistant messages cannot contain image or video parts")
        through_text, generated_end, message_starts = self._render_turn(message)
        # The rendered turn's last token is the end-of-turn token; a sample cut off before it gets it here.
        end_of_turn_text = ""
        rendered_end_id = self._splitter.last_id(through_text[len(self._rendered_text) : generated_end])
        if rendered_end_id in self._end_ids and list(sampled_ids[-1:]) != [
            rendered_end_id
        ]:
            end_of_turn_text = self.tokenizer.decode([rendered_end_id], skip_special_tokens=False)

        self.token_ids.extend(map(int, sampled_ids))
        self.action_mask.extend([1] * len(sampled_ids))
        self.messages.append(message)
        self._rendered_text = through_text
        self._starts = message_starts
        self._pending_text = end_of_turn_text + through_text[generated_end:]
        self._awaiting_assistant = False

    def append_messages(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Append non-assistant messages (tool results, user turns) and the next generation prompt.

        Returns only the new ids (mask 0): template text left over from the last assistant turn, the
        observation, and the generation prompt when `add_generation_prompt`.
        """
        if self._awaiting_assistant:
            raise ValueError(
                "the conversation ends with a generation prompt: append_assistant() must come next"
            )
        if not self._started:
            raise ValueError("call start() before append_messages()")
        for index, message in enumerate(messages):
            if _role_of(message, index) == "assistant":
                raise ValueError(
                    "append_messages() takes tool/user messages; append sampled turns with append_assistant()"
                )
        new_full_text, message_starts = self._text(self.messages + list(messages), add_generation_prompt)
        self._check_extends(
            new_full_text, f"adding messages {len(self.messages)}..{len(self.messages) + len(messages) - 1}"
        )
        new_text = self._pending_text + new_full_text[len(self._rendered_text) :]
        image_parts = _image_parts(messages, first_index=len(self.messages))
        if image_parts:
            images = [prepare_image(part, self.image_settings) for part in image_parts]
            [new_ids] = self._encode_with_images([new_text], images)
        else:
            new_ids = self._splitter.encode(new_text)
        self.token_ids.extend(new_ids)
        self.action_mask.extend([0] * len(new_ids))
        self.messages.extend(messages)
        self._rendered_text = new_full_text
        self._starts = message_starts
        self._pending_text = ""
        self._awaiting_assistant = add_generation_prompt
        return new_ids

    def finish(self) -> Encoded:
        """Close the conversation and return all ids and the action mask.

        Template text still pending after the last assistant turn (Qwen's "\\n" after `<|im_end|>`, or the
        end-of-turn token of a cut-off turn) is appended with mask 0, so the ids equal
        `encode_conversation(tokenizer, enc.messages, add_generation_prompt=...)` when every sampled turn
        matches its rendering. A conversation that ends with a generation prompt has nothing pending.
        """
        tail_ids = self._splitter.encode(self._pending_text)
        self.token_ids.extend(tail_ids)
        self.action_mask.extend([0] * len(tail_ids))
        self._pending_text = ""
        return self.encoded()

    def encoded(self) -> Encoded:
        """The ids, action mask and images of everything appended so far."""
        return Encoded(token_ids=list(self.token_ids), action_mask=list(self.action_mask), images=list(self.images))
