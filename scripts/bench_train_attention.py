"""Benchmark: the update step's attention (forward, and forward + backward) over packed rows, by implementation.

    python scripts/bench_train_attention.py                          # Qwen2.5-3B's heads, 8 x 1024, bf16 (GPU)
    python scripts/bench_train_attention.py --heads 14 --head-dim 64 # Qwen2.5-0.5B's heads
    python scripts/bench_train_attention.py --batch 2 --seq-len 64 --heads 4 --kv-heads 2 --head-dim 16 \
        --dtype float32 --impls xla                                  # the CPU check

Every implementation gets the same queries [B, T, H, D], keys and values [B, T, K, D] and rows packed as the
trainer packs them (`trainer/batch.py`): `--segments` sequences per row of random lengths, then `--pad` padding
positions (segment id 0), causal attention within each segment:
  xla                 the einsum path (`attention_impl="xla"`: fp32 softmax over a [B, T, T] segment mask);
  cudnn_mask          cuDNN's fused attention with that mask as a dense bias (`attention_impl="cudnn"` until
                      2026-11-28): every block of the T x T square is computed, and the backward also computes the
                      bias gradient;
  cudnn_mask_causal   the same with cuDNN's causal mask as well (blocks above the diagonal skipped);
  cudnn_segments      cuDNN's packed-sequence layout: each segment's start and length (`segment_layout`), causal
                      within them, no bias (`ModelConfig.attention_segments` = --max-segments: the model's path,
                      a `lax.cond` taking the dense mask where a row has more segments);
  cudnn_packed_kernel the packed-layout kernel alone (no cond; skipped where a row holds more runs than the bound);
  cudnn_causal        causal attention over the whole row, the segment boundaries ignored: what a peer that does
                      not pack runs; right only when every row is one sequence, so its difference is not checked.
Reports ms of the forward and of forward + backward (all --layers layers), and the largest difference of the
outputs and of the three input gradients from the first implementation (same inputs), as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def segment_ids_for(rng, batch: int, seq_len: int, segments: int, pad: int):
    """[B, T] int32: `segments` sequences of random lengths (each >= 1) per row, then `pad` zeros."""
    import numpy as np
    out = np.zeros((batch, seq_len), np.int32)
    used = seq_len - pad
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, used), size=segments - 1, replace=False)) if segments > 1 else []
        bounds = [0, *cuts, used]
        for s in range(segments):
            out[b, bounds[s]:bounds[s + 1]] = s + 1
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=1, help="timed calls per measurement (a model's layer count)")
    p.add_argument("--segments", type=int, nargs="+", default=[1, 4], help="sequences per row, one run each")
    p.add_argument("--pad", type=int, default=0, help="padding positions at the end of every row")
    p.add_argument("--max-segments", type=int, nargs="+", default=[0],
                   help="cudnn_segments: static bounds on segments per row, one run each (0: --segments, + 1 with "
                        "padding)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--impls", nargs="+",
                   default=["xla", "cudnn_mask", "cudnn_mask_causal", "cudnn_segments", "cudnn_packed_kernel",
                            "cudnn_causal"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from agentfly_jax.models.transformer import (SegmentMask, _packed_kernel, attention_mask, dot_product_attention,
                                                 segment_layout)
    from agentfly_jax.trainer.batch import row_runs

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    B, T, H, K, D = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim

    def impl_fn(name: str, max_segments: int):
        if name == "xla":
            return lambda q, k, v, seg: dot_product_attention(q, k, v, attention_mask(seg), "xla")
        if name == "cudnn_mask":
            return lambda q, k, v, seg: jax.nn.dot_product_attention(
                q, k, v, mask=attention_mask(seg)[:, None], implementation="cudnn")
        if name == "cudnn_mask_causal":
            return lambda q, k, v, seg: jax.nn.dot_product_attention(
                q, k, v, mask=attention_mask(seg)[:, None], is_causal=True, implementation="cudnn")
        if name == "cudnn_segments":
            return lambda q, k, v, seg: dot_product_attention(q, k, v, SegmentMask(seg, max_segments), "cudnn")
        if name == "cudnn_packed_kernel":
            return lambda q, k, v, seg: _packed_kernel(q, k, v, *segment_layout(seg, max_segments)[:2])
        if name == "cudnn_causal":
            return lambda q, k, v, seg: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                     implementation="cudnn")
        raise SystemExit(f"bench_train_attention: unknown implementation {name!r}")

    out_file = open(args.out, "a") if args.out else None
    rng = np.random.default_rng(0)
    for segments in args.segments:
        seg = jnp.asarray(segment_ids_for(rng, B, T, segments, args.pad))
        variants = [(name, m or segments + (1 if args.pad else 0))
                    for name in args.impls
                    for m in (args.max_segments if name in ("cudnn_segments", "cudnn_packed_kernel") else [0])]
        keys = jax.random.split(jax.random.key(segments), 4)
        q = jax.random.normal(keys[0], (B, T, H, D), dtype)
        k = jax.random.normal(keys[1], (B, T, K, D), dtype)
        v = jax.random.normal(keys[2], (B, T, K, D), dtype)
        ct = jax.random.normal(keys[3], (B, T, H, D), dtype)
        reference = None
        runs = int(row_runs(np.asarray(seg)).max())
        for name, max_segments in variants:
            if name == "cudnn_packed_kernel" and runs > max_segments:  # the layout would leave runs out: wrong
                print(json.dumps({"impl": name, "segments": segments, "max_segments": max_segments,
                                  "skipped": f"rows hold {runs} runs"}), flush=True)
                continue
            attend = impl_fn(name, max_segments)

            def forward(q, k, v, seg, attend=attend):
                return attend(q, k, v, seg)

            def both(q, k, v, seg, attend=attend):
                out, vjp = jax.vjp(lambda a, b_, c: attend(a, b_, c, seg), q, k, v)
                return (out, *vjp(ct))

            try:
                fwd = jax.jit(forward).lower(q, k, v, seg).compile()
                fb = jax.jit(both).lower(q, k, v, seg).compile()
                results = [np.asarray(x, np.float32) for x in fb(q, k, v, seg)]
            except Exception as e:  # an implementation this platform or jax lacks: say so, go on with the others
                record = {"impl": name, "segments": segments, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(json.dumps(record), flush=True)
                continue

            def timed(fn):
                jax.block_until_ready(fn(q, k, v, seg))
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    for _ in range(args.layers):
                        r = fn(q, k, v, seg)
                    jax.block_until_ready(r)
                    times.append(time.perf_counter() - t0)
                return 1e3 * statistics.median(times)

            record = {"impl": name, "batch": B, "seq_len": T, "heads": H, "kv_heads": K, "head_dim": D,
                      "segments": segments, "pad": args.pad, "layers": args.layers, "dtype": args.dtype,
                      "fwd_ms": round(timed(fwd), 3), "fwd_bwd_ms": round(timed(fb), 3),
                      "device": jax.devices()[0].device_kind}
            if name in ("cudnn_segments", "cudnn_packed_kernel"):
                record["max_segments"] = max_segments
            if reference is None:
                reference = (name, results)
            elif name != "cudnn_causal" or segments == 1 and not args.pad:
                record["vs"] = reference[0]
                record["max_abs_diff"] = {label: float(np.max(np.abs(a - b))) for label, a, b in
                                          zip(("out", "dq", "dk", "dv"), results, reference[1])}
            print(json.dumps(record), flush=True)
            if out_file:
                out_file.write(json.dumps(record) + "\n")
    if out_file:
        out_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
