"""The `@reward` decorator: a function of the final answer, the trajectory and dataset fields by name.

A reward function's parameters say what it needs:
- `prediction`: the final answer text (the content of the chain's last assistant turn);
- `trajectory`: the chain's `Trajectory` (tokens, tool calls, turns, ...);
- `task`: the whole dataset row (read-only);
- `env`: the chain's environment of the reward's `pool` (environment-backed rewards, `@reward(pool=...)`);
- any other name: the dataset field of that name. A parameter with a default is optional.

The signature is checked against the dataset before the first rollout (`Reward.check_tasks`), so a
misspelt field fails at start with a message naming it. At scoring time nothing raises: a reward that
raises (SystemExit and KeyboardInterrupt included), times out or returns something unusable gives 0.0 and
`ok=False` with the reason and its kind (`REWARD_ERROR_KINDS`).

Every reward runs under a time limit: its own `@reward(timeout=...)`, else the one the caller passes (the
agent's `reward_timeout`, config `agent.reward_timeout`), else DEFAULT_REWARD_TIMEOUT_S; `math.inf` means
none. At the limit the reward is cancelled and, if it does not stop, abandoned (a sync reward's thread, or an
async reward that ignores cancellation, runs on in the background; see `call_with_limit`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from agentfly_jax.tools.context import ToolContext
from agentfly_jax.tools.execute import (
    CallRaisedBaseException,
    CallTimedOut,
    call_with_limit,
    retire_environment,
)

PREDICTION_PARAMETER = "prediction"
TRAJECTORY_PARAMETER = "trajectory"
TASK_PARAMETER = "task"
ENV_PARAMETER = "env"
_RUNTIME_PARAMETERS = (PREDICTION_PARAMETER, TRAJECTORY_PARAMETER, TASK_PARAMETER, ENV_PARAMETER)

#: Seconds a reward may take when neither the reward nor the caller sets a limit.
DEFAULT_REWARD_TIMEOUT_S = 300.0

#: Every way scoring can fail; each RewardResult with ok=False carries one of these.
REWARD_ERROR_KINDS = (
    "exception",  # the reward raised (SystemExit, KeyboardInterrupt and other BaseExceptions included)
    "timeout",  # it ran past its time limit and was stopped (or abandoned)
    "bad_return",  # it returned something that is not a finite number or {"reward": number, ...}
    "env_error",  # the chain's environment for an environment-backed reward could not be had
)

#: Rewards by name, filled by `@reward`.
REWARD_REGISTRY: dict[str, Reward] = {}


class RewardBindingError(ValueError):
    """A reward asks for a dataset field the dataset does not have (raised before any rollout)."""


@dataclasses.dataclass
class RewardResult:
    """A scored chain: the reward, logged extras, and whether scoring worked (error says why not)."""

    reward: float
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    ok: bool = True
    error: str | None = None
    error_kind: str | None = None  # one of REWARD_ERROR_KINDS when ok is False
    abandoned: bool = False  # timed out and still running when given up on


def _failed(kind: str, message: str, extras: dict[str, Any] | None = None, **fields: Any) -> RewardResult:
    assert kind in REWARD_ERROR_KINDS, kind
    return RewardResult(0.0, dict(extras or {}), ok=False, error=message, error_kind=kind, **fields)


class Reward:
    """A reward function with its needs read from the signature; see the module docstring."""

    def __init__(
        self,
        func: Callable,
        *,
        name: str | None = None,
        pool: str | None = None,
        timeout: float | None = None,
    ):
        self.func = func
        self.name = name or func.__name__
        self.pool = pool
        self.timeout = timeout
        self.is_async = inspect.iscoroutinefunction(func)
        signature = inspect.signature(func)
        self.required_fields: list[str] = []
        self.optional_fields: list[str] = []
        self.takes_all_fields = False
        names = set()
        for parameter in signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                self.takes_all_fields = True
                continue
            if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
                raise TypeError(
                    f"reward '{self.name}': parameter '{parameter.name}' cannot be passed by name; "
                    "reward parameters are filled by name"
                )
            names.add(parameter.name)
            if parameter.name in _RUNTIME_PARAMETERS:
                continue
            if parameter.default is inspect.Parameter.empty:
                self.required_fields.append(parameter.name)
            else:
                self.optional_fields.append(parameter.name)
        self.parameter_names = names
        if ENV_PARAMETER in names and pool is None:
            raise TypeError(
                f"reward '{self.name}' has an 'env' parameter but no pool: use @reward(pool=...) to say which "
                "environment it scores in"
            )
        if pool is not None and ENV_PARAMETER not in names:
            raise TypeError(f"reward '{self.name}' has pool={pool!r} but no 'env' parameter to receive it")
        if timeout is not None and not timeout > 0:
            raise TypeError(f"reward '{self.name}': timeout must be positive seconds, got {timeout!r}")

    @property
    def needs_env(self) -> bool:
        """Whether the reward scores in the chain's environment."""
        return self.pool is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Reward({self.name!r}, fields={self.required_fields + self.optional_fields})"

    # ----------------------------------------------------------------------------------------------
    # Binding to a dataset
    # ----------------------------------------------------------------------------------------------

    def bind(self, fields: Iterable[str], *, source: str = "the dataset") -> None:
        """Check that every required field is among `fields`; raises RewardBindingError otherwise."""
        fields = set(fields)
        missing = [name for name in self.required_fields if name not in fields]
        if missing:
            raise RewardBindingError(self._missing_message(missing[0], fields, source))

    def check_tasks(self, tasks: Sequence[Mapping[str, Any]], *, where: Callable[[int], str] | None = None) -> None:
        """Check every dataset row has the fields this reward needs; the error names the first bad row.

        `where(index)` describes a row for the message (default: "task {index}").
        """
        describe = where or (lambda index: f"task {index}")
        for index, row in enumerate(tasks):
            missing = [name for name in self.required_fields if name not in row]
            if missing:
                raise RewardBindingError(self._missing_message(missing[0], set(row), describe(index)))

    def _missing_message(self, field: str, fields: set[str], source: str) -> str:
        close = difflib.get_close_matches(field, sorted(fields), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        return (
            f"reward '{self.name}' takes a parameter '{field}', but {source} has no field '{field}' "
            f"(fields: {', '.join(sorted(fields)) or 'none'}).{hint} Rename the parameter to a dataset field, "
            "give it a default, or add the field to the dataset."
        )

    # ----------------------------------------------------------------------------------------------
    # Scoring
    # ----------------------------------------------------------------------------------------------

    def arguments_for(
        self, *, prediction: str, trajectory: Any, task: Mapping[str, Any], env: Any = None
    ) -> dict[str, Any]:
        """The keyword arguments this reward is called with."""
        runtime = {
            PREDICTION_PARAMETER: prediction,
            TRAJECTORY_PARAMETER: trajectory,
            TASK_PARAMETER: task,
            ENV_PARAMETER: env,
        }
        arguments = {name: value for name, value in runtime.items() if name in self.parameter_names}
        wanted = self.required_fields + self.optional_fields
        for name in wanted:
            if name in task:
                arguments[name] = task[name]
        if self.takes_all_fields:
            for name, value in task.items():
                if name not in _RUNTIME_PARAMETERS and name not in arguments:
                    arguments[name] = value
        return arguments

    async def score(
        self,
        *,
        prediction: str,
        trajectory: Any = None,
        task: Mapping[str, Any] | None = None,
        context: ToolContext | None = None,
        timeout: float | None = None,
    ) -> RewardResult:
        """Call the reward; failures (raise, timeout, bad return, no environment) give 0.0 with ok=False.

        timeout: the limit for a reward without its own (None: DEFAULT_REWARD_TIMEOUT_S; `math.inf`: none).
        """
        task = task if task is not None else (context.task if context is not None else {})
        limit_s = self.timeout if self.timeout is not None else timeout
        limit_s = DEFAULT_REWARD_TIMEOUT_S if limit_s is None else limit_s
        if not self.needs_env:
            return await self._call(prediction, trajectory, task, None, limit_s)
        if context is None:
            return _failed(
                "env_error",
                f"reward '{self.name}' scores in environment pool '{self.pool}' and needs the chain's context",
            )
        async with context.env_lock(self.pool):
            try:
                env = await context.env(self.pool)
            except Exception as error:  # noqa: BLE001 - a failing reward is data, not a dead rollout
                return _failed(
                    "env_error",
                    f"reward '{self.name}' could not get its environment (pool '{self.pool}'): "
                    f"{type(error).__name__}: {error}",
                )
            return await self._call(prediction, trajectory, task, env, limit_s)

    async def _call(
        self, prediction: str, trajectory: Any, task: Mapping[str, Any], env: Any, limit_s: float
    ) -> RewardResult:
        try:
            arguments = self.arguments_for(prediction=prediction, trajectory=trajectory, task=task, env=env)
            value = await call_with_limit(self.func, arguments, is_async=self.is_async, limit_s=limit_s)
        except CallTimedOut as stopped:
            state = " and was abandoned still running" if stopped.abandoned else ""
            if stopped.abandoned and retire_environment(env):  # it may still be changing its environment
                state += "; its environment will not be reused after this episode"
            return _failed(
                "timeout",
                f"reward '{self.name}' did not finish within {limit_s:g} s{state}",
                abandoned=stopped.abandoned,
            )
        except CallRaisedBaseException as error:  # SystemExit, KeyboardInterrupt, ... from the reward's code
            return _failed("exception", f"reward '{self.name}' raised {error}")
        except Exception as error:  # noqa: BLE001 - a failing reward is data, not a dead rollout
            return _failed("exception", f"reward '{self.name}' raised {type(error).__name__}: {error}")
        try:
            return self._result_of(value)
        except Exception as error:  # noqa: BLE001 - e.g. a __float__ that raises
            return _failed(
                "bad_return",
                f"reward '{self.name}' returned a {type(value).__name__} that is not a number "
                f"({type(error).__name__}: {error})",
            )

    def _result_of(self, value: Any) -> RewardResult:
        extras: dict[str, Any] = {}
        if isinstance(value, Mapping):
            if "reward" not in value:
                return _failed(
                    "bad_return",
                    f"reward '{self.name}' returned a dict without a 'reward' key (keys: {sorted(map(str, value))})",
                )
            extras = {key: item for key, item in value.items() if key != "reward"}
            value = value["reward"]
        if isinstance(value, str) or not hasattr(value, "__float__"):
            return _failed(
                "bad_return",
                f"reward '{self.name}' returned {type(value).__name__}; return a float or {{'reward': ...}}",
                extras,
            )
        number = float(value)
        if not math.isfinite(number):
            return _failed("bad_return", f"reward '{self.name}' returned {number}", extras)
        return RewardResult(number, extras)


def reward(
    func: Callable | None = None,
    *,
    name: str | None = None,
    pool: str | None = None,
    timeout: float | None = None,
):
    """Make a function a reward; usable as `@reward` or `@reward(name=..., pool=..., timeout=...)`.

    It returns a float, or a dict with `reward` plus extras (logged). Sync and async functions both work
    (sync ones run in a worker thread). `pool` makes it environment-backed: it receives the chain's
    environment of that pool as `env`. `timeout`: seconds before it is stopped and scores 0.0 (default: the
    agent's `reward_timeout`, else DEFAULT_REWARD_TIMEOUT_S; `math.inf` for none).
    """

    def decorate(function: Callable) -> Reward:
        made = Reward(function, name=name, pool=pool, timeout=timeout)
        REWARD_REGISTRY[made.name] = made
        return made

    return decorate(func) if func is not None else decorate


def as_reward(value: Reward | Callable | str | None) -> Reward | None:
    """A Reward from a Reward, a plain function, or a registered reward name (None stays None)."""
    if value is None or isinstance(value, Reward):
        return value
    if isinstance(value, str):
        if value not in REWARD_REGISTRY:
            raise KeyError(f"no reward named {value!r} is registered; registered: {sorted(REWARD_REGISTRY)}")
        return REWARD_REGISTRY[value]
    if callable(value):
        return Reward(value)
    raise TypeError(f"reward_fn must be a @reward function, a function or a registered name, got {value!r}")
