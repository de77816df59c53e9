"""@tool: schemas from signatures, type hints and docstrings; methods; definition errors; argument checks."""

import enum
import typing
from typing import Any, Literal

import pytest

from agentfly_jax.tools import Tool, ToolDefinitionError, as_tool_table, get_tool, parse_docstring, tool
from agentfly_jax.tools.schema import validate_arguments


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


@tool(name="weather_lookup", timeout=3.0, max_observation_chars=100)
async def lookup_weather(
    city: str,
    days: int,
    unit: Unit = Unit.CELSIUS,
    hourly: bool = False,
    tags: list[str] | None = None,
    mode: Literal["fast", "exact"] = "fast",
    scale: float = 1.0,
) -> str:
    """Look up the weather forecast.

    More text about the tool.

    Args:
        city (str): Name of the city,
            for example "Paris".
        days: Number of days.
        unit: Temperature unit.
        hourly: Hour by hour.
        tags: Labels.
        mode: Speed or precision.
        scale: A factor.

    Returns:
        The forecast.
    """
    return city


def test_schema_from_signature_hints_and_docstring():
    schema = lookup_weather.schema
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "weather_lookup"
    assert function["description"] == "Look up the weather forecast.\n\nMore text about the tool."
    parameters = function["parameters"]
    assert parameters["required"] == ["city", "days"]
    properties = parameters["properties"]
    assert properties["city"] == {"type": "string", "description": 'Name of the city, for example "Paris".'}
    assert properties["days"] == {"type": "integer", "description": "Number of days."}
    assert properties["unit"] == {
        "enum": ["celsius", "fahrenheit"],
        "type": "string",
        "description": "Temperature unit.",
    }
    assert properties["hourly"]["type"] == "boolean"
    assert properties["tags"] == {
        "type": "array",
        "items": {"type": "string"},
        "nullable": True,
        "description": "Labels.",
    }
    assert properties["mode"]["enum"] == ["fast", "exact"]
    assert properties["scale"]["type"] == "number"
    assert lookup_weather.timeout == 3.0 and lookup_weather.max_observation_chars == 100
    assert lookup_weather.is_async and not lookup_weather.stateful
    assert get_tool("weather_lookup") is lookup_weather


def test_description_override_and_docstring_parsing_sections():
    @tool(description="Custom words.")
    def shout(text: str) -> str:
        """Ignored summary.

        Arguments:
            text: What to shout.
        """
        return text.upper()

    assert shout.schema["function"]["description"] == "Custom words."
    assert shout.schema["function"]["parameters"]["properties"]["text"]["description"] == "What to shout."
    assert shout(text="hi") == "HI"  # the decorated function stays callable
    description, arguments = parse_docstring("Summary.\n\nArgs:\n    a (int): first\n    b: second\n        more\n")
    assert description == "Summary." and arguments == {"a": "first", "b": "second more"}


def test_method_tools_bind_to_their_instance_and_leave_self_out():
    class Searcher:
        def __init__(self, corpus):
            self.corpus = corpus

        @tool
        def search(self, query: str, limit: int = 2) -> str:
            """Search the corpus.

            Args:
                query: Words to find.
                limit: Most results.
            """
            return ", ".join([doc for doc in self.corpus if query in doc][:limit])

    searcher = Searcher(["red fox", "red hen", "blue jay"])
    bound = searcher.search
    assert isinstance(bound, Tool) and bound.is_method
    assert list(bound.parameters["properties"]) == ["query", "limit"]
    assert bound(query="red") == "red fox, red hen"
    assert as_tool_table([searcher.search, searcher.search])["search"]._instance is searcher
    with pytest.raises(TypeError, match="use it through an instance"):
        Searcher.search(query="red")


def test_stateful_tool_takes_env_and_task_out_of_the_schema():
    @tool(stateful=True, pool="sandbox")
    async def run_step(action: str, env: Any, task: dict) -> str:
        """Step the environment.

        Args:
            action: What to do.
        """
        return action

    assert run_step.stateful and run_step.pool == "sandbox" and run_step.wants_task
    assert list(run_step.parameters["properties"]) == ["action"]

    @tool(stateful=True)
    def default_pool(env: Any) -> str:
        """Look."""
        return ""

    assert default_pool.pool == "default_pool"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: tool(_no_hint), "parameter 'x' has no type hint"),
        (lambda: tool(lambda x: x), "a tool name may hold letters, digits"),
        (lambda: tool(_undocumented), "no description"),
        (lambda: tool(_takes_env), "not stateful"),
        (lambda: tool(stateful=True)(_no_env), "no parameter named 'env'"),
        (lambda: tool(_star_args), r"\*values"),
        (lambda: tool(_object_hint), "has no JSON schema"),
        (lambda: tool(pool="p")(_no_env), "needs stateful=True"),
        (lambda: tool(timeout=0)(_no_env), "timeout must be positive"),
    ],
)
def test_definition_errors_say_what_to_fix(make, message):
    with pytest.raises(ToolDefinitionError, match=message):
        make()


def _no_hint(x) -> int:
    """Doc."""


def _undocumented(x: int) -> int:
    return x


def _takes_env(env: int) -> str:
    """Doc."""


def _no_env(x: int) -> str:
    """Doc."""


def _star_args(*values: int) -> str:
    """Doc."""


def _object_hint(x: object) -> str:
    """Doc."""


def test_validate_arguments_reports_every_problem_and_converts_integral_floats():
    parameters = lookup_weather.parameters
    checked = validate_arguments("w", parameters, {"city": "Oslo", "days": 3.0, "tags": None, "unit": "celsius"})
    assert checked == {"city": "Oslo", "days": 3, "tags": None, "unit": "celsius"}
    assert type(checked["days"]) is int
    with pytest.raises(ValueError) as info:
        validate_arguments("w", parameters, {"days": "two", "hourly": 1, "color": "red", "unit": "kelvin"})
    message = str(info.value)
    for expected in (
        "missing required argument 'city' (string)",
        "unknown argument 'color'",
        "argument 'days' must be integer, got 'two'",
        "argument 'hourly' must be boolean, got 1",
        "argument 'unit' must be one of 'celsius', 'fahrenheit'",
        "Expected arguments: city: string, days: integer",
    ):
        assert expected in message
    with pytest.raises(ValueError, match=r"argument 'tags'\[1\] must be string"):
        validate_arguments("w", parameters, {"city": "a", "days": 1, "tags": ["x", 2]})
    with pytest.raises(ValueError, match="must be integer, got True"):
        validate_arguments("w", parameters, {"city": "a", "days": True})


def test_tool_table_rejects_two_tools_with_one_name():
    @tool(name="same_name")
    def first(x: int) -> str:
        """One."""

    @tool(name="same_name")
    def second(x: int) -> str:
        """Two."""

    with pytest.raises(ValueError, match="two different tools are named 'same_name'"):
        as_tool_table([first, second])


def test_type_hint_forms():
    from agentfly_jax.tools.schema import json_schema_for_type

    assert json_schema_for_type(typing.Optional[int], "x") == {"type": "integer", "nullable": True}
    assert json_schema_for_type(typing.Union[int, str], "x") == {"type": ["integer", "string"]}
    assert json_schema_for_type(dict[str, float], "x") == {"type": "object", "additionalProperties": {"type": "number"}}
    assert json_schema_for_type(tuple[int, ...], "x") == {"type": "array", "items": {"type": "integer"}}
    assert json_schema_for_type(Any, "x") == {}
    with pytest.raises(ToolDefinitionError, match="mixed item types"):
        json_schema_for_type(tuple[int, str], "x")
