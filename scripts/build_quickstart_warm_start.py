"""Builds tests/trainer/data/quickstart_warm_start/: the quickstart's tiny policy after an SFT warm start.

    python scripts/build_quickstart_warm_start.py            # about 9 minutes on a 2-core CPU, 1 on a GPU

The quickstart's own SFT stages, shortened as its vLLM test has always run them: 600 steps of tool-call
demonstrations (the call format and copying the numbers into it), then 150 steps of a mix in which 60% of the
answers are guesses, so that the warm-started policy calls its calculator ~40% of the time. No RL step. The
trainer's exported policy (`final_policy/`: config.json and model.safetensors, an HF Qwen2 checkpoint of 2.3 MB)
is copied into the repository with `build.json` (the command, the device, the SFT scalars at its end, the
tokenizer's size). The committed one was built on an H200 (the tokenizer files of a CPU run placed in the
workdir's `tokenizer/` first: the trainer loads them from there, so the vocabulary is the one the test suite's
runs build, whatever version of the tokenizers library trains it on the GPU host).

tests/trainer/test_train_loop.py::test_quickstart_on_the_vllm_server_improves_reward starts from it
(`config.model.hf_path`): its RL on the vLLM server needs a policy that copies numbers into its calls, which 750
SFT steps of this tiny model took ~8 minutes of the test on 2 cores to learn. The checkpoint goes with the
arithmetic environment's tokenizer, template and prompts: tests/trainer/test_warm_start_checkpoint.py fails when
they change under it (its demonstrations are no longer predicted); run this script again then.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "trainer", "data", "quickstart_warm_start")
SFT = ("--config.sft.stages=((600, 1.0), (150, 0.4))", "--config.sft.optimizer.decay_steps=730")
FILES = ("config.json", "model.safetensors")


def quickstart_run(workdir: str, checkpoint: str):
    """The trainer's set-up of the quickstart (no evaluation) on `checkpoint`: its tokenizer, agent and tasks."""
    from agentfly_jax.trainer import loop
    from experiments.quickstart import get_config

    c = get_config()
    c.workdir, c.progress, c.model.hf_path = workdir, False, checkpoint
    c.eval.update(dict(num_tasks=0, before_sft=False))
    return loop.setup(c)


def fingerprint(run) -> str:
    """sha256 of the first 8 demonstrations of each SFT stage as the trainer encodes them (token ids and action
    masks): it changes with the tokenizer, the chat template, the system prompt, the tool schemas and the
    demonstrations themselves, which the checkpoint was trained on."""
    from agentfly_jax.trainer import builders, loop

    digest = hashlib.sha256()
    stages = builders.sft_conversations(run.config, run.task_setup, run.train_tasks, run.tokenizer)
    for i, (_, demos) in enumerate(stages):
        first = loop._Demonstrations(run, demos[:8], i, longest=1 << 30)
        for e in map(first._encoded, range(len(first))):
            digest.update(json.dumps([[int(t) for t in e.token_ids], [int(m) for m in e.action_mask]]).encode())
    return digest.hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=OUT, help="where the checkpoint goes (default: %(default)s)")
    parser.add_argument("--workdir", default=None, help="the training run's workdir (default: a temporary one)")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="quickstart-warm-start-")
    command = [sys.executable, "-m", "agentfly_jax.train", "--config", "experiments/quickstart.py",
               f"--config.workdir={workdir}", *SFT, "--config.rl.steps=0", "--config.eval.num_tasks=0",
               "--config.eval.before_sft=False", "--config.checkpoint.every=0"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as the quickstart runs
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    summary = json.load(open(os.path.join(workdir, "summary.json")))
    final = summary["final_policy"]
    os.makedirs(args.out, exist_ok=True)
    for name in FILES:
        shutil.copy(os.path.join(final, name), os.path.join(args.out, name))
    import jax
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(workdir, "tokenizer"))
    record = {"command": ["python", "-m", "agentfly_jax.train", "--config", "experiments/quickstart.py", *SFT,
                          "--config.rl.steps=0", "--config.eval.num_tasks=0", "--config.eval.before_sft=False",
                          "--config.checkpoint.every=0"],
              "built": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
              "tokenizer_size": len(tokenizer), "sft": summary["sft"]}
    run = quickstart_run(tempfile.mkdtemp(prefix="quickstart-warm-start-check-"), args.out)
    try:
        record["fingerprint"] = fingerprint(run)
    finally:
        from agentfly_jax.trainer import loop

        loop._close_run(run)
    with open(os.path.join(args.out, "build.json"), "w") as fh:
        json.dump(record, fh, indent=2)
        fh.write("\n")
    print(f"wrote {', '.join(FILES)} and build.json to {args.out}; SFT at its end: {summary['sft']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
