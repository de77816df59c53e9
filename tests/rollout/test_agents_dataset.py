"""Dataset files for agents: JSON lists and JSONL lines of rows with `question`; errors name file and line."""

import json

import pytest

from agentfly_jax.rewards import RewardBindingError, math_match, reward
from agentfly_jax.rollout.data import DatasetError, load_tasks

ROWS = [
    {"question": "What is 2+2?", "answer": "4", "level": 1},
    {"question": "What is 3*3?", "answer": "9", "tags": ["easy"]},
]


def test_json_and_jsonl_load_the_same_rows(tmp_path):
    as_json = tmp_path / "tasks.json"
    as_json.write_text(json.dumps(ROWS, indent=2))
    as_jsonl = tmp_path / "tasks.jsonl"
    as_jsonl.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n\n")
    assert load_tasks(as_json) == ROWS == load_tasks(as_jsonl)
    assert load_tasks(as_jsonl, limit=1) == ROWS[:1]
    sniffed = tmp_path / "tasks.data"  # no known suffix: JSONL unless it starts with '['
    sniffed.write_text(json.dumps(ROWS[0]))
    assert load_tasks(sniffed) == ROWS[:1]


def test_reward_fields_checked_at_load_with_file_and_line(tmp_path):
    path = tmp_path / "tasks.json"
    rows = [ROWS[0], {"question": "no answer here", "solution": "x"}]
    path.write_text(json.dumps(rows, indent=2))
    assert load_tasks(tmp_path / "tasks.json", reward=None)
    with pytest.raises(RewardBindingError) as info:
        load_tasks(path, reward=math_match)
    # The second row starts on line 7 of the indented file.
    assert f"but {path}:7 has no field 'answer' (fields: question, solution)" in str(info.value)

    @reward
    def uses_level(prediction: str, level: int) -> float:
        return 0.0

    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n")
    with pytest.raises(RewardBindingError, match=f"but {jsonl}:2 has no field 'level'"):
        load_tasks(jsonl, reward=uses_level)


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("a.jsonl", '{"question": "ok"}\n{"question": "broken",\n', "a.jsonl:2: invalid JSON"),
        ("b.jsonl", '{"question": "ok"}\n\n["not", "an", "object"]\n', "b.jsonl:3: each row must be a JSON object"),
        ("c.jsonl", '{"question": "ok"}\n{"prompt": "x"}\n', "c.jsonl:2: the row needs a non-empty string 'question'"),
        ("d.json", '[\n  {"question": "ok"},\n  {"question": ""}\n]', "d.json:3: the row needs a non-empty string"),
        ("e.json", '[\n  {"question": "ok"},\n  {"question": "x",}\n]', "e.json:3: invalid JSON"),
        ("f.json", '[{"question": "ok"} {"question": "x"}]', "f.json:1: invalid JSON: expected ',' or ']'"),
        ("g.json", '{"question": "ok"}', "g.json:1: a JSON dataset is a list of objects"),
        ("h.json", "[]", "h.json: the dataset has no rows"),
        ("i.json", '[{"question": "ok"}]\n\n]', "i.json:3: unexpected text after the closing ']'"),
    ],
)
def test_malformed_files_say_where(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DatasetError) as info:
        load_tasks(path)
    assert str(info.value).startswith(str(tmp_path / message.split(":")[0])) and message.split(":", 1)[1] in str(
        info.value
    )


def test_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset file"):
        load_tasks(tmp_path / "absent.jsonl")
