"""The long-context recipe's report (bench/longctx_recipe.py): the `k3rl eval` grids before and after each RL stage.

`compare(grids, trained_lengths, ratio)` reads each grid's results.json (rl/eval/report.py's cells: success, its
Wilson interval, effective length per runner, family and serving) and returns, per family and serving, the model's
success by length for every evaluated model, the effective lengths, and the verdicts of issue 30: the effective
length after the last stage ≥ 2× the warm start's, and at the longest trained length the difference's Newcombe
95% interval above 0. `write_report` renders report.md / report.json and `before_after.png`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional


def load_grid(eval_dir: Path) -> dict[str, Any]:
    return json.loads((eval_dir / "results.json").read_text())


def _cells(grid: dict[str, Any], runner: str = "model") -> dict[tuple[str, str, int], dict[str, Any]]:
    return {(c["family"], c["serve"], int(c["length"])): c for c in grid["cells"] if c["runner"] == runner}


def _effective(grid: dict[str, Any], family: str, serve: str, runner: str = "model") -> Optional[int]:
    for e in grid["effective_lengths"]:
        if (e["runner"], e["family"], e["serve"]) == (runner, family, serve):
            return e["effective_length"]
    return None


def compare(grids: dict[str, dict[str, Any]], trained_lengths: list[int]) -> dict[str, Any]:
    """`grids`: model name → results.json, in training order (the first is the warm start, the last the final
    model). Per (family, serving): success rows, effective lengths and the verdicts."""
    from k3rl.rl.eval.before_after import newcombe_interval

    names = list(grids)
    first = grids[names[0]]
    keys = sorted({(f, s) for f, s, _ in _cells(first)})
    longest = max(trained_lengths)
    out = []
    for family, serve in keys:
        lengths = sorted({n for f, s, n in _cells(first) if (f, s) == (family, serve)})
        rows = {}
        for name, grid in grids.items():
            cells = _cells(grid)
            rows[name] = {n: _cell(cells.get((family, serve, n))) for n in lengths}
        for baseline in ("oracle", "closed_book"):
            cells = _cells(first, baseline)
            if any((family, serve, n) in cells for n in lengths):
                rows[baseline] = {n: _cell(cells.get((family, serve, n))) for n in lengths}
        eff = {name: _effective(grid, family, serve) for name, grid in grids.items()}
        entry: dict[str, Any] = {"family": family, "serve": serve, "lengths": lengths, "success": rows,
                                 "effective_length": eff}
        before, after = eff[names[0]], eff[names[-1]]
        entry["effective_doubled"] = bool(after and (before is None or after >= 2 * before)) if after else False
        at = max((n for n in lengths if n <= longest), default=None)
        b, a = rows[names[0]].get(at), rows[names[-1]].get(at)
        if at is not None and b and a and b["tasks"] and a["tasks"]:
            lo, hi = newcombe_interval(b["successes"], b["tasks"], a["successes"], a["tasks"])
            entry["at_longest_trained"] = {"length": at, "difference": a["success"] - b["success"],
                                           "difference_ci95": [lo, hi], "beyond_ci": lo > 0}
        out.append(entry)
    return {"models": names, "trained_lengths": trained_lengths, "cells": out}


def _cell(c: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    if c is None:
        return None
    ok = c["tasks"] - c["errors"]
    return {"successes": int(c["successes"]), "tasks": ok, "errors": c["errors"],
            "success": (c["successes"] / ok) if ok else math.nan, "ci95": c["success_ci95"]}


def markdown(result: dict[str, Any], info: dict[str, Any]) -> str:
    lines = [f"# Long-context RL recipe: seed {info.get('seed')}, {info.get('path')} code path", "",
             f"CPU: {info.get('cpu')}; wall {info.get('wall_s', 0) / 60:.1f} min; peak RSS "
             f"{info.get('peak_rss_bytes', 0) / 2**30:.2f} GiB; RL stages at {result['trained_lengths']} tokens; "
             f"grid tasks disjoint from {info.get('disjoint_from_training')} training tasks (asserted).", ""]
    for entry in result["cells"]:
        lengths = entry["lengths"]
        lines += [f"## {entry['family']} / {entry['serve']}", "",
                  "| model | " + " | ".join(f"{n}" for n in lengths) + " | effective length |",
                  "|---|" + "---|" * (len(lengths) + 1)]
        for name, row in entry["success"].items():
            cells = []
            for n in lengths:
                c = row.get(n)
                cells.append("—" if c is None or not c["tasks"] else
                             f"{c['successes']}/{c['tasks']} [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]")
            eff = entry["effective_length"].get(name, "")
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {eff if eff is not None else 'none'} |")
        verdict = [f"effective length doubled: {'yes' if entry['effective_doubled'] else 'no'}"]
        if "at_longest_trained" in entry:
            t = entry["at_longest_trained"]
            lo, hi = t["difference_ci95"]
            verdict.append(f"at {t['length']} tokens: {t['difference']:+.2f} [95% CI {lo:+.2f}, {hi:+.2f}] — "
                           f"{'beyond' if t['beyond_ci'] else 'not beyond'} its interval")
        lines += ["", "; ".join(verdict), ""]
    return "\n".join(lines) + "\n"


BASELINE_STYLE = {"oracle": {"linestyle": ":", "color": "grey"}, "closed_book": {"linestyle": "--", "color": "black"}}


def plot(result: dict[str, Any], path: Path) -> Path:
    """Success by length (log axis), one panel per family and serving, a line per model and baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells), 3.4), squeeze=False)
    for ax, entry in zip(axes[0], cells):
        for name, row in entry["success"].items():
            xs = [n for n in entry["lengths"] if row.get(n) and row[n]["tasks"]]
            ys = [row[n]["success"] for n in xs]
            lo = [row[n]["success"] - row[n]["ci95"][0] for n in xs]
            hi = [row[n]["ci95"][1] - row[n]["success"] for n in xs]
            style = BASELINE_STYLE.get(name, {})
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=2, label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(f"{entry['family']} / {entry['serve']}")
        ax.set_xlabel("prompt tokens")
    axes[0][0].set_ylabel("success (95% Wilson)")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out: Path, models: dict[str, Path], trained_lengths: list[int], timings: dict[str, float],
                 wall_s: float, peak_rss: int, info: dict[str, Any]) -> Path:
    grids = {name: load_grid(out / f"eval-{name}") for name in models}
    result = compare(grids, trained_lengths)
    info = {**info, "wall_s": sum(timings.values()) or wall_s, "peak_rss_bytes": peak_rss, "timings": timings}
    (out / "report.json").write_text(json.dumps({**result, "info": info}, indent=1))
    (out / "report.md").write_text(markdown(result, info))
    plot(result, out / "before_after.png")
    print((out / "report.md").read_text(), flush=True)
    return out / "report.md"
