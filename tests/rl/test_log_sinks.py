"""rl/log_sinks.py: `run.loggers: [tensorboard, wandb]` — an offline wandb run holds the same scalars, the config
and the plots as TensorBoard, read back from the files each wrote; a resumed job continues the same wandb run."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from k3rl.rl.config.schemas import TrainJob
from k3rl.rl.log_sinks import open_sinks
from k3rl.rl.metrics import MetricsLogger

wandb = pytest.importorskip("wandb")


@pytest.fixture
def no_wandb_account(tmp_path, monkeypatch):
    """No API key anywhere (HOME without a ~/.netrc) and no WANDB_MODE: the sink must choose offline itself."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()


def job(name: str = "sinks"):
    return OmegaConf.merge(OmegaConf.structured(TrainJob), {"run": {"name": name, "loggers": ["tensorboard", "wandb"]}})


def wandb_records(run_dir: Path) -> list:
    """The protobuf records of the offline run files under `run_dir/wandb` (the LevelDB-style log wandb writes:
    a 7-byte file header, 32 KiB blocks of records each with a 7-byte header: crc, length, kind)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunk = path.read_bytes(), 7, b""
        while pos + 7 <= len(data):
            room = 32768 - pos % 32768
            if room < 7:
                pos += room
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0:
                break
            chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                record = pb.Record()
                record.ParseFromString(chunk)
                out.append(record)
                chunk = b""
    return out


def history(records) -> list[dict]:
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def write_png(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    fig.savefig(path)
    plt.close(fig)
    return path


def test_an_offline_wandb_run_holds_tensorboards_scalars_config_and_plots(tmp_path, no_wandb_account):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sinks = open_sinks(job(), run_dir)
    assert [type(s).__name__ for s in sinks] == ["TensorBoardSink", "WandbSink"]
    assert sinks[1].mode == "offline"
    logger = MetricsLogger(run_dir, total_steps=3, console=False, sinks=sinks)
    for step in range(3):
        logger.log(step, {"reward/mean": 0.25 * step, "train/loss": float("nan") if step == 1 else 1.0 - step})
    logger.images([write_png(tmp_path / "reward.png")])
    logger.close()

    rows = history(wandb_records(run_dir))
    scalars = [{k: v for k, v in r.items() if k in ("step", "reward/mean", "train/loss")} for r in rows[:3]]
    assert scalars == [{"step": 0, "reward/mean": 0.0, "train/loss": 1.0}, {"step": 1, "reward/mean": 0.25},
                       {"step": 2, "reward/mean": 0.5, "train/loss": -1.0}]  # NaN left out, as in TensorBoard
    image = rows[3]
    assert image["step"] == 2 and image["plots/reward/_type"] == "image-file"
    assert list(run_dir.glob("wandb/offline-run-*/files/media/images/plots/reward_*.png"))
    run = next(r.run for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["run"]["loggers"] == ["tensorboard", "wandb"] and config["learner"]["lr"] == 1e-5

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0, "tensors": 0}).Reload()
    assert [e.value for e in events.Scalars("reward/mean")] == [0.0, 0.25, 0.5]
    assert [e.step for e in events.Scalars("train/loss")] == [0, 2]
    assert events.Tags()["images"] == ["plots/reward"] and "config/text_summary" in events.Tags()["tensors"]


def test_a_resumed_job_continues_its_wandb_run(tmp_path, no_wandb_account):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for steps in ((0, 1), (1, 2)):  # the second opening resumes from the checkpoint of step 0
        logger = MetricsLogger(run_dir, total_steps=3, resume_step=None if steps[0] == 0 else 0, console=False,
                               sinks=open_sinks(job(), run_dir, None if steps[0] == 0 else 0))
        for step in steps:
            logger.log(step, {"reward/mean": float(step)})
        logger.close()
    run_id = (run_dir / "wandb_id").read_text().strip()
    runs = sorted(run_dir.glob("wandb/offline-run-*"))
    assert len(runs) == 2 and all(run_id in r.name for r in runs)
    assert [r["step"] for r in history(wandb_records(run_dir))] == [0, 1, 1, 2]  # wandb keeps the repeated step


def test_an_unknown_logger_is_named():
    cfg = OmegaConf.create({"run": {"loggers": ["tensorboard", "mlflow"], "name": "x"}})
    with pytest.raises(ValueError, match=r"run.loggers: \['mlflow'\]"):
        open_sinks(cfg, Path("."))
