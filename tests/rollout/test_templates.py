"""encode_conversation and ConversationEncoder against Hugging Face's own Jinja rendering.

The independent reference is `tokenizer.apply_chat_template(..., tokenize=True)` with the reference
Qwen2.5-Instruct and Llama 3 Instruct templates (tests/rollout/data). The Qwen2.5 tokenizer is the real
one rebuilt offline; the Llama 3 tokenizer is a stand-in with Llama 3's special tokens on the Qwen BPE
(see conftest.py).
"""

import unicodedata

import numpy as np
import PIL.Image
import pytest

from agentfly_jax.images import ImageError
from agentfly_jax.rollout.templates import (
    ConversationEncoder,
    TemplateNotAppendOnlyError,
    encode_conversation,
    render_conversation,
    render_qwen2_5,
)
from tests.rollout.conversations import CONVERSATIONS, TOOLS
from tests.rollout.fakes import tool_call_text

FAMILIES = {
    # family: (tokenizer fixture holding the reference Jinja template, named template, end-of-turn token)
    "qwen2.5": ("qwen_tokenizer", "qwen2.5", "<|im_end|>"),
    "llama3": ("llama3_tokenizer", "llama3", "<|eot_id|>"),
}


def hf_token_ids(tokenizer, messages, tools, add_generation_prompt):
    """Token ids from Hugging Face's Jinja rendering + tokenisation (transformers 5 gives a BatchEncoding)."""
    out = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    return list(out["input_ids"]) if not isinstance(out, list) else out


def hf_generated_turns(tokenizer, messages, tools, end_of_turn):
    """Each assistant turn as the model writes it: HF's text after the generation prompt, to end_of_turn."""
    turns = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(
            messages[:index], tools=tools, add_generation_prompt=True, tokenize=False
        )
        through = tokenizer.apply_chat_template(messages[: index + 1], tools=tools, tokenize=False)
        assert through.startswith(prompt)
        turn = through[len(prompt) :]
        turns.append(turn[: turn.rindex(end_of_turn) + len(end_of_turn)])
    return turns


def masked_runs(encoded):
    """Maximal runs of token ids with action_mask 1."""
    runs, current = [], []
    for token, bit in zip(encoded.token_ids, encoded.action_mask):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


CASES = [
    pytest.param(
        family, conversation, tools, generation_prompt, id=f"{family}-{conversation}-{tools_id}-{gp_id}"
    )
    for family in FAMILIES
    for conversation in CONVERSATIONS
    for tools, tools_id in ((None, "no_tools"), (TOOLS, "tools"))
    for generation_prompt, gp_id in ((False, "closed"), (True, "generation_prompt"))
]


@pytest.mark.parametrize("family, conversation, tools, add_generation_prompt", CASES)
def test_named_and_generic_templates_equal_hf_apply_chat_template(
    request, family, conversation, tools, add_generation_prompt
):
    fixture, name, _ = FAMILIES[family]
    tokenizer = request.getfixturevalue(fixture)
    messages = CONVERSATIONS[conversation]
    expected = hf_token_ids(tokenizer, messages, tools, add_generation_prompt)
    named = encode_conversation(
        tokenizer, messages, tools=tools, chat_template=name, add_generation_prompt=add_generation_prompt
    )
    generic = encode_conversation(
        tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt
    )
    assert named.token_ids == expected
    assert generic.token_ids == expected
    assert named.action_mask == generic.action_mask
    assert len(named.action_mask) == len(named.token_ids)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("with_tools", [False, True], ids=["no_tools", "tools"])
def test_masked_runs_decode_to_each_assistant_turn(request, family, conversation, with_tools):
    fixture, name, end_of_turn = FAMILIES[family]
    tokenizer = request.getfixturevalue(fixture)
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if with_tools else None
    # Both tokenizers NFC-normalise (as Qwen2.5's does), so a model can only write the NFC form.
    expected_turns = [
        unicodedata.normalize("NFC", turn)
        for turn in hf_generated_turns(tokenizer, messages, tools, end_of_turn)
    ]
    for chat_template in (name, None):
        encoded = encode_conversation(tokenizer, messages, tools=tools, chat_template=chat_template)
        decoded = [tokenizer.decode(run, skip_special_tokens=False) for run in masked_runs(encoded)]
        assert decoded == expected_turns


def test_qwen_mask_boundaries_written_out(qwen_tokenizer):
    """The exact split for one tool-calling turn, written by hand from the Qwen2.5 format."""
    messages = CONVERSATIONS["several_tool_calls_then_consecutive_results"][:4]
    encoded = encode_conversation(qwen_tokenizer, messages, chat_template="qwen2.5")
    runs = [qwen_tokenizer.decode(run) for run in masked_runs(encoded)]
    assert runs == [
        (
            "I will compute and search in parallel.\n"
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": {"query": "Dune novel author", "top_k": 2}}\n'
            "</tool_call><|im_end|>"
        )
    ]
    first = encoded.action_mask.index(1)
    last = len(encoded.action_mask) - 1 - encoded.action_mask[::-1].index(1)
    im_start, im_end = qwen_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    # Generation prompt "<|im_start|>assistant\n" is not masked; "\n" after <|im_end|> is not masked.
    assert qwen_tokenizer.decode(encoded.token_ids[first - 3 : first]) == "<|im_start|>assistant\n"
    assert encoded.token_ids[first - 3] == im_start
    assert encoded.token_ids[last] == im_end
    assert qwen_tokenizer.decode(encoded.token_ids[last + 1 : last + 3]) == "\n<|im_start|>"
    # <tool_call> / </tool_call> are single added tokens (151657 / 151658) inside the masked run.
    assert encoded.token_ids[first:last].count(151657) == 2
    assert encoded.token_ids[first:last].count(151658) == 2


def test_llama3_mask_boundaries_written_out(llama3_tokenizer):
    messages = CONVERSATIONS["whitespace_and_code"][2:]
    encoded = encode_conversation(
        llama3_tokenizer, messages, chat_template="llama3", add_generation_prompt=True
    )
    text = llama3_tokenizer.decode(encoded.token_ids)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nRun it.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nIt prints 500000500000.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert [llama3_tokenizer.decode(run) for run in masked_runs(encoded)] == [
        "It prints 500000500000.<|eot_id|>"
    ]
    # BOS comes from the template only once, even though this tokenizer's post-processor would add one.
    assert encoded.token_ids.count(llama3_tokenizer.bos_token_id) == 1


def _rollout_incrementally(tokenizer, messages, tools, chat_template, end_of_turn, add_generation_prompt):
    """Replay a conversation as a rollout: prompt, then sampled assistant turns and observations."""
    sampled_turns = hf_generated_turns(tokenizer, messages, tools, end_of_turn)
    first_assistant = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    encoder = ConversationEncoder(tokenizer, chat_template=chat_template)
    prompt_ids = encoder.start(messages[:first_assistant], tools)
    assert prompt_ids == hf_token_ids(tokenizer, messages[:first_assistant], tools, True)
    index, turn = first_assistant, 0
    while index < len(messages):
        sampled_ids = tokenizer.encode(sampled_turns[turn], add_special_tokens=False)
        encoder.append_assistant(sampled_ids, messages[index])
        assert encoder.token_ids[-len(sampled_ids) :] == sampled_ids
        turn += 1
        index += 1
        following = []
        while index < len(messages) and messages[index]["role"] != "assistant":
            following.append(messages[index])
            index += 1
        if following:
            more_turns = index < len(messages)
            before = len(encoder.token_ids)
            new_ids = encoder.append_messages(
                following, add_generation_prompt=more_turns or add_generation_prompt
            )
            assert encoder.token_ids[before:] == new_ids
    return encoder


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("with_tools", [False, True], ids=["no_tools", "tools"])
@pytest.mark.parametrize("named", [True, False], ids=["named", "jinja"])
def test_incremental_rollout_equals_one_shot(request, family, conversation, with_tools, named):
    fixture, name, end_of_turn = FAMILIES[family]
    tokenizer = request.getfixturevalue(fixture)
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if with_tools else None
    chat_template = name if named else None
    ends_with_observation = messages[-1]["role"] != "assistant"
    encoder = _rollout_incrementally(
        tokenizer, messages, tools, chat_template, end_of_turn, ends_with_observation
    )
    incremental = encoder.finish()
    one_shot = encode_conversation(
        tokenizer,
        messages,
        tools=tools,
        chat_template=chat_template,
        add_generation_prompt=ends_with_observation,
    )
    assert incremental.token_ids == one_shot.token_ids
    assert incremental.action_mask == one_shot.action_mask
    assert incremental.token_ids == hf_token_ids(tokenizer, messages, tools, ends_with_observation)


def test_incremental_keeps_sampled_ids_that_differ_from_the_rendering(qwen_tokenizer):
    """A model may write a tool call with other spacing than the template; its ids stay as sampled."""
    messages = CONVERSATIONS["several_tool_calls_then_consecutive_results"]
    sampled_text = (
        "I will compute and search in parallel.\n"
        '<tool_call>\n{"name":"calculator","arguments":{"expression":"12*7"}}\n</tool_call>\n'
        '<tool_call>\n{"name":"search","arguments":{"query":"Dune novel author","top_k":2}}\n</tool_call>'
        "<|im_end|>"
    )
    sampled_ids = qwen_tokenizer.encode(sampled_text, add_special_tokens=False)
    for chat_template in ("qwen2.5", None):
        encoder = ConversationEncoder(qwen_tokenizer, chat_template=chat_template)
        prompt_ids = encoder.start(messages[:2])
        encoder.append_assistant(sampled_ids, messages[2])
        observation_ids = encoder.append_messages(messages[3:5])
        one_shot = encode_conversation(
            qwen_tokenizer, messages[:5], chat_template=chat_template, add_generation_prompt=True
        )
        rendered_turn_length = one_shot.action_mask.count(1)
        assert encoder.token_ids == prompt_ids + sampled_ids + observation_ids
        assert encoder.action_mask == [0] * len(prompt_ids) + [1] * len(sampled_ids) + [0] * len(
            observation_ids
        )
        assert observation_ids == one_shot.token_ids[len(prompt_ids) + rendered_turn_length :]
        assert sampled_ids != one_shot.token_ids[len(prompt_ids) : len(prompt_ids) + rendered_turn_length]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("named", [True, False], ids=["named", "jinja"])
def test_turn_cut_off_before_end_of_turn_gets_it_from_the_template(request, family, named):
    fixture, name, end_of_turn = FAMILIES[family]
    tokenizer = request.getfixturevalue(fixture)
    encoder = ConversationEncoder(tokenizer, chat_template=name if named else None)
    encoder.start([{"role": "user", "content": "Count to ten."}])
    truncated = tokenizer.encode("1 2 3 4 5", add_special_tokens=False)  # stopped by max_tokens
    encoder.append_assistant(truncated)
    new_ids = encoder.append_messages([{"role": "user", "content": "Go on."}])
    end_of_turn_id = tokenizer.convert_tokens_to_ids(end_of_turn)
    assert new_ids[0] == end_of_turn_id
    assert encoder.action_mask[-len(new_ids) :] == [0] * len(new_ids)
    full = [
        {"role": "user", "content": "Count to ten."},
        {"role": "assistant", "content": "1 2 3 4 5"},
        {"role": "user", "content": "Go on."},
    ]
    assert encoder.token_ids == hf_token_ids(tokenizer, full, None, True)


def test_default_assistant_message_is_the_decoded_sample(qwen_tokenizer):
    encoder = ConversationEncoder(qwen_tokenizer, chat_template=None)
    encoder.start([{"role": "user", "content": "Hi"}])
    encoder.append_assistant(qwen_tokenizer.encode("Hello there!<|im_end|>", add_special_tokens=False))
    assert encoder.messages[-1] == {"role": "assistant", "content": "Hello there!"}


def test_qwen_content_starting_with_a_line_break_is_tokenised_as_sampled(qwen_tokenizer):
    """The one documented difference from one-shot HF tokenisation: a BPE merge across the turn start.

    HF tokenises "assistant\\n" + "\\nHi" as one piece ("\\n\\n" is one token); a model continuing the
    generation prompt "...assistant\\n" can only have sampled "\\n" then "Hi". We keep the sampled form.
    """
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\nHi"}]
    encoded = encode_conversation(qwen_tokenizer, messages, chat_template="qwen2.5")
    prompt = encode_conversation(
        qwen_tokenizer, messages[:1], chat_template="qwen2.5", add_generation_prompt=True
    )
    sampled = qwen_tokenizer.encode("\nHi<|im_end|>", add_special_tokens=False)
    assert encoded.token_ids[: len(prompt.token_ids) + len(sampled)] == prompt.token_ids + sampled
    assert encoded.token_ids != hf_token_ids(qwen_tokenizer, messages, None, False)
    assert qwen_tokenizer.decode(encoded.token_ids) == qwen_tokenizer.decode(
        hf_token_ids(qwen_tokenizer, messages, None, False)
    )


def test_image_parts_render_as_placeholders_and_encode_to_each_images_vision_tokens(qwen_tokenizer):
    """The text keeps one <|image_pad|> per image (as the Jinja template writes it); the ids stand each image's
    pad for as many pads as its tokens, as the VL processor expands the text (mask 0)."""
    wide = PIL.Image.new("RGB", (70, 50), (200, 10, 10))  # resized to 56x56: 4 tokens
    square = np.zeros((100, 100, 3), np.uint8)  # resized to 112x112: 16 tokens
    with_image = [
        {
            "role": "user",
            "content": [{"type": "image", "image": wide}, {"type": "text", "text": "What is this?"}],
        },
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image", "image": square}]},
    ]
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    as_text = [
        {"role": "user", "content": placeholder + "What is this?"},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "And this?" + placeholder},
    ]
    rendered = "".join(chunk.text for chunk in render_conversation(qwen_tokenizer, with_image, chat_template="qwen2.5"))
    assert rendered == qwen_tokenizer.apply_chat_template(as_text, tokenize=False)
    as_expanded = [
        {"role": "user", "content": placeholder.replace("<|image_pad|>", "<|image_pad|>" * 4) + "What is this?"},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "And this?" + placeholder.replace("<|image_pad|>", "<|image_pad|>" * 16)},
    ]
    encoded = encode_conversation(qwen_tokenizer, with_image, chat_template="qwen2.5", add_generation_prompt=True)
    assert encoded.token_ids == hf_token_ids(qwen_tokenizer, as_expanded, None, True)
    assert [image.num_tokens for image in encoded.images] == [4, 16]
    image_pad, vision_start, vision_end = qwen_tokenizer.convert_tokens_to_ids(
        ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"]
    )
    assert (image_pad, vision_start, vision_end) == (151655, 151652, 151653)
    vision = [i for i, token in enumerate(encoded.token_ids) if token in (image_pad, vision_start, vision_end)]
    assert len(vision) == 4 + 16 + 4 and all(encoded.action_mask[i] == 0 for i in vision)
    assert [qwen_tokenizer.decode(run) for run in masked_runs(encoded)] == ["A cat.<|im_end|>"]

    encoder = ConversationEncoder(qwen_tokenizer, chat_template="qwen2.5")
    encoder.start(with_image[:1])
    encoder.append_assistant(qwen_tokenizer.encode("A cat.<|im_end|>", add_special_tokens=False), with_image[1])
    encoder.append_messages(with_image[2:])
    assert encoder.encoded() == encoded
    assert [encoded.token_ids[start - 1] for start in encoder.image_starts] == [vision_start, vision_start]

    with pytest.raises(ValueError, match="video content parts cannot be encoded"):
        encode_conversation(qwen_tokenizer, [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}],
                            chat_template="qwen2.5")
    with pytest.raises(ImageError, match="holds no image"):
        encode_conversation(qwen_tokenizer, [{"role": "user", "content": [{"type": "image"}]}],
                            chat_template="qwen2.5")


def test_tools_given_as_python_functions_match_hf(qwen_tokenizer):
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: the expression to evaluate, e.g. 2*(3+4)
        """
        return expression

    messages = CONVERSATIONS["plain_single_turn"]
    expected = hf_token_ids(qwen_tokenizer, messages, [calculator], False)
    assert (
        encode_conversation(qwen_tokenizer, messages, tools=[calculator], chat_template="qwen2.5").token_ids
        == expected
    )


# A minimal ChatML template without a default system prompt.
PLAIN_CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_explicit_jinja_text_is_used_instead_of_the_tokenizers_own(qwen_tokenizer):
    messages = CONVERSATIONS["multi_turn_without_system"]
    encoded = encode_conversation(qwen_tokenizer, messages, chat_template=PLAIN_CHATML_TEMPLATE)
    expected = qwen_tokenizer.apply_chat_template(
        messages, chat_template=PLAIN_CHATML_TEMPLATE, tokenize=True
    )
    assert encoded.token_ids == list(expected["input_ids"])
    assert qwen_tokenizer.decode(encoded.token_ids).startswith("<|im_start|>user\nWrite a haiku")
    assert [qwen_tokenizer.decode(run) for run in masked_runs(encoded)] == [
        messages[1]["content"] + "<|im_end|>",
        messages[3]["content"] + "<|im_end|>",
    ]


# A template that prints the number of messages at the top: every new message rewrites earlier text.
COUNTING_TEMPLATE = (
    "{{ '<|im_start|>system\\n' + (messages | length | string) + ' messages<|im_end|>\\n' }}"
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_non_append_only_template_is_rejected_naming_the_first_differing_token(qwen_tokenizer):
    prompt = [{"role": "user", "content": "Hi"}]
    encoder = ConversationEncoder(qwen_tokenizer, chat_template=COUNTING_TEMPLATE)
    prompt_ids = encoder.start(prompt)
    with pytest.raises(TemplateNotAppendOnlyError, match="not append-only") as caught:
        encoder.append_assistant(qwen_tokenizer.encode("Hello<|im_end|>", add_special_tokens=False))
    # "<|im_start|>" "system" "\n" then "1" vs "2": the count token is the first that differs.
    assert caught.value.token_position == 3
    assert qwen_tokenizer.decode(prompt_ids[caught.value.token_position]) == "1"
    assert "token 3" in str(caught.value)

    with pytest.raises(TemplateNotAppendOnlyError, match="token 3"):
        encode_conversation(
            qwen_tokenizer,
            prompt + [{"role": "assistant", "content": "Hello"}],
            chat_template=COUNTING_TEMPLATE,
        )


def test_a_named_template_rerenders_the_last_message_it_had(qwen_tokenizer):
    """Qwen2.5 closes a run of tool results after the last one: a tool result appended on its own after
    another changes the earlier text (the "<|im_end|>" that closed the run), which the encoder must see
    although it renders a named template from the last message it had on."""
    user = {"role": "user", "content": "Look it up."}
    call = {"role": "assistant", "content": tool_call_text("search", {"query": "x"})}
    first, second = ({"role": "tool", "content": text} for text in ("one", "two"))
    encoder = ConversationEncoder(qwen_tokenizer, chat_template="qwen2.5")
    encoder.start([user])
    encoder.append_assistant(qwen_tokenizer.encode(call["content"] + "<|im_end|>", add_special_tokens=False), call)
    encoder.append_messages([first], add_generation_prompt=False)
    before = "".join(chunk.text for chunk in render_qwen2_5([user, call, first], None, False))
    with pytest.raises(TemplateNotAppendOnlyError, match="adding messages 3..3") as caught:
        encoder.append_messages([second])
    # the first difference is where "<|im_end|>" closed the first result
    assert caught.value.char_position == before.rindex("<|im_end|>")
    assert encoder.messages == [user, call, first]  # nothing was appended

    # the same messages in one append render as one user turn, like the one-shot encoding
    encoder = ConversationEncoder(qwen_tokenizer, chat_template="qwen2.5")
    encoder.start([user])
    encoder.append_assistant(qwen_tokenizer.encode(call["content"] + "<|im_end|>", add_special_tokens=False), call)
    encoder.append_messages([first, second])
    expected = encode_conversation(qwen_tokenizer, [user, call, first, second], chat_template="qwen2.5",
                                   add_generation_prompt=True)
    assert encoder.token_ids == expected.token_ids and encoder.action_mask == expected.action_mask


def test_errors_name_what_is_wrong(qwen_tokenizer, llama3_tokenizer):
    messages = CONVERSATIONS["plain_single_turn"]
    with pytest.raises(ValueError, match="unknown chat template 'qwen3'"):
        encode_conversation(qwen_tokenizer, messages, chat_template="qwen3")
    with pytest.raises(ValueError, match="role 'narrator'"):
        encode_conversation(qwen_tokenizer, [{"role": "narrator", "content": "x"}], chat_template="qwen2.5")
    with pytest.raises(ValueError, match="empty conversation"):
        encode_conversation(qwen_tokenizer, [], chat_template="qwen2.5")
    with pytest.raises(ValueError, match="needs a string 'name'"):
        encode_conversation(
            qwen_tokenizer,
            [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]},
            ],
            chat_template="qwen2.5",
        )
    with pytest.raises(ValueError, match="no placeholder for image"):
        encode_conversation(
            llama3_tokenizer, [{"role": "user", "content": [{"type": "image"}]}], chat_template="llama3"
        )
    with pytest.raises(ValueError, match="bos_token, but the tokenizer has none"):
        encode_conversation(qwen_tokenizer, messages, chat_template="llama3")

    encoder = ConversationEncoder(qwen_tokenizer, chat_template="qwen2.5")
    with pytest.raises(ValueError, match="call start"):
        encoder.append_messages([{"role": "user", "content": "x"}])
    encoder.start(messages[:1])
    with pytest.raises(ValueError, match="append_assistant\\(\\) must come next"):
        encoder.append_messages([{"role": "user", "content": "x"}])
    encoder.append_assistant(qwen_tokenizer.encode("Paris<|im_end|>", add_special_tokens=False))
    with pytest.raises(ValueError, match="append_messages\\(\\) takes tool/user messages"):
        encoder.append_messages([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="needs a generation prompt first"):
        encoder.append_assistant([1, 2])


def test_tokenizer_without_chat_template_needs_one(qwen_tokenizer):
    template = qwen_tokenizer.chat_template
    qwen_tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match="tokenizer has no chat_template"):
            encode_conversation(qwen_tokenizer, CONVERSATIONS["plain_single_turn"])
        # A named template needs no Jinja at all.
        assert encode_conversation(
            qwen_tokenizer, CONVERSATIONS["plain_single_turn"], chat_template="qwen2.5"
        ).token_ids
    finally:
        qwen_tokenizer.chat_template = template
