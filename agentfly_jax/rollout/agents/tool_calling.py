"""ToolCallingAgent: Hermes/Qwen-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` calls."""

from __future__ import annotations

from agentfly_jax.rollout.agents.base import BaseAgent
from agentfly_jax.tools.parsers import ParseResult, parse_hermes_tool_calls


class ToolCallingAgent(BaseAgent):
    """Calls tools the way Qwen2.5 and Hermes models are trained to.

    The chat template renders the tool schemas into the system prompt (Qwen2.5's `# Tools` section, or
    whatever the given Jinja template does with `tools`); any number of `<tool_call>` blocks per turn run
    concurrently, and their results come back as `tool` messages. A turn without a call is the answer.
    """

    observation_role = "tool"

    def template_tools(self) -> list[dict] | None:
        """The schemas of every tool, for the chat template."""
        return [tool.schema for tool in self.tools.values()] or None

    def parse(self, text: str) -> ParseResult:
        """`<tool_call>` blocks in `text`."""
        return parse_hermes_tool_calls(text)
