"""Hybrid retrieval: BM25 and the dense retriever fused by reciprocal rank fusion (RRF).

    index = SearchIndex.default(retriever="hybrid")          # the cached BM25 index + the cached embeddings
    index.search("who painted the Mona Lisa", k=5)           # scores are RRF scores, best first

RRF (Cormack, Clarke and Büttcher, 2009) scores a document by the sum over the rankings that contain it of
1 / (rrf_k + rank), rank counted from 1; a document only one side found gets only that side's term. Each side
retrieves `max(k, candidates)` documents (50 by default), so a document ranked, say, 12th by BM25 and 2nd by the
dense side can still reach the fused top 5.

Ties: documents with equal scores inside one ranking share the better rank (competition ranking "1224"), so
the fused order does not depend on how a retriever happens to order its ties. Documents with equal fused scores
are ordered by their best rank on either side, then by which side gave that rank (BM25 first), then by document
number, so the output is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

RRF_K = 60
CANDIDATES = 50


def competition_ranks(ranking: Sequence[tuple[int, float]]) -> list[tuple[int, int]]:
    """(document, rank) for a best-first [(document, score)] list; tied scores share the better rank."""
    ranked, previous_score, previous_rank = [], None, 0
    for position, (document, score) in enumerate(ranking, start=1):
        rank = previous_rank if previous_score is not None and score == previous_score else position
        ranked.append((int(document), rank))
        previous_score, previous_rank = score, rank
    return ranked


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[tuple[int, float]]], rrf_k: float = RRF_K
) -> list[tuple[int, float]]:
    """Fuses best-first [(document, score)] rankings into one best-first [(document, rrf_score)] list holding
    every document of any ranking (see the module docstring for the rank and tie rules)."""
    if rrf_k < 0:
        raise ValueError(f"rrf_k={rrf_k}; expected rrf_k >= 0")
    scores: dict[int, float] = {}
    best: dict[int, tuple[int, int]] = {}  # document -> (best rank, index of the ranking that gave it)
    for side, ranking in enumerate(rankings):
        seen = set()
        for document, rank in competition_ranks(ranking):
            if document in seen:  # a retriever listing a document twice counts it once, at its better rank
                continue
            seen.add(document)
            scores[document] = scores.get(document, 0.0) + 1.0 / (rrf_k + rank)
            best[document] = min(best.get(document, (rank, side)), (rank, side))
    order = sorted(scores, key=lambda d: (-scores[d], best[d][0], best[d][1], d))
    return [(d, scores[d]) for d in order]


class HybridRetriever:
    """BM25 + dense retrieval fused by RRF; the same `search(query, k)` interface as Bm25 and DenseRetriever.

    bm25, dense: the two retrievers over the same documents (same document numbers). rrf_k: the RRF constant
    (60). candidates: how deep each side retrieves, at least `k` (50).
    """

    def __init__(self, bm25: Any, dense: Any, *, rrf_k: float = RRF_K, candidates: int = CANDIDATES):
        if bm25.num_documents != dense.num_documents:
            raise ValueError(
                f"the BM25 index has {bm25.num_documents} documents and the dense one {dense.num_documents}; "
                "they must index the same corpus"
            )
        if candidates < 1:
            raise ValueError(f"candidates={candidates}; expected at least 1")
        if rrf_k < 0:
            raise ValueError(f"rrf_k={rrf_k}; expected rrf_k >= 0")
        self.bm25, self.dense = bm25, dense
        self.rrf_k, self.candidates = rrf_k, candidates
        self.num_documents = bm25.num_documents

    def rankings(self, query: str, k: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """(BM25 ranking, dense ranking), each `max(k, candidates)` deep (BM25: fewer when few documents share a
        term with the query)."""
        depth = max(k, self.candidates)
        return self.bm25.search(query, depth), self.dense.search(query, depth)

    def search(self, query: str, k: int = 10) -> list[tuple[int, float]]:
        if k < 1:
            raise ValueError(f"k={k}; expected k >= 1")
        return reciprocal_rank_fusion(self.rankings(query, k), self.rrf_k)[:k]
