"""The RL trainer loop, top to bottom:

  setup → (resume | SFT warm start) → eval → for each step:
      rollout (agent + backend + tools + env pool) → rewards → advantages (estimator by name)
      → jitted update (policy, critic for PPO, reference for KL) → weight sync → metrics → checkpoint → eval

The async world (agents, backends, tools) runs on one asyncio event loop kept for the whole run; everything
else is plain Python around jitted functions. Numbers come from the experiment config.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
from agentfly_jax.models import save_pretrained
from agentfly_jax.models import sharding as shd
from agentfly_jax.rollout import encode_conversation, trajectories_to_batch
from agentfly_jax.trainer import builders
from agentfly_jax.trainer.batching import build_update_batch, choose_bucket, pack
from agentfly_jax.trainer.checkpoint import Checkpointer
from agentfly_jax.trainer.metrics import MetricWriter
from agentfly_jax.trainer.state import (OptimizerConfig, TrainState, create_train_state, init_model_state,
                                        learning_rate_schedule,
                                        make_optimizer, state_shardings)
from agentfly_jax.trainer.update import LossConfig, make_logprob_fn, make_sft_step, make_train_step, make_value_fn

log = logging.getLogger(__name__)

ALGORITHMS = {  # algorithm -> (advantage estimator, needs a critic)
    "grpo": ("grpo", False), "drgrpo": ("drgrpo", False), "rloo": ("rloo", False),
    "reinforce_pp": ("reinforce_pp", False), "ppo": ("gae", True),
}


_EVAL_KEYS = {"every", "num_tasks", "num_chains", "temperature", "top_p", "sampled_chains"}


@dataclasses.dataclass
class Run:
    """What the loop holds between steps (built once in `setup`)."""

    config: Any
    workdir: str
    tokenizer: Any
    train_tasks: list
    eval_tasks: list
    policy: Any
    critic: Any
    mesh: Any
    rules: Any
    state: TrainState
    shardings: TrainState
    policy_opt: Any
    critic_opt: Any
    train_step: Any
    logprob_fn: Any
    value_fn: Any
    backend: Any
    agent: Any
    writer: MetricWriter
    checkpointer: Checkpointer
    runner: asyncio.Runner
    success_threshold: float


# ================================================================================================ setup
def setup(config, workdir: str) -> Run:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as fh:
        json.dump(config.to_dict(), fh, indent=2, default=str)
    unknown_eval = sorted(set(config.eval.keys()) - _EVAL_KEYS)
    if unknown_eval:
        raise ValueError(f"unknown config.eval keys {unknown_eval}; known: {sorted(_EVAL_KEYS)} (greedy decoding "
                         "is temperature=0.0; plain temperature-1 sampling beside the headline is sampled_chains=N)")
    if config.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown config.algorithm {config.algorithm!r}; expected one of {sorted(ALGORITHMS)}")

    # --- Tokenizer, tasks, models -------------------------------------------------------------------
    tokenizer = builders.build_tokenizer(config, workdir)
    train_tasks, eval_tasks = builders.build_tasks(config)
    policy, policy_params = builders.build_policy(config, tokenizer)
    needs_critic = ALGORITHMS[config.algorithm][1]

    # --- Create optimizers & state; shard & transfer ----------------------------------------------
    mesh, rules = builders.build_mesh(config), builders.sharding_rules(config)
    policy_opt_cfg = OptimizerConfig.from_mapping(config.optimizer.to_dict())
    policy_opt = make_optimizer(policy_opt_cfg)
    critic, critic_params, critic_opt = None, None, None
    if needs_critic:
        critic, critic_params = builders.critic_from_policy(policy, policy_params)
        critic_opt = make_optimizer(OptimizerConfig.from_mapping(config.critic_optimizer.to_dict()))
    ref_params = jax.tree.map(jnp.copy, policy_params) if _uses_reference(config) else None
    state = create_train_state(policy_params, policy_opt, critic_params=critic_params, critic_opt=critic_opt,
                               ref_params=ref_params)
    shardings = state_shardings(state, mesh, policy_model=policy, policy_opt=policy_opt, critic_model=critic,
                                critic_opt=critic_opt, rules=rules)
    state = jax.device_put(state, shardings)

    loss_cfg = LossConfig.from_mapping({k: v for k, v in config.loss.to_dict().items() if k != "agg"})
    train_step = make_train_step(policy, loss_cfg, policy_opt, critic_model=critic, critic_opt=critic_opt,
                                 lr_schedule=learning_rate_schedule(policy_opt_cfg), state_sharding=shardings)

    # --- Generation backend & agent -------------------------------------------------------------------
    runner = asyncio.Runner()
    backend = builders.build_backend(config, policy, state.policy.params, workdir)
    try:
        agent = builders.build_agent(config, backend, tokenizer)
        writer = MetricWriter(os.path.join(workdir, "tensorboard"))
        checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every=config.checkpoint.every,
                                    keep=config.checkpoint.keep)
    except BaseException:  # launched vLLM servers must not outlive a failed setup
        runner.run(backend.close())
        runner.close()
        raise

    return Run(config=config, workdir=workdir, tokenizer=tokenizer, train_tasks=train_tasks, eval_tasks=eval_tasks,
               policy=policy, critic=critic, mesh=mesh, rules=rules, state=state, shardings=shardings,
               policy_opt=policy_opt, critic_opt=critic_opt, train_step=train_step,
               logprob_fn=make_logprob_fn(policy, temperature=loss_cfg.temperature, chunk=loss_cfg.logprob_chunk),
               value_fn=make_value_fn(critic) if critic is not None else None, backend=backend, agent=agent,
               writer=writer, checkpointer=checkpointer, runner=runner, success_threshold=config.agent.get("success_threshold", 1.0))


def _uses_reference(config) -> bool:
    return bool(config.loss.kl_coef) or bool(config.advantage.get("kl_coef", 0.0))


# ============================================================================================ SFT stage
def run_sft(run: Run) -> dict:
    """Supervised warm start on demonstrations (masked cross-entropy on the assistant tokens)."""
    cfg = run.config
    sft = cfg.sft
    template = cfg.get("chat_template") or None
    stages = [(steps, [encode_conversation(run.tokenizer, m, chat_template=template) for m in demos])
              for steps, demos in builders.sft_stages(cfg, run.train_tasks)]
    opt_cfg = OptimizerConfig.from_mapping(sft.optimizer.to_dict())
    optimizer = make_optimizer(opt_cfg)
    state = create_train_state(run.state.policy.params, optimizer)
    step_fn = make_sft_step(run.policy, LossConfig(logprob_chunk=cfg.loss.logprob_chunk), optimizer,
                            lr_schedule=learning_rate_schedule(opt_cfg))
    rng = np.random.default_rng(cfg.seed + 11)
    metrics, step = {}, 0
    bar = tqdm(total=sum(s for s, _ in stages), desc="sft", disable=not cfg.progress)
    for stage_steps, encoded in stages:
        for _ in range(stage_steps):
            idx = rng.choice(len(encoded), size=sft.batch_size, replace=False)
            arrays, lengths = _encoded_to_arrays([encoded[j] for j in idx], cfg.seq_buckets)
            micro, _ = build_update_batch(arrays, lengths, agg="token-mean", row_len=arrays["tokens"].shape[1],
                                          micro_batches=cfg.rl.micro_batches,
                                          rows_multiple=_rows_multiple(run) // cfg.rl.micro_batches)
            with _mesh_context(run):
                state, metrics = step_fn(state, _put_batch(run, micro))
            step += 1
            bar.update()
            if step % cfg.log_every == 0:
                run.writer.scalars(step, jax.device_get(metrics))
    bar.close()
    run.state = run.state.replace(policy=run.state.policy.replace(params=state.policy.params))
    if run.state.ref_params is not None:  # the KL reference is the warm-started policy
        run.state = run.state.replace(ref_params=jax.tree.map(jnp.copy, state.policy.params))
    if run.state.critic is not None:  # the critic's trunk starts from the warm-started policy too
        critic_params = {**run.state.critic.params, "model": jax.tree.map(jnp.copy, state.policy.params["model"])}
        run.state = run.state.replace(critic=init_model_state(critic_params, run.critic_opt))
    run.state = jax.device_put(run.state, run.shardings)
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def _encoded_to_arrays(encoded, buckets):
    lengths = np.array([len(e.token_ids) for e in encoded], np.int32)
    t = choose_bucket(int(lengths.max()), buckets)
    tokens = np.zeros((len(encoded), t), np.int32)
    mask = np.zeros((len(encoded), t), np.float32)
    for i, e in enumerate(encoded):
        tokens[i, :len(e.token_ids)] = e.token_ids
        mask[i, :len(e.action_mask)] = e.action_mask
    return {"tokens": tokens, "action_mask": mask}, lengths


# ========================================================================================== evaluation
def evaluate(run: Run, step: int) -> dict:
    """Success on held-out tasks: the headline pass decodes at (`eval.temperature`, `eval.top_p`; temperature 0
    is greedy) with `eval.num_chains` chains per task; `eval.sampled_chains` > 0 adds plain sampling at
    temperature 1 (the training distribution, logged as eval/*_sampled) with that many chains per task."""
    ev = run.config.eval
    tasks = run.eval_tasks[:ev.num_tasks]
    result = _eval_pass(run, step, tasks, ev.temperature, ev.get("top_p", 1.0), ev.num_chains, "")
    if ev.get("sampled_chains", 0):
        result.update(_eval_pass(run, step, tasks, 1.0, 1.0, ev.sampled_chains, "_sampled"))
    run.writer.scalars(step, result)
    return result


def _eval_pass(run: Run, step: int, tasks, temperature: float, top_p: float, num_chains: int, suffix: str) -> dict:
    agent = run.agent
    saved = agent.temperature, agent.top_p
    agent.temperature, agent.top_p = temperature, top_p
    try:
        trajs = run.runner.run(agent.run(tasks, num_chains=num_chains, seed=10_000_019 + step,
                                         progress=run.config.progress))
    finally:
        agent.temperature, agent.top_p = saved
    rewards = np.array([t.reward for t in trajs])
    sample = trajs[0]
    run.writer.text(step, f"eval/sample_trajectory{suffix}",
                    f"reward={sample.reward} finish={sample.finish_reason}\n\n"
                    + run.tokenizer.decode(sample.token_ids, skip_special_tokens=False))
    return {f"eval/success{suffix}": float((rewards >= run.success_threshold).mean()),
            f"eval/reward{suffix}": float(rewards.mean()),
            f"eval/turns{suffix}": float(np.mean([t.num_turns for t in trajs])),
            f"eval/tool_calls{suffix}": float(np.mean([t.tool_calls for t in trajs]))}


# ============================================================================================ RL step
def rollout(run: Run, step: int):
    cfg = run.config.rl
    order = np.random.default_rng(run.config.seed * 1_000_003 + step // max(1, len(run.train_tasks)))
    start = (step * cfg.tasks_per_step) % len(run.train_tasks)
    perm = order.permutation(len(run.train_tasks))
    tasks = [run.train_tasks[perm[(start + i) % len(perm)]] for i in range(cfg.tasks_per_step)]
    return run.runner.run(run.agent.run(tasks, num_chains=cfg.chains_per_task, seed=run.config.seed * 7919 + step,
                                        progress=run.config.progress))


def prepare_batch(run: Run, trajectories) -> tuple[dict, np.ndarray, dict]:
    """Trajectories -> per-trajectory arrays with old/ref logprobs, values and advantages (+ metrics)."""
    cfg = run.config
    t = choose_bucket(max(traj.length for traj in trajectories), cfg.seq_buckets)
    arrays = trajectories_to_batch(trajectories, pad_to=t)
    lengths = arrays["lengths"]
    per_token = {"tokens": arrays["tokens"], "action_mask": arrays["action_mask"],
                 "sampler_logprobs": arrays["sampler_logprobs"]}

    # Forward passes on packed rows: old logprobs (policy before this update), reference logprobs, values.
    packed = pack(per_token, lengths, row_len=t, rows_multiple=_rows_multiple(run))
    batch = _put_batch(run, packed.arrays)
    with _mesh_context(run):
        per_token["old_logprobs"] = packed.unpack(np.asarray(run.logprob_fn(run.state.policy.params, batch)), t)
        if run.state.ref_params is not None:
            per_token["ref_logprobs"] = packed.unpack(np.asarray(run.logprob_fn(run.state.ref_params, batch)), t)
        values = None
        if run.value_fn is not None:
            values = packed.unpack(np.asarray(run.value_fn(run.state.critic.params, batch)), t)
            per_token["old_values"] = values * per_token["action_mask"]

    estimator, _ = ALGORITHMS[cfg.algorithm]
    adv_cfg = cfg.advantage.to_dict()
    token_kl = None
    if "ref_logprobs" in per_token and adv_cfg.get("kl_coef"):
        token_kl = algorithms.kl_penalty(per_token["old_logprobs"], per_token["ref_logprobs"], "k1")
    estimator_cfg = {k: v for k, v in adv_cfg.items() if v is not None and _estimator_accepts(estimator, k)}
    advantages, returns = algorithms.compute_advantages(
        estimator, rewards=jnp.asarray(arrays["rewards"]), group_ids=jnp.asarray(arrays["group_ids"]),
        action_mask=jnp.asarray(per_token["action_mask"]), values=None if values is None else jnp.asarray(values),
        token_kl=token_kl, **estimator_cfg)
    per_token["advantages"] = np.asarray(advantages)
    if returns is not None:
        per_token["returns"] = np.asarray(returns)
    mask = per_token["action_mask"] > 0
    metrics = {"advantages/mean": float(per_token["advantages"][mask].mean()) if mask.any() else 0.0,
               "advantages/std": float(per_token["advantages"][mask].std()) if mask.any() else 0.0,
               "mismatch/sampler_vs_trainer_logprob_abs": float(np.abs(
                   per_token["old_logprobs"] - per_token["sampler_logprobs"])[mask].mean()) if mask.any() else 0.0}
    return per_token, lengths, metrics


_ESTIMATOR_KEYS = {"grpo": {"normalize_std", "eps"}, "drgrpo": {"eps"}, "rloo": set(),
                   "reinforce_pp": {"kl_coef"}, "gae": {"gamma", "lam", "kl_coef"}}


def _estimator_accepts(name: str, key: str) -> bool:
    return key in _ESTIMATOR_KEYS[name]


def update(run: Run, per_token: dict, lengths: np.ndarray, step: int) -> dict:
    """PPO-style epochs over shuffled mini-batches of trajectories; returns the last mini-batch's metrics."""
    cfg = run.config
    n = len(lengths)
    rng = np.random.default_rng(cfg.seed * 31 + step)
    row_len = per_token["tokens"].shape[1]
    metrics, tokens_trained = {}, 0
    for _ in range(cfg.rl.ppo_epochs):
        for mb in np.array_split(rng.permutation(n), cfg.rl.mini_batches):
            sub = {k: v[mb] for k, v in per_token.items()}
            micro, _ = build_update_batch(sub, lengths[mb], agg=cfg.loss.agg, row_len=row_len,
                                          micro_batches=cfg.rl.micro_batches,
                                          rows_multiple=_rows_multiple(run) // cfg.rl.micro_batches)
            with _mesh_context(run):
                run.state, metrics = run.train_step(run.state, _put_batch(run, micro))
            tokens_trained += int(lengths[mb].sum())
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}
    out["update/tokens"] = float(tokens_trained)
    return out


def sync_weights(run: Run, version: int) -> float:
    t0 = time.perf_counter()
    run.runner.run(run.backend.update_weights(run.state.policy.params, version))
    return time.perf_counter() - t0


def rollout_metrics(run: Run, trajectories) -> dict:
    rewards = np.array([t.reward for t in trajectories])
    stats = {f"rollout/{k}": v for k, v in run.agent.last_run_stats.items()}
    return {**stats, "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "success/rate": float((rewards >= run.success_threshold).mean()),
            "rollout/turns_mean": float(np.mean([t.num_turns for t in trajectories])),
            "rollout/tool_calls_mean": float(np.mean([t.tool_calls for t in trajectories])),
            "rollout/response_tokens_mean": float(np.mean([t.num_action_tokens for t in trajectories])),
            "rollout/reward_failures": float(sum("reward_failed" in t.flags for t in trajectories))}


# ============================================================================================== train
def train(config, workdir: str | None = None) -> dict:
    """Runs the experiment described by `config`; returns (and writes) `<workdir>/summary.json`."""
    workdir = workdir or config.workdir
    t_start = time.time()
    run = setup(config, workdir)
    try:
        # --- Load checkpoint (or warm start) --------------------------------------------------------
        start_step, sft_metrics = 0, {}
        restored = run.checkpointer.restore_latest(_checkpoint_tree(run)) if config.resume else None
        if restored is not None:
            start_step, tree, meta = restored
            run.state = jax.device_put(tree["state"], run.shardings)
            sync_weights(run, meta["weight_version"])
            log.info("resumed from step %d (%s)", start_step, run.checkpointer.directory)
            before = meta.get("eval_before") or {}
        else:
            if config.sft.steps or config.sft.get("stages"):
                sft_metrics = run_sft(run)
                sync_weights(run, 0)
            before = evaluate(run, 0) if config.eval.num_tasks else {}
            _save(run, 0, before, force=True)

        # --- RL loop --------------------------------------------------------------------------------
        bar = tqdm(range(start_step, config.rl.steps), desc=f"rl/{config.algorithm}", initial=start_step,
                   total=config.rl.steps, disable=not config.progress)
        for step in bar:
            t0 = time.perf_counter()
            trajectories = rollout(run, step)
            t_rollout = time.perf_counter() - t0

            t0 = time.perf_counter()
            per_token, lengths, batch_metrics = prepare_batch(run, trajectories)
            update_metrics = update(run, per_token, lengths, step)
            t_update = time.perf_counter() - t0

            t_sync = sync_weights(run, step + 1)
            metrics = {**rollout_metrics(run, trajectories), **batch_metrics, **update_metrics,
                       "time/rollout_s": t_rollout, "time/update_s": t_update, "time/weight_sync_s": t_sync,
                       "throughput/update_tokens_per_s": update_metrics["update/tokens"] / max(t_update, 1e-9),
                       "throughput/rollout_tokens_per_s": float(lengths.sum()) / max(t_rollout, 1e-9),
                       "policy_version": float(step + 1)}
            if (step + 1) % config.log_every == 0:
                run.writer.scalars(step + 1, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", kl=f"{metrics.get('policy/approx_kl', 0):.3f}")
            if config.eval.every and (step + 1) % config.eval.every == 0 and step + 1 < config.rl.steps:
                evaluate(run, step + 1)
            if run.checkpointer.should_save(step + 1):
                _save(run, step + 1, before)
            run.writer.flush()

        # --- Final eval, checkpoint, summary ----------------------------------------------------------
        after = evaluate(run, config.rl.steps) if config.eval.num_tasks else {}
        _save(run, config.rl.steps, before, force=True)
        # The trained policy in Hugging Face format (transformers and vLLM load it), with its tokenizer.
        final_dir = os.path.join(workdir, "final_policy")
        save_pretrained(run.policy, jax.device_get(run.state.policy.params), final_dir)
        run.tokenizer.save_pretrained(final_dir)
        summary = {"algorithm": config.algorithm, "success_before": before.get("eval/success"),
                   "success_after": after.get("eval/success"),
                   "success_before_sampled": before.get("eval/success_sampled"),
                   "success_after_sampled": after.get("eval/success_sampled"),
                   "eval_temperature": config.eval.temperature, "eval_top_p": config.eval.get("top_p", 1.0),
                   "steps": config.rl.steps, "wall_seconds": round(time.time() - t_start, 1),
                   "resumed_from": start_step if restored is not None else None, "sft": sft_metrics,
                   "backend": config.backend, "workdir": os.path.abspath(workdir), "final_policy": final_dir}
        with open(os.path.join(workdir, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=2)
        return summary
    finally:
        _close_run(run)


def _close_run(run: Run) -> None:
    """Closes everything the run holds; one failing close does not skip the others (launched vLLM servers and
    pooled environments would outlive the trainer). The first error is raised after all were tried."""
    steps = [run.writer.close, run.checkpointer.close, lambda: run.runner.run(run.backend.close())]
    if hasattr(run.agent.env_provider, "close"):  # the resource manager of config.envs
        steps.append(lambda: run.runner.run(run.agent.env_provider.close()))
    steps.append(run.runner.close)
    errors = []
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - collected and re-raised below
            log.error("closing the run: %s: %s", type(exc).__name__, exc)
            errors.append(exc)
    if errors:
        raise errors[0]


# ============================================================================================ helpers
def _checkpoint_tree(run: Run) -> dict:
    return {"state": run.state}


def _save(run: Run, step: int, eval_before: dict, force: bool = False) -> None:
    meta = {"step": step, "weight_version": step, "algorithm": run.config.algorithm,
            "eval_before": eval_before, "data_position": step * run.config.rl.tasks_per_step}
    run.checkpointer.save(step, _checkpoint_tree(run), meta, force=force)


def _data_parallel(run: Run) -> int:
    return int(run.mesh.shape["data"] * run.mesh.shape["fsdp"])


def _rows_multiple(run: Run) -> int:
    """Packed row counts are rounded up to this: a multiple of the data-parallel size x micro-batches and of
    `config.row_bucket` (few distinct shapes to compile, little padding)."""
    unit = _data_parallel(run) * run.config.rl.micro_batches
    return unit * max(1, -(-run.config.row_bucket // unit))


def _put_batch(run: Run, arrays: dict):
    """Host arrays -> device arrays, rows split over the data-parallel mesh axes."""
    out = {}
    for k, v in arrays.items():
        v = np.asarray(v)
        if v.ndim >= 2:
            lead = 1 if v.ndim == 3 else 0  # [M, R, L] micro-batches or [R, L] rows
            spec = [None] * v.ndim
            spec[lead] = ("data", "fsdp")
            out[k] = jax.device_put(v, jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec(*spec)))
        else:
            out[k] = jax.device_put(v, jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec()))
    return out


@contextlib.contextmanager
def _mesh_context(run: Run):
    """The run's mesh and logical axis rules, active while tracing/running jitted steps."""
    with jax.set_mesh(run.mesh), shd.axis_rules(run.rules):
        yield
