"""Strict JSONL reading for files a user hands k3rl (task files, training task rows, pretraining data).

A line is what lies between two `\\n` bytes — never a Unicode line break such as U+2028 or U+0085, which
may sit inside a JSON string — and must be UTF-8 (no byte-order mark: a UTF-16 file or one saved with a
BOM is named as such). A value is refused, with `path:line: what is wrong`, where plain `json.loads` would
raise something other than `JSONDecodeError` or let through what later breaks a run: an integer longer
than Python converts (`ValueError`), nesting deeper than `MAX_DEPTH` (`RecursionError` further on), a
lone surrogate (a `UnicodeEncodeError` when the text is tokenized or written), and `NaN`/`Infinity` or a
number that overflows to one (invalid JSON in the outputs).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any

MAX_DEPTH = 100
"""Deepest nesting of arrays and objects a row may have (a task row needs three or four levels)."""

_BOMS = {b"\xef\xbb\xbf": "UTF-8 with a byte-order mark", b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32",
         b"\xff\xfe": "UTF-16", b"\xfe\xff": "UTF-16"}


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class JsonlError(ValueError):
    """A JSONL file or line that cannot be read: the message is `path:line: what is wrong`."""


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every non-blank line, split on `\\n` only; `JsonlError` for a line that is not
    UTF-8 or a file that starts with a byte-order mark."""
    # binary iteration splits on b"\n" alone and streams: a pretraining file may be larger than memory
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if n == 1:
                for bom, name in _BOMS.items():
                    if raw.startswith(bom):
                        raise JsonlError(f"{path}:1: the file is {name}; save it as UTF-8 without a byte-order mark")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise JsonlError(f"{path}:{n}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
            if line.strip():
                yield n, line


def json_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(where, value) of every record of a JSONL file, `where` being `path:line`; or, for a file whose first line
    opens an array, of each item of that one JSON array (what `datasets` reads from a `.json` file), `where`
    being `path:line: record i`. `JsonlError` as `jsonl_lines` and `parse_line` raise it, and for an empty file."""
    lines = jsonl_lines(path)
    first = next(lines, None)
    if first is None:
        raise JsonlError(f"{path}:1: the file is empty (no records)")
    if not first[1].lstrip().startswith("["):
        for n, line in chain([first], lines):
            yield f"{path}:{n}", parse_line(f"{path}:{n}", line)
        return
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise JsonlError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x})") from None
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        # parse_line would name the array's first line: name the line of the fault instead
        raise JsonlError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError):
        pass
    value = parse_line(f"{path}:{first[0]}", text)
    for i, record in enumerate(value if isinstance(value, list) else [value]):
        yield f"{path}:{first[0]}: record {i}", record


def parse_line(where: str, line: str) -> Any:
    """The JSON value of one line; `JsonlError("{where}: …")` when it is not one k3rl can use."""
    try:
        value = json.loads(line, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise JsonlError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise JsonlError(f"{where}: nested too deeply to parse (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:
        # the int-string limit (ValueError from int()) and the refusals of the hooks below
        raise JsonlError(f"{where}: {e}") from None
    depth = _depth(value)
    if depth > MAX_DEPTH:
        raise JsonlError(f"{where}: nested {depth} levels deep (at most {MAX_DEPTH})")
    # a lone surrogate can only come from a \uD800–\uDFFF escape (raw surrogate bytes are not UTF-8)
    if _SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise JsonlError(f"{where}: a string holds a lone surrogate ({e.object[e.start]!r}), which is not "
                             f"text") from None
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (NaN and Infinity are refused)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} overflows a 64-bit float")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of a parsed value (a scalar is 0), counted without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            todo.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            todo.extend((v, depth + 1) for v in item)
        else:
            continue
        deepest = max(deepest, depth + 1)
    return deepest
