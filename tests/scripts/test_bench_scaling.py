"""scripts/bench_scaling.py, CPU-sized: the tiny shape on fake CPU devices runs end to end (one device and
fsdp x tensor on four), reports consistent figures and no rematerialization; two processes joined by
jax.distributed step on the same batch as one; a failed worker fails the script."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.script_modules import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["--shapes", "tiny", "--rows-per-device", "1", "--seq-len", "16", "--steps", "2", "--warmup", "1"]


def _run(args, timeout=240):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the workers get their own device counts
    return subprocess.run([sys.executable, "scripts/bench_scaling.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bench_scaling_short(tmp_path):
    out = tmp_path / "scaling.jsonl"
    proc = _run([*SHORT, "--devices", "1,4", "--layouts", "fsdp_tensor", "--profile", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    single, sharded = _records(out)
    assert (single["layout"], single["devices"], single["speedup"], single["efficiency"]) == ("single", 1, 1.0, 1.0)
    assert (sharded["layout"], sharded["devices"], sharded["processes"]) == ("fsdp_tensor", 4, 1)
    assert sharded["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
    assert (single["global_tokens"], sharded["global_tokens"]) == (16, 64)  # weak scaling: tokens per device fixed
    for r in (single, sharded):
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and np.isfinite(r["loss"]) and r["dtype"] == "float32"
        assert r["remat_warnings"] == 0
        assert r["tokens_per_s"] == pytest.approx(r["global_tokens"] / (r["step_ms"] / 1e3), rel=1e-3)
    assert sharded["efficiency"] == pytest.approx(sharded["tokens_per_s"] / (4 * single["tokens_per_s"]), abs=1e-4)
    for r in (single, sharded):  # the same steps back to back, one read-back at the end
        assert r["tokens_per_s_pipelined"] == pytest.approx(r["global_tokens"] / (r["step_ms_pipelined"] / 1e3),
                                                            rel=1e-3)
    assert single["efficiency_pipelined"] == 1.0
    assert sharded["efficiency_pipelined"] == pytest.approx(
        sharded["tokens_per_s_pipelined"] / (4 * single["tokens_per_s_pipelined"]), abs=1e-4)
    for r in (single, sharded):  # where a run's time went: its phases in order, within the driver's wall time
        phases = r["phases_s"]
        assert list(phases) == ["devices", "state", "compile", "steps", "profile"], phases
        assert 0 < phases["devices"] <= phases["state"] <= phases["compile"] <= phases["steps"] <= phases[
            "profile"] <= r["wall_s"]
        assert r["xla_flags"] == ""  # the workers' own device-count flag is not the caller's
        assert r["attention_segments"] == 8  # ModelConfig's default, recorded (no effect on the CPU's einsum path)
    collectives = sharded["collectives"]
    assert collectives["all-gather"] > 0 and collectives["all-reduce"] > 0  # fsdp gathers, tensor all-reduces
    assert collectives["all-to-all"] == 0 and collectives["collective-permute"] == 0
    assert single["collectives"] == dict.fromkeys(collectives, 0)
    for r in (single, sharded):  # --profile: the traced step split into computation, collectives and idle time
        t = r["timeline"]["mean"]
        assert t["compute_ms"] > 0 and t["span_ms"] >= t["compute_ms"] and t["idle_ms"] >= 0
        assert 0 <= t["exposed_collective_ms"] <= t["collective_ms"]
    assert single["timeline"]["mean"]["collective_ms"] == 0 and sharded["timeline"]["mean"]["collective_ms"] > 0
    parts = re.compile(r".+ \((forward|backward)\)$|log-probs and loss|optimizer and metrics")
    for device in sharded["timeline"]["devices"].values():  # exposed collectives named by the model's part
        labels = set(device["exposed_by_label"]) | {e["label"] for e in device["top_exposed"]}
        named = {label for label in labels if label not in (None, "unlabelled")}
        assert named and all(parts.fullmatch(label) for label in named), labels
    assert "| shape | layout | devices | processes | span ms | computation | collectives | exposed | idle |" in proc.stdout
    assert "SUMMARY weak scaling, 1 x 16 tokens per device, cpu" in proc.stdout
    assert "| tiny | fsdp_tensor | 4 | 1 |" in proc.stdout


@pytest.mark.slow
def test_two_processes_step_on_the_same_batch_as_one(tmp_path):
    out = tmp_path / "scaling.jsonl"
    proc = _run([*SHORT, "--devices", "2", "--layouts", "fsdp", "--processes", "2", "--out", str(out)], timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    single, one_process, two_processes = _records(out)
    assert single["devices"] == 1 and one_process["processes"] == 1 and two_processes["processes"] == 2
    assert one_process["devices"] == two_processes["devices"] == 2
    assert one_process["mesh"] == two_processes["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
    # the same params and global batch: the same loss, whichever process holds which device
    assert two_processes["loss"] == pytest.approx(one_process["loss"], rel=1e-5)
    assert two_processes["vs_one_process"] == pytest.approx(  # rounded to 4 decimals
        two_processes["tokens_per_s"] / one_process["tokens_per_s"], abs=1e-4)
    assert two_processes["remat_warnings"] == 0
    assert "| tiny | fsdp | 2 | 2 |" in proc.stdout


def test_a_failed_worker_fails_the_script():
    proc = _run([*SHORT, "--devices", "1", "--timeout", "1"])
    assert proc.returncode == 1
    record = json.loads(proc.stdout.splitlines()[0])
    assert record["layout"] == "single" and "killed after 1 s (--timeout)" in record["error"]
    assert "| tiny | single | 1 | 1 | failed: worker exited" in proc.stdout


def test_bad_arguments_are_refused_in_one_line():
    proc = _run(["--layouts", "fsdp,pipeline"])
    assert proc.returncode == 2 and "--layouts: ['pipeline'] not understood" in proc.stderr
    proc = _run(["--devices", "two"])
    assert proc.returncode == 2 and "--devices and --processes take comma-separated integers" in proc.stderr
    proc = _run(["--rows-per-device", "8", "--micro-batches", "3"])
    assert proc.returncode == 2 and "--micro-batches 3 must divide --rows-per-device 8" in proc.stderr
    proc = _run(["--rows-per-device", "8", "--micro-batches", "2", "--layer-row-splits", "3"])
    assert proc.returncode == 2 and "--layer-row-splits 3 must divide a micro-batch's rows per device (4)" in proc.stderr
    proc = _run(["--rule", "act_residual_bach=tensor"])  # the trainer's own rule check, before any worker runs
    assert proc.returncode == 2 and "sharding rule 'act_residual_bach': no such logical name" in proc.stderr


@pytest.mark.slow
def test_compile_only_reports_collectives_and_no_rematerialization(tmp_path):
    out = tmp_path / "scaling.jsonl"
    proc = _run([*SHORT, "--devices", "4", "--layouts", "tensor", "--compile-only", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record,) = _records(out)  # no one-device baseline: nothing is timed
    assert record["mesh"] == {"data": 1, "fsdp": 1, "tensor": 4} and "step_ms" not in record
    assert record["remat_warnings"] == 0 and record["collectives"]["all-reduce"] > 0
    assert record["collectives"]["all-to-all"] == record["collectives"]["collective-permute"] == 0
    assert "| tiny | tensor | 4 | 1 | " in proc.stdout and "| compile s | all-gather |" in proc.stdout


@pytest.mark.slow
def test_precompiled_runs_load_their_programs_from_the_cache(tmp_path):
    """--precompile compiles every run's program first (concurrently, compile-only workers); the timed runs then
    find theirs in the persistent cache: the cache holds one train-step program per run and no more, and the
    rule override reaches the workers (its own program, recorded in the JSON)."""
    out, cache = tmp_path / "scaling.jsonl", tmp_path / "cache"
    env_cache = {"JAX_COMPILATION_CACHE_DIR": str(cache)}
    args = [*SHORT, "--devices", "1,4", "--layouts", "fsdp_tensor", "--precompile", "2", "--out", str(out),
            "--rule", "act_residual_batch=data,fsdp,tensor"]
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", **env_cache}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "scripts/bench_scaling.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    single, sharded = _records(out)
    assert "precompiled 2 programs" in proc.stderr
    entries = [p.name for p in cache.iterdir() if p.name.endswith("-cache")]  # (a bounded cache has "-atime" too)
    assert sorted(name.split("-")[0] for name in entries if name.startswith("jit_train_step")) == [
        "jit_train_step"] * 2
    compiled = {int(d): float(t) for d, t in re.findall(r"precompiled tiny \S+ on (\d) devices \(1 processes\): "
                                                        r"([0-9.]+) s", proc.stderr)}
    assert set(compiled) == {1, 4}, proc.stderr[-2000:]
    for r in (single, sharded):  # loaded, not compiled again (seconds against a fraction of one)
        assert r["compile_s"] < 0.5 * compiled[r["devices"]], (r["compile_s"], compiled)
    assert sharded["rules"] == {"act_residual_batch": ["data", "fsdp", "tensor"]}
    assert single["precompiled"] is True and sharded["precompiled"] is True  # warnings counted from there
    assert sharded["remat_warnings"] == 0 and np.isfinite(sharded["loss"]) and single["tokens_per_s"] > 0


def test_collectives_in_loops_are_those_of_while_bodies():
    """`collectives_in_loops` counts a collective inside a loop's body (once per iteration when run) and not one
    outside it; on a program of 2 fake CPU devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    bench = load_script("bench_scaling")
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])

    def program(in_loop: bool):
        def body(x):
            if in_loop:
                return jax.lax.fori_loop(0, 3, lambda i, a: a + jax.lax.psum(a * i, "d"), x)
            return jax.lax.fori_loop(0, 3, lambda i, a: a * 2.0 + i, x) + jax.lax.psum(x, "d")

        f = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        return jax.jit(f).lower(jnp.ones(8)).compile().as_text()

    inside, outside = program(True), program(False)
    assert bench.count_collectives(inside)["all-reduce"] >= 1 and bench.collectives_in_loops(inside)["all-reduce"] >= 1
    assert bench.count_collectives(outside)["all-reduce"] >= 1
    assert bench.collectives_in_loops(outside) == dict.fromkeys(bench.COLLECTIVES, 0)


def test_trace_timeline_breakdown_against_a_per_nanosecond_count():
    """trace_timeline.breakdown's interval arithmetic (computation and collectives merged separately, the
    collective time no computation covers, the time nothing runs) equals counting every nanosecond of the span."""
    timeline = load_script("trace_timeline")
    rng = np.random.default_rng(0)
    names = ["fusion.3", "gemm_7", "all-reduce.12", "ncclDevKernel_AllGather_RING_LL", "reduce-scatter.1", "copy.2"]
    for _ in range(20):
        events = []
        for _ in range(rng.integers(1, 30)):
            start = int(rng.integers(0, 5000))  # in microseconds: the breakdown's figures are ms to 3 decimals
            events.append((str(rng.choice(names)), 1000 * start, 1000 * (start + int(rng.integers(1, 800)))))
        steps = int(rng.integers(1, 4))
        got = timeline.breakdown(events, steps)
        lo, hi = min(s for _, s, _ in events) // 1000, max(e for _, _, e in events) // 1000
        comm, work = np.zeros(hi - lo, bool), np.zeros(hi - lo, bool)  # one entry per microsecond
        for name, s, e in events:
            (comm if timeline.COLLECTIVE.search(name.lower()) else work)[s // 1000 - lo:e // 1000 - lo] = True
        want = {"span_ms": hi - lo, "compute_ms": work.sum(), "collective_ms": comm.sum(),
                "exposed_collective_ms": (comm & ~work).sum(), "idle_ms": (~comm & ~work).sum()}
        for key, us in want.items():
            assert got[key] == round(int(us) * 1000 / 1e6 / steps, 3), (key, events)  # ns, as the script rounds
        exposed = sum(row["ms"] for row in got["top_exposed"])
        assert exposed >= got["exposed_collective_ms"] - 1e-3 * len(got["top_exposed"]) or len(got["top_exposed"]) == 8
    with pytest.raises(ValueError, match="no device events"):
        timeline.breakdown([], 1)


def test_trace_events_are_named_by_whichever_name_the_program_labels():
    """A kernel is labelled by the HLO op the trace gives it when the program's text knows that op (a cuBLAS kernel
    has a library name of its own), else by its kernel name (a fusion's kernel is named after its instruction; a
    trace may give one HLO op for all the kernels a command buffer replays); neither known: the HLO op."""
    timeline = load_script("trace_timeline")
    labels = {"custom-call_5": "MLP (forward)", "loop_add_fusion_2": "norms (forward)"}
    events = [("nvjet_tst_128x256", "custom-call.5", 0, 10),        # library kernel: its HLO op
              ("loop_add_fusion_2", "command_buffer.1", 10, 20),    # a command buffer's name: the kernel's own
              ("loop_add_fusion_2", None, 20, 30),                  # no HLO op in the trace
              ("input_reduce_fusion", "fusion.9", 30, 40),          # neither labelled: the HLO op
              ("memset32", None, 40, 45)]
    assert timeline.named(events, labels) == [("custom-call.5", 0, 10), ("loop_add_fusion_2", 10, 20),
                                              ("loop_add_fusion_2", 20, 30), ("fusion.9", 30, 40),
                                              ("memset32", 40, 45)]
    assert [n for n, _, _ in timeline.named(events)] == [e[0] for e in events]
    assert timeline.time_by_label(timeline.named(events, labels), labels, 1e-6) == {  # ns as ms: 1e-6 "steps"
        "norms (forward)": 20, "unlabelled": 15, "MLP (forward)": 10}


def test_hlo_instructions_describe_each_instruction_by_its_kernel_key():
    """trace_timeline.hlo_instructions: shape, opcode and op_name of every instruction (tuple shapes, fused
    instructions and ones without metadata included), keyed as the trace's kernels are."""
    timeline = load_script("trace_timeline")
    hlo = """HloModule jit_step
%fused_computation.3 (param_0: bf16[8,16]) -> bf16[16,8] {
  %param_0 = bf16[8,16]{1,0} parameter(0)
  ROOT %transpose.1 = bf16[16,8]{1,0} transpose(bf16[8,16]{1,0} %param_0), dimensions={1,0}, metadata={op_name="jit(step)/mlp/transpose"}
}
ENTRY %main (p: bf16[8,16]) -> (bf16[16,8], f32[]) {
  %p = bf16[8,16]{1,0} parameter(0)
  %copy.7 = bf16[8,16]{0,1} copy(bf16[8,16]{1,0} %p)
  %loop_transpose_fusion.2 = bf16[16,8]{1,0} fusion(bf16[8,16]{0,1} %copy.7), kind=kLoop, calls=%fused_computation.3, metadata={op_name="jit(step)/transpose(jvp(model))/mlp/down_proj/dot_general"}
  %tuple.4 = (bf16[16,8]{1,0}, f32[]) tuple(bf16[16,8]{1,0} %loop_transpose_fusion.2, f32[] %c)
}"""
    got = timeline.hlo_instructions(hlo)
    assert got["copy_7"] == "bf16[8,16]{0,1} copy"
    assert got["transpose_1"] == "bf16[16,8]{1,0} transpose jit(step)/mlp/transpose"
    assert got["loop_transpose_fusion_2"] == ("bf16[16,8]{1,0} fusion "
                                              "jit(step)/transpose(jvp(model))/mlp/down_proj/dot_general")
    assert got["tuple_4"] == "(bf16[16,8]{1,0}, f32[]) tuple"
