"""Evaluate an agent on an environment's held-out tasks: success, mean reward, turns and tool errors.

    .venv/bin/python scripts/eval_env.py --env scienceworld --agent oracle --num 4
    .venv/bin/python scripts/eval_env.py --env code_interpreter --agent oracle --num 16
    .venv/bin/python scripts/eval_env.py --env alfworld --agent random --num 12 --seed 1 --json out.json \
        --option num_train_games=12 --option num_test_games=12     # a small suite (default: 240 + 60 games)
    .venv/bin/python scripts/eval_env.py --env my_package.my_env:env_spec --agent oracle --option size=3
    .venv/bin/python scripts/eval_env.py --env alfworld --agent model --backend jax --model runs/x/final_policy \
        --chat-template qwen2.5
    .venv/bin/python scripts/eval_env.py --env scienceworld --agent model --backend vllm \
        --model runs/x/final_policy --chat-template qwen2.5 --vllm-url http://127.0.0.1:8000

`--env NAME` loads the environment's EnvSpec with `agentfly_jax.envs.spec.load_env_spec(NAME, options)`: a
registered name (the `agentfly_jax.environments` entry points: arithmetic, code_interpreter, webshop, search,
alfworld, scienceworld; or `register_env`) or an import path `package.module:env_spec`; options come from
`--option k=v` (values parsed as JSON when they parse). The agent runs through the real rollout: tools on
pooled environments (ResourceManager), the environment's reward. `oracle` and `random` are scripted agents
(the environment's oracle and random policies, see environments/evaluation.py); `model` samples from a
checkpoint (embedded JAX sampler or a vLLM server) with the agent type the environment's prompt is written for
(`spec.agent`: tool_calling, react, code, or an import path `package.module:AgentClass`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runnable from a checkout

from agentfly_jax.envs.spec import EnvSpec, load_env_spec  # noqa: E402
from environments.evaluation import evaluate, scripted_agent  # noqa: E402


def parse_options(pairs: list[str]) -> dict:
    """["k=v", ...] -> {k: v} with JSON values where they parse (numbers, booleans, lists), else strings."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--option {pair!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def load_spec(name: str, options: dict) -> EnvSpec:
    """`load_env_spec(name, options)`, its errors (unknown environment, unknown option) as command-line errors."""
    try:
        return load_env_spec(name, options)
    except ValueError as error:
        raise SystemExit(f"--env {name!r}: {error}") from error


def agent_class(spec: EnvSpec):
    """The agent class `spec.agent` names: a built-in type or an import path 'package.module:AgentClass'."""
    from agentfly_jax.rollout import agents

    builtin = {"tool_calling": agents.ToolCallingAgent, "react": agents.ReactAgent, "code": agents.CodeAgent}
    if spec.agent in builtin:
        return builtin[spec.agent]
    module_name, _, attr = spec.agent.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise SystemExit(f"environment {spec.name!r} names agent {spec.agent!r}, which cannot be imported "
                         f"({error}); expected one of {sorted(builtin)} or 'package.module:AgentClass'") from error


# Model types whose tokenizers transformers may need to correct (its `fix_mistral_regex` check).
_MISTRAL_MODEL_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")


def _tokenizer_options(model_dir: str) -> dict:
    """transformers warns of a broken Mistral pre-tokenizer regex ("incorrect tokenization") for any local
    checkpoint whose config.json lacks `transformers_version`, as agentfly_jax's save_pretrained writes it. For a
    model type that is not Mistral's nothing is corrected either way, so the false warning is switched off."""
    with open(os.path.join(model_dir, "config.json")) as fh:
        config = json.load(fh)
    if "transformers_version" in config or config.get("model_type") in _MISTRAL_MODEL_TYPES:
        return {}
    return {"fix_mistral_regex": False}


def model_agent_factory(spec: EnvSpec, args):
    """The spec's agent type over a checkpoint (JAX sampler or vLLM server) for `evaluate`."""
    from transformers import AutoTokenizer

    from agentfly_jax.models import load_pretrained

    cls = agent_class(spec)

    if not args.model:
        raise SystemExit("--agent model needs --model PATH (a Hugging Face checkpoint directory)")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"--model {args.model!r}: no config.json there; expected a Hugging Face checkpoint "
                         "directory (e.g. a run's final_policy)")
    tokenizer = AutoTokenizer.from_pretrained(args.model, **_tokenizer_options(args.model))
    if not args.chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise SystemExit(f"the tokenizer in {args.model} has no chat template of its own (the trainer's offline "
                         "Qwen2.5 tokenizer has none): pass --chat-template qwen2.5 (or llama3), the template the "
                         "policy was trained with (config.chat_template)")
    model, params = load_pretrained(args.model)
    if args.backend == "jax":
        from agentfly_jax.rollout.backends import JaxSampler

        backend = JaxSampler(model, params, max_slots=max(1, args.num * args.chains), max_len=args.max_context)
    else:
        from agentfly_jax.rollout.backends import VLLMBackend

        if not args.vllm_url:
            raise SystemExit("--backend vllm needs --vllm-url http://HOST:PORT")
        backend = VLLMBackend(args.vllm_url, model)

    def make(manager):
        return cls(backend, tokenizer, tools=spec.tools, reward_fn=spec.reward,
                   chat_template=args.chat_template or None, system_prompt=spec.system_prompt,
                   env_provider=manager, max_turns=args.max_turns or spec.max_turns,
                   max_new_tokens=args.max_new_tokens, max_context_tokens=args.max_context,
                   temperature=args.temperature, max_observation_chars=spec.max_observation_chars)

    return make, backend


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", required=True,
                        help="a registered environment (e.g. alfworld) or an import path 'package.module:env_spec'")
    parser.add_argument("--agent", choices=("oracle", "random", "model"), default="oracle")
    parser.add_argument("--backend", choices=("jax", "vllm"), default="jax", help="for --agent model")
    parser.add_argument("--model", default="", help="HF checkpoint directory, for --agent model")
    parser.add_argument("--vllm-url", action="append", default=[], help="vLLM server URL (repeatable)")
    parser.add_argument("--chat-template", default="", help="'qwen2.5', 'llama3' or '' (the tokenizer's own)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--num", type=int, default=8, help="number of tasks")
    parser.add_argument("--chains", type=int, default=1, help="chains per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-turns", type=int, default=0, help="0: the environment's default")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--max-context", type=int, default=8192)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--pool-size", type=int, default=0, help="max instances per pool (0: the spec's)")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE passed to the env_spec() factory")
    parser.add_argument("--json", default="", help="write the full summary (with per-task rows) here")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    spec = load_spec(args.env, parse_options(args.option))
    policy = {"oracle": spec.oracle_policy, "random": spec.random_policy}.get(args.agent)
    if args.agent != "model" and policy is None:
        raise SystemExit(f"--agent {args.agent}: environment {spec.name!r} has no {args.agent} policy; "
                         "evaluate a checkpoint with --agent model instead")
    try:
        tasks = spec.split_tasks(args.split, args.num, args.seed)
    except ValueError as error:
        raise SystemExit(f"--split {args.split} --num {args.num}: {error}") from error
    backend = None
    if args.agent == "model":
        make_agent, backend = model_agent_factory(spec, args)
    else:
        overrides = {"max_turns": args.max_turns} if args.max_turns else {}

        def make_agent(manager):
            return scripted_agent(spec, args.agent, manager, seed=args.seed, **overrides)

    pool_overrides = {name: {"max_size": args.pool_size} for name in spec.pools} if args.pool_size else None

    async def run():
        from agentfly_jax.envs.sandbox import close_sandboxes

        try:
            return await evaluate(spec, make_agent, tasks, num_chains=args.chains, seed=args.seed,
                                  pool_overrides=pool_overrides, progress=args.progress)
        finally:
            if backend is not None:
                await backend.close()
            # Code sandboxes (a code_interpreter pool) finish their slot releases on this loop, before
            # asyncio.run closes it; nothing happens for environments without one.
            await close_sandboxes()

    summary = asyncio.run(run())
    summary.update(agent=args.agent, split=args.split, seed=args.seed)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2, default=str)
    headline = {k: summary[k] for k in ("env", "agent", "split", "tasks", "chains", "success", "reward_mean",
                                        "turns_mean", "tool_calls_mean", "tool_errors_total", "tool_latency_s_mean",
                                        "wall_s")}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in headline.items()}))
    return summary


if __name__ == "__main__":
    main()
