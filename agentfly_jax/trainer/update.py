"""The jitted functions of an RL step: `prepare` (old/reference logprobs, values, advantages and loss
weights, in one pass on the device) and `train_step` (policy, and critic, gradients accumulated over
micro-batches, one optimiser step per mini-batch), plus the SFT step.

Inputs are `PackedRows` (see `batch.py`): every per-token array of a mini-batch is `[M, R, L]` (M
micro-batches of R rows of L tokens). Losses are weighted sums with per-token `loss_weights` that
`prepare` computed for each whole mini-batch (`algorithms.aggregation_weights`), so M micro-batches give
exactly the gradient of one full mini-batch, packed or not. Metrics are action-token means (or min/max) over
the mini-batch. The algorithm's knobs come from its recipe (`algorithms.recipes.ResolvedAlgorithm`).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from agentfly_jax import algorithms
from agentfly_jax.algorithms.recipes import ResolvedAlgorithm
from agentfly_jax.models import CausalLM, lora
from agentfly_jax.models.config import gpu_compiler_options
from agentfly_jax.trainer.batch import PackedRows, UpdateBatch
from agentfly_jax.trainer.state import ModelState, TrainState


def _shift_right(x):
    """[R, L-1] values for tokens 1..L-1 -> [R, L] token-aligned (token 0 has no prediction: 0)."""
    return jnp.pad(x, ((0, 0), (1, 0)))


def _vision_inputs(rows: PackedRows) -> dict:
    """The vision-language policy's image arguments for a micro-batch with images ({} without)."""
    if rows.vision is None:
        return {}
    return {"pixel_values": rows.vision.pixel_values, "vision_layout": rows.vision.layout()}


def token_logprobs(model: CausalLM, params, rows: PackedRows, *, temperature=1.0, chunk=None):
    """(logprobs [R, L], entropy [R, L]) of each token given the tokens before it in its segment (fp32).

    Token 0 of a row and the first token of each packed segment get values that callers must mask out
    (they are never action tokens: a trajectory starts with its prompt). A vision-language policy
    (`Qwen2_5_VLCausalLM`) reads the micro-batch's images (`rows.vision`) at its image tokens, with mRoPE positions.
    """
    hidden = model.apply({"params": params}, rows.tokens, rows.positions, rows.segment_ids,
                         method=type(model).hidden_states, **_vision_inputs(rows))  # [R, L, E]

    def logits_fn(h):
        return model.apply({"params": params}, h, method=type(model).logits_from_hidden)

    logprobs, entropy = algorithms.token_logprobs_and_entropy(
        hidden[:, :-1], rows.tokens[:, 1:], logits_fn, temperature=temperature, chunk_size=chunk)
    return _shift_right(logprobs), _shift_right(entropy)


def values_of(model, params, rows: PackedRows):
    """Critic values [R, L], token-aligned like `token_logprobs`: values[t] is the value of the state in which
    token t is chosen (the critic's output at position t - 1)."""
    values = model.apply({"params": params}, rows.tokens, rows.positions, rows.segment_ids)
    return _shift_right(values[:, :-1])


#: The mean |trainer - sampler| log-probability of the action tokens (the old log-probabilities against the
#: rollout engine's): logged by `prepare`, or by the train step when it computes the old log-probabilities.
MISMATCH = "mismatch/sampler_vs_trainer_logprob_abs"


def _sampler_mismatch(old_logprobs, rows: PackedRows):
    """MISMATCH's value over the action tokens of `rows` (any leading axes)."""
    return _mean_on(jnp.abs(old_logprobs - rows.sampler_logprobs), rows.action_mask)


def policy_loss(params, rows: PackedRows, model, alg: ResolvedAlgorithm):
    """(loss, metrics) on one micro-batch; the loss is sum(loss_weights * per-token terms). With
    `alg.old_logprobs_in_step` the old log-probabilities are this forward pass's own (`rows.old_logprobs` unread)
    and the metrics hold the sampler mismatch (MISMATCH)."""
    mask = rows.action_mask  # [R, L]
    token_weights = rows.loss_weights  # [R, L], the recipe's aggregation over the whole mini-batch folded in
    logprobs, entropy = token_logprobs(model, params, rows, temperature=alg.temperature, chunk=alg.logprob_chunk)
    metrics = {}
    old_logprobs = rows.old_logprobs
    if alg.old_logprobs_in_step:  # the parameters prepare would have read: their values, without a gradient
        old_logprobs = jax.lax.stop_gradient(logprobs)
        metrics[MISMATCH] = _sampler_mismatch(old_logprobs, rows)
    pg_weights = token_weights
    if alg.is_cap is not None:
        is_weights, is_metrics = algorithms.truncated_is_weights(
            old_logprobs, rows.sampler_logprobs, mask, cap=alg.is_cap)
        pg_weights = token_weights * is_weights
        metrics.update(is_metrics)
    loss_fn = algorithms.get_policy_loss(alg.recipe.policy_loss)
    # sequence-level losses (GSPO) find the packed trajectories by their segment ids
    extra = {"segment_ids": rows.segment_ids} if "segment_ids" in inspect.signature(loss_fn).parameters else {}
    pg_loss, pg_metrics = loss_fn(
        logprobs, old_logprobs, rows.advantages, mask, clip_eps=alg.clip_eps,
        clip_eps_high=alg.clip_eps_high, dual_clip=alg.dual_clip, weights=pg_weights, **extra)
    metrics.update(pg_metrics)
    metrics["pg_loss"] = loss = pg_loss
    if alg.kl_loss_coef:
        kl = algorithms.kl_penalty(logprobs, rows.ref_logprobs, alg.kl_loss_estimator)  # [R, L]
        metrics["kl_loss"] = algorithms.aggregate_loss(kl, mask, weights=token_weights)
        metrics["kl_ref"] = _mean_on(kl, mask)
        loss = loss + alg.kl_loss_coef * metrics["kl_loss"]
    if alg.entropy_coef:
        loss = loss + algorithms.entropy_bonus(entropy, mask, coef=alg.entropy_coef, weights=token_weights)
    metrics["entropy"] = _mean_on(entropy, mask)
    metrics["logprob_mean"] = _mean_on(logprobs, mask)
    metrics["loss"] = loss
    return loss, metrics


def sft_loss(params, rows: PackedRows, model, chunk=None):
    """Masked cross-entropy on demonstration tokens: -sum(loss_weights * logprob) over action tokens."""
    mask = rows.action_mask
    logprobs, entropy = token_logprobs(model, params, rows, temperature=1.0, chunk=chunk)
    nll = -algorithms.aggregate_loss(logprobs, mask, weights=rows.loss_weights)
    token_acc = _mean_on(jnp.exp(logprobs) > 0.5, mask)  # the demonstrated token is the argmax for sure
    return nll, {"loss": nll, "entropy": _mean_on(entropy, mask), "token_prob_gt_half": token_acc,
                 "logprob_mean": _mean_on(logprobs, mask)}


def critic_loss(params, rows: PackedRows, model, value_clip_eps, value_coef):
    """Clipped value loss, token-mean over the mini-batch's action tokens (`value_weights`)."""
    values = values_of(model, params, rows)
    loss, metrics = algorithms.value_loss(values, rows.old_values, rows.returns, rows.action_mask,
                                          clip_eps=value_clip_eps, weights=rows.value_weights)
    loss = value_coef * loss
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


def accumulate_gradients(loss_fn: Callable, params, micro_batches, trainable=None):
    """Sum of gradients and combined metrics of `loss_fn(params, mb) -> (loss, metrics)` over the leading
    micro-batch axis of `micro_batches` (a lax.scan: memory of one micro-batch). With `trainable` (a predicate
    on parameter paths, e.g. LoRA's adapters) the gradients are taken, and returned, for those leaves only.

    Under a mesh with `data` > 1 and more than one micro-batch, the loop runs in a `shard_map` over `data`: each
    data-parallel group accumulates the gradients of its own rows and they are summed over `data` once, after the
    loop. Left to the partitioner, the accumulator has the parameters' layout (replicated over `data`), so every
    micro-batch's gradients were all-reduced inside the loop: M times the traffic. (The loss is a weighted sum
    over rows, so the sum of the groups' gradients is the batch's.) With one micro-batch the partitioner's
    per-layer reductions stay, which can overlap with the rest of the backward."""
    data = _data_groups(micro_batches)
    if data == 1:
        grads, metrics, total_n = _accumulate(loss_fn, params, micro_batches, trainable)
        return grads, _finish(metrics, total_n)

    def per_group(p, mb):
        grads, metrics, total_n = _accumulate(loss_fn, p, mb, trainable)
        reduce = {k: jax.lax.pmax if k.endswith("_max") else jax.lax.pmin if k.endswith("_min") else jax.lax.psum
                  for k in metrics}
        return (jax.lax.psum(grads, "data"), {k: reduce[k](v, "data") for k, v in metrics.items()},
                jax.lax.psum(total_n, "data"))

    rows = jax.tree.map(lambda _: P(None, "data"), micro_batches)
    # The map is manual over `data` and over every axis of size 1 (which changes nothing else): when the axes
    # left to the partitioner are all of size 1, JAX's custom_partitioning ops (cuDNN attention on a GPU) fail
    # an assertion while partitioning (jax 0.10-0.11: get_num_ways_dim_sharded); fully manual, they lower as
    # plain calls. check_vma=False: the gradient of a parameter replicated over `data` is then each group's own
    # (with it, JAX would sum it over `data` inside every micro-batch, the traffic this avoids).
    mesh = jax.sharding.get_abstract_mesh()
    manual = {"data"} | {name for name, size in mesh.shape.items() if size == 1}
    grads, metrics, total_n = jax.shard_map(per_group, in_specs=(P(), rows), out_specs=P(), axis_names=manual,
                                            check_vma=False)(params, micro_batches)
    return grads, _finish(metrics, total_n)


def _data_groups(micro_batches: PackedRows) -> int:
    """Over how many `data` groups `accumulate_gradients` splits its loop: the active mesh's `data` size when it
    is > 1, there is more than one micro-batch, and every array of the batch is [M, R, ...] with R divisible by it
    (not a vision batch, whose images are not split by rows); else 1. Also 1 where `fsdp` and `tensor` are both
    > 1: there XLA's partitioner (jaxlib 0.11.2) fails a CHECK on the loop mapped by hand over `data` (in
    AllReduceAlongShardingDims), so the partitioner's own reductions in the loop stay."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("data", 1) == 1 or "data" in getattr(mesh, "manual_axes", ()):
        return 1
    if mesh.shape.get("fsdp", 1) > 1 and mesh.shape.get("tensor", 1) > 1:
        return 1
    data = mesh.shape["data"]
    leaves = jax.tree.leaves(micro_batches)
    m, r = micro_batches.tokens.shape[:2]
    if (m == 1 or micro_batches.vision is not None or r % data
            or any(x.ndim < 2 or x.shape[:2] != (m, r) for x in leaves)):
        return 1
    return data


def _accumulate(loss_fn: Callable, params, micro_batches, trainable=None):
    """`accumulate_gradients`' loop on the rows it is given -> (gradient sum, metric accumulators, tokens)."""
    if trainable is not None:
        params, frozen = lora.split_trainable(params, trainable)
        full_loss = loss_fn
        loss_fn = lambda p, b: full_loss(lora.combine(p, frozen), b)  # noqa: E731
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    first = jax.tree.map(lambda x: x[0], micro_batches)
    metric_shapes = jax.eval_shape(lambda p, b: loss_fn(p, b)[1], params, first)

    def body(carry, mb):
        grads_acc, metrics_acc, n_acc = carry
        (_, metrics), grads = grad_fn(params, mb)
        n = jnp.sum(mb.action_mask > 0).astype(jnp.float32)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        return (grads_acc, _combine(metrics_acc, metrics, n), n_acc + n), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    init = (zeros, _init_metrics(metric_shapes), jnp.zeros((), jnp.float32))
    (grads, metrics, total_n), _ = jax.lax.scan(body, init, micro_batches)
    return grads, metrics, total_n


def _apply(ms: ModelState, grads, optimizer: optax.GradientTransformation, trainable=None):
    """One optimiser step; with `trainable`, `grads` and the optimiser state cover those leaves only and the
    rest of the parameters pass through unchanged (norms are of the trained leaves).

    A step whose gradients are not finite (a NaN/inf loss, an overflow) is skipped: parameters and optimiser
    state stay as they were (Adam's moments would otherwise carry the NaN into every later step) and the
    `nonfinite` metric is 1. The trainer counts these and stops a run that keeps producing them. The decision
    depends on the gradients alone (known before the update), so the select stays elementwise with the
    update and XLA can still write the new moments over the donated old ones."""
    trained, frozen = (ms.params, None) if trainable is None else lora.split_trainable(ms.params, trainable)
    fused_step = getattr(optimizer, "fused_step", None)
    if fused_step is not None:  # fused_clip_adamw: the skip and the norms inside its one pass
        new, opt_state, stats = fused_step(grads, ms.opt_state, trained)
        grad_norm, update_norm, param_norm, finite = stats
    else:
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        updates, opt_state = optimizer.update(grads, ms.opt_state, trained)
        new = optax.apply_updates(trained, updates)
        new, opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), (new, opt_state), (trained, ms.opt_state))
        measure = getattr(optimizer, "update_norm", "exact")  # optimizer.update_norm
        if measure == "applied":
            update_norm = optax.tree.norm(jax.tree.map(lambda n, o: n.astype(jnp.float32) - o.astype(jnp.float32),
                                                       new, trained))
        else:
            update_norm = optax.tree.norm(updates) if measure == "exact" else None
        param_norm = optax.tree.norm(trained)
    metrics = {"grad_norm": grad_norm, "param_norm": param_norm, "nonfinite": 1.0 - finite.astype(jnp.float32)}
    if update_norm is not None:  # optimizer.update_norm="off": not computed, not logged
        metrics["update_norm"] = update_norm
    return ModelState(params=new if frozen is None else lora.combine(new, frozen), opt_state=opt_state), metrics


# ------------------------------------------------------------------------------------------------- prepare
def _per_micro_batch(fn, params, rows: PackedRows):
    """fn(params, rows [R, L]) -> [R, L], applied to every micro-batch of rows [K, M, R, L] one at a time
    (memory of one micro-batch)."""
    k, m = rows.tokens.shape[:2]
    flat = jax.tree.map(lambda x: x.reshape(k * m, *x.shape[2:]), rows)
    out = jax.lax.map(lambda mb: fn(params, mb), flat)  # [K*M, R, L]
    return out.reshape(rows.tokens.shape)


def _unpack(packed, batch: UpdateBatch):
    """Packed [K, M, R, L] -> trajectory view [N, T] (0 past each trajectory's end)."""
    index = batch.unpack_index
    return jnp.where(index >= 0, packed.reshape(-1)[jnp.maximum(index, 0)], 0).astype(packed.dtype)


def _pack(per_trajectory, batch: UpdateBatch):
    """Trajectory view [N, T] -> packed [K, M, R, L] (0 on padding)."""
    flat = jnp.concatenate([per_trajectory.reshape(-1), jnp.zeros((1,), per_trajectory.dtype)])
    return flat[batch.pack_index]


def _traced_counting(fn, traces, name: str):
    """`fn`, counting in `traces[name]` each time jit traces it: once per new input shape (a compile, or a load
    from the persistent compilation cache). `traces` None: `fn` itself."""
    if traces is None:
        return fn

    @functools.wraps(fn)
    def counted(*args):
        traces[name] += 1
        return fn(*args)

    return counted


def make_prepare_fn(policy_model, alg: ResolvedAlgorithm, *, critic_model=None, gpu_gemm="cublas", traces=None):
    """Jitted `prepare(state, batch) -> (batch, metrics)`: fills the rows' old logprobs (the policy before this
    update), reference logprobs (with a KL knob), old values (with a critic), advantages and returns (the
    recipe's estimator on the trajectory view), and loss weights (the recipe's aggregation over each
    mini-batch), all on the device in one pass; `gpu_gemm`: `models.config.gpu_compiler_options`; `traces`: a
    collections.Counter whose "prepare" counts the programs traced (see `_traced_counting`)."""
    recipe = alg.recipe

    def logprob_fn(params, rows):
        return token_logprobs(policy_model, params, rows, temperature=alg.temperature, chunk=alg.logprob_chunk)[0]

    def prepare(state: TrainState, batch: UpdateBatch):
        rows = batch.rows
        # the train step computes them itself (one optimiser step: its parameters are the ones read here)
        old = None if alg.old_logprobs_in_step else _per_micro_batch(logprob_fn, state.policy.params, rows)
        ref = _per_micro_batch(logprob_fn, state.ref_params, rows) if alg.needs_reference else None
        mask = _unpack(rows.action_mask, batch)  # [N, T]
        values = None
        if critic_model is not None:
            packed_values = _per_micro_batch(lambda p, r: values_of(critic_model, p, r), state.critic.params, rows)
            values = _unpack(packed_values, batch) * mask
        token_kl = None
        estimator_kwargs = dict(alg.estimator_kwargs)
        if recipe.kl_in_reward:
            estimator_kwargs["kl_coef"] = alg.kl_in_reward_coef
            if alg.kl_in_reward_coef:  # never with old_logprobs_in_step (config.resolved_algorithm)
                token_kl = algorithms.kl_penalty(_unpack(old, batch), _unpack(ref, batch),
                                                 alg.kl_in_reward_estimator)
        advantages, returns = algorithms.compute_advantages(
            recipe.estimator, rewards=batch.rewards, group_ids=batch.group_ids, action_mask=mask, values=values,
            token_kl=token_kl, **estimator_kwargs)
        k = rows.tokens.shape[0]  # mini-batches: a static shape under jit
        weights = algorithms.aggregation_weights(mask, alg.aggregation, norm_len=alg.norm_len,
                                                 groups=batch.minibatch, num_groups=k)
        filled = rows.replace(old_logprobs=old, ref_logprobs=ref, advantages=_pack(advantages, batch),
                              loss_weights=_pack(weights, batch))
        if critic_model is not None:
            value_weights = algorithms.aggregation_weights(mask, "token-mean", groups=batch.minibatch, num_groups=k)
            filled = filled.replace(old_values=_pack(values, batch), returns=_pack(returns, batch),
                                    value_weights=_pack(value_weights, batch))
        on = mask > 0
        count = jnp.maximum(jnp.sum(on), 1)
        adv_mean = jnp.sum(jnp.where(on, advantages, 0.0)) / count
        metrics = {
            "advantages/mean": adv_mean,
            "advantages/std": jnp.sqrt(jnp.sum(jnp.where(on, (advantages - adv_mean) ** 2, 0.0)) / count),
        }
        if old is not None:
            metrics[MISMATCH] = _sampler_mismatch(old, rows)
        return batch.replace(rows=filled), metrics

    return jax.jit(_traced_counting(prepare, traces, "prepare"), compiler_options=gpu_compiler_options(gpu_gemm))


# ---------------------------------------------------------------------------------------------- the steps
def make_train_step(policy_model, alg: ResolvedAlgorithm, policy_opt: optax.GradientTransformation, *,
                    critic_model=None, critic_opt=None, value_clip_eps=0.2, value_coef=1.0, lr_schedule=None,
                    state_sharding=None, trainable=None, gpu_gemm="cublas", traces=None):
    """Returns jitted `train_step(state, rows) -> (state, metrics)` on one mini-batch of prepared PackedRows
    [M, R, L]. The state is donated; with `state_sharding` the new state keeps that sharding. `trainable`
    (e.g. `lora.is_adapter`) trains only those policy parameters; `gpu_gemm`: `models.config.gpu_compiler_options`;
    `traces`: a collections.Counter whose "train_step" counts the programs traced (`_traced_counting`)."""

    def train_step(state: TrainState, micro_batches: PackedRows):
        metrics = {}
        grads, policy_metrics = accumulate_gradients(
            lambda p, b: policy_loss(p, b, policy_model, alg), state.policy.params, micro_batches, trainable)
        policy, opt_metrics = _apply(state.policy, grads, policy_opt, trainable)
        mismatch = {MISMATCH: policy_metrics.pop(MISMATCH)} if MISMATCH in policy_metrics else {}
        metrics.update({f"policy/{k}": v for k, v in {**policy_metrics, **opt_metrics}.items()}, **mismatch)
        if lr_schedule is not None:
            metrics["policy/learning_rate"] = lr_schedule(state.step)
        critic = state.critic
        if critic is not None:
            grads, critic_metrics = accumulate_gradients(
                lambda p, b: critic_loss(p, b, critic_model, value_clip_eps, value_coef), critic.params,
                micro_batches)
            critic, opt_metrics = _apply(critic, grads, critic_opt)
            metrics.update({f"critic/{k}": v for k, v in {**critic_metrics, **opt_metrics}.items()})
        # a skipped (non-finite) policy update does not advance the step: it stays the optimiser's count, so
        # the logged learning rate is the one its schedule applies
        taken = (1.0 - metrics["policy/nonfinite"]).astype(state.step.dtype)
        new_state = state.replace(step=state.step + taken, policy=policy, critic=critic)
        return new_state, metrics

    out_shardings = None if state_sharding is None else (state_sharding, None)
    return jax.jit(_traced_counting(train_step, traces, "train_step"), donate_argnums=0,
                   out_shardings=out_shardings, compiler_options=gpu_compiler_options(gpu_gemm))


def make_sft_step(model, optimizer: optax.GradientTransformation, *, logprob_chunk=None, lr_schedule=None,
                  state_sharding=None, trainable=None, gpu_gemm="cublas", traces=None):
    """Jitted `sft_step(state, rows [M, R, L]) -> (state, metrics)`: supervised fine-tuning on the same packed,
    action-masked rows as RL, token-mean over the mini-batch (only the policy is trained; with `trainable`,
    only those of its parameters; `gpu_gemm`: `models.config.gpu_compiler_options`; `traces`: a Counter whose
    "sft_step" counts the programs traced)."""

    def sft_step(state: TrainState, micro_batches: PackedRows):
        mask = micro_batches.action_mask
        weights = algorithms.aggregation_weights(mask.reshape(-1, mask.shape[-1]), "token-mean").reshape(mask.shape)
        micro_batches = micro_batches.replace(loss_weights=weights)
        grads, metrics = accumulate_gradients(lambda p, b: sft_loss(p, b, model, logprob_chunk),
                                              state.policy.params, micro_batches, trainable)
        policy, opt_metrics = _apply(state.policy, grads, optimizer, trainable)
        out = {f"sft/{k}": v for k, v in {**metrics, **opt_metrics}.items()}
        if lr_schedule is not None:
            out["sft/learning_rate"] = lr_schedule(state.step)
        return state.replace(step=state.step + (1.0 - out["sft/nonfinite"]).astype(state.step.dtype), policy=policy), out

    out_shardings = None if state_sharding is None else (state_sharding, None)
    return jax.jit(_traced_counting(sft_step, traces, "sft_step"), donate_argnums=0,
                   out_shardings=out_shardings, compiler_options=gpu_compiler_options(gpu_gemm))


def take_minibatch(rows: PackedRows, k: int) -> PackedRows:
    """Mini-batch k of rows [K, M, R, L], on the device."""
    return jax.tree.map(lambda x: x[k], rows)
