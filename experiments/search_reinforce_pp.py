"""Wikipedia search QA with REINFORCE++: a tool-calling agent answers questions with a `search` tool over the
offline Wikipedia-summaries corpus (environments/search).

    agentfly-train --config experiments/search_reinforce_pp.py \
        --config.model.hf_path=/path/to/Qwen2.5-3B-Instruct --config.tokenizer.path=/path/to/Qwen2.5-3B-Instruct
    agentfly-train --config experiments/search_reinforce_pp.py:cpu         # CPU plumbing check
    python scripts/eval_env.py --env search --agent oracle --num 50         # the oracle reaches reward 1.0

Rows are generated single-hop questions (or FanOutQA sub-questions, `env.options.question_set`); the reward is
exact match of the final answer. REINFORCE++ needs one chain per question (its baseline is the batch, not a
group) and puts a small KL to the reference policy into the reward (`advantage.kl_in_reward_coef`).
"""
from experiments.common import agentfly_grpo, base, cpu_plumbing, tiny_policy


def get_config(arg: str | None = None):
    c = base("runs/search_reinforce_pp", "search", question_set="generated", retriever="bm25", pool_size=64)
    agentfly_grpo(c)
    c.algorithm = "reinforce_pp"
    c.advantage.kl_in_reward_coef = 0.01
    c.task.update(dict(num_train=0, num_eval=64))
    tiny_policy(c)
    c.seq_buckets = (1024, 2048, 4096)
    c.agent.update(dict(max_turns=4, max_new_tokens=128, max_context_tokens=4096, max_observation_chars=3000))
    c.jax_sampler.update(dict(max_slots=64, max_len=4096))
    c.rl.update(dict(steps=300, tasks_per_step=64, chains_per_task=1))
    c.checkpoint.every = 25
    c.eval.every = 25
    if arg == "cpu":
        cpu_plumbing(c)
    elif arg:
        raise ValueError(f"experiments/search_reinforce_pp.py takes no argument or 'cpu', got {arg!r}")
    return c
