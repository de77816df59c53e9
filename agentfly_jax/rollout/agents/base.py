"""BaseAgent: what an agent is made of (backend, tokenizer, template, tools, reward) and the hooks to override.

An agent turns dataset rows into Trajectories with `await agent.run(tasks, num_chains, max_turns)`; the
multi-chain, multi-turn rollout itself lives in `agentfly_jax.rollout.chain`. Subclasses decide how a
conversation starts (`build_messages`), which tool schemas the chat template renders (`template_tools`),
how tool calls are read from the model's text (`parse`), how results go back (`observation_messages`) and,
when needed, how a turn is sampled (`generate`).
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Iterable, Mapping, Sequence
from os import PathLike
from typing import Any

import numpy as np

from agentfly_jax.rewards.decorator import Reward, as_reward
from agentfly_jax.rollout.backends.base import Completion, GenerationBackend
from agentfly_jax.images import ImageSettings, PreparedImage
from agentfly_jax.rollout.templates import TextDecoder, end_of_turn_ids, resolve_template
from agentfly_jax.rollout.trajectory import Trajectory
from agentfly_jax.tools.context import EnvironmentProvider
from agentfly_jax.tools.decorator import Tool, as_tool_table
from agentfly_jax.tools.execute import ToolResult
from agentfly_jax.tools.parsers import ParseResult

Message = dict[str, Any]

# End-of-turn / end-of-text tokens of the supported families; those the tokenizer knows are stop tokens.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


def task_images(task: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The image content parts of a row's `images` field, in order ([] when the row has none).

    `images` is a sequence (a list, a tuple, or any sequence type such as a lazily rendered one: it is
    iterated, not required to be a list) whose items are images (PIL images, numpy arrays, paths, bytes, data
    URLs: whatever `agentfly_jax.images.load_image` takes) or ready image content parts; a single image (a string,
    bytes, a path, an array, a PIL image, a content part) stands for a sequence of one. The images are not
    loaded here: the chain's encoder loads and resizes them once for all of a task's chains."""
    images = task.get("images")
    if images is None:
        return []
    if isinstance(images, (str, bytes, PathLike, Mapping, np.ndarray)) or not isinstance(images, Iterable):
        images = [images]  # one image, not a sequence of them (an array or a string is iterable too)
    parts = []
    for index, image in enumerate(images):
        if image is None:
            raise ValueError(f"the row's images[{index}] is None; give an image (PIL image, array, path, bytes) or "
                             "leave it out of the row's images")
        is_part = isinstance(image, Mapping) and image.get("type") in ("image", "image_url")
        parts.append(dict(image) if is_part else {"type": "image", "image": image})
    return parts


class BaseAgent(abc.ABC):
    """An agent: samples turns from a backend, runs the tool calls it parses, and scores chains.

    Args:
      backend: the GenerationBackend that samples token ids.
      tokenizer: a Hugging Face tokenizer of the policy.
      tools: Tools (or functions / registered tool names) the agent may call.
      reward_fn: a @reward function (or a plain function / registered reward name) scoring each chain.
      chat_template: "qwen2.5", "llama3", Jinja text, or None for the tokenizer's own template.
      system_prompt: the system message (agents add their tool and format instructions where needed).
      env_provider: hands out environments for stateful tools and env-backed rewards
        (`async with env_provider.acquire(pool, key) as env`), e.g. the resource manager.
      max_turns: assistant turns per chain (default for `run`).
      max_new_tokens: most tokens sampled in one turn.
      max_context_tokens: most tokens in a whole chain (prompt, turns and observations).
      temperature, top_p, top_k: sampling parameters passed to the backend.
      max_concurrency: most chains running at once (None: all).
      tool_timeout, max_observation_chars: defaults for tools that do not set their own.
      reward_timeout: seconds the reward may take when it sets no `@reward(timeout=...)` (None:
        DEFAULT_REWARD_TIMEOUT_S, 300; `math.inf`: no limit); past it the chain scores 0.0 (`timeout`).
      parallel_tool_calls: run the tool calls of one turn concurrently (True) or one after another.
      stop_token_ids: tokens that end a turn (default: the tokenizer's end-of-turn tokens).
      min_pixels, max_pixels: the pixel range images (in prompts and tool observations) are resized into for a
        vision-language policy (None: the Qwen2-VL processor's 56*56 and 28*28*1280); an image takes
        pixels / 784 tokens, so max_pixels bounds what one image costs of max_context_tokens.
    """

    #: role of the messages that carry tool results back to the model
    observation_role = "tool"

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Any,
        *,
        tools: Mapping[str, Tool] | Iterable[Any] = (),
        reward_fn: Reward | Any = None,
        chat_template: str | None = None,
        system_prompt: str | None = None,
        env_provider: EnvironmentProvider | None = None,
        max_turns: int = 4,
        max_new_tokens: int = 512,
        max_context_tokens: int = 4096,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_concurrency: int | None = None,
        tool_timeout: float | None = None,
        max_observation_chars: int | None = None,
        parallel_tool_calls: bool = True,
        stop_token_ids: Sequence[int] | None = None,
        reward_timeout: float | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ):
        for name, value in (
            ("max_turns", max_turns),
            ("max_new_tokens", max_new_tokens),
            ("max_context_tokens", max_context_tokens),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_concurrency is not None and (not isinstance(max_concurrency, int) or max_concurrency < 1):
            raise ValueError(f"max_concurrency must be a positive int or None, got {max_concurrency!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        for name, value in (("tool_timeout", tool_timeout), ("reward_timeout", reward_timeout)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be positive seconds (math.inf: no limit) or None, got {value!r}")
        self.backend = backend
        self.tokenizer = tokenizer
        self.tools = as_tool_table(tools)
        self.reward_fn = as_reward(reward_fn)
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.env_provider = env_provider
        self.max_turns = max_turns
        self.max_new_tokens = max_new_tokens
        self.max_context_tokens = max_context_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.max_concurrency = max_concurrency
        self.tool_timeout = tool_timeout
        self.reward_timeout = reward_timeout
        self.max_observation_chars = max_observation_chars
        self.parallel_tool_calls = parallel_tool_calls
        pixels = {"min_pixels": min_pixels, "max_pixels": max_pixels}
        #: how images are sized and cut into patches (see agentfly_jax.images)
        self.image_settings = ImageSettings(**{name: value for name, value in pixels.items() if value is not None})
        #: rollout-level counters of the last `run` (chains, turns, tool calls and errors, envs, wall time)
        self.last_run_stats: dict[str, float] = {}

        needs_env = [f"tool '{t.name}' (pool '{t.pool}')" for t in self.tools.values() if t.stateful]
        if self.reward_fn is not None and self.reward_fn.needs_env:
            needs_env.append(f"reward '{self.reward_fn.name}' (pool '{self.reward_fn.pool}')")
        if needs_env and env_provider is None:
            raise ValueError(
                f"{', '.join(needs_env)} need{'s' if len(needs_env) == 1 else ''} an environment but no "
                "env_provider was given: pass env_provider= (e.g. the resource manager)"
            )
        resolve_template(tokenizer, chat_template)  # fails here, not mid-rollout, on a bad template
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids is not None else self._default_stop_ids()
        if not self.stop_token_ids:
            raise ValueError(
                "the tokenizer has no end-of-turn token the agent knows; pass stop_token_ids= explicitly"
            )
        self._stop_set = set(self.stop_token_ids)

    def _default_stop_ids(self) -> list[int]:
        """The chat template's end-of-turn token (whatever the tokenizer marks special), the tokenizer's eos,
        and the known end-of-turn tokens the tokenizer lists as special."""
        special = set(self.tokenizer.all_special_tokens)
        ids = end_of_turn_ids(self.tokenizer, self.chat_template)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and eos not in ids:
            ids.append(eos)
        for token in END_OF_TURN_TOKENS:
            if token in special:
                token_id = self.tokenizer.convert_tokens_to_ids(token)
                if isinstance(token_id, int) and token_id not in ids:
                    ids.append(token_id)
        return ids

    # ----------------------------------------------------------------------------------------------
    # Hooks
    # ----------------------------------------------------------------------------------------------

    def build_messages(self, task: Mapping[str, Any]) -> list[Message]:
        """The conversation a chain starts from: the system prompt (if any) and the task's question.

        A row with `images` (a sequence of images, or one image) shows them before the question: the user
        message is then content parts, the images in order and the question's text last (`task_images`)."""
        question = task["question"]
        messages: list[Message] = []
        system = self.system_message(task)
        if system:
            messages.append({"role": "system", "content": system})
        images = task_images(task)
        if images:
            content: Any = [*images, {"type": "text", "text": question}]
        else:
            content = question
        messages.append({"role": "user", "content": content})
        return messages

    def system_message(self, task: Mapping[str, Any]) -> str | None:
        """The system prompt text for `task` (None: the template's default)."""
        return self.system_prompt

    def template_tools(self) -> list[dict] | None:
        """Tool schemas the chat template renders into the prompt (None: the agent describes tools itself)."""
        return None

    @abc.abstractmethod
    def parse(self, text: str) -> ParseResult:
        """Tool calls (and malformed parts as errors) in one assistant turn's decoded text."""

    def is_final(self, parsed: ParseResult) -> bool:
        """Whether a turn ends the chain: no tool call and nothing malformed, i.e. a final answer."""
        return not parsed.tool_calls and not parsed.errors

    def observation_messages(self, results: Sequence[ToolResult]) -> list[Message]:
        """The messages that carry one turn's tool results back to the model, in call order (a result with images
        as its content parts)."""
        return [{"role": self.observation_role, "content": result.content} for result in results]

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        seed: int | None,
        images: Sequence[PreparedImage] = (),
    ) -> Completion:
        """Sample one assistant turn continuing `prompt_token_ids` (ends at a stop token or `max_tokens`).

        `images`: the prompt's images in order (one per run of `<|image_pad|>` ids), for a vision-language
        policy; passed on to backends that set `supports_images = True`, refused otherwise.
        """
        extra = {}
        if images:
            if not getattr(self.backend, "supports_images", False):
                raise RuntimeError(
                    f"the prompt holds {len(images)} images but the backend {type(self.backend).__name__} does not "
                    "take images (it does not set supports_images = True): sampling would ignore them. Use a "
                    "backend that serves a vision-language model with its images"
                )
            extra["images"] = list(images)
        completions = await self.backend.generate(
            prompt_token_ids,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=self.stop_token_ids,
            n=1,
            seed=seed,
            **extra,
        )
        if len(completions) != 1:
            raise RuntimeError(f"backend returned {len(completions)} completions for n=1")
        return completions[0]

    async def setup_env(self, pool: str, env: Any, task: Mapping[str, Any]) -> None:
        """Called once when a chain acquires its environment of `pool`, before the first use.

        Starts the episode the way the environment interface defines it: `await env.reset(task)` with the
        chain's dataset row (a copy), when the environment has a `reset` method. Override to pass
        something else (e.g. only the fields naming a game) or to skip it.
        """
        reset = getattr(env, "reset", None)
        if callable(reset):
            started = reset(dict(task))
            if inspect.isawaitable(started):
                await started

    def decode_turn(self, token_ids: Sequence[int]) -> str:
        """The text of a sampled turn, without its final stop token."""
        ids = list(token_ids)
        if ids and ids[-1] in self._stop_set:
            ids = ids[:-1]
        decoder = self.__dict__.get("_decoder")
        if decoder is None or decoder.tokenizer is not self.tokenizer:
            decoder = self._decoder = TextDecoder(self.tokenizer)
        return decoder(ids)

    # ----------------------------------------------------------------------------------------------
    # Rollout
    # ----------------------------------------------------------------------------------------------

    async def run(
        self,
        tasks: Sequence[Mapping[str, Any]],
        num_chains: int = 1,
        max_turns: int | None = None,
        *,
        seed: int | None = None,
        progress: bool = True,
        timeout: float | None = None,
    ) -> list[Trajectory]:
        """Roll out `num_chains` chains per task concurrently; returns their Trajectories, task-major.

        tasks: dataset rows, each with a `question` (and any fields the reward or tools use).
        max_turns: assistant turns per chain (default: the agent's `max_turns`).
        seed: makes sampling reproducible per (task, chain, turn) on backends that honour seeds.
        progress: show a tqdm bar with live chain/turn/tool counts.
        timeout: wall-clock seconds for the whole rollout; chains still running then are cancelled,
          release their environments and come back with finish_reason "cancelled".
        The reward's dataset fields are checked against every task before the first rollout.
        Rollout-level counters are in `agent.last_run_stats` afterwards.
        """
        from agentfly_jax.rollout.chain import run_rollout

        return await run_rollout(
            self,
            tasks,
            num_chains=num_chains,
            max_turns=max_turns if max_turns is not None else self.max_turns,
            seed=seed,
            progress=progress,
            timeout=timeout,
        )
