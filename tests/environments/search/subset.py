"""A search cache over a subset of the real Wikipedia corpus, for the dense and hybrid tests.

Embedding all 10,033 summaries takes 15 to 20 minutes on two CPU cores, too long for a CI run without a cache.
These tests embed instead the gold articles of the questions they ask plus a fixed sample of other real
summaries (the distractors), with the real all-MiniLM-L6-v2 encoder: about a minute on two cores. The
full-corpus figures are `scripts/bench_retrieval.py`'s (docs/benchmarks.md).
"""

from pathlib import Path

from environments.search.corpus import load_corpus, subset, write_corpus
from environments.search.questions import generated_questions, split_questions

#: (question, gold article) pairs the hybrid retriever must answer (tests/environments/search/test_hybrid.py)
KNOWN_QUESTIONS = [
    ("who painted the Mona Lisa", "Mona Lisa"),
    ("What is the name of the 1995 film by John Lasseter?", "Toy Story"),
    ("the physicist who developed the theory of relativity", "Albert Einstein"),
    ("In what year was Marie Curie born?", "Marie Curie"),
    ("the capital city of France", "Paris"),
]
#: the held-out generated questions the recall check asks (tests/scripts/test_bench_retrieval.py)
BENCH_QUESTIONS = 40
#: other real summaries drawn with random.Random(SEED)
SAMPLE, SEED = 1500, 0


def subset_titles(documents) -> list[str]:
    """The gold articles of the known questions and of the first BENCH_QUESTIONS held-out generated ones."""
    _, heldout = split_questions(generated_questions(documents))
    return [title for _, title in KNOWN_QUESTIONS] + [row["gold_titles"][0] for row in heldout[:BENCH_QUESTIONS]]


def build_subset_cache(directory: Path) -> Path:
    """Writes the subset corpus into `directory` (its indexes are built there on first use); returns it."""
    documents = load_corpus()
    write_corpus(subset(documents, subset_titles(documents), sample=SAMPLE, seed=SEED), directory)
    return directory
