"""Benchmark: weak scaling of the jitted policy update step over 1, 2 and 4 devices, by mesh layout.

    python scripts/bench_scaling.py --shapes 0.5b --devices 1,2,4                     # every layout, one process
    python scripts/bench_scaling.py --shapes 0.5b --devices 4 --processes 2           # + 2 processes x 2 devices
    python scripts/bench_scaling.py --shapes tiny --devices 1,4 --steps 2 --seq-len 32  # CPU: fake devices
    python scripts/bench_scaling.py --shapes 1.5b --devices 1,2,4 --precompile 8       # compile all first, 8 at once
    python scripts/bench_scaling.py --layouts tensor --rule act_residual_batch=data,fsdp,tensor  # another rule

Weak scaling: every device gets --rows-per-device rows of --seq-len tokens, so N devices step on N times the
tokens of one device (each layout splits the same global batch its own way). A layout's efficiency on N devices
is its tokens/s over N x the one-device tokens/s of the same invocation. Every run is timed twice: with the loss
read back after each step (`step_ms`, `efficiency`) and with the steps back to back (`step_ms_pipelined`,
`efficiency_pipelined`), as the trainer runs its mini-batches; `--profile N` adds each device's split of a step
into computation, collectives hidden and exposed, and idle time (`timeline`, scripts/trace_timeline.py). The step is the trainer's own
(`make_train_step`: PPO policy loss with fp32 log-probabilities, AdamW with global-norm clipping, the state
donated and kept in its sharding), traced under the trainer's mesh and logical axis rules
(`models/sharding.py`), on patterned weights (`new_state`) and random tokens; bf16 compute on a GPU, fp32 on the CPU.

Layouts on N devices: fsdp (fsdp=N), data (data=N), tensor (tensor=N), fsdp_tensor (fsdp=N/2 x tensor=2, from
4 devices on). Each (shape, layout, device count) runs in worker processes of its own that see exactly those
devices (CUDA_VISIBLE_DEVICES; on the CPU that many fake devices), so peak memory and XLA's log belong to it. The
driver reads the workers' stderr for the SPMD partitioner's "involuntary full rematerialization" warning: a
reshard between two layouts that XLA could only do by replicating the whole tensor, the sign of activation and
parameter shardings that disagree. With --processes P every layout on N devices also runs as P processes of
N/P devices joined by jax.distributed (the trainer's `distributed.initialize`, a coordinator on this host, gloo
collectives on the CPU), compared with one process of N devices.

Prints a JSON line per run and a summary table. On the CPU, fake devices share the host's cores: the figures
there check that everything compiles and runs, they are not a measure of scaling.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

_STARTED = time.monotonic()  # a worker's phases are timed from its start (`phases_s`)

# Runnable as `python scripts/bench_scaling.py` from a checkout without installing the package.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agentfly_jax.models.shapes import SHAPES  # noqa: E402

SHAPE_NAMES = {"0.5b": "qwen2.5-0.5b", "1.5b": "qwen2.5-1.5b", "3b": "qwen2.5-3b", "tiny": "tiny"}
LAYOUTS = ("fsdp", "data", "tensor", "fsdp_tensor")
REMAT_WARNING = "involuntary full rematerialization"
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def mesh_axes(layout: str, devices: int) -> dict[str, int]:
    """The mesh of `layout` on `devices` devices; ValueError where that layout needs more or other devices."""
    if devices == 1:
        return {}
    if layout == "fsdp_tensor":
        if devices < 4 or devices % 2:
            raise ValueError(f"fsdp_tensor (fsdp=N/2 x tensor=2) needs an even device count >= 4, got {devices}")
        return {"fsdp": devices // 2, "tensor": 2}
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    return {layout: devices}


def _applies(layout: str, devices: int) -> bool:
    try:
        mesh_axes(layout, devices)
        return True
    except ValueError:
        return False


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective the compiled program holds (async start/done pairs counted once)."""
    return {op: len(re.findall(rf"\s{op}(?:-start)?\(", hlo_text)) for op in COLLECTIVES}


def loop_body_lines(hlo_text: str):
    """The instruction lines of the computations that are a while loop's body (each runs once per iteration)."""
    bodies = {name.lstrip("%") for name in re.findall(r"\swhile\(.*?body=(%?[\w.\-]+)", hlo_text)}
    current = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):  # a computation's header
            current = line.split()[0].lstrip("%")
        elif current in bodies:
            yield line


def collectives_in_loops(hlo_text: str) -> dict[str, int]:
    """The collectives of the computations that are a while loop's body (the micro-batch loop of gradient
    accumulation, a logits chunk loop): each runs once per iteration. A gradient all-reduce here, rather than
    once after the loop, moves the gradients once per micro-batch."""
    return count_collectives("\n".join(loop_body_lines(hlo_text)))


def parse_rule(text: str) -> tuple[str, str | tuple[str, ...] | None]:
    """`NAME=AXES` (comma-separated mesh axes, or empty for none) -> a logical axis rule, checked by the trainer's
    own `sharding.override_rules` (a known name, mesh axes, none twice)."""
    from agentfly_jax.models.sharding import override_rules

    name, sep, axes = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--rule {text!r}: expected NAME=AXES with AXES comma-separated of data, fsdp, tensor "
                         f"(or empty), e.g. act_residual_batch=data,fsdp")
    parts = tuple(a.strip() for a in axes.split(",") if a.strip())
    rule = name.strip(), (None if not parts else parts[0] if len(parts) == 1 else parts)
    override_rules([rule])
    return rule


# ============================================================================================== the worker
def _host_batch(args, shape: dict, global_rows: int):
    """One mini-batch of packed rows [1, R, L] on the host, filled as `prepare` would fill it (random advantages,
    old logprobs -11, token-mean loss weights), the same on every process (seeded)."""
    import numpy as np

    from agentfly_jax.algorithms import aggregation_weights
    from agentfly_jax.trainer import pack_step, take_minibatch

    rng = np.random.default_rng(0)
    n, length = global_rows, args.seq_len
    tokens = rng.integers(0, shape["vocab_size"], (n, length), dtype=np.int32)
    mask = np.ones((n, length), np.float32)
    mask[:, 0] = 0  # token 0 has no prediction
    advantages = rng.normal(size=(n, length)).astype(np.float32) * mask
    old_logprobs = np.full((n, length), -11.0, np.float32) * mask
    batch = pack_step(tokens, mask, old_logprobs, np.full(n, length), rewards=np.zeros(n, np.float32),
                      group_ids=np.arange(n), minibatch=np.zeros(n, np.int32), num_minibatches=1, row_len=length,
                      micro_batches=args.micro_batches)

    def packed(per_sequence):  # [N, T] -> the rows' [K, M, R, L] layout
        return np.concatenate([per_sequence.reshape(-1), np.zeros(1, np.float32)])[batch.pack_index]

    rows = batch.rows.replace(old_logprobs=packed(old_logprobs), advantages=packed(advantages),
                              loss_weights=packed(np.asarray(aggregation_weights(mask, "token-mean"))))
    return take_minibatch(rows, 0)


def run_worker(args) -> dict:
    """Builds, compiles and times the update step of one shape and layout on the devices this process sees."""
    phases = {}

    def phase(name):  # seconds since the worker started, at the end of each phase
        phases[name] = round(time.monotonic() - _STARTED, 2)

    import jax

    if args.num_processes > 1:
        from agentfly_jax.trainer import distributed
        from agentfly_jax.trainer.config import DistributedSection

        if jax.config.jax_platforms == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        distributed.initialize(DistributedSection(coordinator_address=args.coordinator,
                                                  num_processes=args.num_processes, process_id=args.process_id,
                                                  initialization_timeout=args.init_timeout))
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from agentfly_jax.algorithms import get_recipe
    from agentfly_jax.models import CausalLM, ModelConfig
    from agentfly_jax.models import sharding as shd
    from agentfly_jax.trainer import (OptimizerConfig, create_train_state, make_optimizer, make_train_step,
                                      state_shardings)

    devices = jax.device_count()
    gpu = jax.default_backend() == "gpu"
    phase("devices")
    shape = SHAPES[SHAPE_NAMES[args.shape]]
    dtype = jnp.bfloat16 if gpu else jnp.float32
    segments = {} if args.attention_segments is None else {"attention_segments": args.attention_segments}
    config = ModelConfig(**shape, qkv_bias=True, family="qwen2", dtype=dtype,
                         param_dtype=jnp.float32 if args.fp32_params else dtype, remat=args.layer_remat,
                         layer_row_splits=args.layer_row_splits, **segments)
    model = CausalLM(config)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-6, weight_decay=0.01))
    alg = get_recipe("grpo").resolve({}, {"logprob_chunk": args.chunk or None})  # PPO clipped loss, token-mean
    mesh = shd.make_mesh(mesh_axes(args.layout, devices))
    rules = shd.override_rules(args.rule or ())
    global_rows = args.rows_per_device * devices

    abstract_params = jax.eval_shape(
        lambda: nn.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"])

    def new_state():
        """Deterministic weights of the model's shapes without running its initialisers: flax's init traces the
        whole model and draws every weight from threefry, which took 70 s (one H200) to 140 s (four) to compile
        and run at the 0.5B shape, more than the run it prepares. Norm scales 1, biases 0, the rest a fixed
        pattern of +-0.02: the step's time does not depend on the values, only its loss must stay finite."""
        def leaf(path, x):
            name = str(getattr(path[-1], "key", path[-1]))
            if name == "scale":
                return jnp.ones(x.shape, x.dtype)
            if name == "bias":
                return jnp.zeros(x.shape, x.dtype)
            return (0.02 * jnp.sin(jnp.arange(x.size, dtype=jnp.float32) * 0.7 + len(path))).reshape(x.shape
                                                                                                    ).astype(x.dtype)

        return create_train_state(jax.tree_util.tree_map_with_path(leaf, abstract_params), optimizer)

    abstract_state = jax.eval_shape(new_state)
    sharding = state_shardings(abstract_state, mesh, policy_model=model, policy_opt=optimizer, rules=rules)
    rows_sharding = NamedSharding(mesh, P(None, ("data", "fsdp")))
    host_rows = _host_batch(args, shape, global_rows)
    if args.compile_only:  # abstract inputs: nothing is allocated
        state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract_state,
                             sharding)
        rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows_sharding), host_rows)
    else:
        state = jax.jit(new_state, out_shardings=sharding)()
        # each process supplies the slices of the (identical) host batch that its devices hold
        rows = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, rows_sharding, lambda idx: x[idx]),
                            host_rows)
        jax.block_until_ready((state, rows))
    phase("state")

    t0 = time.perf_counter()
    with jax.set_mesh(mesh), shd.axis_rules(rules):
        step = make_train_step(model, alg, optimizer, state_sharding=sharding)
        compiled = step.lower(state, rows).compile()
    compile_s = time.perf_counter() - t0
    phase("compile")
    hlo = compiled.as_text()
    result = {"shape": args.shape, "layout": args.layout if devices > 1 else "single", "devices": devices,
              "processes": jax.process_count(), "mesh": dict(mesh.shape), "device_kind": jax.devices()[0].device_kind,
              "dtype": jnp.dtype(dtype).name, "rows_per_device": args.rows_per_device, "seq_len": args.seq_len,
              "global_tokens": global_rows * args.seq_len, "layer_remat": args.layer_remat, "chunk": args.chunk,
              "rules": dict(args.rule or []), "compile_s": round(compile_s, 2),
              "micro_batches": args.micro_batches, "layer_row_splits": args.layer_row_splits,
              "attention_segments": config.attention_segments, "collectives": count_collectives(hlo),
              "collectives_in_loops": collectives_in_loops(hlo), "phases_s": phases,
              "xla_flags": _callers_flags(os.environ.get("XLA_FLAGS", "")),
              "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}}
    if args.compile_only:
        return result

    times = []
    loss = None
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, rows)
        loss = float(jax.block_until_ready(metrics["policy/loss"]))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if not np.isfinite(loss):
        raise RuntimeError(f"the update step's loss is {loss}")
    # Back to back, as the trainer runs its mini-batches' steps: each dispatched before the last one ends, the
    # metrics left on the device. The synced steps above also count each step's dispatch and read-back, which
    # grow with the devices a program spans (on 4 H200s: 5-6 ms a step between programs against 3.4 on one).
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = compiled(state, rows)
    jax.block_until_ready(metrics["policy/loss"])
    pipelined = (time.perf_counter() - t0) / args.steps
    phase("steps")
    if args.profile:
        result["timeline"] = _profile_steps(compiled, state, rows, args.profile)
        phase("profile")
    median = statistics.median(times)
    stats = jax.local_devices()[0].memory_stats() or {}
    result.update(step_ms=round(1e3 * median, 3), step_ms_min=round(1e3 * min(times), 3),
                  tokens_per_s=round(result["global_tokens"] / median, 1),
                  step_ms_pipelined=round(1e3 * pipelined, 3),
                  tokens_per_s_pipelined=round(result["global_tokens"] / pipelined, 1),
                  peak_gib=round(stats["peak_bytes_in_use"] / 2**30, 2) if "peak_bytes_in_use" in stats else None,
                  loss=loss)
    return result


def _profile_steps(compiled, state, rows, steps: int) -> dict:
    """`steps` more update steps under `jax.profiler`, read back into a per-device breakdown of the step's time
    (scripts/trace_timeline.py: computation, collectives hidden behind it, collectives exposed, idle), the
    exposed collectives also by the part of the model they belong to (`exposed_by_label`)."""
    import jax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from trace_timeline import hlo_labels, summarise_trace, update_part

    labels = hlo_labels(compiled.as_text(), update_part)  # the exposed collectives by part of the model
    trace_dir = tempfile.mkdtemp(prefix="bench-scaling-trace-")
    try:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                state, metrics = compiled(state, rows)
            jax.block_until_ready(metrics["policy/loss"])
        return summarise_trace(trace_dir, steps, labels=labels)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


# ============================================================================================== the driver
def _gpu_ids() -> list[str]:
    """The GPUs the workers may use: CUDA_VISIBLE_DEVICES when set, else the ones nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()]
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return [str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def _rule_arg(text: str):
    try:
        return parse_rule(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_PORTS_LOCK, _PORTS_GIVEN = threading.Lock(), set()


def _free_port() -> int:
    """A free local port for a run's coordinator, never one given before in this process (concurrent runs of
    `precompile` each get their own)."""
    with _PORTS_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _PORTS_GIVEN:
                _PORTS_GIVEN.add(port)
                return port


def _callers_flags(flags: str) -> str:
    """XLA_FLAGS without the fake CPU device count, which the driver sets per worker."""
    return re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags).strip()


def _worker_env(platform: str, device_ids: list[str], local_devices: int, extra: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           **(extra or {})}
    flags = _callers_flags(env.get("XLA_FLAGS", ""))
    if platform == "cpu":
        env.update(JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={local_devices}".strip())
    else:
        env.update(CUDA_VISIBLE_DEVICES=",".join(device_ids), XLA_FLAGS=flags)
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    return env


def run_layout(args, shape: str, layout: str, devices: int, processes: int, platform: str, gpus: list[str],
               extra_env: dict | None = None) -> dict:
    """Runs one (shape, layout, devices) in `processes` worker processes -> process 0's result, with the count of
    rematerialization warnings that any of them logged while compiling (or `error` when a worker failed)."""
    local = devices // processes
    port, started = _free_port(), time.monotonic()
    worker_args = ["--shape", shape, "--layout", layout, "--rows-per-device", str(args.rows_per_device),
                   "--micro-batches", str(args.micro_batches),
                   "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--chunk", str(args.chunk), "--init-timeout", str(args.init_timeout),
                   "--profile", str(args.profile)]
    worker_args += ["--fp32-params"] * args.fp32_params + ["--layer-remat"] * args.layer_remat
    worker_args += ["--layer-row-splits", str(args.layer_row_splits)]
    if args.attention_segments is not None:
        worker_args += ["--attention-segments", str(args.attention_segments)]
    worker_args += ["--compile-only"] * args.compile_only
    for name, axes in args.rule or []:
        worker_args += ["--rule", f"{name}={','.join((axes,) if isinstance(axes, str) else axes or ())}"]
    procs = []
    for pid in range(processes):
        argv = [sys.executable, os.path.abspath(__file__), "--worker", *worker_args]
        if processes > 1:
            argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(pid)]
        env = _worker_env(platform, gpus[pid * local:(pid + 1) * local], local, extra_env)
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs, deadline = [], time.monotonic() + args.timeout  # (returncode, stdout, stderr) of each process
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                err += f"\nkilled after {args.timeout} s (--timeout)"
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    base = {"shape": shape, "layout": layout if devices > 1 else "single", "devices": devices, "processes": processes,
            "rules": dict(args.rule or []), "wall_s": round(time.monotonic() - started, 1)}  # start to every exit
    warnings = sum(err.lower().count(REMAT_WARNING) for _, _, err in outputs)
    failed = [(rc, err) for rc, _, err in outputs if rc != 0]
    results = [ln for ln in outputs[0][1].splitlines() if ln.startswith("RESULT ")]
    if failed or not results:
        rc, err = failed[0] if failed else outputs[0][::2]
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        raised = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", ln)]  # the exception
        tail = raised[-1:] + lines[-3:]
        return {**base, "error": f"worker exited {rc}: " + " | ".join(tail)[-1500:], "remat_warnings": warnings}
    return {**json.loads(results[-1][len("RESULT "):]), "remat_warnings": warnings, "wall_s": base["wall_s"]}


def _plan(args) -> list[tuple[str, str, int, int]]:
    """(shape, layout, devices, processes) to run, the one-device baseline of each shape first."""
    runs = []
    for shape in args.shapes:
        if 1 in args.devices or not args.compile_only:  # the baseline of the efficiencies
            runs.append((shape, "fsdp", 1, 1))
        for devices in (d for d in args.devices if d > 1):
            for layout in (x for x in args.layouts if _applies(x, devices)):  # the rest: named in the summary
                runs.append((shape, layout, devices, 1))
                for processes in sorted({p for p in args.processes if p > 1 and devices % p == 0}):
                    runs.append((shape, layout, devices, processes))
    return runs


def _fmt(result: dict, key: str, spec: str) -> str:
    return "-" if result.get(key) is None else format(result[key], spec)


def _summary(results: list[dict], args) -> list[str]:
    if args.compile_only:
        lines = ["| shape | layout | devices | processes | compile s | all-gather | all-reduce | all-to-all | "
                 "collective-permute | remat warnings |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    else:
        lines = ["| shape | layout | devices | processes | step ms | tokens/s | speedup | efficiency | "
                 "step ms, pipelined | efficiency, pipelined | vs 1 process | remat warnings |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        head = f"| {r['shape']} | {r['layout']} | {r['devices']} | {r['processes']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][:80]} | | | | | | | {r['remat_warnings']} |")
        elif args.compile_only:
            c = r["collectives"]
            lines.append(f"{head} {r['compile_s']} | {c['all-gather']} | {c['all-reduce']} | {c['all-to-all']} | "
                         f"{c['collective-permute']} | {r['remat_warnings']} |")
        else:
            lines.append(f"{head} {r['step_ms']} | {r['tokens_per_s']:,.0f} | {_fmt(r, 'speedup', '.2f')} | "
                         f"{_fmt(r, 'efficiency', '.1%')} | {r['step_ms_pipelined']} | "
                         f"{_fmt(r, 'efficiency_pipelined', '.1%')} | {_fmt(r, 'vs_one_process', '.3f')} | "
                         f"{r['remat_warnings']} |")
    profiled = [r for r in results if "timeline" in r]
    if profiled:  # --profile: where each run's device time went, ms a step, averaged over its devices
        lines += ["", "| shape | layout | devices | processes | span ms | computation | collectives | exposed | idle |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in profiled:
            t = r["timeline"]["mean"]
            lines.append(f"| {r['shape']} | {r['layout']} | {r['devices']} | {r['processes']} | {t['span_ms']} | "
                         f"{t['compute_ms']} | {t['collective_ms']} | {t['exposed_collective_ms']} | {t['idle_ms']} |")
    return lines


def precompile(args, platform: str, gpus: list[str]) -> dict:
    """Compiles every planned run's program into JAX's persistent compilation cache, `args.precompile` runs at a
    time (compile-only workers: abstract inputs, no preallocated device memory), so that each timed run then
    loads its program instead of compiling it while the other devices wait; returns each run's compile-only record
    (its rematerialization warnings: a timed run that loads its program compiles nothing and so logs none).
    Compiling is host work, so on a host with cores to spare the whole plan's compiles take about as long as the
    slowest one. The cache is JAX_COMPILATION_CACHE_DIR (a temporary directory, removed at exit, when unset), and
    every program is cached however fast it compiled (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0, also for the
    timed runs). Caveat: XLA's GEMM autotuning measures kernels while other compiles share the devices, and the
    timed runs inherit its picks; with cuBLAS GEMMs (the trainer's default) it picks among few algorithms.
    On 4 H200s (jaxlib 0.11.2) only the one-device program was then loaded; the timed multi-GPU runs compiled
    theirs again (27 s against the precompile's 25 s; the records' `compile_s` show it), so there it saved nothing.
    """
    from concurrent.futures import ThreadPoolExecutor

    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        cache = tempfile.mkdtemp(prefix="bench-scaling-xla-cache-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    pre = argparse.Namespace(**{**vars(args), "compile_only": True})
    extra = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    plan, t0 = _plan(args), time.monotonic()

    def one(run):
        try:
            r = run_layout(pre, *run, platform, gpus, extra)
        except Exception as e:  # noqa: BLE001 - the timed run then compiles (and fails) on its own
            r = {"error": f"{type(e).__name__}: {e}", "remat_warnings": 0}
        print(f"precompiled {run[0]} {run[1]} on {run[2]} devices ({run[3]} processes): "
              + (f"failed: {r['error'][:200]}" if "error" in r else f"{r['compile_s']} s"), file=sys.stderr,
              flush=True)
        return run, r

    with ThreadPoolExecutor(args.precompile) as pool:
        records = dict(pool.map(one, plan))
    print(f"precompiled {len(plan)} programs in {time.monotonic() - t0:.0f} s into "
          f"{os.environ['JAX_COMPILATION_CACHE_DIR']}", file=sys.stderr, flush=True)
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="0.5b", help=f"comma-separated, of {', '.join(SHAPE_NAMES)}")
    p.add_argument("--devices", default="1,2,4", help="comma-separated device counts (1 = the baseline)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--processes", default="1", help="comma-separated process counts; >1 also runs every layout "
                                                    "as that many processes of N/P devices")
    p.add_argument("--rows-per-device", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=1,
                   help="gradient accumulation: each step's rows in this many micro-batches (divides the rows)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--chunk", type=int, default=0,
                   help="positions per fp32 logits chunk (0: the whole sequence at once)")
    p.add_argument("--layer-remat", action="store_true", help="rematerialise each decoder layer in the backward")
    p.add_argument("--layer-row-splits", type=int, default=1, metavar="N",
                   help="run each layer on N independent groups of rows (ModelConfig.layer_row_splits), so that "
                        "one group's tensor-parallel all-reduces can overlap another's GEMMs; 1: off")
    p.add_argument("--attention-segments", type=int, metavar="N",
                   help="ModelConfig.attention_segments (default: ModelConfig's): cuDNN's packed layout for up to N "
                        "segments a row; 0: the dense segment mask (the only path before 2026-11-28)")
    p.add_argument("--rule", action="append", type=_rule_arg, metavar="NAME=AXES",
                   help="override one logical axis rule of the trainer's defaults (repeatable), e.g. "
                        "act_residual_batch=data,fsdp; an empty AXES replicates")
    p.add_argument("--fp32-params", action="store_true", help="fp32 master params, bf16 compute (GPU)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, trace N more steps with jax.profiler; each record's `timeline` splits a "
                   "device's step into computation, hidden and exposed collectives and idle time")
    p.add_argument("--compile-only", action="store_true",
                   help="lower and compile on abstract inputs (nothing allocated): warnings and collectives only")
    p.add_argument("--platform", choices=["auto", "gpu", "cpu"], default="auto",
                   help="auto: the GPUs nvidia-smi lists (or CUDA_VISIBLE_DEVICES), else fake CPU devices")
    p.add_argument("--precompile", type=int, default=0, metavar="J",
                   help="first compile every run's program, J at a time, into the persistent compilation cache "
                        "(see precompile); 0: each run compiles its own")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run before its workers are killed")
    p.add_argument("--init-timeout", type=int, default=120, help="seconds for the processes of a run to connect")
    p.add_argument("--out", help="append the JSON lines to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    p.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        result = run_worker(args)
        if result["processes"] == 1 or args.process_id == 0:
            print("RESULT " + json.dumps(result), flush=True)
        sys.stderr.flush()
        # Nothing is left to save, and tearing down the runtime of a multi-GPU process (its NCCL communicators,
        # preallocated memory) can take longer than the run: the driver waits for every worker's exit.
        os._exit(0)

    def csv(text, what, valid=None, cast=str):
        items = [cast(x.strip()) for x in text.split(",") if x.strip()]
        bad = [x for x in items if valid is not None and x not in valid]
        if not items or bad:
            p.error(f"--{what}: {bad or 'nothing'} not understood; expected comma-separated values"
                    + (f" of {', '.join(map(str, valid))}" if valid else ""))
        return items

    args.shapes = csv(args.shapes, "shapes", SHAPE_NAMES)
    args.layouts = csv(args.layouts, "layouts", LAYOUTS)
    try:
        args.devices = sorted(set(csv(args.devices, "devices", cast=int)))
        args.processes = sorted(set(csv(args.processes, "processes", cast=int)))
    except ValueError as e:
        p.error(f"--devices and --processes take comma-separated integers ({e})")
    if min(args.devices) < 1 or min(args.processes) < 1:
        p.error("--devices and --processes must be >= 1")
    if (args.rows_per_device < 1 or args.seq_len < 2 or args.steps < 1 or args.warmup < 0 or args.chunk < 0
            or args.precompile < 0 or args.micro_batches < 1 or args.profile < 0 or args.layer_row_splits < 1
            or (args.attention_segments or 0) < 0):
        p.error("--rows-per-device >= 1, --seq-len >= 2, --steps >= 1, --warmup >= 0, --chunk >= 0, "
                "--precompile >= 0, --micro-batches >= 1, --profile >= 0, --layer-row-splits >= 1 and "
                "--attention-segments >= 0")
    if args.rows_per_device % args.micro_batches:
        p.error(f"--micro-batches {args.micro_batches} must divide --rows-per-device {args.rows_per_device}: "
                f"every device's rows are split evenly into the micro-batches")
    if (args.rows_per_device // args.micro_batches) % args.layer_row_splits:
        p.error(f"--layer-row-splits {args.layer_row_splits} must divide a micro-batch's rows per device "
                f"({args.rows_per_device // args.micro_batches}): each device splits its own rows into the groups")
    gpus = _gpu_ids() if args.platform in ("auto", "gpu") else []
    platform = "gpu" if gpus else "cpu"
    if args.platform == "gpu" and not gpus:
        p.error("--platform gpu: no GPU found (nvidia-smi -L lists none and CUDA_VISIBLE_DEVICES is unset)")
    if platform == "gpu" and max(args.devices) > len(gpus):
        p.error(f"--devices {max(args.devices)} but only {len(gpus)} GPUs are visible ({','.join(gpus)})")

    precompiled = precompile(args, platform, gpus) if args.precompile and not args.compile_only else {}
    results, baseline, single_process = [], {}, {}
    for shape, layout, devices, processes in _plan(args):
        r = run_layout(args, shape, layout, devices, processes, platform, gpus)
        pre = precompiled.get((shape, layout, devices, processes))
        if pre is not None:  # the warnings were logged when the program was compiled, in the precompile
            r["remat_warnings"] += pre["remat_warnings"]
            r["precompiled"] = "error" not in pre
        if "tokens_per_s" in r:
            if devices == 1:
                baseline[shape] = r["tokens_per_s"], r["tokens_per_s_pipelined"]
            if shape in baseline:
                synced, pipelined = baseline[shape]
                r["speedup"] = round(r["tokens_per_s"] / synced, 3)
                r["efficiency"] = round(r["tokens_per_s"] / synced / devices, 4)  # not the rounded speedup
                r["efficiency_pipelined"] = round(r["tokens_per_s_pipelined"] / pipelined / devices, 4)
            if processes == 1:
                single_process[(shape, layout, devices)] = r["tokens_per_s"]
            elif (shape, layout, devices) in single_process:
                r["vs_one_process"] = round(r["tokens_per_s"] / single_process[(shape, layout, devices)], 4)
        results.append(r)
        print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(r) + "\n")
    skipped = [f"{x} on {d}" for x in args.layouts for d in args.devices if d > 1 and not _applies(x, d)]
    print(f"SUMMARY weak scaling, {args.rows_per_device} x {args.seq_len} tokens per device, {platform}"
          + (f" ({results[0].get('device_kind')})" if results else "")
          + (f"; not applicable: {', '.join(skipped)}" if skipped else ""))
    print("\n".join(_summary(results, args)))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
