"""Agents that fail on process 1 of a multi-process run, for tests/trainer/test_process_faults.py: the quickstart's
tool-calling agent, whose rollout number `AT` on process 1 (with evaluation off and no SFT: RL step AT - 1's) kills
the process (SIGKILL: a crash, an out-of-memory kill), freezes it (SIGSTOP: a hung host) or raises. Chosen through
`config.agent.type='tests.trainer.faulty_agents:<class>'`, the way a user plugs in an agent of their own; nothing in
the library knows of them."""
import os
import signal

import jax

from agentfly_jax.rollout.agents import ToolCallingAgent


class _FailsOnProcessOne(ToolCallingAgent):
    AT = 2  # the rollout of process 1 that fails: the second (RL step 1, after checkpoint 1)

    async def run(self, tasks, *args, **kwargs):
        self._rollouts = getattr(self, "_rollouts", 0) + 1
        if jax.process_index() == 1 and self._rollouts == self.AT:
            self.fail()
        return await super().run(tasks, *args, **kwargs)

    def fail(self) -> None:
        raise NotImplementedError


class KilledOnProcessOne(_FailsOnProcessOne):
    def fail(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class FrozenOnProcessOne(_FailsOnProcessOne):
    def fail(self) -> None:
        os.kill(os.getpid(), signal.SIGSTOP)


class RaisesOnProcessOne(_FailsOnProcessOne):
    def fail(self) -> None:
        raise RuntimeError("an environment server of process 1 broke (injected by the test)")
