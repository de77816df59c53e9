"""Quickstart: RL teaches a tiny agent to use its calculator instead of guessing — offline, on a CPU.

    python -m agentfly_jax.train --config experiments/quickstart.py
    python -m agentfly_jax.train --config experiments/quickstart.py --config.algorithm=ppo
    python -m agentfly_jax.train --config experiments/quickstart.py --config.backend=vllm --config.vllm.launch=True
    python -m agentfly_jax.train --config experiments/quickstart.py --config.backend=vllm \
        --config.vllm.urls="('http://127.0.0.1:8000',)"   # servers started by scripts/start_vllm.sh

A project-built tokenizer and a tiny Qwen2-architecture model are warm-started by SFT on demonstrations in
which only part of the answers use the `calculator` tool (the rest guess, see `sft.stages`), so the agent
starts out succeeding less than half of the time; RL (config.algorithm: grpo, drgrpo, rloo, reinforce_pp or ppo) then raises
success on held-out arithmetic tasks. Results: `<workdir>/summary.json`, TensorBoard in
`<workdir>/tensorboard`.
"""
import ml_collections


def get_config(arg: str | None = None):
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = "runs/quickstart"
    c.algorithm = "grpo"
    c.resume = False
    c.progress = True
    c.log_every = 1
    c.seq_buckets = (64, 128, 256)  # packed row lengths (tokens)
    c.row_bucket = 8  # packed row counts round up to a multiple of this

    c.task = ml_collections.ConfigDict(dict(kind="arithmetic", num_train=4000, num_eval=64, operand_min=10,
                                            operand_max=999, ops="*+-", train_path="", eval_path=""))
    c.tokenizer = ml_collections.ConfigDict(dict(kind="arithmetic", path=""))
    c.chat_template = ""  # "": the tokenizer's own template
    # A tiny Qwen2-architecture model (head_dim 32 so vLLM can serve it too). Set hf_path to start from an HF
    # checkpoint instead (then tokenizer.path should point at its tokenizer).
    c.model = ml_collections.ConfigDict(dict(hf_path="", family="qwen2", hidden_size=128, intermediate_size=384,
                                             num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                                             tie_word_embeddings=True, max_position_embeddings=512,
                                             dtype="float32"))

    c.agent = ml_collections.ConfigDict(dict(type="tool_calling", tools=("calculator",), reward="math_match",
                                             success_threshold=1.0, max_turns=3, max_new_tokens=48,
                                             max_context_tokens=256, temperature=1.0, top_p=1.0, top_k=-1))
    c.backend = "jax"  # "jax" (embedded JaxSampler) or "vllm" (server URLs below)
    c.jax_sampler = ml_collections.ConfigDict(dict(max_slots=128, max_len=256))
    # vLLM: servers at `urls` (serving a checkpoint of this model's shape), or launch=True to start num_servers local
    # ones on the initial policy; either way the trained weights are synced to them after every update.
    c.vllm = ml_collections.ConfigDict(dict(urls=(), weight_sync="memory", launch=False, num_servers=1,
                                            server_args=("--dtype", "float32", "--max-model-len", "512")))

    # SFT warm start in two stages of demonstrations: tool calls only (the call format and copying numbers),
    # then a mix in which 60% of the answers are guesses, so the warm-started agent calls its tool ~40% of
    # the time and succeeds at most about that often.
    c.sft = ml_collections.ConfigDict(dict(stages=((500, 1.0), (150, 0.4)), steps=0, tool_fraction=1.0,
                                           batch_size=64, data_path="",
                                           optimizer=dict(learning_rate=1e-2, warmup_steps=20, decay_steps=630,
                                                          schedule="cosine", end_lr_ratio=0.1,
                                                          weight_decay=0.0)))
    c.rl = ml_collections.ConfigDict(dict(steps=40, tasks_per_step=16, chains_per_task=8, ppo_epochs=1,
                                          mini_batches=1, micro_batches=1))
    c.optimizer = ml_collections.ConfigDict(dict(learning_rate=1e-3, warmup_steps=0, decay_steps=0,
                                                 schedule="constant", weight_decay=0.0, max_grad_norm=1.0))
    c.critic_optimizer = ml_collections.ConfigDict(dict(learning_rate=3e-3, warmup_steps=0, max_grad_norm=1.0))
    c.loss = ml_collections.ConfigDict(dict(agg="token-mean", clip_eps=0.2, clip_eps_high=0.28, dual_clip=None,
                                            kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, temperature=1.0,
                                            logprob_chunk=None, is_cap=None, value_clip_eps=0.2, value_coef=1.0))
    c.advantage = ml_collections.ConfigDict(dict(gamma=1.0, lam=1.0, normalize_std=True, kl_coef=0.0))

    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    c.sharding_rules = ()  # () -> agentfly_jax.models.sharding.DEFAULT_RULES
    c.checkpoint = ml_collections.ConfigDict(dict(every=10, keep=2))
    # Success = sampling at temperature 1 with nucleus top_p 0.95, 4 chains per held-out task: the policy's own mix
    # of tool use and guessing, without its lowest-probability tail of slips (a wrong digit chunk copied now and
    # then). Logged beside it: plain sampling (temperature 1, top_p 1: the training distribution) as
    # eval/success_sampled. Greedy decoding (temperature=0.0) would hide the mix: the warm-started agent's single
    # most likely first token is already the tool call (its guesses spread over many number tokens).
    c.eval = ml_collections.ConfigDict(dict(every=20, num_tasks=64, num_chains=4, temperature=1.0, top_p=0.95,
                                            sampled_chains=4))
    return c
