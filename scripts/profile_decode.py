"""Profile: where a JaxSampler decode step spends its time, from a `jax.profiler` trace of the sampler's own
jitted decode program, with the device ops grouped by kind.

    python scripts/profile_decode.py                          # Qwen2.5-0.5B shape, bf16, batch 64 and 256 (GPU)
    python scripts/profile_decode.py --shape tiny --dtype float32 --batches 4 --context 32 --steps 4   # CPU check

Every slot of a `JaxSampler` (prefix caching off) holds a sequence of `--context` tokens; the sampler's decode
program (`steps_per_call` steps, temperature 1, no top-p/top-k) then runs `--calls` times under the profiler. The
trace's device events (XLA ops on a GPU, or the host's XLA ops on a CPU) are summed by op name and grouped into
kinds by the HLO op names they carry (matmuls, attention, sampling, cache writes, copies, ...); the JSON line per
batch lists the kinds and the top ops with their share of the device time and the measured ms per step.
`--keep-trace DIR` keeps the raw trace (open it with TensorBoard's profile plugin or xprof).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # trace_timeline

from agentfly_jax.models.config import GPU_GEMMS  # noqa: E402
from agentfly_jax.models.shapes import SHAPES  # noqa: E402
from bench_sampler import FUSE  # noqa: E402
from trace_timeline import device_timelines, hlo_labels, kernel_key  # noqa: E402

# the named scopes of models/decode.py and the sampler's decode program, found in an op's HLO metadata
SCOPES = ("sampling", "lm_head", "cache_write", "attention", "qkv", "o_proj", "mlp")
# otherwise: op name (lower case) -> kind; the first pattern that matches wins
KINDS = (
    ("cache_write", r"scatter|dynamic-update-slice|dynamic_update_slice"),
    ("sampling", r"rng|threefry|random|gumbel|argmax|sort|cumsum|reduce-window|log_softmax|logsumexp"),
    ("matmul", r"gemm|cublas|dot|matmul|triton_gemm|cutlass|sm90_xmma|nvjet"),
    ("attention", r"attention|softmax|flash|decode_attn"),
    ("copy", r"copy|transpose|bitcast|slice|concatenate"),
    ("elementwise / fusion", r"fusion|loop|input_reduce|reduce"),
)


def hlo_scopes(hlo_text: str) -> dict[str, str]:
    """kernel key -> the named scope (SCOPES) its HLO instruction's op_name carries (a fusion: the scope most of
    its fused instructions carry)."""
    return hlo_labels(hlo_text, lambda op_name: next(
        (s for s in SCOPES if re.search(rf"(^|/){s}(/|$)", op_name)), None))


def kind_of(name: str, scopes: dict[str, str] | None = None) -> str:
    if scopes and kernel_key(name) in scopes:
        return scopes[kernel_key(name)]
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def device_events(trace_dir: str) -> list[tuple[str, float]]:
    """(op name, duration ms) of every device op in the trace under `trace_dir` (GPU planes; the host's XLA ops
    when there is no GPU)."""
    return [(name, (end - start) / 1e6) for events in device_timelines(trace_dir).values()
            for name, start, end in events]


def summarise(events, steps: int, top: int, scopes: dict[str, str] | None = None) -> dict:
    by_op = collections.Counter()
    counts = collections.Counter()
    total = sum(ms for _, ms in events) or float("nan")
    for name, ms in events:
        by_op[name] += ms
        counts[name] += 1
    by_kind = collections.Counter()
    for name, ms in by_op.items():
        by_kind[kind_of(name, scopes)] += ms
    return {"device_ms_per_step": round(total / steps, 4),
            "kinds": {k: {"ms_per_step": round(ms / steps, 4), "share": round(ms / total, 4)}
                      for k, ms in by_kind.most_common()},
            "top_ops": [{"op": name[:120], "kind": kind_of(name, scopes), "ms_per_step": round(ms / steps, 4),
                         "share": round(ms / total, 4), "launches_per_step": round(counts[name] / steps, 2)}
                        for name, ms in by_op.most_common(top)]}


def profile_batch(args, model, params, batch: int) -> dict:
    import jax
    import numpy as np

    from agentfly_jax.rollout.backends.jax_sampler import JaxSampler, _bucket

    max_len = args.context + args.steps * (args.calls + 2) + 1
    sampler = JaxSampler(model, params, max_slots=batch, max_len=max_len, steps_per_call=args.steps,
                         prefix_caching=False, sampling_noise=args.noise,
                         decode_attention=args.attention,
                         fuse_projections=FUSE[args.fuse_projections],
                         gpu_gemm=args.gpu_gemm)
    cfg = sampler._cfg
    cfg["temperature"][:] = 1.0
    cfg["budget"][:] = max_len
    cfg["seed"][:] = np.arange(batch, dtype=np.uint32)
    cfg["alive"][:] = True
    state = dict(sampler._state)
    state["positions"] = jax.device_put(np.full(batch, args.context, np.int32), sampler.device)
    state["done"] = jax.device_put(np.zeros(batch, bool), sampler.device)
    cache, cfg_device = sampler._cache, jax.device_put(cfg, sampler.device)

    def run(cache, state, calls, position):
        for _ in range(calls):
            position += args.steps
            kv_len = _bucket(sampler.window_buckets, min(position + 1, max_len))
            cache, state, out = sampler._decode(sampler._params, cache, state, cfg_device, kv_len, False, args.steps)
        jax.block_until_ready(out)
        return cache, state

    cache, state = run(cache, state, 1, args.context)  # compile
    kv_len = _bucket(sampler.window_buckets, min(args.context + args.steps + 1, max_len))
    scopes = hlo_scopes(sampler._decode.lower(sampler._params, cache, state, cfg_device, kv_len, False,
                                              args.steps).compile().as_text())
    t = time.perf_counter()
    cache, state = run(cache, state, args.calls, args.context)
    wall_ms = 1e3 * (time.perf_counter() - t) / (args.calls * args.steps)
    trace_dir = args.keep_trace or tempfile.mkdtemp(prefix="decode-trace-")
    with jax.profiler.trace(os.path.join(trace_dir, f"batch{batch}")):
        cache, state = run(cache, state, args.calls, args.context)
    summary = summarise(device_events(os.path.join(trace_dir, f"batch{batch}")), args.calls * args.steps, args.top,
                        scopes)
    return {"batch": batch, "fuse_projections": sampler.fuse_projections, "gpu_gemm": sampler.gpu_gemm,
            "context": args.context, "steps_per_call": args.steps, "wall_ms_per_step": round(wall_ms, 4),
            "tokens_per_s": round(batch / wall_ms * 1e3, 1), **summary}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--context", type=int, default=288, help="tokens already in every slot (the mean context of "
                   "bench_sampler's default long round: 128 + 320 / 2)")
    p.add_argument("--steps", type=int, default=8, help="decode steps per jitted call (steps_per_call)")
    p.add_argument("--calls", type=int, default=8, help="decode calls profiled")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--noise", choices=["hash", "threefry"], default="hash", help="JaxSampler sampling_noise")
    p.add_argument("--attention", default="auto", help="JaxSampler decode_attention")
    p.add_argument("--pallas", help="the Pallas decode kernel's 'splits,block_k,warps' (decode.set_pallas_tuning)")
    p.add_argument("--fuse-projections", choices=sorted(FUSE), default="auto",
                   help="JaxSampler fuse_projections: 1 joins q/k/v and gate/up (decode.fuse_projections), 0 not")
    p.add_argument("--gpu-gemm", choices=GPU_GEMMS, default="triton",
                   help="JaxSampler gpu_gemm: how the decode program's matrix products compile on a GPU")
    p.add_argument("--top", type=int, default=25, help="ops listed")
    p.add_argument("--keep-trace", help="write the raw traces under this directory")
    p.add_argument("--out", help="append the JSON lines to this file")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from agentfly_jax.models import CausalLM, ModelConfig, init_params

    from agentfly_jax.models import decode

    if args.pallas:
        decode.set_pallas_tuning(args.pallas)
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    config = ModelConfig(**SHAPES[args.shape], qkv_bias=True, family="qwen2", dtype=dtype, param_dtype=dtype,
                         max_position_embeddings=4096)
    model = CausalLM(config)
    params = init_params(model, jax.random.PRNGKey(0))
    for batch in args.batches:
        row = {"shape": args.shape, "dtype": args.dtype, "device": jax.devices()[0].device_kind,
               "noise": args.noise, "attention": args.attention, "pallas": args.pallas,
               **profile_batch(args, model, params, batch)}
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
