"""ScienceWorld with GRPO: a ReAct agent runs science experiments in the real simulator (environments/scienceworld).

    agentfly-train --config experiments/scienceworld_grpo.py \
        --config.model.hf_path=/path/to/Qwen2.5-7B-Instruct --config.tokenizer.path=/path/to/Qwen2.5-7B-Instruct
    agentfly-train --config experiments/scienceworld_grpo.py:cpu   # CPU plumbing check: two GRPO steps
    agentfly-train --config experiments/scienceworld_grpo.py --config.env.options.task_names=boil,melt
    python scripts/eval_env.py --env scienceworld --agent oracle --num 4    # gold paths reach reward 1.0

Rows are (task, variation) pairs of the simulator's train / test variations (`env.options.task_names`: "all",
"eval" or comma-separated names); the question is the task description. The agent calls
`scienceworld_step(action)` and `scienceworld_valid_actions()` on its own simulator (one JVM each, pooled); the
reward is the simulator's score / 100. Defaults follow AgentFly's multi-turn GRPO recipe; the tiny random
policy only exercises the pipeline.
"""
from experiments.common import agentfly_grpo, base, cpu_plumbing, tiny_policy


def get_config(arg: str | None = None):
    c = base("runs/scienceworld_grpo", "scienceworld", task_names="all", max_steps=100, pool_size=16)
    agentfly_grpo(c)
    c.eval.num_tasks = 60  # every held-out row
    c.task.update(dict(num_train=600, num_eval=60, eval_split="test"))
    tiny_policy(c, max_position_embeddings=8192)
    c.seq_buckets = (2048, 4096, 8192)
    c.agent.update(dict(max_turns=20, max_new_tokens=256, max_context_tokens=8192, max_observation_chars=4000))
    c.jax_sampler.update(dict(max_slots=64, max_len=8192))
    if arg == "cpu":  # two steps of one task on 2 simulators
        c.env.options.update(dict(task_names="boil", pool_size=2))
        cpu_plumbing(c, buckets=(512, 1024), steps=2, tasks_per_step=1, new_tokens=16, slots=2, eval_tasks=1)
        c.task.num_train = 4
    elif arg:
        raise ValueError(f"experiments/scienceworld_grpo.py takes no argument or 'cpu', got {arg!r}")
    return c
