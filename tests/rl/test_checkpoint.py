"""Checkpoints: atomic commit, crash at any point (a real `os._exit` in a child process), retention,
the `latest` pointer, named errors for damaged checkpoints, and the trainer-state round trip
(trajectories through Parquet, RNG states restored)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from k3rl.rl import checkpoint as ckpt
from k3rl.rollout.trajectory import Trajectory

REPO = Path(__file__).parents[2]


def write_payload(directory: Path, step: int) -> None:
    (directory / "model.bin").write_bytes(bytes([step % 256]) * (1000 + step))
    (directory / "sub").mkdir()
    (directory / "sub" / "state.json").write_text(json.dumps({"step": step}))


def save_step(manager: ckpt.CheckpointManager, step: int) -> None:
    with manager.begin(step) as tmp:
        write_payload(tmp, step)


def make_trajectory(n: int, seed: int, routed: bool = False) -> Trajectory:
    rng = np.random.default_rng(seed)
    mask = (np.arange(n) >= 3).astype(np.uint8)
    return Trajectory(tokens=rng.integers(0, 500, n).astype(np.int32), loss_mask=mask,
                      logprobs=(-rng.random(n) * mask).astype(np.float32),
                      versions=np.where(mask, 4, -1).astype(np.int32),
                      turn_spans=np.array([[3, n]], dtype=np.int32), prompt_len=3, reward=float(seed),
                      group_id=f"g{seed}", task_id=f"t{seed}",
                      routed_experts=rng.integers(-1, 8, (n, 2, 2)).astype(np.int16) if routed else None)


def test_commit_pointer_and_retention(tmp_path):
    manager = ckpt.CheckpointManager(tmp_path, keep=2)
    assert ckpt.find_latest(tmp_path) is None and ckpt.find_latest(tmp_path / "absent") is None
    for step in range(1, 6):
        save_step(manager, step)
        assert ckpt.find_latest(tmp_path) == tmp_path / ckpt.step_dir_name(step)
        assert (tmp_path / "latest").read_text().strip() == ckpt.step_dir_name(step)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004", "step-000005"]
    manifest = ckpt.verify(tmp_path / "step-000005")
    assert manifest["step"] == 5 and {k: v["size"] for k, v in manifest["files"].items()} == \
        {"model.bin": 1005, "sub/state.json": 11}
    assert all(len(v["sha256"]) == 64 for v in manifest["files"].values())


def test_exception_mid_save_keeps_previous_and_prunes_nothing(tmp_path):
    manager = ckpt.CheckpointManager(tmp_path, keep=2)
    for step in (1, 2):
        save_step(manager, step)
    with pytest.raises(RuntimeError, match="crash"):
        with manager.begin(3) as tmp:
            (tmp / "model.bin").write_bytes(b"half")
            raise RuntimeError("crash")
    assert ckpt.find_latest(tmp_path) == tmp_path / "step-000002"
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 2]
    assert not list(tmp_path.glob(".tmp-*"))


CHILD = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from rl import checkpoint as ckpt

    root, where = Path(sys.argv[1]), sys.argv[2]
    manager = ckpt.CheckpointManager(root, keep=2)
    if where == "pointer":
        def die(step):
            os._exit(9)
        manager._write_latest = die
    if where == "prune":
        def die_in_prune():
            os._exit(9)
        manager.prune = die_in_prune
    with manager.begin(3) as tmp:
        (tmp / "model.bin").write_bytes(b"x" * 1003)
        if where == "writing":
            os._exit(9)
""")


@pytest.mark.parametrize("where", ["writing", "pointer", "prune"])
def test_hard_crash_leaves_a_complete_checkpoint(tmp_path, where):
    manager = ckpt.CheckpointManager(tmp_path, keep=2)
    for step in (1, 2):
        save_step(manager, step)
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), where], cwd=REPO, capture_output=True)
    assert done.returncode == 9, done.stderr.decode()
    latest = ckpt.find_latest(tmp_path)
    if where == "writing":
        assert latest == tmp_path / "step-000002" and len(list(tmp_path.glob(".tmp-step-000003-*"))) == 1
        assert (tmp_path / "latest").read_text().strip() == "step-000002"
    else:  # renamed and complete: found even though `latest` still names step 2
        assert latest == tmp_path / "step-000003" and ckpt.verify(latest)["files"]["model.bin"]["size"] == 1003
        assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 2, 3]
    save_step(manager, 4)  # the next save cleans up what the crash left behind
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == ([2, 4] if where == "writing" else [3, 4])
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".trash-*"))


def test_incomplete_and_corrupt_checkpoints_are_named(tmp_path):
    manager = ckpt.CheckpointManager(tmp_path, keep=3)
    save_step(manager, 1)
    save_step(manager, 2)
    (tmp_path / "step-000007").mkdir()  # no manifest: e.g. a copy that did not finish
    (tmp_path / "step-000007" / "model.bin").write_bytes(b"?")
    assert ckpt.find_latest(tmp_path) == tmp_path / "step-000002"
    with pytest.raises(ckpt.IncompleteCheckpointError, match="no COMPLETE"):
        ckpt.verify(tmp_path / "step-000007")
    with pytest.raises(ckpt.IncompleteCheckpointError):
        ckpt.load_trainer_state(tmp_path / "step-000099")

    with open(tmp_path / "step-000002" / "model.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ckpt.CorruptCheckpointError, match="model.bin has 10 bytes"):
        ckpt.find_latest(tmp_path)
    skipped = []
    assert ckpt.find_latest(tmp_path, on_corrupt=lambda p, e: skipped.append(p.name)) == tmp_path / "step-000001"
    assert skipped == ["step-000002"]
    (tmp_path / "step-000002" / "sub" / "state.json").unlink()
    (tmp_path / "step-000002" / ckpt.COMPLETE).write_text("{not json")
    with pytest.raises(ckpt.CorruptCheckpointError, match="unreadable"):
        ckpt.verify(tmp_path / "step-000002")
    with pytest.raises(ckpt.IncompleteCheckpointError, match="trainer_state"):
        ckpt.load_trainer_state(tmp_path / "step-000001")  # complete, but holds no trainer state


def test_trainer_state_round_trip_restores_trajectories_and_rng(tmp_path):
    unconsumed = [make_trajectory(9, 1, routed=True), make_trajectory(14, 2)]
    state = {"step": 12, "cursor": {"epoch": 1, "index": 37}, "pending": [], "unconsumed": unconsumed,
             "array": np.arange(4)}
    manager = ckpt.CheckpointManager(tmp_path)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    with manager.begin(12) as tmp:
        ckpt.save_trainer_state(tmp, state)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)

    loaded = ckpt.load_trainer_state(ckpt.find_latest(tmp_path))
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected
    assert loaded["step"] == 12 and loaded["cursor"] == {"epoch": 1, "index": 37} and loaded["pending"] == []
    np.testing.assert_array_equal(loaded["array"], np.arange(4))
    assert len(loaded["unconsumed"]) == 2
    for got, want in zip(loaded["unconsumed"], unconsumed):
        for name in ("tokens", "loss_mask", "logprobs", "versions", "turn_spans"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
        assert (got.reward, got.group_id, got.task_id) == (want.reward, want.group_id, want.task_id)
    np.testing.assert_array_equal(loaded["unconsumed"][0].routed_experts, unconsumed[0].routed_experts)
    assert loaded["unconsumed"][1].routed_experts is None
    assert (ckpt.find_latest(tmp_path) / "trajectories-unconsumed.parquet").is_file()

    with pytest.raises(ValueError, match="plain names"):
        ckpt.save_trainer_state(tmp_path / "x", {"a/b": 1})


def test_trajectory_count_mismatch_is_corruption(tmp_path):
    manager = ckpt.CheckpointManager(tmp_path)
    with manager.begin(1) as tmp:
        ckpt.save_trainer_state(tmp, {"unconsumed": [make_trajectory(6, 0)]})
    path = ckpt.find_latest(tmp_path)
    saved = torch.load(path / ckpt.TRAINER_STATE, weights_only=False)
    saved["state"]["unconsumed"]["count"] = 5
    torch.save(saved, path / ckpt.TRAINER_STATE)
    ckpt.mark_complete(path, step=1)  # a consistent manifest over inconsistent contents
    with pytest.raises(ckpt.CorruptCheckpointError, match="holds 1 trajectories, 5 were saved"):
        ckpt.load_trainer_state(path)


def test_atomic_dir_replaces_a_target_only_when_the_new_one_is_complete(tmp_path):
    target = tmp_path / "policy"
    with ckpt.atomic_dir(target) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(KeyError):
        with ckpt.atomic_dir(target) as tmp:
            (tmp / "a").write_text("new")
            raise KeyError("interrupted")
    assert (target / "a").read_text() == "old"
    with ckpt.atomic_dir(target) as tmp:
        (tmp / "a").write_text("new")
    assert (target / "a").read_text() == "new" and ckpt.verify(target)["files"]["a"]["size"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
    with pytest.raises(ValueError, match="keep"):
        ckpt.CheckpointManager(tmp_path, keep=0)


def test_a_flipped_byte_anywhere_is_caught_and_named(tmp_path):
    """Content hashes: any byte changed in any file of a checkpoint (model, optimizer, trainer state,
    trajectories) is a CorruptCheckpointError naming the file, from `verify` and from loading."""
    manager = ckpt.CheckpointManager(tmp_path)
    with manager.begin(3) as tmp:
        write_payload(tmp, 3)
        ckpt.save_trainer_state(tmp, {"step": 3, "unconsumed": [make_trajectory(40, 1), make_trajectory(33, 2)]})
    path = tmp_path / "step-000003"
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != ckpt.COMPLETE)
    assert {p.name for p in files} >= {"model.bin", "state.json", "trainer_state.pt", "trajectories-unconsumed.parquet"}
    rng = random.Random(0)
    for f in files:
        original = f.read_bytes()
        for offset in sorted({0, len(original) - 1, *rng.sample(range(len(original)), min(6, len(original)))}):
            damaged = bytearray(original)
            damaged[offset] ^= 0x40
            f.write_bytes(bytes(damaged))
            with pytest.raises(ckpt.CorruptCheckpointError, match=f"{f.relative_to(path).as_posix()} does not match"):
                ckpt.verify(path)
            with pytest.raises(ckpt.CorruptCheckpointError):
                ckpt.load_trainer_state(path, restore_rng_state=False)
        f.write_bytes(original)
    assert ckpt.load_trainer_state(path, restore_rng_state=False)["step"] == 3


def test_a_checkpoint_saved_before_content_hashes_still_loads(tmp_path):
    """Manifests of earlier versions list sizes only: they verify by size and load."""
    manager = ckpt.CheckpointManager(tmp_path)
    with manager.begin(1) as tmp:
        ckpt.save_trainer_state(tmp, {"step": 1, "unconsumed": [make_trajectory(8, 0)]})
    path = tmp_path / "step-000001"
    manifest = json.loads((path / ckpt.COMPLETE).read_text())
    manifest["files"] = {k: v["size"] for k, v in manifest["files"].items()}  # the old format
    (path / ckpt.COMPLETE).write_text(json.dumps(manifest))
    assert ckpt.find_latest(tmp_path) == path
    assert len(ckpt.load_trainer_state(path, restore_rng_state=False)["unconsumed"]) == 1
