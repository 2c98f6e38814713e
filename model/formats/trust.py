"""What k3rl takes from a model directory: its code only on request, its paths only inside it.

A model directory is untrusted input (a downloaded checkpoint). Two rules, used by every loader:

- **Remote code** (`check_remote_code`): a directory asks for code when its tokenizer_config.json or config.json
  has an `auto_map` (transformers would import `tokenization_x.py`, `configuration_x.py`, `modeling_x.py` from
  it). Without the opt-in (`run.trust_remote_code=true` for every job command, `--trust-remote-code` for
  `k3rl export`) that is a `RemoteCodeError` naming the file and the code, and every transformers/vLLM call gets
  `trust_remote_code=False`, so nothing is imported either way. The `auto_map` of a K3 directory's config.json
  (model/formats/layouts.py `MODEL_TYPES`, e.g. k3rl's own copies of model/formats/remote/*.py) is not a request: k3rl reads
  those directories natively and never imports their code. Tokenizer code files (`*.py`) are copied on (export,
  checkpoints: model/formats/save.py `copy_tokenizer`) only with the opt-in.
- **Paths** (`inside`): a file a directory names (an index's shard, a side file, a tokenizer file) must resolve
  inside it — no absolute path, no `..` out of it, no symlink leading out; otherwise a `PathEscapeError` naming
  who named it and the path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Union

from k3rl.model.formats.layouts import MODEL_TYPES

OPT_IN = "run.trust_remote_code=true (k3rl export: --trust-remote-code)"
TOKENIZER_CONFIG = "tokenizer_config.json"
CONFIG = "config.json"


class RemoteCodeError(ValueError):
    """A directory asks for its own Python code to be imported, and the user did not allow it."""


class PathEscapeError(ValueError):
    """A path a directory names resolves outside it (absolute, `..`, or a symlink leading out)."""


def _auto_map(path: Path) -> Any:
    """The `auto_map` of a JSON file (None when the file, its JSON or the key is missing)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        # an unreadable file asks for nothing here (transformers, told trust_remote_code=False, imports nothing
        # either); its own reader names the error
        return None
    return data.get("auto_map") if isinstance(data, dict) else None


def remote_code_requests(directory: str | Path, *, model: bool = True) -> list[str]:
    """Each request for the directory's own code, as 'FILE: auto_map KEY → module.Class (module.py)'.

    The tokenizer's (tokenizer_config.json's `auto_map`, config.json's `AutoTokenizer` entry) always count; the
    model's (config.json's other entries) when `model`. A K3 directory's config.json asks for nothing (k3rl
    reads it natively)."""
    directory = Path(directory)
    found = []
    tok_map = _auto_map(directory / TOKENIZER_CONFIG)
    if tok_map:
        found += _describe(directory / TOKENIZER_CONFIG, tok_map, "AutoTokenizer")
    config_map = _auto_map(directory / CONFIG)
    if isinstance(config_map, dict) and config_map:
        try:
            raw = read_json(directory / CONFIG)
        except ValueError:
            raw = None
        native = isinstance(raw, dict) and raw.get("model_type") in MODEL_TYPES
        if not native:
            found += _describe(directory / CONFIG, {k: v for k, v in config_map.items()
                                                    if model or k == "AutoTokenizer"}, None)
    return found


def _describe(path: Path, auto_map: Any, key: str | None) -> list[str]:
    # tokenizer auto_maps are also written as a bare [slow, fast] list
    entries = auto_map.items() if isinstance(auto_map, dict) else [(key, auto_map)]
    out = []
    for name, refs in entries:
        refs = list(dict.fromkeys(r for r in (refs if isinstance(refs, (list, tuple)) else [refs])
                                  if isinstance(r, str)))
        files = sorted({r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs})
        out.append(f"{path}: auto_map {name} → {', '.join(refs) or '?'} ({', '.join(files) or 'code'})")
    return out


def check_remote_code(directory: str | Path, allowed: bool, *, model: bool = True) -> bool:
    """The `trust_remote_code` to pass to transformers/vLLM for `directory`: `allowed` itself, after raising
    `RemoteCodeError` when the directory asks for code (`remote_code_requests`) and it is not allowed."""
    requests = remote_code_requests(directory, model=model)
    if requests and not allowed:
        raise RemoteCodeError(f"{'; '.join(requests)}: the directory asks to run its own Python code, which k3rl "
                              f"does not import unless allowed; inspect it, then set {OPT_IN}")
    return bool(allowed)


def read_json(path: Union[str, os.PathLike], what: str = "cannot read") -> object:
    """A JSON file of a model directory (untrusted): anything unreadable is a ValueError naming the file — not
    UTF-8, not JSON, an integer past Python's digit limit, nesting too deep for the parser."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"{path}: {what} ({why})") from None


def inside(directory: str | Path, name: Any, named_by: str) -> Path:
    """`directory / name`, refused unless it resolves inside `directory` (symlinks followed). `named_by` says who
    named the path (e.g. "model.safetensors.index.json: tensor lm_head.weight"), for the error."""
    directory = Path(directory)
    if not isinstance(name, str) or not name:
        raise PathEscapeError(f"{named_by}: file name {name!r} is not a non-empty string")
    path = directory / name
    target = path.resolve()
    if Path(name).is_absolute() or not any(target.is_relative_to(root) for root in _roots(directory)):
        raise PathEscapeError(f"{named_by}: path {name!r} resolves outside {directory} "
                              f"(to {target}); a model directory may only name files inside itself")
    return path


def _roots(directory: Path) -> list[Path]:
    """Where a directory's files may live: the directory, and for a snapshot of the Hugging Face hub cache
    (`models--org--name/snapshots/REV/`, whose files are symlinks to `../../blobs/HASH`) its repository's blobs."""
    root = directory.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return [root, root.parent.parent / "blobs"]
    return [root]


__all__ = ["OPT_IN", "PathEscapeError", "RemoteCodeError", "check_remote_code", "inside", "read_json",
           "remote_code_requests"]
