"""BFCL multi-turn function calling (environments/bfcl): an agent fulfils several user requests in a row by
calling the functions of real BFCL backends (file system, trading bot, travel booking, vehicle control, ...).

    agentfly-train --config experiments/smollm2_bfcl.py          # GPU shape (8192-token chains)
    agentfly-train --config experiments/smollm2_bfcl.py:cpu      # CPU plumbing check (tiny policy, 1 step)
    python scripts/eval_env.py --env bfcl --agent oracle --num 64   # the oracle scores 1.0 on the test split

Tasks are BFCL's multi_turn_base (135 train / 64 held-out test); `BFCLAgent` delivers the next user turn each
time the model answers without a tool call. The reward is the fraction of user turns after which the backend
state and the results read match the ground truth's (success: all of them). Prompts are long: the task's
function schemas alone are 1.7k-4.2k tokens (median 2.7k, qwen2.5 tokenizer), ground-truth chains 1.9k-4.8k,
so the context is 8192 tokens (max_context_tokens + max_new_tokens). An SFT warm start on the ground-truth
conversations (tool calls, real outputs, "Done." per turn) teaches the call format and the turn-taking first;
GRPO groups of 8 chains per task then give the reward differences to learn from.

The policy here is the tiny random one (the pipeline runs, nothing is learned); a real run sets the real
checkpoint (experiments/common.py: `smollm2(c)`, or model.hf_path and tokenizer.path).
"""
from experiments.common import base, cpu_plumbing, tiny_policy


def get_config(arg: str | None = None):
    c = base("runs/smollm2_bfcl", "bfcl", pool_size=256, max_turns=24)
    tiny_policy(c, max_position_embeddings=8192)
    c.tokenizer.kind = "qwen2.5"
    c.chat_template = "qwen2.5"
    c.algorithm = "grpo"
    c.task.update(dict(num_train=0, num_eval=64))
    c.seq_buckets = (4096, 6144, 8192)
    c.row_bucket = 8
    c.agent.update(dict(max_turns=24, max_new_tokens=256, max_context_tokens=7936, temperature=1.0,
                        max_observation_chars=2000))
    c.jax_sampler.update(dict(max_slots=128, max_len=8192, steps_per_call=16))
    # SFT: the ground truth only (format + turn-taking), then a mix in which 30% answer without calling
    c.sft.update(dict(stages=((60, 1.0), (20, 0.7)), batch_size=16))
    c.sft.optimizer.update(dict(learning_rate=5e-5, warmup_steps=5, decay_steps=80, schedule="cosine",
                                end_lr_ratio=0.1))
    c.rl.update(dict(steps=100, tasks_per_step=16, chains_per_task=8, ppo_epochs=1, mini_batches=4, micro_batches=2))
    c.optimizer.update(dict(learning_rate=1e-5, warmup_steps=0, schedule="constant"))
    c.loss.clip_eps_high = 0.28
    c.checkpoint.update(dict(every=25, keep=1))
    c.eval.update(dict(every=25, num_tasks=64, num_chains=1, temperature=1.0, top_p=1.0, sampled_chains=0))
    if arg == "cpu":
        # prompts alone are up to 4.2k tokens: the plumbing run keeps the real context, 2 turns of 32 tokens
        cpu_plumbing(c, context=5120, buckets=(5120,), turns=2, new_tokens=32, slots=4, eval_tasks=0)
        c.env.options.pool_size = 8
        c.task.num_eval = 4
        c.rl.micro_batches = 2  # 5k-token rows on a CPU: two at a time
        c.jax_sampler.max_len = 5120
        c.sft.update(dict(stages=((1, 1.0),), batch_size=2))
        c.sft.optimizer.update(dict(warmup_steps=0, decay_steps=1))
    elif arg:
        raise ValueError(f"experiments/smollm2_bfcl.py takes no argument or 'cpu', got {arg!r}")
    return c
