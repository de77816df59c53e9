"""BFCLEnv: one chain's BFCL backend instances (file system, trading bot, travel API, ...) and their history.

    env = BFCLEnv()
    await env.reset(task)                       # fresh instances of the task's classes from initial_config
    text = env.call("cd", {"folder": "document"})   # runs the backend method; the result as text
    env.end_user_turn()                         # the agent delivers the next user turn: checkpoint the state

The environment remembers the text result of every successful call (`results`) and a checkpoint (state and
number of results) at the end of every user turn but the last, which the reward compares with the ground
truth's (see `environments.bfcl.scoring`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from agentfly_jax.envs.base import Environment, StepResult
from environments.bfcl.data import format_result, new_instances, public_methods


class BFCLCallError(Exception):
    """A call the task's backends cannot run (unknown or excluded function); its message is the observation."""


def snapshot(instances: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Deep copy of every instance's public attributes (what BFCL's state checker compares)."""
    return {name: {key: copy.deepcopy(value) for key, value in vars(instance).items() if not key.startswith("_")}
            for name, instance in instances.items()}


class BFCLEnv(Environment):
    """See the module docstring."""

    def __init__(self):
        self.task_id: str | None = None
        self.instances: dict[str, Any] = {}
        self.methods: dict[str, Any] = {}
        self.excluded: list[str] = []
        self.results: list[str] = []
        self.checkpoints: list[tuple[dict, int]] = []
        self.calls = 0
        self.failed_calls = 0

    async def reset(self, task: Any = None) -> str:
        """Fresh instances of the task's `involved_classes` loaded with its `initial_config`.

        Without a task (the pool's reset between chains) everything is forgotten.
        """
        self.instances, self.methods, self.results, self.checkpoints = {}, {}, [], []
        self.calls = self.failed_calls = 0
        if task is None:
            self.task_id, self.excluded = None, []
            return "No BFCL task is loaded."
        if not isinstance(task, Mapping) or "initial_config" not in task or "involved_classes" not in task:
            raise ValueError("a BFCL task row needs 'initial_config' and 'involved_classes'")
        self.task_id = task.get("id")
        self.excluded = list(task.get("excluded_functions", []))
        self.instances = new_instances(task["initial_config"], list(task["involved_classes"]))
        self.methods = public_methods(self.instances, self.excluded)
        return f"Loaded {', '.join(self.instances)}."

    def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """Runs backend method `name` with keyword `arguments`; its result as text.

        Raises BFCLCallError for a function this task does not have, and lets the backend's own exceptions
        through (the tool runtime turns both into error observations).
        """
        self.calls += 1
        method = self.methods.get(name)
        if method is None:
            self.failed_calls += 1
            known = ", ".join(sorted(self.methods)) or "none (no task loaded)"
            raise BFCLCallError(f"function {name!r} is not available in this task; available: {known}")
        try:
            text = format_result(method(**dict(arguments)))
        except Exception:
            self.failed_calls += 1
            raise
        self.results.append(text)
        return text

    async def step(self, action: Any) -> StepResult:
        """One call {"name": ..., "arguments": {...}}; errors come back as the observation."""
        try:
            return StepResult(self.call(action["name"], action.get("arguments") or {}))
        except Exception as error:  # noqa: BLE001 - the observation says what went wrong
            return StepResult(f"Error during execution: {error}", info={"error": type(error).__name__})

    def state(self) -> dict[str, dict[str, Any]]:
        """The instances' public attributes now (deep copy)."""
        return snapshot(self.instances)

    def end_user_turn(self) -> None:
        """Checkpoints the state and the results so far: the user turn that was being answered is over."""
        self.checkpoints.append((self.state(), len(self.results)))

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        self.instances, self.methods = {}, {}

    def __repr__(self) -> str:
        return f"BFCLEnv(task={self.task_id!r}, calls={self.calls}, turns_ended={len(self.checkpoints)})"
