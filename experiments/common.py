"""Blocks the experiment configs share: the defaults of every key (the typed config's), the tiny
Qwen2-architecture policy used where no pretrained weights are given, the AgentFly-style RL numbers for the
environment experiments, and the `:cpu` shrink that makes any experiment a minutes-long plumbing run on a CPU.
"""
import os
from pathlib import Path

from ml_collections import ConfigDict

from agentfly_jax.trainer.config import default_config

#: The real pretrained policy set-up builds (scripts/build_smollm2.py): SmolLM2-135M-Instruct, dequantised Q4_1.
SMOLLM2_DIR = os.environ.get("AGENTFLY_SMOLLM2_DIR",
                             str(Path(__file__).resolve().parents[1] / ".cache" / "models" / "SmolLM2-135M-Instruct"))


def base(workdir: str, env: str = "", **env_options) -> ConfigDict:
    """Every key at its default (unset knobs are command-line settable placeholders), for environment `env`."""
    c = default_config()
    c.workdir = workdir
    c.env.name = env
    c.env.options = ConfigDict(env_options)
    return c


def tiny_policy(c: ConfigDict, max_position_embeddings: int = 4096) -> None:
    """A tiny random Qwen2-architecture policy (head_dim 32, so vLLM can serve it too): the pipeline runs, a
    real run sets model.hf_path and tokenizer.path to a checkpoint instead."""
    c.model.update(dict(hf_path="", family="qwen2", hidden_size=128, intermediate_size=384, num_layers=2,
                        num_heads=4, num_kv_heads=2, qkv_bias=True, tie_word_embeddings=True,
                        max_position_embeddings=max_position_embeddings, dtype="float32"))


def smollm2(c: ConfigDict, *, cpu: bool = False) -> None:
    """The real pretrained policy: SmolLM2-135M-Instruct (134.5M parameters, 49,152-token vocabulary, 8,192
    context; dequantised 4-bit weights, not the original bf16 release) with its own tokenizer, prompted with the
    qwen2.5 template (ChatML with tools: the same `<|im_start|>`/`<|im_end|>` tokens as the model's own
    template, plus a tool section). Mixed precision: bf16 compute over fp32 master parameters (fp32 on a CPU,
    where bf16 matmuls are slow)."""
    c.model.hf_path = SMOLLM2_DIR
    c.tokenizer.update(dict(path=SMOLLM2_DIR, kind=""))
    c.chat_template = "qwen2.5"
    c.model.update(dict(dtype="float32" if cpu else "bfloat16", param_dtype="float32"))
    c.vllm.server_args = ("--dtype", "float32" if cpu else "bfloat16")


def smollm2_grpo(c: ConfigDict, *, steps: int, tasks_per_step: int = 16, chains_per_task: int = 8,
                 learning_rate: float = 1e-5, eval_tasks: int = 128, eval_chains: int = 1) -> None:
    """GRPO numbers for SmolLM2 on one GPU within about 15 minutes: `tasks_per_step` x `chains_per_task` chains a
    step, two mini-batches, a constant learning rate suited to a 135M model, asymmetric clipping 0.2 / 0.28;
    rematerialised layers and 4k-token micro-batches so that a step fits a shared GPU; held-out success on
    `eval_tasks` x `eval_chains` episodes with the training sampling (temperature 1, top_p 1) every 20 steps."""
    c.algorithm = "grpo"
    c.model.remat = True
    c.rl.update(dict(steps=steps, tasks_per_step=tasks_per_step, chains_per_task=chains_per_task, ppo_epochs=1,
                     mini_batches=2, micro_batches=1, micro_batch_tokens=4096))
    c.optimizer.update(dict(learning_rate=learning_rate, warmup_steps=0, schedule="constant"))
    c.loss.clip_eps_high = 0.28
    c.checkpoint.update(dict(every=0, keep=1))
    c.task.num_eval = max(c.task.num_eval, eval_tasks)
    c.eval.update(dict(every=20, num_tasks=eval_tasks, num_chains=eval_chains, temperature=1.0, top_p=1.0,
                       sampled_chains=0))


def smollm2_sft(c: ConfigDict, stages, *, batch_size: int = 16, learning_rate: float = 5e-5) -> None:
    """A short SFT warm start on the environment's demonstrations (`stages`: ((steps, expert_fraction), ...))."""
    total = sum(steps for steps, _ in stages)
    c.sft.update(dict(stages=tuple(stages), batch_size=batch_size))
    c.sft.optimizer.update(dict(learning_rate=learning_rate, warmup_steps=min(10, total // 10), decay_steps=total,
                                schedule="cosine", end_lr_ratio=0.1))


def smollm2_cpu(c: ConfigDict, *, context: int = 1024, buckets=(1024,), real_model: bool = True) -> None:
    """The SmolLM2 recipes' `:cpu` plumbing run: one SFT step of 2 demonstrations, then one GRPO step of one task
    x 2 chains (2 turns of 32 tokens) within `context` tokens. One group is enough to exercise every part; the
    135M model's update is compute-bound on a CPU (about a minute of a 2-core machine per run), so each extra task
    costs seconds of the test suite. `real_model=False` keeps SmolLM2's tokenizer, vocabulary and template but swaps
    in the tiny random policy: the recipe's own parts (environment, tools, agent, reward, demonstrations) run the
    same, in a fraction of the time; the real model's loading and export are the same for every recipe and stay
    covered by the recipe that keeps it (arithmetic)."""
    if not real_model:
        tiny_policy(c, max_position_embeddings=8192)  # SmolLM2's context
        c.model.vocab_size = 49152
    cpu_plumbing(c, context=context, buckets=buckets, turns=2, new_tokens=32, slots=4, tasks_per_step=1)
    c.model.remat = False  # a CPU's memory holds a one-row step's activations: no recomputation in the backward
    c.sft.update(dict(stages=((1, 1.0),), batch_size=2))
    c.sft.optimizer.update(dict(warmup_steps=0, decay_steps=1))


def agentfly_grpo(c: ConfigDict) -> None:
    """AgentFly's multi-turn GRPO numbers: 8 tasks x 8 chains a step, temperature 1, constant small learning
    rate, token-mean loss, asymmetric clipping 0.2 / 0.28, greedy held-out eval every 20 steps."""
    c.algorithm = "grpo"
    c.tokenizer.kind = "qwen2.5"
    c.chat_template = "qwen2.5"
    c.rl.update(dict(steps=200, tasks_per_step=8, chains_per_task=8, ppo_epochs=1, mini_batches=2, micro_batches=2))
    c.optimizer.update(dict(learning_rate=1e-6, warmup_steps=5, schedule="constant"))
    c.critic.optimizer.update(dict(learning_rate=1e-5))
    c.loss.clip_eps_high = 0.28
    c.sft.optimizer.update(dict(learning_rate=1e-5, warmup_steps=10))
    c.checkpoint.update(dict(every=20, keep=2))
    c.eval.update(dict(every=20, num_tasks=64, num_chains=1, temperature=0.0, top_p=1.0, sampled_chains=1))


def cpu_plumbing(c: ConfigDict, *, context: int = 1024, buckets=(1024,), turns: int = 2, steps: int = 1,
                 tasks_per_step: int = 2, new_tokens: int = 32, slots: int = 4, eval_tasks: int = 0) -> ConfigDict:
    """The `:cpu` variant: `steps` small RL steps of the tiny policy (2 chains a task), short turns, and a held-out
    eval of `eval_tasks` rows before and after (none by default); minutes on 2 cores."""
    c.rl.update(dict(steps=steps, tasks_per_step=tasks_per_step, chains_per_task=2, mini_batches=1, micro_batches=1))
    c.optimizer.warmup_steps = 0  # a one- or two-step run still updates the weights
    c.task.num_eval = 2 * eval_tasks
    c.eval.update(dict(num_tasks=eval_tasks, every=0))
    c.agent.update(dict(max_turns=turns, max_new_tokens=new_tokens, max_context_tokens=context))
    c.jax_sampler.update(dict(max_slots=slots, max_len=context))
    c.seq_buckets = tuple(buckets)
    c.row_bucket = 1
    c.checkpoint.every = 0
    return c
