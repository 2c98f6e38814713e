"""The main job (`k3rl quickstart`): the before/after statistics, a shrunken end-to-end run on a
local Ray cluster, and named config errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3rl.rl.commands.quickstart import main
from k3rl.rl.eval.before_after import collapses, newcombe_interval, summary_lines

REPO = Path(__file__).resolve().parents[2]


def test_newcombe_interval_matches_the_published_example():
    # Newcombe (1998), Stat. Med. 17:873, Table II example (a): 56/70 vs 48/80, method 10.
    low, high = newcombe_interval(48, 80, 56, 70)
    assert low == pytest.approx(0.0524, abs=5e-4) and high == pytest.approx(0.3339, abs=5e-4)
    low, high = newcombe_interval(56, 70, 48, 80)  # the other way round: the mirror image
    assert low == pytest.approx(-0.3339, abs=5e-4) and high == pytest.approx(-0.0524, abs=5e-4)


def test_bad_quickstart_config_names_the_keys(tmp_path, capsys):
    assert main([f"run.output_dir={tmp_path}", "sft.num_tasks=200", "env.num_tasks=100"]) == 2
    err = capsys.readouterr().err
    assert "sft.num_tasks (200) must be ≤ env.num_tasks (100)" in err
    assert not any(tmp_path.iterdir())  # nothing started


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(2400)  # two short Ray jobs: ~100 s alone, 917 s on a 2-core box running three other jobs
def test_quickstart_runs_end_to_end_and_reports_before_and_after(tmp_path, capsys):
    overrides = [f"run.output_dir={tmp_path}", "run.name=qs", "sft.max_steps=3", "sft.num_tasks=8",
                 "env.num_tasks=8", "rl.steps=2", "rl.tasks_per_step=2", "rl.group_size=2", "eval.num_tasks=6",
                 "eval.every=0", "ray.num_cpus=2", "rollout.num_cpus=1",
                 "learner.num_cpus=1"]
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


@pytest.mark.parametrize("extra", [[], ["eval.every=0", "rl.steps=3"], ["eval.every=5"]])
def test_the_phases_run_what_k3rl_sft_and_k3rl_train_would_load(tmp_path, extra):
    """The SFT and RL jobs are the recipe's sections as `k3rl sft` / `k3rl train` load them, with only the run
    directory, the starting model and (at most `rl.steps`, never 0) `eval.every` set by the quickstart."""
    from k3rl.rl.commands.quickstart import rl_job, sft_job
    from k3rl.rl.config import QuickstartJob, SFTJob, TrainJob, load_config, to_yaml

    recipe = REPO / "configs/rl/quickstart.yaml"
    cfg = load_config(recipe, extra, QuickstartJob)
    sft = load_config(recipe, extra + [f"run.output_dir={tmp_path}", "run.name=sft", f"sft.model_dir={tmp_path}/init"],
                      SFTJob)
    every = cfg.eval.every if 0 < cfg.eval.every <= cfg.rl.steps else cfg.rl.steps
    rl = load_config(recipe, extra + [f"run.output_dir={tmp_path}", "run.name=rl", f"rl.model_path={tmp_path}/sft/model",
                                      f"eval.every={every}"], TrainJob)
    assert to_yaml(sft_job(cfg, tmp_path, tmp_path / "init")) == to_yaml(sft)
    assert to_yaml(rl_job(cfg, tmp_path, tmp_path / "sft" / "model")) == to_yaml(rl)
    assert rl_job(cfg, tmp_path, tmp_path).eval.every == (3 if extra[:1] == ["eval.every=0"] else 8 if not extra else 5)


def test_quickstart_needs_held_out_tasks(tmp_path, capsys):
    assert main([f"run.output_dir={tmp_path}", "eval.num_tasks=0"]) == 2
    assert "eval.num_tasks: the quickstart compares held-out success" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_make_tasks_names_the_keys_when_the_env_cannot():
    from k3rl.envs.base import Env
    from k3rl.rl.config import ConfigError
    from k3rl.rl.orchestrator.tasks import make_tasks, task_key

    class Few(Env):
        def tasks(self, n, seed=0):
            if n > 3:
                raise ValueError(f"only 3 tasks, asked for {n}")
            return [{"id": f"t{i}", "q": i} for i in range(n)]

    assert make_tasks(Few(), 2, 0, "env.num_tasks") == [{"id": "t0", "q": 0}, {"id": "t1", "q": 1}]
    with pytest.raises(ConfigError, match=r"env.num_tasks / env.args: environment Few cannot make 5 tasks "
                                          r"\(seed 7\): only 3 tasks, asked for 5"):
        make_tasks(Few(), 5, 7, "env.num_tasks / env.args")
    with pytest.raises(ConfigError, match="sft.num_tasks: environment Env cannot make 1 tasks"):
        make_tasks(Env(), 1, 0, "sft.num_tasks")  # an env without a task generator
    assert task_key({"id": "a", "q": 1}) == task_key({"q": 1, "id": "b"}) != task_key({"q": 2})


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(2700)  # ~6 min on an idle 2-core machine; room for a loaded one
def test_the_default_recipe_learns_beyond_its_confidence_interval(tmp_path):
    """The main job itself (`make run`'s recipe, ~8 min on 2 cores): after RL the held-out greedy
    success beats the SFT policy's by more than the difference's 95% interval, and the gain is the
    habit RL was given to unlearn (hedged answers): F1 rises with it."""
    # a process of its own, as `make run` runs it: its own local Ray cluster (the session's has 2 CPUs)
    done = subprocess.run([sys.executable, "-m", "k3rl.rl.commands.quickstart", f"run.output_dir={tmp_path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=2600)
    print(done.stdout[-800:], done.stderr[-2000:])
    assert done.returncode == 0
    report = json.loads((tmp_path / "quickstart" / "report.json").read_text())
    assert report["improved_beyond_ci"], report
    assert report["difference_ci95"][0] > 0 and report["after"]["f1"] > report["before"]["f1"]


def _result(k1, k2, n=100, collapse=()):
    from k3rl.rl.metrics import wilson_interval

    low, high = newcombe_interval(k1, n, k2, n)
    part = lambda k, step: {"step": step, "successes": k, "tasks": n, "success": k / n,  # noqa: E731
                            "ci95": list(wilson_interval(k, n)), "f1": 0.2, "reward": 0.3}
    return {"before": part(k1, 0), "after": part(k2, 8), "difference": (k2 - k1) / n,
            "difference_ci95": [low, high], "improved_beyond_ci": low > 0 and wilson_interval(k2, n)[0] > k1 / n,
            "collapses": list(collapse)}


def test_a_collapse_is_found_in_the_training_curve_and_named_with_what_to_try():
    # the run of issue 11: reward 0.12, 0.15, then 7 of 8 groups all zero
    rows = [{"step": 0, "eval/success_rate": 0.0},
            {"step": 1, "reward/mean": 0.12, "groups/zero_variance_frac": 0.0},
            {"step": 2, "reward/mean": 0.149, "groups/zero_variance_frac": 0.0},
            {"step": 3, "reward/mean": 0.0016, "groups/zero_variance_frac": 0.875, "train/kl_ref": 0.13},
            {"step": 4, "reward/mean": 0.10, "groups/zero_variance_frac": 0.25}]
    (c,) = collapses(rows)
    assert c["step"] == 3 and c["best_reward_before"] == 0.149 and c["kl_ref"] == 0.13
    assert collapses(rows[:3]) == []  # a noisy but healthy curve is not a collapse
    text = "\n".join(summary_lines(_result(0, 0, collapse=[c])))
    assert "did NOT improve" in text and "collapse at step 3" in text
    assert "what to try: training collapsed at step 3" in text and "learner.lr=" in text


def test_no_improvement_without_collapse_suggests_more_steps_or_another_seed():
    text = "\n".join(summary_lines(_result(10, 14)))
    assert "did NOT improve" in text and "rl.steps" in text and "run.seed" in text
    good = "\n".join(summary_lines(_result(0, 40)))
    assert "RL improved held-out success beyond the confidence intervals" in good and "what to try" not in good
