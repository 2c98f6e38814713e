"""Is a model directory intact? The `COMPLETE` manifest of a saved directory, and the checks one without it allows.

A model directory is untrusted input: a downloaded checkpoint, or one of this toolkit's own whose bytes changed
on disk. Every k3rl loader (model/formats/load.py `load_model`, model/policy.py `load_policy`, the tokenizer and
engine loaders) calls `verify_model_dir` first, so every load is checked, not only a resume.

- **With a manifest** (`COMPLETE`, written last by rl/checkpoint.py `atomic_dir`: relative path → size and SHA-256
  of every file): `verify` checks size and content hash of every listed file, so any flipped byte is a
  `CorruptCheckpointError` naming the file. Learner checkpoints (`step-N/`), SFT outputs (`model/`) and pretraining
  stages (`final/`) hold their model files beside their own `COMPLETE`; a directory without one whose PARENT's
  manifest lists files under it (`<parent>/COMPLETE` naming `<dir>/…`) is verified against those entries. A file
  a loader reads (weights, JSON, code, tokenizer) that the manifest does not list was added after the save and is
  refused too. Cost: one SHA-256 pass over every listed file (a learner checkpoint's optimizer state included),
  measured at 0.9 s per GB on the 2-core CI box (files in the page cache; a cold disk adds its read time). A
  directory is hashed once per process: later loads of the same directory with the same file sizes and
  modification times reuse the result (the tokenizer, the policy and a reference model share one pass).
- **Every directory**, with a manifest or without, is then checked for what can be checked — for one without a
  manifest (a released-layout directory from elsewhere) that is all there is, as nothing says what its bytes
  should be: the index's shard set equals the `*.safetensors` files beside it (`check_shard_set`), every
  tensor's name, shape and dtype against config.json (model/formats/load.py `_check_tensors`, `_check_dtypes`;
  K3 directories), safetensors headers that parse and data of the size they declare, and finite values
  (`nonfinite_tensors`: every floating tensor is scanned in full, one min/max pass, 0.2–0.3 s per GB of float32
  or bfloat16 on the CI box; the drivers' streaming model/formats/weight_files.py `scan_weight_files` reads and scans at ~0.2 s per GB from
  the page cache).
  A flipped data byte is caught when it makes a value NaN/±inf (an exponent byte turned all-ones) and missed when
  it makes another finite value: most single-bit flips of a mantissa or sign, or of an exponent bit that keeps
  the exponent below all-ones, go unnoticed. Only a manifest detects those.

Non-finite weights are refused by name (`NonFiniteWeightsError`: the directory, each tensor and its count of
NaN/inf values) unless the caller allows them (`run.allow_nonfinite_weights`, `k3rl export --allow-nonfinite`):
a policy holding NaN samples `<|pad|>` forever and trains nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch

COMPLETE = "COMPLETE"
# Files a loader reads: an unlisted one in a verified directory would be loaded unverified.
_LOADED_FILES = re.compile(r".*\.(safetensors|json|py|bin|pt|pth|model|tiktoken|txt|jinja)$")
_SHARD = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
_SHOWN = 5
OVERRIDE = "run.allow_nonfinite_weights=true (k3rl export: --allow-nonfinite) loads them anyway"
"""How a user loads non-finite weights anyway (evaluation and export; training refuses them regardless)."""
TRAINING = "training cannot start from them (every step would be skipped)"
"""What a training command says instead: no override helps there."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used."""


class IncompleteCheckpointError(CheckpointError):
    """The directory has no COMPLETE manifest: a save that never finished, or not a checkpoint."""


class CorruptCheckpointError(CheckpointError):
    """The manifest does not match the files on disk, or a file cannot be read."""


class NonFiniteWeightsError(ValueError):
    """Weights holding NaN or ±inf; the message names the directory (or file), each tensor and its count."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_manifest(root: Path) -> dict[str, dict[str, Any]]:
    """Relative path → {size, sha256} of every file under root (the manifest itself excluded)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != COMPLETE:
            out[path.relative_to(root).as_posix()] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return out


def _read_manifest(directory: Path) -> dict[str, Any]:
    marker = directory / COMPLETE
    try:
        manifest = json.loads(marker.read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest["files"], dict):
            raise TypeError("not an object with a `files` object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{directory}: unreadable {COMPLETE} manifest ({e})") from None
    return manifest


def _check_entries(directory: Path, files: dict[str, Any]) -> None:
    """Size and content hash of each listed file (`directory / rel`)."""
    for rel, entry in files.items():
        # manifests written before content hashes existed hold the size only
        size, digest = (entry, None) if isinstance(entry, int) else (entry.get("size"), entry.get("sha256"))
        path = directory / rel
        if not path.is_file():
            raise CorruptCheckpointError(f"{directory}: {rel} is listed in the manifest but missing")
        if path.stat().st_size != size:
            raise CorruptCheckpointError(f"{directory}: {rel} has {path.stat().st_size} bytes, "
                                         f"the manifest says {size}")
        if digest is not None and sha256_file(path) != digest:
            raise CorruptCheckpointError(f"{directory}: {rel} does not match its content hash in the manifest "
                                         f"(the file changed after it was saved)")


def verify(directory: str | Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint; IncompleteCheckpointError / CorruptCheckpointError otherwise."""
    directory = Path(directory)
    if not directory.is_dir():
        raise IncompleteCheckpointError(f"no checkpoint directory at {directory}")
    if not (directory / COMPLETE).is_file():
        raise IncompleteCheckpointError(f"{directory}: no {COMPLETE} manifest (a save that did not finish?)")
    manifest = _read_manifest(directory)
    _check_entries(directory, manifest["files"])
    return manifest


def _covering_manifest(directory: Path) -> Optional[tuple[Path, str]]:
    """(directory holding the manifest, prefix of `directory`'s entries in it) or None when none covers it."""
    if (directory / COMPLETE).is_file():
        return directory, ""
    parent = directory.parent
    if parent != directory and (parent / COMPLETE).is_file():
        prefix = directory.name + "/"
        if any(rel.startswith(prefix) for rel in _read_manifest(parent)["files"]):
            return parent, prefix
    return None


_verified: dict[str, tuple] = {}


def _signature(directory: Path) -> tuple:
    return tuple(sorted((p.relative_to(directory).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                        for p in directory.rglob("*") if p.is_file()))


def verify_model_dir(directory: str | Path) -> Optional[Path]:
    """Verify the manifest that covers a model directory (its own `COMPLETE`, or its parent's listing files under
    it); return the directory holding that manifest, or None when there is none (nothing to verify). Raises
    `CorruptCheckpointError` naming the file that differs, is missing, or was added after the save."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    covering = _covering_manifest(directory)
    if covering is None:
        return None
    root, prefix = covering
    key = str(directory.resolve())
    signature = _signature(directory)
    if _verified.get(key) == signature:
        return root
    files = {rel: e for rel, e in _read_manifest(root)["files"].items() if rel.startswith(prefix)}
    _check_entries(root, files)
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(root).as_posix()
        hidden = any(part.startswith(".") for part in path.relative_to(directory).parts)
        if path.is_file() and not hidden and path.name != COMPLETE and rel not in files \
                and _LOADED_FILES.match(path.name):
            raise CorruptCheckpointError(f"{root}: {rel} is not in the {COMPLETE} manifest (added after the save); "
                                         f"remove it or save the directory again")
    _verified[key] = signature
    return root


def check_shard_set(directory: str | Path, weight_map: Optional[dict[str, str]],
                    side_files: Iterable[str] = ()) -> None:
    """The index's shards are exactly the weight files beside it: no `*.safetensors` the index does not name
    (other readers may load a stray `model.safetensors` instead of the index), and `model-k-of-n` names that
    agree on n and count 1…n. Side files (k3rl's patch weights) are not shards. No index: nothing to compare."""
    if weight_map is None:
        return
    directory = Path(directory)
    named = set(weight_map.values())
    stray = sorted(p.name for p in directory.glob("*.safetensors") if p.name not in named and p.name not in side_files)
    if stray:
        raise ValueError(f"{directory}: {', '.join(stray)} not named by model.safetensors.index.json (a leftover "
                         f"of another save, or added); the index's shards must be the directory's weight files")
    numbered = sorted((int(m[1]), int(m[2])) for m in map(_SHARD.match, named) if m)
    counts = list(range(1, numbered[0][1] + 1)) if numbered else []
    if numbered and (len({n for _, n in numbered}) > 1 or [k for k, _ in numbered] != counts):
        have = ", ".join(f"{k}-of-{n}" for k, n in numbered)
        raise ValueError(f"{directory}: model.safetensors.index.json names shards {have}, not 1…n of one n "
                         f"(a shard left out of the index?)")


def count_nonfinite(t: torch.Tensor) -> int:
    """NaN and ±inf values in a tensor (0 for integer tensors)."""
    if not t.is_floating_point() or t.numel() == 0:
        return 0
    # min and max in one pass propagate NaN and show ±inf: ~10× cheaper than isfinite on the clean path
    lo, hi = torch.aminmax(t)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return 0
    return int(t.numel() - torch.isfinite(t).sum())


def nonfinite_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, int]]:
    """(name, count of NaN/±inf values) of every tensor that holds any, in order."""
    with torch.no_grad():
        return [(name, n) for name, t in tensors if (n := count_nonfinite(t))]


def refuse_nonfinite(bad: list[tuple[str, int]], source: Any, allow: bool = False, hint: str = OVERRIDE) -> None:
    """`NonFiniteWeightsError` naming `source` and the tensors of `bad` (name, count), then `hint` (what the user
    can do); with `allow`, a warning."""
    if not bad:
        return
    shown = ", ".join(f"{name} ({n} value{'s' if n > 1 else ''})" for name, n in bad[:_SHOWN])
    more = f" and {len(bad) - _SHOWN} more tensors" if len(bad) > _SHOWN else ""
    tensors = f"{len(bad)} tensor{'s' if len(bad) > 1 else ''}"
    what = f"{source}: non-finite weights (NaN or ±inf) in {tensors}: {shown}{more}"
    if allow:
        warnings.warn(f"{what}; loaded anyway", UserWarning, stacklevel=3)
        return
    raise NonFiniteWeightsError(what + (f"; {hint}" if hint else ""))


__all__ = ["COMPLETE", "CheckpointError", "CorruptCheckpointError", "IncompleteCheckpointError",
           "NonFiniteWeightsError", "OVERRIDE", "TRAINING", "check_shard_set", "count_nonfinite", "file_manifest",
           "nonfinite_tensors", "refuse_nonfinite", "sha256_file", "verify", "verify_model_dir"]
