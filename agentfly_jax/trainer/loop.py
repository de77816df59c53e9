"""The RL trainer loop, top to bottom:

  setup → (resume | SFT warm start) → eval → for each step:
      rollout (agent + backend + tools + env pool) → rewards → one UpdateBatch → prepare (old/ref logprobs,
      values, advantages: the recipe's estimator) → jitted updates per mini-batch → weight sync → metrics
      → checkpoint → eval

The config is typed and validated once (`TrainConfig.build`) before any model or data work; the algorithm is
a recipe looked up by name (`algorithms.get_recipe`). The async world (agents, backends, tools) runs on one
asyncio event loop kept for the whole run; everything else is plain Python around jitted functions.

With `rl.max_staleness` > 0 (asynchronous off-policy training, trainer/async_rollouts.py) that event loop runs in
its own thread and the rollouts of the next steps (at most max_staleness policy versions ahead) run while a
step updates; the step's order above is kept for the trainer, and `AsyncSteps` hands it each step's batch.

Several processes (jax.distributed, docs/tpu.md) run the same loop: each rolls out its own contiguous share of a
step's tasks (and of the held-out tasks) on its own backend and environments, packs its own rows into its block of
the global batch, and the processes exchange only host-sized data (counts, rewards, the scalars) through the
coordinator's key-value store (`distributed.allgather_json`); SFT batches, which every process can build, are
built whole everywhere and each process hands its devices their part. Process 0 alone writes config.json, the
metrics, summary.json and the final export; checkpoints are saved and restored by all processes (orbax).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import dataclasses
import gc
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from agentfly_jax import algorithms
from agentfly_jax.algorithms.recipes import ResolvedAlgorithm
from agentfly_jax.heap import freeze_startup_heap, unfreeze_startup_heap
from agentfly_jax.models import lora
from agentfly_jax.models import sharding as shd
from agentfly_jax.models.config import jit_run_once
from agentfly_jax.models.transformer import packed_segment_bound
from agentfly_jax.rollout import encode_conversation, trajectories_to_batch
from agentfly_jax.rollout.trajectory import Trajectory, images_to_batch
from agentfly_jax.trainer import builders, distributed
from agentfly_jax.trainer.async_rollouts import RolloutProducer, ThreadedRunner, staleness_filter
from agentfly_jax.trainer.batch import (NoChainsLeftError, UpdateBatch, assign_minibatches, choose_bucket,
                                       drop_failed_chains, no_chains_left_error, pack_step, place_block, rows_needed,
                                       row_runs, unpack_index_from)
from agentfly_jax.trainer.checkpoint import Checkpointer
from agentfly_jax.trainer.config import ConfigError, OptimizerConfig, TrainConfig
from agentfly_jax.trainer.export import export_policy
from agentfly_jax.trainer.metrics import MetricWriter
from agentfly_jax.trainer.state import (TrainState, create_train_state, init_model_state,
                                        learning_rate_schedule, make_optimizer, state_shardings)
from agentfly_jax.trainer.update import make_prepare_fn, make_sft_step, make_train_step, take_minibatch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
    """What the loop holds between steps (built once in `setup`)."""

    config: TrainConfig
    algorithm: ResolvedAlgorithm
    workdir: str
    task_setup: builders.TaskSetup
    tokenizer: Any
    train_tasks: list[dict]
    eval_tasks: list[dict]
    policy: Any  # CausalLM
    critic: Any  # ValueModel | None
    mesh: jax.sharding.Mesh
    rules: tuple
    state: TrainState
    shardings: TrainState
    critic_opt: Any
    prepare_fn: Any
    train_step: Any
    backend: Any
    agent: Any
    env_manager: Any
    writer: MetricWriter
    checkpointer: Checkpointer
    runner: Any  # asyncio.Runner; a ThreadedRunner (its loop in a background thread) when rl.max_staleness > 0
    serving_model: Any = None  # the policy as served and exported (a LoRA policy: the plain model)
    serve_params: Any = None  # policy params -> the serving model's params (LoRA: adapters merged)
    trainable: Any = None  # which policy parameters are trained (LoRA: the adapters); None: all
    engine_seen: dict = dataclasses.field(default_factory=dict)  # the sampler's cumulative counters, last logged
    # programs traced by the jitted steps (prepare, train_step, sft_step): one per new batch shape
    traces: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    heap_frozen: bool = False  # setup froze the start-up heap (agentfly_jax/heap.py); _close_run gives it back


class NonFiniteTrainingError(RuntimeError):
    """Training produced non-finite numbers (loss, gradients or parameters) and the run was stopped."""


class _NonFiniteGuard:
    """Counts steps in a row whose optimiser updates were skipped for non-finite numbers (update.py `_apply`
    skips them on the device) and stops the run at `limit`: a run that keeps producing NaN would otherwise go
    on training nothing, and checkpoint and export whatever it has."""

    def __init__(self, limit: int):
        self.limit, self.in_row = limit, 0

    def observe(self, skipped: float, stage: str, step: int, updates: int) -> None:
        if not skipped:
            self.in_row = 0
            return
        self.in_row += 1
        log.warning("%s step %d: %d of %d optimiser updates skipped (non-finite loss or gradients); %d step(s) in "
                    "a row, the run stops at %d (config.max_nonfinite_steps)", stage, step, int(skipped), updates,
                    self.in_row, self.limit)
        if self.in_row >= self.limit:
            raise NonFiniteTrainingError(
                f"{stage} step {step}: the loss or gradients were not finite in {self.in_row} steps in a row "
                f"(config.max_nonfinite_steps={self.limit}); the skipped updates left the parameters as they were, "
                "nothing non-finite was saved. Look for a learning rate too high for the model "
                f"(config.{'sft.' if stage == 'sft' else ''}optimizer.learning_rate), a division by a tiny number "
                "(config.loss.temperature), or rewards/advantages that are not finite")


def _finite_flags(arrays):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in arrays])


def _all_finite(arrays):
    """One flag per array, in ONE program: a reduction per array dispatched as its own program would start dozens of
    cross-device all-reduces at once, and on a CPU mesh (in-process collectives on a few threads) their
    participants can wait on each other for good. Run before saves only (models.config.jit_run_once)."""
    return jit_run_once(_finite_flags, arrays)


def _check_finite(tree, what: str) -> None:
    """Refuses to save or export `tree` when any floating-point value in it is NaN or infinite."""
    leaves = [(jax.tree_util.keystr(path), x) for path, x in jax.tree_util.tree_leaves_with_path(tree)
              if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
    if not leaves:
        return
    finite = _fetch(_all_finite([x for _, x in leaves]))
    bad = [path for (path, _), ok in zip(leaves, finite) if not ok]
    if bad:
        raise NonFiniteTrainingError(f"refusing to {what}: {len(bad)} tensors hold NaN or inf "
                                     f"(first: {', '.join(bad[:3])})")


def _optimizer(cfg: OptimizerConfig):
    return make_optimizer(cfg), learning_rate_schedule(cfg)


# ================================================================================================ setup
def setup(config, workdir: str | None = None) -> Run:
    """Validates the config (a ConfigDict, dict or TrainConfig) and builds everything a run holds."""
    cfg = TrainConfig.build(config)  # a TrainConfig instance is checked again too
    distributed.start(cfg)  # jax.distributed (several processes) before any device work; idempotent
    alg = cfg.resolved_algorithm()
    if cfg.backend == "vllm" and not cfg.vllm.launch:
        builders.probe_vllm_servers(cfg.vllm.urls)
    workdir = workdir or cfg.workdir
    multi, writer_process = jax.process_count() > 1, jax.process_index() == 0
    if multi:
        _check_shares(cfg)
    os.makedirs(workdir, exist_ok=True)
    if writer_process:
        with open(os.path.join(workdir, "config.json"), "w") as fh:
            json.dump(dataclasses.asdict(cfg), fh, indent=2, default=str)

    # --- Environment, tokenizer, tasks, models -----------------------------------------------------
    task_setup = builders.build_task_setup(cfg)
    # a tokenizer built into the workdir (config.tokenizer.kind='env'): process 0 writes it, the others read it
    if multi and not writer_process:
        distributed.allgather_json("waiting for the tokenizer")
    tokenizer = builders.build_tokenizer(cfg, task_setup, workdir)
    if multi and writer_process:
        distributed.allgather_json("tokenizer written")
    train_tasks, eval_tasks = builders.build_tasks(cfg, task_setup)
    policy, policy_params = builders.build_policy(cfg, tokenizer)
    builders.check_vision_critic(policy, alg.needs_critic)

    # --- Create optimizers & state; shard & transfer ----------------------------------------------
    mesh, rules = builders.build_mesh(cfg), builders.sharding_rules(cfg)
    if multi:
        _data_parallel_block(mesh)  # refuses a mesh whose data-parallel shards span processes, before any work
    policy_opt, policy_schedule = _optimizer(cfg.optimizer)
    critic, critic_params, critic_opt = None, None, None
    if alg.needs_critic:
        critic, critic_params = builders.critic_from_policy(policy, policy_params)
        critic_opt, _ = _optimizer(cfg.critic.optimizer)
    ref_params = jax.tree.map(jnp.copy, policy_params) if alg.needs_reference else None
    trainable = lora.is_adapter if policy.config.lora_rank else None  # LoRA: only the adapters are trained
    if trainable is not None:
        log.info("LoRA rank %d on %s: %d adapter values trained, %d base values frozen", policy.config.lora_rank,
                 ",".join(policy.config.lora_targets), lora.adapter_count(policy_params),
                 sum(int(x.size) for x in jax.tree.leaves(policy_params)) - lora.adapter_count(policy_params))
    state = create_train_state(policy_params, policy_opt, critic_params=critic_params, critic_opt=critic_opt,
                               ref_params=ref_params, trainable=trainable)
    shardings = state_shardings(state, mesh, policy_model=policy, policy_opt=policy_opt, critic_model=critic,
                                critic_opt=critic_opt, rules=rules, trainable=trainable)
    state = jax.device_put(state, shardings)
    traces = collections.Counter()
    prepare_fn = make_prepare_fn(policy, alg, critic_model=critic, gpu_gemm=cfg.model.gpu_gemm, traces=traces)
    train_step = make_train_step(policy, alg, policy_opt, critic_model=critic, critic_opt=critic_opt,
                                 value_clip_eps=cfg.critic.value_clip_eps, value_coef=cfg.critic.value_coef,
                                 lr_schedule=policy_schedule, state_sharding=shardings, trainable=trainable,
                                 gpu_gemm=cfg.model.gpu_gemm, traces=traces)

    # --- Generation backend, environment pools & agent ----------------------------------------------
    # asynchronous training (rl.max_staleness > 0): the event loop runs in its own thread so that chains go on
    # while the trainer updates (trainer/async_rollouts.py)
    serving_model, serve_params = builders.serving_view(policy)
    # a vision-language policy's launched vLLM servers read its tokenizer and image settings from the model directory
    vision = {"tokenizer": tokenizer} if builders.is_vision_language(policy) else {}
    backend = _build_backend(cfg, serving_model, serve_params(state.policy.params), workdir, **vision)
    runner = ThreadedRunner() if cfg.rl.max_staleness else asyncio.Runner()  # after the backend: nothing to leak
    env_manager = None
    try:
        env_manager = builders.build_env_manager(task_setup)
        agent = builders.build_agent(cfg, task_setup, backend, tokenizer, env_provider=env_manager)
        builders.check_vision_agent(policy, agent)
        writer = MetricWriter(os.path.join(workdir, "tensorboard"), active=writer_process)
        checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every=cfg.checkpoint.every,
                                    keep=cfg.checkpoint.keep)
    except BaseException:  # launched vLLM servers and pooled environments must not outlive a failed setup
        if env_manager is not None:
            runner.run(env_manager.close())
        runner.run(backend.close())
        close_runner(runner)
        raise

    run = Run(config=cfg, algorithm=alg, workdir=workdir, task_setup=task_setup, tokenizer=tokenizer,
              train_tasks=train_tasks, eval_tasks=eval_tasks, policy=policy, critic=critic, mesh=mesh, rules=rules,
              state=state, shardings=shardings, critic_opt=critic_opt, prepare_fn=prepare_fn, train_step=train_step,
              backend=backend, agent=agent, env_manager=env_manager, writer=writer, checkpointer=checkpointer,
              runner=runner, serving_model=serving_model, serve_params=serve_params, trainable=trainable,
              traces=traces)
    # Everything made so far (imports, models, tokenizer, agent) lives as long as the run: frozen out of the garbage
    # collector's reach, so that the full collections the rollouts set off walk only what the steps make
    # (docs/benchmarks.md, "Rollout runtime overhead at 256 chains").
    run.heap_frozen = freeze_startup_heap()
    log.info("start-up heap frozen: %d objects left out of garbage collection", gc.get_freeze_count())
    return run


# ============================================================================================ SFT stage
def run_sft(run: Run) -> dict:
    """Supervised warm start on demonstrations (masked cross-entropy on the assistant tokens)."""
    cfg = run.config
    longest = max(cfg.seq_buckets)
    stages = [(steps, _Demonstrations(run, demos, i, longest))
              for i, (steps, demos) in enumerate(builders.sft_conversations(cfg, run.task_setup, run.train_tasks,
                                                                            run.tokenizer))]
    for i, (stage_steps, demos) in enumerate(stages):
        if stage_steps and len(demos) < cfg.sft.batch_size:
            raise ConfigError(f"config.sft.batch_size={cfg.sft.batch_size} but stage {i} has only {len(demos)} "
                              "demonstrations: lower the batch size or add demonstrations")
    optimizer, schedule = _optimizer(cfg.sft.optimizer)
    state = create_train_state(run.state.policy.params, optimizer, trainable=run.trainable)
    # the state enters each step placed as the step returns it: a first call on other placements (a fresh
    # optimiser state is uncommitted) compiled the same program a second time at step 2
    shardings = state_shardings(state, run.mesh, policy_model=run.policy, policy_opt=optimizer, rules=run.rules,
                                trainable=run.trainable)
    state = jax.device_put(state, shardings)
    step_fn = make_sft_step(run.policy, optimizer, logprob_chunk=run.algorithm.logprob_chunk, lr_schedule=schedule,
                            state_sharding=shardings, trainable=run.trainable, gpu_gemm=cfg.model.gpu_gemm,
                            traces=run.traces)
    rng = np.random.default_rng(cfg.seed + 11)
    metrics, step = {}, 0
    guard = _NonFiniteGuard(cfg.max_nonfinite_steps)
    unchecked = []  # (step, device scalar) of skipped-update flags not read yet: read at each log, not per step
    total = sum(s for s, _ in stages)
    bar = tqdm(total=total, desc="sft", disable=not cfg.progress)
    for stage_steps, demos in stages:
        for _ in range(stage_steps):
            chosen = demos.draw(rng, cfg.sft.batch_size)
            batch, image_metrics = _pack(run, [e.token_ids for e in chosen], [e.action_mask for e in chosen],
                                         [e.images for e in chosen])
            with _mesh_context(run):
                state, metrics = step_fn(state, take_minibatch(_put_batch(run, batch).rows, 0))
            step += 1
            bar.update()
            unchecked.append((step, metrics["sft/nonfinite"]))
            if step % cfg.log_every == 0:
                run.writer.scalars(step, {**_fetch(metrics), "sft/compiles": float(run.traces["sft_step"]),
                                          **{k.replace("update/", "sft/"): v for k, v in image_metrics.items()}})
            if step % cfg.log_every == 0 or step == total:
                for at, skipped in zip([s for s, _ in unchecked], _fetch([v for _, v in unchecked])):
                    guard.observe(float(skipped), "sft", at, 1)
                unchecked.clear()
        demos.report(step)
    bar.close()
    run.state = run.state.replace(policy=run.state.policy.replace(params=state.policy.params))
    if run.state.ref_params is not None:  # the KL reference is the warm-started policy
        run.state = run.state.replace(ref_params=jax.tree.map(jnp.copy, state.policy.params))
    if run.state.critic is not None:  # the critic's trunk starts from the warm-started policy too
        trunk = run.serve_params(state.policy.params)["model"]  # a LoRA policy's merged trunk
        critic_params = {**run.state.critic.params, "model": jax.tree.map(jnp.copy, trunk)}
        run.state = run.state.replace(critic=init_model_state(critic_params, run.critic_opt))
    run.state = jax.device_put(run.state, run.shardings)
    return {k: float(v) for k, v in _fetch(metrics).items()}


class _Demonstrations:
    """One SFT stage's demonstrations, each encoded when a step first draws it: a short stage draws a small share
    of them, and encoding the quickstart's 8,000 up front took ~20 s of each run's start on a 2-core CPU (~50 s
    before the templates kept their per-tokenizer answers). One longer than the largest bucket (`longest`) is cut
    to it (config.sft.cut_long) or left out of every later draw, counted, and the step's draw is made again from
    the rest (a stage of demonstrations that all fit draws exactly as if all had been encoded first)."""

    def __init__(self, run: Run, conversations: list, stage: int, longest: int):
        self.run, self.conversations, self.stage, self.longest = run, conversations, stage, longest
        self.encoded: dict[int, Any] = {}  # index -> Encoded, or None when too long and left out
        self.drawable = np.arange(len(conversations))

    def __len__(self) -> int:
        return len(self.conversations)

    @property
    def dropped(self) -> int:
        """The demonstrations found too long and left out so far."""
        return sum(e is None for e in self.encoded.values())

    def _encoded(self, index: int):
        if index not in self.encoded:
            run = self.run
            encoded = encode_conversation(run.tokenizer, _as_agent_prompts(run.agent, self.conversations[index]),
                                          tools=run.agent.template_tools(),
                                          chat_template=run.config.chat_template or None,
                                          image_settings=run.agent.image_settings)
            if len(encoded.token_ids) > self.longest:
                encoded = _cut_encoded(run, encoded, self.longest) if run.config.sft.cut_long else None
            self.encoded[index] = encoded
        return self.encoded[index]

    def draw(self, rng: np.random.Generator, size: int) -> list:
        """`size` different demonstrations that fit, drawn uniformly from those not known to be too long."""
        while True:
            if len(self.drawable) < size:
                self._refuse(size)
            picks = self.drawable[rng.choice(len(self.drawable), size=size, replace=False)]
            chosen = [self._encoded(int(j)) for j in picks]
            too_long = [int(j) for j, e in zip(picks, chosen) if e is None]
            if not too_long:
                return chosen
            if self.dropped == len(too_long):  # the first found
                log.warning("sft stage %d: demonstrations longer than the largest bucket (%d tokens) are left out "
                            "(counted in sft/stage%d_dropped_too_long); raise config.seq_buckets or set "
                            "config.sft.cut_long", self.stage, self.longest, self.stage)
            self.drawable = np.setdiff1d(self.drawable, too_long)

    def _refuse(self, size: int) -> None:
        for j in self.drawable:  # every demonstration left is encoded, so that the count below is exact
            self._encoded(int(j))
        fitting = sum(e is not None for e in self.encoded.values())
        if not fitting:
            raise ConfigError(f"sft stage {self.stage}: every one of the {len(self)} demonstrations is longer than "
                              f"the largest bucket ({self.longest} tokens): raise config.seq_buckets or set "
                              "config.sft.cut_long")
        raise ConfigError(f"config.sft.batch_size={size} but only {fitting} of the {len(self)} demonstrations of "
                          f"sft stage {self.stage} fit the largest bucket ({self.longest} tokens): lower the batch "
                          "size, raise config.seq_buckets or set config.sft.cut_long")

    def report(self, step: int) -> None:
        """The stage's count of demonstrations left out (found among those it drew), logged at its last step."""
        if self.dropped:
            log.warning("sft stage %d: %d of the %d demonstrations it encoded (of %d) were longer than the largest "
                        "bucket (%d tokens) and left out", self.stage, self.dropped, len(self.encoded), len(self),
                        self.longest)
            self.run.writer.scalars(step, {f"sft/stage{self.stage}_dropped_too_long": float(self.dropped)})


def _as_agent_prompts(agent, messages: list[dict]) -> list[dict]:
    """A demonstration as the agent will see its tasks in RL: the agent's system message first (unless the
    demonstration has its own), and the chat template renders the agent's tool schemas (passed by the caller)."""
    if messages and messages[0].get("role") == "system":
        return list(messages)
    question = next((m.get("content") for m in messages if m.get("role") == "user"), "")
    if isinstance(question, list):  # content parts (images and text): the question is the text
        question = "".join(p.get("text", "") for p in question if isinstance(p, dict) and p.get("type") == "text")
    system = agent.system_message({"question": question})
    return ([{"role": "system", "content": system}] if system else []) + list(messages)


def _cut_encoded(run: Run, encoded, length: int):
    """A demonstration cut to its first `length` tokens (config.sft.cut_long), with the images whose tokens are
    kept whole; a cut through an image's tokens moves back to before them (half an image cannot be read)."""
    if not encoded.images:
        return dataclasses.replace(encoded, token_ids=encoded.token_ids[:length],
                                   action_mask=encoded.action_mask[:length])
    pad = builders.vision_token_ids(run.tokenizer)["image_token_id"]
    ids = np.asarray(encoded.token_ids)
    pad_at = np.flatnonzero(ids == pad)  # the images' token runs, one after another in order
    kept, end = [], length
    used = 0
    for image in encoded.images:
        first, last = int(pad_at[used]), int(pad_at[used + image.num_tokens - 1])
        used += image.num_tokens
        if last < length:
            kept.append(image)
        else:
            end = min(end, first)
    return dataclasses.replace(encoded, token_ids=encoded.token_ids[:end], action_mask=encoded.action_mask[:end],
                               images=kept)


# ========================================================================================== evaluation
def evaluate(run: Run, step: int, prefix: str = "eval") -> dict:
    """Success on held-out tasks: the headline pass decodes at (`eval.temperature`, `eval.top_p`; temperature 0
    is greedy) with `eval.num_chains` chains per task; `eval.sampled_chains` > 0 adds plain sampling at
    temperature 1 (the training distribution, logged as eval/*_sampled) with that many chains per task.
    `prefix` names the scalars (`eval_before_sft` for the pass before the SFT warm start)."""
    ev = run.config.eval
    tasks = run.eval_tasks[:ev.num_tasks]
    result = _eval_pass(run, step, tasks, ev.temperature, ev.top_p, ev.num_chains, "")
    if ev.sampled_chains:
        result.update(_eval_pass(run, step, tasks, 1.0, 1.0, ev.sampled_chains, "_sampled"))
    result = {prefix + key[len("eval"):]: value for key, value in result.items()}
    run.writer.scalars(step, result)
    return result


def _eval_pass(run: Run, step: int, tasks, temperature: float, top_p: float, num_chains: int, suffix: str) -> dict:
    # a copy of the agent samples at the evaluation's settings: training rollouts may be running at the same time
    # (asynchronous training) on the same backend, tools and environments, at their own settings
    agent = copy.copy(run.agent)
    agent.temperature, agent.top_p = temperature, top_p
    multi = jax.process_count() > 1
    if multi:  # each process evaluates its own share of the tasks; the scalars are over every process's chains
        tasks = tasks[distributed.process_share(len(tasks))]
    trajs = run.runner.run(agent.run(tasks, num_chains=num_chains, seed=_process_seed(10_000_019 + step),
                                     progress=run.config.progress))
    if trajs:  # process 0's first chain (the first of the run's); process 0 alone writes
        sample = trajs[0]
        run.writer.text(step, f"eval/sample_trajectory{suffix}",
                        f"reward={sample.reward} finish={sample.finish_reason}\n\n"
                        + run.tokenizer.decode(sample.token_ids, skip_special_tokens=False))
    rewards, turns, tool_calls = ([t.reward for t in trajs], [t.num_turns for t in trajs],
                                  [t.tool_calls for t in trajs])
    if multi:
        every = distributed.allgather_json([rewards, turns, tool_calls])
        rewards, turns, tool_calls = ([v for own in every for v in own[i]] for i in range(3))
    rewards = np.array(rewards)
    return {f"eval/success{suffix}": float((rewards >= run.task_setup.success_threshold).mean()),
            f"eval/reward{suffix}": float(rewards.mean()),
            f"eval/turns{suffix}": float(np.mean(turns)),
            f"eval/tool_calls{suffix}": float(np.mean(tool_calls))}


# ============================================================================================ RL step
def _step_tasks(run: Run, step: int, extra_round: int = 0) -> list[dict]:
    """The step's tasks: the next `tasks_per_step` of a per-epoch shuffle of the training set; an extra round of
    dynamic sampling draws its own `tasks_per_step` distinct tasks at random (seeded by step and round, so a
    resumed run repeats them)."""
    cfg = run.config
    count, n = cfg.rl.tasks_per_step, len(run.train_tasks)
    if extra_round:  # distinct tasks within the round (a task drawn twice would share its group id)
        pick = np.random.default_rng([cfg.seed, step, 2, extra_round]).choice(n, size=count, replace=count > n)
        return _own_share([run.train_tasks[i] for i in pick])
    order = np.random.default_rng(cfg.seed * 1_000_003 + step // max(1, n))
    start = (step * count) % n
    perm = order.permutation(n)
    return _own_share([run.train_tasks[perm[(start + i) % n]] for i in range(count)])


def _own_share(tasks: list) -> list:
    """This process's contiguous share of a step's tasks (all of them with one process)."""
    return tasks if jax.process_count() == 1 else tasks[distributed.process_share(len(tasks))]


def _process_seed(seed: int) -> int:
    """A rollout seed of this process: the seed itself on process 0 (and with one process), another one on each
    other process, whose chains would otherwise repeat process 0's per-(task index, chain, turn) seeds."""
    return seed + 1_000_000_007 * jax.process_index()


def rollout(run: Run, step: int):
    """The step's chains -> (trajectories to train on, every trajectory sampled, dynamic-sampling metrics).

    With `rl.dynamic_sampling` (DAPO), groups whose chains all got the same reward are dropped (they have no
    advantage signal) and further rounds of tasks are rolled out until `tasks_per_step` groups with signal are
    in hand or `dynamic_sampling_max_rounds` extra rounds are spent; the batch is then topped up with dropped
    groups so that every step trains on `tasks_per_step` groups. Groups are renumbered, so a task drawn twice
    makes two groups.

    Chains that ended in a runtime error (chain_error) are left out of both lists before anything else
    (`batch.drop_failed_chains`: their groups go on with the chains that remain) and counted as
    `rollout/chain_errors_dropped`; a step that has no chain left stops the run with the first error.

    The agent's rollout counters come back in the metrics as `rollout/*` (taken from the very call that made
    them: with asynchronous training several steps' rollouts run at once)."""
    cfg = run.config
    rl = cfg.rl
    failed, round_stats = [], []
    processes, me = jax.process_count(), jax.process_index()

    async def run_and_count(tasks, seed):
        trajectories = await run.agent.run(tasks, num_chains=rl.chains_per_task, seed=seed, progress=cfg.progress)
        return trajectories, dict(run.agent.last_run_stats)  # no await in between: this call's own counters

    def sample(tasks, round_index):
        trajectories, stats = run.runner.run(run_and_count(
            tasks, _process_seed(cfg.seed * 7919 + step + 1_000_033 * round_index)))
        round_stats.append(stats)
        kept, dropped = drop_failed_chains(trajectories)
        failed.extend(dropped)
        if processes > 1:  # group ids unique over the processes (each numbers its own tasks)
            for t in trajectories:
                t.group_id = t.group_id * processes + me
        return kept

    def no_chains_left(metrics):
        # several processes: a process left without chains goes on (the others may have some); make_batch
        # stops every process when none has any (`_CHAIN_ERROR` carries this process's count and first error)
        if processes == 1:
            raise no_chains_left_error(failed, step)
        return {**metrics, _CHAIN_ERROR: [len(failed), str(no_chains_left_error(failed, step))]}

    if not rl.dynamic_sampling:
        trajectories = sample(_step_tasks(run, step), 0)
        metrics = {"rollout/chain_errors_dropped": float(len(failed)), **_prefixed(round_stats[0])}
        if not trajectories:
            metrics = no_chains_left(metrics)
        return trajectories, trajectories, metrics
    target = len(_own_share(list(range(rl.tasks_per_step))))  # this process's share of the step's groups
    kept, dropped, every = [], [], []
    rounds = 0
    while len(kept) < target and rounds <= rl.dynamic_sampling_max_rounds:
        trajectories = sample(_step_tasks(run, step, rounds), rounds)
        every.extend(trajectories)
        groups: dict[int, list] = {}
        for t in trajectories:
            groups.setdefault(t.group_id, []).append(t)
        for group in groups.values():
            rewards = {t.reward for t in group}
            (kept if len(rewards) > 1 else dropped).append(group)
        rounds += 1
    filled = max(0, target - len(kept))
    chosen = kept[:target] + dropped[len(dropped) - filled:] if filled else kept[:target]
    train_on = []
    for new_id, group in enumerate(chosen):
        for t in group:
            t.group_id = new_id * processes + me
            train_on.append(t)
    metrics = {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/groups_kept": float(len(kept)),
               "dynamic_sampling/groups_dropped": float(len(dropped)),
               "dynamic_sampling/groups_filled": float(filled),
               "dynamic_sampling/chains_sampled": float(len(every)),
               "rollout/chain_errors_dropped": float(len(failed))}
    if not train_on:
        metrics = no_chains_left(metrics)
    combined = _combine_round_stats(round_stats)  # every round's chains
    run.agent.last_run_stats = combined
    metrics.update(_prefixed(combined))
    if filled:
        log.warning("step %d: dynamic sampling found %d of %d groups with reward signal in %d rounds; %d groups "
                    "without signal fill the batch", step, len(kept), target, rounds, filled)
    return train_on, every, metrics


class AsyncSteps:
    """The loop's side of asynchronous training (`rl.max_staleness` > 0; see trainer/async_rollouts.py): step s's
    rollout starts once the served policy is at version >= s - max_staleness and runs while earlier steps update.
    `take(step)` hands over the step's trajectories (checked against the staleness bound) with the `async/*`
    scalars; `updated` / `synced` tell it that an update finished and that its weights are served."""

    def __init__(self, run: Run, start_step: int):
        self.run, self.max_staleness = run, run.config.rl.max_staleness
        self.trained_version = start_step  # updates finished: the state a failure must not lose
        self.updating = False  # between an update's first and last mini-batch the state is neither step
        self._since = time.perf_counter()
        self._interrupted = self._interrupted_so_far()
        self.producer = RolloutProducer(lambda step: rollout(run, step), start_step, run.config.rl.steps,
                                        self.max_staleness, version=lambda: int(run.backend.weight_version))

    def take(self, step: int):
        """(trajectories to train on, every trajectory sampled, sampling metrics, rollout seconds, async metrics)."""
        batch, waited = self.producer.take(step)
        trajectories, sampled, sampling_metrics = batch.result
        kept, stale, lags = staleness_filter(trajectories, step, self.max_staleness)
        if stale:  # cannot happen by construction (batch s starts at version >= s - max_staleness): a bug's alarm
            log.warning("step %d: %d of %d trajectories are more than %d policy versions old and were dropped",
                        step, len(stale), len(trajectories), self.max_staleness)
        if not kept:
            raise RuntimeError(f"step {step}: every trajectory of the batch is more than rl.max_staleness="
                               f"{self.max_staleness} policy versions old")
        now = time.perf_counter()
        metrics = {"async/staleness_mean": float(np.mean(lags)), "async/staleness_max": float(max(lags)),
                   "async/stale_dropped": float(len(stale)), "async/trainer_wait_s": waited,
                   "async/rollout_idle_s": self.producer.idle_s(self._since, now),
                   "async/batches_in_flight": float(self.producer.in_flight),
                   "async/version_at_rollout_start": float(batch.version_at_start)}
        self._since = now
        return kept, sampled, sampling_metrics, batch.ended - batch.started, metrics

    def begin_update(self) -> None:
        self.updating = True

    def updated(self, version: int) -> None:
        self.trained_version, self.updating = version, False

    def synced(self, version: int, sync_s: float) -> dict:
        """Starts the rollouts the new version allows; the weight sync's scalars."""
        self.producer.advance(version)
        interrupted, self._interrupted = self._interrupted, self._interrupted_so_far()
        return {"async/weight_sync_wait_s": sync_s, "async/interrupted_sequences": self._interrupted - interrupted}

    def _interrupted_so_far(self) -> float:
        """Sequences the backend has interrupted at weight syncs so far (partial rollouts)."""
        stats = getattr(self.run.backend, "stats", None) or {}
        return float(stats.get("interrupted_sequences", 0) + stats.get("interrupted_requests", 0))

    def close(self) -> None:
        self.producer.close()

    def save_after_failure(self, eval_before: dict) -> None:
        """The run failed (a rollout, a weight sync, an evaluation, ...): the trainer state of the last finished
        update is checkpointed (if it is not already) so that `config.resume` continues from it. Not when the
        failure came between an update's mini-batches (that state is neither step), nor with several processes
        (the save is collective and the others may not be failing)."""
        step = self.trained_version
        if self.updating or jax.process_count() > 1:
            log.error("asynchronous training stopped on an error %s; the trainer state is not saved, the last "
                      "checkpoint in %s is the one to resume from", "during an update" if self.updating else
                      "in a run of several processes", self.run.checkpointer.directory)
            return
        try:
            _save(self.run, step, eval_before, force=True)
            log.error("asynchronous training stopped on an error; the trainer state after %d updates is in %s "
                      "(set config.resume=True to continue from it)", step, self.run.checkpointer.directory)
        except Exception as exc:  # noqa: BLE001 - the original error is what the caller raises
            log.error("asynchronous training stopped on an error and the trainer state of step %d could not be "
                      "saved: %s: %s", step, type(exc).__name__, exc)


def _prefixed(stats: dict) -> dict:
    return {f"rollout/{k}": v for k, v in stats.items()}


def _combine_round_stats(rounds: list[dict]) -> dict:
    """The agent's per-run statistics of several rollout rounds as one: counts add up, peaks take the max,
    means and per-chain ratios are averaged over the rounds."""
    out = {}
    for key in rounds[0]:
        values = [r.get(key, 0.0) for r in rounds]
        if key.endswith("_peak"):
            out[key] = max(values)
        elif "mean" in key or "per_chain" in key:
            out[key] = sum(values) / len(values)
        else:
            out[key] = sum(values)
    return out


def overlong_shaping(run: Run, arrays: dict) -> dict:
    """DAPO's overlong penalty added to `arrays["rewards"]` in place (by the chains' sampled tokens); metrics."""
    rl = run.config.rl
    if not rl.overlong_buffer_len:
        return {}
    sampled = np.asarray(arrays["action_mask"]).sum(axis=1)
    penalty = np.asarray(algorithms.overlong_penalty(sampled, max_len=run.config.overlong_max_len(),
                                                     buffer_len=rl.overlong_buffer_len))
    arrays["rewards"] = (arrays["rewards"] + (rl.overlong_penalty_factor or 1.0) * penalty).astype(np.float32)
    return {"reward/overlong_penalty_mean": float(penalty.mean()),
            "reward/overlong_fraction": float((penalty < 0).mean())}


def make_batch(run: Run, trajectories, step: int, chain_error: list | None = None) -> UpdateBatch:
    """Trajectories -> the step's UpdateBatch, on the devices (one transfer), filled by the jitted `prepare`
    (old/reference logprobs, values, advantages, loss weights); returns it with prepare's metrics (and the
    overlong shaping's). Several processes: this process's trajectories make its block of the global batch
    (`_make_batch_processes`; `chain_error`: what `rollout` said when this process kept no chain)."""
    cfg = run.config
    if jax.process_count() > 1:
        return _make_batch_processes(run, trajectories, step, chain_error)
    with_images = any(t.images for t in trajectories)
    arrays = trajectories_to_batch(trajectories, pad_to=choose_bucket(max(t.length for t in trajectories),
                                                                       cfg.seq_buckets),
                                   image_token_id=_image_token_id(run) if with_images else None)
    shaping = overlong_shaping(run, arrays)
    # fewer trajectories than mini-batches (failed chains were dropped): no empty mini-batch (Adam's momentum
    # would move the parameters on its zero gradient)
    mini_batches = min(cfg.rl.mini_batches, len(trajectories))
    if mini_batches < cfg.rl.mini_batches:
        log.warning("step %d: %d trajectories for %d mini-batches; this step uses %d", step, len(trajectories),
                    cfg.rl.mini_batches, mini_batches)
    minibatch = assign_minibatches(len(trajectories), mini_batches, np.random.default_rng([cfg.seed, step, 0]))
    batch = pack_step(arrays["tokens"], arrays["action_mask"], arrays["sampler_logprobs"], arrays["lengths"],
                      rewards=arrays["rewards"], group_ids=arrays["group_ids"], minibatch=minibatch,
                      num_minibatches=mini_batches, micro_batches=cfg.rl.micro_batches,
                      rows_multiple=_rows_multiple(run, arrays["tokens"].shape[1]),
                      micro_batch_tokens=cfg.rl.micro_batch_tokens, **_image_arrays(run, arrays))
    packing = packing_metrics(batch, run.policy.config, row_shards=_data_parallel_size(run.mesh))
    with _mesh_context(run):
        batch, metrics = run.prepare_fn(run.state, _put_batch(run, batch))
    return batch, {**metrics, **shaping, **packing, **_image_metrics(arrays, batch)}


def _make_batch_processes(run: Run, trajectories, step: int, chain_error: list | None):
    """make_batch with several processes. Each process packs its own trajectories into its block of every
    micro-batch's rows (the rows its devices hold: `_data_parallel_block`); two host exchanges make the processes
    agree first: on the trajectory count N and the row length T (the global longest's bucket), then on the row
    count (the most any process's mini-batch needs: a process with fewer trajectories pads with empty rows,
    segment 0, masked) and on the per-trajectory arrays [N] (rewards, group ids, lengths), which every device
    holds whole. Trajectories are numbered process by process; the mini-batch split is the one-process split of
    all N; `pack_index` points into the global [N, T] view and `unpack_index` is derived from it on the devices."""
    cfg = run.config
    me = jax.process_index()
    first_dp, dp_local, dp = _data_parallel_block(run.mesh)
    shared = distributed.allgather_json({"n": len(trajectories),
                                         "longest": max((t.length for t in trajectories), default=0),
                                         "images": any(t.images for t in trajectories), "error": chain_error})
    total = sum(s["n"] for s in shared)
    if not total:  # every process stops alike: no process has a chain to train on
        errors = [s["error"] for s in shared if s["error"]]
        raise NoChainsLeftError(f"RL step {step}: all {sum(e[0] for e in errors)} chains of the {len(shared)} "
                                "processes ended in a runtime error (chain_error), so there is nothing to train on; "
                                f"process {shared.index(next(s for s in shared if s['error']))} said: "
                                f"{errors[0][1]}")
    if any(s["images"] for s in shared):
        raise ConfigError(f"RL step {step}: trajectories with images are trained by one process only (each "
                          "micro-batch's images go to every device whole, which the processes' blocks of rows do not "
                          "provide); run a vision-language policy on one host (config.distributed.num_processes=1)")
    first = sum(s["n"] for s in shared[:me])
    row_len = choose_bucket(max(s["longest"] for s in shared), cfg.seq_buckets)
    arrays = (trajectories_to_batch(trajectories, pad_to=row_len) if trajectories
              else _no_trajectories(row_len))
    sampled = np.asarray(arrays["action_mask"]).sum(axis=1)
    mini_batches = min(cfg.rl.mini_batches, total)
    if mini_batches < cfg.rl.mini_batches:
        log.warning("step %d: %d trajectories for %d mini-batches; this step uses %d", step, total,
                    cfg.rl.mini_batches, mini_batches)
    every_minibatch = assign_minibatches(total, mini_batches, np.random.default_rng([cfg.seed, step, 0]))
    minibatch = every_minibatch[first:first + len(trajectories)]
    second = distributed.allgather_json({"rows": rows_needed(arrays["lengths"], minibatch, mini_batches, row_len),
                                         "rewards": arrays["rewards"].tolist(),
                                         "group_ids": arrays["group_ids"].tolist(),
                                         "lengths": arrays["lengths"].tolist(), "sampled": sampled.tolist()})
    every = {key: np.concatenate([np.asarray(s[key], dtype) for s in second]) for key, dtype in
             (("rewards", np.float32), ("group_ids", np.int32), ("lengths", np.int32), ("sampled", np.float32))}
    # DAPO's overlong shaping over every process's trajectories, from their sampled-token counts (an [N, 1]
    # "mask" holding each count sums to it); the rewards the devices see are these
    shaped = {"action_mask": every["sampled"][:, None], "rewards": every["rewards"]}
    shaping = overlong_shaping(run, shaped)
    every_rewards = shaped["rewards"]
    local_multiple = _rows_multiple(run, row_len) * dp_local // dp
    block = pack_step(arrays["tokens"], arrays["action_mask"], arrays["sampler_logprobs"], arrays["lengths"],
                      rewards=every_rewards[first:first + len(trajectories)], group_ids=arrays["group_ids"],
                      minibatch=minibatch, num_minibatches=mini_batches, micro_batches=cfg.rl.micro_batches,
                      rows_multiple=local_multiple, micro_batch_tokens=cfg.rl.micro_batch_tokens,
                      min_rows=max(s["rows"] for s in second), row_blocks=dp // dp_local)
    block = place_block(block, first_trajectory=first, num_trajectories=total)
    with _mesh_context(run):
        batch = _put_block(run, block, first_dp // dp_local, dp // dp_local, rewards=every_rewards,
                           group_ids=every["group_ids"], minibatch=every_minibatch, lengths=every["lengths"])
        batch, metrics = run.prepare_fn(run.state, batch)
    return batch, {**metrics, **shaping}


def _no_trajectories(row_len: int) -> dict:
    """trajectories_to_batch's arrays for a process that kept no chain this step (its rows are all padding)."""
    return {"tokens": np.zeros((0, row_len), np.int32), "action_mask": np.zeros((0, row_len), np.float32),
            "sampler_logprobs": np.zeros((0, row_len), np.float32), "lengths": np.zeros(0, np.int32),
            "rewards": np.zeros(0, np.float32), "group_ids": np.zeros(0, np.int32)}


def update(run: Run, batch: UpdateBatch, step: int) -> dict:
    """`rl.ppo_epochs` passes over the step's mini-batches (in a new order each epoch), one optimiser step per
    mini-batch; returns the last mini-batch's metrics."""
    cfg = run.config
    rng = np.random.default_rng([cfg.seed, step, 1])  # its own stream: not the next step's assignment
    metrics, skipped = {}, []
    for _ in range(cfg.rl.ppo_epochs):
        for k in rng.permutation(batch.num_minibatches):
            with _mesh_context(run):
                run.state, metrics = run.train_step(run.state, take_minibatch(batch.rows, int(k)))
            skipped.append({key: v for key, v in metrics.items() if key.endswith("/nonfinite")})
    # skipped (non-finite) optimiser steps of the whole update, not only of its last mini-batch
    metrics = {k: v for k, v in metrics.items() if not k.endswith("/nonfinite")}
    for key in skipped[0] if skipped else ():
        metrics[key.replace("/nonfinite", "/nonfinite_updates")] = sum(s[key] for s in skipped)
    return metrics


def sync_weights(run: Run, version: int) -> float:
    """Serves the trained policy as `version`; seconds it took. With rollouts in flight (asynchronous training)
    their sequences finish on the old weights first, or with `rl.partial_rollouts` go on with the new ones."""
    t0 = time.perf_counter()
    params = run.serve_params(run.state.policy.params)
    if jax.process_count() > 1:  # each process's own backend gets the whole policy, on the host
        params = _host_params(params)
    if run.config.rl.partial_rollouts:
        run.runner.run(run.backend.update_weights(params, version, interrupt=True))
    else:
        run.runner.run(run.backend.update_weights(params, version))
    return time.perf_counter() - t0


def rollout_metrics(run: Run, trajectories) -> dict:
    """Scalars of the trajectories sampled in a step (the agent's counters come with `rollout`'s metrics)."""
    return _trajectory_metrics(run, _trajectory_values(trajectories), _engine_metrics(run))


def _trajectory_values(trajectories) -> dict:
    """What the step's scalars read of each sampled trajectory (host lists: processes exchange them)."""
    return {"reward": [t.reward for t in trajectories], "turns": [t.num_turns for t in trajectories],
            "tool_calls": [t.tool_calls for t in trajectories],
            "response_tokens": [t.num_action_tokens for t in trajectories],
            "reward_failed": [int("reward_failed" in t.flags) for t in trajectories],
            "images": [len(t.images) for t in trajectories], "length": [t.length for t in trajectories]}


def _trajectory_metrics(run: Run, values: dict, engine: dict) -> dict:
    rewards = np.array(values["reward"])
    return {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "success/rate": float((rewards >= run.task_setup.success_threshold).mean()),
            "rollout/turns_mean": float(np.mean(values["turns"])),
            "rollout/tool_calls_mean": float(np.mean(values["tool_calls"])),
            "rollout/response_tokens_mean": float(np.mean(values["response_tokens"])),
            "rollout/reward_failures": float(sum(values["reward_failed"])),
            **_rollout_image_metrics(values["images"]), **engine}


def _rollout_image_metrics(counts: list) -> dict:
    """Images the sampled chains saw (prompts and tool observations; `counts`: per chain), for chains with
    images; none otherwise."""
    if not any(counts):
        return {}
    return {"rollout/images": float(sum(counts)), "rollout/images_mean": float(np.mean(counts))}


#: The JAX sampler's cumulative prompt counters (`JaxSampler.stats`) logged per step, as the step's share.
_PREFIX_COUNTERS = ("prompt_tokens", "prefill_tokens", "prefix_tokens_reused", "prefix_hits", "prefix_evictions")


def _engine_metrics(run: Run) -> dict:
    """The JAX sampler's compiled programs so far (bounded shapes: they should stop growing after the first
    steps), its prompt work since the last call (prompt tokens asked for, computed, and taken from cached
    prefixes; prefix hits and evictions; the share of prompt tokens reused) and the devices' peak memory, where
    the runtime reports them."""
    out = {}
    counts = getattr(run.backend, "compile_counts", None)  # the JAX sampler's programs traced, by kind
    if counts is not None:
        out["sampler/compiles"] = float(sum(counts.values()))
        out.update({f"sampler/compiles_{kind}": float(n) for kind, n in counts.items()})
    stats = getattr(run.backend, "stats", None)
    if counts is not None and stats is not None:
        now = {key: float(stats.get(key, 0)) for key in _PREFIX_COUNTERS}
        out.update({f"sampler/{key}": value - run.engine_seen.get(key, 0.0) for key, value in now.items()})
        run.engine_seen = now
        if out["sampler/prompt_tokens"] > 0:
            out["sampler/prefix_reused_fraction"] = out["sampler/prefix_tokens_reused"] / out["sampler/prompt_tokens"]
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    if peaks and all(p is not None for p in peaks):
        out["memory/peak_gib"] = max(peaks) / 2**30
    return out


# ============================================================================================== train
def train(config, workdir: str | None = None) -> dict:
    """Runs the experiment described by `config`; returns (and writes) `<workdir>/summary.json`."""
    t_start = time.time()
    try:
        run = setup(config, workdir)
    except BaseException as exc:
        _stop_processes(exc)
        raise
    cfg, workdir = run.config, run.workdir
    producer, before = None, {}
    forget_cleanup = distributed.at_emergency_exit(lambda: _release_processes(run))
    try:
        # --- Load checkpoint (or warm start) --------------------------------------------------------
        start_step, sft_metrics, before_sft = 0, {}, {}
        # the optimizer state's layout follows optimizer.fused (checkpoints before it existed: "off")
        restored = (run.checkpointer.restore_latest(_checkpoint_tree(run), settings={
            "optimizer_fused": (cfg.optimizer.fused, "off")}) if cfg.resume else None)
        if restored is not None:
            start_step, tree, meta = restored
            run.state = jax.device_put(tree["state"], run.shardings)
            sync_weights(run, meta["weight_version"])
            log.info("resumed from step %d (%s)", start_step, run.checkpointer.directory)
            before = meta.get("eval_before") or {}
        else:
            if cfg.sft.steps or cfg.sft.stages:
                if cfg.eval.num_tasks and cfg.eval.before_sft:
                    before_sft = evaluate(run, 0, prefix="eval_before_sft")
                sft_metrics = run_sft(run)
                sync_weights(run, 0)
            before = evaluate(run, 0) if cfg.eval.num_tasks else {}
            _save(run, 0, before, force=True)

        # --- RL loop --------------------------------------------------------------------------------
        bar = tqdm(range(start_step, cfg.rl.steps), desc=f"rl/{cfg.algorithm}", initial=start_step,
                   total=cfg.rl.steps, disable=not cfg.progress)
        nonfinite = _NonFiniteGuard(cfg.max_nonfinite_steps)
        # asynchronous training: rollouts of later steps run while this one updates (trainer/async_rollouts.py)
        producer = AsyncSteps(run, start_step) if cfg.rl.max_staleness else None
        for step in bar:
            t0 = time.perf_counter()
            if producer is None:
                trajectories, sampled, sampling_metrics = rollout(run, step)
                t_rollout, async_metrics = time.perf_counter() - t0, {}
            else:
                trajectories, sampled, sampling_metrics, t_rollout, async_metrics = producer.take(step)

            t0 = time.perf_counter()
            chain_error = sampling_metrics.pop(_CHAIN_ERROR, None)
            batch, batch_metrics = make_batch(run, trajectories, step, chain_error)
            if producer is not None:
                producer.begin_update()
            update_metrics = update(run, batch, step)
            update_metrics = {k: float(v) for k, v in _fetch({**batch_metrics, **update_metrics}).items()}
            t_update = time.perf_counter() - t0
            tokens = float(sum(t.length for t in trajectories))
            sampled_tokens = float(sum(t.length for t in sampled))

            if producer is not None:
                producer.updated(step + 1)
            t_sync = sync_weights(run, step + 1)
            if producer is not None:
                async_metrics.update(producer.synced(step + 1, t_sync))
            if jax.process_count() > 1:  # the step's scalars describe every process's chains
                sampling_metrics, async_metrics, tokens, sampled_tokens, t_rollout = _process_metrics(
                    run, trajectories, sampled, sampling_metrics, async_metrics, t_rollout)
                metrics = {**sampling_metrics, **update_metrics, **async_metrics}
            else:
                metrics = {**sampling_metrics, **rollout_metrics(run, sampled), **update_metrics, **async_metrics}
            metrics = {**metrics,
                       "update/tokens": tokens * cfg.rl.ppo_epochs,
                       # programs the update has traced so far (prepare and train_step): each new batch shape
                       # [K, M, R, L] compiles both again; growing step after step means the packed row count
                       # keeps changing (config.row_bucket, rl.micro_batch_tokens)
                       "update/compiles": float(run.traces["prepare"] + run.traces["train_step"]),
                       "time/rollout_s": t_rollout, "time/update_s": t_update, "time/weight_sync_s": t_sync,
                       "throughput/update_tokens_per_s": tokens * cfg.rl.ppo_epochs / max(t_update, 1e-9),
                       "throughput/rollout_tokens_per_s": sampled_tokens / max(t_rollout, 1e-9),
                       "policy_version": float(step + 1)}
            if (step + 1) % cfg.log_every == 0:
                run.writer.scalars(step + 1, metrics)
            nonfinite.observe(sum(v for k, v in update_metrics.items() if k.endswith("/nonfinite_updates")), "rl",
                              step + 1, cfg.rl.ppo_epochs * batch.num_minibatches)  # after its scalars are written
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", kl=f"{metrics.get('policy/approx_kl', 0):.3f}")
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.rl.steps:
                evaluate(run, step + 1)
            if run.checkpointer.should_save(step + 1):
                _save(run, step + 1, before)
            run.writer.flush()

        if producer is not None:
            producer.close()
        # --- Final eval, checkpoint, summary ----------------------------------------------------------
        after = evaluate(run, cfg.rl.steps) if cfg.eval.num_tasks else {}
        _save(run, cfg.rl.steps, before, force=True)
        # The trained policy in Hugging Face format (transformers and vLLM load it), with its tokenizer, the chat
        # template used in training and the turn's stop tokens as eos (trainer/export.py).
        final_dir = os.path.join(workdir, "final_policy")
        _check_finite(run.state.policy.params, "export the final policy")
        final_params = _host_params(run.serve_params(run.state.policy.params))  # collective with several processes
        if jax.process_index() == 0:  # process 0 alone writes the export and the summary
            export_policy(run.serving_model, final_params, run.tokenizer, final_dir,
                          stop_token_ids=run.agent.stop_token_ids, chat_template=cfg.chat_template or None,
                          image_settings=run.agent.image_settings)
        summary = {"algorithm": cfg.algorithm, "environment": cfg.env.name or cfg.task.train_path,
                   "success_before": before.get("eval/success"), "success_after": after.get("eval/success"),
                   "reward_before": before.get("eval/reward"), "reward_after": after.get("eval/reward"),
                   "success_before_sft": before_sft.get("eval_before_sft/success"),
                   "reward_before_sft": before_sft.get("eval_before_sft/reward"),
                   "eval_episodes": len(run.eval_tasks[:cfg.eval.num_tasks]) * cfg.eval.num_chains,
                   "success_before_sampled": before.get("eval/success_sampled"),
                   "success_after_sampled": after.get("eval/success_sampled"),
                   "eval_temperature": cfg.eval.temperature, "eval_top_p": cfg.eval.top_p,
                   "steps": cfg.rl.steps, "wall_seconds": round(time.time() - t_start, 1),
                   "resumed_from": start_step if restored is not None else None, "sft": sft_metrics,
                   "backend": cfg.backend, "workdir": os.path.abspath(workdir), "final_policy": final_dir}
        if jax.process_index() == 0:
            with open(os.path.join(workdir, "summary.json"), "w") as fh:
                json.dump(summary, fh, indent=2)
        return summary
    except BaseException as exc:
        lost = _stop_processes(exc, reraise=False)  # several processes: tell the others, or learn who was lost
        if producer is not None and isinstance(exc, Exception):  # rollouts run on their own: stop them, keep
            producer.close()  # what the trainer has done
            producer.save_after_failure(before)
        if lost is not None:  # (the watchdog's interrupt, a KeyboardInterrupt, is no cause worth showing)
            raise lost from (None if isinstance(exc, KeyboardInterrupt) else exc)
        raise
    finally:
        try:
            _close_run(run)
        finally:  # (kept until here: the close itself may be what is stuck, e.g. a save waiting for a lost peer)
            forget_cleanup()


def _stop_processes(exc: BaseException, reraise: bool = True):
    """A run of several processes ends on `exc`: when another process was lost or failed (`distributed.stopped_by`
    waits for the watchdog's verdict where `exc` may be that loss seen from here), the ProcessLostError that names
    it, raised from `exc` (returned with reraise=False); otherwise this process's own failure, told to the others
    so that they stop at once. One process: nothing."""
    lost = distributed.stopped_by(exc)  # None at once with one process
    if lost is not None and reraise:
        raise lost from (None if isinstance(exc, KeyboardInterrupt) else exc)
    return lost


def _release_processes(run: Run) -> None:
    """What must not outlive a process that the watchdog ends while its main thread is stuck (a collective waiting
    for a lost process): launched inference servers and pooled environments (their child processes are then
    terminated as well, distributed.end_child_processes)."""
    if run.env_manager is not None:
        run.runner.run(run.env_manager.close())
    run.runner.run(run.backend.close())


def close_runner(runner: asyncio.Runner | ThreadedRunner, timeout_s: float = 30.0) -> None:
    """`runner.close()`, bounded: tasks still pending (e.g. an abandoned tool call that swallows cancellation)
    get `timeout_s` to end after being cancelled; if some never do, the loop is closed around them with a
    warning instead of waiting forever (`asyncio.Runner.close` would). A ThreadedRunner (asynchronous training)
    does the same on its own thread."""
    if isinstance(runner, ThreadedRunner):
        runner.close(timeout_s)
        return
    loop = runner.get_loop()
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if pending:
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.wait(pending, timeout=timeout_s))
        stuck = [task for task in pending if not task.done()]
        if stuck:
            log.warning("%d background task(s) ignored cancellation for %.0f s (abandoned tool calls or rewards); "
                        "closing the event loop without them", len(stuck), timeout_s)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            return
    runner.close()


def _close_run(run: Run) -> None:
    """Closes everything the run holds; one failing close does not skip the others (launched vLLM servers and
    pooled environments would outlive the trainer). The first error is raised after all were tried."""
    steps = [run.writer.close, run.checkpointer.close, lambda: run.runner.run(run.backend.close())]
    if run.env_manager is not None:
        steps.append(lambda: run.runner.run(run.env_manager.close()))
    steps.append(lambda: close_runner(run.runner))
    errors = []
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - collected and re-raised below
            log.error("closing the run: %s: %s", type(exc).__name__, exc)
            errors.append(exc)
    unfreeze_startup_heap(run.heap_frozen)  # the run's start-up objects are collectable again
    run.heap_frozen = False
    if errors:
        raise errors[0]


# ============================================================================================ helpers
def _checkpoint_tree(run: Run) -> dict:
    return {"state": run.state}


def _save(run: Run, step: int, eval_before: dict, force: bool = False) -> None:
    meta = {"step": step, "weight_version": step, "algorithm": run.config.algorithm,
            "eval_before": eval_before, "data_position": step * run.config.rl.tasks_per_step,
            "optimizer_fused": run.config.optimizer.fused}
    _check_finite(run.state, f"checkpoint step {step}")
    run.checkpointer.save(step, _checkpoint_tree(run), meta, force=force)


def _rows_multiple(run: Run, row_len: int) -> int:
    """Packed row counts of a micro-batch are rounded up to this: a multiple of the data-parallel size and of
    `config.row_bucket / micro_batches` (few distinct shapes to compile, little padding), but never more rows
    than `rl.micro_batch_tokens` allows at this row length (then the micro-batch count absorbs the variation)."""
    data_parallel = _data_parallel_size(run.mesh)
    per_micro = -(-run.config.row_bucket // run.config.rl.micro_batches)
    budget = run.config.rl.micro_batch_tokens
    if budget:
        per_micro = min(per_micro, max(1, budget // row_len))
    return data_parallel * max(1, -(-per_micro // data_parallel))


def _pack(run: Run, token_ids: list, action_masks: list, images: list | None = None) -> tuple[UpdateBatch, dict]:
    """SFT conversations (and their images, `Encoded.images`) -> (a one-mini-batch UpdateBatch (no rewards or
    groups), its image scalars)."""
    lengths = np.array([len(t) for t in token_ids], np.int32)
    t = choose_bucket(int(lengths.max()), run.config.seq_buckets)
    tokens = np.zeros((len(token_ids), t), np.int32)
    mask = np.zeros((len(token_ids), t), np.float32)
    for i, (ids, m) in enumerate(zip(token_ids, action_masks)):
        tokens[i, :len(ids)], mask[i, :len(m)] = ids, m
    n = len(token_ids)
    arrays = {}
    if images is not None and any(images):  # the batch layout of rollouts, through the same packing
        arrays = images_to_batch([Trajectory(ids, m, [0.0] * len(ids), images=list(own))
                                  for ids, m, own in zip(token_ids, action_masks, images)],
                                 image_token_id=_image_token_id(run))
    batch = pack_step(tokens, mask, np.zeros_like(mask), lengths, rewards=np.zeros(n), group_ids=np.arange(n),
                      minibatch=np.zeros(n, np.int32), num_minibatches=1, micro_batches=run.config.rl.micro_batches,
                      rows_multiple=_rows_multiple(run, t), micro_batch_tokens=run.config.rl.micro_batch_tokens,
                      **_image_arrays(run, arrays))
    return batch, _image_metrics(arrays, batch)


def _image_token_id(run: Run) -> int | None:
    """The policy's image pad token (a vision-language policy), against which batches check their images."""
    vision = getattr(run.policy.config, "vision", None)
    return None if vision is None else vision.image_token_id


def _image_arrays(run: Run, arrays: dict) -> dict:
    """pack_step's image arguments for a batch with images (`images_to_batch`'s keys in `arrays`), else {}."""
    if "image_grid_thw" not in arrays:
        return {}
    return {"images": {k: arrays[k] for k in ("pixel_values", "image_grid_thw", "image_rows")},
            "model_config": run.policy.config}


def packing_metrics(batch: UpdateBatch, model_config, row_shards: int = 1) -> dict:
    """Scalars of a step's packed rows (host numpy, one process's batch): the rows, the share of their token slots
    that is padding (computed by the update all the same), the most sequences a row holds, and, where cuDNN reads
    the rows as packed segments (`model.attention_segments`), the share of micro-batch shards with a row of more
    runs than that bound, which take the dense-mask kernel instead. `row_shards`: the devices a micro-batch's rows
    are split over (data x fsdp); each decides on its own rows (`transformer._cudnn_packed`), so a shard is
    counted, not a whole micro-batch (a count that does not divide the rows counts micro-batches)."""
    seg = np.asarray(batch.rows.segment_ids)  # [K, M, R, L]: 1, 2, ... per row, 0 = padding
    out = {"update/packed_rows": float(np.prod(seg.shape[:-1])),
           "update/padding_fraction": float((seg == 0).mean()),
           "update/max_sequences_per_row": float(seg.max(initial=0))}
    bound = packed_segment_bound(model_config)
    if bound:  # the runs of each row [K, M, R]; a micro-batch's shard with a fuller row takes the dense kernel
        runs = row_runs(seg)
        k, m, r = runs.shape
        shards = row_shards if r % row_shards == 0 else 1
        out["update/dense_attention_fraction"] = float((runs.reshape(k, m, shards, -1).max(axis=-1) > bound).mean())
    return out


def _image_metrics(arrays: dict, batch: UpdateBatch) -> dict:
    """Scalars of a batch's images: how many, their patches, and the patch rows the vision tower ran on (all
    micro-batches, padding included); none for a text-only batch."""
    if "image_grid_thw" not in arrays:
        return {}
    pixels = batch.rows.vision.pixel_values
    return {"update/images": float(len(arrays["image_grid_thw"])),
            "update/image_patches": float(np.prod(arrays["image_grid_thw"], axis=1).sum()),
            "update/image_patch_rows": float(np.prod(pixels.shape[:-1]))}


def _put_batch(run: Run, batch: UpdateBatch) -> UpdateBatch:
    """The host batch -> the devices in one transfer: packed rows split over the data-parallel mesh axes,
    the per-trajectory view replicated."""
    rows_sharding = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec(None, None, ("data", "fsdp")))
    replicated = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec())
    rows = jax.tree.map(lambda _: rows_sharding, batch.rows.replace(vision=None))
    if batch.rows.vision is not None:  # mRoPE positions [K, M, 3, R, L]; each micro-batch's images whole everywhere
        positions = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec(None, None, None,
                                                                                    ("data", "fsdp")))
        rows = rows.replace(positions=positions, vision=jax.tree.map(lambda _: replicated, batch.rows.vision))
    shardings = batch.replace(rows=rows, pack_index=rows_sharding, rewards=replicated, group_ids=replicated,
                              minibatch=replicated, lengths=replicated, unpack_index=replicated)
    if jax.process_count() > 1:  # every process built this whole batch (SFT); each hands its devices their part
        return _put_global(batch, shardings)
    return jax.device_put(batch, shardings)


@contextlib.contextmanager
def _mesh_context(run: Run):
    """The run's mesh and logical axis rules, active while tracing/running jitted steps."""
    with jax.set_mesh(run.mesh), shd.axis_rules(run.rules):
        yield


# ============================================================================ several processes (jax.distributed)
#: rollout's metrics key for a process that kept no chain: [chains dropped, the error line]; make_batch reads it
_CHAIN_ERROR = "_chain_error"


def _check_shares(cfg: TrainConfig) -> None:
    """Every process needs at least one task of a step, and of the held-out tasks when there are any."""
    processes = jax.process_count()
    if cfg.rl.tasks_per_step < processes:
        raise ConfigError(f"config.rl.tasks_per_step={cfg.rl.tasks_per_step} is less than the {processes} processes of "
                          "this run, which each roll out a share of a step's tasks: raise it to at least "
                          f"{processes}")
    if 0 < cfg.eval.num_tasks < processes:
        raise ConfigError(f"config.eval.num_tasks={cfg.eval.num_tasks} is less than the {processes} processes of this "
                          f"run, which each evaluate a share of the held-out tasks: raise it to at least {processes} "
                          "(or 0: no evaluation)")


def _data_parallel_size(mesh) -> int:
    """The data-parallel shards of `mesh`: its ("data", "fsdp") devices, over which packed rows are split."""
    return int(mesh.shape["data"] * mesh.shape["fsdp"])


def _data_parallel_block(mesh) -> tuple[int, int, int]:
    """(the first data-parallel shard this process's devices hold, how many, all of them): packed rows are
    split over the mesh's ("data", "fsdp") shards, and each process fills the rows of its own shards. Refuses a
    mesh in which one shard spans devices of several processes (e.g. a tensor axis across hosts), or a process's
    shards are not one contiguous run."""
    names = list(mesh.axis_names)
    grid = np.moveaxis(np.asarray(mesh.devices), (names.index("data"), names.index("fsdp")), (0, 1))
    dp = grid.shape[0] * grid.shape[1]
    owners = [{d.process_index for d in shard.reshape(-1)} for shard in grid.reshape(dp, -1)]
    shared = [i for i, o in enumerate(owners) if len(o) > 1]
    if shared:
        raise ConfigError(f"the mesh {dict(mesh.shape)} puts devices of several processes on one data-parallel "
                          f"shard (shard {shared[0]}: processes {sorted(owners[shared[0]])}): with several processes "
                          "keep config.mesh.tensor within a host's devices")
    me = jax.process_index()
    mine = [i for i, o in enumerate(owners) if o == {me}]
    counts = {p: sum(o == {p} for o in owners) for p in range(jax.process_count())}
    if mine != list(range(mine[0], mine[0] + len(mine))) or len(set(counts.values())) != 1:
        raise ConfigError(f"the mesh {dict(mesh.shape)} gives the processes uneven or interleaved data-parallel "
                          f"shards ({counts} shards by process): give every host the same number of devices")
    return mine[0], len(mine), dp


def _fetch(tree):
    """jax.device_get, also for arrays replicated over several processes' devices (each process reads its own
    copy): the step's scalars."""
    if jax.process_count() == 1:
        return jax.device_get(tree)

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if not x.is_fully_replicated:
                raise ValueError(f"_fetch: an array of shape {x.shape} is split over processes: gather it instead")
            return np.asarray(x.addressable_data(0))
        return jax.device_get(x)

    return jax.tree.map(one, tree)


def _host_params(params):
    """The parameters whole on this host (numpy), one array at a time (jax.device_get with one process; with
    several, each sharded array is gathered over the processes: collective, every process calls it)."""
    if jax.process_count() == 1:
        return jax.device_get(params)
    from jax.experimental import multihost_utils

    return jax.tree.map(lambda x: multihost_utils.process_allgather(x, tiled=True)
                        if isinstance(x, jax.Array) and not x.is_fully_addressable else jax.device_get(x), params)


def _build_backend(cfg: TrainConfig, serving_model, params, workdir: str, **vision):
    """builders.build_backend; with several processes, each process's own: a JAX sampler on its local devices
    (builders.sampler_devices: one, or tensor_parallel of them), or its share of `vllm.urls` (launched servers: each
    process starts its own, process p > 0 under `<workdir>/processes/<p>`), fed the policy from the host."""
    if jax.process_count() == 1:
        return builders.build_backend(cfg, serving_model, params, workdir, **vision)
    params, me = _host_params(params), jax.process_index()
    if cfg.backend == "jax":
        return builders.build_backend(cfg, serving_model, params, workdir, **vision)
    vllm = cfg.vllm
    if not vllm.launch:
        urls = tuple(vllm.urls)[distributed.process_share(len(vllm.urls))]
        if not urls:
            raise ConfigError(f"config.vllm.urls names {len(vllm.urls)} servers for the {jax.process_count()} "
                              "processes of this run, which each sample on their own servers: give at least one "
                              "per process (or vllm.launch=True: each process starts its own)")
        cfg = dataclasses.replace(cfg, vllm=dataclasses.replace(vllm, urls=urls))
    own_dir = workdir if me == 0 else os.path.join(workdir, "processes", str(me))
    return builders.build_backend(cfg, serving_model, params, own_dir, **vision)


def _put_block(run: Run, block: UpdateBatch, index: int, blocks: int, **per_trajectory) -> UpdateBatch:
    """A process's packed block (rows [K, M, R / blocks, L], block `index` of every micro-batch's R rows) -> the
    global UpdateBatch: the rows sharded as `_put_batch` shards them, each process handing its devices rows of its
    own block; the per-trajectory arrays (`per_trajectory`: every process's, the same everywhere) replicated; the
    unpack_index computed on the devices from the global pack_index."""
    rows_sharding = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec(None, None, ("data", "fsdp")))
    replicated = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec())

    def rows(x):
        x = np.asarray(x)
        own = x.shape[2]
        shape = (*x.shape[:2], own * blocks, *x.shape[3:])

        def part(where):
            start, stop, _ = where[2].indices(shape[2])
            if not index * own <= start <= stop <= (index + 1) * own:
                raise ValueError(f"rows {start}:{stop} of this process's devices lie outside its block {index}")
            return x[(*where[:2], slice(start - index * own, stop - index * own), *where[3:])]

        return jax.make_array_from_callback(shape, rows_sharding, part)

    def whole(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, replicated, lambda where: x[where])

    packed = jax.tree.map(rows, block.rows)
    pack_index = rows(block.pack_index)
    num = len(per_trajectory["lengths"])
    unpack_index = jax.jit(unpack_index_from, static_argnums=(1, 2), out_shardings=replicated)(
        pack_index, num, int(block.unpack_index.shape[1]))
    return UpdateBatch(rows=packed, pack_index=pack_index, unpack_index=unpack_index,
                       **{k: whole(v) for k, v in per_trajectory.items()})


def _put_global(tree, shardings):
    """Host arrays that every process holds whole (the same everywhere) -> global arrays of `shardings`, each
    process handing its own devices their part."""
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda where: np.asarray(x)[where]),
                        tree, shardings)


#: How the processes' host scalars of a step combine: the largest (peaks, waits, per-process programs and
#: memory), a mean weighted by the key named (per-call or per-chain means), else the sum (counts).
_LARGEST = ("_peak", "wall_time_s", "dynamic_sampling/rounds")
_LARGEST_PREFIXES = ("sampler/compiles", "memory/", "async/")
_MEAN_WEIGHTS = {"rollout/generation_latency_s_mean": "rollout/generation_calls",
                 "rollout/tool_latency_s_mean": "rollout/tool_calls",
                 "sampler/prefix_reused_fraction": "sampler/prompt_tokens"}


def combine_process_metrics(per_process: list[dict]) -> dict:
    """One step's host scalars of every process (the agents' counters, dynamic sampling, async, engine) as the
    run's: sums of counts, the largest of peaks and waits, means weighted by what they average over (calls, else
    chains: `rollout/chains`)."""
    out = {}
    keys = list(dict.fromkeys(k for metrics in per_process for k in metrics))
    for key in keys:
        present = [m for m in per_process if key in m]
        values = [float(m[key]) for m in present]
        if key.endswith(_LARGEST) or key.startswith(_LARGEST_PREFIXES):
            out[key] = max(values)
        elif "mean" in key or "per_chain" in key or key in _MEAN_WEIGHTS:
            weights = [float(m.get(_MEAN_WEIGHTS.get(key, "rollout/chains"), 1.0)) for m in present]
            out[key] = (sum(w * v for w, v in zip(weights, values)) / sum(weights) if sum(weights)
                        else sum(values) / len(values))
        else:
            out[key] = sum(values)
    return out


def _process_metrics(run: Run, trajectories, sampled, sampling_metrics: dict, async_metrics: dict,
                     t_rollout: float):
    """The step's host scalars over every process (one exchange): (sampling metrics with the rollout's trajectory
    scalars, async metrics, tokens trained, tokens sampled, rollout seconds (the slowest process's))."""
    mine = {"sampling": sampling_metrics, "async": async_metrics, "engine": _engine_metrics(run),
            "values": _trajectory_values(sampled), "tokens": float(sum(t.length for t in trajectories)),
            "t_rollout": t_rollout}
    every = distributed.allgather_json(mine)
    values = {key: [v for own in every for v in own["values"][key]] for key in mine["values"]}
    engine = combine_process_metrics([own["engine"] for own in every])
    sampling = {**combine_process_metrics([own["sampling"] for own in every]),
                **_trajectory_metrics(run, values, engine)}
    return (sampling, combine_process_metrics([own["async"] for own in every]),
            sum(own["tokens"] for own in every), float(sum(values["length"])), max(own["t_rollout"] for own in every))
