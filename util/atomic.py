"""Atomic writes: a file or a directory appears whole under its name, or not at all.

The idiom, written once here for `model/`, `envs/` and `rl/`: write into a temporary sibling (same filesystem),
fsync what was written, `os.replace` it onto the target (atomic on POSIX), then fsync the parent so the rename
itself survives a power loss. A crash therefore leaves the old target or the new one, never half of either, plus
at most a hidden temporary (`.tmp-…`, `.trash-…`, `.<name>.tmp-…`) that readers ignore.

- `write_text_atomic(path, text)`: one file.
- `atomic_dir(target, seal)`: a directory; `seal(tmp)` runs last, before the rename (default `sync_tree`; a
  checkpoint's seal also writes its `COMPLETE` manifest, rl/checkpoint.py `atomic_dir`).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_file(path: str | Path) -> None:
    """Flush a file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: str | Path) -> None:
    """fsync every file and directory under `root`, deepest first, then `root` itself."""
    root = Path(root)
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file():
            fsync_file(path)
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(root)


def write_text_atomic(path: str | Path, text: str, errors: str | None = None) -> None:
    """Replace `path` by a file holding `text` (a temporary sibling, fsynced, renamed, the parent fsynced).
    `errors`: as for `open` (e.g. "surrogateescape" for text read that way)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w", errors=errors) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def atomic_dir(target: str | Path, seal: Callable[[Path], None] = sync_tree) -> Iterator[Path]:
    """Yield a temp dir beside `target`; on success `seal` it and rename it to `target`.

    An existing `target` is replaced only after the new one is sealed (moved to a `.trash-…` sibling first, then
    deleted). On an exception the temp dir is removed and the exception propagates (a hard crash leaves it)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        seal(tmp)
        if target.exists():
            old = target.parent / f".trash-{target.name}-{secrets.token_hex(4)}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["atomic_dir", "fsync_dir", "fsync_file", "sync_tree", "write_text_atomic"]
