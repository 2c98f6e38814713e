"""Run logging: one line per step on the console (rich), TensorBoard scalars, `metrics.jsonl`, PNG curves.

`MetricsLogger(run_dir)` writes, for every `log(step, scalars, extra)`:
- `metrics.jsonl`: one JSON object per step (`step`, `time`, the scalars, then `extra`: lists and
  strings such as the ids of the trained groups), appended and flushed at once;
- the finite numeric scalars to each sink (rl/log_sinks.py, `run.loggers`: TensorBoard under `run_dir/tb` by
  default, Weights & Biases), which also get the PNGs of `images`;
- a rich console line with the headline numbers (`headline`: (metric, label) pairs; RL's by
  default), under a progress bar of the run's steps (`label`: "RL", "SFT", …).

Resuming (`resume_step=k`): `metrics.jsonl` is rewritten (temp file + rename) keeping only the
lines of steps ≤ k, the steps the checkpoint covers, and dropping a line torn by a crash; the
TensorBoard sink purges events after step k. The resumed run then appends steps k+1, k+2, …,
so the file never holds a step twice and never skips one. `resume_step=-1` (resume asked, no
checkpoint yet) keeps nothing. A step is one row: `log` refuses a step at or below the last one written
(a caller that measures twice at one step merges the measurements into that step's row).

`plot(run_dir)` reads `metrics.jsonl` and writes PNG curves into `run_dir/plots` (matplotlib,
Agg backend): reward, training success, held-out success with its 95% Wilson band, KL (mismatch
and reference), staleness, tokens/s. `wilson_interval` is the confidence interval every success
rate is reported with.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from k3rl.util.atomic import write_text_atomic

METRICS_FILE = "metrics.jsonl"
Z95 = 1.959963984540054


def null_nonfinite(value: Any) -> Any:
    """`value` with every NaN or infinite float (nested in dicts, lists, tuples) replaced by None, so that
    `json.dumps(..., allow_nan=False)` writes strict JSON: a bare `NaN` is not JSON, and strict parsers refuse it."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: null_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [null_nonfinite(v) for v in value]
    return value


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default); (0, 1) when n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # exactly 0 with no successes and 1 with no failures (the formula's values, without rounding error)
    low = 0.0 if successes <= 0 else max(0.0, centre - half)
    high = 1.0 if successes >= n else min(1.0, centre + half)
    return low, high


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The parsed lines of `run_dir/metrics.jsonl` (a torn last line is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value / 1000:.1f}k"
    if abs(value) < 1e-2:
        return f"{value:.1e}"
    return f"{value:.3g}"


# (metric, console label) shown on each step's line when present
_HEADLINE = (("reward/mean", "reward"), ("success/rate", "success"), ("groups/zero_variance", "zero-var"),
             ("train/mismatch_kl", "mkl"), ("staleness/max", "stale"), ("perf/gen_tokens_per_s", "gen tok/s"),
             ("perf/train_tokens_per_s", "train tok/s"), ("perf/step_time_s", "s"))


class MetricsLogger:
    """Console + TensorBoard + metrics.jsonl for one run directory; see module docstring."""

    def __init__(self, run_dir: str | Path, total_steps: int, resume_step: Optional[int] = None,
                 console: bool = True, label: str = "RL",
                 headline: Sequence[tuple[str, str]] = (), sinks: Optional[Sequence[Any]] = None):
        """`sinks`: rl/log_sinks.py's (`open_sinks` with the same `resume_step`); None: TensorBoard alone."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from k3rl.rl.log_sinks import TensorBoardSink

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._last: Optional[int] = None
        if resume_step is not None:
            self._last = self._keep_through(resume_step)
        start = max(resume_step or 0, 0)
        self.sinks = list(sinks) if sinks is not None else [TensorBoardSink(self.run_dir, resume_step)]
        self.console = Console(quiet=not console, soft_wrap=True)
        self.headline = tuple(headline) or _HEADLINE
        self.progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=self.console, transient=False, disable=not console)
        self.task = self.progress.add_task("steps", total=total_steps, completed=start)
        self.progress.start()
        self._file = open(self.path, "a")

    def _keep_through(self, step: int) -> Optional[int]:
        """Rewrite metrics.jsonl with the rows of steps ≤ `step` only; the last step kept (None if none)."""
        rows = [r for r in read_metrics(self.run_dir) if r["step"] <= step]
        write_text_atomic(self.path, "".join(json.dumps(row) + "\n" for row in rows))
        return max((r["step"] for r in rows), default=None)

    def log(self, step: int, scalars: Mapping[str, float], extra: Optional[Mapping[str, Any]] = None) -> None:
        """Write one step: scalars to every sink, `extra` (JSON-serialisable) to metrics.jsonl only. Steps
        increase: a step at or below the last one written is a ValueError (it would be a second row)."""
        if self._last is not None and int(step) <= self._last:
            raise ValueError(f"{self.path}: step {step} logged after step {self._last}; each step is one row")
        self._last = int(step)
        row = {"step": int(step), "time": round(time.time(), 3)}
        row.update({k: float(v) for k, v in scalars.items()})
        row.update(extra or {})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        finite = {key: float(value) for key, value in scalars.items() if _is_scalar(value)}
        for sink in self.sinks:
            sink.scalars(int(step), finite)
        parts = [f"{label} {_fmt(float(scalars[key]))}" for key, label in self.headline if key in scalars]
        if "eval/success_rate" in scalars:
            parts.append(f"eval {scalars['eval/success_rate']:.3f} [{scalars['eval/ci_low']:.3f}, "
                         f"{scalars['eval/ci_high']:.3f}] n={int(scalars['eval/num_tasks'])}")
        self.console.print(f"[bold]step {step}[/bold]  " + "  ".join(parts))
        self.progress.update(self.task, completed=max(step, 0))

    def images(self, paths: Sequence[Path], step: Optional[int] = None) -> None:
        """PNG files (the run's plots) to every sink, at `step` (default: the last step written)."""
        if paths:
            for sink in self.sinks:
                sink.images(int(step if step is not None else self._last or 0), list(paths))

    def print(self, message: str) -> None:
        self.console.print(message)

    def close(self) -> None:
        self.progress.stop()
        for sink in self.sinks:
            sink.close()
        self._file.close()


_PLOTS = {
    "reward": ("reward", [("reward/mean", "mean reward")]),
    "success": ("training success rate", [("success/rate", "success")]),
    "kl": ("KL", [("train/mismatch_kl", "mismatch KL (rollout vs learner)"), ("train/kl_ref", "KL to reference")]),
    "staleness": ("staleness (policy versions)", [("staleness/mean", "mean"), ("staleness/max", "max")]),
    "tokens_per_s": ("tokens/s", [("perf/gen_tokens_per_s", "generation"), ("perf/train_tokens_per_s", "training")]),
}


def plot(run_dir: str | Path) -> list[Path]:
    """PNG curves of `run_dir/metrics.jsonl` into `run_dir/plots`; returns the files written.

    A figure whose metrics never appear is not written; `eval_success.png` draws the held-out
    success rate with its 95% Wilson band.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def series(key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], float(r[key])) for r in rows if _is_scalar(r.get(key))]
        return [p[0] for p in pts], [p[1] for p in pts]

    for name, (title, keys) in _PLOTS.items():
        lines = [(label, *series(key)) for key, label in keys]
        lines = [line for line in lines if line[1]]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label, xs, ys in lines:
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    xs, rate = series("eval/success_rate")
    if xs:
        lo = [float(r["eval/ci_low"]) for r in rows if _is_scalar(r.get("eval/success_rate"))]
        hi = [float(r["eval/ci_high"]) for r in rows if _is_scalar(r.get("eval/success_rate"))]
        n = [int(r["eval/num_tasks"]) for r in rows if _is_scalar(r.get("eval/success_rate"))]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.fill_between(xs, lo, hi, alpha=0.25, label="95% Wilson interval")
        ax.plot(xs, rate, marker="o", markersize=3, label="held-out success")
        ax.set_ylim(0, 1)
        ax.set_title(f"held-out success ({n[-1]} tasks)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / "eval_success.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


__all__ = ["METRICS_FILE", "MetricsLogger", "plot", "read_metrics", "wilson_interval"]
