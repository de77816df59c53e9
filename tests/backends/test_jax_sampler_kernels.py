"""JaxSampler's decode kernels: the Pallas decode attention (run by the Pallas interpreter on this CPU) against the
einsum path, and the counter-based Gumbel noise against the uniform distribution and jax.random's."""
import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentfly_jax.models import decode
from agentfly_jax.rollout.backends import JaxSampler
from agentfly_jax.rollout.backends.jax_sampler import hash_uniform, sample_tokens

VOCAB = 1024


def conversation_prompts(seed, count, lo, hi):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(lo, hi))).tolist() for _ in range(count)]


async def two_turns(sampler, prompt, seed, temperature):
    """A chain of two turns, the second continuing the first (prefix caching serves it), as the runtime sends."""
    first = (await sampler.generate(prompt, max_tokens=12, temperature=temperature, seed=seed))[0]
    follow = prompt + first.token_ids + [7, 8, 9]
    second = (await sampler.generate(follow, max_tokens=12, temperature=temperature, seed=seed + 1))[0]
    return first, second


@pytest.mark.parametrize("max_len", [700])
def test_pallas_decode_attention_equals_the_einsum_path(tiny_model, max_len):
    """Greedy and seeded T=1 chains of 5 prompts on 4 slots (prompts 3..150 tokens, two turns, prefix caching): the
    Pallas kernel (cache rounded to 768 positions: 3 sequence splits of 256, blocks of 128) gives the einsum path's
    tokens and logprobs within 1e-5 (fp32)."""
    model, params = tiny_model
    prompts = conversation_prompts(max_len, 5, 3, 150)
    outputs = {}
    for attention in ("xla", "pallas_interpret"):
        sampler = JaxSampler(model, params, max_slots=4, max_len=max_len, steps_per_call=4,
                             decode_attention=attention)
        assert sampler._cache_len == (max_len if attention == "xla" else decode.pallas_cache_length(max_len))

        async def run(sampler=sampler):
            async with sampler:
                return await asyncio.gather(*[two_turns(sampler, p, 10 * i, temperature=0.0 if i % 2 else 1.0)
                                              for i, p in enumerate(prompts)])
        outputs[attention] = asyncio.run(run())
        if attention != "xla":
            assert sampler.compile_counts["decode"] == 1  # one window for every length
    for ref_chain, chain in zip(outputs["xla"], outputs["pallas_interpret"]):
        for ref, got in zip(ref_chain, chain):
            assert got.token_ids == ref.token_ids
            np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)


def test_pallas_cache_length_and_errors(tiny_model):
    assert [decode.pallas_cache_length(n) for n in (1, 256, 257, 2048, 2049)] == [256, 256, 512, 2048, 2304]
    assert [decode._pallas_splits(n) for n in (256, 512, 768, 4096, 4352)] == [16, 16, 3, 16, 17]
    with pytest.raises(ValueError, match="multiple of 256"):
        decode._pallas_splits(300)
    with pytest.raises(ValueError, match="decode_attention"):
        JaxSampler(*tiny_model, decode_attention="flash")
    with pytest.raises(ValueError, match="sampling_noise"):
        JaxSampler(*tiny_model, sampling_noise="philox")


def test_hash_uniforms_are_uniform_and_independent():
    """256 rows (2 seeds x 2 sample indices x 64 steps) x 4096 ids: the uniforms pass a Kolmogorov-Smirnov bound;
    neighbouring ids of a row, and every pair of rows (differing in seed, sample index or step), are
    uncorrelated."""
    rows = 256
    seed = jnp.asarray(np.repeat([3, 4], rows // 2), jnp.uint32)
    sample = jnp.asarray(np.tile([0, 1], rows // 2), jnp.int32)
    step = jnp.asarray(np.arange(rows) // 2 % 64, jnp.int32)
    u = np.asarray(hash_uniform(seed, sample, step, 4096), np.float64)
    assert u.min() > 0 and u.max() < 1
    flat = np.sort(u.ravel())
    ks = np.max(np.abs(flat - (np.arange(flat.size) + 0.5) / flat.size))
    assert ks < 1.63 / np.sqrt(flat.size)  # the 1% critical value
    centred = (u - 0.5) / np.sqrt(1 / 12)
    sigma = 1 / np.sqrt(4096)  # of one correlation estimate
    assert abs(np.mean(centred[:, 1:] * centred[:, :-1])) < 4 * sigma / np.sqrt(rows)
    corr = centred @ centred.T / 4096
    assert np.max(np.abs(corr[~np.eye(rows, dtype=bool)])) < 5.5 * sigma  # 32,640 pairs


def test_hash_noise_samples_the_tempered_distribution():
    """20,000 draws (one slot, 20,000 steps of its stream) from a 6-token distribution with a tiny and a dominant
    token, at T=0.5: frequencies within 4 sigma; logprobs are log_softmax at the token, as with threefry."""
    logits = jnp.asarray([[2.0, 0.0, -1.0, 1.5, -6.0, 0.5]], jnp.float32)
    steps = 20_000
    cfg = {"temperature": jnp.full(steps, 0.5), "top_k": jnp.zeros(steps, jnp.int32), "top_p": jnp.ones(steps),
           "seed": jnp.full(steps, 11, jnp.uint32), "sample_index": jnp.zeros(steps, jnp.int32)}
    batch = jnp.repeat(logits, steps, axis=0)
    probs = np.asarray(jax.nn.softmax(logits[0] / 0.5), np.float64)
    for noise in ("hash", "threefry"):
        tokens, logprobs = jax.jit(lambda b, c, n, noise=noise: sample_tokens(b, c, n, filtered=False, noise=noise))(
            batch, cfg, jnp.arange(steps, dtype=jnp.int32))
        counts = np.bincount(np.asarray(tokens), minlength=6)
        sigma = np.sqrt(steps * probs * (1 - probs))
        assert np.all(np.abs(counts - steps * probs) <= 4 * sigma + 1), (noise, counts, steps * probs)
        np.testing.assert_allclose(np.asarray(logprobs), np.log(probs[np.asarray(tokens)]), atol=1e-5)


# ----------------------------------------------------------------------------------- fused projections
def test_fuse_projections_joins_the_kernels_in_order(tiny_model):
    """qkv_proj holds q's heads, then k's, then v's (kernels and biases); gate_up_proj gate's columns, then up's;
    every other entry is the same array, not a copy; a layer carrying LoRA adapters is left as it is."""
    _, params = tiny_model
    fused = decode.fuse_projections(params)
    for name, layer in params["model"].items():
        if not name.startswith("layers_"):
            assert fused["model"][name] is layer
            continue
        attn, got = layer["self_attn"], fused["model"][name]["self_attn"]
        assert set(got) == {"o_proj", decode.FUSED_QKV} and got["o_proj"] is attn["o_proj"]
        for part in ("kernel", "bias"):
            want = np.concatenate([np.asarray(attn[k][part]) for k in ("q_proj", "k_proj", "v_proj")],
                                  axis=1 if part == "kernel" else 0)
            np.testing.assert_array_equal(np.asarray(got[decode.FUSED_QKV][part]), want)
        mlp, got = layer["mlp"], fused["model"][name]["mlp"]
        assert set(got) == {"down_proj", decode.FUSED_GATE_UP}
        np.testing.assert_array_equal(np.asarray(got[decode.FUSED_GATE_UP]["kernel"]), np.concatenate(
            [np.asarray(mlp["gate_proj"]["kernel"]), np.asarray(mlp["up_proj"]["kernel"])], axis=1))
    assert all(fused[k] is params[k] for k in params if k != "model")
    with_lora = jax.tree.map(lambda x: x, params)
    with_lora["model"]["layers_0"]["self_attn"]["q_proj"] = {**params["model"]["layers_0"]["self_attn"]["q_proj"],
                                                            "lora_a": jnp.zeros((4, 2))}
    kept = decode.fuse_projections(with_lora)["model"]
    assert "q_proj" in kept["layers_0"]["self_attn"] and decode.FUSED_QKV not in kept["layers_0"]["self_attn"]
    assert decode.FUSED_GATE_UP in kept["layers_0"]["mlp"] and decode.FUSED_QKV in kept["layers_1"]["self_attn"]
    # free_parts: the joined parts' buffers are gone, the joined copies and everything else intact
    own = jax.tree.map(jnp.copy, params)
    freed = decode.fuse_projections(own, free_parts=True)
    jax.tree.map(np.testing.assert_array_equal, freed, fused)
    for layer in (v for k, v in own["model"].items() if k.startswith("layers_")):
        parts = [layer["self_attn"][k] for k in ("q_proj", "k_proj", "v_proj")] + [
            layer["mlp"][k] for k in ("gate_proj", "up_proj")]
        assert all(x.is_deleted() for x in jax.tree.leaves(parts))
        assert not layer["self_attn"]["o_proj"]["kernel"].is_deleted() and not layer["mlp"]["down_proj"][
            "kernel"].is_deleted()


def test_fused_sampler_equals_the_unfused_one_across_a_weight_update(tiny_model, tiny_params_b):
    """Greedy and seeded two-turn chains (prefix caching on) on weights A, then on weights B after update_weights:
    the fused sampler gives the unfused one's tokens, and logprobs within 1e-5 (fp32: only the GEMMs' summation
    order differs); the served tree is re-fused at the update."""
    model, params = tiny_model
    prompts = conversation_prompts(11, 5, 3, 60)
    outputs = {}
    for fuse in (False, True):
        sampler = JaxSampler(model, params, max_slots=4, max_len=256, steps_per_call=4, fuse_projections=fuse)
        assert sampler.fuse_projections is fuse
        assert (decode.FUSED_QKV in sampler._params["model"]["layers_0"]["self_attn"]) is fuse

        async def run(sampler=sampler):
            async with sampler:
                chains = lambda: asyncio.gather(*[two_turns(sampler, p, 10 * i, 0.0 if i % 2 else 1.0)  # noqa: E731
                                                  for i, p in enumerate(prompts)])
                first = await chains()
                await sampler.update_weights(tiny_params_b, version=1)
                return first, await chains()
        outputs[fuse] = asyncio.run(run())
        assert (decode.FUSED_QKV in sampler._params["model"]["layers_0"]["self_attn"]) is fuse
    for ref_round, round_ in zip(outputs[False], outputs[True]):
        for ref_chain, chain in zip(ref_round, round_):
            for ref, got in zip(ref_chain, chain):
                assert got.token_ids == ref.token_ids
                np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert outputs[True][0] != outputs[True][1]  # weights B really decode differently


def test_fuse_projections_settings(tiny_model):
    model, params = tiny_model
    assert JaxSampler(model, params).fuse_projections is True  # "auto" on one device
    with pytest.raises(ValueError, match="fuse_projections must be"):
        JaxSampler(model, params, fuse_projections="yes")
    if len(jax.devices()) >= 2:
        assert JaxSampler(model, params, tensor_parallel=2).fuse_projections is False  # "auto" on a mesh
        with pytest.raises(ValueError, match="runs on one device"):
            JaxSampler(model, params, tensor_parallel=2, fuse_projections=True)


def test_gpu_gemm_reaches_every_program(tiny_model, monkeypatch):
    """JaxSampler(gpu_gemm=...): on a GPU backend "cublas" compiles every program of the sampler (prompt passes,
    inserts, decode) with XLA's Triton GEMMs off, "triton" with XLA's defaults; an unknown name is refused. The
    backend is patched to "gpu" and jax.jit recorded (the programs then compile for this CPU without the option)."""
    model, params = tiny_model
    real_jit = jax.jit
    seen = []

    def recording_jit(fn, **kwargs):
        seen.append((getattr(fn, "__name__", "?"), kwargs.pop("compiler_options", None)))
        return real_jit(fn, **kwargs)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "jit", recording_jit)
    cublas = JaxSampler(model, params, max_slots=2, gpu_gemm="cublas")
    names = {name for name, _ in seen}
    assert {"prefill", "decode_call", "insert"} <= names, names
    assert all(options == {"xla_gpu_enable_triton_gemm": False} for _, options in seen), seen
    seen.clear()
    triton = JaxSampler(model, params, max_slots=2)
    assert triton.gpu_gemm == "triton" and seen and all(options is None for _, options in seen), seen
    monkeypatch.undo()
    with pytest.raises(ValueError, match="gpu_gemm='cutlass'"):
        JaxSampler(model, params, gpu_gemm="cutlass")
    # the recorded programs still run: a short greedy generation on this CPU
    async def go():
        try:
            return await cublas.generate([1, 2, 3], max_tokens=3, temperature=0.0)
        finally:
            await cublas.close()

    assert len(asyncio.run(go())[0].token_ids) == 3
