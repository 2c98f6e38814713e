"""Long-context evaluation inside training (rl/orchestrator/eval_grid.py): `k3rl train` with `eval.grid_every` on a
random tiny K3 trained on needle retrieval in context at 1024 tokens, one step, a grid of needle × context × {1024,
1536} tokens × 2 tasks before the step (with the baselines) and after it.

Checks: each grid's rows and cells are exactly what `k3rl eval` gives on the run's own config.yaml for the same
weights (the initial model; the step's checkpoint); the scalars land in metrics.jsonl and TensorBoard under
`eval_grid/<family>/<serve>/<length>/success|ci_low|ci_high` and `…/effective_length` with the grid's values; the
heatmap by step is written; held-out and grid tasks are checked disjoint from the training tasks, and a config
whose grid draws training tasks (or holds a length too short for its family) is refused naming them, before Ray
starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3rl.rl.commands.eval import main as k3rl_eval
from k3rl.rl.eval.rows import read_rows
from k3rl.rl.metrics import read_metrics
from k3rl.rl.orchestrator.eval_grid import check_disjoint, success_by_step, task_identity

LENGTHS = (1024, 1536)


def job(tmp_path: Path, model: Path, name: str, *extra: str):
    from k3rl.rl.config import JobConfig, load_config

    items = [f"run.output_dir={tmp_path / 'runs'}", f"run.name={name}", f"rl.model_path={model}", "run.seed=7",
             "env.name=needle", "env.args={length: 1024}", "env.num_tasks=8", "rl.steps=1", "rl.tasks_per_step=2",
             "rl.group_size=2", "rl.save_every=1", "rollout.max_new_tokens=16", "rollout.max_turns=2",
             "rollout.max_context_tokens=2048", "rollout.num_workers=1", "rollout.num_cpus=0.5",
             "learner.num_cpus=0.5", "learner.lr=1e-3", "eval.num_tasks=3", "eval.every=1", "eval.grid_every=1",
             "eval.grid_num_tasks=2", "eval.families=[needle]", "eval.serve=[context]",
             f"eval.context_lengths=[{','.join(map(str, LENGTHS))}]", "eval.batch_size=2"]
    return load_config(None, items + list(extra), schema=JobConfig)


@pytest.fixture(scope="module")
def grid_run(k3_dir, ray_cluster, tmp_path_factory):
    from k3rl.rl.orchestrator.trainer import Trainer

    tmp_path = tmp_path_factory.mktemp("grid-run")
    trainer = Trainer(job(tmp_path, k3_dir, "grid"))
    return trainer.train()


def _eval(run_dir: Path, out: Path, name: str, model: Path, *extra: str) -> Path:
    """`k3rl eval` on the run's own config.yaml, the grid's tasks per cell, the given weights."""
    assert k3rl_eval([str(run_dir / "config.yaml"), f"run.output_dir={out}", f"run.name={name}",
                      f"eval.model_path={model}", "eval.num_tasks=2", *extra]) == 0
    return out / name


def _rows(directory: Path) -> list[dict]:
    return sorted(({k: v for k, v in r.items() if k != "seconds"} for r in read_rows(directory / "tasks.jsonl")),
                  key=lambda r: (r["runner"], r["task_id"]))


def _cells(directory: Path) -> tuple[list[dict], list[dict]]:
    result = json.loads((directory / "results.json").read_text())
    return [{k: v for k, v in c.items() if k != "seconds"} for c in result["cells"]], result["effective_lengths"]


def test_the_grid_in_training_gives_k3rl_evals_numbers_for_the_same_weights(grid_run, k3_dir, tmp_path):
    grids = grid_run / "eval_grid"
    # before training: the initial model, with the baselines (once)
    before = _eval(grid_run, tmp_path, "before", k3_dir)
    assert _rows(grids / "step_000000") == _rows(before)
    assert _cells(grids / "step_000000") == _cells(before)
    runners = {r["runner"] for r in _rows(before)}
    assert runners == {"model", "oracle", "closed_book"}
    assert all(c["success"] == 1.0 for c in _cells(before)[0] if c["runner"] == "oracle")
    # after the step: its checkpoint holds the weights the grid evaluated (its own copy is removed once scored)
    after = _eval(grid_run, tmp_path, "after", grid_run / "checkpoints" / "step-000001", "eval.baselines=[]")
    assert _rows(grids / "step_000001") == _rows(after)
    assert _cells(grids / "step_000001") == _cells(after)
    assert {r["runner"] for r in _rows(after)} == {"model"} and not (grids / "step_000001" / "model").exists()
    assert len(_rows(after)) == 2 * len(LENGTHS)
    # (the step-1 rows equal k3rl eval's on checkpoint step-000001 above; a random model's greedy text may read the
    # same after one step, so the transcripts of steps 0 and 1 are not required to differ)


def test_the_grid_scalars_land_at_their_steps(grid_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = {r["step"]: r for r in read_metrics(grid_run)}
    acc = EventAccumulator(str(grid_run / "tb"))
    acc.Reload()
    for step in (0, 1):
        cells, lengths = _cells(grid_run / "eval_grid" / f"step_{step:06d}")
        expected = {}
        for c in cells:
            if c["runner"] == "model":
                name = f"eval_grid/needle/context/{c['length']}"
                expected.update({f"{name}/success": c["success"], f"{name}/ci_low": c["success_ci95"][0],
                                 f"{name}/ci_high": c["success_ci95"][1]})
        (effective,) = [e["effective_length"] for e in lengths if e["runner"] == "model"]
        expected["eval_grid/needle/context/effective_length"] = float(effective or 0)
        assert len(expected) == 3 * len(LENGTHS) + 1
        assert {k: v for k, v in rows[step].items() if k.startswith("eval_grid/")} == expected
        assert "eval/success_rate" in rows[step]  # the held-out evaluation shares the step's row
        for key, value in expected.items():
            assert [e.value for e in acc.Scalars(key) if e.step == step] == [pytest.approx(value)], key


def test_the_heatmap_by_step_is_written(grid_run):
    png = grid_run / "eval_grid" / "heatmap.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ((panel, (steps, lengths, success)),) = success_by_step(grid_run / "eval_grid").items()
    assert panel == ("needle", "context") and steps == [0, 1] and lengths == list(LENGTHS)
    assert all(v is not None and 0.0 <= v <= 1.0 for row in success for v in row)
    assert (grid_run / "eval_grid" / "step_000000" / "heatmap.png").is_file()  # k3rl eval's own, by depth


def test_task_identity_is_family_and_seed_or_file_id_or_content():
    assert task_identity({"family": "needle", "seed": 5}) == task_identity({"family": "needle", "seed": 5,
                                                                            "length": 4096})
    assert task_identity({"family": "needle", "seed": 5}) != task_identity({"family": "multihop", "seed": 5})
    assert task_identity({"family": "file", "id": "q1", "seed": 1}) == task_identity({"family": "file", "id": "q1",
                                                                                     "seed": 2})
    assert task_identity({"id": "a", "question": "x"}) == task_identity({"id": "b", "question": "x"})
    # a task file's row of a generated family is that family's task, whatever id the file gives it
    assert task_identity({"family": "needle", "seed": 5, "id": "row-3"}) == task_identity({"family": "needle", "seed": 5})
    check_disjoint([{"family": "needle", "seed": 5}], [{"family": "needle", "seed": 6}], "held-out tasks", "eval.seed")
    with pytest.raises(Exception, match=r"^eval.seed: 1 of the held-out tasks are training tasks \(needle seed 5\)"):
        check_disjoint([{"family": "needle", "seed": 5}], [{"family": "needle", "seed": 5, "length": 2048}],
                       "held-out tasks", "eval.seed")


def test_grid_tasks_are_disjoint_from_training_and_an_overlap_is_refused(k3_dir, tmp_path, capsys):
    import ray

    import k3rl.envs as envs
    from k3rl.rl.config import ConfigError
    from k3rl.rl.orchestrator.eval_grid import EvalGrid, grid_tasks
    from k3rl.rl.orchestrator.tasks import job_tasks
    from k3rl.rl.orchestrator.trainer import Trainer

    cfg = job(tmp_path, k3_dir, "ok")
    tasks = job_tasks(cfg, envs.make("needle", length=1024))
    grid, lines = EvalGrid.for_job(cfg, tmp_path / "runs" / "ok", tasks)
    drawn = {task_identity(t) for t in grid_tasks(grid.cfg)}
    trained = {task_identity(t) for _, t in tasks.train}
    assert len(drawn) == 2 and len(trained) == 8 and not drawn & trained
    assert lines == ["held-out: 3 tasks, disjoint from 8 training tasks",
                     "eval grid: 2 tasks (2 in each of 2 cells) every 1 steps, disjoint from 8 training tasks"]
    # the grid drawn from the training seed: its tasks are training tasks, refused before Ray starts
    was = ray.is_initialized()
    with pytest.raises(ConfigError, match=r"^eval.seed: 2 of the eval grid's tasks are training tasks \(needle seed "):
        Trainer(job(tmp_path, k3_dir, "overlap", "eval.seed=7"))
    assert ray.is_initialized() == was and not (tmp_path / "runs" / "overlap").exists()
    with pytest.raises(ConfigError, match=r"^eval.context_lengths: cannot build needle/context/512 task 0"):
        Trainer(job(tmp_path, k3_dir, "short", "eval.context_lengths=[512,1024]"))
    assert ray.is_initialized() == was and not (tmp_path / "runs" / "short").exists()


def test_success_by_step_and_its_heatmap_from_results_files(tmp_path):
    """The table the heatmap draws: steps in order, a cell no task of which ran (success null) and a length a grid
    did not have are None; the grids after a resume point are forgotten."""
    from k3rl.rl.orchestrator.eval_grid import EvalGrid, heatmap_by_step

    def cell(runner, serve, length, success):
        return {"runner": runner, "family": "needle", "serve": serve, "length": length, "success": success}

    grids = {0: [cell("model", "context", 1024, 0.5), cell("oracle", "context", 1024, 1.0),
                 cell("model", "search", 1024, 0.25)],
             10: [cell("model", "context", 1024, 0.75), cell("model", "context", 2048, None),
                  cell("model", "search", 1024, 1.0)],
             20: [cell("model", "context", 1024, 0.0)]}
    root = tmp_path / "eval_grid"
    for step, cells in grids.items():
        (root / f"step_{step:06d}").mkdir(parents=True)
        (root / f"step_{step:06d}" / "results.json").write_text(json.dumps({"cells": cells}))
    (root / "step_000030").mkdir()  # a grid that never finished: no results.json
    table = success_by_step(root)
    assert table[("needle", "context")] == ([0, 10, 20], [1024, 2048], [[0.5, None], [0.75, None], [0.0, None]])
    assert table[("needle", "search")] == ([0, 10], [1024], [[0.25], [1.0]])
    assert heatmap_by_step(root, tmp_path / "h.png") == tmp_path / "h.png"
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    assert heatmap_by_step(tmp_path / "none", tmp_path / "x.png") is None and not (tmp_path / "x.png").exists()
    EvalGrid(job(tmp_path, tmp_path / "model", "resumed"), tmp_path).forget_after(10)
    assert sorted(p.name for p in root.iterdir()) == ["step_000000", "step_000010"]


def test_the_grid_context_covers_its_longest_cell_when_training_is_shorter(tmp_path, monkeypatch):
    """A length curriculum's short stage (rollout.max_context_tokens 5120) with its grid at 8K and 16K: the grid runs
    at its own limit (longest cell + GRID_ANSWER_TOKENS), not the training one (every cell used to be an error row:
    'prompt of 8115 tokens … exceeds the context limit 5120'); a limit above that is kept."""
    import k3rl.rl.eval.grid as grid_module
    from k3rl.rl.orchestrator.eval_grid import GRID_ANSWER_TOKENS, EvalGrid

    seen = []

    def fake_grid(cfg, model, out, lengths, *, max_context_tokens, **kw):
        seen.append((list(lengths), max_context_tokens))
        (out / "results.json").write_text(json.dumps({"cells": [], "effective_lengths": []}))

    monkeypatch.setattr(grid_module, "eval_model_grid", fake_grid)
    short = EvalGrid(job(tmp_path, tmp_path / "model", "short", "rollout.max_context_tokens=5120",
                         "eval.context_lengths=[8192,16384]"), tmp_path / "a")
    assert short.max_context_tokens == 16384 + GRID_ANSWER_TOKENS
    short.run(0, learner=None)
    assert seen == [([8192, 16384], 16384 + GRID_ANSWER_TOKENS)]
    long = EvalGrid(job(tmp_path, tmp_path / "model", "long", "rollout.max_context_tokens=65536",
                        "eval.context_lengths=[8192]"), tmp_path / "b")
    assert long.max_context_tokens == 65536
