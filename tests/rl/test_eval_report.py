"""rl/eval/report.py on hand-made task rows: results.json is strict JSON whatever the cells hold (one task: a
component's interval of one sample; every task failed: no success), and results.md renders the same cells; a
task is binned by its deepest evidence passage."""

from __future__ import annotations

import json

import pytest

from k3rl.rl.eval.report import aggregate, effective_length, write_results


def row(runner: str, length: int, success: bool, error: str = "", depth: float | None = 0.5) -> dict:
    """A tasks.jsonl row as rl/eval/rows.py's `task_row` writes it (the fields `aggregate` reads)."""
    em = float(success and not error)
    return {"runner": runner, "family": "needle", "serve": "context", "length": length, "error": error,
            "reward": em, "rewards": {} if error else {"em": em, "f1": em}, "success": bool(em),
            "tool_calls": 0.0, "depth": depth, "prompt_tokens": length - 10, "tokens_read": length - 10,
            "seconds": 0.1}


def refuse(constant: str):
    raise AssertionError(f"results.json holds {constant}, which is not JSON")


def test_results_json_is_strict_json_with_one_task_cells_and_failed_cells(tmp_path):
    rows = [row("model", 1024, True), row("model", 2048, False, error="boom"), row("oracle", 1024, True),
            row("oracle", 2048, True), row("oracle", 2048, True)]
    result = aggregate(rows, ratio=0.5, depth_bins=2)
    write_results(result, tmp_path)
    text = (tmp_path / "results.json").read_text()
    cells = {(c["runner"], c["length"]): c for c in json.loads(text, parse_constant=refuse)["cells"]}
    one = cells["model", 1024]
    # one task: its mean, no interval (a spread of one sample is undefined)
    assert one["tasks"] == 1 and one["success"] == 1.0 and one["components"]["em"] == [1.0, None, None]
    failed = cells["model", 2048]
    assert failed["errors"] == 1 and failed["success"] is None and failed["components"] == {}
    assert cells["oracle", 2048]["components"]["em"] == [1.0, 1.0, 1.0]
    lengths = {e["runner"]: e["effective_length"] for e in json.loads(text)["effective_lengths"]}
    assert lengths == {"model": 1024, "oracle": 2048}
    table = (tmp_path / "results.md").read_text()
    assert "| model | needle | context | 2048 | 1 | — |" in table


def test_a_nan_left_in_the_result_is_refused_not_written(tmp_path):
    with pytest.raises(ValueError):
        write_results({"cells": [{"success": float("nan")}], "effective_lengths": []}, tmp_path)
    assert not (tmp_path / "results.json").exists()


def test_a_task_is_binned_by_its_deepest_evidence_passage():
    chain = {**row("model", 1024, True), "depth": 0.1, "depths": [0.1, 0.4, 0.9]}
    shallow = {**row("model", 1024, False), "depth": 0.2, "depths": [0.2]}
    old = row("model", 1024, True, depth=0.3)  # a row written before `depths`: its first evidence passage's
    none = {**row("model", 1024, False), "depth": None, "depths": []}
    (cell,) = aggregate([chain, shallow, old, none], ratio=0.5, depth_bins=2)["cells"]
    assert cell["by_depth"] == [{"successes": 1, "tasks": 2}, {"successes": 1, "tasks": 1}]


def test_effective_length_reads_a_null_success_as_no_result():
    assert effective_length([(1024, 1.0), (2048, None), (4096, 1.0)], 0.5) == 1024
    assert effective_length([(1024, None), (2048, 1.0)], 0.5) is None
