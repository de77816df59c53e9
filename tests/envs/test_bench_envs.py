"""The short version of scripts/bench_envs.py runs end to end and reports sane figures."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.envs.sandbox_helpers import SKIP_DOCKER_ENV

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.docker
def test_bench_envs_quick(tmp_path):
    backends = ["bwrap"] if os.environ.get(SKIP_DOCKER_ENV) == "1" else ["bwrap", "docker"]
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_envs.py", "--quick", "--backends", *backends, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert "manager  100 chains" in proc.stdout and results["machine"].startswith("CPU (")
    spare, queued = results["manager"]
    assert spare["pool_size"] == 200 and queued["pool_size"] == 10
    for m in (spare, queued):
        assert m["cycles_per_s"] > 100 and m["acquire_p50_ms"] <= m["acquire_p99_ms"] <= m["acquire_max_ms"]
    assert queued["created"] == 10  # a queued pool reuses its instances instead of creating more
    assert [s["runs"]["backend"] for s in results["sandbox"]] == backends
    for s in results["sandbox"]:
        assert s["runs"]["execs_per_s"] > 0.5 and s["session"]["cells_per_s"] > 10
