"""Benchmark: one decode step's attention over a sampler-shaped KV cache, all layers, by implementation.

    python scripts/bench_decode_attention.py                     # Qwen2.5-0.5B's heads, bf16, batch 64 and 256 (GPU)
    python scripts/bench_decode_attention.py --splits 4 8 16 --block-k 32 64 128 --warps 0 2 4   # a tuning sweep
    python scripts/bench_decode_attention.py --batches 2 --layers 2 --max-len 256 --live 40 --dtype float32 \
        --impls xla_stacked xla pallas_interpret                   # the CPU check (Pallas interpreted)

Every implementation gets the same queries [layers, B, H, D] and cache, whose rows hold about `--live` tokens
(uniform in [live/2, 3 live/2]) in a cache of `--max-len` positions, and returns the attention outputs of every
layer:
  xla_stacked  the einsum over one cache [L, B, S, K, D] for all layers (the sampler's layout until 2026-11-27):
               each layer's keys of a power-of-two window >= the longest row are a strided slice (a copy);
  xla          the sampler's einsum path now (`decode._attend`): one [B, K, S, D] buffer per layer, the window's
               keys, positions beyond each row's length masked;
  pallas       the sampler's Pallas path (`decode._attend_pallas`: jax's Pallas GPU decode-attention kernel, split
               over the sequence, reading each row's keys up to its length) on the same per-layer buffers, for
               every combination of --splits, --block-k and --warps (`decode.PALLAS_*`);
  pallas_interpret  the same kernel through the Pallas interpreter (CPU).
Reports ms per step (all layers), the effective bandwidth of the live KV read and the largest difference from the
first implementation (same inputs), as JSON lines; the fastest Pallas setting last ("best": true).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--live", type=int, default=288, help="tokens in every row (mean context)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--impls", nargs="+", default=["xla_stacked", "xla", "pallas"])
    p.add_argument("--splits", type=int, nargs="+", default=[16], help="pallas: decode.PALLAS_SPLITS values")
    p.add_argument("--block-k", type=int, nargs="+", default=[128], help="pallas: decode.PALLAS_BLOCK_K values")
    p.add_argument("--warps", type=int, nargs="+", default=[0], help="pallas: decode.PALLAS_WARPS (0: default)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from agentfly_jax.models import decode
    from agentfly_jax.models.transformer import dot_product_attention

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    L, K, H, D, S = args.layers, args.kv_heads, args.heads, args.head_dim, args.max_len
    if args.live * 3 // 2 > S:
        raise SystemExit(f"--live {args.live} needs --max-len >= {args.live * 3 // 2}")

    def xla_stacked(q, cache_k, cache_v, lengths, window):  # cache [L, B, S, K, D], q [L, B, H, D]
        mask = (jnp.arange(window)[None, :] < lengths[:, None])[:, None, :]  # [B, 1, window]
        return jnp.stack([dot_product_attention(q[i][:, None], cache_k[i, :, :window], cache_v[i, :, :window], mask,
                                                "xla")[:, 0] for i in range(L)])

    def xla(q, ks, vs, lengths, window):  # tuples of L buffers [B, K, S, D]
        mask = (jnp.arange(window)[None, :] < lengths[:, None])[:, None, :]
        return jnp.stack([decode._attend(q[i][:, None], ks[i][:, :, :window], vs[i][:, :, :window], mask)[:, 0]
                          for i in range(L)])

    def pallas(q, ks, vs, lengths, interpret):
        return jnp.stack([decode._attend_pallas(q[i], ks[i], vs[i], lengths, interpret) for i in range(L)])

    def settings(impl):
        if not impl.startswith("pallas"):
            return [None]
        return [(sp, bk, w) for sp in args.splits for bk in args.block_k for w in args.warps]

    rows = []
    for batch in args.batches:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((L, batch, H, D)), dtype)
        kk = rng.standard_normal((L, batch, S, K, D)).astype(np.float32)
        vv = rng.standard_normal((L, batch, S, K, D)).astype(np.float32)
        lengths_np = rng.integers(args.live // 2, 3 * args.live // 2 + 1, batch).clip(1, S)
        lengths = jnp.asarray(lengths_np, jnp.int32)
        window = min(1 << (int(lengths_np.max()) - 1).bit_length(), S)
        stacked = (jnp.asarray(kk, dtype), jnp.asarray(vv, dtype))
        per_layer = tuple(tuple(jnp.asarray(c[i].transpose(0, 2, 1, 3), dtype) for i in range(L)) for c in (kk, vv))
        reference, pallas_rows = None, []
        for impl in args.impls:
            for setting in settings(impl):
                if impl == "xla_stacked":
                    run = jax.jit(xla_stacked, static_argnums=4)
                    call = lambda run=run: run(q, *stacked, lengths, window)  # noqa: E731
                elif impl == "xla":
                    run = jax.jit(xla, static_argnums=4)
                    call = lambda run=run: run(q, *per_layer, lengths, window)  # noqa: E731
                elif impl in ("pallas", "pallas_interpret"):
                    decode.PALLAS_SPLITS, decode.PALLAS_BLOCK_K = setting[0], setting[1]
                    decode.PALLAS_WARPS = setting[2] or None
                    run = jax.jit(pallas, static_argnums=4)  # a new jit per setting: the constants are read at trace
                    call = lambda run=run, i=impl: run(q, *per_layer, lengths, i == "pallas_interpret")  # noqa: E731
                else:
                    raise SystemExit(f"unknown impl {impl!r}")
                try:
                    out = jax.block_until_ready(call())
                except Exception as e:  # a kernel setting Triton refuses: report it, try the next
                    row = {"impl": impl, "batch": batch, "setting": setting, "error": f"{type(e).__name__}: {e}"[:300]}
                    print(json.dumps(row), flush=True)
                    continue
                times = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    jax.block_until_ready(call())
                    times.append(time.perf_counter() - t)
                ms = 1e3 * statistics.median(times)
                out = np.asarray(out, np.float32)
                if reference is None:
                    reference = out
                live_bytes = 2 * L * int(lengths_np.sum()) * K * D * jnp.dtype(dtype).itemsize
                row = {"impl": impl, "batch": batch, "layers": L, "live_mean": float(lengths_np.mean()), "max_len": S,
                       "window": window, "dtype": args.dtype, "ms": round(ms, 4),
                       "live_kv_gb_per_s": round(live_bytes / (ms / 1e3) / 1e9, 1),
                       "max_abs_diff_vs_first": float(np.max(np.abs(out - reference))),
                       "device": jax.devices()[0].device_kind}
                if setting:
                    row.update(splits=setting[0], block_k=setting[1], warps=setting[2] or None)
                    pallas_rows.append(row)
                rows.append(row)
                print(json.dumps(row), flush=True)
        if pallas_rows:
            best = dict(min(pallas_rows, key=lambda r: r["ms"]), best=True)
            rows.append(best)
            print(json.dumps(best), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
