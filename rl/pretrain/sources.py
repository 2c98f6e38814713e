"""Reading a pretraining source's documents: the built-in corpora and local text, JSONL and Parquet files.

A source (`DataSource`, rl/config/pretrain.py) is the built-in `wiki` or `shakespeare`, or local files: a text file is
one document, JSONL is read line by line as envs/jsonl.py reads task files (a `.json` file may hold one array of
records), Parquet through `datasets`, optionally streamed; `format: chat` reads JSONL conversations (`{"messages":
[{"role", "content"}, …]}`, e.g. an environment's oracle episodes, envs/longctx/practice.py) that
rl/pretrain/token_cache.py renders as rollouts render them. Reading is strict: a line that is not UTF-8 or JSON, or
a record without a string `text_field`, is `CorruptCorpusError("path:line: what")`. `group_by` makes long
documents: records sharing the column's value are joined by a blank line, groups in order of first appearance (the
group texts are held in memory until the input ends). rl/pretrain/token_cache.py tokenizes what is read here.
"""

from __future__ import annotations

import glob
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from k3rl.envs.jsonl import JsonlError, json_records
from k3rl.envs.sources import (
    BUILTIN_SOURCES,
    CorpusFileNotFoundError,
    CorruptCorpusError,
    _diagnose,
    builtin_documents,
    file_format,
    wiki_records,
)
from k3rl.rl.config import DataSource

_SUFFIXES = {".jsonl", ".json", ".parquet", ".txt", ".md"}


def default_sources() -> dict[str, DataSource]:
    """What an empty `pretrain.sources` means: Wikipedia summaries (short) and whole Shakespeare plays (long)."""
    return {"wiki": DataSource(path="wiki"), "plays": DataSource(path="shakespeare")}


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


def records(name: str, source: DataSource, files: list[Path], scratch: Path) -> Iterator[tuple[str, str, Any]]:
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
        kind = source_kind(path, source)
        if kind == "parquet":
            yield from _parquet_records(path, source, scratch)
        else:
            yield from file_records(path, kind, source)


def source_kind(path: Path, source: DataSource) -> str:
    """`chat` for a conversation source, else the file's format (`text`, `json`, `parquet`: envs/sources.py)."""
    if source.format == "chat":
        if source.group_by:
            raise CorruptCorpusError(f"{path}: group_by {source.group_by!r} does not apply to format chat (a "
                                     f"conversation is one document)")
        return "chat"
    return file_format(path, source.format)


CHAT_ROLES = ("system", "user", "assistant", "tool")


def _conversation(where: str, record: Any) -> list[dict[str, str]]:
    """The `messages` of one chat record, checked: a list of {role, content} with string content, one of them the
    assistant's. `CorruptCorpusError` names what is wrong."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise CorruptCorpusError(f"{where}: a chat record is a JSON object with a non-empty 'messages' list")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)):
            raise CorruptCorpusError(f"{where}: messages[{i}] is not {{\"role\": one of {', '.join(CHAT_ROLES)}, "
                                     f"\"content\": text}}: {json.dumps(m)[:120]}")
    if not any(m["role"] == "assistant" for m in messages):
        raise CorruptCorpusError(f"{where}: a chat record needs an assistant message")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def file_records(path: Path, kind: str, source: DataSource) -> Iterator[tuple[str, Any, Any]]:
    """(label, text, group value) of the non-empty records of a text file (one document) or a JSONL file (one
    record a line; a `.json` file may instead hold one array of records), read strictly (envs/jsonl.py): a line
    that is not UTF-8 or JSON, or a record without a string `text_field`, is `CorruptCorpusError("path:line: …")`.
    A `chat` file's records yield their checked `messages` list in place of the text."""
    try:
        if kind == "text":
            text = _utf8(path, path.read_bytes())
            if text.strip():
                yield f"{path.name}#0", text.strip(), None
            return
        for row, (where, record) in enumerate(json_records(path)):
            if kind == "chat":
                yield f"{path.name}#{row}", _conversation(where, record), None
                continue
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


def check_parquet(path: Path, source: DataSource) -> int:
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


def group_documents(records: Iterator[tuple[str, str, Any]], group_by: Optional[str]) -> Iterator[tuple[str, str]]:
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


__all__ = ["CHAT_ROLES", "check_parquet", "default_sources", "file_records", "group_documents", "records", "source_files",
           "source_kind"]
