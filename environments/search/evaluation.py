"""The search environment's EnvSpec (agentfly_jax.envs.spec): question rows by split, the `search` tool, QA
exact match, the pool, and oracle / random scripted policies.

Splits for `question_set="generated"`: "train" (questions about train articles) and "dev" / "test" (the
held-out articles' questions, first and second half). For "fanoutqa" / "fanoutqa_sub" every split is the
filtered FanOutQA dev set (it is an evaluation set only). `eval_set` gives the held-out splits their own
question set (train on generated questions, evaluate on FanOutQA). `num` rows are a seeded sample of the split
(`num <= 0`: all of it, in a seeded order; more than the split holds: all of it).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any


SYSTEM_PROMPT = (
    "Answer the question. Use the search tool to look things up in Wikipedia article summaries; it returns "
    "titles, short descriptions and the start of each summary. Give a short final answer (a name, a year, "
    "a title)."
)


def _words(text: str) -> str:
    """Lower-case words of `text` without articles, single-spaced: "(1469–1539)" -> "1469 1539"."""
    return " ".join(w for w in re.findall(r"[^\W_]+", text.lower()) if w not in ("a", "an", "the"))


def _answer_shown(answers: list[str], observation: str) -> str | None:
    """The first accepted answer whose words appear (as a phrase) in the observation, else None."""
    text = f" {_words(observation)} "
    for answer in answers:
        words = _words(answer)
        if words and f" {words} " in text:
            return answer
    return None


def oracle_policy(task: Mapping[str, Any], rng: random.Random):
    """Searches the question; if the results do not show the answer, searches the gold articles by title;
    answers with the gold answer the results show. Generated questions are answerable from the summaries, so
    an answer the search never showed is "not found" (a failure); FanOutQA answers may not be in the
    summaries, so there the gold answer is given anyway."""
    answers = [str(a) for a in task["answer"]]
    observation = yield {"name": "search", "arguments": {"query": task["raw_question"], "k": 5}}
    shown = _answer_shown(answers, observation)
    for title in task.get("gold_titles", [])[:10]:
        if shown is not None:
            break
        observation = yield {"name": "search", "arguments": {"query": title, "k": 3}}
        shown = _answer_shown(answers, observation)
    if shown is not None:
        return shown
    return "not found" if task.get("source") == "generated" else answers[0]


def random_policy(task: Mapping[str, Any], rng: random.Random):
    """Searches three random words of the question and answers with a random result title."""
    words = task["raw_question"].split()
    observation = yield {
        "name": "search",
        "arguments": {"query": " ".join(rng.sample(words, min(3, len(words)))), "k": 5},
    }
    titles = re.findall(r"^\d+\. (.+?)(?: — .*)?$", observation, re.MULTILINE)
    return rng.choice(titles) if titles else "I don't know"


def env_spec(
    *,
    question_set: str = "generated",
    eval_set: str = "",
    question_types: str | list[str] = "",
    retriever: str = "bm25",
    rrf_k: float = 60,
    cache: str = "",
    pool_size: int = 64,
    max_turns: int = 14,
    seed: int = 0,
    demo_tasks: int = 512,
):
    """The search environment's spec.

    question_set: "generated", "fanoutqa" or "fanoutqa_sub"; eval_set: the question set of the "dev" and
    "test" splits (empty: question_set). question_types: for "generated", a subset of birth_year, death_year,
    description, cloze (comma-separated or a list; empty: all). seed: the seed the generated questions are
    drawn with. retriever: "bm25", "dense" or "hybrid" (BM25 + dense by reciprocal rank fusion, constant
    `rrf_k`); cache: the corpus/index cache directory (empty: the default). demo_tasks: train questions the
    oracle and random searchers are recorded on for SFT demonstrations (`recorded_demonstrations`).
    """
    options = dict(locals())  # this spec's options: recorded demonstrations rebuild the same spec
    from agentfly_jax.envs.spec import EnvSpec
    from agentfly_jax.rewards.qa import qa_exact_match
    from environments.evaluation import recorded_demonstrations
    from environments.search import POOL_CONFIG
    from environments.search.index import RETRIEVERS
    from environments.search.tasks import SETS, build_tasks
    from environments.search.tools import search

    eval_set = eval_set or question_set
    for option, value in (("question_set", question_set), ("eval_set", eval_set)):
        if value not in SETS:
            raise ValueError(f"{option}={value!r}; expected one of {SETS}")
    types = (
        [t.strip() for t in question_types.split(",") if t.strip()]
        if isinstance(question_types, str)
        else list(question_types)
    )
    if retriever not in RETRIEVERS:
        raise ValueError(f"retriever={retriever!r}; expected one of {RETRIEVERS}")
    pool = dict(
        POOL_CONFIG,
        kwargs=dict(POOL_CONFIG["kwargs"], retriever=retriever, rrf_k=float(rrf_k), cache=cache or None),
        max_size=pool_size,
    )

    def tasks(split: str, num: int, task_seed: int) -> list[dict]:
        if split not in ("train", "dev", "test"):
            raise ValueError(f"unknown search split {split!r}; expected train, dev or test")
        train, heldout = build_tasks(
            {"train_set": question_set, "eval_set": eval_set, "question_types": types, "cache": cache},
            seed=seed,
        )
        if split == "train":
            rows = train  # for a FanOutQA question_set, its whole (evaluation-only) set
        elif eval_set == "generated":
            rows = heldout[: len(heldout) // 2] if split == "dev" else heldout[len(heldout) // 2 :]
        else:
            rows = heldout
        size = len(rows) if num <= 0 else min(num, len(rows))
        return random.Random(f"search-{split}-{task_seed}").sample(rows, size)

    return EnvSpec(
        name="search",
        tasks=tasks,
        tools=[search],
        reward=qa_exact_match,
        pools={"search": pool},
        oracle_policy=oracle_policy,
        random_policy=random_policy,
        demonstrations=recorded_demonstrations(lambda: env_spec(**options), max_tasks=demo_tasks),
        system_prompt=SYSTEM_PROMPT,
        agent="tool_calling",
        max_turns=max_turns,
        success_threshold=1.0,
        splits=("train", "dev", "test"),
    )
