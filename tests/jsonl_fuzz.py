"""Bad (and a few good) JSONL files made from one valid row, for the task-file fuzz tests.

`variants(row, seed)` returns (name, file bytes) pairs, deterministic in `seed`: every field (and the fields
of the first nested object and list item) swapped for each value of `SWAPS`, each field left out, the row in
other encodings, nested deeply, with huge numbers and NaN/Infinity literals, with Unicode line breaks, lone
surrogates and control characters, whole-file oddities (empty, binary, BOMs, CR line ends), and seeded byte
mutations of the valid file. A reader under test must load each one or raise its named error
(`path:line: what`); `problem(message, path)` says what is wrong with an error message.
"""

from __future__ import annotations

import json
import random
import re
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

SWAPS: dict[str, Any] = {
    "null": None, "true": True, "zero": 0, "negative": -1, "float": 1.5, "empty-string": "", "blank": "  ",
    "string": "x", "empty-list": [], "empty-object": {}, "list-of-lists": [[]], "big-int": 10 ** 30,
    "list-of-null": [None], "list-of-objects": [{}],
}
"""Replacement values for the type swaps."""


def _dump(row: Any) -> bytes:
    return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")


def _paths(row: dict) -> Iterator[tuple[str, ...]]:
    """Every top-level key, and the keys of the first object / the first item of each list value."""
    for key, value in row.items():
        yield (key,)
        if isinstance(value, list) and value:
            yield (key, 0)
            if isinstance(value[0], dict):
                yield from ((key, 0, k) for k in value[0])
        elif isinstance(value, dict):
            yield from ((key, k) for k in value)


def _replaced(row: Any, path: tuple, value: Any, drop: bool = False) -> Any:
    row = json.loads(json.dumps(row))
    parent = row
    for step in path[:-1]:
        parent = parent[step]
    if drop:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return row


def _raw_in_question(row: dict, key: str, text: str) -> bytes:
    """The row with `text` spliced raw (unescaped) into the string field `key`."""
    marker = "QQMARKERQQ"
    return _dump({**row, key: f"before {marker} after"}).replace(marker.encode(), text.encode("utf-8", "surrogatepass"))


def variants(row: dict, seed: int = 0, text_key: str = "question") -> list[tuple[str, bytes]]:
    """(name, file bytes) of the fuzzed files; `text_key` is a string field of `row` to splice text into."""
    good = _dump(row)
    out: list[tuple[str, bytes]] = [("valid", good), ("valid-two-rows", good + _dump({**row, "id": "other"}))]
    for path in _paths(row):
        name = ".".join(map(str, path))
        out += [(f"swap:{name}={label}", _dump(_replaced(row, path, value))) for label, value in SWAPS.items()]
        out.append((f"drop:{name}", _dump(_replaced(row, path, None, drop=True))))
    text = good.decode()
    out += [
        ("utf-16", text.encode("utf-16")), ("utf-16-le", text.encode("utf-16-le")),
        ("utf-16-be", text.encode("utf-16-be")), ("utf-32", text.encode("utf-32")),
        ("utf-8-bom", text.encode("utf-8-sig")), ("latin-1", _raw_in_question(row, text_key, "").replace(
            b"before", "caf\u00e9".encode("latin-1"))),
        ("cp1252-quotes", _raw_in_question(row, text_key, "").replace(b"before", b"\x93q\x94")),
        ("invalid-byte-line-2", good + good.replace(b"{", b"{\xff", 1)),
        ("truncated-utf8", good[:-1] + b"\xe2\x82\n"), ("raw-surrogate-bytes", _raw_in_question(row, text_key, "\ud800")),
        ("nul-byte", _raw_in_question(row, text_key, "\x00")), ("gzip-header", b"\x1f\x8b\x08\x00" + good),
    ]
    for depth in (10, 98, 99, 1000, 100_000):
        nest = "[" * depth + "]" * depth
        out.append((f"nest-meta-{depth}", _replaced_raw(row, "meta", '{"nested": ' + nest + "}")))
        out.append((f"nest-value-{depth}", _raw_in_question(row, text_key, "").replace(
            b'"before  after"', nest.encode())))
        out.append((f"nest-row-{depth}", ("[" * depth + json.dumps(row) + "]" * depth + "\n").encode()))
    for digits in (4299, 4300, 4301, 10_000):
        big = "9" * digits
        for key in list(row)[:3] + ["hops"]:
            out.append((f"int-{digits}-in-{key}", _replaced_raw(row, key, big)))
    for literal in ("NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e308", "-0", "1E-400"):
        for key in (text_key, "hops"):
            out.append((f"number-{literal}-in-{key}", _replaced_raw(row, key, literal)))
    out += [(f"long-string-{n}", _dump({**row, text_key: "word " * n})) for n in (10_000, 200_000)]
    for label, ch in [("u2028", "\u2028"), ("u2029", "\u2029"), ("u0085", "\u0085"), ("form-feed", "\x0c"),
                      ("vtab", "\x0b"), ("fs", "\x1c"), ("gs", "\x1d"), ("rs", "\x1e"), ("cr", "\r"), ("del", "\x7f"),
                      ("bom-inside", "\ufeff"), ("nbsp", "\u00a0"), ("rtl", "\u202e"), ("zwj", "\u200d"),
                      ("emoji", "\U0001f600"), ("combining", "e\u0301")]:
        out.append((f"raw-{label}", _raw_in_question(row, text_key, ch)))
        out.append((f"escaped-{label}", _dump({**row, text_key: f"before {ch} after"})))
    for label, escape in [("lone-high", "\\ud800"), ("lone-low", "\\udfff"), ("reversed-pair", "\\ude00\\ud83d"),
                          ("pair", "\\ud83d\\ude00"), ("nul", "\\u0000")]:
        out.append((f"escape-{label}", _raw_in_question(row, text_key, escape)))
        out.append((f"escape-{label}-in-key", good.replace(b"{", ('{"' + escape + '": 1, ').encode(), 1)))
    rng = random.Random(seed)
    out += [
        ("empty", b""), ("blank", b"  \n\n\t\n"), ("crlf", out[1][1].replace(b"\n", b"\r\n")),
        ("cr-only", (good.rstrip(b"\n") + b"\r") * 2), ("no-final-newline", good.rstrip(b"\n")),
        ("binary", bytes(rng.randrange(256) for _ in range(2048))),
        ("binary-after-row", good + bytes(rng.randrange(256) for _ in range(256))),
        ("trailing-garbage", good[:-1] + b" }\n"), ("two-on-a-line", good[:-1] + good),
        ("top-level-list", b"[1, 2]\n"), ("top-level-string", b'"task"\n'), ("top-level-null", b"null\n"),
        ("truncated", good[: len(good) // 2] + b"\n"), ("duplicate-key", good.replace(b"{", b'{"id": "dup", ', 1)),
        ("single-quotes", good.replace(b'"', b"'")), ("python-literals", good.replace(b"true", b"True")),
    ]
    for i in range(60):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            op, at = rng.randrange(3), rng.randrange(len(data))
            if op == 0:
                data[at] = rng.randrange(256)
            elif op == 1:
                data.insert(at, rng.choice(b'{}[]",:\\0\xff\xc3\n'))
            elif len(data) > 2:
                del data[at]
        out.append((f"mutation-{i}", bytes(data)))
    return out


def _replaced_raw(row: dict, key: str, literal: str) -> bytes:
    """The row with field `key` set to the raw JSON text `literal` (a number json.dumps would not write)."""
    marker = "QQRAWQQ"
    return _dump({**row, key: marker}).replace(f'"{marker}"'.encode(), literal.encode())


def problem(message: str, path: Path) -> str | None:
    """What is wrong with an error message for `path` (None if nothing): it must start `path:line: `."""
    if "Traceback" in message:
        return "holds a traceback"
    if not re.match(rf"{re.escape(str(path))}:\d+: \S", message):
        return f"does not start with '{path}:LINE: '"
    return None


def run_fuzz(cases: list[tuple[str, bytes]], tmp_path: Path, read: Callable[[Path], Optional[Iterable[str]]],
             named: type) -> tuple[Counter, list[str]]:
    """Write each case to a file and `read` it: counts of `loaded`, `named` (raised `named` with a good message,
    `problem`) and `traceback` (anything else), and a line per failure. `read` may return messages it wrote
    instead of raising (skipped rows); each must be a good message too."""
    outcome, failures = Counter(), []
    for i, (name, data) in enumerate(cases):
        path = tmp_path / f"{i:03d}.jsonl"
        path.write_bytes(data)
        try:
            messages = read(path) or ()
            outcome["loaded"] += 1
        except named as e:
            outcome["named"] += 1
            messages = [str(e)]
        except BaseException:  # noqa: BLE001 - any other exception is the failure the fuzz tests count
            outcome["traceback"] += 1
            failures.append(f"{name}: {traceback.format_exc(limit=-2)}")
            continue
        failures += [f"{name}: message {what}: {m}" for m in messages if (what := problem(m, path)) is not None]
    return outcome, failures
