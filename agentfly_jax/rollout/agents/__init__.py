"""Agents: BaseAgent and the tool-calling, ReAct and code agents built on it."""

from agentfly_jax.rollout.agents.base import BaseAgent
from agentfly_jax.rollout.agents.code import CodeAgent
from agentfly_jax.rollout.agents.react import ReactAgent
from agentfly_jax.rollout.agents.tool_calling import ToolCallingAgent

__all__ = ["BaseAgent", "CodeAgent", "ReactAgent", "ToolCallingAgent"]
