"""Question-answering rewards: exact match and token F1 after SQuAD-style normalisation."""

from __future__ import annotations

import collections
import re
import string
from typing import Any

from agentfly_jax.rewards.decorator import reward
from agentfly_jax.rewards.extract import extract_answer

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_qa_answer(text: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the), single spaces."""
    lowered = str(text).lower()
    no_punctuation = "".join(character for character in lowered if character not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", no_punctuation).split())


def qa_prediction(prediction: str) -> str:
    """The answer part of a prediction: an `<answer>` tag, `\\boxed{}` or `Final Answer:` line, else all of it."""
    extracted = extract_answer(prediction, order=("answer_tag", "boxed", "final_answer"))
    return extracted if extracted is not None else prediction


def _gold_answers(answer: Any) -> list[str]:
    answers = list(answer) if isinstance(answer, (list, tuple)) else [answer]
    return [str(gold) for gold in answers]


def token_f1(predicted: str, gold: str) -> float:
    """Token-level F1 of two answers after normalisation (1.0 when both are empty)."""
    predicted_tokens = normalize_qa_answer(predicted).split()
    gold_tokens = normalize_qa_answer(gold).split()
    if not predicted_tokens or not gold_tokens:
        return float(predicted_tokens == gold_tokens)
    common = collections.Counter(predicted_tokens) & collections.Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(predicted_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


@reward
def qa_exact_match(prediction: str, answer: Any) -> dict[str, Any]:
    """1.0 when the normalised predicted answer equals a normalised gold `answer` (a string or a list)."""
    predicted = qa_prediction(prediction)
    normalized = normalize_qa_answer(predicted)
    correct = any(normalized == normalize_qa_answer(gold) for gold in _gold_answers(answer))
    return {"reward": float(correct), "extracted": predicted}


@reward
def qa_f1(prediction: str, answer: Any) -> dict[str, Any]:
    """The best token F1 between the predicted answer and the gold `answer`(s)."""
    predicted = qa_prediction(prediction)
    best = max((token_f1(predicted, gold) for gold in _gold_answers(answer)), default=0.0)
    return {"reward": best, "extracted": predicted}
