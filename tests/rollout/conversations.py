"""A corpus of multi-turn conversations for the template tests."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 2*(3+4)"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search an encyclopædia — returns the top passages.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
]


def _call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "plain_single_turn": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    "plain_multi_turn_with_system": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one, bigger than 100?"},
        {"role": "assistant", "content": "101 is prime.\nSo is 103."},
    ],
    "multi_turn_without_system": [
        {"role": "user", "content": "Write a haiku about rain."},
        {
            "role": "assistant",
            "content": "Soft rain on the roof\nthe gutters hum a low tune\nnight drinks the puddles",
        },
        {"role": "user", "content": "Now shorter."},
        {"role": "assistant", "content": "Rain. Roof. Sleep."},
        {"role": "user", "content": "Thanks!"},
    ],
    "several_tool_calls_then_consecutive_results": [
        {"role": "system", "content": "Use tools for arithmetic and facts."},
        {"role": "user", "content": "What is 12*7, and who wrote Dune?"},
        {
            "role": "assistant",
            "content": "I will compute and search in parallel.",
            "tool_calls": [
                _call("calculator", {"expression": "12*7"}),
                _call("search", {"query": "Dune novel author", "top_k": 2}),
            ],
        },
        {"role": "tool", "content": "84"},
        {"role": "tool", "content": "Dune (1965) is a novel by Frank Herbert."},
        {"role": "assistant", "content": "12*7 = 84, and Dune was written by Frank Herbert."},
    ],
    "tool_calls_with_empty_content": [
        {"role": "user", "content": "Compute (2+3)*4 then square it."},
        {"role": "assistant", "content": "", "tool_calls": [_call("calculator", {"expression": "(2+3)*4"})]},
        {"role": "tool", "content": "20"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"name": "calculator", "arguments": {"expression": "20**2"}}],
        },
        {"role": "tool", "content": "400"},
        {"role": "tool", "content": "(second result, same call id)"},
    ],
    "empty_assistant_content": [
        {"role": "system", "content": "Answer or stay silent."},
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Now say 'ok'."},
        {"role": "assistant", "content": "ok"},
    ],
    "unicode": [
        {
            "role": "user",
            "content": "Traduis « café crème » en 中文, and add an emoji 🙂. Also: e\u0301 vs é, مرحبا",
        },
        {"role": "assistant", "content": "« café crème » → 奶油咖啡 ☕️🙂 — e\u0301/é; مرحبا بك"},
        {"role": "user", "content": "Search for Ελληνικά."},
        {
            "role": "assistant",
            "content": "Searching…",
            "tool_calls": [_call("search", {"query": "Ελληνικά ψάρια 🐟", "top_k": 1})],
        },
        {"role": "tool", "content": "Ελληνικά: the Greek language — 🇬🇷"},
        {"role": "assistant", "content": "Ελληνικά means Greek. ✅"},
    ],
    "whitespace_and_code": [
        {"role": "user", "content": "  Show a python loop summing 1..1000000.  "},
        {
            "role": "assistant",
            "content": (
                "Here:\n```python\ntotal = 0\nfor i in range(1, 1000001):\n"
                "    total += i\nprint(total)\n```\n"
            ),
        },
        {"role": "user", "content": "Run it."},
        {"role": "assistant", "content": "It prints 500000500000.   \n\n"},
    ],
    "mid_conversation_system_and_string_arguments": [
        {"role": "user", "content": "Start."},
        {"role": "assistant", "content": "Started."},
        {"role": "system", "content": "New rule: always call the calculator."},
        {"role": "user", "content": "1+1?"},
        {
            "role": "assistant",
            "content": "Calling.",
            # OpenAI-style JSON-string arguments: templates show them as a JSON string.
            "tool_calls": [_call("calculator", '{"expression": "1+1"}')],
        },
        {"role": "tool", "content": "2"},
    ],
}
