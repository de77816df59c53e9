"""The Jinja equivalents of the named templates (`rollout.chat_templates`) render, through transformers'
`apply_chat_template`, exactly the text of our Python renderers and of the published reference templates, on the
whole multi-turn tool-conversation corpus: a policy trained with `chat_template="qwen2.5"` and served with the
exported Jinja sees the prompts it was trained on."""
from pathlib import Path

import pytest

from agentfly_jax.rollout.chat_templates import LLAMA3_JINJA, QWEN2_5_JINJA, jinja_for_template
from agentfly_jax.rollout.templates import render_conversation
from tests.rollout.conversations import CONVERSATIONS, TOOLS

REPO = Path(__file__).resolve().parents[2]
# The reference templates: the shared data beside the checkout, else the copies in tests/rollout/data.
_SHARED = REPO.parent / "shared" / "data" / "chat_templates"
REFERENCE_DIR = _SHARED if (_SHARED / "qwen2_5.jinja").is_file() else Path(__file__).parent / "data"


def reference(name: str) -> str:
    return (REFERENCE_DIR / name).read_text()


def named_text(tokenizer, messages, name, tools=None, add_generation_prompt=False) -> str:
    chunks = render_conversation(tokenizer, messages, tools=tools, chat_template=name,
                                 add_generation_prompt=add_generation_prompt)
    return "".join(chunk.text for chunk in chunks)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_qwen2_5_jinja_equals_the_renderer_and_the_reference(qwen_tokenizer, conversation, with_tools,
                                                             add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if with_tools else None
    ours = named_text(qwen_tokenizer, messages, "qwen2.5", tools, add_generation_prompt)
    jinja = qwen_tokenizer.apply_chat_template(messages, tools=tools, chat_template=QWEN2_5_JINJA, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
    ref = qwen_tokenizer.apply_chat_template(messages, tools=tools, chat_template=reference("qwen2_5.jinja"),
                                             tokenize=False, add_generation_prompt=add_generation_prompt)
    assert jinja == ours
    assert jinja == ref


def test_qwen2_5_jinja_on_a_multi_turn_tool_conversation_shows_the_calls_and_results(qwen_tokenizer):
    messages = CONVERSATIONS["several_tool_calls_then_consecutive_results"]
    text = qwen_tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=QWEN2_5_JINJA, tokenize=False)
    assert text == named_text(qwen_tokenizer, messages, "qwen2.5", TOOLS)
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\n" in text
    assert text.count("<|im_start|>") == text.count("<|im_end|>") == 5


def test_qwen2_5_jinja_follows_the_renderer_beyond_the_reference(qwen_tokenizer):
    """None content and lists of text/image parts (the renderer's inputs) render as the renderer does."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                             {"type": "image", "image": "x.png"}, "this?"]},
                {"role": "assistant", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "Again."}]}]
    jinja = qwen_tokenizer.apply_chat_template(messages, chat_template=QWEN2_5_JINJA, tokenize=False,
                                               add_generation_prompt=True)
    assert jinja == named_text(qwen_tokenizer, messages, "qwen2.5", add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>this?" in jinja


def test_qwen2_5_jinja_refuses_an_unknown_role(qwen_tokenizer):
    with pytest.raises(Exception, match="role"):
        qwen_tokenizer.apply_chat_template([{"role": "narrator", "content": "Once"}], chat_template=QWEN2_5_JINJA,
                                           tokenize=False)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_llama3_jinja_equals_the_renderer_and_the_reference(llama3_tokenizer, conversation):
    messages = CONVERSATIONS[conversation]
    for add_generation_prompt in (False, True):
        ours = named_text(llama3_tokenizer, messages, "llama3", add_generation_prompt=add_generation_prompt)
        jinja = llama3_tokenizer.apply_chat_template(messages, chat_template=LLAMA3_JINJA, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
        ref = llama3_tokenizer.apply_chat_template(messages, chat_template=reference("llama3.jinja"),
                                                   tokenize=False, add_generation_prompt=add_generation_prompt)
        assert jinja == ours == ref


def test_jinja_for_template_picks_what_training_rendered_with(qwen_tokenizer):
    assert jinja_for_template(qwen_tokenizer, "qwen2.5") == QWEN2_5_JINJA
    assert jinja_for_template(qwen_tokenizer, "llama3") == LLAMA3_JINJA
    custom = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert jinja_for_template(qwen_tokenizer, custom) == custom
    assert jinja_for_template(qwen_tokenizer, None) == qwen_tokenizer.chat_template

    class Several:
        chat_template = {"default": "{{ 'd' }}", "tool_use": "{{ 't' }}"}

    assert jinja_for_template(Several(), None) == "{{ 'd' }}"
    assert jinja_for_template(Several(), "tool_use") == "{{ 't' }}"

    class Without:
        chat_template = None

    assert jinja_for_template(Without(), None) is None
