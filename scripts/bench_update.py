"""Benchmark: tokens/s and MFU of the policy update step, against HF transformers + torch on the same card.

    python scripts/bench_update.py                      # Qwen2.5-0.5B shape, bf16, batch 8 x 1024, AdamW
    python scripts/bench_update.py --shape tiny --steps 3  # the short CPU version CI runs
    python scripts/bench_update.py --mode optimizer     # the clip + AdamW step alone: optax, each fused
                                                        # layout, and torch's fused AdamW + clip
    python scripts/bench_update.py --mode rl_step       # ours only: prepare + train step of a GRPO update, with
                                                        # each rl.old_logprobs setting (--old-logprobs)

Both sides get random weights of the same shape, the same token batch and AdamW. Ours runs the full PPO policy
loss (fp32 log-probabilities in sequence chunks, clipped ratio); the peer runs transformers' causal-LM
cross-entropy (sdpa attention, fused AdamW). Each side runs in its own subprocess so neither holds the other's
device memory. Prints a JSON line per side and a summary with the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# Runnable as `python scripts/bench_update.py` from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentfly_jax.models.shapes import SHAPES  # noqa: E402

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def flops_per_token(shape: dict, seq_len: int) -> float:
    """6 x matmul params (+ lm_head) + attention scores/values, forward and backward (PaLM appendix B)."""
    h, f, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_layers"], shape["vocab_size"]
    d = h // shape["num_heads"]
    q, kv = shape["num_heads"] * d, shape["num_kv_heads"] * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * f
    return 6 * (layers * per_layer + h * v) + 12 * layers * q * seq_len


def _timeit(fn, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _ms_of(times: list[float]) -> dict:
    """A timed variant's step_ms (the middle of the sorted times) and step_ms_min, in ms to 3 decimals."""
    return {"step_ms": round(1e3 * sorted(times)[len(times) // 2], 3), "step_ms_min": round(1e3 * min(times), 3)}


# A GPU program replays most of its kernels as CUDA graphs (XLA's command buffers); the trace then names every kernel
# of a graph after the graph (one `command_buffer` HLO op for most of the step, seen on an H200), so --profile turns
# them off unless XLA_FLAGS already says how to run them (at the 0.5B shape on an H200 the step took 69.67 ms without
# them and 69.53 ms with them).
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def run_jax(args) -> dict:
    if args.profile and "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_COMMAND_BUFFERS}".strip()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from agentfly_jax.algorithms import aggregation_weights, get_recipe
    from agentfly_jax.models import CausalLM, ModelConfig, init_params
    from agentfly_jax.trainer import (OptimizerConfig, create_train_state, make_optimizer, make_train_step,
                                      pack_step, take_minibatch, token_logprobs)
    from agentfly_jax.models.config import gpu_compiler_options

    shape = SHAPES[args.shape]
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    from agentfly_jax.models import lora

    config = ModelConfig(**shape, qkv_bias=True, family="qwen2", dtype=dtype,
                         param_dtype=jnp.float32 if args.fp32_params else dtype, remat=args.remat,
                         attention_impl=args.attention, attention_segments=args.attention_segments,
                         lora_rank=args.lora_rank)
    model = CausalLM(config)
    trainable = lora.is_adapter if args.lora_rank else None  # LoRA: adapters trained, the base frozen
    params = init_params(model, jax.random.PRNGKey(0))
    if args.mode in ("optimizer", "rl_step"):
        variants = (_time_optimizers(args, params, trainable) if args.mode == "optimizer"
                    else _time_rl_steps(args, model, params, trainable))
        return {"impl": "agentfly_jax", "device": jax.devices()[0].device_kind, "mode": args.mode,
                "fp32_params": args.fp32_params, "lora_rank": args.lora_rank, "shape": args.shape,
                "dtype": args.dtype, "variants": variants}
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-6, weight_decay=0.01, fused=args.fused_optimizer,
                                               update_norm=args.update_norm))
    state = create_train_state(jax.tree.map(jnp.copy, params), optimizer, trainable=trainable)
    alg = get_recipe("grpo").resolve({}, {"logprob_chunk": args.chunk or None})  # PPO clipped loss, token-mean
    step = make_train_step(model, alg, optimizer, trainable=trainable, gpu_gemm=args.gpu_gemm)
    options = gpu_compiler_options(args.gpu_gemm)  # the forward / grad modes' programs compile as the step does

    rng = np.random.default_rng(0)
    b, t = args.batch, args.seq_len
    seg = args.segments
    n, length = b * seg, t // seg  # `seg` > 1: the same tokens as shorter sequences, `seg` packed per row
    tokens = rng.integers(0, shape["vocab_size"], (n, length), dtype=np.int32)
    mask = np.ones((n, length), np.float32)
    mask[:, 0] = 0  # token 0 of a sequence has no prediction
    advantages = rng.normal(size=(n, length)).astype(np.float32) * mask
    old_logprobs = np.full((n, length), -11.0, np.float32) * mask
    batch = pack_step(tokens, mask, old_logprobs, np.full(n, length), rewards=np.zeros(n, np.float32),
                      group_ids=np.arange(n), minibatch=np.zeros(n, np.int32), num_minibatches=1,
                      micro_batches=args.micro, row_len=t)

    def packed(per_sequence):  # [N, T] -> the packed rows' [K, M, R, L] layout (0 on padding)
        return np.concatenate([per_sequence.reshape(-1), np.zeros(1, np.float32)])[batch.pack_index]

    # What `make_prepare_fn` fills on the device in a run; fixed here so only the update is timed.
    rows = batch.rows.replace(old_logprobs=packed(old_logprobs), advantages=packed(advantages),
                              loss_weights=packed(np.asarray(aggregation_weights(mask, alg.aggregation))))
    micro = jax.tree.map(jnp.asarray, take_minibatch(rows, 0))  # [M, R, L]
    holder = {"state": state}

    # each mode's program compiled ahead of time (its HLO names the kernels of a --profile trace), then timed
    t0 = time.perf_counter()
    if args.mode == "forward":
        first = jax.tree.map(lambda x: x[0], micro)
        fwd = jax.jit(lambda p, r: token_logprobs(model, p, r, chunk=alg.logprob_chunk)[0], compiler_options=options
                      ).lower(params, first).compile()

        def one():
            jax.block_until_ready(fwd(params, first))
        compiled = fwd
    elif args.mode == "grad":
        from agentfly_jax.trainer.update import accumulate_gradients, policy_loss
        grad_fn = jax.jit(lambda p, mb: accumulate_gradients(lambda q, b_: policy_loss(q, b_, model, alg), p, mb),
                          compiler_options=options).lower(params, micro).compile()

        def one():
            jax.block_until_ready(grad_fn(params, micro))
        compiled = grad_fn
    else:
        compiled = step.lower(holder["state"], micro).compile()

        def one():
            holder["state"], metrics = compiled(holder["state"], micro)
            jax.block_until_ready(metrics["policy/loss"])
    one()
    compile_s = time.perf_counter() - t0
    times = _timeit(one, args.steps, args.warmup)
    profile = _profile(one, compiled.as_text(), args.profile) if args.profile else None
    stats = jax.devices()[0].memory_stats() or {}
    opt_values = sum(int(x.size) for x in jax.tree.leaves(holder["state"].policy.opt_state) if x.ndim > 0)
    return {"impl": "agentfly_jax", "device": jax.devices()[0].device_kind, "compile_s": round(compile_s, 2),
            "attention": args.attention, "remat": args.remat, "fp32_params": args.fp32_params, "mode": args.mode,
            "segments": seg, "attention_segments": args.attention_segments, "chunk": args.chunk,
            "lora_rank": args.lora_rank, "fused_optimizer": args.fused_optimizer, "update_norm": args.update_norm,
            "gpu_gemm": args.gpu_gemm, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "trained_values": lora.adapter_count(params) if args.lora_rank else sum(
                int(x.size) for x in jax.tree.leaves(params)),
            "optimizer_values": opt_values,
            "peak_gib": round(stats["peak_bytes_in_use"] / 2**30, 3) if "peak_bytes_in_use" in stats else None,
            **_summary(args, times), **({"profile": profile} if profile else {})}


# kernels by their own (library or fusion) name: what kind of work
_KERNEL_KINDS = (("GEMM", r"gemm|cublas|nvjet|xmma|cutlass|matmul|dot"),
                 ("attention kernels", r"cudnn|flash|fmha|attention"),
                 ("copies", r"copy|transpose|memcpy|memset|concatenate|dynamic_slice|dynamic-update"))


def _profile(one, hlo_text: str, calls: int) -> dict:
    """`calls` more calls of `one` under jax.profiler -> device ms per call by part of the update
    (trace_timeline.update_part), by kind of kernel, the time between kernels (idle), the largest names
    left unlabelled (`unlabelled_top`: HLO ops the program's text does not label, or kernels the trace names
    only by themselves), and the largest copies (`copies_top`: ms per call, how many instructions and what they
    are: shape, opcode and op_name, one entry for the same copy in every layer)."""
    import collections
    import re
    import shutil
    import tempfile

    import jax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from trace_timeline import (COLLECTIVE, breakdown, device_events, hlo_instructions, hlo_labels, kernel_key,
                                named, time_by_label, update_part)

    trace_dir = tempfile.mkdtemp(prefix="bench-update-trace-")
    try:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                one()
        events = next(iter(device_events(trace_dir).values()))
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    labels = hlo_labels(hlo_text, update_part)
    by_op, by_kernel = named(events, labels), named(events)

    def kind(name):  # collectives as the timeline counts them
        if COLLECTIVE.search(name.lower()):
            return "collectives"
        return next((k for k, pattern in _KERNEL_KINDS if re.search(pattern, name.lower())), "other kernels")

    kinds = {kernel_key(name): kind(name) for name, _, _ in by_kernel}
    timeline = breakdown(by_kernel, calls)
    parts = time_by_label(by_op, labels, calls)
    # what stayed unlabelled, by name: says whether the trace's names or the program's op names are missing
    unlabelled = time_by_label([e for e in by_op if kernel_key(e[0]) not in labels],
                               {kernel_key(n): n[:80] for n, _, _ in by_op}, calls)
    # the copies by the instruction they run (a trace may name a library copy only by its HLO op)
    copies = [(op or kernel, start, end) for kernel, op, start, end in events if kinds[kernel_key(kernel)] == "copies"]
    described = hlo_instructions(hlo_text)
    by_copy = time_by_label(copies, {kernel_key(n): n for n, _, _ in copies}, calls)
    # the same copy in every layer is one entry: its description with the layer's number taken out
    groups = collections.defaultdict(lambda: [0.0, 0])
    for name, ms in by_copy.items():
        what = re.sub(r"layers_\d+", "layers_*", described.get(kernel_key(name), "")) or name
        groups[what][0] += ms
        groups[what][1] += 1
    copies_top = [{"ms": round(ms, 3), "count": n, "hlo": what}
                  for what, (ms, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:15]]
    return {"calls": calls, "span_ms": timeline["span_ms"], "idle_ms": timeline["idle_ms"], "parts_ms": parts,
            "kinds_ms": time_by_label(by_kernel, kinds, calls),
            "unlabelled_top": dict(list(unlabelled.items())[:12]), "copies_top": copies_top}


def _time_optimizers(args, params, trainable) -> dict:
    """`--mode optimizer`: the trainer's optimiser step alone (`update._apply`: global-norm clip, AdamW, the
    non-finite skip and the gradient/update/parameter norms it logs; state donated) on fixed random gradients,
    for each `optimizer.fused` setting in turn, in this one process. -> {setting: timings}."""
    import jax
    import jax.numpy as jnp

    from agentfly_jax.models import lora
    from agentfly_jax.trainer import OptimizerConfig, create_train_state, make_optimizer
    from agentfly_jax.trainer.update import _apply

    trained = params if trainable is None else lora.split_trainable(params, trainable)[0]
    leaves, treedef = jax.tree.flatten(trained)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    grads = jax.tree.unflatten(treedef, [(1e-3 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
                                         for k, x in zip(keys, leaves)])

    out = {}
    for setting in args.optimizer_settings:  # "fused[:update_norm]"
        fused, _, update_norm = setting.partition(":")
        optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-6, weight_decay=0.01, fused=fused,
                                                   update_norm=update_norm or OptimizerConfig().update_norm))
        holder = {"ms": create_train_state(jax.tree.map(jnp.copy, params), optimizer, trainable=trainable).policy}
        step = jax.jit(lambda ms, g, opt=optimizer: _apply(ms, g, opt, trainable), donate_argnums=0)
        t0 = time.perf_counter()
        compiled = step.lower(holder["ms"], grads).compile()
        compile_s = time.perf_counter() - t0
        hlo = compiled.as_text()

        def one():
            holder["ms"], metrics = compiled(holder["ms"], grads)
            jax.block_until_ready(metrics)

        times = _timeit(one, args.steps, args.warmup)
        out[setting] = {**_ms_of(times), "compile_s": round(compile_s, 2),
                        "fusions": hlo.count("kind=k"),  # fused kernels in the compiled program (XLA's fusions)
                        "optimizer_arrays": len(jax.tree.leaves(holder["ms"].opt_state))}
        print(f"optimizer {setting}: {out[setting]}", file=sys.stderr, flush=True)
        holder.clear()  # this setting's state is freed before the next one's is made
    out["parameter_leaves"] = len(leaves)
    return out


def _time_rl_steps(args, model, params, trainable) -> dict:
    """`--mode rl_step`: one synchronous GRPO update as the trainer runs it, `prepare` (old log-probabilities unless
    the train step takes them, advantages, loss weights) then the train step, on one batch (groups of 8 rows with
    random rewards), for each `rl.old_logprobs` setting in turn, in this one process. -> {setting: timings}."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from agentfly_jax.algorithms import get_recipe
    from agentfly_jax.trainer import (OptimizerConfig, create_train_state, make_optimizer, make_prepare_fn,
                                      make_train_step, pack_step, take_minibatch)

    rng = np.random.default_rng(0)
    n, t = args.batch, args.seq_len
    tokens = rng.integers(0, model.config.vocab_size, (n, t), dtype=np.int32)
    mask = np.zeros((n, t), np.float32)
    mask[:, t // 4:] = 1.0  # a prompt, then the sampled tokens
    batch = pack_step(tokens, mask, -rng.exponential(size=(n, t)).astype(np.float32) * mask, np.full(n, t),
                      rewards=rng.normal(size=n).astype(np.float32), group_ids=np.arange(n) // 8,
                      minibatch=np.zeros(n, np.int32), num_minibatches=1, micro_batches=args.micro, row_len=t)
    batch = jax.tree.map(jnp.asarray, batch)
    base = get_recipe("grpo").resolve({}, {"logprob_chunk": args.chunk or None})
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-6, weight_decay=0.01, fused=args.fused_optimizer,
                                               update_norm=args.update_norm))
    out = {}
    for setting in args.old_logprobs:
        alg = dataclasses.replace(base, old_logprobs_in_step=setting == "auto")  # what the config decides for it
        prepare = make_prepare_fn(model, alg, gpu_gemm=args.gpu_gemm)
        step = make_train_step(model, alg, optimizer, trainable=trainable, gpu_gemm=args.gpu_gemm)
        holder = {"state": create_train_state(jax.tree.map(jnp.copy, params), optimizer, trainable=trainable)}
        t0 = time.perf_counter()
        prepare_c = prepare.lower(holder["state"], batch).compile()
        filled, _ = prepare_c(holder["state"], batch)
        step_c = step.lower(holder["state"], take_minibatch(filled.rows, 0)).compile()
        compile_s = time.perf_counter() - t0

        def one():
            filled, _ = prepare_c(holder["state"], batch)
            holder["state"], metrics = step_c(holder["state"], take_minibatch(filled.rows, 0))
            jax.block_until_ready(metrics["policy/loss"])

        times = _timeit(one, args.steps, args.warmup)
        cost = (prepare_c.cost_analysis() or {})
        cost = cost[0] if isinstance(cost, list) else cost
        out[setting] = {**_ms_of(times), "compile_s": round(compile_s, 2),
                        "prepare_gflop": round(float(cost.get("flops", 0.0)) / 1e9, 3)}
        print(f"rl_step old_logprobs={setting}: {out[setting]}", file=sys.stderr, flush=True)
        holder.clear()
    return out


def run_torch(args) -> dict:
    import torch
    import transformers

    shape = SHAPES[args.shape]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    cfg = transformers.Qwen2Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
        tie_word_embeddings=shape["tie_word_embeddings"], max_position_embeddings=max(args.seq_len, 2048))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, fused=cuda)
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq_len), device=device)

    if args.mode == "optimizer":  # the peer's clip + fused AdamW step alone, on fixed random gradients
        for p in model.parameters():
            p.grad = 1e-3 * torch.randn_like(p)

        def one():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if cuda:
                torch.cuda.synchronize()

        one()
        times = _timeit(one, args.steps, args.warmup)
        return {"impl": "transformers+torch", "device": torch.cuda.get_device_name() if cuda else "cpu",
                "mode": args.mode, "torch": torch.__version__, **_ms_of(times),
                "parameter_leaves": len(list(model.parameters()))}

    def one():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    one()
    first_s = time.perf_counter() - t0
    times = _timeit(one, args.steps, args.warmup)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    return {"impl": "transformers+torch", "device": name, "compile_s": round(first_s, 2),
            "torch": torch.__version__, "transformers": transformers.__version__, **_summary(args, times)}


def _summary(args, times) -> dict:
    import statistics

    median = statistics.median(times)
    tokens = args.batch * args.seq_len
    return {"shape": args.shape, "dtype": args.dtype, "batch": args.batch, "seq_len": args.seq_len,
            "step_ms": round(1e3 * median, 2), "step_ms_min": round(1e3 * min(times), 2),
            "tokens_per_s": round(tokens / median, 1),
            "flops_per_token": flops_per_token(SHAPES[args.shape], args.seq_len)}


def _mfu(result: dict) -> float | None:
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in result["device"]), None)
    if peak is None:
        return None
    return result["tokens_per_s"] * result["flops_per_token"] / peak


def side_result(cmd: list[str], what: str) -> dict:
    """Runs one benchmark side (`--impl jax|torch`) in its own process -> its last `RESULT` line as a dict; exits
    with its output when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{what} failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    from agentfly_jax.trainer.config import GPU_GEMMS, OPTIMIZER_FUSED, ModelSection, OptimizerConfig
    from agentfly_jax.trainer.fused_adamw import UPDATE_NORMS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--fp32-params", action="store_true", help="ours: fp32 master params, bf16 compute")
    p.add_argument("--attention", choices=["auto", "xla", "cudnn"], default="auto")
    p.add_argument("--segments", type=int, default=1, help="ours: sequences packed per row (segment masks)")
    p.add_argument("--attention-segments", type=int, default=ModelSection().attention_segments,
                   help="ours: config.model.attention_segments, cuDNN's packed layout for up to N segments a row "
                        "(0: the dense segment mask)")
    p.add_argument("--mode", choices=["step", "grad", "forward", "optimizer", "rl_step"], default="step",
                   help="ours: full step, gradients only, forward log-probs only (time breakdown), the "
                        "optimiser step alone (every optimizer.fused setting, and the peer's clip + AdamW), or "
                        "prepare + train step of a GRPO update (ours only, every --old-logprobs setting)")
    p.add_argument("--old-logprobs", nargs="+", default=["prepare", "auto"], choices=["prepare", "auto"],
                   help="--mode rl_step: the rl.old_logprobs settings timed, in this order")
    settings = (*OPTIMIZER_FUSED, *(f"{f}:{n}" for f in OPTIMIZER_FUSED for n in UPDATE_NORMS))
    p.add_argument("--optimizer-settings", nargs="+", default=list(OPTIMIZER_FUSED), choices=settings,
                   help="--mode optimizer: the optimizer.fused settings timed, in this order, each with "
                   "optimizer.update_norm's default or as given after a colon (hybrid:exact, hybrid:off, ...)")
    p.add_argument("--update-norm", choices=UPDATE_NORMS, default=OptimizerConfig().update_norm,
                   help="ours, --mode step: optimizer.update_norm (what the logged update norm measures)")
    p.add_argument("--fused-optimizer", choices=OPTIMIZER_FUSED, default=OptimizerConfig().fused,
                   help="ours, --mode step: optimizer.fused (trainer/fused_adamw.py)")
    p.add_argument("--gpu-gemm", choices=GPU_GEMMS, default=ModelSection().gpu_gemm,
                   help="ours: config.model.gpu_gemm, how the update step's matrix products compile on a GPU")
    p.add_argument("--remat", action="store_true")
    p.add_argument("--chunk", type=int, default=0,
                   help="ours: positions per fp32 logits chunk (0: whole sequence at once, fastest when it fits)")
    p.add_argument("--micro", type=int, default=1, help="micro-batches per step")
    p.add_argument("--lora-rank", type=int, default=0, help="ours: train rank-r LoRA adapters, the base frozen")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="ours: after timing, N more calls under jax.profiler; the result's `profile` gives device ms "
                        "per call by part of the step (MLP, attention, ... forward and backward; loss; optimizer) "
                        "and by kind of kernel")
    p.add_argument("--impl", choices=["all", "jax", "torch"], default="all")
    p.add_argument("--out", help="append JSON results to this file")
    args = p.parse_args(argv)

    if args.impl != "all":
        result = run_jax(args) if args.impl == "jax" else run_torch(args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    if args.mode == "rl_step":  # ours only: the peer has no prepare pass to compare
        ours = side_result([sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
                            "--impl", "jax"], "benchmark side 'jax'")
        print(json.dumps(ours))
        v = ours["variants"]
        print(f"SUMMARY GRPO update (prepare + train step) {args.shape} {args.dtype} B={args.batch} T={args.seq_len} "
              f"on {ours['device']}: " + ", ".join(f"old_logprobs={k} {v[k]['step_ms']} ms (prepare "
                                                   f"{v[k]['prepare_gflop']} GFLOP)" for k in v))
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps({"ours": ours}) + "\n")
        return 0
    results = [side_result([sys.executable, os.path.abspath(__file__),
                            *(argv if argv is not None else sys.argv[1:]), "--impl", impl], f"benchmark side {impl!r}")
               for impl in ("jax", "torch")]
    ours, peer = results
    if args.mode == "optimizer":
        for r in results:
            print(json.dumps(r))
        v = ours["variants"]
        timed = ", ".join(f"{k} {v[k]['step_ms']} ms ({v[k]['fusions']} fusions)" for k in v if k != "parameter_leaves")
        print(f"SUMMARY optimizer step {args.shape} {args.dtype} on {ours['device']} ('off' is optax): {timed}; "
              f"torch clip + AdamW {peer['step_ms']} ms")
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps({"ours": ours, "peer": peer}) + "\n")
        return 0
    for r in results:
        r["mfu"] = _mfu(r)
        print(json.dumps(r))
    ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
    mfu = f", MFU ours {ours['mfu']:.1%} vs peer {peer['mfu']:.1%}" if ours["mfu"] else ""
    print(f"SUMMARY {args.shape} {args.dtype} B={args.batch} T={args.seq_len} on {ours['device']}: "
          f"ours {ours['tokens_per_s']:.0f} tok/s ({ours['step_ms']} ms) vs transformers+torch "
          f"{peer['tokens_per_s']:.0f} tok/s ({peer['step_ms']} ms): ratio {ratio:.2f}x{mfu}")
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps({"ours": ours, "peer": peer, "ratio": ratio}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
