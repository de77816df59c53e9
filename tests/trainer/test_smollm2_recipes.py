"""Every SmolLM2 recipe (experiments/smollm2_*.py) runs end to end: its `:cpu` variant (a one-step SFT warm start
on the environment's demonstrations, one GRPO step on the real environment, the final export) through the
`agentfly-train` command, as a user starts it. Arithmetic runs the real pretrained checkpoint; the other recipes'
plumbing runs keep its tokenizer, vocabulary and template with a tiny random model (experiments/common.py
`smollm2_cpu(real_model=False)`): the real model's loading, sampling and export are the same in every recipe, and
on a CPU each run of it costs about two minutes of the suite.

The runs share the suite's persistent XLA compilation cache (tests/conftest.py).
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
RECIPES = ["arithmetic", "math", "search", "webshop", "bfcl", "alfworld", "scienceworld"]
REAL_MODEL = ("arithmetic",)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint():
    if not (CHECKPOINT / "agentfly_build.json").is_file():
        pytest.fail("the SmolLM2 checkpoint is missing: run scripts/setup.sh (scripts/setup_models.sh builds it)")
    return CHECKPOINT


def train_cpu_variant(experiment: str, workdir, timeout: int = 1500) -> None:
    """`experiments/<experiment>:cpu` through the `agentfly-train` module in its own process, as a user starts it
    (one CPU device: the suite's conftest fakes 8); fails with the run's stderr when it does not finish."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "agentfly_jax.train", f"--config={ROOT}/experiments/{experiment}:cpu",
           f"--config.workdir={workdir}", "--config.progress=False"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("recipe", RECIPES)
def test_cpu_variant_runs_sft_and_an_rl_step(recipe, tmp_path, checkpoint):
    workdir = tmp_path / "run"
    train_cpu_variant(f"smollm2_{recipe}.py", workdir)

    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["environment"] in (recipe, "math_word")
    config = json.loads((workdir / "config.json").read_text())
    assert config["tokenizer"]["path"].endswith("SmolLM2-135M-Instruct") and config["chat_template"] == "qwen2.5"
    if recipe in REAL_MODEL:
        assert config["model"]["hf_path"].endswith("SmolLM2-135M-Instruct")
    else:
        assert config["model"]["hf_path"] == "" and config["model"]["vocab_size"] == 49152
    rows = [json.loads(line) for line in (workdir / "tensorboard" / "metrics.jsonl").open()]
    sft = [r for r in rows if "sft/loss" in r]
    rl = [r for r in rows if "reward/mean" in r]
    assert sft and math.isfinite(sft[-1]["sft/loss"]) and sft[-1]["sft/loss"] > 0
    assert len(rl) == 1 and rl[0]["rollout/chains_finished"] == 2 and rl[0]["rollout/finish/error"] == 0
    assert rl[0]["sampler/compiles"] >= 3  # prefill, insert and decode programs were traced
    assert math.isfinite(rl[0]["policy/loss"]) and rl[0]["update/tokens"] > 0

    final = workdir / "final_policy"
    generation = json.loads((final / "generation_config.json").read_text())
    assert 2 in (generation["eos_token_id"] if isinstance(generation["eos_token_id"], list)
                 else [generation["eos_token_id"]])  # <|im_end|>, the template's end of turn
    assert (final / "chat_template.jinja").is_file() and (final / "model.safetensors").is_file()
