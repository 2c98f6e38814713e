"""The run directory of `k3rl train`: where a run resumes from, and what its checkpoints hold besides the learner.

A checkpoint (`rl/checkpoint.py`, one atomic `checkpoints/step-XXXXXX` directory) holds the learner's state
(written by the learner group) and the driver's: step, version and the collector's `state_dict` (task cursor,
tasks to collect again, every collected trajectory not yet trained on). A fresh run refuses a directory that
already holds a run; `rl.resume=true` continues from the newest checkpoint that verifies, naming any it skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from k3rl.rl import checkpoint as ckpt
from k3rl.rl.config import ConfigError
from k3rl.rl.metrics import METRICS_FILE


def resume_point(run_dir: Path, checkpoints: Path, resume: bool) -> tuple[Optional[Path], list[str]]:
    """(the checkpoint to resume from or None, notes to print): a ConfigError when `run_dir` holds a run
    and `resume` is off, or holds one but no checkpoint that loads."""
    has_run = (run_dir / METRICS_FILE).exists() or bool(ckpt.list_checkpoints(checkpoints))
    if not resume:
        if has_run:
            raise ConfigError(f"run directory {run_dir} already holds a run; set rl.resume=true to continue "
                              f"it, or choose another run.name")
        return None, []
    skipped: list[str] = []

    def corrupt(path: Path, error: Exception) -> None:
        skipped.append(f"{path.name}: {error}")

    latest = ckpt.find_latest(checkpoints, on_corrupt=corrupt)
    notes = [f"[yellow]skipped checkpoint {line}" for line in skipped]
    if latest is None and has_run:
        why = "; ".join(skipped) if skipped else "no checkpoint directory holds a COMPLETE manifest"
        raise ConfigError(f"rl.resume=true: {run_dir} holds a run but no checkpoint that loads ({why}); "
                          f"nothing was changed. Start a new run with another run.name")
    if latest is not None and skipped:
        notes.append(f"[yellow]resuming from the newest checkpoint that verifies, {latest.name}: "
                     f"the steps after it are trained again")
    return latest, notes


def save(checkpoints: ckpt.CheckpointManager, step: int, version: int, learner: Any, collector: Any) -> Path:
    """Checkpoint the learner and the driver at `step` (the collector's calls in flight are awaited first)."""
    collector.drain()
    with checkpoints.begin(step) as tmp:
        learner.save_into(tmp)
        ckpt.save_trainer_state(tmp, {"step": step, "version": version, **collector.state_dict()})
    return checkpoints.root / ckpt.step_dir_name(step)


def restore(path: Path, learner: Any, collector: Any) -> tuple[int, int]:
    """Load the learner and the collector from the checkpoint `path`; returns (step, version)."""
    version = learner.load(path)
    state = ckpt.load_trainer_state(path)
    if int(state["version"]) != version:
        raise ckpt.CorruptCheckpointError(f"{path}: the learner is at version {version}, the trainer state "
                                          f"says {state['version']}")
    collector.load_state_dict(state)
    return int(state["step"]), version
