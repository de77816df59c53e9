"""Benchmark: one decode step's attention over a sampler-shaped KV cache, all layers, by implementation.

    python scripts/bench_decode_attention.py                     # Qwen2.5-0.5B's heads, bf16, batch 64 and 256 (GPU)
    python scripts/bench_decode_attention.py --batches 2 --layers 2 --max-len 256 --live 40 --dtype float32 \
        --impls xla pallas_interpret                               # the CPU check (Pallas in interpret mode)

Every implementation gets the same queries [layers, B, H, D] and cache, whose rows hold `--live` tokens (the
mean context) in a cache of `--max-len` positions, and returns the attention outputs of every layer:
  xla       the sampler's einsum path: cache [L, B, S, K, D], keys of a power-of-two window >= the live length,
            positions beyond each row's length masked;
  pallas    jax's Pallas GPU decode-attention kernel (split-K, reads each row's keys up to its length only) on a
            cache [L, B, K, S, D] (each kv head's keys contiguous), whole cache, per-row lengths;
  pallas_layers  the same kernel on one [B, K, S, D] buffer per layer (no layer slice for XLA to copy).
Reports ms per step (all layers), the effective bandwidth of the live KV read and the largest difference from
`xla` (same inputs), as JSON lines.
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
    p.add_argument("--impls", nargs="+", default=["xla", "pallas", "pallas_layers"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from agentfly_jax.models.transformer import dot_product_attention

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    L, K, H, D, S = args.layers, args.kv_heads, args.heads, args.head_dim, args.max_len
    G = H // K
    window = 1 << (args.live - 1).bit_length()

    def xla(q, cache_k, cache_v, lengths):  # cache [L, B, S, K, D], q [L, B, H, D]
        mask = (jnp.arange(window)[None, :] < lengths[:, None])[:, None, :]  # [B, 1, window]
        outs = [dot_product_attention(q[i][:, None], cache_k[i, :, :window], cache_v[i, :, :window], mask, "xla")[:, 0]
                for i in range(L)]
        return jnp.stack(outs)

    def pallas_impl(interpret):
        from jax.experimental.pallas.ops.gpu.decode_attention import mqa

        def one(q, k, v, lengths):  # q [B, H, D], k/v [B, K, S, D]
            b = q.shape[0]
            out = mqa(q.reshape(b * K, G, D), k.reshape(b * K, S, D), v.reshape(b * K, S, D),
                      kv_seq_len=jnp.repeat(lengths, K), interpret=interpret)
            return out.reshape(b, H, D)

        def whole(q, cache_k, cache_v, lengths):  # cache [L, B, K, S, D]
            return jnp.stack([one(q[i], cache_k[i], cache_v[i], lengths) for i in range(L)])

        def layers(q, ks, vs, lengths):  # tuples of L buffers [B, K, S, D]
            return jnp.stack([one(q[i], ks[i], vs[i], lengths) for i in range(L)])
        return whole, layers

    rows = []
    for batch in args.batches:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((L, batch, H, D)), dtype)
        kk = rng.standard_normal((L, batch, S, K, D)).astype(np.float32)
        vv = rng.standard_normal((L, batch, S, K, D)).astype(np.float32)
        lengths = jnp.asarray(rng.integers(args.live // 2, 3 * args.live // 2, batch).clip(1, window), jnp.int32)
        inputs = {"xla": (jnp.asarray(kk, dtype), jnp.asarray(vv, dtype))}
        head_major = (jnp.asarray(kk.transpose(0, 1, 3, 2, 4), dtype), jnp.asarray(vv.transpose(0, 1, 3, 2, 4), dtype))
        reference = None
        for impl in args.impls:
            if impl == "xla":
                fn, cache = xla, inputs["xla"]
            elif impl.startswith("pallas"):
                whole, layers = pallas_impl(interpret=impl.endswith("interpret"))
                if impl.startswith("pallas_layers"):
                    fn, cache = layers, tuple(tuple(c[i] for i in range(L)) for c in head_major)
                else:
                    fn, cache = whole, head_major
            else:
                raise SystemExit(f"unknown impl {impl!r}")
            run = jax.jit(fn)
            out = jax.block_until_ready(run(q, *cache, lengths))
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                jax.block_until_ready(run(q, *cache, lengths))
                times.append(time.perf_counter() - t)
            ms = 1e3 * statistics.median(times)
            out = np.asarray(out, np.float32)
            if reference is None:
                reference = out
            live_bytes = 2 * L * int(np.asarray(lengths).sum()) * K * D * jnp.dtype(dtype).itemsize
            row = {"impl": impl, "batch": batch, "layers": L, "live_mean": float(np.asarray(lengths).mean()),
                   "max_len": S, "window": window, "dtype": args.dtype, "ms": round(ms, 4),
                   "live_kv_gb_per_s": round(live_bytes / (ms / 1e3) / 1e9, 1),
                   "max_abs_diff_vs_first": float(np.max(np.abs(out - reference))),
                   "device": jax.devices()[0].device_kind}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
