"""A small BM25 index over a list of texts (bm25s + the Snowball English stemmer), shared by the Wikipedia
search environment and the WebShop product search.

    index = Bm25.build(["red apple", "green tea"])
    index.search("apples", k=5)        # [(0, 0.39)]: (document number, score), best first, score > 0 only
    index.save(directory); Bm25.load(directory)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path


def _require_bm25s():
    try:
        import bm25s
        import Stemmer
    except ImportError as error:
        raise ImportError(
            f"BM25 search needs the bm25s and PyStemmer packages ({error}); install the environment extras: "
            "pip install -e '.[envs]'"
        ) from error
    # bm25s sets its logger to DEBUG on import and logs a line on every index build.
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s, Stemmer


class Bm25:
    """BM25 (Lucene variant, k1=1.5, b=0.75) over stemmed, stopword-filtered English tokens."""

    def __init__(self, retriever, num_documents: int):
        bm25s, Stemmer = _require_bm25s()
        self._bm25s = bm25s
        self._stemmer = Stemmer.Stemmer("english")
        self._retriever = retriever
        self.num_documents = num_documents
        # The stemmer and the retriever's scratch arrays are not shared safely across threads.
        self._lock = threading.Lock()

    @classmethod
    def build(cls, texts: Sequence[str]) -> "Bm25":
        """An index of `texts` (document number = position in `texts`)."""
        if not texts:
            raise ValueError("cannot build a BM25 index of no documents")
        bm25s, Stemmer = _require_bm25s()
        tokens = bm25s.tokenize(
            list(texts), stopwords="en", stemmer=Stemmer.Stemmer("english"), show_progress=False
        )
        retriever = bm25s.BM25()
        retriever.index(tokens, show_progress=False)
        return cls(retriever, len(texts))

    def search(self, query: str, k: int = 10) -> list[tuple[int, float]]:
        """Up to `k` (document number, score) pairs, best first; documents sharing no term are left out."""
        if k < 1:
            raise ValueError(f"k={k}; expected k >= 1")
        k = min(k, self.num_documents)
        with self._lock:
            tokens = self._bm25s.tokenize(
                [str(query)], stopwords="en", stemmer=self._stemmer, return_ids=False, show_progress=False
            )
            if not tokens or not tokens[0]:
                return []
            documents, scores = self._retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [(int(d), float(s)) for d, s in zip(documents[0], scores[0]) if s > 0]

    def save(self, directory: str | Path) -> None:
        self._retriever.save(str(directory))

    @classmethod
    def load(cls, directory: str | Path, num_documents: int) -> "Bm25":
        bm25s, _ = _require_bm25s()
        return cls(bm25s.BM25.load(str(directory)), num_documents)
