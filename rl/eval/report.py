"""Reports of `k3rl eval` (rl/eval/grid.py): per-cell scores, effective lengths, the Markdown table, the heatmap.

`aggregate` scores the task rows of each runner and cell with `rl.eval.evaluate.score` (the one scorer: success
with its Wilson interval, every reward component with its interval, tool calls) and bins success by
evidence depth — the deepest evidence passage's (`bin_depth`: how far into the haystack the model must read
to hold every fact the answer rests on; a multihop chain's hops sit at several depths); `effective_length`
is the longest length whose success stays ≥ a ratio of the success at the shortest length; `markdown` and
`heatmap` render them; `write_results` writes results.json and results.md.

What is undefined is null in results.json, never NaN (which is not JSON): the success of a cell whose every
task failed, a component's interval over one task (a spread of one sample).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass
class Episode:
    """A finished task as `rl.eval.evaluate.score` reads it (reward, reward components, counters)."""

    reward: float
    rewards: dict
    metrics: Optional[dict] = None


def aggregate(rows: Sequence[dict[str, Any]], ratio: float, depth_bins: int) -> dict[str, Any]:
    """Per runner and cell: `rl.eval.evaluate.score` of the rows without an error, error count, means of tokens and
    time; per runner, family and serving: the effective length; per cell: success by depth bin."""
    from k3rl.rl.eval.evaluate import Score, score

    by_cell: dict[tuple, list[dict]] = {}
    for r in rows:
        by_cell.setdefault((r["runner"], r["family"], r["serve"], r["length"]), []).append(r)
    cells = []
    for (runner, family, serve, length), group in sorted(by_cell.items()):
        ok = [r for r in group if not r["error"]]
        s: Score = score([Episode(r["reward"], r["rewards"], {"tool_calls": r["tool_calls"]}) for r in ok],
                         None if not ok else _success_key(ok))
        bins: list[list[int]] = [[0, 0] for _ in range(depth_bins)]
        for r in ok:
            depth = bin_depth(r)
            if depth is not None:
                b = min(depth_bins - 1, int(depth * depth_bins))
                bins[b][0] += int(r["success"])
                bins[b][1] += 1
        n = max(1, len(ok))
        cells.append({"runner": runner, "family": family, "serve": serve, "length": length, "tasks": len(group),
                      "errors": len(group) - len(ok), "successes": sum(r["success"] for r in ok),
                      "success": s.rate if ok else None, "success_ci95": list(s.interval) if ok else [0.0, 1.0],
                      "components": {k: [_finite(x) for x in v] for k, v in s.components.items()},
                      "tool_calls": s.tool_calls,
                      "prompt_tokens": sum(r["prompt_tokens"] for r in ok) / n,
                      "tokens_read": sum(r["tokens_read"] for r in ok) / n,
                      "seconds": sum(r["seconds"] for r in ok) / n,
                      "by_depth": [{"successes": k, "tasks": m} for k, m in bins]})
    effective = {}
    for c in cells:
        effective.setdefault((c["runner"], c["family"], c["serve"]), []).append(c)
    lengths = [{"runner": runner, "family": family, "serve": serve,
                "effective_length": effective_length([(c["length"], c["success"]) for c in group], ratio)}
               for (runner, family, serve), group in sorted(effective.items())]
    return {"cells": cells, "effective_lengths": lengths}


def bin_depth(row: dict[str, Any]) -> Optional[float]:
    """The depth a task row is binned by: its deepest evidence passage's (`depths`, in reading order); a row
    written before `depths` existed has only its first one's (`depth`). None without evidence."""
    depths = row.get("depths")
    if depths is None:
        return row.get("depth")
    return max(depths) if depths else None


def _finite(x: float) -> Optional[float]:
    """`x`, or None where it is NaN or infinite (undefined: JSON has no such number)."""
    return x if math.isfinite(x) else None


def write_results(result: dict[str, Any], out: Path) -> None:
    """`out/results.json` (strict JSON: a NaN or infinity left in `result` is a ValueError, not a bad file) and
    `out/results.md`."""
    (out / "results.json").write_text(json.dumps(result, indent=1, allow_nan=False))
    (out / "results.md").write_text(markdown(result))


def _success_key(rows: Sequence[dict]) -> Optional[str]:
    # rows store `success` already decided by the environment's rule; score() needs the same rule: EM when
    # every row reports it (the long-context environments' success_metric), else reward ≥ 1
    return "em" if all("em" in r["rewards"] for r in rows) else None


def effective_length(points: Sequence[tuple[int, Optional[float]]], ratio: float) -> Optional[int]:
    """The longest length whose score is ≥ ratio × the score at the shortest length, every shorter length
    included (a dip breaks the run); None when the shortest length scores 0 (or has no result: None or NaN)."""
    points = sorted(((n, math.nan if s is None else s) for n, s in points), key=lambda p: p[0])
    if not points or not points[0][1] or math.isnan(points[0][1]):
        return None
    base, best = points[0][1], None
    for n, s in points:
        if math.isnan(s) or s < ratio * base:
            break
        best = n
    return best


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table (one row per runner and cell) and the effective lengths."""
    lines = ["| runner | family | serving | length | tasks | success [95% CI] | EM | F1 | evidence recall | "
             "tool calls | tokens read | s/task | errors |", "|" + "---|" * 13]
    for c in result["cells"]:
        comp = c["components"]
        fmt = lambda k: f"{comp[k][0]:.2f}" if comp.get(k, [None])[0] is not None else "—"  # noqa: E731
        lo, hi = c["success_ci95"]
        success = "—" if c["success"] is None else f"{c['success']:.2f} [{lo:.2f}, {hi:.2f}]"
        lines.append(f"| {c['runner']} | {c['family']} | {c['serve']} | {c['length']} | {c['tasks']} | {success} | "
                     f"{fmt('em')} | {fmt('f1')} | {fmt('evidence_recall')} | {c['tool_calls']:.1f} | "
                     f"{c['tokens_read']:.0f} | {c['seconds']:.2f} | {c['errors']} |")
    lines += ["", "| runner | family | serving | effective length |", "|---|---|---|---|"]
    for e in result["effective_lengths"]:
        lines.append(f"| {e['runner']} | {e['family']} | {e['serve']} | {e['effective_length'] or '—'} |")
    return "\n".join(lines) + "\n"


def heatmap(result: dict[str, Any], runners: Sequence[str], path: Path, depth_bins: int) -> Optional[Path]:
    """Success by length (columns) × evidence depth (rows): one row of panels per runner (the evaluated model
    first, then the oracle's ceiling and the closed-book floor, so the scale is in the picture), one panel per
    family and serving."""
    runners = [r for r in runners if any(c["runner"] == r for c in result["cells"])]
    if not runners:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = sorted({(c["family"], c["serve"]) for c in result["cells"]})
    lengths = sorted({c["length"] for c in result["cells"]})
    fig, axes = plt.subplots(len(runners), len(panels), figsize=(3.2 * len(panels) + 1.2, 2.6 * len(runners) + 0.4),
                             squeeze=False)
    # grey: no task of the cell fell in that depth bin
    cmap = plt.get_cmap("viridis").with_extremes(bad="#e8e8e8")
    im = None
    for row, runner in enumerate(runners):
        for col, (family, serve) in enumerate(panels):
            ax = axes[row][col]
            grid = np.full((depth_bins, len(lengths)), np.nan)
            for c in result["cells"]:
                if (c["runner"], c["family"], c["serve"]) == (runner, family, serve):
                    for b, d in enumerate(c["by_depth"]):
                        if d["tasks"]:
                            grid[b, lengths.index(c["length"])] = d["successes"] / d["tasks"]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap=cmap, aspect="auto", origin="upper")
            for (b, j), v in np.ndenumerate(grid):
                if not np.isnan(v):
                    ax.text(j, b, f"{v:.2f}", ha="center", va="center", color="white" if v < 0.6 else "black",
                            fontsize=8)
            ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths])
            ax.set_yticks(range(depth_bins), [f"{b / depth_bins:.0%}–{(b + 1) / depth_bins:.0%}"
                                              for b in range(depth_bins)] if col == 0 else [""] * depth_bins)
            if row == 0:
                ax.set_title(f"{family} · {serve}", fontsize=10)
            if row == len(runners) - 1:
                ax.set_xlabel("context length (tokens)")
            if col == 0:
                ax.set_ylabel(f"{runner}\nevidence depth")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="success (EM)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
