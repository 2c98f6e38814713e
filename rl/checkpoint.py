"""Atomic, self-verifying checkpoints of a run: `step-000010/` directories, a `latest` pointer, the last K kept.

Layout of a checkpoint root (the trainer uses `<run_dir>/checkpoints`):

    step-000010/                 one complete checkpoint
        config.json, model.safetensors, tokenizer files   the Hugging Face model (Learner.save_into)
        optimizer.pt, rng-rank00000.pt, …                  learner state (Learner.save_into)
        trainer_state.pt, trajectories-<key>.parquet       driver state (save_trainer_state)
        COMPLETE                                           manifest, written last
    latest                       "step-000010": a pointer for people and tools
    .tmp-step-000020-<random>/   a save in progress (or one a crash interrupted)

How a save stays atomic (`CheckpointManager.begin`): everything is written into a temporary
directory beside the target; then every file and directory in it is fsynced, the `COMPLETE`
manifest (relative path → size and SHA-256 of every file) is written and fsynced, the directory is renamed
to `step-XXXXXX` (`os.replace`, atomic on POSIX) and the parent fsynced; only then is `latest`
replaced (temp file + `os.replace`) and are checkpoints beyond the newest K deleted (renamed
to a `.trash-*` name first, so a crash during deletion never leaves a `step-*` directory with
missing files). A crash at any moment therefore leaves the previous complete checkpoint, the
new complete one, or both; never a `step-*` directory without its manifest.

`find_latest` trusts directories, not the pointer: it returns the highest-numbered `step-*`
directory that holds a `COMPLETE` manifest (a crash between the rename and the pointer update
loses nothing) and ignores temp, trash and manifest-less directories. `verify` checks the manifest
against the files on disk — size and content hash of every file (manifests written before hashes
existed are checked by size) — so a flipped byte anywhere is a `CorruptCheckpointError` naming the
file. The manifest, `verify` and the errors live in model/formats/integrity.py (re-exported here), because every load of a
model directory verifies it, not only a resume; `check_model_path` is the commands' check of a model directory
before any work (manifest, files, shapes, dtypes, finite weights), a ConfigError naming the key. A newest
checkpoint that does not verify is skipped for the newest one that does only when the
caller asks (`find_latest(root, on_corrupt=…)`, which is told what was skipped, so the run can say
it is going back a few steps); by default it raises.

Trainer state (`save_trainer_state`): a dict saved with `torch.save` (`trainer_state.pt`),
except that each top-level value that is a non-empty list of `Trajectory` goes to its own
Parquet file through `rollout.trajectory.save_trajectories` (no pickled numpy per token). The
driver's RNG states (python, numpy, torch, CUDA) are added automatically and restored by
`load_trainer_state`. The files are trusted (they are this run's own): `torch.load` is called
with `weights_only=False`.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

# the manifest and its verification live in model/ (every model load verifies it); re-exported here
from k3rl.model.formats.integrity import (
    COMPLETE,
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    file_manifest,
    sha256_file,
    verify,
)
from k3rl.util import atomic

LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_TRAJECTORIES = "__trajectories__"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def mark_complete(directory: str | Path, **meta: Any) -> None:
    """fsync everything under `directory`, then write its COMPLETE manifest (last, fsynced)."""
    directory = Path(directory)
    atomic.sync_tree(directory)
    manifest = {"files": file_manifest(directory), **meta}
    with open(directory / COMPLETE, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    atomic.fsync_dir(directory)


@contextmanager
def atomic_dir(target: str | Path, **meta: Any) -> Iterator[Path]:
    """Yield a temp dir beside `target`; on success mark it complete (`mark_complete`, with `meta` in the manifest)
    and rename it to `target` (util/atomic.py `atomic_dir`: an existing `target` is replaced only after the new one
    is complete; on an exception the temp dir is removed and the exception propagates)."""
    with atomic.atomic_dir(target, seal=lambda tmp: mark_complete(tmp, **meta)) as tmp:
        yield tmp


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of every `step-*` directory under root holding a COMPLETE manifest, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _STEP_DIR.match(path.name)
        if m and path.is_dir() and (path / COMPLETE).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def find_latest(root: str | Path, on_corrupt: Optional[Callable[[Path, CorruptCheckpointError], None]] = None
                ) -> Optional[Path]:
    """The newest complete checkpoint under root, verified; None when there is none.

    Temp dirs, trash and `step-*` dirs without a manifest are ignored. A checkpoint that does not
    verify raises CorruptCheckpointError, unless `on_corrupt` is given: then it is called with the
    checkpoint and the error, and the next older checkpoint is tried (see module docstring).
    """
    for _, path in reversed(list_checkpoints(root)):
        try:
            verify(path)
        except CorruptCheckpointError as e:
            if on_corrupt is None:
                raise
            on_corrupt(path, e)
            continue
        return path
    return None


class CheckpointManager:
    """Writes `step-XXXXXX` checkpoints under `root` atomically and keeps the newest `keep` of them."""

    def __init__(self, root: str | Path, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep: must be ≥ 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    @contextmanager
    def begin(self, step: int) -> Iterator[Path]:
        """Yield the temp dir to write step `step` into; on exit commit it, point `latest` at it, prune."""
        with atomic_dir(self.root / step_dir_name(step), step=step) as tmp:
            yield tmp
        self._write_latest(step)
        self.prune()

    def _write_latest(self, step: int) -> None:
        atomic.write_text_atomic(self.root / LATEST, step_dir_name(step) + "\n")

    def latest(self) -> Optional[Path]:
        return find_latest(self.root)

    def prune(self) -> list[Path]:
        """Delete complete checkpoints beyond the newest `keep`, and leftovers of crashed saves."""
        removed = []
        for _, path in list_checkpoints(self.root)[:-self.keep]:
            trash = self.root / f".trash-{path.name}-{secrets.token_hex(4)}"
            os.replace(path, trash)
            removed.append(path)
        atomic.fsync_dir(self.root)
        for path in self.root.iterdir():
            if path.name.startswith((".trash-", ".tmp-step-")) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
        return removed


def check_model_path(key: str, path: str | Path, *, trains: bool = False, allow_nonfinite: bool = False,
                     weights: bool = True) -> None:
    """A command's check of a model directory before any work (model/formats/load.py `check_model_dir`: the manifest
    when there is one, shard set, names, shapes, dtypes, finite values; one tensor in memory at a time): any
    failure is a ConfigError naming `key`, the directory and the file or tensor, which the commands exit 2 with.

    `trains`: the model is trained, so NaN/inf weights are refused whatever `allow_nonfinite` says. `weights=False`:
    only the manifest (a directory used for its tokenizer)."""
    from k3rl.model.formats import integrity
    from k3rl.model.formats.load import check_model_dir
    from k3rl.rl.config import ConfigError

    try:
        if not weights:
            integrity.verify_model_dir(path)
            return
        check_model_dir(path, allow_nonfinite=allow_nonfinite and not trains,
                                  hint=integrity.TRAINING if trains else integrity.OVERRIDE)
    except (OSError, ValueError, CheckpointError) as e:
        raise ConfigError(f"{key}: {e}") from None


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: python `random`, numpy's global, torch CPU, and every CUDA device."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _is_trajectory_list(value: Any) -> bool:
    from k3rl.rollout.trajectory import Trajectory

    return isinstance(value, list) and len(value) > 0 and all(isinstance(t, Trajectory) for t in value)


def save_trainer_state(directory: str | Path, state: dict[str, Any]) -> None:
    """Write the driver's state into `directory` (usually the temp dir of `CheckpointManager.begin`).

    Non-empty lists of `Trajectory` (unconsumed trajectories, partial groups, …) are written as
    `trajectories-<key>.parquet`; everything else, plus the driver's RNG states, to trainer_state.pt.
    """
    from k3rl.rollout.trajectory import save_trajectories

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", key):
            raise ValueError(f"trainer state keys must be plain names ([A-Za-z0-9_.-]+), got {key!r}")
        if _is_trajectory_list(value):
            name = f"trajectories-{key}.parquet"
            save_trajectories(value, directory / name)
            out[key] = {_TRAJECTORIES: name, "count": len(value)}
        else:
            out[key] = value
    torch.save({"state": out, "rng": capture_rng()}, directory / TRAINER_STATE)


def load_trainer_state(directory: str | Path, restore_rng_state: bool = True) -> dict[str, Any]:
    """The dict given to `save_trainer_state`, trajectories loaded back; restores the driver's RNG.

    `directory` must be a complete checkpoint (verified first).
    """
    from k3rl.rollout.trajectory import load_trajectories

    directory = Path(directory)
    verify(directory)
    path = directory / TRAINER_STATE
    if not path.is_file():
        raise IncompleteCheckpointError(f"{directory}: no {TRAINER_STATE} (a learner-only checkpoint?)")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
        state = {}
        for key, value in saved["state"].items():
            if isinstance(value, dict) and _TRAJECTORIES in value:
                trajectories = load_trajectories(directory / value[_TRAJECTORIES])
                if len(trajectories) != value["count"]:
                    raise CorruptCheckpointError(f"{directory}: {value[_TRAJECTORIES]} holds {len(trajectories)} "
                                                 f"trajectories, {value['count']} were saved")
                value = trajectories
            state[key] = value
    except CheckpointError:
        raise
    except Exception as e:  # a truncated or foreign file: name the checkpoint, keep the cause
        raise CorruptCheckpointError(f"{directory}: cannot read the trainer state ({type(e).__name__}: {e})") from e
    if restore_rng_state:
        restore_rng(saved["rng"])
    return state


__all__ = ["COMPLETE", "CheckpointError", "CheckpointManager", "CorruptCheckpointError", "IncompleteCheckpointError",
           "LATEST", "atomic_dir", "capture_rng", "check_model_path", "find_latest", "list_checkpoints",
           "load_trainer_state",
           "mark_complete", "restore_rng", "save_trainer_state", "sha256_file", "step_dir_name", "verify"]
