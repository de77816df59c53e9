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
