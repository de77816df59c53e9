"""The `@tool` decorator: a Python function (sync or async, plain or method) becomes a tool an agent can call."""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from agentfly_jax.tools.schema import ToolDefinitionError, parse_docstring, tool_parameters

# Parameters filled by the runtime, never by the model: the chain's environment and its dataset row.
ENV_PARAMETER = "env"
TASK_PARAMETER = "task"

#: Tools by name, filled by `@tool` on plain functions (methods are bound per instance, so not registered).
TOOL_REGISTRY: dict[str, Tool] = {}


class Tool:
    """A callable tool: the wrapped function plus its name, description, JSON schema and runtime options.

    Calling the Tool object calls the function directly (`calculator(expression="1+2")`); agents run it
    through `execute_tool_call`, which checks arguments, injects `env`/`task`, applies the timeout and
    the observation limit, and turns every failure into an observation.
    """

    def __init__(
        self,
        func: Callable,
        *,
        name: str | None = None,
        description: str | None = None,
        stateful: bool = False,
        pool: str | None = None,
        timeout: float | None = None,
        max_observation_chars: int | None = None,
    ):
        self.func = func
        self.name = name or func.__name__
        where = f"tool '{self.name}'"
        if not self.name.replace("_", "a").replace("-", "a").isalnum():
            raise ToolDefinitionError(f"{where}: a tool name may hold letters, digits, '_' and '-' only")
        doc_description, _ = parse_docstring(inspect.getdoc(func))
        self.description = (description or doc_description).strip()
        if not self.description:
            raise ToolDefinitionError(
                f"{where}: no description; write a docstring or pass @tool(description=...) so the model "
                "knows what the tool does"
            )
        signature = inspect.signature(func)
        names = list(signature.parameters)
        self.is_method = bool(names) and names[0] in ("self", "cls")
        self.wants_env = ENV_PARAMETER in names
        self.wants_task = TASK_PARAMETER in names
        if stateful and not self.wants_env:
            raise ToolDefinitionError(
                f"{where} is stateful=True but has no parameter named '{ENV_PARAMETER}' to receive its "
                "environment"
            )
        if self.wants_env and not stateful:
            raise ToolDefinitionError(
                f"{where} has a parameter '{ENV_PARAMETER}' but is not stateful; environments are given only "
                f"to @tool(stateful=True, pool=...) tools (or rename the parameter)"
            )
        if pool is not None and not stateful:
            raise ToolDefinitionError(f"{where}: pool={pool!r} needs stateful=True")
        if timeout is not None and not timeout > 0:
            raise ToolDefinitionError(f"{where}: timeout must be positive seconds, got {timeout!r}")
        if max_observation_chars is not None and max_observation_chars <= 0:
            raise ToolDefinitionError(
                f"{where}: max_observation_chars must be positive, got {max_observation_chars!r}"
            )
        self.stateful = stateful
        self.pool = (pool or self.name) if stateful else None
        self.timeout = timeout
        self.max_observation_chars = max_observation_chars
        self.is_async = inspect.iscoroutinefunction(func)
        made = tool_parameters(func, injected=(ENV_PARAMETER, TASK_PARAMETER), where=where)
        self.parameters, self.accepts_extra_arguments = made.parameters, made.accepts_extra
        #: {parameter: where its schema came from} and why transformers' get_json_schema could not convert
        #: the function (None when it did); see agentfly_jax.tools.schema.
        self.schema_sources, self.schema_fallback_reason = made.sources, made.fallback_reason
        self._instance: Any = None
        functools.update_wrapper(self, func)

    @property
    def schema(self) -> dict[str, Any]:
        """The function schema chat templates render: {"type": "function", "function": {...}}."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.parameters),
            },
        }

    def with_options(self, **options: Any) -> Tool:
        """A copy with runtime options replaced (`timeout`, `max_observation_chars`), e.g. from a config."""
        unknown = set(options) - {"timeout", "max_observation_chars"}
        if unknown:
            raise ValueError(
                f"tool '{self.name}': unknown option(s) {sorted(unknown)}; "
                "expected timeout, max_observation_chars"
            )
        clone = copy.copy(self)
        for key, value in options.items():
            if value is not None and not value > 0:
                raise ValueError(f"tool '{self.name}': {key} must be positive, got {value!r}")
            setattr(clone, key, value)
        return clone

    def __get__(self, instance: Any, owner: type | None = None) -> Tool:
        # Accessed through an instance, a method tool binds to it (like a function becomes a method).
        if instance is None or not self.is_method:
            return self
        bound = copy.copy(self)
        bound._instance = instance
        return bound

    @property
    def bound_function(self) -> Callable:
        """The function to call with named arguments (bound to its instance for method tools)."""
        if not self.is_method:
            return self.func
        if self._instance is None:
            raise TypeError(
                f"tool '{self.name}' is a method: use it through an instance (`obj.{self.func.__name__}`)"
            )
        return self.func.__get__(self._instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.bound_function(*args, **kwargs)

    def __repr__(self) -> str:
        extra = f", stateful, pool={self.pool!r}" if self.stateful else ""
        return f"Tool({self.name!r}{extra})"


def tool(
    func: Callable | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    stateful: bool = False,
    pool: str | None = None,
    timeout: float | None = None,
    max_observation_chars: int | None = None,
):
    """Make a function (sync or async, plain or method) a tool; usable as `@tool` or `@tool(...)`.

    The schema comes from the signature, type hints and the Google-style docstring (`Args:` section), through
    `transformers.utils.get_json_schema` where it converts them and our own conversion elsewhere (see
    agentfly_jax.tools.schema; `Tool.schema_sources` tells which gave each parameter).
    Args:
      name: tool name shown to the model (default: the function's name).
      description: what the tool does (default: the docstring's description).
      stateful: the tool gets the calling chain's environment instance as its `env` parameter, acquired
        from the agent's environment provider for `pool` and kept for the whole chain.
      pool: environment pool name (default: the tool name).
      timeout: seconds before the call is stopped and a timeout observation returned.
      max_observation_chars: longer observations are truncated (and reported as `oversized`).
    A parameter named `task` receives the chain's dataset row (read-only), never a model argument.
    """

    def decorate(function: Callable) -> Tool:
        made = Tool(
            function,
            name=name,
            description=description,
            stateful=stateful,
            pool=pool,
            timeout=timeout,
            max_observation_chars=max_observation_chars,
        )
        if not made.is_method:
            TOOL_REGISTRY[made.name] = made
        return made

    return decorate(func) if func is not None else decorate


def get_tool(name: str) -> Tool:
    """The registered tool called `name`."""
    if name not in TOOL_REGISTRY:
        raise KeyError(f"no tool named {name!r} is registered; registered tools: {sorted(TOOL_REGISTRY)}")
    return TOOL_REGISTRY[name]


def as_tool_table(tools: Mapping[str, Any] | Iterable[Any] | None) -> dict[str, Tool]:
    """{name: Tool} from Tools, decorated-or-plain functions, registered names, or a {name: Tool} mapping."""
    if tools is None:
        return {}
    if isinstance(tools, Mapping):
        items = list(tools.values())
    elif isinstance(tools, (Tool, str)) or callable(tools):
        items = [tools]
    else:
        items = list(tools)
    table: dict[str, Tool] = {}
    for item in items:
        if isinstance(item, str):
            item = get_tool(item)
        elif not isinstance(item, Tool):
            if not callable(item):
                raise TypeError(f"tools must be Tool objects, functions or registered names, got {item!r}")
            item = Tool(item)
        known = table.get(item.name)
        if known is not None and (known.func is not item.func or known._instance is not item._instance):
            raise ValueError(f"two different tools are named {item.name!r}; give one of them @tool(name=...)")
        table[item.name] = item
    return table
