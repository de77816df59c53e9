"""JaxSampler tensor-parallel over a mesh (tests/conftest.py's 8 fake CPU devices): the same outputs as the
single-device sampler, the params and the KV cache really split, weight updates from the trainer's mesh, and
the compiled decode program's collectives.

The tiny model has 4 heads, 2 kv heads, MLP 256 and vocab 1024, so the three meshes cover the three layouts:
tensor=2 splits everything (1 kv head per device); tensor=4 splits the queries further than the 2 kv heads, so
each kv head is cached twice (4 cache heads, 1 per device); tensor=8 divides no head count, so attention and the
cache are replicated while the MLP and the vocab split. The reference is the single-device sampler, which
tests/backends/test_jax_sampler*.py check against the trainer's recompute and hand-written decodes.
"""
import asyncio
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from agentfly_jax.models import sharding as shd
from agentfly_jax.rollout.backends import JaxSampler
from tests.backends.test_jax_sampler_images import checkpoint as vl_checkpoint  # noqa: F401 (a fixture)
from tests.backends.test_jax_sampler_images import tokenizer as vl_tokenizer  # noqa: F401 (a fixture)
from tests.backends.test_jax_sampler_images import user_prompt
from tests.backends.test_jax_sampler_prefix import grpo

OPTIONS = {"max_slots": 8, "max_len": 128, "min_bucket": 64, "steps_per_call": 4, "prefix_min_tokens": 4}
#: tensor -> (cache kv heads, cache spec, q_proj kernel spec [E, H, D])
LAYOUTS = {2: (2, P(None, "tensor", None, None), P(None, "tensor", None)),
           4: (4, P(None, "tensor", None, None), P(None, "tensor", None)),
           8: (2, P(None, None, None, None), P(None, None, None))}


@pytest.fixture(scope="module")
def single(tiny_model):
    model, params = tiny_model
    sampler = JaxSampler(model, params, **OPTIONS)
    yield sampler
    asyncio.run(sampler.close())


@pytest.fixture(scope="module", params=sorted(LAYOUTS), ids=lambda tp: f"tensor{tp}")
def sharded(request, tiny_model):
    model, params = tiny_model
    sampler = JaxSampler(model, params, **OPTIONS, tensor_parallel=request.param)
    yield sampler
    asyncio.run(sampler.close())


def assert_same(reference, runs):
    """Equal prompts and tokens; logprobs within 1e-5 (fp32: the all-reduces sum in another order)."""
    assert len(reference) == len(runs)
    worst = 0.0
    for chain_ref, chain in zip(reference, runs):
        for (prompt_ref, ref), (prompt, got) in zip(chain_ref, chain, strict=True):
            assert prompt == prompt_ref and got.token_ids == ref.token_ids
            worst = max(worst, float(np.max(np.abs(np.subtract(got.logprobs, ref.logprobs)))))
    assert worst < 1e-5
    return worst


_REFERENCE = {}


def test_outputs_equal_the_single_device_sampler(single, sharded):
    """Multi-turn GRPO-shaped chains with prefix caching: greedy and seeded temperature-1 sampling both give the
    single-device sampler's tokens, logprobs within 1e-5; the cache keeps its layout and is updated in place."""
    cache_before = sharded._cache["k"][0]
    reused = sharded.stats["prefix_tokens_reused"]
    for temperature, seed in ((0.0, 0), (1.0, 50)):
        if (temperature, seed) not in _REFERENCE:  # the single-device runs, once for the three meshes
            _REFERENCE[temperature, seed] = asyncio.run(grpo(single, tasks=2, chains=2, turns=3,
                                                             temperature=temperature, seed=seed))
        runs = asyncio.run(grpo(sharded, tasks=2, chains=2, turns=3, temperature=temperature, seed=seed))
        assert_same(_REFERENCE[temperature, seed], runs)
    assert sharded.stats["prefix_tokens_reused"] > reused  # later turns continued cached prefixes
    assert cache_before.is_deleted()  # donated to the programs, not copied
    heads, spec, _ = LAYOUTS[sharded.tensor_parallel]
    assert all(buf.sharding.spec == spec and buf.shape[1] == heads for buf in sharded._cache["k"])


def test_params_and_cache_are_split(sharded):
    tp = sharded.tensor_parallel
    heads, spec, q_spec = LAYOUTS[tp]
    assert sorted(d.id for d in sharded.mesh.devices.flat) == list(range(tp))
    for name in ("k", "v"):
        for cache in sharded._cache[name]:  # one buffer per layer, [slots, kv heads, positions, head dim]
            assert cache.sharding.spec == spec and cache.shape[1] == heads
            per_device = heads // tp if spec[1] else heads
            assert {shard.data.shape[1] for shard in cache.addressable_shards} == {per_device}
            assert len(cache.addressable_shards) == tp
    params = sharded._params["model"]
    layer = params["layers_0"]
    assert layer["self_attn"]["q_proj"]["kernel"].sharding.spec == q_spec
    assert layer["mlp"]["gate_proj"]["kernel"].sharding.spec == P(None, "tensor")  # MLP 256: divisible by 8
    assert layer["mlp"]["down_proj"]["kernel"].sharding.spec == P("tensor", None)
    assert params["embed_tokens"]["embedding"].sharding.spec == P("tensor", None)  # vocab 1024
    assert layer["input_layernorm"]["scale"].sharding.spec == P(None)
    assert layer["mlp"]["gate_proj"]["kernel"].addressable_shards[0].data.shape == (128, 256 // tp)


def collectives(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, result shape) of every collective in compiled HLO text."""
    found = re.findall(r"= \w+\[([\d,]*)\]\S* (all-reduce|all-gather|all-to-all|reduce-scatter)(?:-start)?\(", hlo)
    return [(kind, tuple(int(n) for n in shape.split(",") if n)) for shape, kind in found]


def test_decode_program_collectives(sharded, tiny_model):
    """The compiled decode call all-reduces the residual stream [B, 1, E] after o_proj and down_proj (and the
    vocab-split embedding lookup) and otherwise moves only per-row scalars of the vocab-split sampling: nothing
    the size of the cache, the weights or the logits."""
    config = tiny_model[0].config
    b, tp = OPTIONS["max_slots"], sharded.tensor_parallel
    cfg = jax.device_put(sharded._cfg, sharded._inputs)
    kv_len = sharded.buckets[0]  # the program the outputs test compiled
    lowered = sharded._decode.lower(sharded._params, sharded._cache, sharded._state, cfg, kv_len, False, 4)
    hlo = lowered.compile().as_text()
    found = collectives(hlo)
    residual = [shape for kind, shape in found if kind == "all-reduce" and shape == (b, 1, config.hidden_size)]
    per_layer = 2 if config.num_heads % tp == 0 else 1  # tensor=8: attention replicated, only down_proj reduces
    assert len(residual) == 1 + per_layer * config.num_layers, found
    for kind, shape in found:
        assert int(np.prod(shape)) <= max(b * config.hidden_size, b * tp), (kind, shape)


def test_weight_update_from_the_trainer_mesh(single, tiny_model, tiny_params_b):
    """Params sharded on a trainer mesh over all 8 devices (fsdp=2 x tensor=4, overlapping the sampler's 4) reach
    the sampler on its own layouts as a copy: the trainer deleting (donating) its buffers afterwards changes
    nothing, and the outputs equal the single-device sampler's with the same weights."""
    model, params_a = tiny_model
    sampler = JaxSampler(model, params_a, **OPTIONS, tensor_parallel=4)
    layouts = jax.tree.map(lambda x: x.sharding, sampler._params)
    trainer_mesh = shd.make_mesh({"fsdp": 2, "tensor": 4})
    trained = shd.shard_params(model, jax.device_get(tiny_params_b), trainer_mesh)  # buffers of its own

    async def run():
        await sampler.update_weights(trained, 1)
        for leaf in jax.tree.leaves(trained):
            leaf.delete()  # the trainer's next step donates them
        await single.update_weights(tiny_params_b, 1)
        try:
            reference = await grpo(single, tasks=1, chains=2, turns=2, seed=7)
            got = await grpo(sampler, tasks=1, chains=2, turns=2, seed=7)
        finally:
            await single.update_weights(params_a, 2)  # the shared sampler back on weights A
            await sampler.close()
        return reference, got

    reference, got = asyncio.run(run())
    assert_same(reference, got)
    assert all(c.weight_version == 1 for chain in got for _, c in chain)
    assert jax.tree.map(lambda x: x.sharding, sampler._params) == layouts


def test_vision_language_policy(vl_checkpoint, vl_tokenizer):
    """A tiny Qwen2.5-VL policy on tensor=2 (its vision tower in the prompt pass program too): a prompt with an
    image and a text prompt together equal the single-device sampler's (greedy tokens, logprobs within 1e-5)."""
    _, model, params = vl_checkpoint
    options = dict(max_slots=4, max_len=256, steps_per_call=4, min_patch_bucket=32, prefix_min_tokens=4)
    with_image, images = user_prompt(vl_tokenizer, ["wide", "what is in it?"])
    text, _ = user_prompt(vl_tokenizer, ["no picture here, only a question about the weather?"])

    async def workload(sampler):
        out = await asyncio.gather(sampler.generate(with_image, images=images, max_tokens=8, temperature=0.0),
                                   sampler.generate(text, max_tokens=8, temperature=0.0))
        await sampler.close()
        return [c for [c] in out]

    reference = asyncio.run(workload(JaxSampler(model, params, **options)))
    sharded = JaxSampler(model, params, **options, tensor_parallel=2)
    got = asyncio.run(workload(sharded))
    for ref, out in zip(reference, got, strict=True):
        assert out.token_ids == ref.token_ids
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert sharded.stats["images"] == 1 and sharded.compile_counts["prefill_images"] == 1
    assert sharded._cache["k"][0].sharding.spec == P(None, "tensor", None, None)


def test_placement_options_are_checked(tiny_model):
    model, params = tiny_model
    with pytest.raises(ValueError, match="one of device=, mesh= and tensor_parallel"):
        JaxSampler(model, params, **OPTIONS, device=jax.devices()[0], tensor_parallel=2)
    with pytest.raises(ValueError, match="needs that many devices"):
        JaxSampler(model, params, **OPTIONS, tensor_parallel=16)
    with pytest.raises(ValueError, match="'tensor' axis only"):
        JaxSampler(model, params, **OPTIONS, mesh=shd.make_mesh({"fsdp": 2, "tensor": 4}))
    with pytest.raises(ValueError, match="tensor_parallel >= 1"):
        JaxSampler(model, params, **OPTIONS, tensor_parallel=0)
    mesh = shd.make_mesh({"tensor": 2}, jax.devices()[6:])  # any local devices
    sampler = JaxSampler(model, params, **OPTIONS, mesh=mesh)
    assert sampler.tensor_parallel == 2 and sampler.device == jax.devices()[6]
    assert {d.id for d in sampler._cache["k"][0].devices()} == {6, 7}


def test_trainer_config(tiny_model):
    """config.jax_sampler.tensor_parallel: the trainer's sampler on the first N devices, or with separate_device
    on the last N with the training mesh on the rest; too many devices, or a vLLM backend, are ConfigErrors."""
    from agentfly_jax.trainer import builders
    from agentfly_jax.trainer.config import ConfigError, TrainConfig
    from experiments.quickstart import get_config

    model, params = tiny_model
    config = get_config()
    assert TrainConfig.build(config).jax_sampler.tensor_parallel == 1
    config.jax_sampler.max_slots = 2
    config.jax_sampler.tensor_parallel = 2
    sampler = builders.build_backend(TrainConfig.build(config), model, params)
    assert sampler.tensor_parallel == 2 and [d.id for d in sampler.mesh.devices.flat] == [0, 1]
    assert sampler.fuse_projections is False  # "auto" on a mesh
    config.jax_sampler.fuse_projections = "on"
    with pytest.raises(ConfigError, match="fuse_projections='on' runs on one device"):
        TrainConfig.build(config)
    config.jax_sampler.fuse_projections, config.jax_sampler.tensor_parallel = "off", 1
    assert builders.build_backend(TrainConfig.build(config), model, params).fuse_projections is False
    config.jax_sampler.fuse_projections = "auto"
    assert builders.build_backend(TrainConfig.build(config), model, params).fuse_projections is True
    config.jax_sampler.tensor_parallel = 2
    config.jax_sampler.separate_device = True
    cfg = TrainConfig.build(config)
    assert [d.id for d in builders.sampler_devices(cfg)] == [6, 7]
    assert [d.id for d in builders.trainer_devices(cfg)] == list(range(6))
    config.jax_sampler.tensor_parallel = 8
    with pytest.raises(ConfigError, match="at least 9 devices"):
        builders.trainer_devices(TrainConfig.build(config))
    config.jax_sampler.separate_device, config.jax_sampler.tensor_parallel = False, 9
    with pytest.raises(ConfigError, match="tensor_parallel=9 needs 9 devices"):
        builders.build_backend(TrainConfig.build(config), model, params)
    config.jax_sampler.tensor_parallel = 0
    with pytest.raises(ConfigError, match="tensor_parallel"):
        TrainConfig.build(config)
    config.jax_sampler.tensor_parallel, config.jax_sampler.decode_attention = 2, "pallas"
    with pytest.raises(ConfigError, match="decode_attention='pallas' runs on one device"):
        TrainConfig.build(config)
    config.jax_sampler.decode_attention = "auto"
    config.jax_sampler.tensor_parallel, config.backend, config.vllm.launch = 2, "vllm", True
    with pytest.raises(ConfigError, match="tensor_parallel=2 is for the JAX sampler"):
        TrainConfig.build(config)
