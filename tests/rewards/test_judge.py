"""`LLMJudge`: an LLM-as-judge reward over any generation backend.

A real JaxSampler with a tiny random model checks the plumbing (the rendered prompt reaches the backend, the
reply is decoded and parsed, a repeated grading makes no request, a timeout scores 0.0 and leaves the sampler
working); its grades are arbitrary. `ScriptedJudgeBackend`, a fake backend that answers scripted replies,
checks the verdict parsing, caching and failure accounting deterministically.
"""

import asyncio

import jax
import pytest

from agentfly_jax.models import CausalLM, ModelConfig, init_params
from agentfly_jax.rewards import LLMJudge, RewardBindingError, parse_verdict
from agentfly_jax.rewards.judge import DEFAULT_PROMPT_TEMPLATE, default_stop_token_ids
from agentfly_jax.rollout.backends import JaxSampler
from agentfly_jax.rollout.backends.base import Completion, GenerationBackend
from environments.arithmetic.tokenizer import build_tokenizer

TASK = {"question": "What is 2 + 2?", "answer": "4"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A small byte-level BPE tokenizer with a ChatML template (<|im_start|>role\\n ... <|im_end|>\\n)."""
    return build_tokenizer(str(tmp_path_factory.mktemp("judge_tokenizer")))


class ScriptedJudgeBackend(GenerationBackend):
    """A fake backend: each request gets the next scripted reply (the last one repeats), encoded and ended
    with the first stop id; `delay` seconds of waiting first, `error` raised instead when set. Records every
    request."""

    def __init__(self, tokenizer, replies, *, delay=0.0, error=None, finish_reason="stop"):
        self.tokenizer, self.replies, self.delay, self.error = tokenizer, list(replies), delay, error
        self.finish_reason = finish_reason
        self.requests = []

    async def generate(self, prompt_token_ids, *, max_tokens, temperature=1.0, top_p=1.0, top_k=-1,
                       stop_token_ids=(), n=1, seed=None):
        self.requests.append({"prompt": list(prompt_token_ids), "max_tokens": max_tokens, "seed": seed,
                              "temperature": temperature, "stop_token_ids": list(stop_token_ids)})
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        reply = self.replies[min(len(self.requests) - 1, len(self.replies) - 1)]
        ids = self.tokenizer.encode(reply, add_special_tokens=False)
        if self.finish_reason == "stop":
            ids = ids + list(stop_token_ids[:1])
        return [Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=self.finish_reason)] * n

    async def update_weights(self, params, version, *, interrupt=False):
        raise NotImplementedError("the scripted judge has no weights")


def judged(judge, prediction="4", task=TASK):
    return asyncio.run(judge.reward.score(prediction=prediction, task=task))


# ------------------------------------------------------------------------------------------------ parsing
@pytest.mark.parametrize(
    "reply, score",
    [
        ("The answer matches.\nGRADE: CORRECT", 1.0),
        ("It says 5, not 4.\nGRADE: INCORRECT", 0.0),
        ("**GRADE:** CORRECT.", 1.0),
        ("grade: **incorrect**", 0.0),
        ("At first GRADE: INCORRECT, but re-reading it... GRADE: CORRECT", 1.0),  # the last verdict wins
        ("GRADE: CORRECT\nOn reflection:\nGRADE: INCORRECT", 0.0),
        ("SCORE: 0.75", 0.75),
        ("Score = .5", 0.5),
        ("GRADE: 1", 1.0),
    ],
)
def test_verdicts(reply, score):
    assert parse_verdict(reply) == (score, None)


@pytest.mark.parametrize(
    "reply, reason",
    [
        ("It looks right to me.", "has no verdict"),
        ("", "has no verdict"),
        ("GRADE: CORRECTLY", "'GRADE: CORRECTLY' is neither CORRECT, INCORRECT nor a number in [0, 1]"),
        ("GRADE: PARTIAL", "neither CORRECT, INCORRECT nor a number"),
        ("SCORE: 7", "'SCORE: 7' is outside [0, 1]"),
        ("SCORE: -0.5", "outside [0, 1]"),
        # a bad last verdict is not skipped for an earlier good one
        ("GRADE: CORRECT\nthen GRADE: maybe", "'GRADE: maybe' is neither"),
        ("GRADE:", "neither CORRECT"),
    ],
)
def test_unparsable_verdicts(reply, reason):
    score, why = parse_verdict(reply)
    assert score is None and reason in why


# ------------------------------------------------------------------------------------------------ prompt
def test_prompt_is_the_template_through_the_chat_template(tokenizer):
    backend = ScriptedJudgeBackend(tokenizer, ["GRADE: CORRECT"])
    template = "Q={question} R={reference} P={prediction} {other} \\frac{1}{2}"
    judge = LLMJudge(backend, tokenizer, prompt_template=template, system_prompt="Grade strictly.")
    rendered = judge.render_prompt("2+2?", ["4", "four"], "it is {reference}")
    # one pass: the prediction's "{reference}" stays as written, so do unknown braces
    assert rendered == "Q=2+2? R=- 4\n- four P=it is {reference} {other} \\frac{1}{2}"
    chat = ("<|im_start|>system\nGrade strictly.<|im_end|>\n<|im_start|>user\n" + rendered
            + "<|im_end|>\n<|im_start|>assistant\n")
    assert judge.prompt_token_ids("2+2?", ["4", "four"], "it is {reference}") == tokenizer.encode(
        chat, add_special_tokens=False)
    # the default stops: the template's end of turn (also this tokenizer's eos), once
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert judge.stop_token_ids == default_stop_token_ids(tokenizer) == [im_end]
    result = judged(judge, prediction="it is {reference}", task={"question": "2+2?", "answer": ["4", "four"]})
    assert result.reward == 1.0
    prompt = tokenizer.encode(chat, add_special_tokens=False)
    assert backend.requests == [{"prompt": prompt, "max_tokens": 512, "seed": 0, "temperature": 0.0,
                                 "stop_token_ids": [im_end]}]


def test_default_template_names_every_field(tokenizer):
    judge = LLMJudge(ScriptedJudgeBackend(tokenizer, ["GRADE: CORRECT"]), tokenizer)
    assert judge.prompt_template == DEFAULT_PROMPT_TEMPLATE
    text = judge.render_prompt("What is 2 + 2?", "4", "five")
    assert "Question:\nWhat is 2 + 2?\n" in text and "Reference answer:\n4\n" in text
    assert "Answer to grade:\nfive\n" in text and text.endswith('"GRADE: INCORRECT".')


# ------------------------------------------------------------------------------------------------ reward
def test_a_reward_bound_to_the_dataset_fields(tokenizer):
    backend = ScriptedJudgeBackend(tokenizer, ["Same number.\nGRADE: CORRECT"])
    judge = LLMJudge(backend, tokenizer, question_field="problem", reference_field="solution", name="judge_q")
    assert judge.reward.name == "judge_q" and judge.reward.is_async
    assert judge.reward.required_fields == ["problem", "solution"]
    with pytest.raises(RewardBindingError, match="no field 'solution'"):
        judge.reward.check_tasks([{"problem": "2+2?", "answer": "4"}])
    result = judged(judge, task={"problem": "2+2?", "solution": "4", "unused": 1})
    assert result.ok and result.reward == 1.0
    assert result.extras == {"judge_reason": None, "judge_reply": "Same number.\nGRADE: CORRECT",
                             "judge_cached": False, "judge_failure": None}
    assert "2+2?" in tokenizer.decode(backend.requests[0]["prompt"])

    # a rubric without a reference answer
    rubric = LLMJudge(ScriptedJudgeBackend(tokenizer, ["SCORE: 0.5"]), tokenizer, reference_field=None,
                      prompt_template="Rate the answer to {question}: {prediction}\nEnd with SCORE: x")
    assert rubric.reward.required_fields == ["question"]
    assert judged(rubric, task={"question": "Why?"}).reward == 0.5


@pytest.mark.parametrize(
    "options, message",
    [
        ({"prompt_template": "Grade {question} against {reference}."}, "{prediction} placeholder"),
        ({"question_field": None}, "uses {question} but question_field is None"),
        ({"prompt_template": "{question} {prediction}"},
         "no {reference} placeholder but reference_field='answer'"),
        ({"reference_field": "task"}, "must name a dataset field"),
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ],
)
def test_bad_options_are_refused(tokenizer, options, message):
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        LLMJudge(ScriptedJudgeBackend(tokenizer, []), tokenizer, **options)


# ------------------------------------------------------------------------------------------------ cache
def test_one_backend_request_per_distinct_grading(tokenizer):
    backend = ScriptedJudgeBackend(tokenizer, ["GRADE: CORRECT", "GRADE: INCORRECT"], delay=0.05)
    judge = LLMJudge(backend, tokenizer)
    first, again = judged(judge), judged(judge)
    assert (first.reward, again.reward) == (1.0, 1.0) and len(backend.requests) == 1
    assert (first.extras["judge_cached"], again.extras["judge_cached"]) == (False, True)
    assert judged(judge, prediction="5").reward == 0.0 and len(backend.requests) == 2  # another prediction

    async def together():  # identical gradings at once: they wait for the one request
        return await asyncio.gather(*(judge.grade("Q", "R", "P") for _ in range(4)))

    verdicts = asyncio.run(together())
    assert len(backend.requests) == 3 and len({v.score for v in verdicts}) == 1
    assert sorted(v.cached for v in verdicts) == [False, True, True, True]
    assert (judge.requests, judge.cache_hits, judge.failure_count) == (3, 4, 0)


def test_cache_size_is_bounded(tokenizer):
    backend = ScriptedJudgeBackend(tokenizer, ["GRADE: CORRECT"])
    judge = LLMJudge(backend, tokenizer, max_cache_entries=2)
    for prediction in ("a", "b", "a", "c", "a", "b"):  # least recently used goes: b after c arrives
        judged(judge, prediction=prediction)
    assert len(backend.requests) == 4
    assert list(judge._cache) == [("What is 2 + 2?", "4", prediction) for prediction in ("a", "b")]


# ------------------------------------------------------------------------------------------------ failures
def test_an_unparsable_reply_scores_zero_once_per_grading(tokenizer, caplog):
    backend = ScriptedJudgeBackend(tokenizer, ["I cannot decide."])
    judge = LLMJudge(backend, tokenizer)
    result = judged(judge)
    assert result.ok and result.reward == 0.0 and result.extras["judge_failure"] == "unparsable"
    assert "has no verdict" in result.extras["judge_reason"] and "has no verdict" in caplog.text
    assert judged(judge).extras["judge_cached"] is True and len(backend.requests) == 1
    assert judge.failures == {"unparsable": 1}

    cut = LLMJudge(ScriptedJudgeBackend(tokenizer, ["Let me think about"], finish_reason="length"), tokenizer,
                   max_tokens=4)
    assert "(the reply was cut at max_tokens=4)" in judged(cut).extras["judge_reason"]


def test_a_timeout_scores_zero_is_logged_counted_and_not_cached(tokenizer, caplog):
    backend = ScriptedJudgeBackend(tokenizer, ["GRADE: CORRECT"], delay=5.0)
    judge = LLMJudge(backend, tokenizer, timeout=0.1)
    result = judged(judge)
    assert result.ok and result.reward == 0.0
    assert result.extras["judge_reason"] == "the judge did not answer within 0.1 s"
    assert result.extras["judge_failure"] == "timeout" and "did not answer within 0.1 s" in caplog.text
    backend.delay = 0.0
    assert judged(judge).reward == 1.0 and len(backend.requests) == 2  # asked again
    assert judge.failures == {"timeout": 1} and judge.failure_count == 1


def test_a_failing_backend_scores_zero(tokenizer):
    judge = LLMJudge(ScriptedJudgeBackend(tokenizer, [], error=ConnectionError("server gone")), tokenizer)
    result = judged(judge)
    assert result.ok and result.reward == 0.0
    assert result.extras["judge_reason"] == "the judge backend failed: ConnectionError: server gone"
    assert judge.failures == {"backend_error": 1}


# ------------------------------------------------------------------------------------------------ JaxSampler
class CountingBackend(GenerationBackend):
    """Passes every request to the real backend, keeping a record of it."""

    def __init__(self, backend):
        self.backend, self.requests = backend, []

    async def generate(self, prompt_token_ids, **options):
        self.requests.append((list(prompt_token_ids), options))
        return await self.backend.generate(prompt_token_ids, **options)

    async def update_weights(self, params, version, *, interrupt=False):
        await self.backend.update_weights(params, version, interrupt=interrupt)


@pytest.fixture(scope="module")
def sampler(tokenizer):
    model = CausalLM(ModelConfig(family="qwen2", vocab_size=len(tokenizer), hidden_size=64,
                                 intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                                 head_dim=32, qkv_bias=True, tie_word_embeddings=True,
                                 max_position_embeddings=256))
    params = init_params(model, jax.random.PRNGKey(0))
    backend = JaxSampler(model, params, max_slots=2, max_len=256, steps_per_call=4)
    yield backend
    asyncio.run(backend.close())


SHORT_TEMPLATE = "Q: {question}\nRef: {reference}\nAns: {prediction}\nGRADE?"


def test_judging_with_a_jax_sampler(tokenizer, sampler):
    backend = CountingBackend(sampler)
    judge = LLMJudge(backend, tokenizer, prompt_template=SHORT_TEMPLATE, max_tokens=12, timeout=300)
    result = judged(judge)
    assert result.ok and len(backend.requests) == 1
    prompt, options = backend.requests[0]
    assert prompt == judge.prompt_token_ids("What is 2 + 2?", "4", "4")
    assert options == {"max_tokens": 12, "temperature": 0.0, "stop_token_ids": judge.stop_token_ids, "n": 1,
                       "seed": 0}
    # the reply is what the sampler writes for that prompt (greedy: the same again), decoded and parsed
    [completion] = asyncio.run(sampler.generate(prompt, max_tokens=12, temperature=0.0,
                                                stop_token_ids=judge.stop_token_ids, seed=0))
    reply = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert result.extras["judge_reply"] == reply
    score, reason = parse_verdict(reply)
    assert result.reward == (score if score is not None else 0.0)
    assert result.extras["judge_reason"] == (None if score is not None else reason
                                             + (" (the reply was cut at max_tokens=12)"
                                                if completion.finish_reason == "length" else ""))
    # the same grading again: answered from the cache, no request
    again = judged(judge)
    assert len(backend.requests) == 1 and again.extras["judge_cached"] is True
    assert (again.reward, again.extras["judge_reply"]) == (result.reward, reply)


def test_a_jax_sampler_timeout(tokenizer, sampler):
    backend = CountingBackend(sampler)
    # no stop tokens: the random model writes until max_tokens, far longer than the timeout
    judge = LLMJudge(backend, tokenizer, prompt_template=SHORT_TEMPLATE, max_tokens=200, stop_token_ids=[],
                     timeout=0.01)
    result = judged(judge, prediction="5")
    assert result.ok and result.reward == 0.0 and result.extras["judge_failure"] == "timeout"
    assert result.extras["judge_reason"] == "the judge did not answer within 0.01 s"
    assert judge.failures == {"timeout": 1}
    # not cached, and the sampler serves the next request (the timed-out one was cancelled)
    judge.timeout = 300.0
    later = judged(judge, prediction="5")
    assert len(backend.requests) == 2 and later.extras["judge_failure"] in (None, "unparsable")
    assert later.extras["judge_reply"] is not None and judge.failures["timeout"] == 1
