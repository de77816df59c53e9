"""ReactAgent: Thought / Action / Action Input / Observation steps, ending with a Final Answer."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agentfly_jax.rollout.agents.base import BaseAgent, Message
from agentfly_jax.tools.execute import ToolResult
from agentfly_jax.tools.parsers import ParseResult, parse_react

DEFAULT_REACT_INSTRUCTIONS = "Answer the question. Think step by step and use the tools when they help."

REACT_FORMAT = """Use exactly this format:

Thought: what you think about next
Action: the tool to use, one of [{names}]
Action Input: the tool's arguments as a JSON object
Observation: the tool's result (written for you; do not write it yourself)
... (Thought, Action, Action Input and Observation can repeat)
Thought: I know the final answer
Final Answer: the answer"""


class ReactAgent(BaseAgent):
    """ReAct prompting: the tools and the step format are described in the system prompt by the agent.

    Observations come back as a user message `Observation: ...`; a turn with `Final Answer:` (or with
    no Action at all) ends the chain.
    """

    observation_role = "user"

    def system_message(self, task: Mapping[str, Any]) -> str | None:
        """The instructions, one line per tool with its JSON-schema arguments, and the ReAct format."""
        lines = []
        for tool in self.tools.values():
            arguments = json.dumps(tool.parameters.get("properties", {}), ensure_ascii=False)
            lines.append(f"- {tool.name}: {tool.description} Arguments: {arguments}")
        names = ", ".join(self.tools)
        return (
            (self.system_prompt or DEFAULT_REACT_INSTRUCTIONS)
            + "\n\nYou can use these tools:\n"
            + "\n".join(lines)
            + "\n\n"
            + REACT_FORMAT.format(names=names)
        )

    def parse(self, text: str) -> ParseResult:
        """Action / Action Input pairs (and a Final Answer) in `text`."""
        return parse_react(text)

    def observation_messages(self, results: Sequence[ToolResult]) -> list[Message]:
        """One user message with an `Observation:` line per tool result (followed by its images, if any)."""
        if not any(result.parts for result in results):
            content = "\n".join(f"Observation: {result.observation}" for result in results)
            return [{"role": self.observation_role, "content": content}]
        parts: list[dict] = []
        for index, result in enumerate(results):
            parts.append({"type": "text", "text": ("\n" if index else "") + f"Observation: {result.observation}"})
            parts.extend(part for part in result.parts or () if part["type"] == "image")
        return [{"role": self.observation_role, "content": parts}]
