"""The on-disk token cache of a pretraining source: tokenized once, reused while nothing it was built from changes.

`build_store` tokenizes a source's documents (rl/pretrain/sources.py) with the model's tokenizer, an EOS after every
document, and writes them incrementally to `cache_root/<name>-<key>/`; `check_sources` reads every local file
through before any work, so a bad one is a named error `path:line: what` before anything is tokenized or written.
Documents are untrusted text: a control-token string in one (`<|im_end|>`, `<tool_call>`, …) is neutralised as in
chat rendering, never a control id.

    tokens.bin      uint16 (vocab < 65536) or uint32, all documents back to back    [num_tokens]
    offsets.npy     int64, where each document starts (and the end)                 [num_docs + 1]
    manifest.json   source settings, tokenizer identity, input checksum, counts (control-token strings neutralised)
    COMPLETE        rl/checkpoint.py's manifest: the directory was renamed into place whole

`<key>` hashes the source settings (all but `streaming`, which changes how the input is read, not what), the
tokenizer (its `tokenizer.json`) and the input (built-ins: `builtin_checksum`; files: path, size, mtime), so a
changed tokenizer or file gets a new cache and an unchanged one is reused. Stale caches are left in place. Builds
run under a file lock in a temporary directory (`atomic_dir`): a crash never leaves half a cache, and ranks that
race for the same source tokenize it once. `tokens.bin` is read through a read-only `np.memmap`, so a corpus
larger than memory works.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from k3rl.envs.sources import BUILTIN_SOURCES, CorpusError, CorruptCorpusError, builtin_checksum
from k3rl.rl.checkpoint import COMPLETE, atomic_dir
from k3rl.rl.config import DataSource
from k3rl.rl.pretrain.sources import check_parquet, file_records, group_documents, records, source_files, source_kind

Progress = Callable[[str, int, int], None]
"""progress(stage, done, total): documents tokenized so far (total 0 while unknown: a stream)."""

CACHE_FORMAT = 2
"""2: control-token strings in documents neutralised (a format-1 cache may hold control ids from text)."""
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_BATCH_DOCS, _BATCH_CHARS = 256, 1 << 22
_HELDOUT = 0x68656C64


class TokenStore:
    """A tokenized source on disk: documents back to back in `tokens.bin`, each ending with EOS."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest: dict[str, Any] = json.loads((self.path / "manifest.json").read_text())
        self.name: str = self.manifest["name"]
        self.offsets = np.load(self.path / "offsets.npy")  # [num_docs + 1] int64
        self.tokens = np.memmap(self.path / "tokens.bin", dtype=np.dtype(self.manifest["dtype"]), mode="r")
        if len(self.tokens) != self.offsets[-1] or len(self.offsets) != self.manifest["num_docs"] + 1:
            raise CorruptCorpusError(f"{self.path}: tokens.bin / offsets.npy do not match manifest.json")

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)  # [num_docs] int64, EOS included

    def doc(self, i: int) -> np.ndarray:
        """Tokens of document i, its EOS last (a read-only view of the memmap)."""
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def split_heldout(self, k: int, seed: int) -> list[int]:
        """k document ids to hold out, drawn by `seed` among the longest half (sorted; training never sees them)."""
        if k <= 0:
            return []
        if k >= self.num_docs:
            raise ValueError(f"source {self.name!r}: cannot hold out {k} of its {self.num_docs} documents "
                             f"(at least one must be left to train on)")
        by_length = np.argsort(-self.doc_lengths, kind="stable")
        candidates = by_length[:max(k, (self.num_docs + 1) // 2)]
        chosen = np.random.default_rng([seed, _HELDOUT]).choice(candidates, size=k, replace=False)
        return sorted(int(i) for i in chosen)

    def __repr__(self) -> str:
        return f"TokenStore({self.name!r}, {self.num_docs} docs, {self.num_tokens} tokens, {self.path})"


def heldout_documents(store: TokenStore, ids: Sequence[int]) -> list[np.ndarray]:
    """The held-out documents' tokens (int32 copies, EOS last)."""
    return [np.asarray(store.doc(i), dtype=np.int32) for i in ids]


def tokenizer_identity(tokenizer) -> str:
    """SHA-256 of the tokenizer's `tokenizer.json` (or its vocabulary) and EOS id."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{text}\0{tokenizer.eos_token_id}".encode()).hexdigest()


def build_store(name: str, source: DataSource, tokenizer, cache_root: str | Path,
                progress: Optional[Progress] = None) -> TokenStore:
    """The token cache of `source` under `cache_root`, tokenized now unless an identical one exists.

    A document's length counts its EOS: `min_tokens: 32769` keeps documents that fill a 32K row's 32768 + 1 tokens.
    """
    if not _SAFE_NAME.match(name):
        raise ValueError(f"source name {name!r}: must be a plain folder name (letters, digits, '.', '_', '-')")
    builtin = source.path in BUILTIN_SOURCES
    files = [] if builtin else source_files(name, source)
    checksum = builtin_checksum(source.path) if builtin else _input_checksum(files)
    settings = {k: v for k, v in dataclasses.asdict(source).items() if k != "streaming"}
    tok_id = tokenizer_identity(tokenizer)
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, settings, tok_id, checksum]).encode()).hexdigest()[:12]
    root = Path(cache_root) / f"{name}-{key}"
    root.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(root) + ".lock"):
        if not (root / COMPLETE).is_file():
            vocab = len(tokenizer)
            dtype = np.dtype(np.uint16 if vocab < 1 << 16 else np.uint32)
            manifest = {"format": CACHE_FORMAT, "name": name, "key": key, "source": dataclasses.asdict(source),
                        "tokenizer": tok_id, "tokenizer_name": getattr(tokenizer, "name_or_path", ""),
                        "vocab_size": vocab, "eos_token_id": tokenizer.eos_token_id, "dtype": dtype.name,
                        "input_checksum": checksum, "files": [str(p) for p in files]}
            with atomic_dir(root) as tmp:
                texts = group_documents(records(name, source, files, root.parent), source.group_by)
                manifest.update(_write_tokens(name, texts, tokenizer, dtype, source.min_tokens, tmp, progress))
                (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return TokenStore(root)


def check_sources(sources: Mapping[str, DataSource], cache_root: str | Path) -> None:
    """Every local source's files read through without tokenizing, before any work: a file that cannot be a corpus
    is a `ConfigError` naming the source and `path:line: what is wrong`. Files a complete cache was built from
    (same paths, sizes, mtimes and settings) are not read again: they were read whole when it was built."""
    from k3rl.rl.config import ConfigError

    for name, source in sources.items():
        if not _SAFE_NAME.match(name):
            raise ConfigError(f"pretrain.sources: the name {name!r} must be a plain folder name (letters, digits, "
                              f"'.', '_', '-'): it names the source's cache directory")
        if source.path in BUILTIN_SOURCES:
            continue
        try:
            files = source_files(name, source)
            if _cached(name, source, files, Path(cache_root)):
                continue
            documents = 0
            for path in files:
                kind = source_kind(path, source)
                if kind == "parquet":
                    documents += check_parquet(path, source)
                else:
                    documents += sum(1 for _ in file_records(path, kind, source))
            if not documents:
                raise CorruptCorpusError(f"{', '.join(map(str, files[:3]))}: no document (every record is empty)")
        except CorpusError as e:
            raise ConfigError(f"pretrain.sources.{name}: {e}") from None


def _input_checksum(files: list[Path]) -> str:
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def _cached(name: str, source: DataSource, files: list[Path], cache_root: Path) -> bool:
    """Whether a complete cache of `name` was built from these very files with these settings."""
    checksum, settings = _input_checksum(files), dataclasses.asdict(source)
    for manifest in cache_root.glob(f"{glob.escape(name)}-*/manifest.json"):
        try:
            saved = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        same = {k: v for k, v in saved.get("source", {}).items() if k != "streaming"} == \
            {k: v for k, v in settings.items() if k != "streaming"}
        if same and saved.get("input_checksum") == checksum and (manifest.parent / COMPLETE).is_file():
            return True
    return False


def _write_tokens(name: str, texts: Iterator[tuple[str, Any]], tokenizer, dtype: np.dtype, min_tokens: int,
                  out: Path, progress: Optional[Progress]) -> dict[str, Any]:
    """Tokenize in batches, EOS after each document, and append to out/tokens.bin; offsets.npy at the end.

    Documents are untrusted text: every control-token string in them (`<|im_end|>`, `<|bos|>`, `<tool_call>`, …:
    each special or added token of the tokenizer) is neutralised as chat rendering does (rollout/chat.py
    `neutralize`), so the only control id a document's tokens hold is the EOS written after it; the count is
    `neutralized_control_strings` in the manifest. A conversation (a `chat` source's `messages`) is rendered as the
    agent loop renders a rollout (rollout/chat.py `render_transcript`: the template's framing and the tool-call
    markers are real, the contents neutralised), so pretraining on it trains the very tokens RL samples."""
    from k3rl.rollout.chat import ChatRenderer, control_pattern, neutralize, render_transcript

    eos = tokenizer.eos_token_id
    controls = control_pattern(tokenizer, special_only=False)
    renderer: Optional[ChatRenderer] = None

    def conversation_ids(label: str, messages: list[dict[str, str]]) -> list[int]:
        nonlocal renderer
        try:
            renderer = renderer or ChatRenderer(tokenizer)
            ids = render_transcript(renderer, messages)[0]
        except ValueError as e:
            raise CorruptCorpusError(f"pretraining source {name!r}: {label}: {e}") from None
        return ids[:-1] if ids and ids[-1] == eos else ids  # the document's EOS follows
    offsets, total, seen, dropped, neutralized = [0], 0, 0, 0, 0
    longest = ("", 0)
    with open(out / "tokens.bin", "wb") as f:
        def flush(batch: list[tuple[str, str]]) -> None:
            nonlocal total, seen, dropped, longest, neutralized
            texts = []
            for _, text in batch:
                clean, n = neutralize(text, controls) if isinstance(text, str) else ("", 0)
                texts.append(clean)
                neutralized += n
            ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
            ids = [doc if isinstance(text, str) else conversation_ids(label, text)
                   for (label, text), doc in zip(batch, ids)]
            for (label, _), doc in zip(batch, ids):
                n = len(doc) + 1
                longest = max(longest, (label, n), key=lambda x: x[1])
                if n < min_tokens:
                    dropped += 1
                    continue
                arr = np.empty(n, dtype=np.int64)  # [n]
                arr[:-1] = doc
                arr[-1] = eos
                if arr.max() > np.iinfo(dtype).max:
                    raise ValueError(f"pretraining source {name!r}: token id {arr.max()} does not fit {dtype.name} "
                                     f"(the tokenizer has {len(tokenizer)} entries)")
                f.write(arr.astype(dtype).tobytes())
                total += n
                offsets.append(total)
            seen += len(batch)
            if progress:
                progress(f"tokenize {name}", seen, 0)

        batch, chars = [], 0
        for label, text in texts:
            batch.append((label, text))
            chars += len(text) if isinstance(text, str) else sum(len(m["content"]) for m in text)
            if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                flush(batch)
                batch, chars = [], 0
        if batch:
            flush(batch)
    if len(offsets) == 1:
        raise CorruptCorpusError(f"pretraining source {name!r}: no document of ≥ {min_tokens} tokens (min_tokens) among its "
                         f"{seen}; the longest, {longest[0]!r}, has {longest[1]} (EOS included)")
    np.save(out / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    return {"num_docs": len(offsets) - 1, "num_tokens": total, "dropped_docs": dropped,
            "longest_doc_tokens": longest[1], "neutralized_control_strings": neutralized}


__all__ = ["CACHE_FORMAT", "Progress", "TokenStore", "build_store", "check_sources", "heldout_documents", "tokenizer_identity"]
