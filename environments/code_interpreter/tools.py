"""The `code_interpreter` tool: runs Python in the calling chain's persistent sandboxed session."""

from __future__ import annotations

from agentfly_jax.tools import tool
from environments.code_interpreter.env import CodeInterpreterEnv


@tool(name="code_interpreter", stateful=True, pool="code_interpreter")
async def code_interpreter(code: str, env: CodeInterpreterEnv) -> str:
    """Run Python code in a persistent session (variables and imports persist between calls, like a notebook).
    Returns what the code printed, any error, and the value of the last expression.

    Args:
      code: Python source code to execute.
    """
    result = await env.step(code)
    return result.observation
