"""Calculator arithmetic on a real pretrained model: SmolLM2-135M-Instruct learns to call its `calculator` tool.

    agentfly-train --config experiments/smollm2_arithmetic.py          # one GPU (≈ 10 min on an H100/H200)
    agentfly-train --config experiments/smollm2_arithmetic.py:cpu      # one-step plumbing run on a CPU

The quickstart's task (environments/arithmetic: "What is 417 * 38?", scored by exact match) on the real model
that set-up builds (`.cache/models/SmolLM2-135M-Instruct`, dequantised Q4_1 weights). Alone, the model answers
from memory and is mostly wrong on 2-3 digit operands; it has never seen the `<tool_call>` format. A short SFT
warm start on the environment's demonstrations teaches the format from a mix in which only part of the answers
use the tool (`sft.stages`), so the warm-started policy calls it some of the time; GRPO then has groups whose
chains differ (tool: right; guess: mostly wrong) and raises held-out success. Success is measured before SFT,
after SFT and after RL on 128 held-out tasks with the training sampling (temperature 1, top_p 1).
"""
from experiments.common import base, smollm2, smollm2_cpu, smollm2_grpo, smollm2_sft


def get_config(arg: str | None = None):
    c = base("runs/smollm2_arithmetic", "arithmetic", operand_min=10, operand_max=999, ops="*+-", num_heldout=128)
    smollm2(c, cpu=arg == "cpu")
    c.task.update(dict(num_train=8000, num_eval=128))
    c.seq_buckets = (256, 512, 1024)
    c.agent.update(dict(max_turns=3, max_new_tokens=96, max_context_tokens=1024))
    c.jax_sampler.update(dict(max_slots=256, max_len=1024, steps_per_call=16))
    # the tool format first, then a mix with 70% guesses: the warm start calls its tool a minority of times
    smollm2_sft(c, ((40, 1.0), (40, 0.3)), batch_size=32)
    smollm2_grpo(c, steps=60, tasks_per_step=32, chains_per_task=8)
    if arg == "cpu":
        smollm2_cpu(c)
    elif arg:
        raise ValueError(f"experiments/smollm2_arithmetic.py takes no argument or 'cpu', got {arg!r}")
    return c
