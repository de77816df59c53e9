"""CodeAgent: each fenced python block the model writes runs in the `code_interpreter` tool."""

from __future__ import annotations

from agentfly_jax.rollout.agents.base import BaseAgent
from agentfly_jax.tools.parsers import CODE_INTERPRETER_TOOL, ParseResult, parse_python_code_blocks

DEFAULT_CODE_INSTRUCTIONS = (
    "Solve the task. To run Python, write it in a ```python fenced block; its output comes back to you. "
    "Variables and imports persist between blocks. When you are done, answer without a code block "
    "(put a final numeric or short answer in \\boxed{})."
)


class CodeAgent(BaseAgent):
    """Writes code instead of JSON calls: ```python blocks become `code_interpreter(code=...)` calls.

    The `code_interpreter` tool must be among `tools` (the code-interpreter environment provides it;
    usually stateful, so one chain keeps one Python session across turns). A turn without a python block
    is the answer.
    """

    observation_role = "tool"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if CODE_INTERPRETER_TOOL not in self.tools:
            raise ValueError(
                f"CodeAgent runs python blocks with the '{CODE_INTERPRETER_TOOL}' tool, but tools has "
                f"{sorted(self.tools) or 'none'}: pass tools=[<the code_interpreter tool>]"
            )

    def system_message(self, task) -> str | None:
        """The given system prompt, or instructions on writing python blocks."""
        return self.system_prompt or DEFAULT_CODE_INSTRUCTIONS

    def parse(self, text: str) -> ParseResult:
        """Fenced python blocks in `text`, as `code_interpreter` calls."""
        return parse_python_code_blocks(text)
