"""Your own task: JSONL rows, your @tool functions and your @reward, given by import path.

    agentfly-train --config experiments/custom_task.py \
        --config.task.train_path=my_data/train.jsonl --config.task.eval_path=my_data/eval.jsonl \
        --config.agent.tools="('my_package.tools:my_tool',)" --config.agent.reward=my_package.rewards:my_reward \
        --config.model.hf_path=/path/to/Qwen2.5-1.5B-Instruct --config.tokenizer.path=/path/to/Qwen2.5-1.5B-Instruct
    agentfly-train --config experiments/custom_task.py:cpu   # the bundled example, a tiny random policy (minutes)

Each row is a JSON object with a non-empty `question` plus any fields your reward (and tools taking `task`)
read by parameter name, e.g. {"question": "How many m are in 3 mile?", "answer": 4828.032}. The defaults
train on the bundled example (`experiments/custom_task_example`: unit conversions with a `convert_units` tool,
rewarded by `close_to_answer`). A custom agent class: `--config.agent.type=my_package.agents:MyAgent`.
Tools that need an environment instance name a pool; add the pool under `config.envs`. The tutorial:
docs/custom_task.md.
"""
from experiments.common import base, cpu_plumbing, tiny_policy

EXAMPLE = "experiments/custom_task_example"


def get_config(arg: str | None = None):
    c = base("runs/custom_task")
    c.task.update(dict(train_path=f"{EXAMPLE}/train.jsonl", eval_path=f"{EXAMPLE}/eval.jsonl", num_train=0,
                       num_eval=64))
    c.agent.update(dict(type="tool_calling", tools=("experiments.custom_task_example.tools:convert_units",),
                        reward="experiments.custom_task_example.rewards:close_to_answer", max_turns=3,
                        max_new_tokens=256, max_context_tokens=2048))
    c.algorithm = "grpo"
    c.tokenizer.kind = "qwen2.5"  # replace by tokenizer.path with model.hf_path for a real run
    c.chat_template = "qwen2.5"
    tiny_policy(c, max_position_embeddings=4096)
    c.seq_buckets = (1024, 2048)
    c.rl.update(dict(steps=100, tasks_per_step=8, chains_per_task=8, mini_batches=1, micro_batches=1))
    c.optimizer.update(dict(learning_rate=1e-6, warmup_steps=5))
    c.loss.clip_eps_high = 0.28
    c.eval.update(dict(every=20, num_tasks=64, num_chains=1, temperature=1.0))
    if arg == "cpu":
        cpu_plumbing(c)
    elif arg:
        raise ValueError(f"experiments/custom_task.py takes no argument or 'cpu', got {arg!r}")
    return c
