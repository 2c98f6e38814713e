"""bench/recipe_report.py: the long-context recipe's verdicts from `k3rl eval` results (effective length doubled,
difference at the longest trained length beyond its Newcombe interval)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
recipe_report = pytest.importorskip("recipe_report")


def _grid(successes: dict[int, int], n: int = 24, runner: str = "model", ratio: float = 0.85) -> dict:
    """A results.json as rl/eval/report.py `aggregate` writes it, for one family and serving."""
    from k3rl.rl.eval.report import effective_length
    from k3rl.rl.metrics import wilson_interval

    cells = [{"runner": runner, "family": "needle", "serve": "context", "length": length, "tasks": n, "errors": 0,
              "successes": k, "success": k / n, "success_ci95": list(wilson_interval(k, n))}
             for length, k in successes.items()]
    eff = effective_length([(c["length"], c["success"]) for c in cells], ratio)
    return {"cells": cells, "effective_lengths": [{"runner": runner, "family": "needle", "serve": "context",
                                                   "effective_length": eff}]}


def test_doubled_effective_length_and_a_difference_beyond_its_interval():
    before = _grid({1024: 20, 2048: 10, 4096: 3, 8192: 1})
    after = _grid({1024: 21, 2048: 20, 4096: 19, 8192: 8})
    result = recipe_report.compare({"sft": before, "rl-4096": after}, [2048, 4096])
    (entry,) = result["cells"]
    assert entry["effective_length"] == {"sft": 1024, "rl-4096": 4096}
    assert entry["effective_doubled"]
    t = entry["at_longest_trained"]
    assert t["length"] == 4096 and t["difference"] == pytest.approx(16 / 24)
    assert t["beyond_ci"] and t["difference_ci95"][0] > 0


def test_no_gain_is_reported_as_no_gain():
    before = _grid({1024: 12, 2048: 6, 4096: 2})
    after = _grid({1024: 12, 2048: 7, 4096: 3})
    (entry,) = recipe_report.compare({"sft": before, "rl-2048": after}, [2048])["cells"]
    assert not entry["effective_doubled"]
    assert entry["at_longest_trained"]["length"] == 2048 and not entry["at_longest_trained"]["beyond_ci"]


def test_a_model_that_never_succeeds_has_no_effective_length():
    zero = _grid({1024: 0, 2048: 0})
    (entry,) = recipe_report.compare({"sft": zero, "rl-2048": zero}, [2048])["cells"]
    assert entry["effective_length"] == {"sft": None, "rl-2048": None} and not entry["effective_doubled"]


def test_report_files(tmp_path):
    before = _grid({1024: 20, 2048: 10})
    before["cells"] += _grid({1024: 24, 2048: 24}, runner="oracle")["cells"]
    after = _grid({1024: 21, 2048: 19})
    for name, grid in {"sft": before, "rl-2048": after}.items():
        (tmp_path / f"eval-{name}").mkdir()
        (tmp_path / f"eval-{name}" / "results.json").write_text(json.dumps(grid))
    md = recipe_report.write_report(tmp_path, {"sft": None, "rl-2048": None}, [2048], {"sft": 60.0, "rl-2048": 120.0},
                                    0.0, 2**30, {"seed": 0, "path": "native", "cpu": "test", "disjoint_from_training": 8})
    text = md.read_text()
    assert "| sft | 20/24" in text and "| oracle | 24/24" in text and "wall 3.0 min" in text
    assert json.loads((tmp_path / "report.json").read_text())["cells"][0]["effective_length"]["rl-2048"] == 2048
    assert (tmp_path / "before_after.png").stat().st_size > 0
