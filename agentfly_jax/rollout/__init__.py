"""Rollout side: trajectories, chat templates with action masks, tool-call parsers."""

from agentfly_jax.rollout.parsers import (
    ParseError,
    ParseResult,
    ToolCall,
    parse_hermes_tool_calls,
    parse_python_code_blocks,
    parse_react,
    parse_tool_calls,
)
from agentfly_jax.rollout.templates import (
    ConversationEncoder,
    Encoded,
    TemplateNotAppendOnlyError,
    TextChunk,
    encode_conversation,
    render_conversation,
)
from agentfly_jax.rollout.trajectory import ToolCallRecord, Trajectory, trajectories_to_batch

__all__ = [
    "ConversationEncoder",
    "Encoded",
    "ParseError",
    "ParseResult",
    "TemplateNotAppendOnlyError",
    "TextChunk",
    "ToolCall",
    "ToolCallRecord",
    "Trajectory",
    "encode_conversation",
    "parse_hermes_tool_calls",
    "parse_python_code_blocks",
    "parse_react",
    "parse_tool_calls",
    "render_conversation",
    "trajectories_to_batch",
]

# Agents, the rollout runner and dataset loading use `agentfly_jax.tools`, which itself imports this
# package's parsers; they load on first access so that importing either package first works.
_LAZY_EXPORTS = {
    "BaseAgent": "agentfly_jax.rollout.agents",
    "CodeAgent": "agentfly_jax.rollout.agents",
    "ReactAgent": "agentfly_jax.rollout.agents",
    "ToolCallingAgent": "agentfly_jax.rollout.agents",
    "RolloutStats": "agentfly_jax.rollout.chain",
    "run_rollout": "agentfly_jax.rollout.chain",
    "load_tasks": "agentfly_jax.rollout.data",
}
__all__ += list(_LAZY_EXPORTS)


def __getattr__(name):
    if name in _LAZY_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
