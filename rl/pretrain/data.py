"""Pretraining token data: sources → a token cache on disk → packed rows, a pure function of (seed, stage, row).

Token cache (`build_store`). A source (`DataSource`: the built-in `wiki` or `shakespeare`, or local text / JSONL /
Parquet files: JSONL read line by line as envs/jsonl.py reads task files, Parquet through `datasets`, optionally
streamed; `check_sources` reads every file through before any work, so a bad one is a named error
`path:line: what` before anything is tokenized or written) is tokenized once with the model's tokenizer, an EOS
after every document, and written incrementally to `cache_root/<name>-<key>/`. Documents are untrusted text: a
control-token string in one (`<|im_end|>`, `<tool_call>`, …) is neutralised as in chat rendering, never a control id.

    tokens.bin      uint16 (vocab < 65536) or uint32, all documents back to back    [num_tokens]
    offsets.npy     int64, where each document starts (and the end)                 [num_docs + 1]
    manifest.json   source settings, tokenizer identity, input checksum, counts (control-token strings neutralised)
    COMPLETE        rl/checkpoint.py's manifest: the directory was renamed into place whole

`<key>` hashes the source settings (all but `streaming`, which changes how the input is read, not what), the
tokenizer (its `tokenizer.json`) and the input (built-ins: `builtin_checksum`; files: path, size, mtime), so a
changed tokenizer or file gets a new cache and an unchanged one is reused. Stale caches are left in place. Builds
run under a file lock in a temporary directory (`atomic_dir`): a crash never leaves half a cache, and ranks that
race for the same source tokenize it once. `tokens.bin` is read through a read-only `np.memmap`, so a corpus
larger than memory works. `group_by` makes long documents: records sharing the column's value are joined by a
blank line, groups in order of first appearance (the group texts are held in memory until the input ends; the
tokens are still written group by group).

Packed rows (`PackedRows`). Each source is an endless stream: epochs of a seeded permutation of its training
documents (held-out ones excluded), concatenated. Row k of a source is stream tokens [k·S, k·S + S + 1) — S + 1
tokens train S next-token predictions, and the last one is the first of row k + 1, so every token is predicted
once. A document cut by a row boundary continues in the next row. Global row r draws its source by the mixture
weights from an RNG seeded with (seed, stage, block of r), so `row(r)` depends on r alone: reading rows out of
order, or resuming in a fresh process, gives the same rows. Positions restart at 0 at every document start (and
at the row's first token, even mid-document); `loss_mask` is 0 exactly there: the first token of a document is
never predicted from the previous one.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import re
import tempfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from k3rl.envs.jsonl import JsonlError, json_records
from k3rl.envs.sources import (
    BUILTIN_SOURCES,
    CorpusError,
    CorpusFileNotFoundError,
    CorruptCorpusError,
    _diagnose,
    builtin_checksum,
    builtin_documents,
    file_format,
    wiki_records,
)
from k3rl.rl.checkpoint import COMPLETE, atomic_dir
from k3rl.rl.config import DataSource

Progress = Callable[[str, int, int], None]
"""progress(stage, done, total): documents tokenized so far (total 0 while unknown: a stream)."""

CACHE_FORMAT = 2
"""2: control-token strings in documents neutralised (a format-1 cache may hold control ids from text)."""
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_SUFFIXES = {".jsonl", ".json", ".parquet", ".txt", ".md"}
_BATCH_DOCS, _BATCH_CHARS = 256, 1 << 22
_ROWS_PER_BLOCK = 4096
_MIXTURE, _HELDOUT = 0x6D6978, 0x68656C64


def default_sources() -> dict[str, DataSource]:
    """What an empty `pretrain.sources` means: Wikipedia summaries (short) and whole Shakespeare plays (long)."""
    return {"wiki": DataSource(path="wiki"), "plays": DataSource(path="shakespeare")}


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


def source_files(name: str, source: DataSource) -> list[Path]:
    """The files of a local source: a file, the corpus files of a directory, or a glob's files (sorted)."""
    path = Path(source.path).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [p for p in sorted(path.rglob("*")) if p.is_file() and not p.name.startswith(".")
                 and (source.format != "auto" or any(s.lower() in _SUFFIXES for s in p.suffixes))]
    else:
        files = [Path(p) for p in sorted(glob.glob(str(path), recursive=True)) if Path(p).is_file()]
    if not files:
        raise CorpusFileNotFoundError(f"pretraining source {name!r}: no corpus file at {source.path!r}")
    return files


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
                texts = _group(_records(name, source, files, root.parent), source.group_by)
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
                kind = file_format(path, source.format)
                if kind == "parquet":
                    documents += _check_parquet(path, source)
                else:
                    documents += sum(1 for _ in _file_records(path, kind, source))
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


def _records(name: str, source: DataSource, files: list[Path], scratch: Path) -> Iterator[tuple[str, str, Any]]:
    """(label, text, group value) of every non-empty record of the source, in input order."""
    if source.path in BUILTIN_SOURCES:
        if source.path == "wiki":
            records = ({**r, "text": f"{r['title']}\n\n{r['extract'].strip()}"} for r in wiki_records())
        else:
            records = ({"id": d.id, "title": d.title, "text": f"{d.title}\n\n{d.text}"}
                       for d in builtin_documents(source.path))
        for i, r in enumerate(records):
            if source.group_by and source.group_by not in r:
                raise CorruptCorpusError(f"pretraining source {name!r}: the built-in {source.path!r} has no "
                                         f"{source.group_by!r} field (fields: {', '.join(r)})")
            yield r.get("title", str(i)), r["text"], r.get(source.group_by) if source.group_by else None
        return
    for path in files:
        kind = file_format(path, source.format)
        if kind == "parquet":
            yield from _parquet_records(path, source, scratch)
        else:
            yield from _file_records(path, kind, source)


def _file_records(path: Path, kind: str, source: DataSource) -> Iterator[tuple[str, str, Any]]:
    """(label, text, group value) of the non-empty records of a text file (one document) or a JSONL file (one
    record a line; a `.json` file may instead hold one array of records), read strictly (envs/jsonl.py): a line
    that is not UTF-8 or JSON, or a record without a string `text_field`, is `CorruptCorpusError("path:line: …")`."""
    try:
        if kind == "text":
            text = _utf8(path, path.read_bytes())
            if text.strip():
                yield f"{path.name}#0", text.strip(), None
            return
        for row, (where, record) in enumerate(json_records(path)):
            text, group = _fields(where, record, source)
            if text and text.strip():
                yield f"{path.name}#{row}", text.strip(), group
    except JsonlError as e:
        raise CorruptCorpusError(str(e)) from None
    except OSError as e:
        raise CorruptCorpusError(f"{path}:1: cannot be read ({e.strerror or e})") from None


def _utf8(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise CorruptCorpusError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x})") from None


def _fields(where: str, record: Any, source: DataSource) -> tuple[Optional[str], Any]:
    """(text, group value) of one JSON record; `CorruptCorpusError` when it has no string `text_field`."""
    if not isinstance(record, dict):
        raise CorruptCorpusError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    for column in [source.text_field] + ([source.group_by] if source.group_by else []):
        if column not in record:
            raise CorruptCorpusError(f"{where}: no {column!r} column (columns: {', '.join(record) or 'none'})")
    text = record[source.text_field]
    if text is not None and not isinstance(text, str):
        raise CorruptCorpusError(f"{where}: {source.text_field!r} is {type(text).__name__}, not text")
    return text, record[source.group_by] if source.group_by else None


def _check_parquet(path: Path, source: DataSource) -> int:
    """Open a Parquet file and read its text column through; the number of rows. A corrupt file or a missing or
    non-string column is `CorruptCorpusError` (Parquet has no lines: the row group is named)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = [source.text_field] + ([source.group_by] if source.group_by else [])
    try:
        pf = pq.ParquetFile(path)
        _check_columns(path, pf.schema_arrow.names, columns)
        kind = pf.schema_arrow.field(source.text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
            raise CorruptCorpusError(f"{path}: column {source.text_field!r} is {kind}, not text")
        rows = 0
        for group in range(pf.num_row_groups):
            try:
                rows += pf.read_row_group(group, columns=columns).num_rows
            except (pa.ArrowException, OSError, ValueError) as e:
                raise CorruptCorpusError(f"{path}: row group {group}: cannot be read ({type(e).__name__}: {e})") \
                    from None
        return rows
    except CorruptCorpusError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise CorruptCorpusError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _parquet_records(path: Path, source: DataSource, scratch: Path) -> Iterator[tuple[str, str, Any]]:
    """(label, text, group value) of the non-empty rows of a Parquet file, read through `datasets` (streamed with
    `source.streaming`)."""
    import datasets

    datasets.disable_progress_bars()
    field = source.text_field
    columns = [field] + ([source.group_by] if source.group_by else [])
    # datasets' Arrow copy of a non-streamed file lives only while it is read
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".datasets-") as cache:
        try:
            ds = datasets.load_dataset("parquet", data_files=[str(path)], split="train", cache_dir=cache,
                                       streaming=source.streaming)
            _check_columns(path, ds.column_names, columns)
            row = 0
            for batch in ds.iter(batch_size=1024):
                _check_columns(path, list(batch), columns)
                for text, group in zip(batch[field], batch[columns[-1]]):
                    if text is not None and not isinstance(text, str):
                        raise CorruptCorpusError(f"{path}: row {row}: {field!r} is {type(text).__name__}, not text")
                    if text and text.strip():
                        yield f"{path.name}#{row}", text.strip(), group if source.group_by else None
                    row += 1
        except CorruptCorpusError:
            raise
        except Exception as exc:
            raise CorruptCorpusError(_diagnose(path, "parquet", exc)) from exc


def _check_columns(path: Path, have: Optional[list[str]], want: list[str]) -> None:
    missing = [c for c in want if have is not None and c not in have]
    if missing:
        raise CorruptCorpusError(f"{path}: no {missing[0]!r} column (columns: {', '.join(have)})")


def _group(records: Iterator[tuple[str, str, Any]], group_by: Optional[str]) -> Iterator[tuple[str, str]]:
    """(label, text) of each document: the records themselves, or each group's records joined by a blank line."""
    if not group_by:
        yield from ((label, text) for label, text, _ in records)
        return
    groups: dict[Any, list[str]] = {}
    for _, text, value in records:
        key = value if isinstance(value, (str, int, float, bool, type(None))) else json.dumps(value, default=str)
        groups.setdefault(key, []).append(text)
    for key in list(groups):
        yield f"{group_by}={key}", "\n\n".join(groups.pop(key))


def _write_tokens(name: str, texts: Iterator[tuple[str, str]], tokenizer, dtype: np.dtype, min_tokens: int,
                  out: Path, progress: Optional[Progress]) -> dict[str, Any]:
    """Tokenize in batches, EOS after each document, and append to out/tokens.bin; offsets.npy at the end.

    Documents are untrusted text: every control-token string in them (`<|im_end|>`, `<|bos|>`, `<tool_call>`, …:
    each special or added token of the tokenizer) is neutralised as chat rendering does (rollout/chat.py
    `neutralize`), so the only control id a document's tokens hold is the EOS written after it; the count is
    `neutralized_control_strings` in the manifest."""
    from k3rl.rollout.chat import control_pattern, neutralize

    eos = tokenizer.eos_token_id
    controls = control_pattern(tokenizer, special_only=False)
    offsets, total, seen, dropped, neutralized = [0], 0, 0, 0, 0
    longest = ("", 0)
    with open(out / "tokens.bin", "wb") as f:
        def flush(batch: list[tuple[str, str]]) -> None:
            nonlocal total, seen, dropped, longest, neutralized
            texts = []
            for _, text in batch:
                clean, n = neutralize(text, controls)
                texts.append(clean)
                neutralized += n
            ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
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
            chars += len(text)
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


@dataclass
class PackedRow:
    """One training row: seq_len + 1 tokens of one source, documents packed back to back."""

    row: int
    """Global row index r."""
    source: str
    index: int
    """Row index k within the source's stream (its tokens are stream[k·S, k·S + S + 1))."""
    tokens: np.ndarray
    """[S + 1] int32."""
    position_ids: np.ndarray
    """[S + 1] int32: 0 at the row's first token and at each document start, then counting up."""
    loss_mask: np.ndarray
    """[S + 1] uint8: 0 where position_ids is 0 (nothing predicts them), 1 elsewhere."""
    doc_ids: tuple[int, ...]
    """The documents the row touches, in order (a document id may repeat across an epoch boundary)."""

    def trajectory(self):
        """The row as the learner's `Trajectory` (rollout/trajectory.py): its tokens, loss mask and packed
        positions; no sampling policy (behaviour log-probs 0, versions -1), which the `nll` objective ignores."""
        from k3rl.rollout.trajectory import Trajectory

        n = len(self.tokens)
        return Trajectory(tokens=self.tokens.astype(np.int32), loss_mask=self.loss_mask.astype(np.uint8),
                          logprobs=np.zeros(n, np.float32), versions=np.full(n, -1, np.int32),
                          turn_spans=np.zeros((0, 2), np.int32), prompt_len=0,
                          position_ids=self.position_ids.astype(np.int32))


class PackedRows:
    """Rows of `seq_len + 1` tokens drawn from `stores` by mixture `weights`; `row(r)` is a pure function of r."""

    def __init__(self, stores: Mapping[str, TokenStore], weights: Mapping[str, float], seq_len: int, seed: int,
                 stage: int, exclude: Optional[Mapping[str, Sequence[int]]] = None):
        unknown = sorted((set(weights) | set(exclude or {})) - set(stores))
        if unknown:
            raise ValueError(f"mixture or held-out list names unknown sources {unknown}; the sources are "
                             f"{sorted(stores)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be ≥ 1, got {seq_len}")
        self.names = list(stores)
        self.stores = dict(stores)
        self.seq_len, self.seed, self.stage = seq_len, seed, stage
        self.docs: dict[str, np.ndarray] = {}
        self._lengths: dict[str, np.ndarray] = {}
        for name, store in stores.items():
            held = np.asarray(sorted((exclude or {}).get(name, [])), dtype=np.int64)
            self.docs[name] = np.setdiff1d(np.arange(store.num_docs), held)  # [n_train] int64
            self._lengths[name] = store.doc_lengths  # [num_docs] int64
        self._per_epoch = {n: int(self._lengths[n][self.docs[n]].sum()) for n in self.names}
        if weights:
            w = np.array([float(weights.get(n, 0.0)) for n in self.names])
        else:
            w = np.array([float(self._per_epoch[n]) for n in self.names])
        if (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
            raise ValueError(f"mixture weights must be ≥ 0 with a positive sum, got {dict(zip(self.names, w))}")
        for n, wi in zip(self.names, w):
            if wi > 0 and len(self.docs[n]) == 0:
                raise ValueError(f"source {n!r} has weight {wi} but no training document (all held out)")
        self.weights = dict(zip(self.names, w / w.sum()))
        self._cdf = np.cumsum(w / w.sum())  # [n_sources]
        self._cdf /= self._cdf[-1]
        self._choices: list[np.ndarray] = []
        self._counts = [np.zeros(len(self.names), dtype=np.int64)]
        self._epochs: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, b: int) -> np.ndarray:
        """Source index of each row of block b ([_ROWS_PER_BLOCK] int16); blocks before it are drawn first."""
        while len(self._choices) <= b:
            rng = np.random.default_rng([self.seed, self.stage, _MIXTURE, len(self._choices)])
            pick = np.searchsorted(self._cdf, rng.random(_ROWS_PER_BLOCK), side="right").astype(np.int16)
            self._choices.append(pick)
            self._counts.append(self._counts[-1] + np.bincount(pick, minlength=len(self.names)))
        return self._choices[b]

    def locate(self, r: int) -> tuple[str, int]:
        """(source, k): the source that fills global row r and the row's index in that source's stream."""
        b, i = divmod(r, _ROWS_PER_BLOCK)
        block = self._block(b)
        s = int(block[i])
        return self.names[s], int(self._counts[b][s] + np.count_nonzero(block[:i] == s))

    def _epoch(self, name: str, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order [n_train], cumulative lengths [n_train + 1]) of epoch e of a source's stream."""
        if (name, e) not in self._epochs:
            if len(self._epochs) >= 4 * len(self.names):
                self._epochs.pop(next(iter(self._epochs)))
            rng = np.random.default_rng([self.seed, self.stage, zlib.crc32(name.encode()), e])
            order = self.docs[name][rng.permutation(len(self.docs[name]))]
            cum = np.concatenate([[0], np.cumsum(self._lengths[name][order])])
            self._epochs[(name, e)] = order, cum
        return self._epochs[(name, e)]

    def _spans(self, name: str, k: int) -> list[tuple[int, int, int]]:
        """(document, offset in it, length) of the pieces of stream[k·S, k·S + S + 1)."""
        pos, left, spans = k * self.seq_len, self.seq_len + 1, []
        while left:
            e, q = divmod(pos, self._per_epoch[name])
            order, cum = self._epoch(name, e)
            j = int(np.searchsorted(cum, q, side="right")) - 1
            offset = q - int(cum[j])
            n = min(left, int(cum[j + 1]) - q)
            spans.append((int(order[j]), offset, n))
            pos, left = pos + n, left - n
        return spans

    def row(self, r: int) -> PackedRow:
        name, k = self.locate(r)
        spans = self._spans(name, k)
        store = self.stores[name]
        tokens = np.concatenate([store.doc(d)[o:o + n] for d, o, n in spans]).astype(np.int32)  # [S + 1]
        position_ids = np.concatenate([np.arange(n, dtype=np.int32) for _, _, n in spans])  # [S + 1]
        # a piece that starts mid-document is the row's first piece: position 0 there too
        loss_mask = (position_ids != 0).astype(np.uint8)  # [S + 1]
        return PackedRow(r, name, k, tokens, position_ids, loss_mask, tuple(d for d, _, _ in spans))

    def batch(self, step: int, rows_per_step: int) -> list[PackedRow]:
        """Rows [step·R, (step + 1)·R)."""
        return [self.row(r) for r in range(step * rows_per_step, (step + 1) * rows_per_step)]

    def digest(self, step: int, rows_per_step: int) -> str:
        """Short hash of which (source, document, offset) pieces fill the step's rows: the data order, for logs."""
        h = hashlib.sha256()
        for r in range(step * rows_per_step, (step + 1) * rows_per_step):
            name, k = self.locate(r)
            h.update(f"{name}:{self._spans(name, k)};".encode())
        return h.hexdigest()[:12]
