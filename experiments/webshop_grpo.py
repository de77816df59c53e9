"""WebShop with GRPO: a tool-calling agent shops in the WebShop-compatible environment (environments/webshop).

    agentfly-train --config experiments/webshop_grpo.py \
        --config.model.hf_path=/path/to/Qwen2.5-3B-Instruct --config.tokenizer.path=/path/to/Qwen2.5-3B-Instruct
    agentfly-train --config experiments/webshop_grpo.py:cpu                # CPU plumbing check (≈ 1.5 min)
    python scripts/eval_env.py --env webshop --agent oracle --num 50        # the oracle reaches reward 1.0

Each dataset row is a shopping goal (instruction + verifiable targets) over a generated 1,000-product catalog
(`env.options.source="official"` with `items_path` / `attributes_path` uses the official WebShop files). The
agent calls `webshop_search(query)` and `webshop_click(target)` on its own shop session (a pool through the
resource manager) and is rewarded with the WebShop score of what it bought:
r_type · (matched attributes + matched options + price ok) / (|U_att| + |U_opt| + 1).
GRPO compares the `chains_per_task` chains of each goal.

By default the policy is a tiny random Qwen2-architecture model with the real Qwen2.5 tokenizer (the run
exercises the whole pipeline but cannot learn to shop from scratch); set `model.hf_path` and `tokenizer.path`
for a real run. With Qwen's 151k vocabulary the default buckets (up to 4,096 tokens) need an accelerator.
"""
from experiments.common import agentfly_grpo, base, cpu_plumbing, tiny_policy


def get_config(arg: str | None = None):
    c = base("runs/webshop_grpo", "webshop", source="generated", seed=0, num_products=1000, items_path="",
             attributes_path="", human_goals_path="", max_actions=30, pool_size=64)
    agentfly_grpo(c)
    c.eval.num_tasks = 53  # every held-out row
    c.task.update(dict(num_train=0, num_eval=53))  # the whole held-out "test" half (53 of 106 goals)
    tiny_policy(c)
    c.seq_buckets = (1024, 2048, 4096)
    c.agent.update(dict(max_turns=15, max_new_tokens=128, max_context_tokens=4096, max_observation_chars=3000))
    c.jax_sampler.update(dict(max_slots=64, max_len=4096))
    if arg == "cpu":
        cpu_plumbing(c)
    elif arg:
        raise ValueError(f"experiments/webshop_grpo.py takes no argument or 'cpu', got {arg!r}")
    return c
