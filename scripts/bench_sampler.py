"""Benchmark: decode tokens/s of JaxSampler against HF transformers `generate` on the same card, with the HBM
roofline.

    python scripts/bench_sampler.py                    # Qwen2.5-0.5B shape, bf16, batch 64 and 256 (GPU)
    python scripts/bench_sampler.py --shape tiny --batches 2 4 --prompt-len 8 --new-tokens 16 --extra-tokens 16
                                                       # the short CPU version CI runs

Both sides get random weights of the same shape (bf16), the same batch of random prompts (`--prompt-len`
tokens each) and sample with temperature 1 (no top-p/top-k, no stop tokens) until every sequence has its
tokens. Ours: `batch` concurrent `JaxSampler.generate` calls (continuous batching, `batch` slots). Peer:
`model.generate(do_sample=True)` on the padded batch (sdpa attention, dynamic KV cache).

Each side runs every batch size twice after a warm-up, with N = --new-tokens and N + --extra-tokens new tokens;
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

from agentfly_jax.models.shapes import SHAPES  # noqa: E402
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # matched in this order against the device name


def param_count(shape: dict) -> int:
    h, f, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_layers"], shape["vocab_size"]
    d = h // shape["num_heads"]
    q, kv = shape["num_heads"] * d, shape["num_kv_heads"] * d
    per_layer = h * q + 2 * h * kv + q * h + (q + 2 * kv) + 3 * h * f + 2 * h
    return v * h * (1 if shape["tie_word_embeddings"] else 2) + layers * per_layer + h


def roofline(shape: dict, batch: int, mean_context: float, bytes_per_value: int, bandwidth: float | None) -> dict:
    """Bytes one decode step must move from HBM and the implied best step time and tokens/s."""
    d = shape["hidden_size"] // shape["num_heads"]
    kv_per_token = 2 * shape["num_layers"] * shape["num_kv_heads"] * d * bytes_per_value
    weight_bytes = param_count(shape) * bytes_per_value  # the tied embedding is read once, as the lm_head
    kv_bytes = batch * mean_context * kv_per_token
    out = {"weight_bytes": weight_bytes, "kv_bytes_per_step": int(kv_bytes), "bandwidth": bandwidth}
    if bandwidth:
        step_s = (weight_bytes + kv_bytes) / bandwidth
        out.update(step_ms=round(1e3 * step_s, 4), tokens_per_s=round(batch / step_s, 1))
    return out


def _prompts(args, batch: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, SHAPES[args.shape]["vocab_size"], (batch, args.prompt_len), dtype=np.int64)


def _measure(generate_round, args) -> dict:
    """Warm-up, then wall times of `args.repeats` rounds at N and at N + extra new tokens (medians)."""
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
    return {"warmup_s": round(warmup_s, 2), "wall_short_s": statistics.median(short),
            "wall_long_s": statistics.median(long)}


def _summary(args, batch: int, timing: dict) -> dict:
    n_long = args.new_tokens + args.extra_tokens
    decode_s = timing["wall_long_s"] - timing["wall_short_s"]
    decode = batch * args.extra_tokens / decode_s if decode_s > 0 else float("nan")
    return {"shape": args.shape, "dtype": args.dtype, "batch": batch, "prompt_len": args.prompt_len,
            "new_tokens": [args.new_tokens, n_long], **{k: round(v, 4) if isinstance(v, float) else v
                                                       for k, v in timing.items()},
            "e2e_tokens_per_s": round(batch * n_long / timing["wall_long_s"], 1),
            "decode_tokens_per_s": round(decode, 1),
            "decode_step_ms": round(1e3 * decode_s / args.extra_tokens, 4)}


# ------------------------------------------------------------------------------------------------ ours
def run_jax(args) -> list[dict]:
    import asyncio

    import jax
    import jax.numpy as jnp

    from agentfly_jax.models import CausalLM, ModelConfig, init_params
    from agentfly_jax.rollout.backends.jax_sampler import JaxSampler

    shape = SHAPES[args.shape]
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    max_len = args.prompt_len + args.new_tokens + args.extra_tokens
    config = ModelConfig(**shape, qkv_bias=True, family="qwen2", dtype=dtype, param_dtype=dtype,
                         max_position_embeddings=max(max_len, 2048))
    model = CausalLM(config)
    params = init_params(model, jax.random.PRNGKey(0))
    device = jax.devices()[0]
    results = []
    for batch in args.batches:
        prompts = _prompts(args, batch).tolist()
        sampler = JaxSampler(model, params, max_slots=batch, max_len=max_len, steps_per_call=args.steps_per_call)
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
                  "steps_per_call": args.steps_per_call, "compiles": dict(sampler.compile_counts),
                  **_summary(args, batch, timing)}
        results.append(result)
        del sampler
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
    p.add_argument("--bandwidth", type=float, help="HBM bytes/s for the roofline (default: by device name)")
    p.add_argument("--impl", choices=["all", "jax", "torch"], default="all")
    p.add_argument("--out", help="append the JSON results to this file")
    args = p.parse_args(argv)

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
        if proc.returncode != 0 or len(lines) != len(args.batches):
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"benchmark side {impl!r} failed (exit {proc.returncode})")
        sides[impl] = [json.loads(ln[len("RESULT "):]) for ln in lines]

    shape = SHAPES[args.shape]
    bytes_per_value = 2 if args.dtype == "bfloat16" else 4
    for ours, peer in zip(sides["jax"], sides["torch"]):
        batch = ours["batch"]
        mean_context = args.prompt_len + args.new_tokens + args.extra_tokens / 2  # over the decode-only steps
        roof = roofline(shape, batch, mean_context, bytes_per_value, _bandwidth(ours["device"], args.bandwidth))
        ours["roofline"] = roof
        print(json.dumps(ours))
        print(json.dumps(peer))
        ratio = ours["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
        vs_roof = (f", {roof['tokens_per_s'] / ours['decode_tokens_per_s']:.2f}x below the HBM roofline "
                   f"({roof['tokens_per_s']:.0f} tok/s, {roof['step_ms']} ms/step)" if roof.get("tokens_per_s")
                   else ", no roofline (unknown device bandwidth; pass --bandwidth)")
        print(f"SUMMARY {args.shape} {args.dtype} batch={batch} prompt={args.prompt_len} on {ours['device']}: "
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
