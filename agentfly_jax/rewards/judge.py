"""LLM-as-judge reward: a generation backend grades the prediction against the reference answer.

    judge = LLMJudge(judge_backend, judge_tokenizer, question_field="question", reference_field="answer")
    agent = ToolCallingAgent(policy_backend, tokenizer, reward_fn=judge.reward, ...)
    judge.failures  # a Counter: timeout, backend_error, unparsable, prompt_error

The backend is any object with the generation backends' `generate(prompt_token_ids, *, max_tokens,
temperature, stop_token_ids, seed, ...)` coroutine returning completions with `token_ids` and
`finish_reason`: the embedded JaxSampler, the vLLM client (VLLMBackend), or another one of the same protocol
(agentfly_jax.rollout.backends.base.GenerationBackend). It may be the policy's own backend or a separate judge
model.

One grading:
1. The prompt template (DEFAULT_PROMPT_TEMPLATE, or your own) gets `{question}`, `{reference}` and
   `{prediction}` filled in, in one pass (text inside a prediction is never substituted again); other braces
   stay as written. A reference given as a list is written one accepted answer per line ("- ...").
2. The prompt goes through the tokenizer's chat template (`apply_chat_template(...,
   add_generation_prompt=True)`, or the Jinja text given as `chat_template`), after an optional system
   prompt, and is encoded without adding special tokens again.
3. The backend samples the reply (greedy by default) up to `max_tokens`, stopping at the chat template's
   end-of-turn token and the tokenizer's eos (or the `stop_token_ids` given), within `timeout` seconds.
4. `parse_verdict` reads the reply: the LAST `GRADE: CORRECT` / `GRADE: INCORRECT` (1.0 / 0.0) or
   `SCORE: x` / `GRADE: x` with x a number in [0, 1] decides (case-insensitive, `**` emphasis allowed).
   A last verdict that is anything else, or no verdict at all, scores 0.0 with the reason.

Failures never raise: a timeout, a backend error, an unparsable reply and a prompt the chat template cannot
render each score 0.0 with the reason in the reward's extras (`judge_reason`, and the kind in
`judge_failure`), are logged as warnings and counted in `LLMJudge.failures` (by FAILURE_KINDS).

Caching: one backend request per distinct (question, reference, prediction) per judge. A reply (parsed or
not) is cached; a timeout or a backend error is not, so the next grading asks again. Identical gradings that
arrive while the first is running wait for it instead of asking too. At most `max_cache_entries` verdicts
are kept (least recently used ones go first).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

from agentfly_jax.rewards.decorator import Reward

log = logging.getLogger(__name__)

DEFAULT_PROMPT_TEMPLATE = """You are grading an answer to a question against the reference answer.

Question:
{question}

Reference answer:
{reference}

Answer to grade:
{prediction}

Is the answer to grade correct, that is, does it give the same final result as the reference answer? \
Wording, formatting and extra explanation do not matter; a different, missing or ambiguous final result is \
incorrect. Reason briefly, then end your reply with exactly one line: "GRADE: CORRECT" or \
"GRADE: INCORRECT"."""

PLACEHOLDERS = ("question", "reference", "prediction")
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
# A verdict: the keyword, ':' (or '='), then its value, with optional markdown emphasis around each part.
_VERDICT = re.compile(r"\b(GRADE|SCORE)\b[ \t*]*[:=][ \t*]*([^\s*]*)", re.IGNORECASE)
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_WORD_VERDICTS = {"CORRECT": 1.0, "INCORRECT": 0.0}

# Reward parameters the runtime fills (not dataset fields).
_RUNTIME_NAMES = ("prediction", "trajectory", "task", "env")

#: `LLMJudge.failures` keys.
FAILURE_KINDS = ("timeout", "backend_error", "unparsable", "prompt_error")


def parse_verdict(reply: str) -> tuple[float | None, str | None]:
    """(score, None) from the judge's reply, or (None, why no score could be read).

    The last `GRADE:` / `SCORE:` in the reply decides: `CORRECT` is 1.0, `INCORRECT` 0.0, a number must lie in
    [0, 1] (`SCORE: 0.75`). Trailing punctuation after the value is ignored (`GRADE: CORRECT.`).
    """
    verdicts = list(_VERDICT.finditer(reply))
    if not verdicts:
        return None, ("the judge's reply has no verdict: expected a last line 'GRADE: CORRECT' or "
                      "'GRADE: INCORRECT' (or 'SCORE: x' with x in [0, 1])")
    last = verdicts[-1]
    value = last.group(2).rstrip(".,;:!)]'\"")
    if value.upper() in _WORD_VERDICTS:
        return _WORD_VERDICTS[value.upper()], None
    if _NUMBER.fullmatch(value):
        number = float(value)
        if 0.0 <= number <= 1.0:
            return number, None
        return None, f"the judge's last verdict '{last.group(0).strip()}' is outside [0, 1]"
    return None, (f"the judge's last verdict '{last.group(0).strip()}' is neither CORRECT, INCORRECT nor a "
                  "number in [0, 1]")


@dataclasses.dataclass(frozen=True)
class JudgeVerdict:
    """One grading: the score, why it is 0.0 when no verdict was read (`reason`), the judge's reply, whether
    it came from the cache, and the failure kind (one of FAILURE_KINDS) when there was one."""

    score: float
    reason: str | None
    reply: str | None
    cached: bool = False
    failure: str | None = None


class LLMJudge:
    """A judge model behind a generation backend, and the reward (`.reward`) that asks it; see the module doc.

    backend: the generation backend that runs the judge model.
    tokenizer: the judge model's tokenizer (a transformers tokenizer with a chat template).
    prompt_template: the user message, with `{question}`, `{reference}` and `{prediction}` placeholders
      (`{prediction}` is required).
    question_field / reference_field: the dataset fields that fill `{question}` / `{reference}`; None for a
      template without that placeholder. The reward asks for exactly these fields, so a dataset lacking one
      is refused before the first rollout.
    system_prompt: an optional system message before the prompt.
    chat_template: Jinja text to use instead of the tokenizer's own chat template.
    max_tokens, temperature, seed: the judge's sampling (greedy by default: the same input, the same grade).
    stop_token_ids: where the reply ends (default: the chat template's end-of-turn token and the eos).
    timeout: seconds one grading may take before it scores 0.0.
    max_cache_entries: verdicts kept for repeated gradings.
    name: the reward's name (in logs and results). The reward is not put in REWARD_REGISTRY (it needs this
      judge's backend): pass `judge.reward` itself wherever a reward is taken.
    """

    def __init__(
        self,
        backend: Any,
        tokenizer: Any,
        *,
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        question_field: str | None = "question",
        reference_field: str | None = "answer",
        system_prompt: str | None = None,
        chat_template: str | None = None,
        max_tokens: int = 512,
        temperature: float = 0.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        timeout: float = 60.0,
        max_cache_entries: int = 65536,
        name: str = "llm_judge",
    ):
        if not callable(getattr(backend, "generate", None)):
            raise TypeError(f"backend must be a generation backend with a generate() coroutine, "
                            f"got {backend!r}")
        for method in ("apply_chat_template", "encode", "decode"):
            if not callable(getattr(tokenizer, method, None)):
                raise TypeError(f"tokenizer has no {method}(); give the judge model's transformers tokenizer")
        if not isinstance(prompt_template, str) or "{prediction}" not in prompt_template:
            raise ValueError("prompt_template must be a string with a {prediction} placeholder")
        fields = {"question": question_field, "reference": reference_field}
        for placeholder, field in fields.items():
            used = "{" + placeholder + "}" in prompt_template
            if used and field is None:
                raise ValueError(f"prompt_template uses {{{placeholder}}} but {placeholder}_field is None; "
                                 "name the dataset field that fills it")
            if not used and field is not None:
                raise ValueError(f"prompt_template has no {{{placeholder}}} placeholder but "
                                 f"{placeholder}_field={field!r}; add the placeholder or pass "
                                 f"{placeholder}_field=None")
            if field is not None and (not field.isidentifier() or field in _RUNTIME_NAMES):
                raise ValueError(f"{placeholder}_field={field!r} must name a dataset field (an identifier "
                                 f"other than {', '.join(_RUNTIME_NAMES)})")
        if question_field is not None and question_field == reference_field:
            raise ValueError(f"question_field and reference_field are both {question_field!r}")
        if not max_tokens >= 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not max_cache_entries >= 0:
            raise ValueError(f"max_cache_entries must be >= 0, got {max_cache_entries!r}")
        self.backend = backend
        self.tokenizer = tokenizer
        self.prompt_template = prompt_template
        self.question_field = question_field
        self.reference_field = reference_field
        self.system_prompt = system_prompt
        self.chat_template = chat_template
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.seed = int(seed)
        self.timeout = float(timeout)
        self.max_cache_entries = int(max_cache_entries)
        self.name = name
        self.stop_token_ids = (list(map(int, stop_token_ids)) if stop_token_ids is not None
                               else default_stop_token_ids(tokenizer, chat_template))
        #: Failed gradings by kind (FAILURE_KINDS); cache hits of a failed reply are not counted again.
        self.failures: collections.Counter = collections.Counter()
        #: Backend requests made, and gradings answered from the cache (or from an identical one in flight).
        self.requests = 0
        self.cache_hits = 0
        self._cache: collections.OrderedDict[tuple[str, str, str], JudgeVerdict] = collections.OrderedDict()
        self._pending: dict[tuple[str, str, str], tuple[asyncio.AbstractEventLoop, asyncio.Task]] = {}
        self.reward = self._make_reward()

    @property
    def failure_count(self) -> int:
        """Failed gradings so far, all kinds together."""
        return sum(self.failures.values())

    # ------------------------------------------------------------------------------------------ prompt
    def render_prompt(self, question: Any, reference: Any, prediction: Any) -> str:
        """The user message: the template with its placeholders filled in one pass."""
        values = {"question": _as_text(question), "reference": _reference_text(reference),
                  "prediction": _as_text(prediction)}
        return _PLACEHOLDER.sub(lambda match: values[match.group(1)], self.prompt_template)

    def prompt_token_ids(self, question: Any, reference: Any, prediction: Any) -> list[int]:
        """The token ids sent to the backend: the rendered prompt through the chat template."""
        messages = [{"role": "user", "content": self.render_prompt(question, reference, prediction)}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  chat_template=self.chat_template)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ------------------------------------------------------------------------------------------ grading
    async def grade(self, question: Any, reference: Any, prediction: Any) -> JudgeVerdict:
        """The judge's verdict on `prediction` (cached; never raises except on cancellation)."""
        key = (_as_text(question), _reference_text(reference), _as_text(prediction))
        if key in self._cache:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return dataclasses.replace(self._cache[key], cached=True)
        loop = asyncio.get_running_loop()
        pending = self._pending.get(key)
        if pending is not None and pending[0] is loop:  # the same grading is running: share its verdict
            self.cache_hits += 1
            return dataclasses.replace(await asyncio.shield(pending[1]), cached=True)
        task = loop.create_task(self._ask(key))
        self._pending[key] = (loop, task)
        task.add_done_callback(lambda done: self._forget_pending(key, done))
        # shielded: a cancelled caller leaves the grading running for the others that wait for it
        return await asyncio.shield(task)

    def _forget_pending(self, key: tuple[str, str, str], task: asyncio.Task) -> None:
        if key in self._pending and self._pending[key][1] is task:
            del self._pending[key]

    async def _ask(self, key: tuple[str, str, str]) -> JudgeVerdict:
        question, reference, prediction = key
        try:
            prompt = self.prompt_token_ids(question, reference, prediction)
        except Exception as error:  # noqa: BLE001 - a template that cannot render is a failed grading
            return self._failed("prompt_error", f"the judge prompt could not be rendered: "
                                                f"{type(error).__name__}: {error}")
        self.requests += 1
        try:
            completions = await asyncio.wait_for(
                self.backend.generate(prompt, max_tokens=self.max_tokens, temperature=self.temperature,
                                      stop_token_ids=self.stop_token_ids, n=1, seed=self.seed),
                self.timeout,
            )
            completion = completions[0]
            reply = self.tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
        except TimeoutError:
            return self._failed("timeout", f"the judge did not answer within {self.timeout:g} s")
        except Exception as error:  # noqa: BLE001 - a failing judge scores 0.0, it does not end the rollout
            return self._failed("backend_error", f"the judge backend failed: {type(error).__name__}: {error}")
        score, reason = parse_verdict(reply)
        if score is None:
            if getattr(completion, "finish_reason", None) == "length":
                reason = f"{reason} (the reply was cut at max_tokens={self.max_tokens})"
            verdict = self._failed("unparsable", reason, reply=reply)
        else:
            verdict = JudgeVerdict(score=score, reason=None, reply=reply)
        if self.max_cache_entries:
            self._cache[key] = verdict
            while len(self._cache) > self.max_cache_entries:
                self._cache.popitem(last=False)
        return verdict

    def _failed(self, kind: str, reason: str, reply: str | None = None) -> JudgeVerdict:
        self.failures[kind] += 1
        log.warning("LLM judge %r: %s (score 0.0)", self.name, reason)
        return JudgeVerdict(score=0.0, reason=reason, reply=reply, failure=kind)

    # ------------------------------------------------------------------------------------------ reward
    def _make_reward(self) -> Reward:
        question_field, reference_field = self.question_field, self.reference_field

        async def llm_judge(prediction: str, **fields: Any) -> dict[str, Any]:
            verdict = await self.grade(fields.get(question_field, ""), fields.get(reference_field, ""),
                                       prediction)
            return {"reward": verdict.score, "judge_reason": verdict.reason, "judge_reply": verdict.reply,
                    "judge_cached": verdict.cached, "judge_failure": verdict.failure}

        # The reward machinery reads the dataset fields a reward needs from its signature.
        parameters = [inspect.Parameter("prediction", inspect.Parameter.KEYWORD_ONLY)]
        parameters += [inspect.Parameter(field, inspect.Parameter.KEYWORD_ONLY)
                       for field in (question_field, reference_field) if field is not None]
        llm_judge.__signature__ = inspect.Signature(parameters)
        llm_judge.__doc__ = (f"{self.name}: the judge model's grade of the prediction (fields: "
                             f"{', '.join(p.name for p in parameters[1:]) or 'none'}).")
        return Reward(llm_judge, name=self.name)


def _as_text(value: Any) -> str:
    return "" if value is None else str(value).strip()


def _reference_text(reference: Any) -> str:
    if isinstance(reference, (list, tuple)):
        return "\n".join(f"- {_as_text(item)}" for item in reference)
    return _as_text(reference)


def default_stop_token_ids(tokenizer: Any, chat_template: str | None = None) -> list[int]:
    """The chat template's end-of-turn token (the added token written right after an assistant message's
    content) and the tokenizer's eos; raises ValueError when there is neither."""
    ids: list[int] = []
    marker = "JUDGE_END_OF_TURN_MARKER"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
            tokenize=False, chat_template=chat_template)
    except Exception:  # noqa: BLE001 - a template that cannot render an assistant turn: the eos alone
        text = ""
    if marker in text:
        after = text[text.index(marker) + len(marker):]
        added = tokenizer.get_added_vocab() if callable(getattr(tokenizer, "get_added_vocab", None)) else {}
        starts = [token for token in added if token and after.startswith(token)]
        if starts:
            ids.append(int(added[max(starts, key=len)]))
    eos = getattr(tokenizer, "eos_token_id", None)
    for token in eos if isinstance(eos, (list, tuple)) else [eos]:
        if token is not None and int(token) not in ids:
            ids.append(int(token))
    if not ids:
        raise ValueError("found no end-of-turn or eos token for the judge's replies; pass stop_token_ids=")
    return ids
