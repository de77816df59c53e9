"""BFCL multi_turn_base data: task rows, the held-out split, function docs as tool schemas, ground truth.

The data comes from the `bfcl-eval` package (Berkeley Function Calling Leaderboard, Apache-2.0), installed
without its dependencies by `scripts/setup_envs.sh`; only its data files and the executable backend classes
are used. A row of `task_rows()`:

    {"id": "multi_turn_base_0", "task_id": 0,
     "question": first user message, "user_turns": [text of every user turn],
     "initial_config": {class name: scenario}, "involved_classes": [...], "excluded_functions": [...],
     "functions": [tool schema of every function the task may call],
     "ground_truth": [[{"name": ..., "arguments": {...}}, ...] per user turn]}

Tasks whose ground truth contradicts BFCL's own function docs are left out (one in 2026.3.23:
multi_turn_base_173 passes `close_ticket(ticket_id='ticket_001')` where the doc says integer; the tool
runtime, which validates arguments against the docs, would refuse the call), leaving 199.

Split (`SPLIT_SALT`): a task is held out ("test") when sha256(SPLIT_SALT + id) is among the 64 smallest of
the kept tasks, else it is "train" (135 tasks). It depends on the task ids only, never on a seed, so the two
splits never share a task.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import importlib
import inspect
import json
import os
from typing import Any

#: The executable backends of the multi-turn categories: class name -> (module, function-doc file).
BACKENDS = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
#: Backends without a scenario to load (BFCL's STATELESS_CLASSES).
STATELESS = ("MathAPI",)
BACKEND_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
CATEGORY = "multi_turn_base"
SPLIT_SALT = "agentfly-bfcl-split-v1:"
NUM_TEST = 64
SPLITS = ("train", "test")

# BFCL's parameter types -> JSON schema types.
_TYPES = {"dict": "object", "float": "number", "integer": "integer", "string": "string", "array": "array",
          "boolean": "boolean", "tuple": "array", "any": None}


class BFCLDataError(RuntimeError):
    """The bfcl-eval package (data or backends) is missing or unusable."""


def data_dir() -> str:
    """The data folder of the installed bfcl-eval package."""
    try:
        import bfcl_eval
    except ImportError as error:
        raise BFCLDataError("the BFCL environment needs bfcl-eval: run scripts/setup_envs.sh (it installs "
                            "bfcl-eval==2026.3.23 with --no-deps)") from error
    return os.path.join(os.path.dirname(bfcl_eval.__file__), "data")


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def backend_class(class_name: str) -> type:
    """The executable backend class (e.g. GorillaFileSystem)."""
    if class_name not in BACKENDS:
        raise ValueError(f"unknown BFCL backend {class_name!r}; known: {', '.join(BACKENDS)}")
    module = importlib.import_module(f"{BACKEND_PACKAGE}.{BACKENDS[class_name][0]}")
    return getattr(module, class_name)


def new_instances(initial_config: dict, involved_classes: list[str]) -> dict[str, Any]:
    """Fresh backend instances of the involved classes, each loaded with its part of `initial_config`."""
    instances = {}
    for class_name in involved_classes:
        instance = backend_class(class_name)()
        if class_name not in STATELESS:
            instance._load_scenario(copy.deepcopy(initial_config.get(class_name, {})), long_context=False)
        instances[class_name] = instance
    return instances


def public_methods(instances: dict[str, Any], excluded: list[str] = ()) -> dict[str, Any]:
    """{method name: bound method} of the instances' public methods (BFCL's name -> instance mapping)."""
    methods = {}
    for instance in instances.values():
        for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
            if not name.startswith("_") and name not in excluded:
                methods[name] = method
    return methods


def format_result(result: Any) -> str:
    """A call's result as text, the way BFCL's executor records it (dicts as JSON)."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


# ------------------------------------------------------------------------------------------ function docs
def _convert_schema(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_convert_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            converted = _TYPES.get(value, value)
            if converted is not None:
                out[key] = converted
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _convert_schema(prop) for name, prop in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _convert_schema(value)
        else:
            out[key] = value
    return out


def _short_description(text: str) -> str:
    """BFCL prefixes every description with its system's blurb ('This tool belongs to ... Tool description:')."""
    marker = "Tool description:"
    return text.split(marker, 1)[1].strip() if marker in text else text.strip()


@functools.lru_cache(maxsize=4)
def function_docs(compact: bool = True) -> dict[str, dict[str, dict]]:
    """{class name: {function name: tool schema}} from BFCL's function docs.

    A schema is {"type": "function", "function": {"name", "description", "parameters"}} with BFCL's types
    mapped to JSON schema ("dict" -> "object", "float" -> "number") and its `response` section left out.
    compact: drop the per-system blurb BFCL repeats in front of every description.
    """
    folder = os.path.join(data_dir(), "multi_turn_func_doc")
    docs: dict[str, dict[str, dict]] = {}
    for class_name, (_, file_name) in BACKENDS.items():
        docs[class_name] = {}
        for doc in _read_jsonl(os.path.join(folder, file_name)):
            parameters = _convert_schema(doc.get("parameters") or {"type": "dict", "properties": {}})
            parameters.setdefault("type", "object")
            parameters.setdefault("properties", {})
            parameters.setdefault("required", [])
            description = _short_description(doc["description"]) if compact else doc["description"]
            docs[class_name][doc["name"]] = {
                "type": "function",
                "function": {"name": doc["name"], "description": description, "parameters": parameters},
            }
    return docs


# ----------------------------------------------------------------------------------------- ground truth
def parse_call(text: str) -> tuple[str, list, dict]:
    """`"mv(source='a', destination='b')"` -> ("mv", [], {"source": "a", "destination": "b"}) (literals only)."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {text!r}")  # noqa: TRY004 - bad data, not a bad type
    args = [ast.literal_eval(arg) for arg in node.args]
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    return node.func.id, args, kwargs


def keyword_call(text: str, methods: dict[str, Any]) -> dict:
    """A ground-truth call string as {"name", "arguments"} with positional arguments named from the method."""
    name, args, kwargs = parse_call(text)
    if args:
        if name not in methods:
            raise ValueError(f"ground truth calls unknown function {name!r}")
        names = [p for p in inspect.signature(methods[name]).parameters]
        kwargs = {**dict(zip(names, args)), **kwargs}
    return {"name": name, "arguments": kwargs}


# ------------------------------------------------------------------------------------------------- rows
@functools.lru_cache(maxsize=2)
def _all_rows(compact: bool) -> tuple[dict, ...]:
    folder = data_dir()
    questions = _read_jsonl(os.path.join(folder, f"BFCL_v4_{CATEGORY}.json"))
    answers = {row["id"]: row["ground_truth"]
               for row in _read_jsonl(os.path.join(folder, "possible_answer", f"BFCL_v4_{CATEGORY}.json"))}
    docs = function_docs(compact)
    rows = []
    for entry in questions:
        classes = list(entry["involved_classes"])
        excluded = list(entry.get("excluded_function", []))
        turns = []
        for turn in entry["question"]:
            users = [m["content"] for m in turn if m.get("role") == "user"]
            turns.append("\n".join(users))
        methods = public_methods(new_instances(entry["initial_config"], classes))
        ground_truth = [[keyword_call(call, methods) for call in turn] for turn in answers[entry["id"]]]
        functions = [schema for c in classes for name, schema in docs[c].items() if name not in excluded]
        if not _follows_docs(ground_truth, functions):
            continue
        rows.append({
            "id": entry["id"],
            "task_id": int(entry["id"].rsplit("_", 1)[1]),
            "question": turns[0],
            "user_turns": turns,
            "initial_config": entry["initial_config"],
            "involved_classes": classes,
            "excluded_functions": excluded,
            "functions": functions,
            "ground_truth": ground_truth,
        })
    rows.sort(key=lambda row: row["task_id"])
    return tuple(rows)


def _follows_docs(ground_truth: list[list[dict]], functions: list[dict]) -> bool:
    """Whether every ground-truth call names one of the task's functions with arguments its doc accepts."""
    from agentfly_jax.tools.schema import validate_arguments

    schemas = {f["function"]["name"]: f["function"]["parameters"] for f in functions}
    for call in (call for turn in ground_truth for call in turn):
        if call["name"] not in schemas:
            return False
        try:
            validate_arguments(call["name"], schemas[call["name"]], call["arguments"])
        except ValueError:
            return False
    return True


def split_of(task_id: str, all_ids: list[str]) -> str:
    """"test" when the id is among the NUM_TEST smallest salted hashes of `all_ids`, else "train"."""
    return "test" if task_id in _test_ids(tuple(all_ids)) else "train"


@functools.lru_cache(maxsize=2)
def _test_ids(all_ids: tuple[str, ...]) -> frozenset[str]:
    ranked = sorted(all_ids, key=lambda i: hashlib.sha256((SPLIT_SALT + i).encode()).hexdigest())
    return frozenset(ranked[:NUM_TEST])


def task_rows(split: str, compact: bool = True) -> list[dict]:
    """Every row of a split, in task-id order (deep copies: callers may change them)."""
    if split not in SPLITS:
        raise ValueError(f"BFCL has no split {split!r}; its splits: {list(SPLITS)}")
    rows = _all_rows(compact)
    ids = [row["id"] for row in rows]
    return [copy.deepcopy(row) for row in rows if split_of(row["id"], ids) == split]
