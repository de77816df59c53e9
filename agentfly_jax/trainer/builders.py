"""Typed config (+ the environment spec) -> objects: tokenizer, tasks, demonstrations, policy/critic, mesh,
generation backend, agent and environment pools.

Every number comes from the config; these functions only wire. The environment is a plugin
(`agentfly_jax.envs.spec`): its spec brings task rows, tools, reward, pools, prompt and demonstrations;
the config's `agent.tools` / `agent.reward` / `envs` (import paths, for a user's own code) override or extend it.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import logging
import os
import random
import traceback
from typing import Any

import jax
import jax.numpy as jnp

from agentfly_jax.envs.manager import PoolConfig, ResourceManager
from agentfly_jax.envs.spec import EnvSpec, load_env_spec
from agentfly_jax.rewards.decorator import REWARD_REGISTRY, Reward
from agentfly_jax.tools.decorator import TOOL_REGISTRY, Tool
from agentfly_jax.models import (CausalLM, ModelConfig, Qwen2_5_VLCausalLM, ValueModel, VisionConfig, init_params,
                                 load_pretrained, lora, save_pretrained)
from agentfly_jax.models import sharding as shd
from agentfly_jax.trainer.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ environment
@dataclasses.dataclass
class TaskSetup:
    """What the agent is trained on: the environment's spec (None for a task from files) and the resolved
    tools, reward and pools."""

    spec: EnvSpec | None
    tools: list
    reward: Any
    pools: dict[str, dict]
    success_threshold: float
    agent_class: type


def build_task_setup(cfg: TrainConfig) -> TaskSetup:
    """The environment plugin named by `config.env`, or a user's task from files; tools and reward given as
    import paths in `config.agent` replace the spec's, pools in `config.envs` extend (or override) its pools."""
    try:
        spec = load_env_spec(cfg.env.name, cfg.env.options) if cfg.env.name else None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.env: {e}") from None
    if cfg.agent.tools:
        tools = [_resolve_named(t, "config.agent.tools", Tool) for t in cfg.agent.tools]
        seen: dict[str, tuple[str, Tool]] = {}
        for entry, t in zip(cfg.agent.tools, tools):
            other, first = seen.setdefault(t.name, (entry, t))
            if (first.func, first._instance) != (t.func, t._instance):
                raise ConfigError(f"config.agent.tools: {other!r} and {entry!r} are both named {t.name!r}; the "
                                  "model calls tools by name: give one of them @tool(name=...)")
    else:
        tools = list(spec.tools if spec else [])
    reward = _resolve_named(cfg.agent.reward, "config.agent.reward", Reward) if cfg.agent.reward else spec.reward
    pools = dict(spec.pools if spec else {})
    for name, pool in cfg.envs.items():
        if not isinstance(pool, dict):
            raise ConfigError(f"config.envs.{name}: expected a pool config (factory, kwargs, max_size, ...), "
                              f"got {pool!r}")
        base = pools.get(name, {})  # a plugin's pool: override its fields, and its kwargs key by key
        pools[name] = {**base, **pool, "kwargs": {**base.get("kwargs", {}), **pool.get("kwargs", {})}}
    for name, pool in pools.items():  # fail now, not when the first chain asks for an instance
        try:
            PoolConfig(**pool)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.envs.{name}: {e}") from None
    # Every pool a stateful tool or an environment-backed reward names must exist, or each call would fail.
    users = [(f"tool '{t.name}'", t.pool) for t in tools if isinstance(t, Tool) and t.stateful]
    if isinstance(reward, Reward) and reward.needs_env:
        users.append((f"reward '{reward.name}'", reward.pool))
    for who, pool in users:
        if pool not in pools:
            raise ConfigError(f"{who} uses environment pool {pool!r} but the run has pools {sorted(pools)}: add "
                              f"config.envs.{pool} (factory, kwargs, max_size, ...) or fix the tool's pool name")
    threshold = cfg.agent.success_threshold
    if threshold is None:
        threshold = spec.success_threshold if spec else 1.0
    kind = cfg.agent.type or (spec.agent if spec else "tool_calling")
    where = "config.agent.type" if cfg.agent.type else f"environment {spec.name!r}'s agent" if spec else "agent"
    return TaskSetup(spec=spec, tools=tools, reward=reward, pools=pools, success_threshold=threshold,
                     agent_class=agent_class(kind, where))


def _import_path(path: str, where: str, what: str):
    """The object at import path 'package.module:name'; a ConfigError starting with `where` otherwise."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name != e.name and not module_name.startswith(e.name + "."):
            raise ConfigError(f"{where}: importing {module_name} needs the module {e.name!r}, which is not "
                              "installed") from None
        raise ConfigError(f"{where} cannot be imported ({e}); expected 'package.module:{what}'") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: say where, in one line
        raise ConfigError(f"{where}: importing {module_name} failed: {type(e).__name__}: {e}"
                          f"{_user_frame(e)}") from None
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ConfigError(f"{where} cannot be imported ({e}); expected 'package.module:{what}'") from None


def _user_frame(error: BaseException) -> str:
    """' (file:line)' of the innermost frame of the error's traceback outside this package and the standard
    library: the line of the user's code that raised it."""
    import agentfly_jax

    own = os.path.dirname(os.path.abspath(agentfly_jax.__file__))
    stdlib = os.path.dirname(os.path.abspath(os.__file__))
    where = ""
    if isinstance(error, SyntaxError) and error.filename:
        return f" ({error.filename}:{error.lineno})"
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((own, stdlib)) and not path.startswith("<"):
            where = f" ({path}:{lineno})"
    return where


def _resolve_named(name: str, key: str, kind: type):
    """A tool or reward given as an import path ("package.module:name") is imported and must be a `kind`
    (@tool / @reward object); a plain name is looked up in the registries."""
    if ":" in name:
        obj = _import_path(name, f"{key}: {name!r}", "name")
    else:
        registry = TOOL_REGISTRY if kind is Tool else REWARD_REGISTRY
        if name not in registry:
            raise ConfigError(f"{key}: no {kind.__name__.lower()} named {name!r} is registered (registered: "
                              f"{', '.join(sorted(registry))}); give an import path 'package.module:name'")
        obj = registry[name]
    if not isinstance(obj, kind):
        decorator = "@tool" if kind is Tool else "@reward"
        raise ConfigError(f"{key}: {name!r} is {type(obj).__name__}, not a {decorator} function; decorate it "
                          f"with agentfly_jax.{'tools' if kind is Tool else 'rewards'}.{decorator[1:]}")
    return obj


def build_tasks(cfg: TrainConfig, setup: TaskSetup) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): the spec's splits, or the user's JSON/JSONL files."""
    task = cfg.task
    if setup.spec is not None:
        try:
            train = setup.spec.split_tasks("train", task.num_train, cfg.seed)
            heldout = setup.spec.split_tasks(task.eval_split, task.num_eval, cfg.seed) if task.num_eval else []
        except ValueError as e:  # e.g. more held-out rows than the split has, an unknown split
            raise ConfigError(f"config.task: {e}") from None
        return train, heldout
    from agentfly_jax.rollout.data import load_tasks

    try:
        train = load_tasks(task.train_path, reward=setup.reward, limit=task.num_train or None)
        # a held-out file is read (and checked) even when no row of it is used (num_eval=0)
        heldout = load_tasks(task.eval_path, reward=setup.reward) if task.eval_path else []
    except ValueError as e:  # malformed rows, or a reward field the rows lack: the message names file:line
        raise ConfigError(f"config.task: {e}") from None
    for key, path, rows, wanted in (("num_train", task.train_path, train, task.num_train),
                                    ("num_eval", task.eval_path, heldout, task.num_eval)):
        if wanted and len(rows) < wanted:
            log.warning("config.task.%s=%d but %s has %d rows: using those %d", key, wanted, path, len(rows),
                        len(rows))
    return train, heldout[:task.num_eval]


def read_sft_conversations(path: str) -> list[list[dict]]:
    """The conversations of a JSONL file of {"messages": [{"role": ..., "content": ...}, ...]} rows; a ConfigError
    naming the file and line for anything unreadable, and when no row has an assistant message to learn from (rows
    without one are left out, with a warning)."""
    where = f"config.sft.data_path={path!r}"
    try:
        with open(path, "rb") as fh:
            raw = fh.read().splitlines()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror or e})") from None
    conversations, silent = [], []
    for number, data in enumerate(raw, start=1):
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}:{number}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}: invalid JSON: {e.msg} (column {e.colno})") from None
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{path}:{number}: expected an object with a non-empty 'messages' list, got "
                              f"{type(row).__name__ if not isinstance(row, dict) else 'keys ' + str(sorted(row))}")
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ConfigError(f"{path}:{number}: message {k} must be an object with a string 'role' "
                                  f"(system, user, assistant or tool), got {m!r}"[:300])
            if m["role"] == "assistant" and not m.get("content") and not m.get("tool_calls"):
                raise ConfigError(f"{path}:{number}: message {k} is an assistant message with neither 'content' "
                                  "nor 'tool_calls': nothing to learn from it")
        if any(m["role"] == "assistant" for m in messages):
            conversations.append(messages)
        else:
            silent.append(number)
    if not conversations:
        raise ConfigError(f"{where}: no row has an assistant message (SFT learns the assistant's turns): "
                          f"{len(silent)} rows without one")
    if silent:
        log.warning("%s: %d rows have no assistant message and are left out (lines %s%s)", path, len(silent),
                    ", ".join(map(str, silent[:5])), ", ..." if len(silent) > 5 else "")
    return conversations


def sft_conversations(cfg: TrainConfig, setup: TaskSetup, train_tasks: list[dict],
                      tokenizer: Any = None) -> list[tuple[int, list]]:
    """[(steps, conversations)] for the SFT warm start.

    `sft.data_path` (JSONL of {"messages": [...]}) gives one stage of `sft.steps`; `sft.stages`
    ((steps, expert_fraction), ...) generate the environment's demonstrations per stage, e.g. first expert-only
    (learn the call format), then a mix in which the rest show the environment's weaker behaviour."""
    sft = cfg.sft
    if sft.data_path:
        return [(sft.steps, read_sft_conversations(sft.data_path))]
    stages = sft.stages
    if sft.steps:  # steps without data_path: one stage of the environment's demonstrations
        stages = ((sft.steps, 1.0 if sft.expert_fraction is None else sft.expert_fraction),)
    if not stages:
        return []
    if setup.spec is None or setup.spec.demonstrations is None:
        name = setup.spec.name if setup.spec else "a task from files"
        raise ConfigError(f"config.sft needs demonstrations but {name} has none: give config.sft.data_path "
                          "(JSONL of {'messages': [...]}) with config.sft.steps")
    demonstrations = setup.spec.demonstrations
    # demonstrations recorded by running scripted agents take the run's tokenizer and observation limit
    offered = {"tokenizer": tokenizer, "max_observation_chars": cfg.agent.max_observation_chars}
    accepted = inspect.signature(demonstrations).parameters
    extra = {k: v for k, v in offered.items() if k in accepted and v is not None}
    return [(int(steps), demonstrations(train_tasks, random.Random(cfg.seed + 7 + 1000 * i), float(fraction),
                                        **extra))
            for i, (steps, fraction) in enumerate(stages)]


# -------------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(cfg: TrainConfig, setup: TaskSetup, workdir: str):
    tok = cfg.tokenizer
    if tok.path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tok.path)
    if tok.kind == "env":
        if setup.spec is None or setup.spec.tokenizer is None:
            raise ConfigError("config.tokenizer.kind='env' but the environment builds no tokenizer: set "
                              "config.tokenizer.path or kind='qwen2.5'")
        return setup.spec.tokenizer(os.path.join(workdir, "tokenizer"), cfg.seed)
    from agentfly_jax.rollout.tokenizers import build_qwen2_5_tokenizer  # kind == "qwen2.5", checked by the config

    return build_qwen2_5_tokenizer(os.path.join(workdir, "tokenizer"))


# ------------------------------------------------------------------------------------------------ models
def build_policy(cfg: TrainConfig, tokenizer) -> tuple[CausalLM | Qwen2_5_VLCausalLM, Any]:
    """The policy and its parameters: the checkpoint at `model.hf_path` (a Qwen2.5-VL checkpoint gives a
    `Qwen2_5_VLCausalLM`), or a random-initialised model of the config's shape (`model.family="qwen2_5_vl"`: a
    vision-language one, its special token ids the tokenizer's)."""
    m = dataclasses.asdict(cfg.model)
    hf_path = m.pop("hf_path")
    dtype = m.pop("dtype")
    param_dtype = m.pop("param_dtype") or dtype
    vision, mrope_section = m.pop("vision"), m.pop("mrope_section")
    m.pop("gpu_gemm")  # how the update steps compile (trainer/update.py), not part of the model
    overrides = {k: m.pop(k) for k in ("remat", "layer_row_splits", "attention_impl", "attention_segments",
                                       "lora_rank", "lora_alpha", "lora_targets")}
    if hf_path:
        model, params = load_pretrained(hf_path, dtype=dtype, param_dtype=param_dtype, **overrides)
        if model.config.vocab_size < len(tokenizer):
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the checkpoint's vocabulary "
                              f"{model.config.vocab_size}: use the checkpoint's own tokenizer")
        if model.config.vision is not None:
            _check_vision_tokens(model.config.vision, tokenizer, hf_path)
        if model.config.lora_rank:  # the checkpoint is the frozen base: fresh adapters beside it
            params = lora.lora_init_fn(model)(params, jax.random.PRNGKey(cfg.seed + 17))
        return model, params
    if m["vocab_size"] and m["vocab_size"] < len(tokenizer):
        raise ConfigError(f"config.model.vocab_size={m['vocab_size']} but the tokenizer has {len(tokenizer)} tokens: "
                          "raise it, or leave it unset (None: the tokenizer's size)")
    m["vocab_size"] = m["vocab_size"] or len(tokenizer)
    if m["family"] != "qwen2_5_vl":
        model = CausalLM(ModelConfig(**m, dtype=dtype, param_dtype=param_dtype, **overrides))
        return model, init_params(model, jax.random.PRNGKey(cfg.seed))
    head_dim = m["hidden_size"] // m["num_heads"]
    vision_config = VisionConfig(**vision, out_hidden_size=m["hidden_size"], patch_size=14, temporal_patch_size=2,
                                 spatial_merge_size=2, **vision_token_ids(tokenizer))
    model = Qwen2_5_VLCausalLM(ModelConfig(**m, dtype=dtype, param_dtype=param_dtype, vision=vision_config,
                                           mrope_section=mrope_section or default_mrope_section(head_dim),
                                           **overrides))
    return model, init_params(model, jax.random.PRNGKey(cfg.seed))


#: The Qwen2-VL special tokens a vision-language policy's tokenizer holds, by VisionConfig field.
VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                 "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}


def vision_token_ids(tokenizer) -> dict[str, int]:
    """{VisionConfig field: id} of the tokenizer's Qwen2-VL special tokens; a ConfigError naming those it lacks."""
    getter = getattr(tokenizer, "get_added_vocab", None)
    added = dict(getter()) if getter else {}
    missing = [token for token in VISION_TOKENS.values() if token not in added]
    if missing:
        raise ConfigError(f"a vision-language policy (config.model.family='qwen2_5_vl') needs a tokenizer with the "
                          f"Qwen2-VL tokens, and this one lacks {', '.join(missing)}: use config.tokenizer.kind="
                          "'qwen2.5' or a Qwen2-VL / Qwen2.5-VL tokenizer (config.tokenizer.path)")
    return {field: int(added[token]) for field, token in VISION_TOKENS.items()}


def _check_vision_tokens(vision: VisionConfig, tokenizer, hf_path: str) -> None:
    """The checkpoint's image token must be the tokenizer's `<|image_pad|>` (the rollout expands that token)."""
    ids = vision_token_ids(tokenizer)
    if ids["image_token_id"] != vision.image_token_id:
        raise ConfigError(f"the checkpoint at {hf_path} reads images at token id {vision.image_token_id} but the "
                          f"tokenizer's <|image_pad|> is {ids['image_token_id']}: use the checkpoint's own tokenizer")


def default_mrope_section(head_dim: int) -> tuple[int, int, int]:
    """mRoPE's split of head_dim / 2 rotary frequencies into (temporal, height, width): a quarter temporal, the
    rest shared by height and width, as Qwen2.5-VL's (16, 24, 24) for head_dim 128."""
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return temporal + (half - temporal) % 2, height, height


def is_vision_language(model) -> bool:
    """Whether `model` takes images (a Qwen2.5-VL policy)."""
    return getattr(getattr(model, "config", None), "vision", None) is not None


def agent_image_settings(cfg: TrainConfig):
    """The image settings the agent prepares images with (`config.agent.min_pixels / max_pixels`, else the
    processor's defaults), as `BaseAgent` builds them."""
    from agentfly_jax.images import ImageSettings

    pixels = {"min_pixels": cfg.agent.min_pixels, "max_pixels": cfg.agent.max_pixels}
    return ImageSettings(**{k: v for k, v in pixels.items() if v is not None})


def check_vision_critic(policy, needs_critic: bool) -> None:
    """No critic beside a vision-language policy: the value model is a text model and would not see the images."""
    if needs_critic and is_vision_language(policy):
        raise ConfigError("the policy is a vision-language model (Qwen2.5-VL) and the algorithm trains a critic, "
                          "which would not see the images: use a critic-free algorithm (grpo, rloo, reinforce_pp, ...)")


def check_vision_agent(policy, agent) -> None:
    """A vision-language policy trains on the agent's images: the agent must cut them into the tower's patches."""
    if not is_vision_language(policy):
        return
    vision, settings = policy.config.vision, agent.image_settings
    tower = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
    agent_geometry = (settings.patch_size, settings.temporal_patch_size, settings.merge_size)
    if tower != agent_geometry:
        raise ConfigError(f"the policy's vision tower reads patches of (size, temporal, merge) {tower} but the agent "
                          f"cuts images into {agent_geometry}: images would not match the tower's input")


def serving_view(policy: CausalLM):
    """(model, params -> params) for everything outside training (the sampler, vLLM weight sync, export, the
    critic's trunk): a LoRA policy is served as the plain model with its adapters merged into the kernels."""
    if not policy.config.lora_rank:
        return policy, lambda params: params
    scale = policy.config.lora_scale
    return type(policy)(policy.config.replace(lora_rank=0)), jax.jit(lambda params: lora.merge_lora(params, scale))


def critic_from_policy(policy: CausalLM, policy_params) -> tuple[ValueModel, Any]:
    """A value model with the policy's trunk (copied; a LoRA policy's merged) and a zero-initialised head; the
    critic trains all of its parameters."""
    plain, serve = serving_view(policy)
    critic = ValueModel(plain.config)
    head = init_params(critic, jax.random.PRNGKey(0))["value_head"]
    return critic, {"model": jax.tree.map(jnp.copy, serve(policy_params)["model"]), "value_head": head}


# -------------------------------------------------------------------------------------------------- mesh
def build_mesh(cfg: TrainConfig):
    """The training mesh: every device, or every device but the sampler's (`jax_sampler.separate_device`)."""
    try:
        return shd.make_mesh(dataclasses.asdict(cfg.mesh), devices=trainer_devices(cfg))
    except ValueError as e:
        raise ConfigError(f"config.mesh: {e}") from None


def trainer_devices(cfg: TrainConfig) -> list:
    """Every device, or (`jax_sampler.separate_device`) all but the sampler's last `jax_sampler.tensor_parallel`."""
    devices = jax.devices()
    if not cfg.jax_sampler.separate_device:
        return devices
    if jax.process_count() > 1:
        raise ConfigError("config.jax_sampler.separate_device=True runs in one process only (the sampler takes the "
                          f"last device); this run has {jax.process_count()} processes: unset it")
    tp = cfg.jax_sampler.tensor_parallel
    if len(devices) < tp + 1:
        raise ConfigError(f"config.jax_sampler.separate_device=True with tensor_parallel={tp} needs at least {tp + 1} "
                          f"devices (the sampler's {tp} and one to train on); this process has {len(devices)} "
                          f"({devices[0].platform}): unset separate_device or lower tensor_parallel")
    return devices[:-tp]


def sampler_devices(cfg: TrainConfig) -> list:
    """The JAX sampler's `jax_sampler.tensor_parallel` devices, this process's own (with several processes each
    samples on its own): the last ones when kept apart from the training mesh (separate_device), else the first."""
    local, tp = jax.local_devices(), cfg.jax_sampler.tensor_parallel
    if tp > len(local):
        raise ConfigError(f"config.jax_sampler.tensor_parallel={tp} needs {tp} devices for the sampler; this process "
                          f"has {len(local)} ({local[0].platform}): lower it to at most {len(local)}")
    return local[-tp:] if cfg.jax_sampler.separate_device else local[:tp]


def sampler_placement(cfg: TrainConfig) -> dict:
    """JaxSampler's placement options: `device` (tensor_parallel=1), or a 1-D "tensor" `mesh` over its devices."""
    devices = sampler_devices(cfg)
    if len(devices) == 1:
        return {"device": devices[0]}
    return {"mesh": shd.make_mesh({"tensor": len(devices)}, devices)}


def sharding_rules(cfg: TrainConfig):
    """The model's default logical axis rules with the config's `sharding_rules` replacing them by name."""
    return shd.override_rules(cfg.sharding_rules)


# ----------------------------------------------------------------------------------- backend and agent
def probe_vllm_servers(urls, timeout: float = 5.0) -> None:
    """ConfigError naming every server of `config.vllm.urls` that does not answer GET /health: found at start,
    not after the SFT warm start and the first evaluation."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # as the backend: no proxy variables
    failures = []
    for url in urls:
        try:
            with opener.open(f"{url.rstrip('/')}/health", timeout=timeout) as answer:
                if answer.status != 200:
                    failures.append(f"{url} (HTTP {answer.status})")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            failures.append(f"{url} ({getattr(exc, 'reason', exc)})")
    if failures:
        raise ConfigError(f"config.vllm.urls: {len(failures)} of {len(urls)} vLLM servers do not answer GET /health: "
                          f"{'; '.join(failures)}; start them (scripts/start_vllm.sh) or set config.vllm.launch=True")


def build_backend(cfg: TrainConfig, model, params, workdir: str | None = None, tokenizer=None):
    """The rollout backend. With `backend="vllm"` and `vllm.launch=True`, the trainer starts
    `vllm.num_servers` local servers itself: the initial policy is written to `<workdir>/vllm_model` (the servers
    need a checkpoint of the policy's shape; the trained weights reach them by weight sync), the servers start in
    the background (about a minute each on a CPU, during the SFT warm start; the backend's first request waits for
    them and raises their start's error) and are stopped when the backend closes. A vision-language policy's
    directory also gets `tokenizer` and the image processor's settings (`preprocessor_config.json`, the agent's
    min/max pixels): vLLM's image processing needs both."""
    if cfg.backend == "jax":
        from agentfly_jax.rollout.backends import JaxSampler

        # the sampler keeps its weights in the compute dtype (bf16 under mixed precision: half the memory
        # traffic per decoded token); each weight sync casts the trained fp32 parameters to it
        compute = jnp.dtype(model.config.dtype)
        served = jax.tree.map(lambda x: x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
        options = dataclasses.asdict(cfg.jax_sampler)
        del options["separate_device"], options["tensor_parallel"]  # where it runs: sampler_placement
        options["max_len"] = options["max_len"] or cfg.agent.max_context_tokens  # what a chain can grow to
        options["fuse_projections"] = {"on": True, "off": False}.get(options["fuse_projections"], "auto")
        return JaxSampler(model, served, seed=cfg.seed, **sampler_placement(cfg), **options)
    from agentfly_jax.rollout.backends import LocalVLLMServers, VLLMBackend

    v = cfg.vllm
    urls = list(v.urls)
    server_args = list(v.server_args)
    if not any(a.split("=")[0] == "--max-model-len" for a in server_args):  # room for prompt + completion
        server_args += ["--max-model-len", str(cfg.agent.max_context_tokens + cfg.agent.max_new_tokens)]
    servers = None
    if v.launch:
        if workdir is None:
            raise ConfigError("config.vllm.launch=True needs a workdir for the served checkpoint")
        model_dir = os.path.join(workdir, "vllm_model")
        save_pretrained(model, jax.device_get(params), model_dir)
        if is_vision_language(model):
            if tokenizer is None:
                raise ValueError("serving a vision-language policy on launched vLLM servers needs its tokenizer: "
                                 "pass tokenizer= to build_backend")
            from agentfly_jax.trainer.export import write_preprocessor_config

            tokenizer.save_pretrained(model_dir)
            write_preprocessor_config(model_dir, agent_image_settings(cfg))
        servers = LocalVLLMServers(model_dir, v.num_servers, extra_args=server_args,
                                   run_dir=os.path.join(workdir, "vllm"))
        urls = servers.start(wait=False)  # they start while the run sets up and warm-starts; the first request waits
    return VLLMBackend(urls, model, owned_servers=servers, weight_sync=v.weight_sync, weight_dir=v.weight_dir or None,
                       served_model_name=v.served_model_name, request_timeout=v.request_timeout,
                       update_timeout=v.update_timeout, max_retries=v.max_retries)


AGENT_TYPES = {"tool_calling": "ToolCallingAgent", "react": "ReactAgent", "code": "CodeAgent"}


def agent_class(kind: str, where: str = "config.agent.type"):
    """The agent class of `kind`: a built-in type name or an import path 'package.module:AgentClass'."""
    from agentfly_jax.rollout import agents

    if ":" in kind:
        cls = _import_path(kind, f"{where}={kind!r}", "AgentClass")
        if not (isinstance(cls, type) and issubclass(cls, agents.BaseAgent)):
            raise ConfigError(f"{where}={kind!r} is not a subclass of agentfly_jax.rollout.agents.BaseAgent")
        return cls
    if kind not in AGENT_TYPES:
        raise ConfigError(f"{where}={kind!r}; expected one of {sorted(AGENT_TYPES)} or an import path "
                          "'package.module:AgentClass'")
    return getattr(agents, AGENT_TYPES[kind])


def build_agent(cfg: TrainConfig, setup: TaskSetup, backend, tokenizer, env_provider=None):
    a = cfg.agent
    spec = setup.spec
    cls = setup.agent_class
    system_prompt = a.system_prompt if a.system_prompt is not None else ((spec.system_prompt if spec else "") or None)
    options = dict(max_turns=a.max_turns or (spec.max_turns if spec else 4),
                   max_observation_chars=a.max_observation_chars or (spec.max_observation_chars if spec else None),
                   max_new_tokens=a.max_new_tokens, max_context_tokens=a.max_context_tokens,
                   temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, parallel_tool_calls=a.parallel_tool_calls,
                   tool_timeout=a.tool_timeout, reward_timeout=a.reward_timeout, max_concurrency=a.max_concurrency,
                   stop_token_ids=a.stop_token_ids, min_pixels=a.min_pixels, max_pixels=a.max_pixels)
    return cls(backend, tokenizer, tools=setup.tools, reward_fn=setup.reward, chat_template=cfg.chat_template or None,
               system_prompt=system_prompt, env_provider=env_provider, **options)


def build_env_manager(setup: TaskSetup) -> ResourceManager | None:
    """A ResourceManager over the task's pools, or None when it has none (the trainer closes it at the end)."""
    return ResourceManager(setup.pools) if setup.pools else None
