"""The picture of the context climb: loss by position on held-out long documents, and plots per stage.

* `position_loss(score, docs, seq_len)`: the mean next-token loss (nats) and perplexity of held-out documents in
  position buckets (0–128, 128–512, … up to `seq_len`), scored by the learner's own log-prob path
  (`Learner.score`, segment by segment when long). Does the loss at position 30K fall during the 32K stage? Compare
  the last bucket at the stage's start and end.
* `plot_stage_loss`: a stage's training loss and learning rate against its steps (`loss.png`).
* `plot_position_loss`: loss by position bucket at each stage's start and end, all stages (`position_loss.png`).
* `plot_score_by_length`: the retrieval grid's success by length after each stage (`score_by_length.png`, from
  each stage's `eval/results.json`, rl/eval/grid.py).
* `plot_retrieval_gain`: the likelihood score's gain (log p of the answer with the evidence minus without,
  rl/pretrain/retrieval_score.py) by length at the end of each stage, with its 95% interval (`retrieval_gain.png`):
  a climb that learns to retrieve shows it here before the grid's chat-format success moves.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np


def bucket_edges(seq_len: int) -> list[int]:
    """0, 128, 512, 2K, … (powers of 4 from 128), closed by `seq_len`."""
    edges = [0]
    edge = 128
    while edge < seq_len:
        edges.append(edge)
        edge *= 4
    return edges + [seq_len]


def position_loss(score: Callable[[list], list[np.ndarray]], docs: Sequence[np.ndarray], seq_len: int
                  ) -> dict[str, Any]:
    """Mean loss (nats/token) and perplexity of the first `seq_len` predictions of each held-out document, by
    position bucket. `score` is `Learner.score` (log π of every loss-mask token, in order)."""
    from k3rl.rl.train.supervised import as_trajectory

    docs = [np.asarray(d[:seq_len + 1]) for d in docs if len(d) >= 2]
    if not docs:
        return {}
    trajectories = []
    for d in docs:
        mask = np.ones(len(d), dtype=np.uint8)
        mask[0] = 0
        trajectories.append(as_trajectory(d, mask))
    logps = score(trajectories)  # [len(d) - 1] each: position t predicts token t + 1
    edges = bucket_edges(seq_len)
    sums = np.zeros(len(edges) - 1)
    counts = np.zeros(len(edges) - 1)
    for lp in logps:
        pos = np.arange(len(lp))
        idx = np.searchsorted(edges, pos, side="right") - 1
        np.add.at(sums, idx, -lp)
        np.add.at(counts, idx, 1)
    keep = counts > 0
    nll = (sums[keep] / counts[keep]).tolist()
    buckets = [[edges[i], edges[i + 1]] for i in range(len(edges) - 1) if keep[i]]
    total = float(sums.sum() / counts.sum())
    return {"buckets": buckets, "nll": nll, "ppl": [float(np.exp(v)) for v in nll], "tokens": counts[keep].tolist(),
            "docs": len(docs), "mean_nll": total}


def bucket_name(lo: int, hi: int) -> str:
    from k3rl.rl.pretrain.stages import human_tokens

    return f"{human_tokens(lo)}-{human_tokens(hi)}"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """The climb plots' common finish: log2 x-axis, labels, grid, legend, PNG."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_stage_loss(rows: Sequence[dict], path: Path, title: str) -> Optional[Path]:
    """Training loss (and learning rate, right axis) of one stage against its steps."""
    rows = [r for r in rows if "loss" in r and not r.get("skipped")]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker="o", markersize=3, label="train loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    if any("lr" in r for r in rows):
        twin = ax.twinx()
        twin.plot([r["step"] for r in rows if "lr" in r], [r["lr"] for r in rows if "lr" in r], color="gray",
                  linestyle="--", label="learning rate")
        twin.set_ylabel("learning rate")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_position_loss(stages: Sequence[dict], path: Path) -> Optional[Path]:
    """Loss by position bucket at the start (dashed) and end (solid) of every stage."""
    stages = [s for s in stages if s.get("heldout_end") or s.get("heldout_start")]
    if not stages:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(stages)))
    for stage, color in zip(stages, colors):
        for key, style in (("heldout_start", "--"), ("heldout_end", "-")):
            curve = stage.get(key)
            if not curve:
                continue
            mids = [(lo + hi) / 2 for lo, hi in curve["buckets"]]
            ax.plot(mids, curve["nll"], style, color=color, marker="o", markersize=3,
                    label=f"{stage['name']} {'start' if key == 'heldout_start' else 'end'}")
    return _save(plt, fig, ax, path, "position in the held-out document (bucket middle)", "loss (nats / token)",
                 "held-out long documents: loss by position, per stage")


def grid_scores(results_file: Path, runner: str = "model") -> dict[str, list[tuple[int, float]]]:
    """{"family/serve": [(length, success), …]} of one runner in a `k3rl eval` results.json (NaN for a cell whose
    success is null: every task of it failed)."""
    data = json.loads(Path(results_file).read_text())
    out: dict[str, list[tuple[int, float]]] = {}
    for cell in data.get("cells", []):
        if cell.get("runner") != runner:
            continue
        success = np.nan if cell["success"] is None else float(cell["success"])
        out.setdefault(f"{cell['family']}/{cell['serve']}", []).append((int(cell["length"]), success))
    return {k: sorted(v) for k, v in out.items()}


def plot_score_by_length(stages: Sequence[dict], path: Path) -> Optional[Path]:
    """Success by length of the retrieval grid after each stage (one line per stage and family)."""
    stages = [s for s in stages if s.get("grid")]
    if not stages:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(stages)))
    markers = "osd^v<>"
    for stage, color in zip(stages, colors):
        for j, (cell, points) in enumerate(sorted(stage["grid"].items())):
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=markers[j % len(markers)], color=color,
                    label=f"{stage['name']}: {cell}")
    ceiling = stages[-1].get("grid_oracle") or {}
    for j, points in enumerate(v for _, v in sorted(ceiling.items())):
        ax.plot([p[0] for p in points], [p[1] for p in points], linestyle="--", color="gray", alpha=0.6,
                label="oracle (the ceiling)" if j == 0 else None)
    ax.set_ylim(-0.05, 1.05)
    return _save(plt, fig, ax, path, "context length (tokens of the prompt)", "success",
                 "retrieval after each stage of the climb")


def plot_retrieval_gain(stages: Sequence[dict], path: Path) -> Optional[Path]:
    """Gain in log p(gold answer) from the evidence passages by length, at the end of each stage (one line per stage
    and family, the 95% interval as error bars; a dotted line at 0: a model that does not read the context)."""
    stages = [s for s in stages if s.get("retrieval_end")]
    if not stages:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(stages)))
    markers = "osd^v<>"
    for stage, color in zip(stages, colors):
        for j, (family, rows) in enumerate(sorted(stage["retrieval_end"]["families"].items())):
            points = sorted((int(n), r) for n, r in rows.items() if r.get("gain") is not None)
            gain = np.array([r["gain"] for _, r in points], dtype=float)
            low = np.array([np.nan if r.get("gain_low") is None else r["gain_low"] for _, r in points], dtype=float)
            high = np.array([np.nan if r.get("gain_high") is None else r["gain_high"] for _, r in points], dtype=float)
            ax.errorbar([n for n, _ in points], gain, yerr=[np.nan_to_num(gain - low), np.nan_to_num(high - gain)],
                        marker=markers[j % len(markers)], color=color, capsize=3, label=f"{stage['name']}: {family}")
    ax.axhline(0.0, color="gray", linestyle=":", linewidth=1)
    return _save(plt, fig, ax, path, "context length (tokens of the in-context prompt)",
                 "log p(answer): with − without evidence (nats)",
                 "retrieval for base models: what the evidence adds, after each stage")


__all__ = ["bucket_edges", "bucket_name", "grid_scores", "plot_position_loss", "plot_retrieval_gain",
           "plot_score_by_length", "plot_stage_loss", "position_loss"]
