"""Where a run's scalars, config and plots go besides `metrics.jsonl` and the console (`run.loggers`).

- `tensorboard`: event files under `run_dir/tb` (scalars, the job's config as text, the PNG plots as images);
  a resumed run purges the events after its checkpoint's step.
- `wandb`: a Weights & Biases run with the same scalars, the config as the run's config and the PNGs as images.
  Its mode is `WANDB_MODE` when set, else online when an API key is found (`WANDB_API_KEY` or `wandb login`'s
  `~/.netrc` entry), else offline: the run is written under `run_dir/wandb`, and `wandb sync` uploads it later.
  The run id is kept in `run_dir/wandb_id`, so a resumed job continues the same run. wandb cannot purge: the
  steps a resume repeats appear twice in its history, each row with its `step` (the charts' x-axis);
  `metrics.jsonl` and TensorBoard keep one row per step.

`open_sinks(cfg, run_dir, resume_step)` opens the sinks a job config names; `rl/metrics.py`'s `MetricsLogger`
writes to them.
"""

from __future__ import annotations

import netrc
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

LOGGERS = ("tensorboard", "wandb")


class TensorBoardSink:
    """TensorBoard event files in `run_dir/tb` (module docstring)."""

    def __init__(self, run_dir: Path, resume_step: Optional[int] = None, config_text: str = ""):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"), purge_step=None if resume_step is None else resume_step + 1)
        if config_text:
            self.writer.add_text("config", "```\n" + config_text + "\n```", 0)

    def scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def images(self, step: int, paths: Sequence[Path]) -> None:
        import matplotlib.image

        for path in paths:
            self.writer.add_image(f"plots/{Path(path).stem}", matplotlib.image.imread(path)[..., :3], step,
                                  dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbSink:
    """A Weights & Biases run (module docstring)."""

    def __init__(self, run_dir: Path, name: str, config: Mapping[str, Any], project: str,
                 entity: Optional[str] = None):
        try:
            import wandb
        except ImportError:
            raise ValueError("run.loggers: `wandb` needs the wandb package (pip install wandb)") from None
        self.wandb = wandb
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
        id_file.write_text(run_id + "\n")
        self.mode = os.environ.get("WANDB_MODE") or ("online" if _has_wandb_key() else "offline")
        self.run = wandb.init(project=project, entity=entity, name=name, dir=str(run_dir), config=dict(config),
                              id=run_id, resume="allow", mode=self.mode, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    @property
    def directory(self) -> Path:
        """This run's own files (offline: what `wandb sync` uploads)."""
        return Path(self.run.dir).parent

    def scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({"step": step, **scalars})

    def images(self, step: int, paths: Sequence[Path]) -> None:
        self.run.log({"step": step, **{f"plots/{Path(p).stem}": self.wandb.Image(str(p)) for p in paths}})

    def close(self) -> None:
        self.run.finish()


def open_sinks(cfg: Any, run_dir: Path, resume_step: Optional[int] = None) -> list:
    """The sinks `cfg.run.loggers` names for a job config `cfg` (OmegaConf) writing to `run_dir`."""
    from omegaconf import OmegaConf

    names = list(cfg.run.loggers)
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ValueError(f"run.loggers: {unknown} — each must be one of {', '.join(LOGGERS)}")
    sinks: list = []
    try:
        if "tensorboard" in names:
            sinks.append(TensorBoardSink(run_dir, resume_step, OmegaConf.to_yaml(cfg)))
        if "wandb" in names:
            sinks.append(WandbSink(run_dir, f"{cfg.run.name}/{run_dir.name}" if run_dir.name != cfg.run.name
                                   else cfg.run.name, OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                                   cfg.run.wandb_project, cfg.run.wandb_entity))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


__all__ = ["LOGGERS", "TensorBoardSink", "WandbSink", "open_sinks"]
