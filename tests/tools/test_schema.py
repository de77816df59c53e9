"""@tool: schemas from signatures, type hints and docstrings; methods; definition errors; argument checks."""

import enum
import json
import typing
from typing import Any, Literal, Optional

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
    # a fixed-length tuple: one schema per position
    assert json_schema_for_type(tuple[int, str], "x") == {
        "type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}


# --------------------------------------------------------------------------------------------------
# Agreement with transformers.utils.get_json_schema, and the fallback where it cannot convert
# --------------------------------------------------------------------------------------------------


def _book_room(
    guest: str,
    nights: int,
    breakfast: bool = False,
    budget: Optional[float] = None,  # noqa: UP045 - the Optional spelling is a case of its own
    view: Literal["sea", "garden"] = "sea",
    floor: Literal["ground", 1, 2] = 1,
    ages: list[int] = (),
    notes: dict[str, str] | None = None,
    extras: dict[str, Any] | None = None,
    room: int | str = 0,
    either: str | int | None = None,
    payment: list[int] | str = "card",
    seats: list[list[float]] | None = None,
    pair: tuple[int, str] = (0, ""),
    drink: str = "tea",
    anything: Any = None,
) -> str:
    """Book a hotel room.

    Args:
        guest: Name of the guest.
        nights: Number of nights,
            at least one.
        breakfast: Whether breakfast is included.
        budget: Most the guest pays per night.
        view: What the window looks at.
        floor: Which floor.
        ages: Ages of the guests.
        notes: Free notes by topic.
        extras: Anything else.
        room: Room number or name.
        either: A number or a name.
        payment: Card numbers, or the payment method.
        seats: Seat positions per table.
        pair: A number and its label.
        drink: The welcome drink (choices: ["tea", "coffee"])
        anything: No type restriction.

    Returns:
        The booking reference.
    """
    return guest


def _book_room_other_docstring(
    guest: str,
    nights: int,
    breakfast: bool = False,
    budget: Optional[float] = None,  # noqa: UP045 - the Optional spelling is a case of its own
    view: Literal["sea", "garden"] = "sea",
    floor: Literal["ground", 1, 2] = 1,
    ages: list[int] = (),
    notes: dict[str, str] | None = None,
    extras: dict[str, Any] | None = None,
    room: int | str = 0,
    either: str | int | None = None,
    payment: list[int] | str = "card",
    seats: list[list[float]] | None = None,
    pair: tuple[int, str] = (0, ""),
    drink: str = "tea",
    anything: Any = None,
) -> str:
    """Book a hotel room.

    Arguments:
        guest (str): Name of the guest.
        nights (int): Number of nights,
            at least one.
        breakfast (bool): Whether breakfast is included.
        budget (float, optional): Most the guest pays per night.
        view: What the window looks at.
        floor: Which floor.
        ages: Ages of the guests.
        notes: Free notes by topic.
        extras: Anything else.
        room: Room number or name.
        either: A number or a name.
        payment: Card numbers, or the payment method.
        seats: Seat positions per table.
        pair: A number and its label.
        drink: The welcome drink (choices: ["tea", "coffee"])
        anything: No type restriction.
    """
    return guest


def _hand_written_booking_schema():
    """The schema of `_book_room`, written out by hand from the JSON Schema rules both converters follow."""
    return {
        "type": "object",
        "properties": {
            "guest": {"type": "string", "description": "Name of the guest."},
            "nights": {"type": "integer", "description": "Number of nights, at least one."},
            "breakfast": {"type": "boolean", "description": "Whether breakfast is included."},
            "budget": {"type": "number", "nullable": True, "description": "Most the guest pays per night."},
            "view": {"type": "string", "enum": ["sea", "garden"], "description": "What the window looks at."},
            "floor": {"type": ["string", "integer"], "enum": ["ground", 1, 2], "description": "Which floor."},
            "ages": {"type": "array", "items": {"type": "integer"}, "description": "Ages of the guests."},
            "notes": {"type": "object", "additionalProperties": {"type": "string"}, "nullable": True,
                      "description": "Free notes by topic."},
            "extras": {"type": "object", "additionalProperties": {}, "nullable": True,
                       "description": "Anything else."},
            "room": {"type": ["integer", "string"], "description": "Room number or name."},
            "either": {"type": ["integer", "string"], "nullable": True, "description": "A number or a name."},
            "payment": {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "string"}],
                        "description": "Card numbers, or the payment method."},
            "seats": {"type": "array", "items": {"type": "array", "items": {"type": "number"}},
                      "nullable": True, "description": "Seat positions per table."},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                     "description": "A number and its label."},
            "drink": {"type": "string", "enum": ["tea", "coffee"], "description": "The welcome drink"},
            "anything": {"description": "No type restriction."},
        },
        "required": ["guest", "nights"],
    }


def test_schemas_come_from_transformers_and_match_a_hand_written_schema():
    from transformers.utils import get_json_schema

    from agentfly_jax.tools.schema import SOURCE_TRANSFORMERS

    book = Tool(_book_room)
    expected = _hand_written_booking_schema()
    assert get_json_schema(_book_room)["function"]["parameters"] == expected  # the independent reference
    assert book.parameters == expected
    assert json.dumps(book.parameters) == json.dumps(get_json_schema(_book_room)["function"]["parameters"])
    assert set(book.schema_sources.values()) == {SOURCE_TRANSFORMERS} and book.schema_fallback_reason is None
    assert "return" not in book.schema["function"]  # chat templates render the schema verbatim


def test_our_conversion_agrees_with_transformers_on_every_hint_both_convert():
    from transformers.utils import get_json_schema

    from agentfly_jax.tools.schema import SOURCE_OWN, json_schema_for_type, tool_parameters

    reference = get_json_schema(_book_room)["function"]["parameters"]["properties"]
    hints = typing.get_type_hints(_book_room)
    for name, schema in reference.items():
        own = json_schema_for_type(hints[name], name)
        if name == "drink":  # the enum comes from the docstring's (choices: ...), not from the hint
            own["enum"] = ["tea", "coffee"]
        assert {**own, "description": schema["description"]} == schema, name
    # a docstring get_json_schema refuses (`Arguments:`, `name (type): text`): every schema is ours, and equal
    made = tool_parameters(_book_room_other_docstring, where="t")
    assert set(made.sources.values()) == {SOURCE_OWN}
    assert "DocstringParsingException" in made.fallback_reason
    assert made.parameters == _hand_written_booking_schema()
    with pytest.raises(Exception, match="no description for the argument 'guest'"):
        get_json_schema(_book_room_other_docstring)


def test_hints_transformers_misreads_or_refuses_use_our_schema():
    from transformers.utils import get_json_schema

    from agentfly_jax.tools.schema import SOURCE_OWN, SOURCE_TRANSFORMERS

    def convert(city: str, unit: Unit = Unit.CELSIUS, units: list[Unit] | None = None) -> str:
        """Convert a temperature.

        Args:
            city: Where.
            unit: The unit.
            units: More units.
        """

    made = Tool(convert)
    assert get_json_schema(convert)["function"]["parameters"]["properties"]["unit"]["type"] == "object"
    assert made.parameters["properties"]["unit"] == {
        "type": "string", "enum": ["celsius", "fahrenheit"], "description": "The unit."}
    units = made.parameters["properties"]["units"]
    assert units["items"] == {"type": "string", "enum": ["celsius", "fahrenheit"]}
    assert made.schema_sources == {"city": SOURCE_TRANSFORMERS, "unit": SOURCE_OWN, "units": SOURCE_OWN}

    def count(words: set[str], window: tuple[int, ...] = ()) -> str:
        """Count words.

        Args:
            words: The words.
            window: Sizes.
        """

    counted = Tool(count)
    assert counted.schema_sources == {"words": SOURCE_OWN, "window": SOURCE_OWN}
    assert "TypeHintParsingException" in counted.schema_fallback_reason
    assert counted.parameters["properties"] == {
        "words": {"type": "array", "items": {"type": "string"}, "description": "The words."},
        "window": {"type": "array", "items": {"type": "integer"}, "description": "Sizes."},
    }


def test_a_union_of_types_of_one_json_type_is_that_type_once():
    from agentfly_jax.tools.schema import json_schema_for_type

    assert json_schema_for_type(list | tuple, "x") == {"type": "array"}
    assert json_schema_for_type(list | tuple | None, "x") == {"type": "array", "nullable": True}
    assert json_schema_for_type(str | int | float, "x") == {"type": ["integer", "number", "string"]}

    @tool
    def collect(items: list | tuple) -> str:
        """Collect items.

        Args:
            items: The items.
        """
        return str(items)

    assert collect.parameters["properties"]["items"] == {"type": "array", "description": "The items."}
    assert validate_arguments("collect", collect.parameters, {"items": [1, "a"]}) == {"items": [1, "a"]}
    with pytest.raises(ValueError, match="argument 'items' must be array, got 'ab'"):
        validate_arguments("collect", collect.parameters, {"items": "ab"})


def test_validation_follows_the_schema_the_model_sees():
    book = Tool(_book_room)
    base = {"guest": "Ada", "nights": 2}
    checked = validate_arguments("b", book.parameters, {**base, "pair": [3.0, "x"], "drink": "coffee",
                                                       "floor": "ground", "room": 3.0, "budget": 80})
    assert checked["pair"] == [3, "x"] and type(checked["pair"][0]) is int
    assert checked["floor"] == "ground" and checked["room"] == 3 and type(checked["room"]) is int
    problems = {
        "pair": ([1], "argument 'pair' must be array of 2 items (integer, string), got 1 items"),
        "drink": ("water", "argument 'drink' must be one of 'tea', 'coffee', got 'water'"),
        "floor": (3, "argument 'floor' must be one of 'ground', 1, 2, got 3"),
        "room": (True, "argument 'room' must be integer or string, got True"),
        "payment": ([1, "x"], "argument 'payment' has the wrong type"),
    }
    for name, (value, message) in problems.items():
        with pytest.raises(ValueError) as info:
            validate_arguments("b", book.parameters, {**base, name: value})
        assert message in str(info.value), (name, str(info.value))
    with pytest.raises(ValueError, match=r"argument 'pair'\[1\] must be string, got 2"):
        validate_arguments("b", book.parameters, {**base, "pair": [1, 2]})

    @tool
    def scale(factor: float | int) -> str:  # noqa: PYI041 - the union is the case
        """Scale.

        Args:
            factor: By how much.
        """
        return str(factor)

    # where numbers are allowed a float stays a float (the integer option does not swallow 2.0)
    assert type(validate_arguments("s", scale.parameters, {"factor": 2.0})["factor"]) is float


def test_docstring_choices_must_be_a_json_list():
    def pick(drink: str) -> str:
        """Pick.

        Args:
            drink: The drink (choices: [tea, coffee])
        """

    with pytest.raises(ToolDefinitionError, match=r"'drink': the docstring's \(choices: ...\) is not a JSON list"):
        Tool(pick)
