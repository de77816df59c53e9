"""BFCL multi-turn function calling (environments/bfcl): an agent fulfils several user requests in a row by
calling the functions of real BFCL backends (file system, trading bot, travel booking, vehicle control, ...).

    agentfly-train --config experiments/smollm2_bfcl.py          # one GPU (8192-token chains)
    agentfly-train --config experiments/smollm2_bfcl.py:cpu      # one-step plumbing run on a CPU
    python scripts/eval_env.py --env bfcl --agent oracle --num 64   # the oracle scores 1.0 on the test split

Tasks are BFCL's multi_turn_base (135 train / 64 held-out test); `BFCLAgent` delivers the next user turn each
time the model answers without a tool call. The reward is the fraction of user turns after which the backend
state and the results read match the ground truth's (success: all of them). Prompts are long: the task's
function schemas alone are 1.7k-4.2k tokens (median 2.7k, qwen2.5 tokenizer); with SmolLM2's tokenizer the
ground-truth chains are 2.1k-5.4k tokens (median 3.7k), so the context is the model's whole 8192 tokens
(max_context_tokens + max_new_tokens). An SFT warm start on the ground-truth
conversations (tool calls, real outputs, "Done." per turn) teaches the call format and the turn-taking first;
GRPO groups of 8 chains per task then give the reward differences to learn from.
The policy is SmolLM2-135M-Instruct (experiments/common.py: `smollm2`); held-out: the 64 test tasks x 2 chains.
"""
from experiments.common import base, smollm2, smollm2_cpu, smollm2_grpo, smollm2_sft


def get_config(arg: str | None = None):
    c = base("runs/smollm2_bfcl", "bfcl", pool_size=256, max_turns=24)
    smollm2(c, cpu=arg == "cpu")
    c.task.update(dict(num_train=0, num_eval=64))
    c.seq_buckets = (4096, 6144, 8192)
    c.agent.update(dict(max_turns=24, max_new_tokens=256, max_context_tokens=7936, max_observation_chars=2000))
    c.jax_sampler.update(dict(max_slots=64, max_len=8192, steps_per_call=16))
    # SFT: the ground truth only (format + turn-taking), then a mix in which 30% answer without calling
    smollm2_sft(c, ((60, 1.0), (20, 0.7)), batch_size=16)
    smollm2_grpo(c, steps=20, tasks_per_step=8, chains_per_task=8, eval_tasks=64, eval_chains=2)
    c.eval.every = 10
    if arg == "cpu":
        # Prompts alone are up to 4.2k tokens, and 30 layers of attention over 5k-token rows need more memory
        # than a CPU machine has: the plumbing run keeps the real tokenizer, template and context but swaps in the
        # tiny random policy (same vocabulary, 2 layers).
        smollm2_cpu(c, context=5120, buckets=(5120,), real_model=False)
        c.env.options.pool_size = 8
        # the SFT demonstrations are whole conversations (up to 5.4k tokens); the RL rows (prompts of 2-4k tokens)
        # take the smallest bucket that holds them: attention over a packed row is quadratic in its length
        c.seq_buckets = (2048, 4096, 8192)
        c.jax_sampler.max_len = 5120
        c.rl.micro_batches = 2
    elif arg:
        raise ValueError(f"experiments/smollm2_bfcl.py takes no argument or 'cpu', got {arg!r}")
    return c
