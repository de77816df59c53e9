"""Environment plugins: one `EnvSpec` per environment, found by name.

An environment package (this repository's `environments/<name>/`, or a user's own) exposes a factory
`env_spec(**options) -> EnvSpec` and makes it findable in one of three ways:

- an entry point in the group `agentfly_jax.environments` (how `environments/*` are registered, in
  setup.cfg): `webshop = environments.webshop:env_spec`;
- `register_env("name")(factory)` at import time of user code;
- an import path given as the name: `"my_package.my_env:env_spec"`.

The trainer (`config.env.name`, `config.env.options`) and `scripts/eval_env.py --env NAME` both call
`load_env_spec(name, options)`; the library never imports an environment package itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import inspect
import random
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

from agentfly_jax.rewards.decorator import Reward
from agentfly_jax.tools.decorator import Tool

ENTRY_POINT_GROUP = "agentfly_jax.environments"

#: A scripted policy: a generator function `policy(task, rng)` that yields tool calls
#: {"name": ..., "arguments": {...}}, receives each call's observation text back from `yield`, and returns
#: the final answer text (or None).
ScriptedPolicy = Callable[[Mapping[str, Any], random.Random], Generator[dict, str, "str | None"]]

#: SFT demonstrations: `demonstrations(tasks, rng, expert_fraction) -> [messages, ...]`, one conversation per
#: task; `expert_fraction` of them solve the task with the tools, the rest show the environment's weaker
#: baseline behaviour (e.g. answering without the tool). A function that also takes a keyword `tokenizer` gets the
#: run's tokenizer (e.g. to run scripted agents, `environments.evaluation.recorded_demonstrations`).
Demonstrations = Callable[[Sequence[Mapping[str, Any]], random.Random, float], list[list[dict]]]

AGENT_TYPES = ("tool_calling", "react", "code")


@dataclasses.dataclass
class EnvSpec:
    """Everything the trainer and the evaluation script need from one environment.

    tasks(split, num, seed) -> rows: dataset rows of a split (the environment names its splits, usually
    "train", "dev", "test"); `num <= 0` means every row of the split. Each row has a non-empty `question`
    plus the fields the environment's tools, reward and `reset(task)` read. Deterministic in `seed`, and
    held-out splits never share a task with "train".
    tools / reward: the @tool objects the agent may call and the @reward scoring a finished chain.
    pools: {pool name: ResourceManager pool config} for every pool the tools and the reward name.
    agent: the agent type the prompt and tool format are written for ("tool_calling", "react", "code").
    demonstrations: SFT conversations for a warm start (None: the environment has none).
    oracle_policy / random_policy: scripted agents for evaluation (None: the environment has none). The
    oracle must solve every task; the random one is the floor.
    tokenizer(directory, seed): the environment's own tokenizer, for environments that build one (None:
    use a pretrained tokenizer).
    """

    name: str
    tasks: Callable[[str, int, int], list[dict]]
    tools: list[Tool]
    reward: Reward
    pools: dict[str, dict] = dataclasses.field(default_factory=dict)
    system_prompt: str = ""
    agent: str = "tool_calling"
    max_turns: int = 30
    success_threshold: float = 1.0
    max_observation_chars: int = 8192
    splits: tuple[str, ...] = ("train", "dev", "test")
    demonstrations: Demonstrations | None = None
    oracle_policy: ScriptedPolicy | None = None
    random_policy: ScriptedPolicy | None = None
    tokenizer: Callable[[str, int], Any] | None = None

    def __post_init__(self):
        where = f"EnvSpec {self.name!r}"
        self.tools = list(self.tools)
        for t in self.tools:
            if not isinstance(t, Tool):
                raise TypeError(f"{where}: tools must be @tool objects, got {t!r}")
            if t.stateful and t.pool not in self.pools:
                raise ValueError(f"{where}: tool '{t.name}' uses pool '{t.pool}' but pools has "
                                 f"{sorted(self.pools)}; add a pool config for it")
        if not isinstance(self.reward, Reward):
            raise TypeError(f"{where}: reward must be a @reward function, got {self.reward!r}")
        if self.reward.needs_env and self.reward.pool not in self.pools:
            raise ValueError(f"{where}: reward '{self.reward.name}' uses pool '{self.reward.pool}' but pools has "
                             f"{sorted(self.pools)}")
        if self.agent not in AGENT_TYPES and ":" not in self.agent:
            raise ValueError(f"{where}: agent={self.agent!r}; expected one of {AGENT_TYPES} or an import path "
                             "'package.module:AgentClass'")
        if self.max_turns < 1:
            raise ValueError(f"{where}: max_turns={self.max_turns}; expected at least 1")

    def split_tasks(self, split: str, num: int, seed: int) -> list[dict]:
        """`tasks(split, num, seed)` with the split name checked first."""
        if split not in self.splits:
            raise ValueError(f"environment {self.name!r} has no split {split!r}; its splits: {list(self.splits)}")
        return self.tasks(split, num, seed)


# ------------------------------------------------------------------------------------------------ registry
_FACTORIES: dict[str, Callable[..., EnvSpec]] = {}


def register_env(name: str) -> Callable[[Callable[..., EnvSpec]], Callable[..., EnvSpec]]:
    """Decorator: registers `factory(**options) -> EnvSpec` under `name` (for environments outside a package
    with an entry point)."""

    def wrap(factory):
        if name in _FACTORIES and _FACTORIES[name] is not factory:
            raise ValueError(f"environment {name!r} is already registered (by {_FACTORIES[name]!r}); pick another name")
        _FACTORIES[name] = factory
        return factory

    return wrap


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def env_names() -> list[str]:
    """Names of every registered environment (entry points and `register_env`)."""
    return sorted(set(_FACTORIES) | set(_entry_points()))


def env_factory(name: str) -> Callable[..., EnvSpec]:
    """The spec factory registered as `name`, or imported from `name` when it is an import path."""
    if name in _FACTORIES:
        return _FACTORIES[name]
    points = _entry_points()
    if name in points:
        return points[name].load()
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"environment {name!r} cannot be imported ({e}); expected 'package.module:env_spec'") from e
    known = env_names()
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown environment {name!r}{hint}; known: {', '.join(known) or 'none'} "
                     "(or give an import path 'package.module:env_spec')")


def load_env_spec(name: str, options: Mapping[str, Any] | None = None) -> EnvSpec:
    """`env_factory(name)(**options)`, with unknown options refused by name before the factory runs."""
    factory = env_factory(name)
    options = dict(options or {})
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not takes_any:
        accepted = [p for p, v in params.items() if v.kind in (v.KEYWORD_ONLY, v.POSITIONAL_OR_KEYWORD)]
        for key in options:
            if key not in accepted:
                close = difflib.get_close_matches(key, accepted, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"environment {name!r} has no option {key!r}{hint}; its options: "
                                 f"{', '.join(accepted) or 'none'}")
    spec = factory(**options)
    if not isinstance(spec, EnvSpec):
        raise TypeError(f"environment {name!r}: {factory!r} returned {type(spec).__name__}, expected an EnvSpec")
    return spec
