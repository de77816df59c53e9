"""Asynchronous multi-chain, multi-turn rollout: every chain is its own task and nothing waits for a batch.

`run_rollout(agent, tasks, num_chains, max_turns)` (what `agent.run` calls) starts one asyncio task per
(task, chain). A chain samples a turn, runs that turn's tool calls concurrently, appends the observations
and samples again, until a final answer, `max_turns`, the context limit, a cut-off turn or an error;
then it is scored right away, overlapping the chains still running. Nothing is lock-stepped: a chain
whose tools are slow delays only itself. A prompt that leaves no room to sample under `max_context_tokens`
(image tokens included) ends its chain before generation ("prompt_too_long", flagged as a chain error so
that the trainer leaves it out).

Images (vision-language policies): the prompt's and the observations' images are expanded to their vision
tokens by the chain's ConversationEncoder (`agent.image_settings`), kept in order in `Trajectory.images`, and
given to the backend with every generate call (`images=`, all of the prompt's so far); a backend takes them
only when it sets `supports_images = True`, else the chain fails with a message saying so.

Each chain holds a `ToolContext`: environments are acquired on first use and released when the chain
ends for any reason, including cancellation (a Ctrl-C, a deadline, the caller cancelling `run`).

Every sampled token keeps the weight version that sampled it (`Completion.token_versions` when the backend
reports them, else the turn's reported or served version), aligned with the chain's tokens (-1 on tokens the
policy did not sample); the Trajectory's `policy_version` is the oldest of them, `policy_version_max` the newest.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from agentfly_jax.rewards.decorator import REWARD_ERROR_KINDS
from agentfly_jax.rollout.templates import ConversationEncoder, EncoderCache, vision_pad_ids
from agentfly_jax.rollout.trajectory import CHAIN_ERROR_FLAG, ToolCallRecord, Trajectory
from agentfly_jax.tools.context import ToolContext
from agentfly_jax.tools.execute import TOOL_ERROR_KINDS, ToolResult, execute_tool_calls, parse_error_result

if TYPE_CHECKING:
    from agentfly_jax.rollout.agents.base import BaseAgent

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "max_turns", "max_context", "prompt_too_long", "length", "error", "cancelled")
# Row fields that give a task a stable group id (when they hold a non-negative int).
GROUP_ID_FIELDS = ("group_id", "task_id", "id")


# --------------------------------------------------------------------------------------------------
# Task checks
# --------------------------------------------------------------------------------------------------


def validate_tasks(tasks: Sequence[Mapping[str, Any]], *, source: str = "tasks") -> None:
    """Every row is a dict with a non-empty string `question`; raises ValueError naming the first bad row."""
    if isinstance(tasks, (str, bytes, Mapping)) or not isinstance(tasks, Sequence):
        raise TypeError(f"{source} must be a list of dataset rows (dicts), got {type(tasks).__name__}")
    if not tasks:
        raise ValueError(f"{source} is empty: give at least one task")
    for index, row in enumerate(tasks):
        if not isinstance(row, Mapping):
            raise TypeError(f"{source}[{index}] must be a dict with a 'question', got {type(row).__name__}")
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(
                f"{source}[{index}] needs a non-empty string 'question' field "
                f"(fields: {', '.join(sorted(map(str, row))) or 'none'})"
            )


def group_id_of(task: Mapping[str, Any], index: int) -> int:
    """The task's own non-negative int id (`group_id`, `task_id` or `id`) if it has one, else `index`."""
    for field in GROUP_ID_FIELDS:
        value = task.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return index


def chain_seed(seed: int | None, task_index: int, chain_index: int, turn: int) -> int | None:
    """A per-(task, chain, turn) sampling seed derived from the run's seed (None stays None)."""
    if seed is None:
        return None
    return zlib.crc32(f"{seed}:{task_index}:{chain_index}:{turn}".encode()) & 0x7FFFFFFF


# --------------------------------------------------------------------------------------------------
# Live counters
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RolloutStats:
    """Counters of one rollout, updated live by the chains (shown in the progress bar)."""

    chains: int = 0
    running: int = 0
    finished: int = 0
    turns: int = 0
    generation_calls: int = 0
    generation_time_s: float = 0.0
    tool_calls: int = 0
    tool_time_s: float = 0.0
    tool_errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tools_abandoned: int = 0  # timed-out tool calls still running when given up on
    reward_failures: int = 0
    reward_errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by kind
    rewards_abandoned: int = 0  # timed-out rewards still running when given up on
    prompts_too_long: int = 0  # chains whose prompt left no room to sample (also finish/prompt_too_long)
    reward_sum: float = 0.0
    rewarded: int = 0
    chain_errors: int = 0
    envs_in_use: int = 0
    envs_in_use_peak: int = 0
    envs_acquired: int = 0
    finish_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    wall_time_s: float = 0.0

    def env_acquired(self, pool: str) -> None:
        """A chain took an environment of `pool`."""
        self.envs_in_use += 1
        self.envs_acquired += 1
        self.envs_in_use_peak = max(self.envs_in_use_peak, self.envs_in_use)

    def env_released(self, pool: str) -> None:
        """A chain gave back an environment of `pool`."""
        self.envs_in_use -= 1

    def as_dict(self) -> dict[str, float]:
        """Flat name -> number, for TensorBoard."""
        out: dict[str, float] = {
            "chains": self.chains,
            "chains_finished": self.finished,
            "turns": self.turns,
            "turns_per_chain": self.turns / self.chains if self.chains else 0.0,
            "generation_calls": self.generation_calls,
            "generation_latency_s_mean": self.generation_time_s / max(self.generation_calls, 1),
            "tool_calls": self.tool_calls,
            "tool_latency_s_mean": self.tool_time_s / max(self.tool_calls, 1),
            "tool_errors": sum(self.tool_errors.values()),
            "tools_abandoned": self.tools_abandoned,
            "reward_failures": self.reward_failures,
            "rewards_abandoned": self.rewards_abandoned,
            "reward_mean": self.reward_sum / self.rewarded if self.rewarded else 0.0,
            "chain_errors": self.chain_errors,
            "envs_acquired": self.envs_acquired,
            "envs_in_use_peak": self.envs_in_use_peak,
            "wall_time_s": self.wall_time_s,
        }
        for kind in TOOL_ERROR_KINDS:
            out[f"tool_errors/{kind}"] = self.tool_errors[kind]
        for kind in REWARD_ERROR_KINDS:
            out[f"reward_failures/{kind}"] = self.reward_errors[kind]
        for reason in FINISH_REASONS:
            out[f"finish/{reason}"] = self.finish_reasons[reason]
        return {key: float(value) for key, value in out.items()}


class _Progress:
    """A tqdm bar over chains whose postfix shows live counts, redrawn at most every `interval_s`."""

    def __init__(self, stats: RolloutStats, total: int, enabled: bool, interval_s: float = 0.2):
        self.stats = stats
        self.interval_s = interval_s
        self.last_draw = 0.0
        self.bar = tqdm(total=total, desc="rollout", unit="chain", disable=not enabled, dynamic_ncols=True)

    def _postfix(self) -> str:
        stats = self.stats
        return (
            f"running={stats.running} turns={stats.turns} tools={stats.tool_calls} "
            f"tool_errors={sum(stats.tool_errors.values())} envs={stats.envs_in_use}"
        )

    def changed(self, finished_chains: int = 0) -> None:
        """Counts changed (and `finished_chains` more chains are done): redraw if it is time."""
        now = time.monotonic()
        if finished_chains:
            self.bar.update(finished_chains)
        if now - self.last_draw >= self.interval_s:
            self.last_draw = now
            self.bar.set_postfix_str(self._postfix(), refresh=True)

    def close(self) -> None:
        """Show the final counts and close the bar."""
        self.bar.set_postfix_str(self._postfix(), refresh=False)
        self.bar.close()


# --------------------------------------------------------------------------------------------------
# One chain
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ChainState:
    """Everything one chain has produced so far; a Trajectory can be built from it at any point."""

    task_index: int
    chain_index: int
    task: Mapping[str, Any]
    group_id: int
    key: str
    prompt_ids: list[int]
    encoder: ConversationEncoder | None = None
    encoder_cache: EncoderCache | None = None  # shared by the rollout's chains: their prompts' pieces
    logprobs: list[float] = dataclasses.field(default_factory=list)  # aligned with encoder.token_ids
    # aligned with encoder.token_ids: the weight version that sampled each token, -1 where the policy did not
    token_versions: list[int] = dataclasses.field(default_factory=list)
    keep_tokens: int | None = None  # set when an observation overflowed the context: tokens to keep
    num_turns: int = 0
    last_text: str = ""
    records: list[ToolCallRecord] = dataclasses.field(default_factory=list)
    tool_errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tool_latencies: list[float] = dataclasses.field(default_factory=list)
    generation_latencies: list[float] = dataclasses.field(default_factory=list)
    # per turn: the version of its first token (else the one served when it was requested)
    policy_versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    flags: set[str] = dataclasses.field(default_factory=set)
    trajectory: Trajectory | None = None


def _record(result: ToolResult, turn: int) -> ToolCallRecord:
    return ToolCallRecord(
        turn=turn,
        name=result.name,
        arguments=dict(result.arguments),
        observation=result.observation,
        error=None if result.ok else f"{result.error_kind}: {result.error}",
        latency_s=result.latency_s,
        images=len(result.images),
    )


async def _chain_turns(
    agent: BaseAgent,
    state: ChainState,
    context: ToolContext,
    max_turns: int,
    seed: int | None,
    stats: RolloutStats,
    progress: _Progress,
) -> None:
    encoder = ConversationEncoder(
        agent.tokenizer,
        chat_template=agent.chat_template,
        cache=state.encoder_cache,
        image_settings=agent.image_settings,
    )
    encoder.start(agent.build_messages(state.task), tools=agent.template_tools())
    state.encoder = encoder
    state.logprobs = [0.0] * len(encoder.token_ids)
    state.token_versions = [-1] * len(encoder.token_ids)
    if len(encoder.token_ids) >= agent.max_context_tokens:
        _prompt_too_long(agent, state, stats)
        return
    # a vision-language policy may sample a vision pad id; it would stand for image features nobody sent
    vision_pads = frozenset()
    if getattr(agent.backend, "supports_images", False):
        cache = state.encoder_cache
        vision_pads = cache.vision_pad_ids if cache is not None else vision_pad_ids(agent.tokenizer)
    for turn in range(max_turns):
        room = agent.max_context_tokens - len(encoder.token_ids)
        if room <= 0:
            state.finish_reason = "max_context"
            return
        max_tokens = min(agent.max_new_tokens, room)
        version = int(agent.backend.weight_version)
        started = time.perf_counter()
        # images only when there are some: text-only agents may override generate() without the argument
        images = {"images": list(encoder.images)} if encoder.images else {}
        completion = await agent.generate(
            list(encoder.token_ids),
            max_tokens=max_tokens,
            seed=chain_seed(seed, state.task_index, state.chain_index, turn),
            **images,
        )
        elapsed = time.perf_counter() - started
        state.generation_latencies.append(elapsed)
        stats.generation_calls += 1
        stats.generation_time_s += elapsed
        sampled = list(map(int, completion.token_ids))
        if len(sampled) > max_tokens:
            raise RuntimeError(f"the backend returned {len(sampled)} tokens for max_tokens={max_tokens}")
        if not all(map(math.isfinite, completion.logprobs)):
            raise RuntimeError("the backend returned a non-finite logprob for a sampled token")
        if completion.finish_reason == "abort":
            raise RuntimeError("the backend aborted the request")
        if vision_pads and not vision_pads.isdisjoint(sampled):
            # The next prompt's pads would no longer match its images (the samplers refuse it) and the update could
            # not place features for them: the chain is a chain error, dropped from the batch and counted.
            raise RuntimeError(
                f"the policy sampled a vision pad token (ids {sorted(vision_pads & set(sampled))}) in turn "
                f"{turn + 1}; it stands for image features, not text, so the chain cannot go on and is dropped "
                "(an SFT warm start on the task's demonstrations makes a vision-language policy stop writing them)"
            )
        # The version that sampled each token when the backend reports it (weights swapped mid-turn give a turn
        # several), else the version that sampled the turn's first token, else the one served when the request
        # went out, for every token of the turn.
        reported = getattr(completion, "weight_version", None)
        turn_version = int(reported) if reported is not None else version
        reported_tokens = getattr(completion, "token_versions", None)
        if reported_tokens is None:
            turn_versions = [turn_version] * len(sampled)
        else:
            turn_versions = [int(v) for v in reported_tokens]
            if len(turn_versions) != len(sampled):
                raise RuntimeError(
                    f"the backend returned {len(turn_versions)} token versions for {len(sampled)} tokens"
                )
        state.last_text = agent.decode_turn(sampled)
        encoder.append_assistant(sampled, {"role": "assistant", "content": state.last_text})
        state.logprobs.extend(map(float, completion.logprobs))
        state.token_versions.extend(turn_versions)
        state.policy_versions.append(turn_versions[0] if turn_versions else turn_version)
        state.num_turns += 1
        stats.turns += 1
        progress.changed()
        if completion.finish_reason == "length":
            # Cut off mid-turn: by the context limit when that was the tighter bound.
            state.finish_reason = "max_context" if max_tokens < agent.max_new_tokens else "length"
            return

        parsed = agent.parse(state.last_text)
        if agent.is_final(parsed):
            state.finish_reason = "stop"
            return
        results = await execute_tool_calls(
            parsed.tool_calls,
            agent.tools,
            parallel=agent.parallel_tool_calls,
            timeout=agent.tool_timeout,
            max_observation_chars=agent.max_observation_chars,
            context=context,
        )
        results += [parse_error_result(error) for error in parsed.errors]
        for result in results:
            state.records.append(_record(result, turn))
            state.tool_latencies.append(result.latency_s)
            stats.tool_calls += 1
            stats.tool_time_s += result.latency_s
            if not result.ok:
                state.tool_errors[result.error_kind] += 1
                stats.tool_errors[result.error_kind] += 1
                if result.error_kind == "tool_exception" and not result.abandoned:  # the tool's fault, not the model's
                    first = stats.tool_errors["tool_exception"] == 1
                    (logger.warning if first else logger.debug)(
                        "chain %s: %s%s", state.key, result.error,
                        " (the first tool exception of this rollout; the rest are counted in tool_errors/"
                        "tool_exception)" if first else "")
            if result.abandoned:
                stats.tools_abandoned += 1
                logger.warning(
                    "chain %s: tool '%s' ran past its timeout and did not stop when cancelled; it was abandoned "
                    "and runs on in the background (%d such calls in this rollout)",
                    state.key,
                    result.name,
                    stats.tools_abandoned,
                )
        progress.changed()

        last_turn = turn == max_turns - 1
        before = len(encoder.token_ids)
        encoder.append_messages(agent.observation_messages(results), add_generation_prompt=not last_turn)
        state.logprobs.extend([0.0] * (len(encoder.token_ids) - before))
        state.token_versions.extend([-1] * (len(encoder.token_ids) - before))
        if len(encoder.token_ids) > agent.max_context_tokens:
            state.keep_tokens = before  # the observation does not fit: the chain ends at its last turn
            state.finish_reason = "max_context"
            return
    state.finish_reason = "max_turns"


def _prompt_too_long(agent: BaseAgent, state: ChainState, stats: RolloutStats) -> None:
    """End a chain whose prompt leaves no room to sample: finish reason "prompt_too_long", flagged as a chain
    error (no episode was played: the trainer leaves it out), with a message saying what to change."""
    encoder = state.encoder
    image_tokens = sum(image.num_tokens for image in encoder.images)
    state.finish_reason = "prompt_too_long"
    state.error = (
        f"the prompt has {len(encoder.token_ids)} tokens"
        + (f" ({image_tokens} of them for its {len(encoder.images)} images)" if encoder.images else "")
        + f", which leaves no room to sample under max_context_tokens={agent.max_context_tokens}: raise "
        "max_context_tokens or shorten the prompt"
        + (f" (an image takes up to max_pixels / {agent.image_settings.factor ** 2} tokens: lower max_pixels)"
           if encoder.images else "")
    )
    state.flags.add(CHAIN_ERROR_FLAG)
    stats.prompts_too_long += 1
    log = logger.warning if stats.prompts_too_long == 1 else logger.debug
    log("chain %s ends before sampling: %s", state.key, state.error)


def build_trajectory(state: ChainState, default_version: int) -> Trajectory:
    """The Trajectory of a chain as it stands (finished, failed or cancelled part-way)."""
    # (The Trajectory makes its own copies of the token lists: the chain's are handed over as they are.)
    if state.encoder is not None:
        token_ids, action_mask = state.encoder.token_ids, state.encoder.action_mask
        logprobs, token_versions = state.logprobs, state.token_versions
        messages = list(state.encoder.messages)
        images, image_starts = state.encoder.images, state.encoder.image_starts
    else:
        token_ids, action_mask = list(state.prompt_ids), [0] * len(state.prompt_ids)
        logprobs, messages = [0.0] * len(state.prompt_ids), None
        token_versions = [-1] * len(state.prompt_ids)
        images, image_starts = [], []
    keep = state.keep_tokens if state.keep_tokens is not None else len(token_ids)
    if keep < len(token_ids):
        token_ids, action_mask = token_ids[:keep], action_mask[:keep]
        logprobs, token_versions = logprobs[:keep], token_versions[:keep]
    # an observation cut off with its tokens takes its images along (the cut is at a message boundary)
    images = [image for image, start in zip(images, image_starts) if start < keep]
    # Staleness counts from the oldest sampled token; a chain that sampled nothing gets its turns' versions
    # (or the version served now).
    sampled_versions = list(itertools.compress(token_versions, action_mask))
    versions = sampled_versions or state.policy_versions or [default_version]
    metrics: dict[str, Any] = {
        "generation_latency_s": sum(state.generation_latencies),
        "generation_latency_s_max": max(state.generation_latencies, default=0.0),
        "tool_latency_s": sum(state.tool_latencies),
        "tool_latency_s_max": max(state.tool_latencies, default=0.0),
        "tool_errors": sum(state.tool_errors.values()),
    }
    for kind in TOOL_ERROR_KINDS:
        metrics[f"tool_errors/{kind}"] = state.tool_errors[kind]
    metrics["policy_version_min"] = min(versions)
    metrics["policy_version_max"] = max(versions)
    if state.error is not None:
        metrics["error"] = state.error
    for field in GROUP_ID_FIELDS:
        if field in state.task and not isinstance(state.task[field], int):
            metrics["task_id"] = str(state.task[field])
            break
    return Trajectory(
        token_ids=token_ids,
        action_mask=action_mask,
        sampler_logprobs=logprobs,
        token_versions=token_versions,
        group_id=state.group_id,
        num_turns=state.num_turns,
        tool_calls=len(state.records),
        tool_call_records=list(state.records),
        policy_version=min(versions),
        policy_version_max=max(versions),
        finish_reason=state.finish_reason or "cancelled",
        metrics=metrics,
        messages=messages,
        flags=set(state.flags),
        images=images,
    )


async def _run_chain(
    agent: BaseAgent,
    state: ChainState,
    max_turns: int,
    seed: int | None,
    stats: RolloutStats,
    progress: _Progress,
    semaphore: asyncio.Semaphore | None,
) -> None:
    entered = False
    try:
        async with semaphore if semaphore is not None else contextlib.nullcontext():
            entered = True
            stats.running += 1
            async with ToolContext(
                state.task,
                env_provider=agent.env_provider,
                key=state.key,
                setup_env=lambda pool, env: agent.setup_env(pool, env, state.task),
                on_acquire=stats.env_acquired,
                on_release=stats.env_released,
            ) as context:
                try:
                    await _chain_turns(agent, state, context, max_turns, seed, stats, progress)
                except (asyncio.CancelledError, KeyboardInterrupt):
                    raise  # stopping the rollout (a KeyboardInterrupt here is Ctrl-C outside asyncio.run)
                except BaseException as error:  # noqa: BLE001 - a failed chain is data, the others go on
                    # SystemExit and the like too: tools and rewards already turn theirs into observations
                    # and failed rewards, but an environment's or a backend's must not end the process either.
                    state.finish_reason = "error"
                    state.error = f"{type(error).__name__}: {error}"
                    state.flags.add(CHAIN_ERROR_FLAG)
                    stats.chain_errors += 1
                    log = logger.warning if stats.chain_errors == 1 else logger.debug
                    log("chain %s failed: %s", state.key, state.error, exc_info=stats.chain_errors == 1)
                trajectory = build_trajectory(state, int(agent.backend.weight_version))
                if agent.reward_fn is not None and CHAIN_ERROR_FLAG not in state.flags:
                    await _score(agent, state, trajectory, context, stats)
                state.trajectory = trajectory
    except asyncio.CancelledError:
        state.finish_reason = "cancelled"
        state.flags.add("cancelled")
        raise
    finally:
        if entered:
            stats.running -= 1
        stats.finished += 1
        stats.finish_reasons[state.finish_reason or "cancelled"] += 1
        progress.changed(finished_chains=1)


async def _score(
    agent: BaseAgent, state: ChainState, trajectory: Trajectory, context: ToolContext, stats: RolloutStats
) -> None:
    """Score a finished chain (inside its context, so env-backed rewards see its environment)."""
    result = await agent.reward_fn.score(
        prediction=state.last_text,
        trajectory=trajectory,
        task=state.task,
        context=context,
        timeout=agent.reward_timeout,
    )
    trajectory.reward = result.reward
    trajectory.reward_extras = dict(result.extras)
    if not result.ok:
        trajectory.flags.add("reward_failed")
        trajectory.reward_extras["reward_error"] = result.error
        trajectory.reward_extras["reward_error_kind"] = result.error_kind
        stats.reward_failures += 1
        stats.reward_errors[result.error_kind] += 1
        stats.rewards_abandoned += int(result.abandoned)
        log = logger.warning if stats.reward_failures == 1 or result.abandoned else logger.debug
        log("chain %s: reward scored 0.0: %s: %s", state.key, result.error_kind, result.error)
    else:
        stats.reward_sum += result.reward
        stats.rewarded += 1


# --------------------------------------------------------------------------------------------------
# The rollout
# --------------------------------------------------------------------------------------------------


async def _wait_for_all(tasks: Sequence[asyncio.Task]) -> None:
    """Wait until every task is done, even if the caller is cancelled again meanwhile."""
    while True:
        pending = [task for task in tasks if not task.done()]
        if not pending:
            return
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            continue


def _prompt_ids(agent: BaseAgent, task: Mapping[str, Any], index: int, cache: EncoderCache) -> list[int]:
    """The task's prompt ids, encoded once up front so a bad row fails before any rollout."""
    try:
        encoder = ConversationEncoder(
            agent.tokenizer, chat_template=agent.chat_template, cache=cache, image_settings=agent.image_settings
        )
        return encoder.start(agent.build_messages(task), tools=agent.template_tools())
    except Exception as error:
        raise ValueError(f"tasks[{index}]: cannot build its prompt: {type(error).__name__}: {error}") from error


async def run_rollout(
    agent: BaseAgent,
    tasks: Sequence[Mapping[str, Any]],
    *,
    num_chains: int,
    max_turns: int,
    seed: int | None = None,
    progress: bool = True,
    timeout: float | None = None,
) -> list[Trajectory]:
    """Roll out `num_chains` chains for each task concurrently; Trajectories in task-major order.

    Before anything is sampled: tasks are validated, the reward's dataset fields are checked against
    every row and each task's prompt is encoded, so those mistakes fail at start with a clear message.
    `timeout` (seconds) cancels chains still running then; they come back with finish_reason "cancelled".
    Cancelling the call itself cancels every chain, releases their environments and re-raises.
    Rollout counters go to `agent.last_run_stats`.
    """
    if not isinstance(num_chains, int) or num_chains < 1:
        raise ValueError(f"num_chains must be a positive int, got {num_chains!r}")
    if not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be positive seconds or None, got {timeout!r}")
    validate_tasks(tasks)
    if agent.reward_fn is not None:
        agent.reward_fn.check_tasks(tasks)
    encoder_cache = EncoderCache(agent.tokenizer)
    prompts = [_prompt_ids(agent, task, index, encoder_cache) for index, task in enumerate(tasks)]

    run_id = uuid.uuid4().hex[:8]
    states = [
        ChainState(
            task_index=task_index,
            chain_index=chain_index,
            task=task,
            group_id=group_id_of(task, task_index),
            key=f"{run_id}/{task_index}/{chain_index}",
            prompt_ids=prompts[task_index],
            encoder_cache=encoder_cache,
        )
        for task_index, task in enumerate(tasks)
        for chain_index in range(num_chains)
    ]
    stats = RolloutStats(chains=len(states))
    bar = _Progress(stats, len(states), progress)
    semaphore = asyncio.Semaphore(agent.max_concurrency) if agent.max_concurrency else None
    started = time.perf_counter()
    chain_tasks = [
        asyncio.create_task(_run_chain(agent, state, max_turns, seed, stats, bar, semaphore), name=state.key)
        for state in states
    ]
    try:
        _, pending = await asyncio.wait(chain_tasks, timeout=timeout)
        if pending:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending)
    except BaseException:
        # The caller cancelled us (or Ctrl-C): stop every chain and wait until each has released its
        # environments before letting the cancellation through.
        for task in chain_tasks:
            task.cancel()
        await _wait_for_all(chain_tasks)
        raise
    finally:
        stats.wall_time_s = time.perf_counter() - started
        agent.last_run_stats = stats.as_dict()
        bar.close()

    trajectories = []
    default_version = int(agent.backend.weight_version)
    for state, task in zip(states, chain_tasks):
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # a bug in the runtime itself, not a chain failure
        trajectories.append(state.trajectory or build_trajectory(state, default_version))
    return trajectories
