"""Benchmark: token log-probabilities and entropies over the vocabulary, forward + backward, ours against autodiff.

    python scripts/bench_logprobs.py                                    # 8 x 1024 positions, Qwen2.5's vocabulary
    python scripts/bench_logprobs.py --batch 4 --seq-len 256 --vocab 32768 --repeats 5   # the CPU figures

Both sides take the same bf16 logits [B, T, V] and targets and compute the gradient of
sum(w1 * logprobs) + sum(w2 * entropy):
  ours      `algorithms.logprobs_from_logits` (a custom VJP: the backward keeps the logits and two fp32 numbers per
            position, and forms the gradient in one pass);
  autodiff  the textbook formula differentiated by JAX: fp32 log_softmax, the target's entry gathered,
            -sum(p log p); the backward keeps the fp32 log-softmax and scatters the target's gradient.
Reports median ms per call, the compiled program's temporary buffers (XLA's memory analysis) and the largest
gradient difference, as JSON lines.
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
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from agentfly_jax import algorithms

    b, t, v, tau = args.batch, args.seq_len, args.vocab, args.temperature
    logits = (3 * jax.random.normal(jax.random.key(0), (b, t, v))).astype(jnp.bfloat16)
    targets = jax.random.randint(jax.random.key(1), (b, t), 0, v)
    w_lp = jax.random.normal(jax.random.key(2), (b, t))
    w_h = jax.random.normal(jax.random.key(3), (b, t))

    def ours(x):
        lp, h = algorithms.logprobs_from_logits(x, targets, tau)
        return jnp.sum(lp * w_lp) + jnp.sum(h * w_h)

    def autodiff(x):
        log_p = jax.nn.log_softmax(x.astype(jnp.float32) / tau, axis=-1)
        lp = jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(lp * w_lp) + jnp.sum(-jnp.sum(jnp.exp(log_p) * log_p, axis=-1) * w_h)

    grads = {}
    out = open(args.out, "a") if args.out else None
    for name, fn in (("ours", ours), ("autodiff", autodiff)):
        compiled = jax.jit(jax.grad(fn)).lower(logits).compile()
        grads[name] = np.asarray(compiled(logits).astype(jnp.float32))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(logits))
            times.append(time.perf_counter() - t0)
        memory = compiled.memory_analysis()
        record = {"impl": name, "batch": b, "seq_len": t, "vocab": v, "temperature": tau,
                  "device": jax.devices()[0].device_kind, "ms": round(1e3 * statistics.median(times), 3),
                  "temp_mib": None if memory is None else round(memory.temp_size_in_bytes / 2**20, 1)}
        if name != "ours":
            record["max_abs_grad_diff_vs_ours"] = float(np.max(np.abs(grads[name] - grads["ours"])))
        print(json.dumps(record), flush=True)
        if out:
            out.write(json.dumps(record) + "\n")
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
