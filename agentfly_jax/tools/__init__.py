"""Tools an agent can call: the `@tool` decorator, running calls safely, and built-in tools."""

from agentfly_jax.tools.calculator import calculator, evaluate_arithmetic
from agentfly_jax.tools.context import EnvironmentProvider, EnvironmentUnavailableError, ToolContext
from agentfly_jax.tools.decorator import TOOL_REGISTRY, Tool, as_tool_table, get_tool, tool
from agentfly_jax.tools.execute import (
    DEFAULT_MAX_OBSERVATION_CHARS,
    DEFAULT_TOOL_TIMEOUT_S,
    TOOL_ERROR_KINDS,
    ToolResult,
    execute_tool_call,
    execute_tool_calls,
    parse_error_result,
)
from agentfly_jax.tools.schema import ToolDefinitionError, parse_docstring, validate_arguments

__all__ = [
    "DEFAULT_MAX_OBSERVATION_CHARS",
    "DEFAULT_TOOL_TIMEOUT_S",
    "TOOL_ERROR_KINDS",
    "TOOL_REGISTRY",
    "EnvironmentProvider",
    "EnvironmentUnavailableError",
    "Tool",
    "ToolContext",
    "ToolDefinitionError",
    "ToolResult",
    "as_tool_table",
    "calculator",
    "evaluate_arithmetic",
    "execute_tool_call",
    "execute_tool_calls",
    "get_tool",
    "parse_docstring",
    "parse_error_result",
    "tool",
    "validate_arguments",
]
