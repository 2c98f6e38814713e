"""`k3rl eval` (rl/commands/eval.py) on a small grid: needle and multi-hop × in context and behind search ×
two lengths, a random tiny K3 (built once by `k3rl init`'s function) and the oracle / closed-book baselines.

Checks: every cell and runner gets its rows and outputs; the oracle solves every task, the closed-book
floor almost none; a run interrupted mid-eval (rows cut, a torn last line) continues without repeating or
losing a task, and the re-run tasks reproduce their first results exactly; a length the model cannot hold
gives error rows while the rest runs; bad configs are named before anything is written."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from k3rl.rl.commands.eval import main
from k3rl.rl.eval.report import effective_length
from k3rl.rl.eval.rows import read_rows

REPO = Path(__file__).parents[2]
GRID = ["eval.families=[needle,multihop]", "eval.serve=[context,search]", "eval.context_lengths=[1024,2048]",
        "eval.num_tasks=3", "eval.batch_size=3", "rollout.max_new_tokens=24", "rollout.max_turns=5",
        "rollout.max_context_tokens=4096"]


def run(out: Path, model: Path, *extra: str) -> int:
    return main([str(REPO / "configs/eval/longctx.yaml"), f"run.output_dir={out}", "run.name=e",
                 f"eval.model_path={model}", *GRID, *extra])


@pytest.fixture(scope="module")
def first_run(k3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-run")
    assert run(out, k3_dir) == 0
    return out / "e"


def test_every_cell_and_runner_is_reported_and_the_baselines_bound_the_scale(first_run):
    for name in ("config.yaml", "tasks.jsonl", "results.json", "results.md", "heatmap.png"):
        assert (first_run / name).is_file(), name
    rows = read_rows(first_run / "tasks.jsonl")
    assert Counter(r["runner"] for r in rows) == {"model": 24, "oracle": 24, "closed_book": 24}
    assert len({(r["runner"], r["task_id"]) for r in rows}) == len(rows)
    result = json.loads((first_run / "results.json").read_text())
    cells = {(c["runner"], c["family"], c["serve"], c["length"]): c for c in result["cells"]}
    assert len(cells) == 3 * 2 * 2 * 2
    for (runner, *_), c in cells.items():
        assert c["tasks"] == 3 and c["errors"] == 0
        if runner == "oracle":
            assert c["success"] == 1.0, c
        if runner == "closed_book":
            assert c["success"] <= 1 / 3, c
    # the lengths are the model tokenizer's counts of the whole in-context prompt (chat template, system message
    # with the tools, user message): what the engine was given, filled to within a passage of the length
    assert all(r["prompt_tokens"] <= r["length"] for r in rows)
    given = [r for r in rows if r["runner"] == "model" and r["serve"] == "context"]
    assert given and all(abs(r["engine_prompt_tokens"] - r["prompt_tokens"]) <= 2 for r in given), given[0]
    assert all(r["engine_prompt_tokens"] > r["length"] - 300 for r in given)
    assert {e["runner"] for e in result["effective_lengths"]} == {"model", "oracle", "closed_book"}
    assert all(e["effective_length"] == 2048 for e in result["effective_lengths"] if e["runner"] == "oracle")
    search_rows = [r for r in rows if r["serve"] == "search" and r["runner"] == "oracle"]
    assert all(r["rewards"]["search_calls"] >= 1 for r in search_rows)
    assert "| oracle | needle | context | 1024 | 3 | 1.00" in (first_run / "results.md").read_text()


def test_an_interrupted_eval_continues_without_repeating_or_losing_a_task(first_run, k3_dir, tmp_path, capsys):
    rows = read_rows(first_run / "tasks.jsonl")
    out = tmp_path / "e"
    out.mkdir()
    (out / "grid.json").write_text((first_run / "grid.json").read_text())
    kept = rows[:10]
    text = "".join(json.dumps(r) + "\n" for r in kept) + json.dumps(rows[10])[:40]  # a torn last line
    (out / "tasks.jsonl").write_text(text)
    assert run(tmp_path, k3_dir) == 0
    printed = capsys.readouterr().out
    assert "resuming: 10 finished task rows kept" in printed
    # not a terminal: a line per finished cell instead of the live bar (runner, cell, success so far, progress)
    assert re.search(r"^eval oracle needle/context/1024: success 1\.00 on 3 \[\d+ s, \d+/\d+\]$", printed, re.M), printed
    again = read_rows(out / "tasks.jsonl")
    assert len(again) == len(rows) and again[:10] == kept
    assert sorted((r["runner"], r["task_id"]) for r in again) == sorted((r["runner"], r["task_id"]) for r in rows)
    # deterministic: every re-run task gives exactly its first result
    first = {(r["runner"], r["task_id"]): r for r in rows}
    for r in again[10:]:
        old = first[(r["runner"], r["task_id"])]
        assert {k: v for k, v in r.items() if k != "seconds"} == {k: v for k, v in old.items() if k != "seconds"}


def test_a_length_the_model_cannot_hold_is_an_error_row_and_the_run_goes_on(k3_dir, tmp_path):
    assert run(tmp_path, k3_dir, "eval.families=[needle]", "eval.serve=[context]",
               "eval.context_lengths=[1024,8192]") == 0
    rows = read_rows(tmp_path / "e" / "tasks.jsonl")
    too_long = [r for r in rows if r["runner"] == "model" and r["length"] == 8192]
    assert too_long and all("exceeds the context limit 4096" in r["error"] for r in too_long)
    assert all(not r["error"] for r in rows if r["length"] == 1024 or r["runner"] != "model")
    result = json.loads((tmp_path / "e" / "results.json").read_text())
    (cell,) = [c for c in result["cells"] if c["runner"] == "model" and c["length"] == 8192]
    assert cell["errors"] == 3


def test_eval_sets_the_models_positions(k3_dir, tmp_path):
    """eval.max_position_embeddings replaces the model's limit for the evaluation (here lowered below a cell)."""
    assert run(tmp_path, k3_dir, "eval.families=[needle]", "eval.serve=[context]", "eval.baselines=[]",
               "eval.context_lengths=[1024,2048]", "eval.max_position_embeddings=1500", "eval.num_tasks=1") == 0
    rows = read_rows(tmp_path / "e" / "tasks.jsonl")
    assert [bool(r["error"]) for r in sorted(rows, key=lambda r: r["length"])] == [False, True]
    assert "max_position_embeddings 1500" in max(rows, key=lambda r: r["length"])["error"]


@pytest.mark.parametrize("override, message", [
    ("eval.families=[needle,haystack]", "eval.families: ['haystack']"),
    ("eval.serve=[context,web]", "eval.serve: ['web']"),
    ("eval.baselines=[oracle,human]", "eval.baselines: ['human']"),
    ("eval.context_lengths=[100]", "eval.context_lengths"),
    ("eval.context_lengths=[300]", "eval.context_lengths: cannot build needle/context/300 task 0"),
    ("eval.model_path=/nonexistent", "eval.model_path: no Hugging Face model"),
])
def test_bad_configs_are_named_before_anything_is_written(k3_dir, tmp_path, capsys, override, message):
    assert run(tmp_path, k3_dir, override) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_effective_length_is_the_longest_run_above_the_ratio():
    assert effective_length([(1024, 0.8), (4096, 0.7), (16384, 0.5), (65536, 0.7)], 0.85) == 4096
    assert effective_length([(1024, 0.8), (4096, 0.6)], 0.85) == 1024
    assert effective_length([(1024, 0.0), (4096, 0.6)], 0.85) is None
    assert effective_length([(4096, 1.0), (1024, 1.0)], 0.85) == 4096


def test_kill_9_mid_eval_then_resume_loses_and_repeats_nothing(k3_dir, tmp_path):
    """A real `k3rl eval` process killed with SIGKILL once some rows are written; the same command again
    finishes the grid: every row before the kill kept as it was, none written twice, none missing."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "k3rl.rl.commands.eval", str(REPO / "configs/eval/longctx.yaml"), f"run.output_dir={tmp_path}",
           "run.name=e", f"eval.model_path={k3_dir}", *GRID, "eval.families=[needle]", "eval.context_lengths=[1024]",
           "eval.num_tasks=4", "eval.batch_size=1"]
    rows_file = tmp_path / "e" / "tasks.jsonl"
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if rows_file.is_file() and len(read_rows(rows_file)) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the eval finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = read_rows(rows_file)
    total = 4 * 2 * 3  # tasks × servings × runners (model, oracle, closed_book)
    assert 3 <= len(before) < total
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    after = read_rows(rows_file)
    assert after[:len(before)] == before
    keys = [(r["runner"], r["task_id"]) for r in after]
    assert len(keys) == len(set(keys)) == total


def test_the_model_and_the_baselines_count_tokens_read_alike(first_run):
    """`tokens_read` counts one thing for every runner: the conversation as the agent loop tokenises it (chat
    template, generation prompts, tool results with their delimiters) less the assistant's own tokens. A runner
    that answers at once (the closed book; the oracle in context) reads exactly the prompt the engine was given
    for that task; the oracle behind search reads its results as well."""
    rows = {(r["runner"], r["task_id"]): r for r in read_rows(first_run / "tasks.jsonl")}
    models = [r for (runner, _), r in rows.items() if runner == "model"]
    assert len(models) == 24
    for model in models:
        prompt, task_id = model["engine_prompt_tokens"], model["task_id"]
        closed, oracle = rows["closed_book", task_id], rows["oracle", task_id]
        assert closed["tool_calls"] == 0 and closed["tokens_read"] == prompt, (closed, prompt)
        assert model["tokens_read"] >= prompt
        if model["serve"] == "context":
            assert oracle["tool_calls"] == 0 and oracle["tokens_read"] == prompt, (oracle, prompt)
        else:
            assert oracle["tool_calls"] >= 1 and oracle["tokens_read"] > prompt


def test_a_row_records_every_evidence_passages_depth(first_run):
    """`depths`: one per evidence passage in reading order (a multihop chain: one per hop); `depth` the first."""
    rows = read_rows(first_run / "tasks.jsonl")
    for r in rows:
        assert r["depths"] == sorted(r["depths"]) and all(0 <= d <= 1 for d in r["depths"])
        assert r["depth"] == (r["depths"][0] if r["depths"] else None)
    chains = [r for r in rows if r["family"] == "multihop" and r["serve"] == "context" and len(r["depths"]) > 1]
    assert chains and all(r["depths"][-1] > r["depth"] for r in chains)
