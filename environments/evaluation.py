"""Evaluating an agent on an environment's held-out tasks, through the real tool + reward + pool pipeline.

Every environment describes itself with an `agentfly_jax.envs.spec.EnvSpec` (its factory
`env_spec(**options)`, found by `load_env_spec(name, options)`; `scripts/eval_env.py --env NAME` relies on
it). What an evaluation reads from the spec:

- `split_tasks(split, num, seed)`: dataset rows of a split (`num <= 0`: all of it). Every row has a
  non-empty `question` plus the fields the environment's `reset(task)`, tools and reward read.
- `tools`, `reward`, `pools`: the @tool objects, the @reward scoring a finished chain and
  {pool name: ResourceManager pool config} for every pool they use.
- `oracle_policy(task, rng)` and `random_policy(task, rng)`: scripted policies (see below; None when the
  environment has none). The oracle must solve every task (success 1.0 is the check that tools,
  environment and reward agree); the random one is the floor.
- `system_prompt`, `max_turns`, `success_threshold`, `max_observation_chars`.

A scripted policy is a generator function `policy(task, rng)` that yields tool calls
`{"name": tool_name, "arguments": {...}}`, receives the observation text of each call back from `yield`
(`observation = yield call`), and returns the final answer text (or None for an empty one):

    def oracle(task, rng):
        observation = yield {"name": "search", "arguments": {"query": task["question"]}}
        return task["answer"]

`scripted_calls(calls, final_answer)` builds one from a fixed list of calls.

Scripted policies run as agents like any model does: `ScriptedAgent` (a ReactAgent, whatever `spec.agent`
says: the script only needs some parseable turn format) writes each call as a ReAct turn,
`ScriptedBackend` turns that text into "sampled" token ids, and the rollout parses the turn, runs the tool
on the chain's pooled environment, feeds the observation back and scores the chain with the reward —
exactly the path a model agent takes. Only the sampling is scripted.

`evaluate(spec, agent, tasks, ...)` runs any agent on tasks with a ResourceManager built from
`spec.pools` and summarises: success rate, mean reward, turns, tool calls and tool errors per chain, tool
latency and the pools' counters.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import random
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

from agentfly_jax.envs import ResourceManager
from agentfly_jax.envs.spec import EnvSpec, ScriptedPolicy
from agentfly_jax.rollout.agents.react import ReactAgent
from agentfly_jax.rollout.backends.base import Completion, GenerationBackend
from agentfly_jax.tools.execute import ToolResult


def scripted_calls(calls: Sequence[Mapping[str, Any]], final_answer: str | None = None) -> Generator:
    """A scripted policy's generator that makes `calls` in order (ignoring observations), then answers."""
    for call in calls:
        yield dict(call)
    return final_answer


# --------------------------------------------------------------------------------------------------
# Scripted agents: the policy is a program, everything else is the real rollout
# --------------------------------------------------------------------------------------------------


class _ChainScript:
    """One chain's scripted policy, its generator and the observation of the previous turn's calls."""

    def __init__(self, policy: ScriptedPolicy, task: Mapping[str, Any], rng: random.Random):
        self.generator = policy(dict(task), rng)
        if not inspect.isgenerator(self.generator):
            raise TypeError(
                f"a scripted policy must be a generator function (yield tool calls); "
                f"{getattr(policy, '__name__', policy)!r} returned {type(self.generator).__name__}"
            )
        self.started = False
        self.finished = False
        self.observation = ""
        self.final_answer: str | None = None

    def next_turn(self) -> dict | None:
        """The next tool call, or None once the policy has returned (its answer is in `final_answer`)."""
        if self.finished:
            return None
        try:
            if not self.started:
                self.started = True
                call = next(self.generator)
            else:
                call = self.generator.send(self.observation)
        except StopIteration as stop:
            self.finished = True
            self.final_answer = stop.value
            return None
        if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
            raise TypeError(f'a scripted policy must yield {{"name": ..., "arguments": {{...}}}}, got {call!r}')
        return {"name": call["name"], "arguments": dict(call.get("arguments") or {})}


# The calling chain's script. Every chain runs in its own asyncio task, which has its own copy of the context:
# ScriptedAgent.build_messages (run at the start of the chain, inside its task) sets it, and the backend's
# generate and the agent's observation_messages (later in the same task) read it.
_CHAIN_SCRIPT: contextvars.ContextVar[_ChainScript | None] = contextvars.ContextVar("chain_script", default=None)


def render_react_turn(call: dict | None, final_answer: str | None, step: int) -> str:
    """The ReAct text of one scripted turn: a tool call, or the final answer."""
    if call is None:
        return f"Thought: I am done.\nFinal Answer: {final_answer or ''}"
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    return f"Thought: step {step}.\nAction: {call['name']}\nAction Input: {arguments}"


class ScriptedBackend(GenerationBackend):
    """A generation backend whose "samples" are the calling chain's scripted turns, tokenised.

    Works with `ScriptedAgent` only (it sets up each chain's script). Every sampled token gets logprob 0
    (the script is deterministic); a turn longer than `max_tokens` is cut there (finish_reason "length").
    Takes prompts with images (`supports_images`) and ignores them: a script decides from its task row.
    """

    supports_images = True

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.turns = 0

    async def generate(self, prompt_token_ids, *, max_tokens, temperature=1.0, top_p=1.0, top_k=-1,
                       stop_token_ids=(), n=1, seed=None, images=()) -> list[Completion]:
        script = _CHAIN_SCRIPT.get()
        if script is None:
            raise RuntimeError(
                "ScriptedBackend.generate was called outside a ScriptedAgent chain; build the agent with "
                "ScriptedAgent(policy, ...) so each chain has its script"
            )
        completions = []
        for _ in range(n):
            call = script.next_turn()
            self.turns += 1
            text = render_react_turn(call, script.final_answer, self.turns)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            if len(ids) >= max_tokens:
                completions.append(Completion(ids[:max_tokens], [0.0] * max_tokens, "length"))
                continue
            ids.append(int(stop_token_ids[0]))
            completions.append(Completion(ids, [0.0] * len(ids), "stop", self.weight_version))
        return completions

    async def update_weights(self, params: Any, version: int, *, interrupt: bool = False) -> None:
        raise NotImplementedError("a scripted policy has no weights to update")


class ScriptedAgent(ReactAgent):
    """A ReAct agent whose turns come from a scripted policy (oracle, random, ...) instead of a model.

    Give it a ScriptedBackend; `policy(task, rng)` is a generator function (see the module docstring).
    `seed` makes the per-chain random generators reproducible: chain j of task i gets Random(f"{seed}/{i}/{j}").
    """

    def __init__(self, policy: ScriptedPolicy, backend: ScriptedBackend, tokenizer: Any, *, seed: int = 0,
                 **kwargs: Any):
        if not isinstance(backend, ScriptedBackend):
            raise TypeError(f"ScriptedAgent needs a ScriptedBackend, got {type(backend).__name__}")
        super().__init__(backend, tokenizer, **kwargs)
        self.policy = policy
        self.seed = seed
        self._chains_started = 0

    def _chain_rng(self) -> random.Random:
        # Chains run as tasks named "<run id>/<task index>/<chain index>" (agentfly_jax.rollout.chain).
        task = asyncio.current_task()
        parts = task.get_name().split("/") if task is not None else []
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            return random.Random(f"{self.seed}/{parts[1]}/{parts[2]}")
        self._chains_started += 1
        return random.Random(f"{self.seed}/chain{self._chains_started}")

    def build_messages(self, task: Mapping[str, Any]) -> list[dict]:
        """The ReAct prompt; also starts this chain's script (see `_CHAIN_SCRIPT`)."""
        _CHAIN_SCRIPT.set(_ChainScript(self.policy, task, self._chain_rng()))
        return super().build_messages(task)

    def observation_messages(self, results: Sequence[ToolResult]) -> list[dict]:
        """The ReAct observation message; the script sees the same observation text."""
        script = _CHAIN_SCRIPT.get()
        if script is not None:
            script.observation = "\n".join(result.observation for result in results)
        return super().observation_messages(results)


def scripted_tokenizer():
    """The tokenizer scripted agents encode their turns with: the offline Qwen2.5 tokenizer."""
    from agentfly_jax.rollout.tokenizers import build_qwen2_5_tokenizer

    return build_qwen2_5_tokenizer()


def scripted_agent(spec: EnvSpec, which: str, env_provider: Any, *, tokenizer: Any = None, seed: int = 0,
                   **agent_options: Any) -> ScriptedAgent:
    """The oracle or random agent of `spec` (which: "oracle" | "random"), wired to `env_provider`."""
    policies = {"oracle": spec.oracle_policy, "random": spec.random_policy}
    if which not in policies:
        raise ValueError(f"unknown scripted agent {which!r}; expected one of {sorted(policies)}")
    if policies[which] is None:
        raise ValueError(f"environment {spec.name!r} has no {which} policy (its EnvSpec.{which}_policy is None); "
                         f"evaluate a model agent instead, or give the spec a {which}_policy")
    tokenizer = tokenizer if tokenizer is not None else scripted_tokenizer()
    options = dict(
        tools=spec.tools,
        reward_fn=spec.reward,
        chat_template="qwen2.5",
        system_prompt=spec.system_prompt,
        env_provider=env_provider,
        max_turns=spec.max_turns,
        max_new_tokens=2048,
        max_context_tokens=1_000_000,
        max_observation_chars=spec.max_observation_chars,
        parallel_tool_calls=False,
    )
    options.update(agent_options)
    return ScriptedAgent(policies[which], ScriptedBackend(tokenizer), tokenizer, seed=seed, **options)


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


def summarize(trajectories: Sequence[Any], success_threshold: float) -> dict[str, Any]:
    """Success rate, mean reward, turns, tool calls and tool errors over finished chains (pure)."""
    n = len(trajectories)
    if n == 0:
        raise ValueError("no trajectories to summarise")
    rewards = [float(t.reward) for t in trajectories]
    tool_errors = [int(t.metrics.get("tool_errors", 0)) for t in trajectories]
    finish: dict[str, int] = {}
    for t in trajectories:
        finish[t.finish_reason] = finish.get(t.finish_reason, 0) + 1
    return {
        "chains": n,
        "success": sum(r >= success_threshold for r in rewards) / n,
        "reward_mean": sum(rewards) / n,
        "turns_mean": sum(t.num_turns for t in trajectories) / n,
        "tool_calls_mean": sum(t.tool_calls for t in trajectories) / n,
        "tool_errors_total": sum(tool_errors),
        "tool_errors_mean": sum(tool_errors) / n,
        "reward_failures": sum("reward_failed" in t.flags for t in trajectories),
        "chain_errors": sum(t.finish_reason == "error" for t in trajectories),
        "finish_reasons": finish,
    }


async def evaluate(spec: EnvSpec, make_agent: Callable[[ResourceManager], Any], tasks: Sequence[dict], *,
                   num_chains: int = 1, seed: int = 0, pool_overrides: Mapping[str, Mapping] | None = None,
                   progress: bool = False, timeout: float | None = None) -> dict[str, Any]:
    """Runs the agent `make_agent(manager)` on `tasks` with pools from `spec.pools`; returns the summary.

    pool_overrides: {pool: {field: value}} merged into the spec's pool configs (e.g. max_size).
    The summary has `summarize`'s figures plus `per_task` rows, rollout counters (`rollout`) and the
    pools' counters (`pools`).
    """
    pools = {}
    for name, config in spec.pools.items():
        merged = dict(config)
        merged.update((pool_overrides or {}).get(name, {}))
        pools[name] = merged
    unknown = set(pool_overrides or {}) - set(pools)
    if unknown:
        raise ValueError(f"pool_overrides names unknown pools {sorted(unknown)}; {spec.name} has {sorted(pools)}")
    manager = ResourceManager(pools)
    started = time.perf_counter()
    try:
        agent = make_agent(manager)
        trajectories = await agent.run(list(tasks), num_chains=num_chains, seed=seed, progress=progress,
                                       timeout=timeout)
        pool_metrics = manager.metrics()
    finally:
        await manager.close()
    summary = summarize(trajectories, spec.success_threshold)
    summary["env"] = spec.name
    summary["tasks"] = len(tasks)
    summary["wall_s"] = time.perf_counter() - started
    stats = dict(getattr(agent, "last_run_stats", {}))
    summary["tool_latency_s_mean"] = stats.get("tool_latency_s_mean", 0.0)
    summary["rollout"] = stats
    summary["pools"] = pool_metrics
    summary["per_task"] = [
        {
            "task": {k: v for k, v in tasks[i // num_chains].items() if k != "question"},
            "reward": float(t.reward),
            "turns": t.num_turns,
            "tool_calls": t.tool_calls,
            "tool_errors": int(t.metrics.get("tool_errors", 0)),
            "finish_reason": t.finish_reason,
            **({"reward_error": t.reward_extras["reward_error"]} if "reward_error" in t.reward_extras else {}),
        }
        for i, t in enumerate(trajectories)
    ]
    return summary


# --------------------------------------------------------------------------------------------------
# SFT demonstrations recorded from the scripted policies
# --------------------------------------------------------------------------------------------------


def _final_answer(react_text: str) -> str:
    marker = "Final Answer:"
    return react_text.split(marker, 1)[1].strip() if marker in react_text else ""


def trajectory_to_tool_calling(trajectory: Any) -> list[dict]:
    """A scripted (ReAct) trajectory as the tool-calling conversation a model agent would have had: the user's
    question, one assistant turn per tool call (with `tool_calls`) followed by its observation as a `tool`
    message, then the final answer. Observations are the real ones the tools returned in that chain."""
    messages = trajectory.messages or []
    question = next((m["content"] for m in messages if m.get("role") == "user"), "")
    out: list[dict] = [{"role": "user", "content": question}]
    for record in trajectory.tool_call_records:
        call = {"type": "function", "function": {"name": record.name, "arguments": dict(record.arguments)}}
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        out.append({"role": "tool", "name": record.name, "content": record.observation or record.error or ""})
    last = messages[-1] if messages else {}
    out.append({"role": "assistant",
                "content": _final_answer(str(last.get("content", ""))) if last.get("role") == "assistant" else ""})
    return out


def trajectory_to_react(trajectory: Any) -> list[dict]:
    """A scripted trajectory as ReAct demonstrations: its messages without the system prompt (the agent adds its
    own), exactly as the scripted ReAct agent wrote them."""
    return [dict(m) for m in (trajectory.messages or []) if m.get("role") != "system"]


def recorded_demonstrations(spec_factory: Callable[[], EnvSpec], *, max_tasks: int = 256,
                            min_reward: float | None = None):
    """A `Demonstrations` function for environments whose only teacher is their scripted policies.

    `demonstrations(tasks, rng, expert_fraction)` picks up to `max_tasks` of `tasks` (by `rng`), runs the
    oracle on `expert_fraction` of them and the random policy on the rest through the real tools, pools and
    reward (`scripted_agent`), and returns each chain as a conversation in the format of `spec.agent`
    (tool-calling: assistant `tool_calls` + `tool` observations; ReAct: the scripted ReAct turns). Oracle chains
    scoring below `min_reward` (default: the spec's success threshold) are dropped and counted in the log: a
    demonstration must show the task solved. `spec_factory` builds the spec (called once per use, in a
    worker thread with its own event loop, so it works whether or not the caller runs one). `tokenizer` (the
    trainer passes the run's) encodes the scripted turns, default `scripted_tokenizer()`; `max_observation_chars`
    (the trainer passes `agent.max_observation_chars`) cuts observations as the RL agent's will be cut.
    """
    import concurrent.futures
    import logging

    log = logging.getLogger(__name__)

    def demonstrations(tasks: Sequence[Mapping[str, Any]], rng: random.Random, expert_fraction: float, *,
                       tokenizer: Any = None, max_observation_chars: int | None = None):
        chosen = list(tasks)
        if len(chosen) > max_tasks:
            chosen = [chosen[i] for i in sorted(rng.sample(range(len(chosen)), max_tasks))]
        expert = [rng.random() < expert_fraction for _ in chosen]

        async def record(spec: EnvSpec):
            manager = ResourceManager(dict(spec.pools))
            try:
                out = {}
                for which, flag in (("oracle", True), ("random", False)):
                    rows = [t for t, e in zip(chosen, expert) if e == flag]
                    if rows and (spec.oracle_policy if flag else spec.random_policy) is None:
                        raise ValueError(f"environment {spec.name!r} has no {which} policy to record "
                                         "demonstrations from")
                    if rows:
                        limit = {"max_observation_chars": max_observation_chars} if max_observation_chars else {}
                        agent = scripted_agent(spec, which, manager, tokenizer=tokenizer,
                                               seed=rng.randrange(1 << 30), **limit)
                        out[which] = (rows, await agent.run(rows, num_chains=1, progress=False))
                return out
            finally:
                await manager.close()

        def in_thread():
            spec = spec_factory()
            return spec, asyncio.run(record(spec))

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            spec, recorded = pool.submit(in_thread).result()
        convert = trajectory_to_react if spec.agent == "react" else trajectory_to_tool_calling
        threshold = spec.success_threshold if min_reward is None else min_reward
        conversations, dropped = [], 0
        for which, (rows, trajectories) in recorded.items():
            for trajectory in trajectories:
                if which == "oracle" and trajectory.reward < threshold:
                    dropped += 1
                    continue
                conversations.append(convert(trajectory))
        if dropped:
            log.warning("%s: %d of %d oracle demonstrations scored below %.2f and were dropped", spec.name,
                        dropped, len(recorded.get("oracle", ((), ()))[1]), threshold)
        if not conversations:
            raise ValueError(f"no demonstrations recorded for {spec.name!r} ({len(chosen)} tasks, "
                             f"{dropped} oracle chains below the reward threshold)")
        rng.shuffle(conversations)
        return conversations

    return demonstrations
