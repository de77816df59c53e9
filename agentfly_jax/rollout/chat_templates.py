"""Jinja equivalents of the named chat templates ("qwen2.5", "llama3") that `templates.py` renders in Python.

Training with `chat_template="qwen2.5"` renders conversations with our Python renderer; a trained policy served
elsewhere (transformers' `apply_chat_template`, vLLM's `/v1/chat/completions`) renders them with the Jinja
template saved beside its tokenizer. These templates produce exactly the text of the Python renderers, so the
served policy sees prompts in the format it was trained on; `jinja_for_template` gives the text to save with
a checkpoint.

Where the Python renderer accepts more than the published reference template, the Jinja follows the renderer:
content may be None (rendered as empty text in Qwen2.5, "None" in Llama 3 as its reference does) or a list of
text parts (joined; Qwen2.5 image/video parts become the Qwen2.5-VL placeholders), and a role the template does
not know is an error instead of being dropped silently.
"""
from __future__ import annotations

from typing import Any

# Qwen2.5-Instruct: ChatML, Hermes-style tools listed in the system prompt, <tool_call> blocks in assistant
# turns, consecutive tool results in one user turn of <tool_response> blocks. Same text as `render_qwen2_5`.
QWEN2_5_JINJA = r"""{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'image' or part.type == 'image_url' or part.image is defined or part.image_url is defined -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type == 'video' or part.video is defined -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- else -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if messages[0].role == 'system' -%}
    {%- set system_text = render_content(messages[0].content) -%}
{%- else -%}
    {%- set system_text = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -%}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' + system_text -}}
    {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + tool | tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' -}}
    {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- else -%}
    {{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'user' or message.role == 'system' -%}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant' -}}
        {%- set content = render_content(message.content) -%}
        {%- if message.tool_calls -%}
            {%- if content -%}
                {{- '\n' + content -}}
            {%- endif -%}
            {%- for tool_call in message.tool_calls -%}
                {%- if tool_call.function is defined -%}
                    {%- set tool_call = tool_call.function -%}
                {%- endif -%}
                {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' -}}
                {{- tool_call.arguments | tojson -}}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- else -%}
            {{- '\n' + content -}}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('message ' ~ loop.index0 ~ ' has role ' ~ message.role ~ '; the qwen2.5 template knows system, user, assistant and tool') -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# Llama 3 Instruct: a header per message, content stripped, <|eot_id|> after each; the tokenizer's bos_token
# first. Tools and tool calls are not rendered (as in the reference template). Same text as `render_llama3`.
LLAMA3_JINJA = r"""{%- for message in messages -%}
    {%- if message.content is none -%}
        {%- set content = 'None' -%}
    {%- elif message.content is string -%}
        {%- set content = message.content -%}
    {%- else -%}
        {%- set content = namespace(text='') -%}
        {%- for part in message.content -%}
            {%- set content.text = content.text + (part if part is string else part.text) -%}
        {%- endfor -%}
        {%- set content = content.text -%}
    {%- endif -%}
    {%- if loop.first -%}
        {{- bos_token -}}
    {%- endif -%}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + content | trim + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""

NAMED_TEMPLATE_JINJA: dict[str, str] = {
    "qwen2.5": QWEN2_5_JINJA,
    "llama3": LLAMA3_JINJA,
}


def jinja_for_template(tokenizer: Any, chat_template: str | None) -> str | None:
    """The Jinja text of the template that `chat_template` selects (the argument the agents and
    `encode_conversation` take): a named template's Jinja equivalent, the Jinja text itself, or the tokenizer's
    own template (by name when it has several). None when the tokenizer has no template and none was named."""
    if chat_template in NAMED_TEMPLATE_JINJA:
        return NAMED_TEMPLATE_JINJA[chat_template]
    if chat_template is not None and ("{{" in chat_template or "{%" in chat_template):
        return chat_template
    own = getattr(tokenizer, "chat_template", None)
    if own is None:
        return None
    if isinstance(own, dict):
        return own.get(chat_template or "default") or (next(iter(own.values())) if chat_template is None else None)
    return own
