"""Recall@1/@5/@10 of the search environment's retrievers (BM25, dense, hybrid) on three question sets.

    .venv/bin/python scripts/bench_retrieval.py                    # all held-out questions, markdown table
    .venv/bin/python scripts/bench_retrieval.py --num 100 --json out.json

Recall@k: the fraction of questions whose gold article is among the top k results (each question here has
one gold article). The question sets:

- generated:   the environment's generated single-hop questions, held-out split (`split_questions`).
- paraphrased: the same questions rewritten away from the article's wording by `paraphrase` (below):
  every question gets a new template ("In what year was X born?" -> "What was the birth year of X?",
  "... die?" -> "When did X pass away?", "What is the name of the D?" -> "Name the D'.",
  'Which subject does this sentence describe? "___ S"' -> "What is described here: S'?"); in D and S the
  lower-case words found in a hand-written synonym table (~230 frequent words) are replaced, capitalised words
  (names, places) are kept, words of the gold title are dropped, "D by Name" becomes "Name's D", and a cloze
  sentence's last comma-separated clause is moved to the front. Birth/death-year questions keep the person's
  name: it is their only handle, so for them only the template changes.
- fanoutqa_sub: FanOutQA dev sub-questions whose evidence article is in the corpus (their own wording, written
  by people; the gold article is the sub-question's evidence article).

The paraphrases are deterministic (no randomness, no model). They are a stress test of lexical overlap, not
natural questions: a synonym table can produce awkward phrasing, and it only covers frequent words.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from environments.search.questions import (
    fanoutqa_questions,
    generated_questions,
    plain_title,
    split_questions,
)

RETRIEVERS = ("bm25", "dense", "hybrid")
KS = (1, 5, 10)

# ----------------------------------------------------------------------------------------- paraphrases

#: Hand-written synonyms for frequent content words of the generated questions (lower case, whole words;
#: capitalised words are never replaced). A replacement may be several words; the table is applied once, left
#: to right (no chains).
SYNONYMS: dict[str, str] = {
    "city": "town", "cities": "towns", "capital": "seat of government", "largest": "biggest",
    "chemical": "chem", "number": "count", "element": "substance", "state": "province",
    "states": "provinces", "family": "lineage", "most": "highly", "empire": "imperial realm", "political": "civic", "populous": "crowded", "language": "tongue",
    "philosopher": "thinker", "study": "research", "first": "earliest", "dynasty": "ruling house",
    "north": "northerly", "used": "employed", "system": "framework",
    "central": "middle", "species": "kind of organism", "south": "southerly", "ancient": "antique",
    "poet": "versifier", "until": "till", "symbol": "sign", "people": "folk", "novel": "book of fiction",
    "region": "area", "king": "monarch", "island": "isle", "period": "era", "genus": "taxon",
    "human": "person", "known": "recognised", "writer": "wordsmith", "founder": "originator",
    "century": "hundred years", "form": "shape", "plants": "flora", "plant": "flora", "major": "big",
    "president": "head of state", "star": "sun-like body", "leader": "chief", "death": "demise",
    "new": "novel", "east": "easterly", "group": "cluster", "southern": "southerly", "made": "built",
    "country": "nation", "author": "writer", "film": "movie", "constellation": "star pattern",
    "ocean": "sea", "northern": "northerly", "philosophical": "philosophic", "second": "next",
    "force": "power", "republic": "commonwealth", "process": "procedure", "politician": "statesman",
    "kingdom": "realm", "range": "chain", "series": "sequence", "social": "societal", "type": "kind",
    "work": "piece", "sea": "ocean", "classical": "traditional", "river": "stream", "material": "matter",
    "emperor": "sovereign", "use": "usage", "moon": "satellite", "near": "close to", "mountain": "peak",
    "earth": "the globe", "rock": "stone", "including": "such as", "early": "initial",
    "physical": "bodily", "objects": "things", "eastern": "easterly", "flowering": "blooming",
    "music": "melodies", "two": "a pair of", "world": "globe", "widely": "broadly", "lake": "pond",
    "scientific": "scholarly", "area": "zone", "province": "territory", "light": "radiation",
    "developed": "devised", "brightest": "most luminous", "school": "academy", "church": "congregation",
    "general": "overall", "published": "issued", "water": "H2O", "surface": "exterior", "part": "portion",
    "musical": "melodic", "written": "penned", "composed": "authored", "native": "indigenous",
    "called": "named", "sport": "game", "military": "armed forces", "revolutionary": "insurgent",
    "humans": "people", "coast": "shore", "during": "throughout", "years": "yrs", "small": "little",
    "archipelago": "island chain", "branch": "offshoot", "natural": "nature's", "west": "westerly",
    "animal": "creature", "forms": "shapes", "person": "individual", "considered": "regarded",
    "body": "mass", "western": "westerly", "legendary": "mythical", "designated": "named",
    "sun": "daystar", "book": "volume", "art": "artwork", "monk": "friar", "consisting": "made up",
    "ability": "capacity", "head": "chief", "cultural": "societal", "society": "community",
    "produced": "made", "municipality": "township", "refers": "points", "activities": "pursuits",
    "history": "past", "field": "domain", "single": "lone", "organisms": "life forms", "led": "headed",
    "against": "versus", "common": "widespread", "novelist": "fiction writer", "among": "amid",
    "concerned": "occupied", "indigenous": "native", "property": "attribute", "figure": "personage",
    "information": "data", "late": "final", "health": "wellbeing", "team": "squad",
    "national": "countrywide", "park": "reserve", "color": "hue", "colour": "hue", "age": "epoch",
    "biological": "biotic", "solid": "rigid", "style": "manner", "science": "discipline",
    "composer": "songwriter", "energy": "vigor", "planet": "world", "theory": "doctrine",
    "literature": "letters", "primarily": "mainly", "islands": "isles", "metropolis": "big city",
    "painter": "artist", "painting": "picture", "war": "conflict", "battle": "clash", "born": "birth",
    "large": "big", "famous": "renowned", "located": "situated", "founded": "established",
    "built": "constructed", "began": "started",
    "religion": "faith", "god": "deity", "ruler": "sovereign", "queen": "female monarch",
    "mathematician": "math scholar", "physicist": "physics scholar", "chemist": "chemistry scholar",
    "economist": "economics scholar", "actor": "performer", "singer": "vocalist", "game": "match",
    "disease": "illness", "building": "edifice", "bird": "avian", "fish": "aquatic animal",
    "word": "term", "company": "firm", "car": "automobile", "tree": "woody plant", "dog": "canine",
}

_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")


def substitute(text: str, table: Mapping[str, str] = SYNONYMS) -> str:
    """Replaces the lower-case whole words found in `table`; capitalised words (names, places) are kept."""

    def swap(match: re.Match) -> str:
        word = match.group(0)
        return word if word[0].isupper() else table.get(word, word)

    return _WORD.sub(swap, text)


def drop_words(text: str, words: set[str]) -> str:
    """`text` without the (case-insensitive) whole words in `words`, single-spaced; a dropped word's trailing
    comma or semicolon stays (on the word before it)."""
    kept: list[str] = []
    for token in text.split():
        if re.sub(r"\W", "", token).lower() not in words:
            kept.append(token)
        elif kept and token[-1] in ",;" and kept[-1][-1] not in ",;":
            kept[-1] += token[-1]
    return " ".join(kept)


def _title_words(title: str) -> set[str]:
    return {w.lower() for w in re.findall(r"\w+", title) if len(w) > 2}


def _rotate_clauses(text: str) -> str:
    """The last comma-separated part first: "A, B, C" -> "C, A, B"."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return ", ".join([parts[-1], *parts[:-1]]) if len(parts) > 1 else text


def _possessive(text: str) -> str | None:
    """ "1995 film by John Lasseter" -> "John Lasseter's 1995 film" (None when there is no "by <Name>")."""
    match = re.fullmatch(r"(.+?) by ([A-Z][\w.'-]*(?: [A-Z][\w.'-]*)*)(.*)", text)
    return f"{match.group(2)}'s {match.group(1)}{match.group(3)}" if match else None


def paraphrase(row: Mapping) -> str:
    """A generated question rewritten away from its article's wording (deterministic; see the module doc)."""
    question, kind = row["question"], row["type"]
    title = row["gold_titles"][0]
    if kind == "birth_year":
        name = question[len("In what year was ") : -len(" born?")]
        return f"What was the birth year of {name}?"
    if kind == "death_year":
        name = question[len("In what year did ") : -len(" die?")]
        return f"When did {name} pass away?"
    if kind == "description":
        description = question[len("What is the name of the ") : -1]
        text = substitute(drop_words(description, _title_words(title)))
        owned = _possessive(text)
        return f"Name {owned}." if owned else f"Name the {text}."
    if kind == "cloze":
        sentence = question.split('"', 1)[1].rsplit('"', 1)[0]
        sentence = sentence.removeprefix("___").strip().rstrip(".")
        words = _title_words(title) | _title_words(plain_title(title))
        text = _rotate_clauses(substitute(drop_words(sentence, words)))
        return f"What is described here: {text}?"
    raise ValueError(f"no paraphrase for question type {kind!r}")


# ------------------------------------------------------------------------------------------- recall


def recall_at(
    questions: Sequence[Mapping], search: Callable[[str, int], list[str]], ks: Sequence[int] = KS
) -> dict[int, float]:
    """{k: fraction of questions whose gold article is among `search(question, max(ks))`'s first k titles}."""
    depth = max(ks)
    hits = dict.fromkeys(ks, 0)
    for row in questions:
        titles = search(row["question"], depth)
        gold = row["gold_titles"][0]
        for k in ks:
            hits[k] += gold in titles[:k]
    return {k: hits[k] / len(questions) if questions else float("nan") for k in ks}


class _CachedEncoder:
    """Remembers query embeddings, so the dense and hybrid runs embed each question once."""

    def __init__(self, encoder):
        self._encoder, self._cache = encoder, {}

    def encode(self, texts, batch_size: int = 64):
        import numpy as np

        missing = [t for t in dict.fromkeys(texts) if t not in self._cache]
        if missing:
            for text, vector in zip(missing, self._encoder.encode(missing, batch_size)):
                self._cache[text] = vector
        return np.stack([self._cache[t] for t in texts])


def question_sets(documents, num: int = 0, sets: Sequence[str] = ("generated", "paraphrased", "fanoutqa_sub")):
    """{set name: [{"question", "gold_titles", "type"}]}; `num` > 0 keeps the first `num` of each."""
    _, heldout = split_questions(generated_questions(documents))
    heldout = heldout[:num] if num > 0 else heldout
    out = {}
    if "generated" in sets:
        out["generated"] = heldout
    if "paraphrased" in sets:
        out["paraphrased"] = [dict(row, question=paraphrase(row)) for row in heldout]
    if "fanoutqa_sub" in sets:
        sub = fanoutqa_questions(documents, level="sub")
        out["fanoutqa_sub"] = sub[:num] if num > 0 else sub
    return out


def bench(
    num: int = 0,
    retrievers: Sequence[str] = RETRIEVERS,
    sets: Sequence[str] = ("generated", "paraphrased", "fanoutqa_sub"),
    cache: str | None = None,
    rrf_k: float = 60,
    ks: Sequence[int] = KS,
    questions: Mapping[str, Sequence[Mapping]] | None = None,
) -> list[dict]:
    """One row per (question set, retriever): {"set", "retriever", "questions", "recall@1", ..., "seconds"}.

    questions: {set name: rows} to ask instead of `question_sets` over the index's documents (`num` and `sets`
    then unused), e.g. the full corpus' questions against the index of a subset cache holding their gold
    articles (`environments.search.corpus.write_corpus`)."""
    from environments.search.index import SearchIndex

    indexes = {name: SearchIndex.default(cache, retriever=name, rrf_k=rrf_k) for name in retrievers}
    for index in indexes.values():  # dense and hybrid share one DenseRetriever: embed each query once
        dense = getattr(index._retriever, "dense", index._retriever)
        if hasattr(dense, "encoder") and not isinstance(dense.encoder, _CachedEncoder):
            dense.encoder = _CachedEncoder(dense.encoder)
    if questions is None:
        questions = question_sets(next(iter(indexes.values())).documents, num, sets)
    rows = []
    for set_name, asked in questions.items():
        for name, index in indexes.items():
            start = time.perf_counter()
            recall = recall_at(asked, lambda q, k, index=index: [r["title"] for r in index.search(q, k)], ks)
            rows.append(
                {
                    "set": set_name,
                    "retriever": name,
                    "questions": len(asked),
                    **{f"recall@{k}": value for k, value in recall.items()},
                    "seconds": round(time.perf_counter() - start, 2),
                }
            )
    return rows


def markdown(rows: Sequence[Mapping], ks: Sequence[int] = KS) -> str:
    header = "| question set | questions | retriever | " + " | ".join(f"recall@{k}" for k in ks) + " |"
    lines = [header, "|" + "---|" * (3 + len(ks))]
    for row in rows:
        recalls = " | ".join(f"{row[f'recall@{k}']:.3f}" for k in ks)
        lines.append(f"| {row['set']} | {row['questions']} | {row['retriever']} | {recalls} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=0, help="questions per set (0: all)")
    parser.add_argument("--retrievers", default=",".join(RETRIEVERS))
    parser.add_argument("--sets", default="generated,paraphrased,fanoutqa_sub")
    parser.add_argument("--rrf-k", type=float, default=60)
    parser.add_argument("--cache", default=None, help="the corpus/index cache directory (default: the env's)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--examples", type=int, default=0, help="print this many paraphrased questions")
    args = parser.parse_args(argv)
    rows = bench(
        args.num, args.retrievers.split(","), args.sets.split(","), cache=args.cache, rrf_k=args.rrf_k
    )
    if args.examples:
        from environments.search.index import SearchIndex

        documents = SearchIndex.default(args.cache).documents
        heldout = question_sets(documents, args.examples, ("generated",))["generated"]
        for row in heldout:
            print(f"- {row['question']}\n  -> {paraphrase(row)}")
    print(markdown(rows))
    if args.json:
        meta = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine()}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
