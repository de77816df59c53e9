"""Short versions of the benchmark scripts: they must run end to end and report sane numbers."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, timeout=300):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)  # the script's own process: one CPU device, as a user would run it
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_bench_update_short(tmp_path):
    out = tmp_path / "bench.jsonl"
    stdout = _run(["scripts/bench_update.py", "--shape", "tiny", "--steps", "2", "--warmup", "1", "--batch", "2",
                   "--seq-len", "64", "--profile", "1", "--out", str(out)])
    assert "SUMMARY tiny" in stdout
    record = json.loads(out.read_text().splitlines()[-1])
    for side in ("ours", "peer"):
        assert record[side]["tokens_per_s"] > 0 and record[side]["step_ms"] > 0
    assert record["ours"]["impl"] == "agentfly_jax" and record["peer"]["impl"] == "transformers+torch"
    # --profile: the traced step's kernels by part of the update, read from the HLO's op names
    parts = record["ours"]["profile"]["parts_ms"]
    for part in ("MLP (forward)", "MLP (backward)", "attention (forward)", "attention (backward)",
                 "log-probs and loss", "optimizer and metrics"):
        assert parts.get(part, 0) > 0, (part, parts)
    assert sum(record["ours"]["profile"]["unlabelled_top"].values()) <= parts.get("unlabelled", 0) + 1e-3
    # the largest copies, each with what its instruction is (shape and opcode from the program's text), the same
    # copy of every layer counted in one entry
    copies = record["ours"]["profile"]["copies_top"]
    assert copies and sum(c["ms"] for c in copies) <= record["ours"]["profile"]["kinds_ms"]["copies"] + 1e-3
    assert all(c["hlo"].split()[1] in ("copy", "fusion", "transpose", "concatenate") for c in copies), copies
    assert all("layers_" not in c["hlo"] or "layers_*" in c["hlo"] for c in copies), copies
    assert any(c["count"] > 1 for c in copies), copies  # the tiny model's two layers copy alike
    assert "--xla_gpu_enable_command_buffer=" in record["ours"]["xla_flags"]  # kernels named one by one on a GPU


def test_bench_update_optimizer_mode_short(tmp_path):
    """--mode optimizer: each setting's step alone, ours and torch's; "hybrid:off" compiles fewer kernels than
    "hybrid" (its default "applied" update norm is a reduction of its own: optimizer.update_norm)."""
    out = tmp_path / "optimizer.jsonl"
    stdout = _run(["scripts/bench_update.py", "--shape", "tiny", "--mode", "optimizer", "--steps", "2", "--warmup",
                   "1", "--optimizer-settings", "hybrid", "hybrid:off", "off:exact", "--out", str(out)])
    assert "SUMMARY optimizer step tiny" in stdout
    record = json.loads(out.read_text().splitlines()[-1])
    variants = record["ours"]["variants"]
    assert [k for k in variants if k != "parameter_leaves"] == ["hybrid", "hybrid:off", "off:exact"]
    assert all(variants[k]["step_ms"] > 0 for k in ("hybrid", "hybrid:off", "off:exact"))
    assert variants["hybrid:off"]["fusions"] < variants["hybrid"]["fusions"]
    assert record["peer"]["step_ms"] > 0


def test_bench_update_rl_step_mode_short(tmp_path):
    """--mode rl_step: prepare + train step for each rl.old_logprobs setting (ours only); with "auto" the compiled
    prepare does no floating-point work of the policy's (the train step's forward pass gives the old log-probs)."""
    out = tmp_path / "rl_step.jsonl"
    stdout = _run(["scripts/bench_update.py", "--shape", "tiny", "--mode", "rl_step", "--steps", "1", "--warmup",
                   "0", "--batch", "8", "--seq-len", "32", "--out", str(out)])
    assert "SUMMARY GRPO update (prepare + train step) tiny" in stdout
    variants = json.loads(out.read_text().splitlines()[-1])["ours"]["variants"]
    assert list(variants) == ["prepare", "auto"] and all(v["step_ms"] > 0 for v in variants.values())
    assert variants["prepare"]["prepare_gflop"] > 0.1 and variants["auto"]["prepare_gflop"] < 1e-3


def test_bench_train_attention_short(tmp_path):
    """The CPU version: the einsum path timed on packed rows with padding; cuDNN's kernels, absent here, each
    reported as an error line, not a crash."""
    out = tmp_path / "attention.jsonl"
    stdout = _run(["scripts/bench_train_attention.py", "--batch", "2", "--seq-len", "32", "--heads", "4",
                   "--kv-heads", "2", "--head-dim", "8", "--dtype", "float32", "--segments", "1", "3", "--pad", "4",
                   "--repeats", "2", "--impls", "xla", "cudnn_segments", "--out", str(out)])
    lines = [json.loads(line) for line in stdout.splitlines()]
    timed = [r for r in lines if "error" not in r]
    assert [(r["impl"], r["segments"]) for r in timed] == [("xla", 1), ("xla", 3)]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in timed)
    assert [json.loads(line) for line in out.read_text().splitlines()] == timed
    assert [r["impl"] for r in lines if "error" in r] == ["cudnn_segments"] * 2


def test_bench_logprobs_short(tmp_path):
    out = tmp_path / "logprobs.jsonl"
    stdout = _run(["scripts/bench_logprobs.py", "--batch", "2", "--seq-len", "16", "--vocab", "512",
                   "--temperature", "0.7", "--repeats", "2", "--out", str(out)])
    records = [json.loads(line) for line in stdout.splitlines()]
    assert [r["impl"] for r in records] == ["ours", "autodiff"]
    assert all(r["ms"] > 0 and r["temp_mib"] is not None for r in records)
    assert records[1]["max_abs_grad_diff_vs_ours"] < 0.05  # the same function: a bf16 ulp or two (0.016 at 2-4)
    assert [json.loads(line) for line in out.read_text().splitlines()] == records


@pytest.mark.slow
def test_bench_lora_short(tmp_path):
    out = tmp_path / "lora.jsonl"
    stdout = _run(["scripts/bench_lora.py", "--shapes", "tiny", "--steps", "2", "--warmup", "1", "--batch", "2",
                   "--seq-len", "64", "--out", str(out)])
    assert "SUMMARY tiny" in stdout
    record = json.loads(out.read_text().splitlines()[-1])
    full, adapters = record["full"], record["lora"]
    assert full["lora_rank"] == 0 and adapters["lora_rank"] == 16
    # the optimiser holds two moments of exactly the trained values: all of them, or the adapters only
    assert full["optimizer_values"] == 2 * full["trained_values"]
    assert adapters["optimizer_values"] == 2 * adapters["trained_values"] < full["optimizer_values"] / 4
    assert full["step_ms"] > 0 and adapters["step_ms"] > 0 and record["ratios"]["step_time"] > 0


@pytest.mark.slow
def test_profile_decode_short(tmp_path):
    """The decode profile on the tiny model: a trace is read back, the device time is split over the decode
    program's named scopes (the sampling and the layers' parts are found in the HLO) and shares sum to 1."""
    out = tmp_path / "profile.jsonl"
    _run(["scripts/profile_decode.py", "--shape", "tiny", "--dtype", "float32", "--batches", "4", "--context", "32",
          "--steps", "4", "--calls", "2", "--top", "5", "--out", str(out)])
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["batch"] == 4 and row["device_ms_per_step"] > 0 and row["tokens_per_s"] > 0
    assert {"sampling", "mlp", "attention"} <= set(row["kinds"]), row["kinds"]
    assert sum(k["share"] for k in row["kinds"].values()) == pytest.approx(1.0, abs=1e-3)
    assert len(row["top_ops"]) == 5


@pytest.mark.slow
def test_bench_decode_attention_short(tmp_path):
    """Decode attention on a small cache: the einsum paths and the interpreted Pallas kernel agree (the same
    inputs) and the best Pallas setting is reported."""
    out = tmp_path / "attn.jsonl"
    _run(["scripts/bench_decode_attention.py", "--batches", "2", "--layers", "2", "--max-len", "256", "--live", "40",
          "--dtype", "float32", "--impls", "xla_stacked", "xla", "pallas_interpret", "--splits", "4", "16",
          "--block-k", "32", "--repeats", "2", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["impl"] for r in rows] == ["xla_stacked", "xla", "pallas_interpret", "pallas_interpret",
                                         "pallas_interpret"]
    assert all(r["ms"] > 0 and r["max_abs_diff_vs_first"] < 1e-5 for r in rows)
    assert rows[-1]["best"] and rows[-1]["ms"] == min(r["ms"] for r in rows[2:4])
