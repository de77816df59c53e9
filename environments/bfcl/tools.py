"""The BFCL tools (one per backend function, with BFCL's function doc as its schema) and the reward.

Every function of the eight multi-turn backends is its own stateful @tool of the pool "bfcl": the model sees
its name, description and parameter schema (the chat template, or `BFCLAgent`, renders the schemas of the
task's classes), arguments are validated against that schema by the tool runtime (a wrong type or a missing
argument is a `bad_arguments` error observation), and a call runs the method on the chain's own instance in
its `BFCLEnv`. A function of a class the task does not involve, or one the task excludes, is an error
observation; so is an exception raised by the backend. Results are the backend's return value as text (dicts
as JSON), bounded by `max_observation_chars`.
"""

from __future__ import annotations

from typing import Any

from agentfly_jax.rewards import reward
from agentfly_jax.tools.decorator import Tool
from environments.bfcl.data import function_docs
from environments.bfcl.env import BFCLEnv
from environments.bfcl.scoring import score_chain

POOL = "bfcl"
#: Longest tool result the model sees (the file system's `cat` of a long file, a long inbox, ...).
MAX_OBSERVATION_CHARS = 2000


def _dispatcher(name: str):
    def call(env: BFCLEnv, **arguments: Any) -> str:
        return env.call(name, arguments)

    call.__name__ = name
    return call


def make_tools(compact: bool = True, max_observation_chars: int = MAX_OBSERVATION_CHARS) -> list[Tool]:
    """One stateful Tool per function of the multi-turn backends, its schema taken from BFCL's docs."""
    tools = []
    for functions in function_docs(compact).values():
        for name, schema in functions.items():
            spec = schema["function"]
            made = Tool(_dispatcher(name), name=name, description=spec["description"], stateful=True, pool=POOL,
                        timeout=30.0, max_observation_chars=max_observation_chars)
            # The model fills exactly BFCL's parameters: validated by the runtime against this schema.
            made.parameters = spec["parameters"]
            made.accepts_extra_arguments = False
            tools.append(made)
    return tools


def chain_score(task: dict, env: BFCLEnv, finish_reason: str | None) -> dict[str, Any]:
    """`score_chain` for a chain whose environment is `env` and that finished with `finish_reason`."""
    delivered = len(env.checkpoints) + 1
    single_message = finish_reason == "stop" and delivered < len(task["user_turns"])
    return score_chain(task, env.checkpoints, env.state(), env.results, single_message)


@reward(name="bfcl_state_match", pool=POOL)
def bfcl_state_match(task: dict, env: BFCLEnv, trajectory: Any = None) -> dict[str, Any]:
    """Fraction of the task's user turns after which the chain's backend state (and the results it read) match
    the ground truth's (see `environments.bfcl.scoring`)."""
    finish_reason = getattr(trajectory, "finish_reason", None)
    scored = chain_score(task, env, finish_reason)
    scored["calls"] = env.calls
    scored["failed_calls"] = env.failed_calls
    return scored
