"""Corpora: documents chunked into passages with stable ids, their indexes, and the on-disk cache.

A corpus comes from a built-in source (``wiki``, ``shakespeare``; see ``envs/sources.py``)
or local JSONL/Parquet/text files, described by a ``CorpusConfig``. ``load_corpus``
returns a ``Corpus`` with the requested indexes (``bm25``, ``dense``; ``hybrid`` fuses
the two), building whatever the cache lacks.

Passage ids are ``<doc id>#<chunk number>``: stable as long as the input and the
chunking settings are. Chunks follow paragraph and sentence ends near ``chunk_words``
words and keep their character span in the document, so paged reading and evidence
bookkeeping can map between the two.

Cache layout (``<cache_dir>/<name>/``): ``manifest.json``, ``documents.parquet``,
``passages.parquet``, ``bm25/``, ``dense/``. Each part carries a key: SHA-256 of the
input files plus the settings it depends on. Changed input rebuilds everything;
changed BM25 settings rebuild only BM25; dense vectors (slow: ~22 passages/s on two
cores) survive anything that leaves the passages alone. Builds run under a file lock
and are written to a temporary directory first, so a crash never leaves half a cache.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from k3rl.envs.index import BM25Index, BM25Params, BM25Tokenizer, DenseIndex, DenseParams, Progress, rrf
from k3rl.envs.sources import (
    BUILTIN_SOURCES,
    CorpusError,
    CorpusFileNotFoundError,
    CorruptCorpusError,
    Document,
    SourceUnavailableError,
    builtin_checksum,
    builtin_documents,
    builtin_texts,
    data_dir,
    fetch_shakespeare,
    load_documents,
    sha256_file,
)
from k3rl.util.atomic import atomic_dir, write_text_atomic

__all__ = [
    "BM25Params", "Corpus", "CorpusConfig", "CorpusError", "CorpusFileNotFoundError", "CorruptCorpusError",
    "DenseParams", "Document", "Hit", "Passage", "SourceUnavailableError", "builtin_texts", "chunk_document",
    "data_dir", "fetch_shakespeare", "load_corpus",
]

CACHE_FORMAT = 1
METHODS = ("bm25", "dense", "hybrid")


@dataclass(frozen=True)
class Passage:
    """A chunk of a document: ``text == document.text[start:end]``."""

    id: str
    doc_id: str
    title: str
    text: str
    start: int
    end: int


@dataclass(frozen=True)
class Hit:
    """One search result."""

    passage: Passage
    score: float
    rank: int


@dataclass
class CorpusConfig:
    """What a corpus is made of and how it is indexed (the YAML of ``k3rl corpus build``)."""

    name: Optional[str] = None
    """Cache folder name, one cache per name; default: the source's name, or the first file's stem."""
    source: Optional[str] = None
    """Built-in source (wiki, shakespeare); default: wiki when no ``files`` are given."""
    files: list[str] = field(default_factory=list)
    """Local JSONL / Parquet / text files (one document per row, or per text file)."""
    format: str = "auto"
    """auto (from the file suffix), json, parquet or text."""
    text_field: str = "text"
    title_field: str = "title"
    id_field: str = "id"
    limit: Optional[int] = None
    """Keep only the first N documents (a quick subset)."""
    chunk_words: int = 100
    """Target passage length in words."""
    indexes: list[str] = field(default_factory=lambda: ["bm25"])
    """Indexes to build: bm25 and/or dense (hybrid search needs both)."""
    bm25: BM25Params = field(default_factory=BM25Params)
    dense: DenseParams = field(default_factory=DenseParams)
    rrf_k: int = 60
    """Constant of reciprocal-rank fusion for hybrid search."""
    cache_dir: Optional[str] = None
    """Default: ``$K3RL_DATA/corpora`` (``~/.cache/k3rl/corpora``)."""

    def __post_init__(self) -> None:
        # A files-only config needs no `source: null`; a config with neither is the wiki default.
        if self.source is None and not self.files:
            self.source = "wiki"
        if self.name is None:
            self.name = self.source or Path(str(self.files[0])).stem


_WORD = re.compile(r"\S+")
_SENTENCE_END = re.compile(r"[.!?;:][\"')\]]*$")


def chunk_document(doc: Document, words: int = 100) -> list[Passage]:
    """Split a document into passages of about ``words`` words.

    A chunk ends at the paragraph break nearest to ``words`` words (within ±50%), else
    at the last sentence end after half the target, else after exactly ``words`` words.
    """
    if words < 1:
        raise ValueError("chunk_words must be >= 1")
    spans = [(m.start(), m.end()) for m in _WORD.finditer(doc.text)]
    if not spans:
        return []
    text = doc.text
    para_start = [i > 0 and "\n\n" in text[spans[i - 1][1] : spans[i][0]].replace("\r", "") for i in range(len(spans))]
    out: list[Passage] = []
    i, n = 0, len(spans)
    while i < n:
        if n - i <= words * 1.5:
            j = n
        else:
            lo, hi, target = i + max(1, words // 2), min(n, i + words * 3 // 2), i + words
            breaks = [p for p in range(lo, hi + 1) if p < n and para_start[p]]
            if breaks:
                j = min(breaks, key=lambda p: (abs(p - target), p))
            else:
                ends = [p for p in range(lo, target + 1) if _SENTENCE_END.search(text[spans[p - 1][0] : spans[p - 1][1]])]
                j = ends[-1] if ends else target
        start, end = spans[i][0], spans[j - 1][1]
        out.append(Passage(f"{doc.id}#{len(out)}", doc.id, doc.title, text[start:end], start, end))
        i = j
    return out


class Corpus:
    """Documents, their passages and the indexes over the passages."""

    def __init__(
        self,
        name: str,
        documents: Sequence[Document],
        passages: Sequence[Passage],
        bm25: BM25Index | None = None,
        dense: DenseIndex | None = None,
        rrf_k: int = 60,
        manifest: dict[str, Any] | None = None,
    ):
        self.name = name
        self.documents = {d.id: d for d in documents}
        self.passages = list(passages)
        self.bm25 = bm25
        self.dense = dense
        self.rrf_k = rrf_k
        self.manifest = manifest or {}
        self._pos = {p.id: i for i, p in enumerate(self.passages)}
        self._by_doc: dict[str, list[int]] = {}
        for i, p in enumerate(self.passages):
            self._by_doc.setdefault(p.doc_id, []).append(i)
        for index in (bm25, dense):
            if index is not None and index.size != len(self.passages):
                raise CorruptCorpusError(f"corpus {name!r}: index has {index.size} rows for {len(self.passages)} passages")

    @classmethod
    def from_documents(
        cls,
        documents: Iterable[Document],
        name: str = "memory",
        chunk_words: int = 100,
        indexes: Sequence[str] = ("bm25",),
        bm25: BM25Params | None = None,
        dense: DenseParams | None = None,
        progress: Progress | None = None,
    ) -> Corpus:
        """An in-memory corpus (no cache), e.g. the haystack of one long-context task."""
        docs = list(documents)
        passages = [p for d in docs for p in chunk_document(d, chunk_words)]
        return cls.from_passages(docs, passages, name, indexes, bm25, dense, progress)

    @classmethod
    def from_passages(
        cls,
        documents: Sequence[Document],
        passages: Sequence[Passage],
        name: str = "memory",
        indexes: Sequence[str] = ("bm25",),
        bm25: BM25Params | None = None,
        dense: DenseParams | None = None,
        progress: Progress | None = None,
    ) -> Corpus:
        """An in-memory corpus over given passages (their ids are kept as they are)."""
        _check_indexes(indexes)
        texts = [index_text(p) for p in passages]
        b = _build_bm25(name, texts, bm25 or BM25Params(), progress) if "bm25" in indexes else None
        d = DenseIndex.build(texts, dense or DenseParams(), progress) if "dense" in indexes else None
        return cls(name, documents, passages, b, d)

    @property
    def methods(self) -> list[str]:
        """Search methods this corpus can serve."""
        out = [m for m, idx in (("bm25", self.bm25), ("dense", self.dense)) if idx is not None]
        return out + (["hybrid"] if len(out) == 2 else [])

    def passage(self, passage_id: str) -> Passage | None:
        i = self._pos.get(passage_id)
        return None if i is None else self.passages[i]

    def position(self, passage_id: str) -> int | None:
        return self._pos.get(passage_id)

    def document(self, doc_id: str) -> Document | None:
        return self.documents.get(doc_id)

    def passages_of(self, doc_id: str) -> list[Passage]:
        return [self.passages[i] for i in self._by_doc.get(doc_id, [])]

    def search(self, query: str, k: int = 5, method: str = "bm25") -> list[Hit]:
        """The ``k`` best passages for ``query`` with ``bm25``, ``dense`` or ``hybrid`` (RRF)."""
        if method not in self.methods:
            raise ValueError(f"corpus {self.name!r} cannot search with {method!r}; available: {', '.join(self.methods) or 'none'}")
        if method == "hybrid":
            depth = max(k, 50)
            a, _ = self.bm25.search(query, depth)
            b, _ = self.dense.search(query, depth)
            fused = rrf([a.tolist(), b.tolist()], self.rrf_k)[:k]
            return [Hit(self.passages[i], s, r) for r, (i, s) in enumerate(fused, 1)]
        index = self.bm25 if method == "bm25" else self.dense
        idx, scores = index.search(query, k)
        return [Hit(self.passages[int(i)], float(s), r) for r, (i, s) in enumerate(zip(idx, scores), 1)]


def index_text(p: Passage) -> str:
    """What the indexes see for a passage: the title (if any) and the text."""
    return f"{p.title}\n{p.text}" if p.title else p.text


def _build_bm25(name: str, texts: Sequence[str], params: BM25Params, progress: Progress | None) -> BM25Index:
    """The BM25 index of `texts`; `CorruptCorpusError` when no text holds a word it can index (only stop words or
    punctuation), which the index library reports as an unrelated `max()` of an empty sequence."""
    tokenize = BM25Tokenizer(params)
    if not any(tokenize(t) for t in texts):
        raise CorruptCorpusError(f"corpus {name!r}: none of its {len(texts)} passages has a word to index (only "
                                 f"stop words, one-character words or punctuation)")
    return BM25Index.build(texts, params, progress)


def _check_indexes(indexes: Sequence[str]) -> None:
    bad = [i for i in indexes if i not in ("bm25", "dense")]
    if bad:
        raise ValueError(f"unknown index {bad[0]!r}; choose from bm25, dense")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def input_checksum(config: CorpusConfig) -> str:
    """SHA-256 over the input files' contents (not their paths)."""
    if config.source:
        return _digest({"builtin": config.source, "sha": builtin_checksum(config.source)})
    if not config.files:
        raise CorpusError(f"corpus {config.name!r}: set either a built-in source or files")
    shas = []
    for f in config.files:
        path = Path(f)
        if not path.is_file():
            raise CorpusFileNotFoundError(f"corpus file not found: {path}")
        shas.append(sha256_file(path))
    return _digest({"files": shas})


def cache_keys(config: CorpusConfig) -> dict[str, str]:
    """One key per cached part: passages, bm25, dense."""
    passages = _digest({
        "format": CACHE_FORMAT, "inputs": input_checksum(config), "source": config.source,
        "fmt": config.format, "fields": [config.text_field, config.title_field, config.id_field],
        "limit": config.limit, "chunk_words": config.chunk_words,
    })
    return {
        "passages": passages,
        "bm25": _digest({"passages": passages, "bm25": asdict(config.bm25)}),
        "dense": _digest({"passages": passages, "dense": asdict(config.dense)}),
    }


_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def corpus_dir(config: CorpusConfig) -> Path:
    """The corpus's own cache folder, `<cache_dir>/<name>`. Building replaces that folder, so the name must
    be one plain folder name: an empty, absolute or dotted-path name (`''`, `/data`, `../x`) would make
    the rebuild delete something else (the cache root and every other corpus in it)."""
    name = config.name
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", ".."):
        raise CorpusError(f"corpus name {name!r}: must be a plain folder name (letters, digits, '.', '_', '-', "
                          f"not starting with '.' or '-'); the cache of a corpus is <cache_dir>/<name>")
    return Path(config.cache_dir or data_dir() / "corpora") / name


def read_documents(config: CorpusConfig) -> list[Document]:
    """The configuration's documents (the first ``limit`` of them)."""
    if config.source:
        if config.files:
            raise CorpusError(f"corpus {config.name!r}: set a built-in source or files, not both")
        if config.source not in BUILTIN_SOURCES:
            raise CorpusError(f"corpus {config.name!r}: unknown source {config.source!r}; choose from {', '.join(BUILTIN_SOURCES)}")
        docs = builtin_documents(config.source)
        docs = list(docs) if config.limit is None else [d for _, d in zip(range(config.limit), docs)]
    else:
        docs = load_documents(config.files, config.format, config.text_field, config.title_field, config.id_field)
        docs = docs if config.limit is None else docs[: config.limit]
    if not docs:
        raise CorruptCorpusError(f"corpus {config.name!r}: the inputs hold no documents")
    return docs


def load_corpus(config: CorpusConfig | str, progress: Progress | None = None, rebuild: bool = False) -> Corpus:
    """Load a corpus from its cache, building the parts that are missing or stale.

    ``config`` may be a ``CorpusConfig`` or a built-in source name (BM25 only).
    """
    if isinstance(config, str):
        config = CorpusConfig(name=config, source=config)
    _check_indexes(config.indexes)
    from filelock import FileLock

    root = corpus_dir(config)
    root.parent.mkdir(parents=True, exist_ok=True)
    keys = cache_keys(config)
    with FileLock(str(root) + ".lock"):
        manifest = _read_manifest(root)
        if rebuild or manifest.get("keys", {}).get("passages") != keys["passages"]:
            manifest = _build_passages(config, root, keys, progress)
        try:
            docs, passages = _read_passages(root)
        except Exception as exc:
            warnings.warn(f"corpus cache {root} is unreadable ({exc}); rebuilding", stacklevel=2)
            manifest = _build_passages(config, root, keys, progress)
            docs, passages = _read_passages(root)
        bm25 = dense = None
        texts = None
        if "bm25" in config.indexes:
            bm25 = _cached_part(root, manifest, keys, "bm25", lambda p: BM25Index.load(p, config.bm25))
            if bm25 is None:
                texts = texts or [index_text(p) for p in passages]
                started = time.perf_counter()
                bm25 = _build_bm25(config.name, texts, config.bm25, progress)
                _save_part(root, manifest, keys, "bm25", bm25.save, time.perf_counter() - started, asdict(config.bm25))
        if "dense" in config.indexes:
            dense = _cached_part(root, manifest, keys, "dense", lambda p: DenseIndex.load(p, config.dense))
            if dense is None:
                texts = texts or [index_text(p) for p in passages]
                started = time.perf_counter()
                dense = DenseIndex.build(texts, config.dense, progress)
                _save_part(root, manifest, keys, "dense", dense.save, time.perf_counter() - started, asdict(config.dense))
    return Corpus(config.name, docs, passages, bm25, dense, config.rrf_k, manifest)


def _read_manifest(root: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((root / "manifest.json").read_text())
        return manifest if isinstance(manifest, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    write_text_atomic(root / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True))


def _build_passages(config: CorpusConfig, root: Path, keys: dict[str, str], progress: Progress | None) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    started = time.perf_counter()
    if progress:
        progress("read documents", 0, 1)
    docs = read_documents(config)
    passages: list[Passage] = []
    for i, d in enumerate(docs):
        passages.extend(chunk_document(d, config.chunk_words))
        if progress and (i % max(1, len(docs) // 50) == 0 or i == len(docs) - 1):
            progress("chunk", i + 1, len(docs))
    with atomic_dir(root) as tmp:
        pq.write_table(pa.table({"id": [d.id for d in docs], "title": [d.title for d in docs], "text": [d.text for d in docs]}),
                       tmp / "documents.parquet")
        pq.write_table(pa.table({
            "id": [p.id for p in passages], "doc_id": [p.doc_id for p in passages],
            "start": pa.array([p.start for p in passages], pa.int64()), "end": pa.array([p.end for p in passages], pa.int64()),
        }), tmp / "passages.parquet")
        settings = {k: v for k, v in asdict(config).items() if k not in ("bm25", "dense", "cache_dir", "indexes")}
        manifest = {
            "name": config.name, "format": CACHE_FORMAT, "config": settings, "keys": {"passages": keys["passages"]},
            "documents": len(docs), "passages": len(passages), "build_seconds": {"passages": time.perf_counter() - started},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        _write_manifest(tmp, manifest)
    return manifest


def _read_passages(root: Path) -> tuple[list[Document], list[Passage]]:
    import pyarrow.parquet as pq

    d = pq.read_table(root / "documents.parquet").to_pydict()
    docs = [Document(i, t, x) for i, t, x in zip(d["id"], d["title"], d["text"])]
    by_id = {doc.id: doc for doc in docs}
    p = pq.read_table(root / "passages.parquet").to_pydict()
    passages = []
    for pid, doc_id, start, end in zip(p["id"], p["doc_id"], p["start"], p["end"]):
        doc = by_id[doc_id]
        passages.append(Passage(pid, doc_id, doc.title, doc.text[start:end], start, end))
    return docs, passages


def _cached_part(root: Path, manifest: dict, keys: dict, part: str, load) -> Any:
    if manifest.get("keys", {}).get(part) != keys[part] or not (root / part).is_dir():
        return None
    try:
        return load(root / part)
    except Exception as exc:
        warnings.warn(f"cached {part} index in {root} is unreadable ({exc}); rebuilding it", stacklevel=2)
        return None


def _save_part(root: Path, manifest: dict, keys: dict, part: str, save, seconds: float, params: dict) -> None:
    with atomic_dir(root / part) as tmp:
        save(tmp)
    manifest.setdefault("keys", {})[part] = keys[part]
    manifest.setdefault("build_seconds", {})[part] = seconds
    manifest[part] = params
    _write_manifest(root, manifest)


def corpus_stats(corpus: Corpus) -> dict[str, Any]:
    """Sizes of a corpus, for logs and the CLI."""
    words = np.array([len(p.text.split()) for p in corpus.passages]) if corpus.passages else np.zeros(1)
    return {
        "documents": len(corpus.documents), "passages": len(corpus.passages), "methods": corpus.methods,
        "words_per_passage": {"mean": float(words.mean()), "max": int(words.max())},
    }
