"""Quickstart: RL teaches a tiny agent to use its calculator instead of guessing — offline, on a CPU.

    agentfly-train --config experiments/quickstart.py
    agentfly-train --config experiments/quickstart.py --config.algorithm=ppo   # grpo drgrpo rloo reinforce_pp ppo
    agentfly-train --config experiments/quickstart.py --config.backend=vllm --config.vllm.launch=True
    agentfly-train --config experiments/quickstart.py --config.backend=vllm \
        --config.vllm.urls="('http://127.0.0.1:8000',)"   # servers started by scripts/start_vllm.sh
    agentfly-train --config experiments/quickstart.py:cpu    # a one-step plumbing run (seconds)

The `arithmetic` environment's own tokenizer and a tiny Qwen2-architecture model are warm-started by SFT on its
demonstrations, in which only part of the answers use the `calculator` tool (the rest guess, see `sft.stages`),
so the agent starts out succeeding less than half of the time; RL then raises success on held-out arithmetic
tasks. Results: `<workdir>/summary.json`, TensorBoard in `<workdir>/tensorboard`.
"""
from experiments.common import base, tiny_policy


def get_config(arg: str | None = None):
    c = base("runs/quickstart", "arithmetic", operand_min=10, operand_max=999, ops="*+-", num_heldout=64)
    c.algorithm = "grpo"
    c.seq_buckets = (64, 128, 256)  # packed row lengths (tokens)
    c.row_bucket = 8
    c.task.update(dict(num_train=4000, num_eval=64))
    c.tokenizer.kind = "env"  # the environment's small tokenizer, trained on its questions
    tiny_policy(c, max_position_embeddings=512)
    c.agent.update(dict(max_turns=3, max_new_tokens=48, max_context_tokens=256, temperature=1.0))
    c.jax_sampler.update(dict(max_slots=128, max_len=256))
    c.vllm.server_args = ("--dtype", "float32", "--max-model-len", "512")

    # SFT warm start in two stages of demonstrations: tool calls only (the call format and copying numbers,
    # long enough that a call and its answer are copied exactly under sampling: stage loss ~1e-3 per token),
    # then a mix in which 60% of the answers are guesses, so the warm-started agent calls its tool ~40% of the
    # time and succeeds at most about that often. lr 3e-3 (1e-2 learned copying on some CPUs and not others).
    c.sft.update(dict(stages=((1400, 1.0), (150, 0.4)), batch_size=64))
    c.sft.optimizer.update(dict(learning_rate=3e-3, warmup_steps=20, decay_steps=1530, schedule="cosine",
                                end_lr_ratio=0.1))
    # RL at 3e-4: Adam's first steps at 1e-3 or more knock the tiny warm-started model's copying out
    c.rl.update(dict(steps=40, tasks_per_step=16, chains_per_task=8, ppo_epochs=1, mini_batches=1, micro_batches=1))
    c.optimizer.update(dict(learning_rate=3e-4, schedule="constant"))
    c.critic.optimizer.update(dict(learning_rate=3e-3))  # read by the ppo recipe only
    c.loss.clip_eps_high = 0.28
    c.checkpoint.update(dict(every=10, keep=2))
    # Success = sampling at temperature 1 with nucleus top_p 0.95, 4 chains per held-out task: the policy's own mix
    # of tool use and guessing, without its lowest-probability tail of slips. Logged beside it: plain sampling
    # (the training distribution) as eval/success_sampled. Greedy decoding (temperature=0.0) would hide the mix.
    c.eval.update(dict(every=20, num_tasks=64, num_chains=4, temperature=1.0, top_p=0.95, sampled_chains=4))
    if arg == "cpu":  # the plumbing variant: a few SFT and RL steps, small rollouts
        c.sft.update(dict(stages=((30, 1.0), (10, 0.4)), batch_size=16))
        c.sft.optimizer.decay_steps = 40
        c.rl.update(dict(steps=1, tasks_per_step=4, chains_per_task=4))
        c.eval.update(dict(num_tasks=8, sampled_chains=2))
    elif arg:
        raise ValueError(f"experiments/quickstart.py takes no argument or 'cpu', got {arg!r}")
    return c
