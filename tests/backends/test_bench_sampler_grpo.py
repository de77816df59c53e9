"""scripts/bench_sampler.py --mode grpo (prefix caching on against off), the short CPU version end to end."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_grpo_short(tmp_path):
    """4 tasks x 4 chains x 2 turns, a slot per chain: caching computes the group's first prompt once and each
    second turn only its new tokens; completions equal those without caching; nothing compiles while measured."""
    out = tmp_path / "grpo.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user would run it
    proc = subprocess.run([sys.executable, "scripts/bench_sampler.py", "--mode", "grpo", "--shape", "tiny",
                           "--dtype", "float32", "--prompts", "4", "--chains", "4", "--turns", "2", "--slots", "16",
                           "--prompt-len", "64", "--new-tokens", "8", "--obs-len", "16", "--repeats", "1",
                           "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("SUMMARY grpo tiny") == 1
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    on, off = record["grpo"]
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)
    assert on["prompt_tokens"] == off["prompt_tokens"] == off["prefill_tokens"]
    assert on["prefix_hits"] == 4 * 4 and on["prefix_shared"] == 4 * 3 and on["prefix_evictions"] == 0
    assert on["prefill_tokens"] < off["prefill_tokens"] / 2
    assert on["completions_equal_other_setting"] == 1.0
    assert on["compiles_in_measured_round"] == off["compiles_in_measured_round"] == 0
    assert on["wall_s"] > 0 and off["wall_s"] > 0
