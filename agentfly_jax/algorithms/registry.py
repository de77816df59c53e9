"""Name -> function registries, so a config selects an advantage estimator or a policy loss by name.

Adding an algorithm is one decorated pure function (plus its numpy-reference test); learners only look
names up.
"""

from __future__ import annotations

from collections.abc import Callable

_ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
_POLICY_LOSSES: dict[str, Callable] = {}


def _register(table: dict[str, Callable], kind: str, name: str, fn: Callable) -> Callable:
    if name in table:
        raise ValueError(f"{kind} '{name}' is already registered (by {table[name]!r}); pick another name")
    table[name] = fn
    return fn


def _lookup(table: dict[str, Callable], kind: str, name: str) -> Callable:
    if name not in table:
        raise ValueError(f"unknown {kind} '{name}'; known: {', '.join(sorted(table))}")
    return table[name]


def register_advantage_estimator(name: str) -> Callable[[Callable], Callable]:
    """Decorator: registers an advantage estimator under `name` and returns it unchanged."""
    return lambda fn: _register(_ADVANTAGE_ESTIMATORS, "advantage estimator", name, fn)


def get_advantage_estimator(name: str) -> Callable:
    """The advantage estimator registered as `name`; ValueError listing the known names otherwise."""
    return _lookup(_ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def advantage_estimator_names() -> list[str]:
    """Sorted names of all registered advantage estimators."""
    return sorted(_ADVANTAGE_ESTIMATORS)


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator: registers a policy loss
    `(logprobs, old_logprobs, advantages, action_mask, **cfg) -> (loss, metrics)` under `name`."""
    return lambda fn: _register(_POLICY_LOSSES, "policy loss", name, fn)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as `name`; ValueError listing the known names otherwise."""
    return _lookup(_POLICY_LOSSES, "policy loss", name)


def policy_loss_names() -> list[str]:
    """Sorted names of all registered policy losses."""
    return sorted(_POLICY_LOSSES)
