"""Benchmark: LoRA against full fine-tuning in the same update step, memory and step time, on one device.

    python scripts/bench_lora.py                                   # Qwen2.5-0.5B and 1.5B shapes, bf16, 8 x 1024
    python scripts/bench_lora.py --shapes tiny --seq-len 64 --batch 2 --steps 2   # the short CPU version CI runs
    python scripts/bench_lora.py --compile-only                    # XLA's planned memory only (no weights made)

Each configuration runs `scripts/bench_update.py --impl jax` in its own process (full: every parameter trained,
AdamW moments for all; LoRA: rank-r adapters on q/k/v/o/gate/up/down, the base frozen, moments for the adapters
only), on random weights of the named shape, with the PPO policy loss over the same token batch. Reported per
run: median step time, tokens/s, the device's peak memory (where the runtime reports it: GPUs), trained and
optimiser values; and LoRA/full ratios. `--compile-only` instead lowers both steps on abstract inputs and prints
XLA's memory plan (arguments, outputs, temporaries): it needs no device memory for the weights, so the large
shapes can be planned on a small machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentfly_jax.models.shapes import SHAPES  # noqa: E402
from scripts.bench_update import side_result  # noqa: E402

BENCH_UPDATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_update.py")


def measured(shape: str, rank: int, args) -> dict:
    cmd = [sys.executable, BENCH_UPDATE, "--impl", "jax", "--shape", shape, "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--dtype", args.dtype, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--chunk", str(args.chunk), "--lora-rank", str(rank), "--fp32-params"]
    if args.remat:
        cmd.append("--remat")
    return side_result(cmd, f"{shape} lora_rank={rank}")


def planned(shape: str, rank: int, args) -> dict:
    """XLA's memory plan of one update step, lowered on abstract (ShapeDtypeStruct) state and batch."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from agentfly_jax.algorithms import get_recipe
    from agentfly_jax.models import CausalLM, ModelConfig, lora
    from agentfly_jax.models.transformer import init_params_shapes
    from agentfly_jax.trainer import OptimizerConfig, create_train_state, make_optimizer, make_train_step, pack_step
    from agentfly_jax.trainer.update import take_minibatch

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    model = CausalLM(ModelConfig(**SHAPES[shape], qkv_bias=True, family="qwen2", dtype=dtype,
                                 param_dtype=jnp.float32, remat=args.remat, lora_rank=rank))
    trainable = lora.is_adapter if rank else None
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-6, weight_decay=0.01))
    params = init_params_shapes(model)
    state = jax.eval_shape(lambda p: create_train_state(p, optimizer, trainable=trainable), params)
    alg = get_recipe("grpo").resolve({}, {"logprob_chunk": args.chunk or None})
    n, t = args.batch, args.seq_len
    batch = pack_step(np.zeros((n, t), np.int32), np.ones((n, t), np.float32), np.zeros((n, t), np.float32),
                      np.full(n, t), rewards=np.zeros(n, np.float32), group_ids=np.arange(n),
                      minibatch=np.zeros(n, np.int32), num_minibatches=1, micro_batches=1, row_len=t)
    zeros = np.zeros(batch.rows.tokens.shape, np.float32)
    rows = batch.rows.replace(old_logprobs=zeros, advantages=zeros, loss_weights=zeros)
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), take_minibatch(rows, 0))
    step = make_train_step(model, alg, optimizer, trainable=trainable)
    memory = step.lower(state, micro).compile().memory_analysis()
    gib = lambda b: round(b / 2**30, 3)  # noqa: E731
    params_count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return {"shape": shape, "lora_rank": rank, "device": jax.devices()[0].device_kind, "plan": "compile-only",
            "batch": n, "seq_len": t, "dtype": args.dtype, "remat": args.remat,
            "trained_values": lora.adapter_count(params) if rank else params_count,
            "optimizer_values": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.policy.opt_state)
                                    if len(x.shape) > 0),
            "argument_gib": gib(memory.argument_size_in_bytes), "output_gib": gib(memory.output_size_in_bytes),
            "temp_gib": gib(memory.temp_size_in_bytes), "alias_gib": gib(memory.alias_size_in_bytes),
            "planned_peak_gib": gib(memory.argument_size_in_bytes + memory.output_size_in_bytes
                                    - memory.alias_size_in_bytes + memory.temp_size_in_bytes)}


def _figures(result: dict, memory_key: str) -> str:
    return f"{result.get(memory_key)} GiB" + (f", {result['step_ms']} ms" if "step_ms" in result else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--chunk", type=int, default=256, help="positions per fp32 logits chunk (0: whole sequence)")
    p.add_argument("--remat", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile-only", action="store_true", help="XLA's memory plan instead of running the steps")
    p.add_argument("--out", help="append JSON results to this file")
    args = p.parse_args(argv)
    if args.rank <= 0:
        p.error("--rank must be > 0")

    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            p.error(f"unknown shape {shape!r}; known: {', '.join(sorted(SHAPES))}")
        run = planned if args.compile_only else measured
        full, adapters = run(shape, 0, args), run(shape, args.rank, args)
        for r in (full, adapters):
            print(json.dumps(r))
        memory_key = "planned_peak_gib" if args.compile_only else "peak_gib"
        ratios = {"optimizer_values": adapters["optimizer_values"] / full["optimizer_values"]}
        if full.get(memory_key) and adapters.get(memory_key):
            ratios["memory"] = adapters[memory_key] / full[memory_key]
        if not args.compile_only:
            ratios["step_time"] = adapters["step_ms"] / full["step_ms"]
        text = ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items())
        print(f"SUMMARY {shape} on {full['device']}: LoRA rank {args.rank} / full fine-tuning: {text} "
              f"(full {_figures(full, memory_key)}; LoRA {_figures(adapters, memory_key)})")
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps({"full": full, "lora": adapters, "ratios": ratios}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
