"""The search environment: a chain's window onto the shared Wikipedia index, recording what it retrieved.

    env = SearchEnv()                                   # the process-wide SearchIndex.default()
    await env.reset(task)                               # remembers the task's gold articles, if any
    result = await env.step({"query": "Mona Lisa painter", "k": 5})
    result.observation                                  # numbered titles, short descriptions and snippets
    result.info["titles"], env.retrieved_titles         # what was shown, for metrics and rewards

The index is built or loaded once per process and shared read-only; an env only keeps per-chain records
(queries, titles shown, whether a gold article was retrieved).
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentfly_jax.envs.base import Environment, StepResult
from environments.search.index import SearchIndex

MAX_K = 20


def format_results(results: list[dict[str, Any]], index: SearchIndex, snippet_chars: int) -> str:
    """Numbered results: "1. Title — short description" and the start of the summary."""
    if not results:
        return "No results. Try other words."
    lines = []
    for rank, result in enumerate(results, start=1):
        document = index.get(result["title"])
        description = f" — {document.description}" if document is not None and document.description else ""
        text = result["text"]
        snippet = text if len(text) <= snippet_chars else text[:snippet_chars].rsplit(" ", 1)[0] + " ..."
        lines.append(f"{rank}. {result['title']}{description}\n   {snippet}")
    return "\n".join(lines)


class SearchEnv(Environment):
    """Search over the Wikipedia summaries for one chain.

    retriever: "bm25" (default), "dense" or "hybrid" (both, fused by reciprocal rank fusion with constant
    `rrf_k`). cache: the cache directory (default: see environments.search.corpus). default_k: results per
    query when the action does not say. snippet_chars: summary characters shown per result.
    """

    def __init__(
        self,
        *,
        retriever: str = "bm25",
        rrf_k: float = 60,
        cache: str | None = None,
        default_k: int = 5,
        snippet_chars: int = 400,
        index: SearchIndex | None = None,
    ):
        if not 1 <= default_k <= MAX_K:
            raise ValueError(f"default_k={default_k}; expected 1..{MAX_K}")
        self.index = index if index is not None else SearchIndex.default(
            cache, retriever=retriever, rrf_k=rrf_k
        )
        self.default_k = default_k
        self.snippet_chars = snippet_chars
        self.gold_titles: set[str] = set()
        self.queries: list[str] = []
        self.retrieved_titles: list[str] = []

    async def reset(self, task: Any = None) -> str:
        """Forgets the previous chain's records; keeps the task's `gold_titles` (when given) for metrics."""
        gold = (task or {}).get("gold_titles") if isinstance(task, dict) else None
        self.gold_titles = set(gold or ())
        self.queries, self.retrieved_titles = [], []
        return "Search the Wikipedia summaries with a query."

    async def step(self, action: Any) -> StepResult:
        """Runs one query: a string, or {"query": ..., "k": ...}."""
        if isinstance(action, dict):
            query, k = action.get("query", ""), action.get("k", self.default_k)
        else:
            query, k = str(action), self.default_k
        if not isinstance(k, int) or not 1 <= k <= MAX_K:
            return StepResult(
                f"Error: k must be an integer from 1 to {MAX_K}, got {k!r}.", info={"error": "bad_k"}
            )
        if not str(query).strip():
            return StepResult(
                "Error: the query is empty; write some words to search for.", info={"error": "empty_query"}
            )
        results = self.index.search(str(query), k)
        titles = [result["title"] for result in results]
        self.queries.append(str(query))
        self.retrieved_titles.extend(t for t in titles if t not in self.retrieved_titles)
        gold_hits = [t for t in titles if t in self.gold_titles]
        return StepResult(
            format_results(results, self.index, self.snippet_chars),
            info={"titles": titles, "scores": [r["score"] for r in results], "gold_hits": gold_hits},
        )

    def gold_recall(self) -> float | None:
        """Fraction of the task's gold articles retrieved so far (None without gold articles)."""
        if not self.gold_titles:
            return None
        return len(self.gold_titles & set(self.retrieved_titles)) / len(self.gold_titles)


async def create_search_env(**kwargs: Any) -> SearchEnv:
    """Pool factory: loads (or builds) the shared index in a worker thread the first time."""
    return await asyncio.to_thread(SearchEnv, **kwargs)
