"""The jitted update step: policy (and critic) gradients accumulated over micro-batches, one optimiser step.

Inputs are packed rows (see `batching.py`) already split into micro-batches: every per-token array is
`[M, R, L]` (M micro-batches of R rows of L tokens). Losses are weighted sums with the per-token
`loss_weights` computed on the host for the whole mini-batch, so M micro-batches give exactly the gradient of
one full batch, packed or not. Metrics are action-token means (or min/max) over the mini-batch.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from agentfly_jax import algorithms
from agentfly_jax.models import CausalLM
from agentfly_jax.trainer.state import ModelState, TrainState, dataclass_from_mapping


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Numbers of the RL objective; the experiment config fills them."""

    policy_loss: str = "ppo"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.0  # KL penalty against the reference policy in the loss (0: off)
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    temperature: float = 1.0  # the sampling temperature: logprobs are recomputed under it
    logprob_chunk: int | None = None  # positions per chunk for fp32 logits (None: whole sequence)
    is_cap: float | None = None  # truncated importance weights trainer/sampler (None: off)
    value_clip_eps: float | None = 0.2
    value_coef: float = 1.0

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any] | None) -> "LossConfig":
        return dataclass_from_mapping(cls, cfg, "loss")


def _shift_right(x):
    """[R, L-1] values for tokens 1..L-1 -> [R, L] token-aligned (token 0 has no prediction: 0)."""
    return jnp.pad(x, ((0, 0), (1, 0)))


def token_logprobs(model: CausalLM, params, batch, *, temperature=1.0, chunk=None):
    """(logprobs [R, L], entropy [R, L]) of each token given the tokens before it in its segment (fp32).

    Token 0 of a row and the first token of each packed segment get values that callers must mask out
    (they are never action tokens: a trajectory starts with its prompt).
    """
    hidden = model.apply({"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"],
                         method=CausalLM.hidden_states)  # [R, L, E]

    def logits_fn(h):
        return model.apply({"params": params}, h, method=CausalLM.logits_from_hidden)

    logprobs, entropy = algorithms.token_logprobs_and_entropy(
        hidden[:, :-1], batch["tokens"][:, 1:], logits_fn, temperature=temperature, chunk_size=chunk)
    return _shift_right(logprobs), _shift_right(entropy)


def values_of(model, params, batch):
    """Critic values [R, L], token-aligned like `token_logprobs`: values[t] is the value of the state in which
    token t is chosen (the critic's output at position t - 1)."""
    values = model.apply({"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"])
    return _shift_right(values[:, :-1])


def policy_loss(params, batch, model, cfg: LossConfig):
    """(loss, metrics) on one micro-batch; the loss is sum(loss_weights * per-token terms)."""
    mask = batch["action_mask"]  # [R, L]
    on_actions = mask > 0
    token_weights = batch["loss_weights"]  # [R, L], aggregation over the whole mini-batch folded in
    logprobs, entropy = token_logprobs(model, params, batch, temperature=cfg.temperature, chunk=cfg.logprob_chunk)
    metrics = {}
    pg_weights = token_weights
    if cfg.is_cap is not None:
        is_weights, is_metrics = algorithms.truncated_is_weights(
            batch["old_logprobs"], batch["sampler_logprobs"], mask, cap=cfg.is_cap)
        pg_weights = token_weights * is_weights
        metrics.update(is_metrics)
    # agg="token-mean" with denominator 1 is a plain sum over action tokens; the weights carry the aggregation.
    pg_loss, pg_metrics = algorithms.get_policy_loss(cfg.policy_loss)(
        logprobs, batch["old_logprobs"], batch["advantages"], mask, clip_eps=cfg.clip_eps,
        clip_eps_high=cfg.clip_eps_high, dual_clip=cfg.dual_clip, agg="token-mean", is_weights=pg_weights,
        denominator=jnp.float32(1.0))
    metrics.update(pg_metrics)
    metrics["pg_loss"] = loss = pg_loss
    if cfg.kl_coef:
        kl = algorithms.kl_penalty(logprobs, batch["ref_logprobs"], cfg.kl_estimator)  # [R, L]
        metrics["kl_loss"] = jnp.sum(jnp.where(on_actions, kl * token_weights, 0.0))
        metrics["kl_ref"] = _mean_on(kl, mask)
        loss = loss + cfg.kl_coef * metrics["kl_loss"]
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * jnp.sum(jnp.where(on_actions, entropy * token_weights, 0.0))
    metrics["entropy"] = _mean_on(entropy, mask)
    metrics["logprob_mean"] = _mean_on(logprobs, mask)
    metrics["loss"] = loss
    return loss, metrics


def sft_loss(params, batch, model, cfg: LossConfig):
    """Masked cross-entropy on demonstration tokens: -sum(loss_weights * logprob) over action tokens."""
    mask = batch["action_mask"]
    logprobs, entropy = token_logprobs(model, params, batch, temperature=1.0, chunk=cfg.logprob_chunk)
    nll = -jnp.sum(jnp.where(mask > 0, logprobs * batch["loss_weights"], 0.0))
    token_acc = _mean_on(jnp.exp(logprobs) > 0.5, mask)  # the demonstrated token is the argmax for sure
    return nll, {"loss": nll, "entropy": _mean_on(entropy, mask), "token_prob_gt_half": token_acc,
                 "logprob_mean": _mean_on(logprobs, mask)}


def critic_loss(params, batch, model, cfg: LossConfig):
    """Clipped value loss, token-mean over the mini-batch's action tokens (`num_action_tokens`)."""
    values = values_of(model, params, batch)
    loss, metrics = algorithms.value_loss(values, batch["old_values"], batch["returns"], batch["action_mask"],
                                          clip_eps=cfg.value_clip_eps, agg="token-mean",
                                          denominator=batch["num_action_tokens"])
    loss = cfg.value_coef * loss
    return loss, {**metrics, "loss": loss}


def _mean_on(x, mask):
    return jnp.sum(jnp.where(mask > 0, x, 0.0)) / jnp.maximum(jnp.sum(mask > 0), 1)


# ------------------------------------------------------------------------------------ micro-batch accumulation
_SUMMED = ("loss", "pg_loss", "kl_loss")  # already weighted over the whole mini-batch: add up


def _combine(acc, metrics, n):
    """Folds one micro-batch's metrics in: sums for losses, min/max for extremes, token-weighted means else."""
    out = {}
    has = n > 0
    for k, v in metrics.items():
        if k in _SUMMED:
            out[k] = acc[k] + v
        elif k.endswith("_max"):
            out[k] = jnp.where(has, jnp.maximum(acc[k], v), acc[k])
        elif k.endswith("_min"):
            out[k] = jnp.where(has, jnp.minimum(acc[k], v), acc[k])
        else:
            out[k] = acc[k] + v * n
    return out


def _init_metrics(metric_shapes):
    return {k: jnp.full((), -jnp.inf if k.endswith("_max") else jnp.inf if k.endswith("_min") else 0.0,
                        jnp.float32) for k in metric_shapes}


def _finish(acc, total_n):
    out = {}
    for k, v in acc.items():
        if k in _SUMMED:
            out[k] = v
        elif k.endswith(("_max", "_min")):
            out[k] = jnp.where(jnp.isfinite(v), v, 0.0)
        else:
            out[k] = v / jnp.maximum(total_n, 1)
    return out


def accumulate_gradients(loss_fn: Callable, params, micro_batches):
    """Sum of gradients and combined metrics of `loss_fn(params, mb) -> (loss, metrics)` over the leading
    micro-batch axis of `micro_batches` (a lax.scan: memory of one micro-batch)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    first = jax.tree.map(lambda x: x[0], micro_batches)
    metric_shapes = jax.eval_shape(lambda p, b: loss_fn(p, b)[1], params, first)

    def body(carry, mb):
        grads_acc, metrics_acc, n_acc = carry
        (_, metrics), grads = grad_fn(params, mb)
        n = jnp.sum(mb["action_mask"] > 0).astype(jnp.float32)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        return (grads_acc, _combine(metrics_acc, metrics, n), n_acc + n), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    init = (zeros, _init_metrics(metric_shapes), jnp.zeros((), jnp.float32))
    (grads, metrics, total_n), _ = jax.lax.scan(body, init, micro_batches)
    return grads, _finish(metrics, total_n)


def _apply(ms: ModelState, grads, optimizer: optax.GradientTransformation):
    updates, opt_state = optimizer.update(grads, ms.opt_state, ms.params)
    return ModelState(params=optax.apply_updates(ms.params, updates), opt_state=opt_state), {
        "grad_norm": optax.tree.norm(grads), "update_norm": optax.tree.norm(updates),
        "param_norm": optax.tree.norm(ms.params)}


def make_train_step(policy_model, loss_cfg: LossConfig, policy_opt: optax.GradientTransformation, *,
                    critic_model=None, critic_opt=None, lr_schedule=None, state_sharding=None):
    """Returns jitted `train_step(state, micro_batches) -> (state, metrics)`.

    `micro_batches`: dict of `[M, R, L]` arrays (tokens, positions, segment_ids, action_mask, old_logprobs,
    sampler_logprobs, advantages, loss_weights, and for KL ref_logprobs, for the critic old_values and returns)
    plus `num_action_tokens [M]` (the mini-batch's action-token count, repeated).
    The state is donated; with `state_sharding` the new state keeps that sharding.
    """

    def train_step(state: TrainState, micro_batches):
        metrics = {}
        grads, policy_metrics = accumulate_gradients(
            lambda p, b: policy_loss(p, b, policy_model, loss_cfg), state.policy.params, micro_batches)
        policy, opt_metrics = _apply(state.policy, grads, policy_opt)
        metrics.update({f"policy/{k}": v for k, v in {**policy_metrics, **opt_metrics}.items()})
        if lr_schedule is not None:
            metrics["policy/learning_rate"] = lr_schedule(state.step)
        critic = state.critic
        if critic is not None:
            grads, critic_metrics = accumulate_gradients(
                lambda p, b: critic_loss(p, b, critic_model, loss_cfg), critic.params, micro_batches)
            critic, opt_metrics = _apply(critic, grads, critic_opt)
            metrics.update({f"critic/{k}": v for k, v in {**critic_metrics, **opt_metrics}.items()})
        new_state = state.replace(step=state.step + 1, policy=policy, critic=critic)
        return new_state, metrics

    out_shardings = None if state_sharding is None else (state_sharding, None)
    return jax.jit(train_step, donate_argnums=0, out_shardings=out_shardings)


def make_sft_step(model, loss_cfg: LossConfig, optimizer: optax.GradientTransformation, *, lr_schedule=None,
                  state_sharding=None):
    """Jitted `sft_step(state, micro_batches) -> (state, metrics)`: supervised fine-tuning on the same packed,
    action-masked batches as RL (only the policy is trained)."""

    def sft_step(state: TrainState, micro_batches):
        grads, metrics = accumulate_gradients(lambda p, b: sft_loss(p, b, model, loss_cfg), state.policy.params,
                                              micro_batches)
        policy, opt_metrics = _apply(state.policy, grads, optimizer)
        out = {f"sft/{k}": v for k, v in {**metrics, **opt_metrics}.items()}
        if lr_schedule is not None:
            out["sft/learning_rate"] = lr_schedule(state.step)
        return state.replace(step=state.step + 1, policy=policy), out

    out_shardings = None if state_sharding is None else (state_sharding, None)
    return jax.jit(sft_step, donate_argnums=0, out_shardings=out_shardings)


def make_logprob_fn(model, *, temperature=1.0, chunk=None):
    """Jitted `(params, batch [R, L]) -> logprobs [R, L]` (old / reference logprobs before an update)."""
    return jax.jit(lambda params, batch: token_logprobs(model, params, batch, temperature=temperature,
                                                       chunk=chunk)[0])


def make_value_fn(model):
    """Jitted `(params, batch [R, L]) -> values [R, L]`."""
    return jax.jit(lambda params, batch: values_of(model, params, batch))
