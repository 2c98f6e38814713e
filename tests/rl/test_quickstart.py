"""The main job (`k3rl quickstart`): the before/after statistics, a shrunken end-to-end run on a
local Ray cluster, and named config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl.quickstart import main, newcombe_interval

REPO = Path(__file__).resolve().parents[2]


def test_newcombe_interval_matches_the_published_example():
    # Newcombe (1998), Stat. Med. 17:873, Table II example (a): 56/70 vs 48/80, method 10.
    low, high = newcombe_interval(48, 80, 56, 70)
    assert low == pytest.approx(0.0524, abs=5e-4) and high == pytest.approx(0.3339, abs=5e-4)
    low, high = newcombe_interval(56, 70, 48, 80)  # the other way round: the mirror image
    assert low == pytest.approx(-0.3339, abs=5e-4) and high == pytest.approx(-0.0524, abs=5e-4)


def test_bad_quickstart_config_names_the_keys(tmp_path, capsys):
    assert main([f"run.output_dir={tmp_path}", "sft.num_tasks=200", "rl.num_tasks=100"]) == 2
    err = capsys.readouterr().err
    assert "sft.num_tasks (200) must be ≤ rl.num_tasks (100)" in err
    assert not any(tmp_path.iterdir())  # nothing started


@pytest.mark.ray
@pytest.mark.slow
def test_quickstart_runs_end_to_end_and_reports_before_and_after(tmp_path, capsys):
    overrides = [f"run.output_dir={tmp_path}", "run.name=qs", "sft.max_steps=3", "sft.num_tasks=8",
                 "rl.num_tasks=8", "rl.steps=2", "rl.tasks_per_step=2", "rl.group_size=2", "rl.eval_tasks=6",
                 "rl.eval_every=0", "ray.num_cpus=2", "rl.rollout_num_cpus=1",
                 "rl.learner_num_cpus=1"]
    assert main(overrides) == 0
    out = capsys.readouterr().out
    run = tmp_path / "qs"
    for part in ("init/config.json", "sft/model/config.json", "sft/loss.png", "rl/metrics.jsonl", "rl/config.yaml",
                 "report.json", "quickstart.png"):
        assert (run / part).exists(), part
    assert any((run / "rl" / "checkpoints").iterdir())
    report = json.loads((run / "report.json").read_text())
    before, after = report["before"], report["after"]
    assert before["step"] == 0 and after["step"] == 2  # eval_every=0 still evaluates before and after
    assert before["tasks"] == after["tasks"] > 0
    for part in (before, after):
        assert part["ci95"][0] <= part["success"] <= part["ci95"][1]
        assert part["success"] == pytest.approx(part["successes"] / part["tasks"])
    assert report["difference_ci95"][0] <= report["difference"] <= report["difference_ci95"][1]
    assert "held-out success before RL" in out and "held-out success after RL" in out
    # a second run never overwrites the first
    assert main(overrides + ["rl.steps=1"]) == 0
    assert (tmp_path / "qs-2" / "report.json").exists()
