"""Global-norm clipping + AdamW in one elementwise pass over parameter groups (`optimizer.fused`).

`optax.chain(clip_by_global_norm, adamw)` works leaf by leaf: a model of L layers has ~12 L parameter leaves,
and the update runs a norm reduction per leaf, a clip, the two moments, bias correction, weight decay and the
learning rate as separate tree maps, and the trainer's metrics (gradient, update and parameter norms) add three
more reductions per leaf. `fused_clip_adamw` computes the same AdamW step with:

- leaves grouped by role, shape, dtype and weight-decay flag, so the k copies of one layer role (every layer's
  `mlp/gate_proj/kernel`, ...) are stacked into one [k, ...] array (a Qwen2.5-0.5B policy: 14 groups instead of
  290 leaves). The Adam moments are *kept* stacked in the optimiser state, so only gradients and parameters are
  stacked per step and only the new parameters are split back. Leaves of one role have the same logical axes
  and so the same sharding: stacking adds an unsharded leading axis and moves no data between devices (a flat
  concatenation of differently sharded leaves would need all-gathers). Stacking and splitting are copies unless
  the compiler fuses them into the pass, so `stack_max_size` limits it to small leaves (biases, norms, small
  k/v kernels: many tiny kernels, launch-bound) and leaves the large ones, which are bandwidth-bound, per leaf;
- one fp32 reduction for the global gradient norm, then one elementwise pass per group that reads gradient,
  parameter and both moments once and writes the new parameter and moments, with the non-finite skip inside and
  the parameter norm a reduction of the same inputs (`fused_step`, which the trainer's `_apply` uses); the
  logged update norm (`update_norm`) is a reduction XLA keeps apart, so its cheapest form is the default;
- fp32 arithmetic inside the pass whatever the storage dtype (moments are stored in the parameters' dtype, as
  optax does), so bf16 parameters get one rounding per step instead of one per operation.

In fp32 the step equals optax's `chain(clip_by_global_norm(c), adamw(schedule, b1, b2, eps, weight_decay,
mask=mask))` up to the summation order of the global norm (tests/trainer/test_fused_adamw.py).
`optax.GradientTransformation` API: `init(params)`, `update(grads, state, params) -> (updates, state)`; the
state is a pytree of arrays (orbax saves it like any other).
"""
from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P


class FusedAdamWState(NamedTuple):
    """`count`: steps taken (int32, the schedule's step); `mu`, `nu`: one array per group, in the group order
    of `plan`: [k, *leaf shape] for a stacked group of k leaves, the leaf's own shape for a group of one."""

    count: jax.Array
    mu: tuple
    nu: tuple


class FusedStats(NamedTuple):
    grad_norm: jax.Array  # of the gradients before clipping (fp32)
    update_norm: jax.Array | None  # of the step's update, as `update_norm` says (None: "off"; NaN when the
    # gradients were not finite and it is "exact"; 0 then with "applied", as nothing changed)
    param_norm: jax.Array  # of the parameters before the step
    finite: jax.Array  # bool: the step was taken (non-finite gradients leave parameters and state unchanged)


class Group(NamedTuple):
    leaves: tuple[int, ...]  # indices into the flattened parameter tree, in tree order
    decay: bool  # weight decay applies to these leaves


class FusedClipAdamW(optax.GradientTransformation):
    """An `optax.GradientTransformation` with two more attributes the trainer uses:
    `fused_step(grads, state, params) -> (new_params, new_state, FusedStats)` (the step with the non-finite skip and
    the metrics' norms inside the pass) and `state_shardings(params, param_shardings, replicated)` (the state's
    sharding tree; `optax.tree_map_params` cannot map parameter shardings onto stacked moments)."""


_LAYER_INDEX = re.compile(r"_\d+$")


def _role(path) -> str:
    """A leaf's path with its layer index taken out: ('model', 'layers_3', 'mlp', ...) -> 'model/layers_#/mlp/...'
    (list positions too), so the same parameter of every layer has the same role."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.SequenceKey):
            parts.append("#")
        elif isinstance(key, jax.tree_util.DictKey):
            parts.append(_LAYER_INDEX.sub("_#", str(key.key)))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(_LAYER_INDEX.sub("_#", key.name))
        else:
            parts.append(str(key))
    return "/".join(parts)


def _decay_flags(params, mask, n: int) -> list[bool]:
    """Per flattened leaf: does weight decay apply? `mask` as in optax: None (all leaves), a tree of bools with
    the params' structure or a prefix of it, or a callable params -> such a tree."""
    if mask is None:
        return [True] * n
    tree = mask(params) if callable(mask) else mask
    try:
        flags = jax.tree.leaves(jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), tree, params))
    except ValueError as err:
        raise ValueError(f"weight-decay mask does not match the parameter tree (nor a prefix of it): {err}") from None
    if len(flags) != n or not all(isinstance(f, bool) for f in flags):
        raise ValueError("weight-decay mask leaves must be Python bools (True: decay the leaf)")
    return flags


def plan(params, mask=None, stack_max_size: int | None = None) -> tuple[Any, tuple[Group, ...]]:
    """(treedef, groups) of a parameter tree (arrays, tracers or ShapeDtypeStructs): leaves of at most
    `stack_max_size` values (None: any size; 0: none) with the same role, shape, dtype and decay flag form a group;
    every other leaf is a group of its own. Deterministic in the tree's paths, shapes and dtypes, so `init`,
    `update` and `state_shardings` agree."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    flags = _decay_flags(params, mask, len(flat))
    buckets: dict[tuple, list[int]] = {}
    for i, (path, x) in enumerate(flat):
        stack = stack_max_size is None or math.prod(x.shape) <= stack_max_size
        key = (_role(path) if stack else i, tuple(x.shape), jnp.dtype(x.dtype), flags[i])
        buckets.setdefault(key, []).append(i)
    return treedef, tuple(Group(tuple(idx), key[3]) for key, idx in buckets.items())


def _stack(xs: list) -> jax.Array:
    return xs[0] if len(xs) == 1 else jnp.stack(xs)


def _unstack(x: jax.Array, k: int) -> list:
    return [x] if k == 1 else [x[j] for j in range(k)]


def _sq(x) -> jax.Array:
    x = x.astype(jnp.float32)
    return jnp.sum(x * x)


#: what the logged update norm measures (`fused_clip_adamw(update_norm=...)`, `optimizer.update_norm`)
UPDATE_NORMS = ("applied", "exact", "off")


def fused_clip_adamw(learning_rate: float | optax.Schedule, *, b1: float = 0.9, b2: float = 0.999,
                     eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float | None = None,
                     mask=None, stack_max_size: int | None = None, update_norm: str = "applied") -> FusedClipAdamW:
    """Global-norm clipping (`max_grad_norm`; None or <= 0: none) followed by AdamW with bias correction,
    decoupled weight decay (`weight_decay` x param, on the leaves `mask` selects, optax's mask semantics) and
    `learning_rate` (a number or an optax schedule of the step count), as one `FusedClipAdamW`. Same-role leaves
    of at most `stack_max_size` values (None: all, 0: none) are stacked across layers (`plan`).

    update_norm: what `FusedStats.update_norm` measures: "applied" the change of the stored parameters (new - old,
    after rounding to their dtype; in fp32 the update itself up to rounding, in bf16 what the step changed),
    "exact" the fp32 update before rounding (optax's `tree.norm(updates)`), "off" nothing (None). XLA does not
    fuse the reduction into the pass, so it costs a pass of its own: on an H200 at the Qwen2.5-3B shape in bf16
    the step alone took 31.0 ms "exact", 25.6 "applied" and 20.4 "off" (docs/benchmarks.md). Without params
    (`update(grads, state)`), "applied" reduces the update ("exact")."""
    if update_norm not in UPDATE_NORMS:
        raise ValueError(f"update_norm must be one of {UPDATE_NORMS}, got {update_norm!r}")
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"b1 and b2 must be in [0, 1), got b1={b1}, b2={b2}")
    if eps <= 0 or weight_decay < 0:
        raise ValueError(f"need eps > 0 and weight_decay >= 0, got eps={eps}, weight_decay={weight_decay}")
    clip = max_grad_norm is not None and max_grad_norm > 0

    def init(params) -> FusedAdamWState:
        treedef, groups = plan(params, mask, stack_max_size)
        leaves = treedef.flatten_up_to(params)

        def zeros(g: Group):
            x = leaves[g.leaves[0]]
            shape = tuple(x.shape) if len(g.leaves) == 1 else (len(g.leaves), *x.shape)
            return jnp.zeros(shape, x.dtype)

        return FusedAdamWState(count=jnp.zeros([], jnp.int32), mu=tuple(map(zeros, groups)),
                               nu=tuple(map(zeros, groups)))

    def _step(grads, state: FusedAdamWState, params, skip_nonfinite: bool):
        """-> (per-leaf updates, per-leaf new params or None, new state, stats); with `skip_nonfinite` the new
        state and params are the old ones when the gradients are not finite."""
        treedef, groups = plan(grads, mask, stack_max_size)
        if len(state.mu) != len(groups):
            raise ValueError(f"optimiser state has {len(state.mu)} groups, the gradients make {len(groups)}: "
                             "the state was made for another parameter tree")
        g_leaves = treedef.flatten_up_to(grads)
        p_leaves = None if params is None else treedef.flatten_up_to(params)
        if p_leaves is None and weight_decay > 0 and any(g.decay for g in groups):
            raise ValueError("fused_clip_adamw with weight decay needs the params: update(grads, state, params)")
        grads_g = [_stack([g_leaves[i] for i in g.leaves]) for g in groups]
        g_norm = jnp.sqrt(sum(_sq(x) for x in grads_g))
        finite = jnp.isfinite(g_norm)
        keep = (lambda new, old: jnp.where(finite, new, old)) if skip_nonfinite else (lambda new, old: new)
        trigger = g_norm < max_grad_norm if clip else None
        count = optax.safe_increment(state.count)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        bc1, bc2 = 1 - b1 ** count, 1 - b2 ** count  # fp32, as optax's bias correction
        updates = [None] * len(g_leaves)
        new_params = None if p_leaves is None else [None] * len(g_leaves)
        mus, nus, u_sq, p_sq = [], [], [], []
        for g_idx, group, grad in zip(range(len(groups)), groups, grads_g):
            mu0, nu0 = state.mu[g_idx], state.nu[g_idx]
            g = grad.astype(jnp.float32)
            if clip:  # optax's clip_by_global_norm, elementwise
                g = jnp.where(trigger, g, (g / g_norm) * max_grad_norm)
            mu = (1 - b1) * g + b1 * mu0.astype(jnp.float32)
            nu = (1 - b2) * (g * g) + b2 * nu0.astype(jnp.float32)
            u = (mu / bc1) / (jnp.sqrt(nu / bc2) + eps)
            param = None
            if p_leaves is not None:
                param = _stack([p_leaves[i] for i in group.leaves])
                p_sq.append(_sq(param))
            if group.decay and weight_decay > 0:
                u = u + weight_decay * param.astype(jnp.float32)
            u = (-lr) * u
            if update_norm == "exact" or (update_norm == "applied" and param is None):
                u_sq.append(_sq(u))
            mus.append(keep(mu.astype(mu0.dtype), mu0))
            nus.append(keep(nu.astype(nu0.dtype), nu0))
            out_dtype = grad.dtype if param is None else param.dtype
            for i, x in zip(group.leaves, _unstack(u.astype(out_dtype), len(group.leaves))):
                updates[i] = x
            if param is not None:
                new = keep((param.astype(jnp.float32) + u).astype(param.dtype), param)
                if update_norm == "applied":
                    u_sq.append(_sq(new.astype(jnp.float32) - param.astype(jnp.float32)))
                for i, x in zip(group.leaves, _unstack(new, len(group.leaves))):
                    new_params[i] = x
        new_state = FusedAdamWState(count=keep(count, state.count), mu=tuple(mus), nu=tuple(nus))
        stats = FusedStats(grad_norm=g_norm, update_norm=jnp.sqrt(sum(u_sq)) if update_norm != "off" else None,
                           param_norm=jnp.sqrt(sum(p_sq)) if p_sq else jnp.float32(jnp.nan), finite=finite)
        unflat = lambda xs: None if xs is None else jax.tree.unflatten(treedef, xs)  # noqa: E731
        return unflat(updates), unflat(new_params), new_state, stats

    def update(grads, state: FusedAdamWState, params=None):
        """optax's contract: the updates to add to the params. Unlike `fused_step`, a non-finite step is not
        skipped here (the trainer's `_apply` uses `fused_step`)."""
        updates, _, new_state, _ = _step(grads, state, params, skip_nonfinite=False)
        return updates, new_state

    def fused_step(grads, state: FusedAdamWState, params):
        """-> (new params, new state, FusedStats): the whole step, skipped (params and state unchanged) when
        the gradients are not finite."""
        if params is None:
            raise ValueError("fused_step needs the params")
        _, new_params, new_state, stats = _step(grads, state, params, skip_nonfinite=True)
        return new_params, new_state, stats

    def state_shardings(params, param_shardings, replicated) -> FusedAdamWState:
        """The state's sharding tree from the params' (arrays or ShapeDtypeStructs) and their shardings: a
        stacked group's moments are sharded like its leaves, with the stacking axis unsharded."""
        treedef, groups = plan(params, mask, stack_max_size)
        shardings = treedef.flatten_up_to(param_shardings)
        leaves = treedef.flatten_up_to(params)
        out = []
        for g in groups:
            first = shardings[g.leaves[0]]
            ndim = len(leaves[g.leaves[0]].shape)
            for i in g.leaves[1:]:
                if not shardings[i].is_equivalent_to(first, ndim):
                    raise ValueError(
                        f"fused optimiser: leaves {jax.tree_util.keystr(_path(params, g.leaves[0]))} and "
                        f"{jax.tree_util.keystr(_path(params, i))} share a role and shape but not a sharding "
                        f"({first} vs {shardings[i]}); stacking them would move data between devices. Set "
                        "optimizer.fused='per_leaf' or 'off'.")
            if len(g.leaves) == 1:
                out.append(first)
            elif isinstance(first, NamedSharding):
                out.append(NamedSharding(first.mesh, P(None, *first.spec), memory_kind=first.memory_kind))
            elif first.is_fully_replicated:
                out.append(first)  # one device or replicated: the same sharding fits the stacked shape
            else:
                raise ValueError(f"fused optimiser: cannot stack leaves with sharding {first!r} (not a NamedSharding)")
        return FusedAdamWState(count=replicated, mu=tuple(out), nu=tuple(out))

    opt = FusedClipAdamW(init, update)
    opt.fused_step = fused_step
    opt.state_shardings = state_shardings
    return opt


def _path(tree, index: int):
    return jax.tree_util.tree_flatten_with_path(tree)[0][index][0]
