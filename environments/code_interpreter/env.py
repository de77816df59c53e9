"""The code interpreter environment: one persistent, sandboxed Python session per chain.

    env = CodeInterpreterEnv(backend="bwrap", timeout=10.0, max_output_chars=4000)
    result = await env.step("import math\\nr = 2\\nmath.pi * r ** 2")
    result.observation  # "Out: 12.566370614359172"
    result = await env.step("r + 1")  # variables and imports persist across steps, like a notebook
    await env.close()

The session starts on the first step (in a bubblewrap slot or a pooled Docker container, see
agentfly_jax.envs.sandbox) and lives until reset/close. A cell that runs past `timeout` is interrupted
(state kept); one that ignores the interrupt, or crashes the interpreter (e.g. the memory limit), ends the
session: the observation says so and the next step starts a fresh one.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from agentfly_jax.envs.base import Environment, StepResult
from agentfly_jax.envs.sandbox import CellResult, PythonSession, SandboxError, get_sandbox

log = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """The code in `text`: the contents of its ```python fenced blocks (joined), else `text` itself."""
    blocks = _FENCE.findall(text)
    return "\n\n".join(block.strip("\n") for block in blocks) if blocks else text


def truncate_middle(text: str, max_chars: int) -> str:
    """`text` cut to about `max_chars` characters, keeping the head and the tail, with a note in between."""
    if len(text) <= max_chars:
        return text
    tail = max_chars // 4
    head = max_chars - tail
    return f"{text[:head]}\n... [{len(text) - head - tail:,} characters truncated] ...\n{text[-tail:]}"


def format_observation(cell: CellResult, *, timeout: float, max_chars: int) -> str:
    """What the model sees after a cell: stdout, stderr, the error, the last expression's value, and a
    note on a time-out or a restarted session; capped at `max_chars` characters."""
    parts = []
    if cell.stdout:
        parts.append(cell.stdout.rstrip("\n"))
    if cell.stderr:
        parts.append("[stderr]\n" + cell.stderr.rstrip("\n"))
    if cell.error:
        parts.append(cell.error.rstrip("\n"))
    if cell.value is not None:
        parts.append(f"Out: {cell.value}")
    if cell.timed_out and not cell.restarted:
        parts.append(
            f"[timeout] The code ran longer than {timeout:g} s and was interrupted. Variables set "
            f"before the interruption are kept."
        )
    if cell.restarted:
        parts.append(
            f"[session restarted] {cell.crash[:1].upper() + cell.crash[1:]}. Variables and imports "
            f"from earlier calls are lost; the next call starts a fresh Python session."
        )
    text = "\n".join(parts) if parts else "(no output)"
    return truncate_middle(text, max_chars)


class CodeInterpreterEnv(Environment):
    """A stateful Python session in a sandbox; `step(code)` runs one cell.

    backend: "bwrap" or "docker" (the process-wide default sandbox of that backend is used unless
      `sandbox` is given).
    timeout: seconds per cell before it is interrupted.
    max_output_chars: observation size cap (stdout and stderr are each also capped in the sandbox).
    """

    def __init__(
        self,
        backend: str = "bwrap",
        *,
        timeout: float = 10.0,
        max_output_chars: int = 4000,
        sandbox: Any = None,
    ):
        if not timeout > 0:
            raise ValueError(f"timeout={timeout!r}; expected positive seconds")
        if max_output_chars < 100:
            raise ValueError(f"max_output_chars={max_output_chars}; expected at least 100")
        self.backend = backend
        self.timeout = timeout
        self.max_output_chars = max_output_chars
        self._sandbox = sandbox
        self._session: PythonSession | None = None
        self.task: Any = None
        self.stats = {"cells": 0, "timeouts": 0, "restarts": 0, "sandbox_errors": 0}
        self._broken: str | None = None

    @property
    def sandbox(self):
        if self._sandbox is None:
            self._sandbox = get_sandbox(self.backend)
        return self._sandbox

    async def reset(self, task: Any = None) -> str:
        """Ends the current session (if any); the next step starts a fresh one."""
        await self._end_session()
        self.task = task
        self._broken = None
        return "A fresh Python session is ready; variables and imports persist across calls."

    async def step(self, action: Any) -> StepResult:
        """Runs `action` (code, optionally in ```python fences, or {"code": ...}) in the session."""
        code = action.get("code", "") if isinstance(action, dict) else str(action)
        code = extract_code(code)
        if self._session is None or not self._session.alive:
            try:
                self._session = await self.sandbox.open_session()
            except SandboxError as e:
                self.stats["sandbox_errors"] += 1
                self._broken = str(e)
                log.warning("code interpreter: could not start a sandbox session: %s", e)
                return StepResult(
                    observation=f"[sandbox error] The code could not be run: {e}",
                    info={"sandbox_error": str(e)},
                )
        cell = await self._session.run_cell(
            code, timeout=self.timeout, max_output_bytes=max(4 * self.max_output_chars, 4096)
        )
        self.stats["cells"] += 1
        self.stats["timeouts"] += cell.timed_out
        if cell.restarted:
            self.stats["restarts"] += 1
            self._session = None
        observation = format_observation(cell, timeout=self.timeout, max_chars=self.max_output_chars)
        info = {
            "stdout": cell.stdout,
            "stderr": cell.stderr,
            "value": cell.value,
            "error": cell.error,
            "timed_out": cell.timed_out,
            "restarted": cell.restarted,
            "elapsed_s": cell.elapsed_s,
        }
        return StepResult(observation=observation, reward=None, done=False, info=info)

    async def health(self) -> bool:
        """False after the sandbox itself failed (not the user's code), so the manager replaces this env."""
        return self._broken is None

    async def close(self) -> None:
        await self._end_session()

    async def _end_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
