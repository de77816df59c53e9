"""LoRA: rank-r adapters beside the decoder's projection kernels, trained with the base frozen.

A model whose `ModelConfig.lora_rank` is r > 0 has, next to the `kernel` of every projection named in
`lora_targets` (q/k/v/o and the MLP's gate/up/down by default), two parameters `lora_a` (input side, rank last)
and `lora_b` (rank first, output side), and computes y = x W + (alpha / r) * (x A) B. B starts at zero, so a
fresh adapter leaves the model's outputs unchanged; A starts uniform in +-1/sqrt(fan_in).

Everything here is pure: `merge_lora` folds the adapters into the kernels (a plain HF-shaped parameter tree for
a `lora_rank=0` model: what weight sync sends and export writes), `split_trainable`/`combine` separate the
adapter leaves (what the optimiser sees) from the frozen rest.

Written here rather than taken from a library (qwix): the projections are explicit einsums whose parameters
carry logical axis names, so adapters declared in the same modules are sharded by the same rules (a `lora` axis,
replicated), and merging into the HF kernels is one einsum per projection; an op-intercepting library creates
its adapters outside that naming and offers no merge for export or weight sync.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

#: The projections that get adapters by default (all of them: attention and MLP).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_NAMES = ("lora_a", "lora_b")


def is_adapter(path: tuple) -> bool:
    """Whether the parameter at `path` (a tuple of keys) is a LoRA adapter."""
    return bool(path) and str(path[-1]) in ADAPTER_NAMES


def has_adapters(params) -> bool:
    return any(is_adapter(p) for p in traverse_util.flatten_dict(params))


def split_trainable(params, trainable: Callable[[tuple], bool] = is_adapter):
    """params -> (trainable subtree, frozen subtree): nested dicts holding only their own leaves."""
    flat = traverse_util.flatten_dict(params)
    chosen = {p: v for p, v in flat.items() if trainable(p)}
    rest = {p: v for p, v in flat.items() if not trainable(p)}
    return traverse_util.unflatten_dict(chosen), traverse_util.unflatten_dict(rest)


def combine(trainable, frozen):
    """The inverse of `split_trainable`: one tree with the leaves of both."""
    flat = traverse_util.flatten_dict(frozen)
    flat.update(traverse_util.flatten_dict(trainable))
    return traverse_util.unflatten_dict(flat)


def merged_kernel(kernel, lora_a, lora_b, scale):
    """kernel + scale * A B in the kernel's layout: [E, N, D] (q/k/v: A [E, r], B [r, N, D]), [H, D, E]
    (o: A [H, D, r], B [r, E]) or [in, out] (MLP: A [in, r], B [r, out]); computed in fp32."""
    a, b = lora_a.astype(jnp.float32), lora_b.astype(jnp.float32)
    delta = jnp.tensordot(a, b, axes=1)  # contracts A's last (rank) axis with B's first
    if delta.shape != kernel.shape:
        raise ValueError(f"LoRA adapter shapes {lora_a.shape} x {lora_b.shape} do not make the kernel's "
                         f"{kernel.shape}")
    return (kernel.astype(jnp.float32) + scale * delta).astype(kernel.dtype)


def merge_lora(params, scale: float):
    """The parameter tree with every adapter folded into its kernel and removed (`scale` = alpha / rank): the
    parameters of the same model with `lora_rank=0`. A tree without adapters is returned unchanged."""
    if not has_adapters(params):
        return params

    def walk(node):
        if not isinstance(node, Mapping):
            return node
        if "lora_a" in node and "lora_b" in node:
            out = {k: v for k, v in node.items() if k not in ADAPTER_NAMES}
            out["kernel"] = merged_kernel(node["kernel"], node["lora_a"], node["lora_b"], scale)
            return out
        return {k: walk(v) for k, v in node.items()}

    return walk(params)


def init_adapters(shapes, rng, dtype=jnp.float32):
    """Fresh adapter values for the adapter leaves of `shapes` (a tree of ShapeDtypeStructs, e.g. from
    `jax.eval_shape` of a LoRA model's init): A uniform in +-1/sqrt(fan_in), B zeros."""
    flat = {p: s for p, s in traverse_util.flatten_dict(shapes).items() if is_adapter(p)}
    out = {}
    for i, (path, shape) in enumerate(sorted(flat.items(), key=lambda kv: tuple(map(str, kv[0])))):
        if path[-1] == "lora_b":
            out[path] = jnp.zeros(shape.shape, dtype)
        else:
            fan_in = math.prod(shape.shape[:-1])
            bound = 1.0 / math.sqrt(fan_in)
            out[path] = jax.random.uniform(jax.random.fold_in(rng, i), shape.shape, dtype, -bound, bound)
    return traverse_util.unflatten_dict(out)


def adapter_count(params) -> int:
    """Number of adapter values in `params`."""
    return sum(int(v.size) for p, v in traverse_util.flatten_dict(params).items() if is_adapter(p))


def lora_init_fn(model) -> Callable[[Any, Any], Any]:
    """`add(params, rng) -> params`: a base model's parameters plus fresh adapters for `model` (a LoRA model
    of the same shapes), without materialising another copy of the base."""
    from agentfly_jax.models.transformer import init_params_shapes

    shapes = init_params_shapes(model)

    def add(params, rng):
        return combine(init_adapters(shapes, rng, model.config.param_dtype), params)

    return add
