"""Figures of the search and WebShop environments (docs/benchmarks.md, "Environments: WebShop and search").

    .venv/bin/python scripts/bench_search_webshop.py [--json out.json]

Search: BM25 index build time over the 10,033 summaries (fresh, in a temporary cache holding only the corpus),
its size on disk, load time from the cache, query latency (p50 / p99 over the held-out generated questions,
one query at a time), top-5 recall of the gold article for 50 held-out questions (the test's sample) and for
all held-out questions, per question type.
WebShop: shop build time (catalog + product index), session step latency, and the mean reward and success
of the oracle and random shoppers on every held-out goal (text sessions, no agent).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runnable from a checkout

from environments.search.corpus import CORPUS_FILE, cache_dir  # noqa: E402
from environments.search.index import SearchIndex  # noqa: E402
from environments.search.questions import generated_questions, split_questions  # noqa: E402


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_search() -> dict:
    index = SearchIndex.default()  # makes sure the corpus is cached
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(cache_dir() / CORPUS_FILE, Path(tmp) / CORPUS_FILE)
        start = time.perf_counter()
        built = SearchIndex._cached_bm25(Path(tmp))
        build_wall = time.perf_counter() - start
        loaded = SearchIndex._cached_bm25(Path(tmp))
        size = built.size_bytes
    _, heldout = split_questions(generated_questions(index.documents))
    latencies = []
    for q in heldout:
        t0 = time.perf_counter()
        loaded.search(q["question"], 5)
        latencies.append(time.perf_counter() - t0)
    hits, totals = Counter(), Counter()
    for q in heldout:
        totals[q["type"]] += 1
        hits[q["type"]] += q["gold_titles"][0] in [r["title"] for r in loaded.search(q["question"], 5)]
    sample = random.Random(0).sample(heldout, 50)
    sample_hits = sum(
        q["gold_titles"][0] in [r["title"] for r in loaded.search(q["question"], 5)] for q in sample
    )
    return {
        "documents": len(index),
        "index_build_s": round(built.build_seconds, 3),
        "index_build_and_save_wall_s": round(build_wall, 3),
        "index_size_mb": round(size / 2**20, 2),
        "index_load_s": round(loaded.load_seconds, 3),
        "query_latency_ms_p50": round(1000 * percentile(latencies, 0.5), 3),
        "query_latency_ms_p99": round(1000 * percentile(latencies, 0.99), 3),
        "queries": len(latencies),
        "top5_recall_50_heldout": sample_hits / 50,
        "top5_recall_all_heldout": round(sum(hits.values()) / sum(totals.values()), 4),
        "heldout_questions": sum(totals.values()),
        "top5_recall_by_type": {t: round(hits[t] / totals[t], 4) for t in sorted(totals)},
    }


def bench_webshop() -> dict:
    from environments.webshop.oracle import OracleShopper, RandomShopper
    from environments.webshop.shop import Shop, ShopSession, catalog_from_config

    start = time.perf_counter()
    shop = Shop(catalog_from_config(source="generated", seed=0, num_products=1000))
    build_s = time.perf_counter() - start
    results = {}
    step_s = []
    for name, make in (
        ("oracle", lambda goal, i: OracleShopper(goal)),
        ("random", lambda goal, i: RandomShopper(i)),
    ):
        rewards, actions = [], []
        for i, goal in enumerate(shop.catalog.heldout_goals):
            session, shopper = ShopSession(shop, goal), make(goal, i)
            observation, reward = session.observation(), 0.0
            for _ in range(40 if name == "oracle" else 15):
                t0 = time.perf_counter()
                outcome = session.act(shopper.act(observation))
                step_s.append(time.perf_counter() - t0)
                observation = outcome.observation
                if outcome.done:
                    reward = outcome.reward or 0.0
                    break
            rewards.append(reward)
            actions.append(session.actions)
        results[name] = {
            "reward_mean": round(statistics.mean(rewards), 4),
            "success": round(sum(r == 1.0 for r in rewards) / len(rewards), 4),
            "actions_mean": round(statistics.mean(actions), 2),
        }
    return {
        "products": len(shop.products),
        "train_goals": len(shop.catalog.train_goals),
        "heldout_goals": len(shop.catalog.heldout_goals),
        "shop_build_s": round(build_s, 3),
        "step_latency_ms_p50": round(1000 * percentile(step_s, 0.5), 3),
        "step_latency_ms_p99": round(1000 * percentile(step_s, 0.99), 3),
        **results,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    summary = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "search": bench_search(),
        "webshop": bench_webshop(),
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
