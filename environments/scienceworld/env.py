"""ScienceWorldEnv: one ScienceWorld simulator (its own JVM) per chain, behind the async environment interface.

    env = ScienceWorldEnv()
    observation = await env.reset({"task_name": "boil", "variation": 0})   # task description + first look
    result = await env.step("open door to kitchen")   # StepResult(observation, reward, done, info)
    actions = await env.valid_actions()               # only when asked: ≈ 0.35 s
    await env.close()

- reward: the package's own score of the episode so far, scaled to [0, 1] (score / 100, negative scores,
  which the simulator gives for a failed task, count as 0). `done` once the simulator says the task is
  completed (or failed), or after `max_steps` moves.
- An input the simulator cannot parse keeps the episode going; the observation says so and
  `info["invalid"]` is True (counted in `stats["invalid_actions"]`).
- A JVM that dies (crash, OOM kill) is replaced inside the same instance: a new JVM loads the task and
  replays the actions taken so far (the simulator is deterministic per task and variation), and the step's
  observation tells the chain its last action was not applied. Counted in `stats["engine_restarts"]`.
- The manager's `reset()` between chains (no task) keeps the JVM and only forgets the episode; the next
  `reset(task)` loads the new task in the same JVM (≈ 0.15 s), so instances are reused, not respawned.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from collections.abc import Mapping
from typing import Any

from agentfly_jax.envs.base import Environment, StepResult
from environments.scienceworld.engine import (
    DEFAULT_JVM_OPTIONS,
    INVALID_ACTION_OBSERVATION,
    Engine,
    EngineCrashedError,
)

log = logging.getLogger(__name__)


def parse_task(task: Any) -> tuple[str, int, str]:
    """(task_name, variation, simplifications) of a task row; ValueError naming what is wrong."""
    if not isinstance(task, Mapping):
        raise ValueError(f'a ScienceWorld task is {{"task_name": str, "variation": int}}, got {task!r}')
    name, variation = task.get("task_name"), task.get("variation")
    if not isinstance(name, str) or not name:
        raise ValueError(f"ScienceWorld task needs a 'task_name' string (e.g. 'boil'); got {name!r}")
    if isinstance(variation, bool) or not isinstance(variation, int) or variation < 0:
        raise ValueError(f"ScienceWorld task {name!r} needs a non-negative int 'variation'; got {variation!r}")
    simplifications = task.get("simplifications", "") or ""
    if not isinstance(simplifications, str):
        raise ValueError(f"'simplifications' must be a comma-separated string, got {simplifications!r}")
    return name, variation, simplifications


def score_to_reward(score: float) -> float:
    """The simulator's score (in [-1, 1]; -1 for a failed task) as a reward in [0, 1]."""
    return min(1.0, max(0.0, float(score)))


class ScienceWorldEnv(Environment):
    """See the module docstring.

    jvm_options: JVM flags (heap cap, collector) for this instance's simulator.
    max_steps: moves after which the episode ends (done).
    max_restarts: JVM replacements per episode before a step gives up with an error observation.
    """

    def __init__(self, *, jvm_options: str = DEFAULT_JVM_OPTIONS, max_steps: int = 100, max_restarts: int = 2):
        if max_steps < 1:
            raise ValueError(f"max_steps={max_steps}; expected at least 1")
        self.jvm_options = jvm_options
        self.max_steps = max_steps
        self.max_restarts = max_restarts
        self._engine: Engine | None = None
        # One thread per instance: the simulator is called from one thread only, in order.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="scienceworld")
        self.task: tuple[str, int, str] | None = None
        self.description = ""
        self.actions: list[str] = []  # actions applied this episode (replayed after a JVM restart)
        self.score = 0.0  # the simulator's score, in [-1, 1]
        self.done = False
        self.moves = 0
        self._restarts_this_episode = 0
        self._broken: str | None = None
        self.stats = collections.Counter()

    # --------------------------------------------------------------------------------------- helpers
    async def _run(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    @property
    def engine(self) -> Engine | None:
        """The running simulator (None before the first reset or after close)."""
        return self._engine

    def _ensure_engine(self) -> Engine:
        if self._engine is None or not self._engine.alive():
            if self._engine is not None:
                self._engine.close()
            self._engine = Engine(self.jvm_options)
            self.stats["engine_starts"] += 1
        return self._engine

    def _load(self, replay: list[str]) -> str:
        """Loads the current task in a (new if needed) engine, replays `replay`; returns the first look."""
        engine = self._ensure_engine()
        name, variation, simplifications = self.task
        engine.load(name, variation, simplifications)
        self.description = engine.task_description()
        for action in replay:
            engine.step(action)
        return engine.look()

    def _restart(self) -> None:
        """Replaces a dead JVM and restores the episode by replaying its actions."""
        self.stats["engine_restarts"] += 1
        self._restarts_this_episode += 1
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self._load(list(self.actions))

    # ------------------------------------------------------------------------------------- interface
    async def reset(self, task: Any = None) -> str:
        """Starts `task` ({"task_name", "variation"}) and returns its description and first look.

        Without a task (the pool's reset between chains) the episode is forgotten and the JVM kept.
        """
        self.actions, self.score, self.done, self.moves = [], 0.0, False, 0
        self._restarts_this_episode = 0
        if task is None:
            self.task = None
            self.description = ""
            return "No ScienceWorld task is loaded; reset with a task to start one."
        self.task = parse_task(task)
        self.stats["resets"] += 1
        try:
            look = await self._run(self._load, [])
        except EngineCrashedError:
            await self._run(self._restart)
            look = await self._run(lambda: self._engine.look())
        self._broken = None
        return f"Task: {self.description}\n\n{look}"

    async def step(self, action: Any) -> StepResult:
        """Applies one action (text, or {"action": text}); see the module docstring for the reward."""
        if isinstance(action, Mapping):
            action = action.get("action", "")
        action = str(action).strip()
        if self.task is None:
            return StepResult(
                "No ScienceWorld task is loaded: the environment must be reset with a task first.",
                reward=0.0, done=True, info={"error": "no_task"},
            )
        if self.done:
            return StepResult(
                f"The episode is over (score {round(100 * self.score)}). No more actions are taken.",
                reward=score_to_reward(self.score), done=True, info=self._info(invalid=False),
            )
        if not action:
            self.stats["invalid_actions"] += 1
            return StepResult("Empty action: write an action such as 'look around'.",
                              reward=score_to_reward(self.score), done=False, info=self._info(invalid=True))
        try:
            observation, score, completed, moves = await self._run(lambda: self._engine.step(action))
        except (EngineCrashedError, AttributeError) as error:
            return await self._after_crash(action, error)
        except Exception as error:  # noqa: BLE001 - a Java exception inside a healthy JVM: the chain is told
            self.stats["engine_errors"] += 1
            log.warning("ScienceWorld simulator raised on %r: %r", action, error)
            return StepResult(f"[environment error] The simulator could not apply {action!r}; try another action.",
                              reward=score_to_reward(self.score), done=False, info=self._info(invalid=True))
        self.stats["steps"] += 1
        invalid = observation.strip() == INVALID_ACTION_OBSERVATION
        if invalid:
            self.stats["invalid_actions"] += 1
        else:
            self.actions.append(action)
        self.score, self.moves = score, moves
        self.done = completed or score < 0 or moves >= self.max_steps
        if self.done:
            outcome = "completed" if score >= 1.0 else ("failed" if score < 0 else "ended")
            limit = " (step limit reached)" if moves >= self.max_steps and not completed else ""
            observation = f"{observation}\n[The task is {outcome}{limit}. Score: {round(100 * score)}/100.]"
        return StepResult(observation, reward=score_to_reward(score), done=self.done,
                          info=self._info(invalid=invalid))

    async def _after_crash(self, action: str, error: Exception) -> StepResult:
        self.stats["engine_crashes"] += 1
        log.warning("ScienceWorld engine crashed during step %r (%s); restarting it", action, error)
        if self._restarts_this_episode >= self.max_restarts:
            self._broken = f"the engine crashed {self._restarts_this_episode + 1} times this episode"
            self.done = True
            return StepResult(
                f"[environment error] The ScienceWorld engine crashed again ({error}); the episode ends here.",
                reward=score_to_reward(self.score), done=True, info=self._info(invalid=False, crashed=True),
            )
        try:
            await self._run(self._restart)
        except Exception as restart_error:  # noqa: BLE001 - reported to the chain, instance marked broken
            self._broken = f"restart failed: {restart_error!r}"
            self.done = True
            return StepResult(
                f"[environment error] The ScienceWorld engine crashed and could not be restarted "
                f"({restart_error}); the episode ends here.",
                reward=score_to_reward(self.score), done=True, info=self._info(invalid=False, crashed=True),
            )
        return StepResult(
            f"[environment restarted] The ScienceWorld engine crashed and was restarted; the episode was restored "
            f"by replaying your {len(self.actions)} earlier actions. Your last action ({action!r}) was NOT "
            f"applied: send it again.",
            reward=score_to_reward(self.score), done=False, info=self._info(invalid=False, crashed=True),
        )

    def _info(self, *, invalid: bool, crashed: bool = False) -> dict[str, Any]:
        name, variation, _ = self.task if self.task else ("", -1, "")
        return {"score": round(100 * self.score), "moves": self.moves, "invalid": invalid, "restarted": crashed,
                "task_name": name, "variation": variation, "completed": self.done and self.score >= 1.0}

    async def valid_actions(self) -> list[str]:
        """The simulator's valid action-object combinations in the current state (≈ 0.35 s)."""
        if self.task is None:
            return []
        self.stats["valid_action_calls"] += 1
        try:
            return await self._run(lambda: self._engine.valid_actions())
        except (EngineCrashedError, AttributeError):
            self.stats["engine_crashes"] += 1
            await self._run(self._restart)
            return await self._run(lambda: self._engine.valid_actions())

    async def health(self) -> bool:
        """False when the JVM is gone or could not be restarted (the pool then replaces the instance)."""
        return self._broken is None and (self._engine is None or self._engine.alive())

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await self._run(engine.close)
        self._executor.shutdown(wait=False)

    def __repr__(self) -> str:
        pid = self._engine.pid if self._engine is not None else None
        return f"ScienceWorldEnv(task={self.task}, jvm_pid={pid})"
