"""Rollout side: trajectories, chat templates with action masks, agents and the multi-chain runner."""

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
    "TemplateNotAppendOnlyError",
    "TextChunk",
    "ToolCallRecord",
    "Trajectory",
    "encode_conversation",
    "render_conversation",
    "trajectories_to_batch",
]

# Agents reach the generation backends, which import JAX (about a second); they, the rollout runner and
# dataset loading load on first access so that importing templates or trajectories stays light.
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
