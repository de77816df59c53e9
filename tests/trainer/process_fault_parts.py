"""Parts plugged into the runs of tests/trainer/test_process_faults.py through the config, the way a user plugs in
their own (nothing in the library knows of them):

- agents that fail on process 1 of a multi-process run: the quickstart's tool-calling agent, whose rollout number
  `AT` on process 1 (with evaluation off and no SFT: RL step AT - 1's) freezes the process (SIGSTOP: a hung
  host) or raises; `config.agent.type='tests.trainer.process_fault_parts:<class>'`;
- `digit_share`, a reward that differs between the chains of an untrained policy (the quickstart's answers are
  all wrong before SFT, so GRPO would have no signal and the parameters would not move):
  `config.agent.reward='tests.trainer.process_fault_parts:digit_share'`."""
import atexit
import os
import signal
import time

import jax

from agentfly_jax.rewards import reward
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


class FrozenOnProcessOne(_FailsOnProcessOne):
    def fail(self) -> None:
        os.kill(os.getpid(), signal.SIGSTOP)


class RaisesOnProcessOne(_FailsOnProcessOne):
    def fail(self) -> None:
        # and its exit takes 2 s more (like stopping containers): process 0, whose coordinator the runtime of
        # process 1 needs until then, must wait for it
        atexit.register(time.sleep, 2)
        raise RuntimeError("an environment server of process 1 broke (injected by the test)")


@reward
def digit_share(prediction: str) -> float:
    """The share of digits among the response's characters."""
    return sum(c.isdigit() for c in prediction) / max(1, len(prediction))
