"""JSON schemas for tools from Python signatures, type hints and Google-style docstrings; argument checks.

A tool's schema is the OpenAI/Hugging Face function format that chat templates render into the system
prompt: `{"type": "function", "function": {"name", "description", "parameters": {...}}}`. The
`parameters` object is a small JSON-schema subset (string, integer, number, boolean, array, object,
null, enum, anyOf, items, prefixItems, additionalProperties, nullable), which is also what
`validate_arguments` checks model-written arguments against: the schema the model sees is the one enforced.

Where the parameters come from (`tool_parameters`): `transformers.utils.get_json_schema`, the function
Hugging Face documents for building tool schemas for chat templates, gives each parameter's schema when it
converts the whole function (every argument described in an `Args:` section in its `name: text` form) and
converts that parameter's type hint faithfully: str, int, float, bool, None, Any, list/tuple/dict and their
generics, unions, Optional, Literal. Our own conversion (`json_schema_for_type`, `parse_docstring`) gives
the rest: Enum classes (get_json_schema calls them "object"), set/Sequence/Mapping, `tuple[X, ...]`, and
every parameter of a function get_json_schema refuses (an undocumented argument, an `Arguments:` section,
`name (type): text` lines, ...). The two agree on every hint both convert (tests/tools/test_schema.py
compares them), so the fallback changes no schema that get_json_schema can make; a docstring's
`(choices: [...])` suffix becomes an `enum` in both. The tool's name and description are always ours
(`@tool(name=..., description=...)` win over the function's), and no return-type entry is added: chat
templates render the schema verbatim and ignore returns.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import re
import sys
import threading
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Docstring section headers; the description is the text before the first of them.
_SECTION_HEADERS = (
    "args",
    "arguments",
    "parameters",
    "params",
    "returns",
    "return",
    "raises",
    "yields",
    "examples",
    "example",
    "note",
    "notes",
)
_SECTION_LINE = re.compile(r"^(\s*)([A-Za-z ]+):\s*$")
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")

# A docstring argument description ending in `(choices: ["a", "b"])`: the JSON list becomes the schema's enum.
_CHOICES = re.compile(r"\(choices:\s*(.*)\)\s*$", re.IGNORECASE)

_JSON_TYPE_NAMES = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


class ToolDefinitionError(TypeError):
    """A function cannot be turned into a tool as written (raised at decoration time)."""


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {argument name: description}) from a Google-style docstring.

    The description is everything before the first section header (`Args:`, `Returns:`, ...).
    Argument lines look like `name (type): text` or `name: text`; indented lines continue the text.
    """
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    description: list[str] = []
    arguments: dict[str, str] = {}
    section: str | None = None
    section_indent = 0
    current: str | None = None
    entry_indent: int | None = None
    for line in lines:
        header = _SECTION_LINE.match(line)
        indent = len(line) - len(line.lstrip())
        if header and header.group(2).strip().lower() in _SECTION_HEADERS and (
            section is None or indent <= section_indent
        ):
            section = header.group(2).strip().lower()
            section_indent = indent
            current, entry_indent = None, None
            continue
        if section is None:
            description.append(line)
            continue
        if section not in ("args", "arguments", "parameters", "params") or not line.strip():
            continue
        if entry_indent is None:
            entry_indent = indent
        match = _ARG_LINE.match(line.strip())
        if indent <= entry_indent and match:
            current = match.group(1).lstrip("*")
            arguments[current] = match.group(3).strip()
        elif current is not None:
            arguments[current] = (arguments[current] + " " + line.strip()).strip()
    return "\n".join(description).strip(), arguments


def json_schema_for_type(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of a Python type hint (str, int, float, bool, list[X], dict, Optional, Literal, Enum).

    `where` names the parameter for error messages.
    """
    if hint is Any or hint is inspect.Parameter.empty:
        return {}
    if hint in _JSON_TYPE_NAMES:
        return {"type": _JSON_TYPE_NAMES[hint]}
    if inspect.isclass(hint) and issubclass(hint, enum.Enum):
        values = [member.value for member in hint]
        schema = _schema_of_values(values, where)
        return schema
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Literal:
        return _schema_of_values(list(args), where)
    if origin in (typing.Union, types.UnionType):
        non_null = [arg for arg in args if arg is not type(None)]
        nullable = len(non_null) < len(args)
        if len(non_null) == 1:
            schema = dict(json_schema_for_type(non_null[0], where))
        else:
            schemas = [json_schema_for_type(arg, where) for arg in non_null]
            if all(set(s) == {"type"} and isinstance(s["type"], str) for s in schemas):
                # Plain types as one type list, sorted and without repeats (`list | tuple` is one "array").
                names = sorted({s["type"] for s in schemas})
                schema = {"type": names[0] if len(names) == 1 else names}
            else:
                schema = {"anyOf": schemas}
        if nullable:
            schema["nullable"] = True
        return schema
    if hint in (list, tuple, set, frozenset) or origin in (list, tuple, set, frozenset, Sequence):
        schema: dict[str, Any] = {"type": "array"}
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            # A fixed-length tuple: one schema per position (exactly that many items).
            if Ellipsis in args:
                raise ToolDefinitionError(f"{where}: tuple[...] may hold `...` only as tuple[X, ...]")
            schema["prefixItems"] = [json_schema_for_type(arg, where) for arg in args]
        elif args:
            schema["items"] = json_schema_for_type(args[0], where)
        return schema
    if hint in (dict, Mapping) or origin in (dict, Mapping):
        schema = {"type": "object"}
        if len(args) == 2:
            schema["additionalProperties"] = json_schema_for_type(args[1], where)
        return schema
    raise ToolDefinitionError(
        f"{where}: type hint {_type_name(hint)} has no JSON schema; use str, int, float, bool, list[...], "
        "dict[str, ...], Optional[...], Literal[...] or an Enum"
    )


def _schema_of_values(values: list[Any], where: str) -> dict[str, Any]:
    """{"type": the values' JSON type (a list in order of first appearance when they mix), "enum": values}."""
    kinds: list[str] = []
    for value in values:
        kind = _JSON_TYPE_NAMES.get(type(value))
        if kind is None:
            raise ToolDefinitionError(
                f"{where}: Literal/Enum values must be str, int, float, bool or None, got {values!r}"
            )
        if kind not in kinds:
            kinds.append(kind)
    if not values:
        raise ToolDefinitionError(f"{where}: a Literal/Enum needs at least one value")
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(values)}


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or repr(hint)


#: Where a parameter's schema came from (`ToolParameters.sources`).
SOURCE_TRANSFORMERS = "transformers.get_json_schema"
SOURCE_OWN = "agentfly_jax"


@dataclasses.dataclass(frozen=True)
class ToolParameters:
    """A function's parameter schema and how it was made.

    parameters: the JSON schema of the arguments the model fills in ({"type": "object", "properties",
      "required"}).
    accepts_extra: whether `**kwargs` takes arguments beyond the schema.
    sources: {parameter name: SOURCE_TRANSFORMERS or SOURCE_OWN}.
    fallback_reason: why `transformers.utils.get_json_schema` could not convert the function (then every
      parameter is SOURCE_OWN); None when it did.
    """

    parameters: dict[str, Any]
    accepts_extra: bool
    sources: dict[str, str]
    fallback_reason: str | None


def tool_parameters(func: Callable, *, injected: Sequence[str] = (), where: str) -> ToolParameters:
    """The schema of the parameters the model fills in: get_json_schema's where it converts them, else ours.

    Parameters named in `injected` (e.g. `env`, `task`), a leading `self`/`cls` and `**kwargs` are left out
    of the schema. Every other parameter needs a type hint. See the module docstring for which source gives
    which parameter; a definition our conversion rejects raises ToolDefinitionError whatever
    get_json_schema would make of it.
    """
    signature = inspect.signature(func)
    try:
        hints = typing.get_type_hints(func)
    except Exception as error:  # unresolvable forward references
        raise ToolDefinitionError(f"{where}: cannot resolve the type hints ({error})") from error
    doc = inspect.getdoc(func)
    _, documented = parse_docstring(doc)
    properties: dict[str, Any] = {}
    required: list[str] = []
    visible: list[inspect.Parameter] = []
    accepts_extra = False
    for position, (name, parameter) in enumerate(signature.parameters.items()):
        if position == 0 and name in ("self", "cls"):
            continue
        if name in injected:
            continue
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            raise ToolDefinitionError(
                f"{where}: *{name} cannot be filled from a JSON object of named arguments; "
                "use named parameters"
            )
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            accepts_extra = True
            continue
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ToolDefinitionError(
                f"{where}: parameter '{name}' is positional-only; tools are called with named arguments"
            )
        if name not in hints:
            raise ToolDefinitionError(
                f"{where}: parameter '{name}' has no type hint; annotate it (e.g. `{name}: str`) so the "
                "model sees its type"
            )
        label = f"{where}, parameter '{name}'"
        schema = dict(json_schema_for_type(hints[name], label))
        if documented.get(name):
            _describe_parameter(schema, documented[name], label)
        properties[name] = schema
        visible.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[name]))
        if parameter.default is inspect.Parameter.empty:
            required.append(name)
    sources = dict.fromkeys(properties, SOURCE_OWN)
    converted, fallback_reason = _transformers_properties(func, visible, doc)
    if converted is not None:
        for parameter in visible:
            if _transformers_converts(parameter.annotation):
                properties[parameter.name] = converted[parameter.name]
                sources[parameter.name] = SOURCE_TRANSFORMERS
    parameters: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    return ToolParameters(parameters, accepts_extra, sources, fallback_reason)


def function_parameters(
    func: Callable, *, injected: Sequence[str] = (), where: str
) -> tuple[dict[str, Any], bool]:
    """(JSON schema of the parameters the model fills in, whether **kwargs accepts extra arguments).

    `tool_parameters` without the record of where each schema came from.
    """
    made = tool_parameters(func, injected=injected, where=where)
    return made.parameters, made.accepts_extra


def _describe_parameter(schema: dict[str, Any], description: str, where: str) -> None:
    """Sets the schema's description, turning a trailing `(choices: [JSON list])` into its `enum`."""
    choices = _CHOICES.search(description)
    if choices:
        try:
            values = json.loads(choices.group(1))
        except json.JSONDecodeError as error:
            raise ToolDefinitionError(
                f"{where}: the docstring's (choices: ...) is not a JSON list ({error}); "
                'write e.g. (choices: ["tea", "coffee"])'
            ) from error
        if not isinstance(values, list) or not values:
            raise ToolDefinitionError(
                f"{where}: the docstring's (choices: ...) must be a non-empty JSON list, "
                f"got {choices.group(1)}"
            )
        schema["enum"] = [value.strip() if isinstance(value, str) else value for value in values]
        description = description[: choices.start()].strip()
    schema["description"] = description


def _transformers_converts(hint: Any) -> bool:
    """Whether get_json_schema converts `hint` faithfully (it calls classes it does not know "object")."""
    if hint in (str, int, float, bool, type(None), Any, list, tuple, dict):
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType, list):
        return all(_transformers_converts(arg) for arg in args)
    if origin is typing.Literal:
        return bool(args) and all(type(arg) in (str, int, float, bool, type(None)) for arg in args)
    if origin is tuple:
        return len(args) >= 2 and Ellipsis not in args and all(_transformers_converts(arg) for arg in args)
    if origin is dict:
        return all(_transformers_converts(arg) for arg in args[1:])
    return False


def _transformers_properties(
    func: Callable, visible: list[inspect.Parameter], doc: str | None
) -> tuple[dict[str, Any] | None, str | None]:
    """({name: schema} from transformers.utils.get_json_schema, None) or (None, why it could not)."""
    def model_visible():  # what get_json_schema reads: the model's parameters only, no return annotation
        pass

    model_visible.__name__ = getattr(func, "__name__", "tool")
    model_visible.__doc__ = doc
    model_visible.__signature__ = inspect.Signature(visible)
    model_visible.__annotations__ = {parameter.name: parameter.annotation for parameter in visible}
    try:
        converted = _get_json_schema(model_visible)["function"]["parameters"]["properties"]
    except Exception as error:  # noqa: BLE001 - any refusal means our conversion gives the schema
        return None, f"{type(error).__name__}: {error}"
    return converted, None


def _get_json_schema(func: Callable) -> dict[str, Any]:
    """transformers.utils.get_json_schema(func), without the torch import it makes on every type hint to map
    `torch.Tensor` (seconds of start-up in a process that has no other use for torch): while it runs, torch
    counts as available only if it is imported already, which it is wherever a hint can name `torch.Tensor`. The
    schema is the same either way."""
    from transformers.utils import chat_template_utils

    with _SCHEMA_LOCK:  # one swap at a time: a second would save the first's stand-in as the original
        available = getattr(chat_template_utils, "is_torch_available", None)
        if available is None:  # another transformers layout: its own behaviour
            return chat_template_utils.get_json_schema(func)
        chat_template_utils.is_torch_available = lambda: "torch" in sys.modules and available()
        try:
            return chat_template_utils.get_json_schema(func)
        finally:
            chat_template_utils.is_torch_available = available


_SCHEMA_LOCK = threading.Lock()


# --------------------------------------------------------------------------------------------------
# Argument validation
# --------------------------------------------------------------------------------------------------


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_label(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(map(repr, schema["enum"]))
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array" and "items" in schema:
        return f"array of {_type_label(schema['items'])}"
    if kind == "array" and "prefixItems" in schema:
        positions = schema["prefixItems"]
        return f"array of {len(positions)} items ({', '.join(map(_type_label, positions))})"
    return kind or "any value"


def coerce_value(value: Any, schema: dict[str, Any], path: str) -> Any:
    """`value` checked against `schema` (and an integral float turned into int for integer fields).

    Raises ValueError naming `path` and the expected type.
    """
    if value is None and schema.get("nullable"):
        return None
    if "enum" in schema:
        if value not in schema["enum"] or isinstance(value, bool) != any(
            isinstance(option, bool) for option in schema["enum"] if option == value
        ):
            raise ValueError(f"{path} must be {_type_label(schema)}, got {_describe(value)}")
        return value
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                return coerce_value(value, option, path)
            except ValueError:
                continue
        raise ValueError(f"{path} has the wrong type: got {_describe(value)}")
    kind = schema.get("type")
    if kind is None:
        return value
    kinds = kind if isinstance(kind, list) else [kind]
    for option in kinds:
        if option == "integer" and isinstance(value, float) and "number" in kinds:
            continue  # a float stays a float where numbers are allowed
        converted = _as_json_type(value, option)
        if converted is not _MISMATCH:
            if option == "array" and "prefixItems" in schema:
                positions = schema["prefixItems"]
                if len(converted) != len(positions):
                    raise ValueError(f"{path} must be {_type_label(schema)}, got {len(converted)} items")
                return [coerce_value(item, positions[i], f"{path}[{i}]") for i, item in enumerate(converted)]
            if option == "array" and "items" in schema:
                return [coerce_value(item, schema["items"], f"{path}[{i}]") for i, item in enumerate(converted)]
            if option == "object" and "additionalProperties" in schema:
                return {
                    key: coerce_value(item, schema["additionalProperties"], f"{path}[{key!r}]")
                    for key, item in converted.items()
                }
            return converted
    raise ValueError(f"{path} must be {_type_label(schema)}, got {_describe(value)}")


_MISMATCH = object()


def _as_json_type(value: Any, kind: str) -> Any:
    if kind == "string":
        return value if isinstance(value, str) else _MISMATCH
    if kind == "boolean":
        return value if isinstance(value, bool) else _MISMATCH
    if kind == "integer":
        if isinstance(value, bool):
            return _MISMATCH
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return _MISMATCH
    if kind == "number":
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else _MISMATCH
    if kind == "array":
        return value if isinstance(value, list) else _MISMATCH
    if kind == "object":
        return value if isinstance(value, dict) else _MISMATCH
    if kind == "null":
        return value if value is None else _MISMATCH
    return value


def validate_arguments(
    tool_name: str, parameters: dict[str, Any], arguments: Mapping[str, Any], *, accepts_extra: bool = False
) -> dict[str, Any]:
    """Arguments checked against the tool's parameter schema; raises ValueError listing every problem."""
    properties: dict[str, Any] = parameters.get("properties", {})
    required = parameters.get("required", [])
    problems: list[str] = []
    checked: dict[str, Any] = {}
    missing = [name for name in required if name not in arguments]
    for name in missing:
        problems.append(f"missing required argument '{name}' ({_type_label(properties[name])})")
    unknown = [name for name in arguments if name not in properties]
    if unknown and not accepts_extra:
        problems.append(
            f"unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
        )
    for name, value in arguments.items():
        if name not in properties:
            if accepts_extra:
                checked[name] = value
            continue
        try:
            checked[name] = coerce_value(value, properties[name], f"argument '{name}'")
        except ValueError as error:
            problems.append(str(error))
    if problems:
        expected = ", ".join(
            f"{name}: {_type_label(schema)}{'' if name in required else ' (optional)'}"
            for name, schema in properties.items()
        )
        raise ValueError(
            f"tool '{tool_name}' got bad arguments: {'; '.join(problems)}. "
            f"Expected arguments: {expected or 'none'}"
        )
    return checked
