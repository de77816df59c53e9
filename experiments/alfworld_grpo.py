"""ALFWorld with GRPO: a ReAct agent acts in ALFWorld's household games on the real engine (environments/alfworld).

    python -m agentfly_jax.train --config experiments/alfworld_grpo.py \
        --config.model.hf_path=/path/to/Qwen2.5-7B-Instruct --config.tokenizer.path=/path/to/Qwen2.5-7B-Instruct
    python -m agentfly_jax.train --config experiments/alfworld_grpo.py --config.rl.steps=2 \
        --config.rl.tasks_per_step=1 --config.rl.chains_per_task=2 --config.agent.max_turns=2 \
        --config.task.num_train=4 --config.task.num_eval=2 --config.eval.num_tasks=1 \
        --config.agent.max_new_tokens=16 --config.agent.max_context_tokens=1024 --config.jax_sampler.max_slots=2 \
        --config.jax_sampler.max_len=1024 --config.seq_buckets="(512,1024)" --config.row_bucket=2 \
        --config.rl.mini_batches=1 --config.rl.micro_batches=1   # CPU plumbing check
    python scripts/eval_env.py --env alfworld --agent oracle --num 12       # the expert plans reach reward 1.0

The CPU plumbing check runs two GRPO steps of the tiny random model on a 4 + 2-game suite in ≈ 45 s on 2 cores
(Qwen's 151k-token vocabulary makes the default 1,024-4,096-token buckets an accelerator's job);
tests/environments/test_env_experiments.py runs exactly that command.

Rows are games of a task suite (`python -m environments.alfworld.build`: the six ALFWorld task types, train and
held-out splits; the official games when ALFWORLD_DATA holds them); the question is the goal text. Without
`task.suite_dir` the suite of `task.num_train` + `task.num_eval` games is generated on first use (≈ 0.6 s a
game, each verified by the engine's planner: ≈ 3 min for the defaults) and cached under
~/.cache/agentfly_jax/alfworld. The agent calls `alfworld_step(action)` and `alfworld_admissible_commands()` on
its own game (pooled engines); the reward is 1.0 when the goal is reached (`alfworld_reward`).

Defaults follow AgentFly's multi-turn GRPO recipe (a ReAct agent, up to 20 turns, 8 chains per task,
temperature 1.0, constant small learning rate, token-mean loss, asymmetric clipping 0.2/0.28), scaled to the
model: the tiny random Qwen2-architecture default here only exercises the pipeline (no pretrained weights exist
on this machine); set `model.hf_path` and `tokenizer.path` to a Qwen2.5-Instruct checkpoint for a real run.
"""
import ml_collections

from agentfly_jax.trainer import builders
from environments.alfworld import SYSTEM_PROMPT
from environments.alfworld import train_eval_tasks as alfworld_tasks

# The "alfworld" task family (builders looks families up by name; experiments add their own).
builders.TASK_FAMILIES.setdefault("alfworld", alfworld_tasks)

def get_config(arg: str | None = None):
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = "runs/alfworld_grpo"
    c.algorithm = "grpo"
    c.resume = False
    c.progress = True
    c.log_every = 1
    c.seq_buckets = (1024, 2048, 4096)  # packed row lengths (tokens)
    c.row_bucket = 8

    c.task = ml_collections.ConfigDict(dict(kind="alfworld", num_train=240, num_eval=60, suite_dir=""))
    c.tokenizer = ml_collections.ConfigDict(dict(kind="qwen2.5", path=""))
    c.chat_template = "qwen2.5"
    c.model = ml_collections.ConfigDict(dict(hf_path="", family="qwen2", hidden_size=128, intermediate_size=384,
                                             num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                                             tie_word_embeddings=True, max_position_embeddings=4096,
                                             dtype="float32"))

    c.agent = ml_collections.ConfigDict(dict(
        type="react",
        tools=("environments.alfworld.tools:alfworld_step",
               "environments.alfworld.tools:alfworld_admissible_commands"),
        reward="environments.alfworld.tools:alfworld_reward", success_threshold=1.0, max_turns=20,
        max_new_tokens=256, max_context_tokens=8192, temperature=1.0, top_p=1.0, top_k=-1,
        max_observation_chars=4000, system_prompt=SYSTEM_PROMPT))
    # One game engine per chain, reused across episodes (the next game is loaded on reset).
    c.envs = ml_collections.ConfigDict({"alfworld": dict(
        factory="environments.alfworld.env:ALFWorldEnv", kwargs=dict(max_steps=50),
        min_size=0, max_size=64, idle_timeout=600.0, acquire_timeout=600.0)})

    c.backend = "jax"
    c.jax_sampler = ml_collections.ConfigDict(dict(max_slots=64, max_len=4096))
    c.vllm = ml_collections.ConfigDict(dict(urls=(), weight_sync="memory", launch=False, num_servers=1,
                                            server_args=()))  # launch: see experiments/quickstart.py

    c.sft = ml_collections.ConfigDict(dict(stages=(), steps=0, tool_fraction=1.0, batch_size=16, data_path="",
                                           optimizer=dict(learning_rate=1e-5, warmup_steps=10, decay_steps=0,
                                                          schedule="constant", weight_decay=0.0)))
    c.rl = ml_collections.ConfigDict(dict(steps=200, tasks_per_step=8, chains_per_task=8, ppo_epochs=1,
                                          mini_batches=2, micro_batches=2))
    c.optimizer = ml_collections.ConfigDict(dict(learning_rate=1e-6, warmup_steps=5, decay_steps=0,
                                                 schedule="constant", weight_decay=0.0, max_grad_norm=1.0))
    c.critic_optimizer = ml_collections.ConfigDict(dict(learning_rate=1e-5, warmup_steps=0, max_grad_norm=1.0))
    c.loss = ml_collections.ConfigDict(dict(agg="token-mean", clip_eps=0.2, clip_eps_high=0.28, dual_clip=None,
                                            kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0, temperature=1.0,
                                            logprob_chunk=None, is_cap=None, value_clip_eps=0.2, value_coef=1.0))
    c.advantage = ml_collections.ConfigDict(dict(gamma=1.0, lam=1.0, normalize_std=True, kl_coef=0.0))

    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    c.sharding_rules = ()
    c.checkpoint = ml_collections.ConfigDict(dict(every=20, keep=2))
    c.eval = ml_collections.ConfigDict(dict(every=20, num_tasks=64, num_chains=1, temperature=0.0,
                                            top_p=1.0, sampled_chains=1))
    return c
