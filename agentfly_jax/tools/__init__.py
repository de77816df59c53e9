"""Tools an agent can call: the `@tool` decorator, the tool-call format, running calls, built-in tools."""

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
from agentfly_jax.tools.parsers import (
    ParseError,
    ParseResult,
    ToolCall,
    parse_hermes_tool_calls,
    parse_python_code_blocks,
    parse_react,
    parse_tool_calls,
)
from agentfly_jax.tools.schema import ToolDefinitionError, parse_docstring, validate_arguments

__all__ = [
    "DEFAULT_MAX_OBSERVATION_CHARS",
    "DEFAULT_TOOL_TIMEOUT_S",
    "TOOL_ERROR_KINDS",
    "TOOL_REGISTRY",
    "EnvironmentProvider",
    "EnvironmentUnavailableError",
    "ParseError",
    "ParseResult",
    "Tool",
    "ToolCall",
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
    "parse_hermes_tool_calls",
    "parse_python_code_blocks",
    "parse_react",
    "parse_tool_calls",
    "tool",
    "validate_arguments",
]
