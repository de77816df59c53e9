"""Tool-call parsers on well-formed and malformed model outputs."""

import random

import pytest

from agentfly_jax.tools.parsers import (
    CODE_INTERPRETER_TOOL,
    ParseResult,
    ToolCall,
    parse_hermes_tool_calls,
    parse_python_code_blocks,
    parse_react,
    parse_tool_calls,
)

# --------------------------------------------------------------------------------------------------
# Hermes / Qwen
# --------------------------------------------------------------------------------------------------

TWO_CALLS = (
    "I will compute and search.\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"query": "Ελληνικά", "top_k": 2}}\n</tool_call>'
)


def test_hermes_several_calls_in_one_turn():
    result = parse_hermes_tool_calls(TWO_CALLS)
    assert result.ok
    assert [(call.name, call.arguments) for call in result.tool_calls] == [
        ("calculator", {"expression": "12*7"}),
        ("search", {"query": "Ελληνικά", "top_k": 2}),
    ]
    assert (
        result.tool_calls[0].raw
        == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
    )
    assert result.text == "I will compute and search."


def test_hermes_arguments_as_a_json_encoded_string():
    # the OpenAI convention: "arguments" is a string holding the JSON object
    output = (
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+2\\"}"}</tool_call>\n'
        '<tool_call>{"name": "search", '
        '"arguments": "{\\"query\\": \\"\u0395\u03bb\\", \\"top_k\\": 2}"}</tool_call>'
    )
    result = parse_hermes_tool_calls(output)
    assert result.ok, result.errors
    assert [(call.name, call.arguments) for call in result.tool_calls] == [
        ("calc", {"expression": "1+2"}),
        ("search", {"query": "Ελ", "top_k": 2}),
    ]
    assert result.tool_calls[0].raw == output.split("\n")[0]


def test_hermes_plain_answer_has_no_calls():
    result = parse_hermes_tool_calls("The answer is 84.")
    assert result == ParseResult(text="The answer is 84.", tool_calls=[], errors=[])


def test_hermes_compact_json_and_text_after_calls():
    result = parse_hermes_tool_calls('<tool_call>{"name":"f","arguments":{}}</tool_call> then more text')
    assert result.ok and result.tool_calls == [
        ToolCall("f", {}, '<tool_call>{"name":"f","arguments":{}}</tool_call>')
    ]
    assert result.text == "then more text"


@pytest.mark.parametrize(
    "output, message",
    [
        ('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {"x": 1}}</tool_call>', "has no name"),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "has no name"),
        ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', "must be a JSON object, got list"),
        (
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1"}</tool_call>',
            "arguments of tool call 'f' are a string that is not valid JSON",
        ),
        (
            '<tool_call>{"name": "f", "arguments": "[1, 2]"}</tool_call>',
            "arguments of tool call 'f' are a JSON string holding list, not an object",
        ),
        ('<tool_call>{"name": "f", "arguments": ""}</tool_call>', "a string that is not valid JSON"),
        ('<tool_call>{"name": "f"}</tool_call>', "has no arguments"),
        ('<tool_call>{"name": "f", "arguments": {}, "id": 3}</tool_call>', "unknown field(s) 'id'"),
        ('<tool_call>["f", {}]</tool_call>', "must be a JSON object with name and arguments, got list"),
        ('<tool_call>{"name": "f", "arguments": {"x": 1', "is not closed"),
        ('<tool_call>\n{"name": "f", "arguments": {}}\n', "is not closed"),
        ("text </tool_call>", "without a matching <tool_call>"),
        ("<tool_call></tool_call>", "not valid JSON"),
    ],
)
def test_hermes_malformed_output_is_a_parse_error(output, message):
    result = parse_hermes_tool_calls(output)
    assert not result.ok
    assert result.tool_calls == []
    assert len(result.errors) == 1
    assert message in result.errors[0].message


def test_hermes_good_call_survives_a_bad_and_an_unclosed_neighbour():
    output = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": oops}</tool_call>'
        '<tool_call>{"name": "c", "arguments": {}}'
    )
    result = parse_hermes_tool_calls(output)
    assert [call.name for call in result.tool_calls] == ["a"]
    assert ["not valid JSON" in e.message for e in result.errors] == [True, False]
    assert "is not closed" in result.errors[1].message
    assert result.errors[1].raw == '<tool_call>{"name": "c", "arguments": {}}'


def test_hermes_unclosed_call_followed_by_a_good_one():
    output = '<tool_call>{"name": "a", "argu<tool_call>{"name": "b", "arguments": {"k": 1}}</tool_call>'
    result = parse_hermes_tool_calls(output)
    assert [(call.name, call.arguments) for call in result.tool_calls] == [("b", {"k": 1})]
    assert len(result.errors) == 1 and result.errors[0].raw == '<tool_call>{"name": "a", "argu'


# --------------------------------------------------------------------------------------------------
# ReAct
# --------------------------------------------------------------------------------------------------


def test_react_action_with_json_input():
    output = 'Thought: I need to add.\nAction: calculator\nAction Input: {"expression": "1+2"}'
    result = parse_react(output)
    assert result.ok
    assert result.tool_calls == [
        ToolCall(
            "calculator", {"expression": "1+2"}, 'Action: calculator\nAction Input: {"expression": "1+2"}'
        )
    ]
    assert result.text == "I need to add."
    assert result.final_answer is None


def test_react_multiline_json_input_and_hallucinated_observation_is_ignored():
    output = (
        'Thought: search it\nAction: search\nAction Input: {\n  "query": "Dune",\n  "top_k": 2\n}\n'
        "Observation: Frank Herbert wrote it.\nThought: done\nFinal Answer: Frank Herbert"
    )
    result = parse_react(output)
    assert result.ok
    assert [(call.name, call.arguments) for call in result.tool_calls] == [
        ("search", {"query": "Dune", "top_k": 2})
    ]
    assert result.final_answer is None
    assert result.text == "search it"


def test_react_final_answer():
    result = parse_react("Thought: I know this.\nFinal Answer: Paris")
    assert (
        result.ok
        and result.tool_calls == []
        and result.final_answer == "Paris"
        and result.text == "I know this."
    )


@pytest.mark.parametrize(
    "output, message",
    [
        ('Action: calculator\nAction Input: {"expression": "1+2"', "not valid JSON"),
        ("Action: calculator\nAction Input: 1+2", "must be a JSON object"),
        ('Action: calculator\nAction Input: ["1+2"]', "must be a JSON object"),
        (
            'Action: calculator\nAction Input: {"e": 1} and more',
            "unexpected text after the Action Input JSON",
        ),
        ("Thought: hmm\nAction: calculator", "has no Action Input"),
        ("Action: calculator\nThought: wait", "has no Action Input"),
        ('Action Input: {"e": 1}', "Action Input without an Action"),
        ('Action:\nAction Input: {"e": 1}', "Action must name one tool"),
        ('Action: calculator\nAction Input: {"e": 1}\nFinal Answer: 3', "both an Action and a Final Answer"),
    ],
)
def test_react_malformed_output_is_a_parse_error(output, message):
    result = parse_react(output)
    assert not result.ok
    assert any(message in error.message for error in result.errors), result.errors


# --------------------------------------------------------------------------------------------------
# Fenced python code
# --------------------------------------------------------------------------------------------------


def test_python_block_becomes_a_code_interpreter_call():
    output = "Let me compute.\n```python\ntotal = sum(range(10))\nprint(total)\n```\nDone."
    result = parse_python_code_blocks(output)
    assert result.ok
    assert result.tool_calls == [
        ToolCall(
            CODE_INTERPRETER_TOOL,
            {"code": "total = sum(range(10))\nprint(total)"},
            "```python\ntotal = sum(range(10))\nprint(total)\n```",
        )
    ]
    assert result.text == "Let me compute.\nDone."


def test_python_blocks_keep_indentation_and_other_languages_stay_text():
    output = "```bash\nls -la\n```\n```py\nfor i in range(2):\n    print(i)\n```\n```python3\nx = 1\n```"
    result = parse_python_code_blocks(output)
    assert [call.arguments["code"] for call in result.tool_calls] == [
        "for i in range(2):\n    print(i)",
        "x = 1",
    ]
    assert result.text == "```bash\nls -la\n```"


@pytest.mark.parametrize(
    "output, message",
    [
        ("```python\nprint(1)\n", "not closed"),
        ("Sure:\n```python\nprint(1)", "not closed"),
        ("```python\n\n```", "empty"),
    ],
)
def test_python_malformed_output_is_a_parse_error(output, message):
    result = parse_python_code_blocks(output)
    assert not result.ok and result.tool_calls == []
    assert message in result.errors[0].message


def test_parse_tool_calls_dispatches_by_format():
    assert parse_tool_calls(TWO_CALLS, "hermes") == parse_hermes_tool_calls(TWO_CALLS)
    assert parse_tool_calls("```python\nx=1\n```", "python_code").tool_calls[0].name == CODE_INTERPRETER_TOOL
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        parse_tool_calls("", "xml")


@pytest.mark.parametrize("parser", [parse_hermes_tool_calls, parse_react, parse_python_code_blocks])
def test_parsers_never_raise_on_truncated_or_mutated_output(parser):
    """Every prefix of a valid output (truncation) and random character edits give a result, never raise."""
    samples = [
        TWO_CALLS,
        (
            'Thought: x\nAction: calculator\nAction Input: {"expression": "1+[2]", "n": {"a": [1, 2]}}\n'
            "Observation: 3"
        ),
        "text\n```python\nprint('```')\n```\nmore ```python\n",
    ]
    generator = random.Random(0)
    alphabet = '<>/{}[]":,\n `tool_call ActionInput:Thought pyn\\'
    for sample in samples:
        outputs = [sample[:cut] for cut in range(len(sample) + 1)]
        for _ in range(200):
            chars = list(sample)
            for _ in range(generator.randint(1, 4)):
                chars[generator.randrange(len(chars))] = generator.choice(alphabet)
            outputs.append("".join(chars))
        for output in outputs:
            result = parser(output)
            assert isinstance(result, ParseResult)
            assert all(isinstance(call.arguments, dict) for call in result.tool_calls)
