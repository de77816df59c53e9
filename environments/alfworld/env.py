"""ALFWorldEnv: one TextWorld PDDL game of ALFWorld per chain, behind the async environment interface.

    env = ALFWorldEnv()
    observation = await env.reset({"game_file": "tasks/test/.../game.tw-pddl"})   # the room and the task
    result = await env.step("go to countertop 1")      # StepResult(observation, reward, done, info)
    commands = await env.admissible_commands()
    await env.close()

Games (`.tw-pddl`: ALFWorld's PDDL domain + grammar + a problem) are played by TextWorld's PDDL engine with
ALFWorld's `AlfredDemangler` (readable names such as "apple 1") and its admissible commands. reward is 1.0
once the goal holds (TextWorld's `won`), else 0.0; `done` when won or after `max_steps` actions. A command
that is not admissible leaves the game unchanged ("Nothing happens.") and is counted (`info["admissible"]`).
Each instance keeps one engine (its own copy of fast-downward) and loads the next game on reset.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import threading
from collections.abc import Mapping
from typing import Any

from agentfly_jax.envs.base import Environment, StepResult

# TextWorld's PDDL engine is not thread-safe: loading runs fast-downward's Python translator and every step
# derives its text through TextWorld's grammar, both with module-level state (concurrent calls from several
# threads failed). All engine calls of a process take this lock: loads (≈ 0.3-0.7 s) and steps (≈ 35 ms)
# run one at a time while the chains' other work (sampling, other tools) goes on.
_ENGINE_LOCK = threading.Lock()


def _start_engine(game_file: str, expert: bool):
    try:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    except ImportError as error:
        raise ImportError(
            "the ALFWorld environment needs `alfworld` and `textworld[pddl]`: pip install -e '.[envs]'"
        ) from error
    infos = textworld.EnvInfos(won=True, admissible_commands=True, feedback=True, policy_commands=expert)
    return textworld.start(game_file, infos, wrappers=[AlfredDemangler(), AlfredInfos])


def parse_task(task: Any) -> str:
    """The game file of an ALFWorld task row; ValueError naming what is wrong."""
    if not isinstance(task, Mapping) or not isinstance(task.get("game_file"), str):
        raise ValueError(f'an ALFWorld task is {{"game_file": path to a .tw-pddl game}}, got {task!r}')
    game_file = task["game_file"]
    if not os.path.isfile(game_file):
        raise ValueError(
            f"ALFWorld game file {game_file!r} does not exist; build games with "
            "`python -m environments.alfworld.build --out DIR --seed S --num N`"
        )
    return game_file


class ALFWorldEnv(Environment):
    """See the module docstring.

    max_steps: actions after which the episode ends (done).
    expert: also compute the engine planner's plan from the current state (`expert_plan()`); slower steps.
    """

    def __init__(self, *, max_steps: int = 50, expert: bool = False):
        if max_steps < 1:
            raise ValueError(f"max_steps={max_steps}; expected at least 1")
        self.max_steps = max_steps
        self.expert = expert
        self._engine = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="alfworld")
        self.game_file: str | None = None
        self.state = None
        self.won = False
        self.done = False
        self.steps = 0
        self.stats = collections.Counter()

    async def _run(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    def _load(self, game_file: str):
        with _ENGINE_LOCK:
            if self._engine is None:
                self._engine = _start_engine(game_file, self.expert)
            else:
                self._engine.load(game_file)
            return self._engine.reset()

    async def reset(self, task: Any = None) -> str:
        """Loads `task`'s game ({"game_file": path}) and returns its first observation (room + task).

        Without a task (the pool's reset between chains) the episode is forgotten and the engine kept.
        """
        self.state, self.won, self.done, self.steps = None, False, False, 0
        if task is None:
            self.game_file = None
            return "No ALFWorld game is loaded; reset with a task to start one."
        self.game_file = parse_task(task)
        self.state = await self._run(self._load, self.game_file)
        self.stats["resets"] += 1
        return str(self.state.feedback).strip()

    @property
    def admissible(self) -> list[str]:
        return list(self.state["admissible_commands"]) if self.state is not None else []

    async def step(self, action: Any) -> StepResult:
        """Applies one command (text, or {"action": text})."""
        if isinstance(action, Mapping):
            action = action.get("action", "")
        action = " ".join(str(action).strip().split())
        if self.state is None:
            return StepResult("No ALFWorld game is loaded: the environment must be reset with a task first.",
                              reward=0.0, done=True, info={"error": "no_game"})
        if self.done:
            return StepResult(f"The episode is over ({'goal reached' if self.won else 'not solved'}).",
                              reward=float(self.won), done=True, info=self._info(admissible=False))
        admissible = action in self.admissible
        if not admissible:
            self.stats["inadmissible"] += 1
        self.state, _, _ = await self._run(self._locked_step, action)
        self.steps += 1
        self.stats["steps"] += 1
        self.won = bool(self.state["won"])
        self.done = self.won or self.steps >= self.max_steps
        observation = str(self.state.feedback).strip()
        if self.won:
            observation += "\n[You completed the task.]"
        elif self.done:
            observation += f"\n[Step limit of {self.max_steps} reached; the task was not completed.]"
        return StepResult(observation, reward=float(self.won), done=self.done, info=self._info(admissible))

    def _locked_step(self, action: str):
        with _ENGINE_LOCK:
            return self._engine.step(action)

    def _info(self, admissible: bool) -> dict[str, Any]:
        return {"won": self.won, "steps": self.steps, "admissible": admissible, "game_file": self.game_file}

    async def admissible_commands(self) -> list[str]:
        """The commands the game accepts in the current state."""
        self.stats["admissible_calls"] += 1
        return self.admissible

    def expert_plan(self) -> list[str]:
        """The engine planner's plan from the current state (needs expert=True)."""
        if not self.expert:
            raise RuntimeError("ALFWorldEnv(expert=False) has no planner output; create it with expert=True")
        return list(self.state["policy_commands"]) if self.state is not None else []

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await self._run(engine.close)
        self._executor.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"ALFWorldEnv(game_file={self.game_file!r}, steps={self.steps}, won={self.won})"
