"""Search-QA dataset rows for agents and experiments.

A row is {"question": <what the agent is told>, "answer": [accepted answers], "gold_titles", "id", "type",
"source"}; the QA rewards (`qa_exact_match`, `qa_f1`) read `answer`, the search env reads `gold_titles`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from environments.search.index import SearchIndex
from environments.search.questions import fanoutqa_questions, generated_questions, split_questions

QUESTION_TEMPLATE = (
    "Answer the question using the search tool (Wikipedia article summaries). Give the final answer as "
    "<answer>...</answer>.\nQuestion: {question}"
)
SETS = ("generated", "fanoutqa", "fanoutqa_sub")


def as_row(question: Mapping[str, Any]) -> dict[str, Any]:
    row = dict(question)
    row["question"] = QUESTION_TEMPLATE.format(question=question["question"])
    row["raw_question"] = question["question"]
    return row


def build_tasks(task_config: Mapping[str, Any], seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows).

    task_config: `train_set` and `eval_set`, each "generated" (train / held-out split of the generated
    single-hop questions), "fanoutqa" (FanOutQA dev, multi-hop, all evidence in the corpus) or "fanoutqa_sub"
    (their single-hop sub-questions); num_train / num_eval (0: all); question_types (generated: a subset of
    birth_year, death_year, description, cloze; empty: all); cache (the corpus/index cache directory).
    """
    index = SearchIndex.default(task_config.get("cache") or None)
    types = set(task_config.get("question_types") or ())

    def questions(name: str, split: str) -> list[dict]:
        if name == "generated":
            rows = generated_questions(index.documents, seed=seed)
            rows = [r for r in rows if not types or r["type"] in types]
            train, heldout = split_questions(rows)
            return train if split == "train" else heldout
        if name in ("fanoutqa", "fanoutqa_sub"):
            return fanoutqa_questions(index.documents, level="full" if name == "fanoutqa" else "sub")
        raise ValueError(f"unknown search question set {name!r}; expected one of {SETS}")

    train = [as_row(q) for q in questions(task_config.get("train_set", "generated"), "train")]
    heldout = [as_row(q) for q in questions(task_config.get("eval_set", "generated"), "heldout")]
    return train[: task_config.get("num_train") or len(train)], heldout[
        : task_config.get("num_eval") or len(heldout)
    ]
