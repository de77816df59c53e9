"""Environments: the async interface, the central resource manager and the code sandboxes.

from agentfly_jax.envs import ResourceManager, Environment, StepResult
from agentfly_jax.envs.sandbox import run_python
"""

from agentfly_jax.envs.base import Environment, StepResult, maybe_await
from agentfly_jax.envs.manager import (
    EnvironmentCreationError,
    PoolClosedError,
    PoolConfig,
    PoolTimeoutError,
    ResourceManager,
)

__all__ = [
    "Environment",
    "StepResult",
    "maybe_await",
    "ResourceManager",
    "PoolConfig",
    "PoolTimeoutError",
    "PoolClosedError",
    "EnvironmentCreationError",
]
