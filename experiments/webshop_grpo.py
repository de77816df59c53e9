"""WebShop with GRPO: a tool-calling agent shops in the WebShop-compatible environment (environments/webshop).

    python -m agentfly_jax.train --config experiments/webshop_grpo.py \
        --config.model.hf_path=/path/to/Qwen2.5-3B-Instruct \
        --config.tokenizer.path=/path/to/Qwen2.5-3B-Instruct
    python -m agentfly_jax.train --config experiments/webshop_grpo.py --config.rl.steps=1 \
        --config.rl.tasks_per_step=2 --config.rl.chains_per_task=2 --config.eval.num_tasks=0 \
        --config.agent.max_turns=2 --config.agent.max_new_tokens=32 --config.agent.max_context_tokens=1024 \
        --config.jax_sampler.max_slots=2 --config.jax_sampler.max_len=1024 --config.seq_buckets="(1024,)" \
        --config.row_bucket=1 --config.rl.mini_batches=1 --config.rl.micro_batches=1   # CPU plumbing check
    python scripts/eval_env.py --env webshop --agent oracle --num 50        # the oracle reaches reward 1.0

Each dataset row is a shopping goal (instruction + verifiable targets) over a generated 1,000-product catalog
(`task.source="official"` with `items_path` / `attributes_path` uses the official WebShop files instead; the
pool's kwargs must name the same catalog). The agent calls `webshop_search(query)` and `webshop_click(target)`
on its own shop session (a pool of 64 environments through the resource manager) and is rewarded with the
WebShop score of what it bought:
r_type · (matched attributes + matched options + price ok) / (|U_att| + |U_opt| + 1).
GRPO compares the `chains_per_task` chains of each goal.

No pretrained weights exist on this machine: by default the policy is a tiny random Qwen2-architecture model
with the real Qwen2.5 tokenizer (the run exercises the whole pipeline but cannot learn to shop from scratch);
set `model.hf_path` (and `tokenizer.path`) to a Qwen2.5-Instruct checkpoint for a real run. With Qwen's 151k
vocabulary the default buckets (up to 4,096 tokens) need an accelerator's memory: the CPU plumbing check
above uses 1,024-token rows (≈ 6 GB, ≈ 1.5 min on 2 cores).
"""
from ml_collections import ConfigDict

CATALOG = dict(source="generated", seed=0, num_products=1000, items_path="", attributes_path="",
               human_goals_path="")


def get_config(arg: str | None = None):
    c = ConfigDict()
    c.seed = 0
    c.workdir = "runs/webshop_grpo"
    c.algorithm = "grpo"
    c.resume = False
    c.progress = True
    c.log_every = 1
    c.seq_buckets = (1024, 2048, 4096)  # packed row lengths (tokens)
    c.row_bucket = 8

    c.task = ConfigDict(dict(kind="webshop", num_train=0, num_eval=64, **CATALOG))
    c.tokenizer = ConfigDict(dict(kind="qwen2.5", path=""))
    c.chat_template = "qwen2.5"
    c.model = ConfigDict(dict(hf_path="", family="qwen2", hidden_size=128, intermediate_size=384,
                              num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                              tie_word_embeddings=True, max_position_embeddings=4096,
                              dtype="float32"))

    c.agent = ConfigDict(dict(
        type="tool_calling",
        tools=("environments.webshop.tools:webshop_search", "environments.webshop.tools:webshop_click"),
        reward="environments.webshop.rewards:webshop_reward", success_threshold=1.0, max_turns=15,
        max_new_tokens=128, max_context_tokens=4096, temperature=1.0, top_p=1.0, top_k=-1,
        max_observation_chars=3000))
    # One shop session per chain from this pool (the catalog must be the task's).
    c.envs = ConfigDict({"webshop": dict(
        factory="environments.webshop.env:create_webshop_env",
        kwargs=dict({k: v for k, v in CATALOG.items() if v != ""}, max_actions=30),
        min_size=0, max_size=64, idle_timeout=300.0, acquire_timeout=300.0)})

    c.backend = "jax"
    c.jax_sampler = ConfigDict(dict(max_slots=64, max_len=4096))
    c.vllm = ConfigDict(dict(urls=(), weight_sync="memory", launch=False, num_servers=1,
                             server_args=()))  # launch: see experiments/quickstart.py

    c.sft = ConfigDict(dict(stages=(), steps=0, tool_fraction=1.0, batch_size=16, data_path="",
                            optimizer=dict(learning_rate=1e-5, warmup_steps=10, decay_steps=0,
                                           schedule="constant", weight_decay=0.0)))
    c.rl = ConfigDict(dict(steps=200, tasks_per_step=8, chains_per_task=8, ppo_epochs=1,
                           mini_batches=2, micro_batches=2))
    c.optimizer = ConfigDict(dict(learning_rate=1e-6, warmup_steps=5, decay_steps=0,
                                  schedule="constant", weight_decay=0.0, max_grad_norm=1.0))
    c.critic_optimizer = ConfigDict(dict(learning_rate=1e-5, warmup_steps=0, max_grad_norm=1.0))
    c.loss = ConfigDict(dict(agg="token-mean", clip_eps=0.2, clip_eps_high=0.28, dual_clip=None,
                             kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, temperature=1.0,
                             logprob_chunk=None, is_cap=None, value_clip_eps=0.2, value_coef=1.0))
    c.advantage = ConfigDict(dict(gamma=1.0, lam=1.0, normalize_std=True, kl_coef=0.0))

    c.mesh = ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    c.sharding_rules = ()
    c.checkpoint = ConfigDict(dict(every=20, keep=2))
    c.eval = ConfigDict(dict(every=20, num_tasks=64, num_chains=1, temperature=0.0, top_p=1.0,
                             sampled_chains=1))
    return c
