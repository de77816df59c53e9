"""BFCLAgent: the tool-calling agent for BFCL's multi-turn tasks, which have several user turns.

A BFCL task is a conversation: the user asks something, the model calls tools and answers, then the user
asks the next thing, and so on. The rollout (`agentfly_jax.rollout.chain`) ends a chain at the first turn
without a tool call (`is_final`); this agent instead delivers the task's next user message there, until
every user turn has been given, and only then lets a turn without a call end the chain:

- `build_messages(task)` starts the chain's user-turn state (a per-chain context variable: every chain runs
  in its own asyncio task with its own copy of the context, as `environments.evaluation` does for scripted
  chains) and writes the system message;
- `is_final(parsed)`: a turn without a tool call (and nothing malformed) is final only when no user turn is
  left; otherwise the chain goes on and
- `observation_messages([])` returns the next user message instead of tool results, after marking the end
  of the previous user turn in the chain's environment (`BFCLEnv.end_user_turn`, the checkpoint the reward
  compares with the ground truth; when the chain has not touched its environment yet, the checkpoint is set
  when it does: `setup_env`).

Tools: a BFCL task may use the functions of its involved backend classes only (about 20-60 of the 128), so
the agent describes the task's functions itself: `system_message_with_tools` writes them into the system
message in the Qwen2.5/Hermes layout (`# Tools` ... `<tools>` one JSON schema a line `</tools>` ...), the
text the qwen2.5 chat template renders from a tools list, and `template_tools()` returns None. The SFT
demonstrations carry the same system message, so warm start and RL see the same prompt.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping, Sequence
from typing import Any

from agentfly_jax.rollout.agents.tool_calling import ToolCallingAgent
from agentfly_jax.rollout.templates import render_qwen2_5
from agentfly_jax.tools.execute import ToolResult
from agentfly_jax.tools.parsers import ParseResult
from environments.bfcl.env import BFCLEnv

_SYSTEM_HEADER = "<|im_start|>system\n"
_SYSTEM_END = "<|im_end|>\n"


def system_message_with_tools(system_prompt: str, functions: Sequence[dict]) -> str:
    """The system message text with the task's tool schemas, laid out as the qwen2.5 template does."""
    rendered = "".join(chunk.text for chunk in render_qwen2_5(
        [{"role": "system", "content": system_prompt}], list(functions) or None, add_generation_prompt=False))
    if not (rendered.startswith(_SYSTEM_HEADER) and rendered.endswith(_SYSTEM_END)):
        raise RuntimeError("unexpected qwen2.5 system rendering")
    return rendered[len(_SYSTEM_HEADER):-len(_SYSTEM_END)]


class _UserTurns:
    """One chain's progress through its task's user turns."""

    def __init__(self, task: Mapping[str, Any]):
        self.turns: list[str] = list(task.get("user_turns") or [task["question"]])
        self.delivered = 1
        self.pending = False
        self.env: BFCLEnv | None = None
        self.ended_before_env = 0  # user turns that ended before the chain acquired its environment

    def end_turn(self) -> None:
        if self.env is not None:
            self.env.end_user_turn()
        else:
            self.ended_before_env += 1


_CHAIN_TURNS: contextvars.ContextVar[_UserTurns | None] = contextvars.ContextVar("bfcl_user_turns", default=None)


class BFCLAgent(ToolCallingAgent):
    """`<tool_call>` agent that delivers a BFCL task's user turns one by one (see the module docstring)."""

    def build_messages(self, task: Mapping[str, Any]) -> list[dict]:
        _CHAIN_TURNS.set(_UserTurns(task))
        system = self.system_message(task) or ""
        functions = task.get("functions")
        if functions is None:  # a row without its own function list: every tool of the agent
            functions = [tool.schema for tool in self.tools.values()]
        return [{"role": "system", "content": system_message_with_tools(system, functions)},
                {"role": "user", "content": task["question"]}]

    def template_tools(self) -> list[dict] | None:
        return None  # the system message already lists the task's functions

    def is_final(self, parsed: ParseResult) -> bool:
        if not super().is_final(parsed):
            return False
        chain = _CHAIN_TURNS.get()
        if chain is None or chain.delivered >= len(chain.turns):
            return True
        chain.pending = True  # the user speaks next: observation_messages delivers the next turn
        return False

    def observation_messages(self, results: Sequence[ToolResult]) -> list[dict]:
        messages = super().observation_messages(results)
        chain = _CHAIN_TURNS.get()
        if chain is not None and chain.pending:
            chain.pending = False
            chain.end_turn()
            messages.append({"role": "user", "content": chain.turns[chain.delivered]})
            chain.delivered += 1
        return messages

    async def setup_env(self, pool: str, env: Any, task: Mapping[str, Any]) -> None:
        await super().setup_env(pool, env, task)
        chain = _CHAIN_TURNS.get()
        if chain is not None and isinstance(env, BFCLEnv):
            chain.env = env
            for _ in range(chain.ended_before_env):  # those turns changed nothing: the initial state
                env.end_user_turn()
            chain.ended_before_env = 0
