"""The visual_scenes reward: exact match of the final answer after normalisation.

The answer is taken from an `<answer>` tag, a `\\boxed{}` or a `Final Answer:` line when the reply has one,
else the whole reply (`agentfly_jax.rewards.qa.qa_prediction`). Both it and the gold answer are normalised
(`normalize_answer`): lower case, no punctuation or articles, number words as digits ("three" -> "3"),
colour and shape synonyms and plurals to the names the questions use ("violet" -> "purple", "circles" ->
"circle"), "true"/"false" to "yes"/"no". The normalised texts must then be equal: "3" and "three" score 1.0,
"There are 3." scores 0.0 (the system prompt asks for the answer alone).
"""

from __future__ import annotations

from typing import Any

from agentfly_jax.rewards.decorator import reward
from agentfly_jax.rewards.qa import normalize_qa_answer, qa_prediction

_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")
_SYNONYMS = {
    **{word: str(value) for value, word in enumerate(_NUMBER_WORDS)},
    "none": "0",
    "violet": "purple",
    "circles": "circle", "disc": "circle", "disk": "circle",
    "squares": "square",
    "triangles": "triangle",
    "stars": "star", "pentagram": "star",
    "true": "yes", "false": "no",
}


def normalize_answer(text: Any) -> str:
    """Lower case, no punctuation or articles, single spaces, every word mapped to its canonical form
    (number words to digits, colour and shape synonyms and plurals, true/false to yes/no); "03" -> "3"."""
    words = normalize_qa_answer(str(text)).split()
    canonical = []
    for word in words:
        word = _SYNONYMS.get(word, word)
        if word.isascii() and word.isdigit():
            word = str(int(word))
        canonical.append(word)
    return " ".join(canonical)


@reward
def visual_scene_answer(prediction: str, answer: str) -> dict[str, Any]:
    """1.0 when the normalised final answer equals the normalised gold `answer`, else 0.0."""
    predicted = qa_prediction(prediction)
    return {"reward": float(normalize_answer(predicted) == normalize_answer(answer)), "extracted": predicted}
