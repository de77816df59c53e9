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
                   "--seq-len", "64", "--out", str(out)])
    assert "SUMMARY tiny" in stdout
    record = json.loads(out.read_text().splitlines()[-1])
    for side in ("ours", "peer"):
        assert record[side]["tokens_per_s"] > 0 and record[side]["step_ms"] > 0
    assert record["ours"]["impl"] == "agentfly_jax" and record["peer"]["impl"] == "transformers+torch"


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
