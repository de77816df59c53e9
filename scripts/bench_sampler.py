"""Benchmark: decode tokens/s of JaxSampler against HF transformers `generate` on the same card, with the HBM
roofline.

    python scripts/bench_sampler.py                    # Qwen2.5-0.5B shape, bf16, batch 64 and 256 (GPU)
    python scripts/bench_sampler.py --shape tiny --batches 2 4 --prompt-len 8 --new-tokens 16 --extra-tokens 16
                                                       # the short CPU version CI runs
    python scripts/bench_sampler.py --shape qwen2.5-7b --tensor-parallel 1 2
                                                       # ours on one GPU, then tensor-parallel on two

Both sides get random weights of the same shape (bf16), the same batch of random prompts (`--prompt-len`
tokens each) and sample with temperature 1 (no top-p/top-k, no stop tokens) until every sequence has its
tokens. Ours: `batch` concurrent `JaxSampler.generate` calls (continuous batching, `batch` slots). Peer:
`model.generate(do_sample=True)` on the padded batch (sdpa attention, dynamic KV cache).

--mode grpo (prefix caching, JaxSampler only): a GRPO-shaped multi-turn workload, `--prompts` tasks x `--chains`
chains x `--turns` turns, run with prefix caching on and then off on samplers of `--slots` slots:
    python scripts/bench_sampler.py --mode grpo                                  # 64 x 8, Qwen2.5-0.5B shape (GPU)
    python scripts/bench_sampler.py --mode grpo --shape tiny --dtype float32 --prompts 8 --chains 4 --slots 16 \
        --prompt-len 64 --new-tokens 16 --obs-len 24                             # the short CPU version
Each chain sends every turn as its own request, as the agent runtime does (rollout/chain.py): turn 1 is the task's
prompt (length uniform in [prompt_len/2, prompt_len], the same for the task's chains), each later turn the
conversation so far plus an observation (uniform in [1, obs_len] random tokens); completions sample at
temperature 1 (seeded per chain and turn) for max_tokens uniform in [new_tokens/2, new_tokens], no stop tokens.
A warm-up round compiles the programs; then `--repeats` measured rounds, each after a weight update (the same
params) that drops what the round before cached, report the median wall time, and the last round the prompt tokens the admitted sequences needed, those a prompt pass actually computed, prefix hits,
and whether the completions equal those of the other setting (seeded sampling: they do unless a near-tie of the
two computations' rounding flips a draw).

--tensor-parallel N [M ...]: our side runs once per value, the JaxSampler split over that many local devices
(`JaxSampler(tensor_parallel=N)`: heads, MLP and vocab split, the KV cache over kv heads); the roofline then counts
the HBM bandwidth of all N devices (each reads its share of the weights and the cache). The peer runs on one.
--fuse-projections auto|0|1 [...]: likewise once per value, `JaxSampler(fuse_projections=...)` (q/k/v and gate/up
as joined GEMMs: 1; the model's own: 0; auto, the default: joined on one device).
--gpu-gemm triton|cublas|triton_exhaustive [...]: likewise, `JaxSampler(gpu_gemm=...)` (how the programs' matrix
products compile on a GPU: XLA's Triton fusions, the default; cuBLAS; Triton with every tiling tried).

Each side runs every batch size after a warm-up, --repeats rounds each with N = --new-tokens and N + --extra-tokens new
tokens, and keeps the fastest round of each;
  e2e tok/s    = batch * N_long / wall(N_long)                 (prompt pass included)
  decode tok/s = batch * extra / (wall(N_long) - wall(N))       (the prompt pass and fixed costs cancel)
Roofline of one decode step: (parameter bytes + KV-cache bytes read at the mean context) / HBM bandwidth
(H100 3.35 TB/s, H200 4.8 TB/s); roofline tok/s = batch / that time. Each side runs in its own subprocess so
neither holds the other's device memory. Prints a JSON line per side and batch, then a SUMMARY line per batch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# Runnable as `python scripts/bench_sampler.py` from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentfly_jax.models.config import GPU_GEMMS  # noqa: E402
from agentfly_jax.models.shapes import SHAPES  # noqa: E402
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # matched in this order against the device name


def param_count(shape: dict) -> int:
    h, f, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_layers"], shape["vocab_size"]
    d = h // shape["num_heads"]
    q, kv = shape["num_heads"] * d, shape["num_kv_heads"] * d
    per_layer = h * q + 2 * h * kv + q * h + (q + 2 * kv) + 3 * h * f + 2 * h
    return v * h * (1 if shape["tie_word_embeddings"] else 2) + layers * per_layer + h


def roofline(shape: dict, batch: int, mean_context: float, bytes_per_value: int, bandwidth: float | None,
             devices: int = 1) -> dict:
    """Bytes one decode step must move from HBM and the implied best step time and tokens/s (on `devices`
    devices of `bandwidth` each, splitting the bytes evenly: tensor parallel)."""
    d = shape["hidden_size"] // shape["num_heads"]
    kv_per_token = 2 * shape["num_layers"] * shape["num_kv_heads"] * d * bytes_per_value
    weight_bytes = param_count(shape) * bytes_per_value  # the tied embedding is read once, as the lm_head
    kv_bytes = batch * mean_context * kv_per_token
    out = {"weight_bytes": weight_bytes, "kv_bytes_per_step": int(kv_bytes), "bandwidth": bandwidth,
           "devices": devices}
    if bandwidth:
        step_s = (weight_bytes + kv_bytes) / (bandwidth * devices)
        out.update(step_ms=round(1e3 * step_s, 4), tokens_per_s=round(batch / step_s, 1))
    return out


def _prompts(args, batch: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, SHAPES[args.shape]["vocab_size"], (batch, args.prompt_len), dtype=np.int64)


def _measure(generate_round, args) -> dict:
    """Warm-up, then wall times of `args.repeats` rounds at N and at N + extra new tokens, each the fastest of its
    rounds: a loaded machine's noise only adds time, and the decode rate is a difference of the two, which the
    medians of two rounds each once made negative on a shared CI machine."""
    n_short, n_long = args.new_tokens, args.new_tokens + args.extra_tokens
    t0 = time.perf_counter()
    generate_round(n_short)
    generate_round(n_long)
    warmup_s = time.perf_counter() - t0
    short, long = [], []
    for _ in range(args.repeats):
        for n, times in ((n_short, short), (n_long, long)):
            t = time.perf_counter()
            generate_round(n)
            times.append(time.perf_counter() - t)
    return {"warmup_s": round(warmup_s, 2), "wall_short_s": min(short), "wall_long_s": min(long)}


def _summary(args, batch: int, timing: dict) -> dict:
    n_long = args.new_tokens + args.extra_tokens
    decode_s = timing["wall_long_s"] - timing["wall_short_s"]
    decode = batch * args.extra_tokens / decode_s if decode_s > 0 else float("nan")
    if not decode_s > 0:
        print(f"bench_sampler: batch {batch}: the round with {args.extra_tokens} more new tokens was not slower "
              f"({timing['wall_long_s']:.4f} s against {timing['wall_short_s']:.4f} s), so the decode rate is nan; "
              "raise --extra-tokens or --repeats", file=sys.stderr)
    return {"shape": args.shape, "dtype": args.dtype, "batch": batch, "prompt_len": args.prompt_len,
            "new_tokens": [args.new_tokens, n_long], **{k: round(v, 4) if isinstance(v, float) else v
                                                       for k, v in timing.items()},
            "e2e_tokens_per_s": round(batch * n_long / timing["wall_long_s"], 1),
            "decode_tokens_per_s": round(decode, 1),
            "decode_step_ms": round(1e3 * decode_s / args.extra_tokens, 4)}


# ------------------------------------------------------------------------------------------------ ours
FUSE = {"auto": "auto", "0": False, "1": True}  # --fuse-projections -> JaxSampler(fuse_projections=...)


def run_jax(args) -> list[dict]:
    import asyncio

    import jax
    import jax.numpy as jnp

    from agentfly_jax.models import CausalLM, ModelConfig, decode, init_params
    from agentfly_jax.rollout.backends.jax_sampler import JaxSampler

    if args.pallas:
        decode.set_pallas_tuning(args.pallas)
    shape = SHAPES[args.shape]
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    max_len = args.prompt_len + args.new_tokens + args.extra_tokens
    config = ModelConfig(**shape, qkv_bias=True, family="qwen2", dtype=dtype, param_dtype=dtype,
                         max_position_embeddings=max(max_len, 2048))
    model = CausalLM(config)
    params = init_params(model, jax.random.PRNGKey(0))
    device = jax.devices()[0]
    results = []
    for batch, tensor_parallel, fuse, gemm in [(b, tp, f, g) for b in args.batches for tp in args.tensor_parallel
                                               for f in args.fuse_projections for g in args.gpu_gemm]:
        prompts = _prompts(args, batch).tolist()
        # prefix caching off: every round repeats the same prompts, which it would serve from the previous round
        sampler = JaxSampler(model, params, max_slots=batch, max_len=max_len, steps_per_call=args.steps_per_call,
                             prefix_caching=False, sampling_noise=args.sampling_noise,
                             decode_attention=args.decode_attention, tensor_parallel=tensor_parallel,
                             fuse_projections=FUSE[fuse], gpu_gemm=gemm)
        loop = asyncio.new_event_loop()

        def one_round(n, sampler=sampler, prompts=prompts, loop=loop):
            async def go():
                return await asyncio.gather(*[sampler.generate(p, max_tokens=n, temperature=1.0, seed=i)
                                              for i, p in enumerate(prompts)])
            out = loop.run_until_complete(go())
            assert all(len(c[0].token_ids) == n for c in out), "a sequence ended early"

        timing = _measure(one_round, args)
        loop.run_until_complete(sampler.close())
        loop.close()
        result = {"impl": "agentfly_jax.JaxSampler", "device": device.device_kind, "jax": jax.__version__,
                  "decode_attention": sampler.decode_attention, "sampling_noise": sampler.sampling_noise,
                  "pallas": args.pallas, "tensor_parallel": tensor_parallel,
                  "fuse_projections": sampler.fuse_projections, "gpu_gemm": sampler.gpu_gemm,
                  "cache_sharding": str(sampler._cache["k"][0].sharding.spec if sampler.mesh is not None else None),
                  "steps_per_call": args.steps_per_call, "compiles": dict(sampler.compile_counts),
                  **_summary(args, batch, timing)}
        results.append(result)
        del sampler
    return results


# ------------------------------------------------------------------------------------------------ grpo mode
def _grpo_workload(args, vocab: int):
    """Per task: prompt ids; per (task, chain, turn): (max_tokens, observation ids). Fixed by --seed."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, vocab, int(rng.integers(max(args.prompt_len // 2, 2), args.prompt_len + 1))).tolist()
               for _ in range(args.prompts)]
    turns = {(t, c, k): (int(rng.integers(max(args.new_tokens // 2, 1), args.new_tokens + 1)),
                         rng.integers(0, vocab, int(rng.integers(1, args.obs_len + 1))).tolist())
             for t in range(args.prompts) for c in range(args.chains) for k in range(args.turns)}
    return prompts, turns


def run_grpo(args) -> list[dict]:
    import asyncio

    import jax
    import jax.numpy as jnp

    from agentfly_jax.models import CausalLM, ModelConfig, decode, init_params
    from agentfly_jax.rollout.backends.jax_sampler import JaxSampler

    if args.pallas:
        decode.set_pallas_tuning(args.pallas)
    shape = SHAPES[args.shape]
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    prompts, turns = _grpo_workload(args, shape["vocab_size"])
    max_len = args.prompt_len + args.turns * (args.new_tokens + args.obs_len)
    config = ModelConfig(**shape, qkv_bias=True, family="qwen2", dtype=dtype, param_dtype=dtype,
                         max_position_embeddings=max(max_len, 2048))
    model = CausalLM(config)
    params = init_params(model, jax.random.PRNGKey(0))
    device = jax.devices()[0]

    async def chain(sampler, task, c):
        prompt, out = list(prompts[task]), []
        for k in range(args.turns):
            max_tokens, observation = turns[task, c, k]
            [completion] = await sampler.generate(prompt, max_tokens=max_tokens, temperature=1.0,
                                                  seed=(task * args.chains + c) * args.turns + k)
            out.append(completion.token_ids)
            prompt = prompt + completion.token_ids + observation
        return out

    async def one_round(sampler):
        return await asyncio.gather(*[chain(sampler, t, c) for t in range(args.prompts) for c in range(args.chains)])

    results, outputs = [], {}
    for caching in (True, False):
        sampler = JaxSampler(model, params, max_slots=args.slots, max_len=max_len,
                             steps_per_call=args.steps_per_call, prefix_caching=caching,
                             sampling_noise=args.sampling_noise, decode_attention=args.decode_attention)
        loop = asyncio.new_event_loop()
        t0 = time.perf_counter()
        loop.run_until_complete(one_round(sampler))  # warm-up: compiles
        warmup_s = time.perf_counter() - t0
        compiled, walls = sum(sampler.compile_counts.values()), []
        for repeat in range(args.repeats):
            # a weight update (the same params) drops what the round before cached: each round starts cold
            loop.run_until_complete(sampler.update_weights(params, version=1 + repeat))
            before = dict(sampler.stats)
            t0 = time.perf_counter()
            outputs[caching] = loop.run_until_complete(one_round(sampler))
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls)
        loop.run_until_complete(sampler.close())
        loop.close()
        stats = {k: sampler.stats[k] - before.get(k, 0) for k in
                 ("prompt_tokens", "prefill_tokens", "prefix_hits", "prefix_shared", "prefix_tokens_reused",
                  "prefix_evictions", "prefix_copies", "prefill_calls", "decode_calls", "tokens")}
        results.append({"impl": "agentfly_jax.JaxSampler", "mode": "grpo", "prefix_caching": caching,
                        "device": device.device_kind, "jax": jax.__version__, "shape": args.shape,
                        "dtype": args.dtype, "prompts": args.prompts, "chains": args.chains, "turns": args.turns,
                        "slots": args.slots, "max_len": max_len, "steps_per_call": args.steps_per_call,
                        "warmup_s": round(warmup_s, 2), "wall_s": round(wall, 3),
                        "wall_s_rounds": [round(w, 3) for w in walls],
                        "generated_tokens_per_s": round(stats["tokens"] / wall, 1), **stats,
                        "compiles": dict(sampler.compile_counts),
                        "compiles_in_measured_round": sum(sampler.compile_counts.values()) - compiled})
        del sampler
    pairs = [(a, b) for ca, cb in zip(outputs[True], outputs[False]) for a, b in zip(ca, cb)]
    equal = sum(a == b for a, b in pairs) / len(pairs)
    for r in results:
        r["completions_equal_other_setting"] = round(equal, 4)
    return results


# ------------------------------------------------------------------------------------------------ peer
def run_torch(args) -> list[dict]:
    import torch
    import transformers

    shape = SHAPES[args.shape]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    max_len = args.prompt_len + args.new_tokens + args.extra_tokens
    cfg = transformers.Qwen2Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
        tie_word_embeddings=shape["tie_word_embeddings"], max_position_embeddings=max(max_len, 2048))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(device)
    model.eval()
    results = []
    for batch in args.batches:
        ids = torch.as_tensor(_prompts(args, batch), device=device)
        mask = torch.ones_like(ids)

        def one_round(n, ids=ids, mask=mask):
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                     top_p=1.0, top_k=0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
            if cuda:
                torch.cuda.synchronize()
            assert out.shape[1] == ids.shape[1] + n

        timing = _measure(one_round, args)
        name = torch.cuda.get_device_name() if cuda else "cpu"
        results.append({"impl": "transformers.generate", "device": name, "torch": torch.__version__,
                        "transformers": transformers.__version__, **_summary(args, batch, timing)})
    return results


# ------------------------------------------------------------------------------------------------ driver
def _bandwidth(device: str, override: float | None) -> float | None:
    if override:
        return override
    return next((bw for name, bw in HBM_BYTES_PER_S.items() if name in device), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64, help="N of the short round")
    p.add_argument("--extra-tokens", type=int, default=256, help="the long round samples N + this many")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--steps-per-call", type=int, default=8, help="JaxSampler decode steps per jitted call")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sampling-noise", choices=["hash", "threefry"], default="hash", help="JaxSampler sampling_noise")
    p.add_argument("--decode-attention", default="auto", help="JaxSampler decode_attention")
    p.add_argument("--pallas", help="the Pallas decode kernel's 'splits,block_k,warps' (decode.set_pallas_tuning)")
    p.add_argument("--bandwidth", type=float, help="HBM bytes/s for the roofline (default: by device name)")
    p.add_argument("--impl", choices=["all", "jax", "torch"], default="all")
    p.add_argument("--mode", choices=["decode", "grpo"], default="decode",
                   help="decode: tokens/s against transformers; grpo: prefix caching on/off (module docstring)")
    p.add_argument("--prompts", type=int, default=64, help="grpo: tasks")
    p.add_argument("--chains", type=int, default=8, help="grpo: chains per task (the GRPO group)")
    p.add_argument("--turns", type=int, default=3, help="grpo: turns per chain")
    p.add_argument("--obs-len", type=int, default=64, help="grpo: longest observation between turns")
    p.add_argument("--slots", type=int, default=256, help="grpo: JaxSampler max_slots")
    p.add_argument("--seed", type=int, default=0, help="grpo: the workload's random lengths and ids")
    p.add_argument("--tensor-parallel", type=int, nargs="+", default=[1],
                   help="our side once per value, on that many local devices (JaxSampler(tensor_parallel=N))")
    p.add_argument("--fuse-projections", nargs="+", choices=sorted(FUSE), default=["auto"],
                   help="our side once per value: JaxSampler(fuse_projections=...): 1 serves q/k/v and gate/up as "
                        "joined GEMMs, 0 as the model's own, auto (the default) joined on one device")
    p.add_argument("--gpu-gemm", nargs="+", choices=GPU_GEMMS, default=["triton"],
                   help="our side once per value: JaxSampler(gpu_gemm=...), the programs' matrix products on a GPU "
                        "through XLA's Triton fusions (the default), cuBLAS, or Triton with every tiling tried")
    p.add_argument("--out", help="append the JSON results to this file")
    args = p.parse_args(argv)
    if min(args.tensor_parallel) < 1 or (args.mode == "grpo" and (args.tensor_parallel != [1]
                                                                  or args.fuse_projections != ["auto"]
                                                                  or args.gpu_gemm != ["triton"])):
        p.error("--tensor-parallel takes values >= 1; it, --fuse-projections and --gpu-gemm are for the decode mode "
                "only")

    if args.mode == "grpo":
        results = run_grpo(args)
        for r in results:
            print(json.dumps(r), flush=True)
        on, off = results
        print(f"SUMMARY grpo {args.shape} {args.dtype} {args.prompts}x{args.chains}x{args.turns} turns, "
              f"{args.slots} slots on {on['device']}: prompt tokens computed {on['prefill_tokens']} with prefix "
              f"caching vs {off['prefill_tokens']} without ({on['prefill_tokens'] / off['prefill_tokens']:.3f}x) "
              f"of {on['prompt_tokens']} needed, {on['prefix_hits']} prefix hits; wall {on['wall_s']:.2f} s vs "
              f"{off['wall_s']:.2f} s ({off['wall_s'] / on['wall_s']:.2f}x); completions equal: "
              f"{on['completions_equal_other_setting']:.3f}", flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps({"grpo": results}) + "\n")
        return 0

    if args.impl != "all":
        results = run_jax(args) if args.impl == "jax" else run_torch(args)
        for r in results:
            print("RESULT " + json.dumps(r), flush=True)
        return 0

    sides = {}
    for impl in ("jax", "torch"):
        cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
               "--impl", impl]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        runs = len(args.batches) * (len(args.tensor_parallel) * len(args.fuse_projections) * len(args.gpu_gemm)
                                    if impl == "jax" else 1)
        if proc.returncode != 0 or len(lines) != runs:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"benchmark side {impl!r} failed (exit {proc.returncode})")
        sides[impl] = [json.loads(ln[len("RESULT "):]) for ln in lines]

    shape = SHAPES[args.shape]
    bytes_per_value = 2 if args.dtype == "bfloat16" else 4
    peers = {peer["batch"]: peer for peer in sides["torch"]}
    for ours in sides["jax"]:
        batch, peer, tp = ours["batch"], peers[ours["batch"]], ours["tensor_parallel"]
        mean_context = args.prompt_len + args.new_tokens + args.extra_tokens / 2  # over the decode-only steps
        roof = roofline(shape, batch, mean_context, bytes_per_value, _bandwidth(ours["device"], args.bandwidth), tp)
        ours["roofline"] = roof
        print(json.dumps(ours))
        print(json.dumps(peer))
        ratio = ours["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
        vs_roof = (f", {roof['tokens_per_s'] / ours['decode_tokens_per_s']:.2f}x below the HBM roofline "
                   f"({roof['tokens_per_s']:.0f} tok/s, {roof['step_ms']} ms/step)" if roof.get("tokens_per_s")
                   else ", no roofline (unknown device bandwidth; pass --bandwidth)")
        where = (ours["device"] + (f" x{tp} (tensor parallel)" if tp > 1 else "")
                 + (", q/k/v and gate/up fused" if ours["fuse_projections"] else "")
                 + (f", {ours['gpu_gemm']} GEMMs" if ours["gpu_gemm"] != "triton" else ""))
        print(f"SUMMARY {args.shape} {args.dtype} batch={batch} prompt={args.prompt_len} on {where}: "
              f"decode ours {ours['decode_tokens_per_s']:.0f} tok/s ({ours['decode_step_ms']} ms/step) vs "
              f"transformers.generate {peer['decode_tokens_per_s']:.0f} tok/s ({peer['decode_step_ms']} ms/step): "
              f"{ratio:.1f}x{vs_roof}; end-to-end {ours['e2e_tokens_per_s']:.0f} vs "
              f"{peer['e2e_tokens_per_s']:.0f} tok/s", flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps({"ours": ours, "peer": peer, "decode_ratio": ratio}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
