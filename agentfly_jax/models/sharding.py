"""Logical axis names -> mesh axes (data, fsdp, tensor).

Rules are data, normally taken from the experiment config (`config.mesh`, `config.sharding_rules`); the
defaults below give FSDP over `fsdp` and Megatron-style tensor parallelism over `tensor`, with the batch
split over `data` x `fsdp`. A dimension that a mesh axis does not divide is replicated along it (e.g. 14 heads
on tensor=4) rather than failing.

Activations follow the same rules through `constrain` (the model's `_constrain`), with the same divisibility
test as the parameters: an activation is only ever asked for a layout that the weights it meets agree with.
Where the two disagree (say q heads split 4 ways but their weights replicated), the SPMD partitioner must
reshard between them, and for some pairs of layouts it can only do so by replicating the whole tensor first
(XLA's "involuntary full rematerialization").

Where the query heads do not split over the mesh axes of `act_heads` (14 heads on tensor=4), attention's rows
take the name `act_attn_batch` (rule sets without it fall back to `act_batch`), by default split over `tensor`
as well: every tensor-parallel device then runs attention with whole heads on its share of the rows, instead of
every device computing all of it (the weights of q/k/v/o are replicated over `tensor` by the divisibility test).

The residual stream between sublayers (embeddings, norms, residual adds) has its rows named `act_residual_batch`
(the same fallback). By default it is the batch's layout; mapped to ("data", "fsdp", "tensor") each tensor-parallel
device keeps 1/tensor of the rows there (Megatron's sequence parallelism, over rows instead of positions): the
norms and adds run on that share, a sublayer's input is all-gathered and its output reduce-scattered where
tensor parallelism otherwise all-reduces, and the gradients take the conjugate collectives (the model's
`_reshard`).

The rows of the tensor-parallel GEMMs' input (q/k/v and gate/up; o_proj's and down_proj's output gradient) are
named `act_gemm_batch` (the same fallback), by default the batch's layout: under sequence parallelism that input is
gathered over `tensor` by a collective of its own before the GEMM. Mapped like the residual, ("data", "fsdp",
"tensor"), the input is left on the residual's rows and the partitioner gathers it as part of partitioning the
GEMM, which is where XLA can overlap the two (a windowed einsum, `--xla_gpu_threshold_for_windowed_einsum_mib`).
"""
from __future__ import annotations

import logging
import math
from typing import Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("value_out", None),
    ("lora", None),  # LoRA adapters' rank axis: small, replicated
    # activations
    ("act_batch", ("data", "fsdp")),
    ("act_attn_batch", ("data", "fsdp", "tensor")),
    ("act_residual_batch", ("data", "fsdp")),  # ("data", "fsdp", "tensor"): sequence parallelism over rows
    ("act_gemm_batch", ("data", "fsdp")),  # with the above, ("data", "fsdp", "tensor"): gathers inside the GEMMs
    ("act_length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def override_rules(overrides, base=DEFAULT_RULES) -> tuple:
    """`base` with each (name, mesh axes) of `overrides` replacing that name's rule: an experiment states only the
    rules it changes, e.g. (("act_residual_batch", ("data", "fsdp", "tensor")),) for sequence parallelism; a name
    left out keeps its rule. Mesh axes: None (replicated), one of MESH_AXES or a sequence of distinct ones. A name
    that `base` does not have (a typo would otherwise change nothing), axes that are not mesh axes or repeat one,
    and anything not a pair are ValueErrors naming the rule."""
    out = {name: axes for name, axes in base}
    for rule in overrides:
        if not isinstance(rule, (list, tuple)) or len(rule) != 2 or not isinstance(rule[0], str):
            raise ValueError(f"sharding rule {rule!r}: expected (logical name, mesh axes), e.g. "
                             f"('act_residual_batch', ('data', 'fsdp', 'tensor'))")
        name, axes = rule
        if name not in out:
            raise ValueError(f"sharding rule {name!r}: no such logical name; the rules name "
                             f"{', '.join(sorted(out))}")
        axes = tuple(axes) if isinstance(axes, (list, tuple)) else axes
        names = (axes,) if isinstance(axes, str) else () if axes is None else axes
        if not isinstance(names, tuple) or any(a not in MESH_AXES for a in names) or len(set(names)) < len(names):
            raise ValueError(f"sharding rule {name!r}: mesh axes {axes!r} not understood; give None, one of "
                             f"{MESH_AXES} or a sequence of distinct ones")
        out[name] = axes[0] if isinstance(axes, tuple) and len(axes) == 1 else axes or None
    return tuple(out.items())


def make_mesh(axis_sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with axes data/fsdp/tensor; one size may be -1 (= the rest)."""
    devices = list(devices if devices is not None else jax.devices())
    unknown = set(axis_sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; expected a subset of {MESH_AXES}")
    sizes = [int(axis_sizes.get(a, 1)) for a in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    if any(s < 1 and s != -1 for s in sizes):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))}: axis sizes are >= 1, or -1 for every remaining device")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if len(devices) % known:
            given = {a: s for a, s in zip(MESH_AXES, sizes) if s != -1}
            raise ValueError(f"mesh {given} (and {MESH_AXES[sizes.index(-1)]}=-1, the rest) needs a multiple of "
                             f"{known} devices but {len(devices)} are available; make the axis sizes divide the "
                             "device count")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices but "
                         f"{len(devices)} are available; make the axis sizes multiply to the device count")
    grid = np.asarray(devices).reshape(sizes)
    # Auto axis types: jax >= 0.10 defaults to Explicit, under which GSPMD-style propagation is disabled.
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def axis_rules(rules=DEFAULT_RULES):
    """Context manager that activates the logical->mesh rules for activation constraints during tracing."""
    return nn.logical_axis_rules(tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rules))


def _mesh_axes_for(logical: str | None, rules) -> tuple[str, ...]:
    for name, target in rules:
        if name == logical:
            if target is None:
                return ()
            return (target,) if isinstance(target, str) else tuple(target)
    return ()


def spec_for_shape(logical_spec: P, shape: Sequence[int], mesh: Mesh, rules=DEFAULT_RULES) -> P:
    """Mesh PartitionSpec for one array: maps its logical names, dropping mesh axes that do not divide it and, inside
    a `shard_map`, the axes it maps by hand (each of its bodies sees one shard along them)."""
    out, taken = [], set(getattr(mesh, "manual_axes", ()))
    for dim, logical in zip(shape, tuple(logical_spec) + (None,) * (len(shape) - len(logical_spec))):
        axes = [a for a in _mesh_axes_for(logical, rules) if a not in taken and mesh.shape.get(a, 1) > 1]
        kept = []
        for a in axes:
            if dim % (math.prod(mesh.shape[x] for x in kept) * mesh.shape[a]) == 0:
                kept.append(a)
            else:
                log.debug("replicating dim %d (%s) along mesh axis %r: not divisible", dim, logical, a)
        taken.update(kept)
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return P(*out)


def constrain(x, names: Sequence[str | None]):
    """`x` pinned to the layout that the active logical axis rules (`axis_rules`) give `names` on the active mesh
    (`jax.set_mesh`), mesh axes that do not divide a dimension dropped as for parameters; `x` itself unless both
    are active."""
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec_for_shape(P(*names), x.shape, mesh, rules))


def active_shards(logical: str, size: int) -> int:
    """Into how many pieces the active rules and mesh cut a dimension of `size` named `logical` (1 without)."""
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return 1
    axes = spec_for_shape(P(logical), (size,), mesh, rules)[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def fully_split(logical: str, size: int) -> bool:
    """Whether every active mesh axis that the active rules give `logical` divides `size` (True without rules
    or a mesh): e.g. False for 14 heads under ("act_heads", "tensor") on tensor=4."""
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return True
    manual = set(getattr(mesh, "manual_axes", ()))
    wanted = math.prod(mesh.shape[a] for a in _mesh_axes_for(logical, rules)
                       if mesh.shape.get(a, 1) > 1 and a not in manual)
    return active_shards(logical, size) == wanted


def rows_beyond_batch(logical: str) -> bool:
    """Whether the active rules split the rows named `logical` over an active mesh axis (size > 1) that
    `act_batch` does not use: e.g. `act_gemm_batch` over tensor under sequence parallelism."""
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return False
    extra = set(_mesh_axes_for(logical, rules)) - set(_mesh_axes_for("act_batch", rules))
    return any(mesh.shape.get(a, 1) > 1 and a not in getattr(mesh, "manual_axes", ()) for a in extra)


def batch_name(preferred: str) -> str:
    """`preferred` (a batch-like activation name) where the active rules map it, else "act_batch", so that rule
    sets written before it existed keep their batch layout."""
    rules = nn.get_logical_axis_rules()
    return preferred if any(name == preferred for name, _ in rules) else "act_batch"


def param_shardings(model: nn.Module, params, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedSharding tree matching `params` (arrays or ShapeDtypeStructs) from the model's logical names."""
    from agentfly_jax.models.transformer import logical_axes  # the model module imports this one

    specs = logical_axes(model)
    return jax.tree.map(lambda spec, p: NamedSharding(mesh, spec_for_shape(spec, p.shape, mesh, rules)),
                        specs, params, is_leaf=lambda x: isinstance(x, P))


def shard_params(model: nn.Module, params, mesh: Mesh, rules=DEFAULT_RULES):
    """Places params on the mesh by their logical axis names."""
    return jax.device_put(params, param_shardings(model, params, mesh, rules))


def batch_sharding(mesh: Mesh, rules=DEFAULT_RULES, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, seq, ...] input: batch over the mesh axes of `act_batch`."""
    axes = tuple(a for a in _mesh_axes_for("act_batch", rules) if mesh.shape.get(a, 1) > 1)
    lead = None if not axes else axes[0] if len(axes) == 1 else axes
    return NamedSharding(mesh, P(lead, *([None] * (ndim - 1))))
