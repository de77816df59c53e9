"""Question sets for search-augmented QA over the Wikipedia summaries.

- `generated_questions(documents)`: single-hop questions written from the summaries, each answerable from
  one summary (its `gold_title`) and checked by exact match / F1:
    birth_year  "In what year was Marie Curie born?"                        -> "1867"
    death_year  "In what year did Marie Curie die?"                         -> "1934"
    description "What is the name of the 1968 film by Stanley Kubrick?"    -> "2001: A Space Odyssey"
    cloze       "Which subject does this sentence describe? '___ is a ...'" -> the title
  `split_questions` puts every question about a held-out article (a stable hash of its title) in the
  held-out set, so held-out questions ask about articles no train question is about.
- `fanoutqa_questions(documents)`: FanOutQA dev (multi-hop, from the `fanoutqa` package, CC BY-SA 4.0)
  filtered to questions all of whose evidence articles are in the corpus; `level="sub"` gives their
  single-hop sub-questions whose evidence article is in the corpus instead.

Every row: {"id", "question", "answer" (list of accepted answers), "gold_titles", "type", "source"}.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from environments.search.corpus import Document

_SENTENCE_END = re.compile(r"(?<=[a-z0-9\)][.!?])\s+(?=[A-Z])")


def heldout_title(title: str, fraction: float = 0.1) -> bool:
    """Whether an article belongs to the held-out split (stable across runs and machines)."""
    return int(hashlib.sha256(title.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction


def plain_title(title: str) -> str:
    """The title without a trailing disambiguation: "Mercury (planet)" -> "Mercury"."""
    return re.sub(r"\s*\([^()]*\)$", "", title).strip()


def _answers_for_title(title: str) -> list[str]:
    plain = plain_title(title)
    return [title] if plain == title else [title, plain]


_LIFESPAN = re.compile(r"\((\d{3,4})\s*[–-]\s*(\d{3,4})\)\s*$")
_BORN = re.compile(r"\(born (\d{4})\)\s*$")


def _lifespan(document: Document) -> tuple[str | None, str | None]:
    """(birth year, death year) from a biography's short description: "Norwegian mathematician (1802–1829)",
    "American basketball player (born 1947)". Circa and BC dates are skipped (ambiguous)."""
    match = _LIFESPAN.search(document.description)
    if match and int(match.group(1)) < int(match.group(2)):
        return match.group(1), match.group(2)
    match = _BORN.search(document.description)
    return (match.group(1), None) if match else (None, None)


_CONTENT = re.compile(r"[a-z0-9]+")
_FUNCTION_WORDS = frozenset(
    "a an and the of in on for to by from with at as or its who which that is was born".split()
)


def _grounded(description: str, text: str, threshold: float = 0.6) -> bool:
    """Whether most content words of a short description also occur in the lead text (so the summary
    itself answers a question asked from the description)."""
    words = [w for w in _CONTENT.findall(description.lower()) if w not in _FUNCTION_WORDS]
    present = set(_CONTENT.findall(text.lower()))
    return bool(words) and sum(w in present for w in words) / len(words) >= threshold


def _first_sentence(text: str) -> str:
    return _SENTENCE_END.split(text, maxsplit=1)[0].strip()


def generated_questions(documents: Sequence[Document], seed: int = 0) -> list[dict[str, Any]]:
    """Single-hop questions from the summaries (at most one per article and type), in a seeded order."""
    descriptions = Counter(d.description.lower() for d in documents if d.description)
    rows: list[dict[str, Any]] = []

    def add(document: Document, kind: str, question: str, answers: list[str]) -> None:
        rows.append(
            {
                "id": f"gen-{kind}-{hashlib.sha1(document.title.encode()).hexdigest()[:10]}",
                "question": question,
                "answer": answers,
                "gold_titles": [document.title],
                "type": kind,
                "source": "generated",
            }
        )

    for document in documents:
        name = plain_title(document.title)
        if document.topic == "People":
            born, died = _lifespan(document)
            if born:
                add(document, "birth_year", f"In what year was {name} born?", [born])
            if died:
                add(document, "death_year", f"In what year did {name} die?", [died])
        description = document.description.strip()
        words = description.split()
        specific = any(w[:1].isupper() or w[:1].isdigit() for w in words[1:])
        if (
            description
            and descriptions[description.lower()] == 1
            and len(words) >= 3
            and specific
            and name.lower() not in description.lower()
            and _grounded(description, document.text)
        ):
            # Lower-case the first word unless the lead writes it capitalised (a proper noun: "Xia dynasty").
            first = words[0]
            lower_in_text = re.search(rf"\b{re.escape(first.lower())}\b", document.text) is not None
            text = description[0].lower() + description[1:] if lower_in_text else description
            add(
                document,
                "description",
                f"What is the name of the {text}?",
                _answers_for_title(document.title),
            )
        sentence = _first_sentence(document.text)
        if sentence.startswith(name + " ") and 60 <= len(sentence) <= 300 and sentence.count(name) == 1:
            cloze = "___" + sentence[len(name) :]
            add(
                document,
                "cloze",
                f'Which subject does this sentence describe? "{cloze}"',
                _answers_for_title(document.title),
            )
    random.Random(f"search-questions-{seed}").shuffle(rows)
    return rows


def split_questions(rows: Iterable[dict[str, Any]], fraction: float = 0.1) -> tuple[list[dict], list[dict]]:
    """(train, held-out): a question is held out when its (first) gold article is."""
    train, heldout = [], []
    for row in rows:
        (heldout if heldout_title(row["gold_titles"][0], fraction) else train).append(row)
    return train, heldout


# ----------------------------------------------------------------------------------------------- FanOutQA


def fanoutqa_path(split: str = "dev") -> Path:
    """The FanOutQA questions file shipped in the `fanoutqa` package (found without importing it)."""
    spec = importlib.util.find_spec("fanoutqa")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "FanOutQA questions need the fanoutqa package: pip install -e '.[envs]' "
            "(or pip install fanoutqa==1.1.1)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / f"fanout-final-{split}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the fanoutqa package; reinstall fanoutqa==1.1.1")
    return path


def _evidence_titles(question: dict[str, Any]) -> list[str]:
    titles = [question["evidence"]["title"]] if question.get("evidence") else []
    for sub in question.get("decomposition") or ():
        titles += _evidence_titles(sub)
    return titles


def answer_text(answer: Any) -> str:
    """A FanOutQA answer (string, number, list or {key: value}) as one string."""
    if isinstance(answer, dict):
        return "; ".join(f"{key}: {answer_text(value)}" for key, value in answer.items())
    if isinstance(answer, (list, tuple)):
        return ", ".join(answer_text(value) for value in answer)
    if isinstance(answer, bool):
        return "yes" if answer else "no"
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer)


def _leaves(question: dict[str, Any]) -> Iterable[dict[str, Any]]:
    for sub in question.get("decomposition") or ():
        if sub.get("evidence") and not sub.get("decomposition"):
            yield sub
        yield from _leaves(sub)


def fanoutqa_questions(documents: Sequence[Document], split: str = "dev", level: str = "full") -> list[dict]:
    """FanOutQA questions answerable from the corpus' articles (see the module docstring)."""
    if level not in ("full", "sub"):
        raise ValueError(f"level={level!r}; expected 'full' (multi-hop) or 'sub' (single-hop sub-questions)")
    titles = {d.title for d in documents}
    texts = {d.title: d.text.lower() for d in documents}
    rows = []
    for question in json.loads(fanoutqa_path(split).read_text()):
        if level == "full":
            evidence = list(dict.fromkeys(_evidence_titles(question)))
            if evidence and all(title in titles for title in evidence):
                rows.append(
                    {
                        "id": f"foqa-{question['id']}",
                        "question": question["question"],
                        "answer": [answer_text(question["answer"])],
                        "gold_titles": evidence,
                        "type": "fanoutqa",
                        "source": f"fanoutqa-{split}",
                    }
                )
            continue
        for sub in _leaves(question):
            title = sub["evidence"]["title"]
            if title in titles:
                answer = answer_text(sub["answer"])
                rows.append(
                    {
                        "id": f"foqa-{sub['id']}",
                        "question": sub["question"],
                        "answer": [answer],
                        "gold_titles": [title],
                        "type": "fanoutqa_sub",
                        "source": f"fanoutqa-{split}",
                        "answer_in_corpus": answer.lower() in texts[title],
                    }
                )
    unique = {row["id"]: row for row in rows}  # a sub-question can be shared by several questions
    return list(unique.values())
