"""Train state (policy, optional critic, frozen reference) and the optax optimiser built from config."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentfly_jax.models import lora
from agentfly_jax.models import sharding as shd
from agentfly_jax.models.config import jit_run_once
from agentfly_jax.trainer.config import OptimizerConfig
from agentfly_jax.trainer.fused_adamw import fused_clip_adamw


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    warmup = optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1))
    end = cfg.learning_rate * cfg.end_lr_ratio
    if cfg.schedule == "constant" or cfg.decay_steps <= 0:
        decay = optax.constant_schedule(cfg.learning_rate)
    elif cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(cfg.learning_rate, cfg.decay_steps, alpha=cfg.end_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(cfg.learning_rate, end, cfg.decay_steps)
    else:
        raise ValueError(f"unknown lr schedule {cfg.schedule!r}; expected 'cosine', 'linear' or 'constant'")
    if cfg.warmup_steps <= 0:
        return decay
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


# optimizer.fused="hybrid": leaves of at most this many values are stacked across layers. An estimate, not a
# measurement: the update of such a leaf moves < 4 MB in bf16, about 1 us of H100/H200 bandwidth, less than the
# cost of launching its kernel, so only the launches count there; larger leaves stay per leaf (no stacking copies)
HYBRID_STACK_MAX_SIZE = 2 ** 18


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """Global-norm clipping + AdamW with the config's schedule: optax's chain, or (`cfg.fused`) the same step as
    one pass over per-leaf or stacked groups, `fused_adamw.fused_clip_adamw`."""
    if cfg.fused != "off":
        stack_max_size = {"per_leaf": 0, "stacked": None, "hybrid": HYBRID_STACK_MAX_SIZE}[cfg.fused]
        return fused_clip_adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                                stack_max_size=stack_max_size, update_norm=cfg.update_norm)
    adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay)
    if cfg.max_grad_norm and cfg.max_grad_norm > 0:
        adamw = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
    optimizer = _Optax(*adamw)
    optimizer.update_norm = cfg.update_norm  # what the trainer's `_apply` logs as the update norm
    return optimizer


class _Optax(optax.GradientTransformation):
    """optax's transformation with an attribute the trainer reads: `update_norm` (`OptimizerConfig`)."""


class ModelState(flax.struct.PyTreeNode):
    """Params + optimiser state of one trained model (policy or critic)."""

    params: Any
    opt_state: Any


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array
    policy: ModelState
    critic: ModelState | None = None
    ref_params: Any = None  # frozen reference policy for the KL term (None: no KL)


def _optimised(params, trainable):
    """The part of `params` the optimiser sees: all of it, or the leaves `trainable(path)` picks (LoRA)."""
    return params if trainable is None else lora.split_trainable(params, trainable)[0]


def init_model_state(params, optimizer: optax.GradientTransformation, trainable=None) -> ModelState:
    """Params + optimiser state; with `trainable` (a predicate on parameter paths, e.g. `lora.is_adapter`) the
    optimiser state covers only those leaves (the rest is frozen)."""
    # jit so that optimiser moments are created with the params' shardings (GSPMD propagates them).
    # (zeros: a program run once, compiled as such: models.config.jit_run_once)
    return ModelState(params=params, opt_state=jit_run_once(optimizer.init, _optimised(params, trainable)))


def create_train_state(policy_params, policy_opt, *, critic_params=None, critic_opt=None,
                       ref_params=None, trainable=None) -> TrainState:
    """`trainable` selects the policy's trained leaves (None: all); the critic trains all of its own."""
    critic = None if critic_params is None else init_model_state(critic_params, critic_opt)
    return TrainState(step=jnp.zeros((), jnp.int32), policy=init_model_state(policy_params, policy_opt, trainable),
                      critic=critic, ref_params=ref_params)


def state_shardings(state: TrainState, mesh: Mesh, *, policy_model, policy_opt, critic_model=None,
                    critic_opt=None, rules=shd.DEFAULT_RULES, trainable=None) -> TrainState:
    """NamedSharding tree for a TrainState: params and their optimiser moments by logical axis names;
    counters and other scalars replicated."""
    replicated = NamedSharding(mesh, P())

    def model_state(ms: ModelState, model, optimizer, trainable=None):
        param_sh = shd.param_shardings(model, ms.params, mesh, rules)
        fused = getattr(optimizer, "state_shardings", None)  # fused_clip_adamw: moments stacked by group
        if fused is not None:
            opt_sh = fused(_optimised(ms.params, trainable), _optimised(param_sh, trainable), replicated)
            return ModelState(params=param_sh, opt_state=opt_sh)
        opt_sh = optax.tree_map_params(optimizer, lambda _, sh: sh, ms.opt_state, _optimised(param_sh, trainable),
                                       transform_non_params=lambda _: replicated)
        return ModelState(params=param_sh, opt_state=opt_sh)

    return TrainState(
        step=replicated,
        policy=model_state(state.policy, policy_model, policy_opt, trainable),
        critic=None if state.critic is None else model_state(state.critic, critic_model, critic_opt),
        ref_params=None if state.ref_params is None else shd.param_shardings(policy_model, state.ref_params,
                                                                            mesh, rules))
