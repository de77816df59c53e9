"""ALFWorld with GRPO: a ReAct agent acts in ALFWorld's household games on the real engine (environments/alfworld).

    agentfly-train --config experiments/alfworld_grpo.py \
        --config.model.hf_path=/path/to/Qwen2.5-7B-Instruct --config.tokenizer.path=/path/to/Qwen2.5-7B-Instruct
    agentfly-train --config experiments/alfworld_grpo.py:cpu       # CPU plumbing check: two GRPO steps (≈ 45 s)
    python scripts/eval_env.py --env alfworld --agent oracle --num 12       # the expert plans reach reward 1.0

Rows are games of a task suite (`python -m environments.alfworld.build`: the six ALFWorld task types, train and
held-out splits; `env.options.suite_dir` for a built one, the official games when ALFWORLD_DATA holds them);
the question is the goal text. The agent calls `alfworld_step(action)` and `alfworld_admissible_commands()` on
its own game (pooled engines); the reward is 1.0 when the goal is reached.

Defaults follow AgentFly's multi-turn GRPO recipe (a ReAct agent, up to 20 turns, 8 chains per task) scaled to
the model: the tiny random policy only exercises the pipeline; set `model.hf_path` and `tokenizer.path` to a
Qwen2.5-Instruct checkpoint for a real run.
"""
from experiments.common import agentfly_grpo, base, cpu_plumbing, tiny_policy


def get_config(arg: str | None = None):
    c = base("runs/alfworld_grpo", "alfworld", suite_dir="", num_train_games=240, num_test_games=60, max_steps=50,
             pool_size=64)
    agentfly_grpo(c)
    c.eval.num_tasks = 60  # every held-out row
    c.task.update(dict(num_train=240, num_eval=60))
    tiny_policy(c)
    c.seq_buckets = (1024, 2048, 4096, 8192)
    c.agent.update(dict(max_turns=20, max_new_tokens=256, max_context_tokens=8192, max_observation_chars=4000))
    c.jax_sampler.update(dict(max_slots=64, max_len=8192))
    if arg == "cpu":  # a 4 + 2-game suite, two steps of one task
        c.env.options.update(dict(num_train_games=4, num_test_games=2, pool_size=2))
        cpu_plumbing(c, buckets=(512, 1024), steps=2, tasks_per_step=1, new_tokens=16, slots=2, eval_tasks=1)
        c.task.num_train = 4
    elif arg:
        raise ValueError(f"experiments/alfworld_grpo.py takes no argument or 'cpu', got {arg!r}")
    return c
