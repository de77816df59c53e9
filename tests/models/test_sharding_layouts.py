"""Activation shardings that agree with the parameter rules (models/sharding.py, the model's `_constrain`).

The policy update step, compiled under fsdp x tensor meshes of fake CPU devices (tests/conftest.py), must compile
without the SPMD partitioner's "involuntary full rematerialization" and move no activation between devices except
by the all-reduces of tensor parallelism over each device's own rows: no all-to-all, no collective-permute, no
all-gather of tokens or activations, no reduction over the batch's shards (where the heads split; where they do
not, attention's rows are gathered within tensor, and with sequence parallelism the residual's). The same program before the fix
gathered every device's tokens for the embedding lookup, all-reduced the full batch's embeddings over all devices
and moved them back with an all-to-all. Where the mesh cuts query heads further than the kv heads, kv heads are
repeated; that path must give the single-device numbers.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from agentfly_jax.algorithms import aggregation_weights, get_recipe
from agentfly_jax.models import CausalLM, ModelConfig, init_params
from agentfly_jax.models import sharding as shd
from agentfly_jax.models.transformer import init_params_shapes, kv_repeats
from agentfly_jax.trainer import (OptimizerConfig, create_train_state, make_optimizer, make_train_step, pack_step,
                                  state_shardings, take_minibatch)
from tests.script_modules import load_script

REMAT = "involuntary full rematerialization"
# Dimensions chosen so that no parameter has the sequence length T (or T - 1, the log-probabilities' length) or
# the logits chunk C among its dims: a collective whose shape has one of them moves activations.
T, C = 40, 20
CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
           qkv_bias=True, family="qwen2", tie_word_embeddings=True)
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\((.*)$")


def _replica_groups(attrs: str, devices: int) -> list[list[int]]:
    """The partitions (positions in the mesh's device order) of each replica group of a collective, from XLA's
    spellings of replica_groups: explicit, iota and mesh."""
    m = re.search(r"replica_groups=\{(\{[0-9,{}]*\})\}", attrs)  # {{0,1},{2,3}}
    if m:
        return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)  # iota
    if m:
        ids = np.arange(devices).reshape([int(d) for d in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*(?:\{([^}]*)\})?", attrs)  # mesh['axis_0'=2,...] {'axis_0'}
    if m:
        sizes = [(a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", m.group(1))]
        names = [a for a, _ in sizes]
        grouped = re.findall(r"'(\w+)'", m.group(2)) if m.group(2) else names
        ids = np.arange(devices).reshape([n for _, n in sizes])
        order = [i for i, a in enumerate(names) if a not in grouped] + [names.index(a) for a in grouped]
        return ids.transpose(order).reshape(-1, int(np.prod([n for a, n in sizes if a in grouped]))).tolist()
    if "replica_groups={}" in attrs:
        return [list(range(devices))]
    raise AssertionError(f"replica groups not understood: {attrs[:200]}")


def _within_tensor(groups: list[list[int]], axes: dict) -> bool:
    """Whether every group holds devices of one tensor group only (the same data and fsdp coordinates)."""
    shape = tuple(axes.get(a, 1) for a in ("data", "fsdp", "tensor"))
    return all(len({np.unravel_index(p, shape)[:2] for p in g}) == 1 for g in groups)


def _activation_collectives(hlo: str, devices: int) -> list[tuple[str, list[tuple[int, ...]], list[list[int]]]]:
    """(op, operand/result dims, replica groups) of every collective whose shapes hold T, T - 1 or C."""
    found = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.match(line)
        if not m:
            continue
        shape, op, attrs = m.groups()
        dims = [tuple(int(d) for d in s.split(",") if d) for s in re.findall(r"\[([0-9,]*)\]", shape)]
        dims = [d for d in dims if {T, T - 1, C} & set(d)]
        if op == "collective-permute":
            found.append((op, dims, []))  # device pairs, no groups
        elif dims or op == "all-to-all":
            found.append((op, dims, _replica_groups(attrs, devices)))
    return found


def _policy_rows(n_rows: int, micro_batches: int):
    """One mini-batch [M, R, T] of random rows, filled as `prepare` would (old logprobs, advantages, weights)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CFG["vocab_size"], (n_rows, T), dtype=np.int32)
    mask = np.ones((n_rows, T), np.float32)
    mask[:, :3] = 0
    batch = pack_step(tokens, mask, np.zeros_like(mask), np.full(n_rows, T), rewards=np.zeros(n_rows, np.float32),
                      group_ids=np.arange(n_rows), minibatch=np.zeros(n_rows, np.int32), num_minibatches=1,
                      micro_batches=micro_batches)

    def packed(x):
        return np.concatenate([x.reshape(-1), np.zeros(1, np.float32)])[batch.pack_index]

    rows = batch.rows.replace(old_logprobs=packed(-5.0 + 0.3 * rng.normal(size=mask.shape).astype(np.float32)),
                              advantages=packed(rng.normal(size=mask.shape).astype(np.float32) * mask),
                              loss_weights=packed(np.asarray(aggregation_weights(mask, "token-mean"))))
    return take_minibatch(rows, 0)


def _compile_update(axes: dict, *, chunk=None, micro_batches=1, rows_per_shard=2, cfg=CFG, rules=shd.DEFAULT_RULES,
                    with_cost=False):
    """The trainer's train step lowered and compiled on abstract, sharded inputs -> (HLO text, local rows), and
    with `with_cost` also XLA's flop count of one device's program."""
    devices = int(np.prod(list(axes.values())))
    mesh = shd.make_mesh(axes, devices=jax.devices()[:devices])
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    model = CausalLM(ModelConfig(**cfg))
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    abstract = jax.eval_shape(lambda p: create_train_state(p, optimizer), init_params_shapes(model))
    sharding = state_shardings(abstract, mesh, policy_model=model, policy_opt=optimizer, rules=rules)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, sharding)
    rows_sharding = NamedSharding(mesh, P(None, ("data", "fsdp")))
    rows = _policy_rows(rows_per_shard * batch_shards * micro_batches, micro_batches)
    rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows_sharding), rows)
    alg = get_recipe("grpo").resolve({}, {"logprob_chunk": chunk})
    with jax.set_mesh(mesh), shd.axis_rules(rules):
        step = make_train_step(model, alg, optimizer, state_sharding=sharding)
        compiled = step.lower(state, rows).compile()
    if with_cost:
        return compiled.as_text(), rows_per_shard, compiled.cost_analysis()["flops"]
    return compiled.as_text(), rows_per_shard


def test_the_log_capture_sees_an_involuntary_rematerialization(capfd):
    """The control: a reshard XLA can only do by replicating (all 8 devices along dim 0 -> dim 2 over 4 of them)
    is reported on stderr, where the tests below look for it."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)

    def reshard(x):
        x = jax.lax.with_sharding_constraint(x * 3, NamedSharding(mesh, P(("a", "b"))))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, None, "b"))) * 2

    capfd.readouterr()
    jax.jit(reshard).lower(jnp.ones((8, 4, 8))).compile()
    assert REMAT in capfd.readouterr().err.lower()


@pytest.mark.slow
@pytest.mark.parametrize("axes, kw", [
    ({"fsdp": 2, "tensor": 2}, {}),
    ({"fsdp": 4, "tensor": 2}, {"chunk": C, "micro_batches": 2}),  # logits in chunks, a scan over micro-batches
    ({"data": 2, "fsdp": 2, "tensor": 2}, {}),
    ({"fsdp": 2, "tensor": 4}, {}),  # 4 query heads over 4 devices, 2 kv heads: kv repeated
], ids=["fsdp2xtensor2", "fsdp4xtensor2-chunked-micro", "data2xfsdp2xtensor2", "fsdp2xtensor4"])
def test_update_under_fsdp_x_tensor_moves_no_activations_but_tensor_all_reduces(capfd, axes, kw):
    capfd.readouterr()
    hlo, local_rows = _compile_update(axes, **kw)
    assert REMAT not in capfd.readouterr().err.lower()
    moved = _activation_collectives(hlo, int(np.prod(list(axes.values()))))
    assert moved, "expected tensor parallelism's all-reduces of activations"
    for op, dims, groups in moved:
        assert op == "all-reduce", (op, dims)  # no all-gather/all-to-all/permute of tokens or activations
        size = len(groups[0])
        assert 1 < size <= axes["tensor"] and axes["tensor"] % size == 0, (op, dims, groups)  # within tensor
        assert all(d[0] == local_rows for d in dims if len(d) >= 2 and d[1] in (T, T - 1)), dims  # own rows
    if kw.get("chunk"):
        assert any(C in d for _, dims, _ in moved for d in dims)  # the chunked logits really ran


def test_activation_constraints_follow_the_parameters_divisibility():
    mesh = shd.make_mesh({"fsdp": 2, "tensor": 4})
    assert shd.active_shards("act_heads", 8) == 1  # no mesh active: nothing is split
    x = jnp.ones((4, 3, 14, 8))
    assert shd.constrain(x, ("act_batch", "act_length", "act_heads", None)) is x
    with jax.set_mesh(mesh), shd.axis_rules():
        assert shd.active_shards("act_heads", 8) == 4
        assert shd.active_shards("act_heads", 14) == 1  # 14 heads on tensor=4: replicated, like their weights
        assert shd.active_shards("act_batch", 6) == 2
        out = jax.jit(lambda a: shd.constrain(a, ("act_batch", "act_length", "act_heads", None)))(x)
    # the batch over fsdp; 14 heads stay whole rather than asking for an uneven split over tensor
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", None, None, None)), x.ndim)


def test_kv_heads_are_repeated_where_the_mesh_splits_query_heads_further():
    assert kv_repeats(4, 2) == 1  # no mesh
    # (mesh, query heads, kv heads, repeats): kv heads split as far as the query heads
    for axes, heads, kv_heads, repeats in [({"fsdp": 2, "tensor": 4}, 4, 2, 2), ({"tensor": 8}, 8, 2, 4),
                                           ({"tensor": 8}, 16, 4, 2), ({"fsdp": 4, "tensor": 2}, 4, 2, 1),
                                           ({"tensor": 8}, 4, 2, 1), ({"tensor": 4}, 14, 2, 1)]:
        mesh = shd.make_mesh(axes, devices=jax.devices()[:int(np.prod(list(axes.values())))])
        with jax.set_mesh(mesh), shd.axis_rules():
            assert kv_repeats(heads, kv_heads) == repeats, (axes, heads, kv_heads)
            shards = shd.active_shards("act_heads", heads)
        assert (kv_heads * repeats) % shards == 0 and (heads // kv_heads) % repeats == 0


def _assert_sharded_update_equals_one_device(cfg: dict, axes: dict, rules=shd.DEFAULT_RULES, micro_batches=1,
                                             reference_cfg=None):
    """Logits and one gradient step (SGD: the update is the gradient itself) under `axes` and `rules` equal one
    device's (of the model `reference_cfg`, by default the same), and so do the step's metrics."""
    model = CausalLM(ModelConfig(**cfg))
    reference_model = CausalLM(ModelConfig(**(reference_cfg or cfg)))
    params = init_params(model, jax.random.PRNGKey(0))
    optimizer = optax.sgd(1.0)
    rows = jax.tree.map(jnp.asarray, _policy_rows(8 * micro_batches, micro_batches))
    alg = get_recipe("grpo").resolve({}, {})
    ids = rows.tokens[0]
    reference_logits = jax.jit(reference_model.apply)({"params": params}, ids)
    reference, ref_metrics = make_train_step(reference_model, alg, optimizer)(
        create_train_state(jax.tree.map(jnp.copy, params), optimizer), rows)

    mesh = shd.make_mesh(axes)
    state = create_train_state(shd.shard_params(model, jax.tree.map(jnp.copy, params), mesh), optimizer)
    sharding = state_shardings(state, mesh, policy_model=model, policy_opt=optimizer, rules=rules)
    state = jax.device_put(state, sharding)
    rows_sharded = jax.device_put(rows, NamedSharding(mesh, P(None, ("data", "fsdp"))))
    with jax.set_mesh(mesh), shd.axis_rules(rules):
        logits = jax.jit(model.apply)({"params": state.policy.params}, rows_sharded.tokens[0])
        state, metrics = make_train_step(model, alg, optimizer, state_sharding=sharding)(state, rows_sharded)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(reference_logits), atol=1e-5, rtol=0)
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(reference.policy.params),
                                                            jax.tree.leaves(params), strict=True))
    assert moved > 1e-3  # the step did something
    for got, want in zip(jax.tree.leaves(state.policy.params), jax.tree.leaves(reference.policy.params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    assert abs(float(metrics["policy/loss"]) - float(ref_metrics["policy/loss"])) <= 1e-6
    assert set(metrics) == set(ref_metrics)
    for key in metrics:
        np.testing.assert_allclose(float(metrics[key]), float(ref_metrics[key]), rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_repeated_kv_heads_give_the_single_device_update():
    """fsdp=2 x tensor=4 with 4 query and 2 kv heads: each kv head is repeated twice so that q, k and v split
    alike; logits and the gradient step equal those of one device."""
    mesh = shd.make_mesh({"fsdp": 2, "tensor": 4})
    with jax.set_mesh(mesh), shd.axis_rules():
        assert shd.active_shards("act_heads", CFG["num_heads"]) == 4  # so the kv heads are repeated twice
    _assert_sharded_update_equals_one_device(CFG, {"fsdp": 2, "tensor": 4})


# 6 query heads: tensor=4 cannot split them (hidden 96, head dim 16; no dim equals T or C)
UNEVEN = dict(CFG, hidden_size=96, num_heads=6, num_kv_heads=2)


def test_heads_the_mesh_cannot_split_attend_over_a_share_of_the_rows(capfd):
    """6 heads on fsdp=2 x tensor=4: attention keeps whole heads and splits its rows over tensor as well
    (`act_attn_batch`), so each device's compiled update does a quarter of the attention that replicating it
    over tensor did (XLA's own flop count, against the same program with the rule pointed back at the batch
    axes); no involuntary rematerialization, and the activations attention moves are all-gathers of rows within
    tensor."""
    mesh = shd.make_mesh({"fsdp": 2, "tensor": 4})
    with jax.set_mesh(mesh), shd.axis_rules():
        assert not shd.fully_split("act_heads", 6) and shd.fully_split("act_heads", 8)
        assert shd.batch_name("act_attn_batch") == "act_attn_batch"
    with jax.set_mesh(mesh), shd.axis_rules(tuple(r for r in shd.DEFAULT_RULES if r[0] != "act_attn_batch")):
        assert shd.batch_name("act_attn_batch") == "act_batch"  # older rule sets keep the batch layout

    replicated_rules = tuple((n, ("data", "fsdp") if n == "act_attn_batch" else a) for n, a in shd.DEFAULT_RULES)
    hlo, flops = {}, {}
    for name, rules in (("rows", shd.DEFAULT_RULES), ("replicated", replicated_rules)):
        capfd.readouterr()
        hlo[name], _, flops[name] = _compile_update({"fsdp": 2, "tensor": 4}, cfg=UNEVEN, rules=rules,
                                                    rows_per_shard=4, with_cost=True)  # 4 rows: 1 a device
        assert REMAT not in capfd.readouterr().err.lower(), name
    # attention is the only part that changes: its flops (scores, softmax, values; q/k/v/o projections) shrink
    assert flops["rows"] < 0.9 * flops["replicated"], flops
    moved = _activation_collectives(hlo["rows"], 8)
    gathers = [(op, dims, groups) for op, dims, groups in moved if op == "all-gather"]
    assert gathers and all(len(g[0]) == 4 and _within_tensor(g, {"fsdp": 2, "tensor": 4}) for _, _, g in gathers), \
        gathers  # within tensor only
    assert not [m for m in moved if m[0] in ("all-to-all", "collective-permute")], moved


@pytest.mark.slow
def test_heads_the_mesh_cannot_split_give_the_single_device_update():
    _assert_sharded_update_equals_one_device(UNEVEN, {"fsdp": 2, "tensor": 4})


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_repeated_kv_heads_forward_equals_one_device_with_bias_and_lora(lora_rank):
    """The repeated kernels carry the qkv bias and, with LoRA, the adapters' delta along (non-zero here)."""
    model = CausalLM(ModelConfig(**CFG, lora_rank=lora_rank))
    params = init_params(model, jax.random.PRNGKey(1))
    rng = np.random.default_rng(2)
    params = jax.tree_util.tree_map_with_path(  # non-zero biases and adapter outputs
        lambda path, p: p + 0.05 * rng.normal(size=p.shape).astype(np.float32)
        if jax.tree_util.keystr(path).endswith(("['bias']", "['lora_b']")) else p, params)
    ids = jnp.asarray(rng.integers(0, CFG["vocab_size"], (4, T)), jnp.int32)
    reference = jax.jit(model.apply)({"params": params}, ids)
    mesh = shd.make_mesh({"fsdp": 2, "tensor": 4})
    with jax.set_mesh(mesh), shd.axis_rules():
        assert kv_repeats(CFG["num_heads"], CFG["num_kv_heads"]) == 2
        out = jax.jit(model.apply)({"params": shd.shard_params(model, params, mesh)},
                                   jax.device_put(ids, shd.batch_sharding(mesh)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference), atol=1e-5, rtol=0)


# Megatron's sequence parallelism over rows: the residual stream's rows split over tensor too
SEQUENCE_PARALLEL = tuple((n, ("data", "fsdp", "tensor") if n == "act_residual_batch" else a)
                          for n, a in shd.DEFAULT_RULES)
# ... and the tensor-parallel GEMMs' input left on those rows: the partitioner gathers it within the GEMM
GEMM_GATHER = tuple((n, ("data", "fsdp", "tensor") if n == "act_gemm_batch" else a) for n, a in SEQUENCE_PARALLEL)


@pytest.mark.parametrize("cfg, axes, rules", [(CFG, {"fsdp": 2, "tensor": 2}, SEQUENCE_PARALLEL),
                                              (CFG, {"fsdp": 2, "tensor": 4}, SEQUENCE_PARALLEL),
                                              (UNEVEN, {"tensor": 4}, SEQUENCE_PARALLEL),
                                              (CFG, {"fsdp": 2, "tensor": 2}, GEMM_GATHER)],
                         ids=["fsdp2xtensor2", "fsdp2xtensor4", "uneven", "gemm-gather"])
def test_sequence_parallel_residual_compiles_without_rematerialization(capfd, cfg, axes, rules):
    """With `act_residual_batch` over tensor, each device keeps its share of the residual's rows between sublayers;
    the sublayers' collectives stay within tensor groups and XLA finds no reshard it must replicate for (the plain
    transpose of the constraints made the fsdp x tensor backward do exactly that). Also with `act_gemm_batch` over
    tensor (the gathers left to the GEMMs' partitioning), which replicated the attention input's gradient under
    fsdp x tensor until the output projections' kernels were pinned too (`_gemm_kernel`)."""
    capfd.readouterr()
    hlo, _ = _compile_update(axes, cfg=cfg, rules=rules, rows_per_shard=4)
    assert REMAT not in capfd.readouterr().err.lower()
    moved = _activation_collectives(hlo, int(np.prod(list(axes.values()))))
    assert moved and not [m for m in moved if m[0] in ("all-to-all", "collective-permute")], moved
    assert all(1 < len(groups[0]) <= axes["tensor"] for _, _, groups in moved), moved
    # the gathers within tensor groups: under fsdp x tensor, gathering the MLP's hidden states and the attention
    # output over fsdp (all of the batch's rows on every device) passed a check by group size alone, both being 2
    gathers = [groups for op, _, groups in moved if op == "all-gather"]
    assert gathers and all(_within_tensor(groups, axes) for groups in gathers), gathers
    # the final hidden states come out with the residual's layout: rows over data, fsdp and tensor
    mesh = shd.make_mesh(axes, devices=jax.devices()[:int(np.prod(list(axes.values())))])
    model = CausalLM(ModelConfig(**cfg))
    params = shd.shard_params(model, init_params(model, jax.random.PRNGKey(0)), mesh, rules)
    ids = jax.device_put(jnp.ones((4 * mesh.shape["data"] * mesh.shape["fsdp"], T), jnp.int32),
                         shd.batch_sharding(mesh))
    with jax.set_mesh(mesh), shd.axis_rules(rules):
        hidden = jax.jit(lambda p, i: model.apply({"params": p}, i, method=CausalLM.hidden_states))(params, ids)
    rows = tuple(a for a in ("data", "fsdp", "tensor") if axes.get(a, 1) > 1)
    assert hidden.sharding.is_equivalent_to(NamedSharding(mesh, P(rows if len(rows) > 1 else rows[0])), 3)


@pytest.mark.slow
@pytest.mark.parametrize("cfg, axes, rules", [(CFG, {"fsdp": 2, "tensor": 4}, SEQUENCE_PARALLEL),
                                              (UNEVEN, {"fsdp": 2, "tensor": 4}, SEQUENCE_PARALLEL),
                                              (CFG, {"data": 2, "tensor": 4}, GEMM_GATHER)],
                         ids=["split-heads", "uneven", "gemm-gather"])
def test_sequence_parallel_update_equals_one_device(cfg, axes, rules):
    _assert_sharded_update_equals_one_device(cfg, axes, rules=rules)


def test_rule_overrides_replace_by_name_and_refuse_unknown_axes():
    rules = dict(shd.override_rules([("act_residual_batch", ["data", "fsdp", "tensor"]), ("embed", None),
                                     ("vocab", ["tensor"]), ("mlp", [])]))
    assert rules["act_residual_batch"] == ("data", "fsdp", "tensor") and rules["embed"] is None
    assert rules["vocab"] == "tensor" and rules["mlp"] is None and rules["heads"] == "tensor"  # others as they were
    assert list(rules) == [name for name, _ in shd.DEFAULT_RULES]
    assert shd.override_rules(()) == shd.DEFAULT_RULES
    with pytest.raises(ValueError, match="'embed'.*'model'"):
        shd.override_rules([("embed", "model")])
    with pytest.raises(ValueError, match="expected \\(logical name, mesh axes\\)"):
        shd.override_rules([("embed",)])
    with pytest.raises(ValueError, match="'act_residual_bach': no such logical name"):  # a typo changes nothing
        shd.override_rules([("act_residual_bach", "tensor")])
    with pytest.raises(ValueError, match="distinct"):
        shd.override_rules([("embed", ("tensor", "tensor"))])


def test_config_sharding_rules_are_overrides_checked_when_the_config_is_built():
    from agentfly_jax.trainer import builders
    from agentfly_jax.trainer.config import ConfigError, TrainConfig
    from experiments import quickstart

    c = quickstart.get_config()
    c.sharding_rules = (("act_residual_batch", ("data", "fsdp", "tensor")),)
    rules = dict(builders.sharding_rules(TrainConfig.build(c)))
    assert rules["act_residual_batch"] == ("data", "fsdp", "tensor") and rules["embed"] == "fsdp"
    c.sharding_rules = (("act_residual_batch", ("data", "model")),)
    with pytest.raises(ConfigError, match="config.sharding_rules: sharding rule 'act_residual_batch': mesh axes"):
        TrainConfig.build(c)


def test_reshard_constrains_the_value_one_way_and_its_gradient_the_other():
    """`_reshard(x, names, grad_names)`: the forward value takes the layout of `names` (all rows of the tensor
    group), the gradient that of `grad_names` (the residual's rows over fsdp x tensor), where a plain constraint's
    gradient would keep the forward layout."""
    from agentfly_jax.models.transformer import _reshard

    mesh = shd.make_mesh({"fsdp": 2, "tensor": 4})
    rows, residual = ("act_batch", "act_length", "act_embed"), ("act_residual_batch", "act_length", "act_embed")
    x = jax.device_put(jnp.arange(8 * 4 * 16, dtype=jnp.float32).reshape(8, 4, 16),
                       NamedSharding(mesh, P(("fsdp", "tensor"))))
    with jax.set_mesh(mesh), shd.axis_rules(SEQUENCE_PARALLEL):
        value = jax.jit(lambda a: _reshard(a, rows, residual) * 2.0)(x)
        grad = jax.jit(jax.grad(lambda a: (_reshard(a, rows, residual) * 3.0).sum()))(x)
        plain = jax.jit(jax.grad(lambda a: (shd.constrain(a, rows) * 3.0).sum()))(x)
    assert value.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), 3)
    assert grad.sharding.is_equivalent_to(NamedSharding(mesh, P(("fsdp", "tensor"))), 3)
    assert plain.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), 3)  # the control
    np.testing.assert_array_equal(np.asarray(value), 2.0 * np.asarray(x))
    np.testing.assert_array_equal(np.asarray(grad), np.full(x.shape, 3.0, np.float32))


@pytest.mark.parametrize("axes", [{"data": 2}, {"data": 4, "fsdp": 2}, {"data": 2, "tensor": 4}],
                         ids=["data2", "data4xfsdp2", "data2xtensor4"])
def test_gradient_accumulation_reduces_over_data_once_after_the_loop(capfd, axes):
    """With 4 micro-batches, each data-parallel group sums its own gradients through the loop and they are
    all-reduced over `data` once, after it (trainer/update.py `accumulate_gradients`): left to the partitioner,
    the accumulator took the parameters' layout and every micro-batch's gradients were all-reduced in the loop
    (on this compiler, 4 all-reduces per iteration under data=2)."""
    bench = load_script("bench_scaling")
    capfd.readouterr()
    hlo, _ = _compile_update(axes, micro_batches=4)
    assert REMAT not in capfd.readouterr().err.lower()
    in_loops = bench.collectives_in_loops(hlo)
    # every collective of the loop stays within one data group: fsdp's and tensor's own
    devices = int(np.prod(list(axes.values())))
    within = devices // axes["data"]  # data is the mesh's major axis: group k holds devices k*within ...
    crossing = []
    for line in bench.loop_body_lines(hlo):
        m = _COLLECTIVE.match(line)
        if m and m.group(2) != "collective-permute":
            if any(len({d // within for d in g}) > 1 for g in _replica_groups(m.group(3), devices)):
                crossing.append(line.strip()[:200])
    assert not crossing, crossing
    assert bench.count_collectives(hlo)["all-reduce"] > in_loops["all-reduce"]  # the reduction after the loop


@pytest.mark.slow
def test_gradient_accumulation_per_data_group_equals_one_device():
    _assert_sharded_update_equals_one_device(CFG, {"data": 2, "tensor": 4}, micro_batches=2)


def _doubled(x):
    """2x through a custom-partitioned op with a custom VJP (its gradient the same op), as cuDNN's fused
    attention is on a GPU."""
    from jax.experimental.custom_partitioning import custom_partitioning

    @custom_partitioning
    def double(y):
        return 2.0 * y

    double.def_partition(infer_sharding_from_operands=lambda mesh, args, result: args[0].sharding,
                         partition=lambda mesh, args, result: (mesh, lambda y: 2.0 * y, args[0].sharding,
                                                               (args[0].sharding,)),
                         sharding_rule="i j -> i j")
    op = jax.custom_vjp(double)
    op.defvjp(lambda y: (double(y), None), lambda _, g: (double(g),))
    return op(x)


@pytest.mark.parametrize("axes", [{"data": 2}, {"data": 2, "fsdp": 2}], ids=["data2", "data2xfsdp2"])
def test_gradient_accumulation_holds_custom_partitioned_ops(axes):
    """A loss with a custom-partitioned op (cuDNN attention on a GPU) accumulates under the data-mapped loop and
    gives the one-device gradients. Mapped over `data` alone with every other axis of size 1, partitioning that
    op failed an assertion (on 4 H200s at data=4: AssertionError in get_num_ways_dim_sharded); the map is manual
    over the size-1 axes too since."""
    from agentfly_jax.trainer.batch import PackedRows
    from agentfly_jax.trainer.update import _data_groups, accumulate_gradients

    rng = np.random.default_rng(0)
    m, r, length = 4, 4, 8
    rows = PackedRows(tokens=jnp.asarray(rng.integers(0, 50, (m, r, length)), jnp.int32),
                      positions=jnp.zeros((m, r, length), jnp.int32), segment_ids=jnp.ones((m, r, length), jnp.int32),
                      action_mask=jnp.asarray(rng.random((m, r, length)) > 0.3, jnp.float32),
                      sampler_logprobs=jnp.zeros((m, r, length), jnp.float32))
    params = {"w": jnp.asarray(rng.normal(size=(50, 16)), jnp.float32)}

    def loss_fn(p, mb):
        h = _doubled(p["w"][mb.tokens].reshape(-1, 16))
        loss = jnp.sum(jnp.tanh(h).sum(-1) * mb.action_mask.reshape(-1))
        return loss, {"loss": loss, "h_max": jnp.max(h)}

    want, want_metrics = jax.jit(lambda p, b: accumulate_gradients(loss_fn, p, b))(params, rows)
    mesh = shd.make_mesh(axes, devices=jax.devices()[:int(np.prod(list(axes.values())))])
    batch_sharding = NamedSharding(mesh, P(None, ("data", "fsdp")))
    with jax.set_mesh(mesh):
        assert _data_groups(rows) == 2
        got, metrics = jax.jit(lambda p, b: accumulate_gradients(loss_fn, p, b))(
            params, jax.device_put(rows, batch_sharding))
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-5)
    for k in want_metrics:
        np.testing.assert_allclose(metrics[k], want_metrics[k], rtol=1e-5, atol=1e-5)


SPLIT = {**CFG, "layer_row_splits": 2}


def test_layer_row_groups_round_trip_and_take_every_nth_row():
    from agentfly_jax.models.transformer import _join_rows, _row_groups

    x = jnp.arange(3 * 8 * 5).reshape(3, 8, 5)  # rows on axis 1, as mRoPE's positions [3, B, T]
    groups = _row_groups(x, 4, 1)
    assert len(groups) == 4 and all(g.shape == (3, 2, 5) for g in groups)
    np.testing.assert_array_equal(groups[1], x[:, 1::4])
    np.testing.assert_array_equal(_join_rows(groups, 1), x)
    with pytest.raises(ValueError, match="layer_row_splits must be an integer >= 1"):
        ModelConfig(**{**CFG, "layer_row_splits": 0})


def test_layer_row_splits_give_the_same_model():
    """Each layer on two groups of rows (packed segments, remat on) computes what the unsplit model does; a
    batch whose rows do not divide runs whole."""
    split, whole = CausalLM(ModelConfig(**SPLIT, remat=True)), CausalLM(ModelConfig(**CFG))
    params = init_params(whole, jax.random.PRNGKey(1))
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, CFG["vocab_size"], (4, T)), jnp.int32)
    segments = jnp.asarray(np.repeat([[1] * 25 + [2] * 15], 4, 0), jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(25), np.arange(15)])[None].repeat(4, 0), jnp.int32)
    want = jax.jit(whole.apply)({"params": params}, ids, positions, segments)
    got = jax.jit(split.apply)({"params": params}, ids, positions, segments)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)

    def grad(model):
        return jax.jit(jax.grad(lambda p: model.apply({"params": p}, ids, positions, segments).std()))(params)

    for a, b in zip(jax.tree.leaves(grad(split)), jax.tree.leaves(grad(whole)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(jax.jit(split.apply)({"params": params}, ids[:3])),
                               np.asarray(jax.jit(whole.apply)({"params": params}, ids[:3])), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_layer_row_splits_update_under_fsdp_x_tensor_equals_the_unsplit_one_device():
    _assert_sharded_update_equals_one_device(SPLIT, {"fsdp": 2, "tensor": 4}, reference_cfg=CFG)


@pytest.mark.parametrize("axes", [{"fsdp": 2, "tensor": 2}, {"tensor": 4}], ids=["fsdp2xtensor2", "tensor4"])
def test_layer_row_splits_keep_each_devices_rows_and_split_the_all_reduces(capfd, axes):
    """Under layer_row_splits=2 every layer's tensor all-reduces run on each group's half of the device's own
    rows (twice as many, half as large): the split moves no data between devices and adds no rematerialization."""
    capfd.readouterr()
    hlo, local_rows = _compile_update(axes, cfg=SPLIT, rows_per_shard=4)
    assert REMAT not in capfd.readouterr().err.lower()
    devices = int(np.prod(list(axes.values())))
    moved = _activation_collectives(hlo, devices)
    assert {op for op, _, _ in moved} == {"all-reduce"}
    assert all(_within_tensor(groups, axes) for _, _, groups in moved)
    rows_of = [d[0] for _, dims, _ in moved for d in dims if len(d) >= 2 and d[1] in (T, T - 1)]
    half = rows_of.count(local_rows // 2)
    assert half >= 2 * 2 * CFG["num_layers"], rows_of  # attention's and the MLP's, per group and layer, forward
    assert set(rows_of) <= {local_rows, local_rows // 2}, rows_of  # the embedding and the logits: all rows
