"""Long-context evaluation inside training: `k3rl eval`'s retrieval grid (rl/eval/grid.py) on the policy every
`eval.grid_every` steps of `k3rl train`, and the check that no evaluated task is a training task.

The grid is `eval_model_grid` itself, so a step's numbers are the ones `k3rl eval` gives for the same weights and
tasks: the run's `config.yaml` with `eval.model_path=<the weights> eval.num_tasks=<grid tasks per cell>` (and
`eval.baselines=[]` after step 0) reproduces every row. The weights of step N > 0 are the learner's, saved as a
model directory (`eval_grid/step_NNNNNN/model`, a learner save: the HF model beside the optimizer state) and
removed once its grid is scored — the run's checkpoint of that step, when `rl.save_every` makes one, holds the same
weights. Step 0 evaluates `rl.model_path` and is the only grid with `eval.baselines` (oracle, closed book): they
do not depend on the policy, so one run of them gives the scale.

Outputs under `<run_dir>/eval_grid/`: `step_NNNNNN/` (what `k3rl eval` writes: results.json, results.md,
tasks.jsonl, heatmap.png by depth) and `heatmap.png` (success by length × training step, one panel per family and
serving), rewritten after each grid. Scalars at the step (metrics.jsonl, TensorBoard):
`eval_grid/<family>/<serve>/<length>/success|ci_low|ci_high` (a cell whose every task failed to run has none) and
`eval_grid/<family>/<serve>/effective_length` (0 when the shortest length scores 0). A grid runs in the driver
process, between steps.

Disjointness (`task_identity`): a generated long-context task is its family and seed (the same question at every
length and serving), a task of the `file` family its id, any other task its content. The trainer's held-out tasks
(equal ones are already dropped, rl/orchestrator/tasks.py) and the grid's must share no identity with a training
task; an overlap is a ConfigError naming it, before Ray starts.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from k3rl.rl.config import ConfigError
from k3rl.rl.orchestrator.tasks import task_key

GRID_DIR = "eval_grid"
_STEP = re.compile(r"^step_(\d{6,})$")


def task_identity(task: Any) -> str:
    """What makes two tasks the same question: family and seed of a generated long-context task (its length,
    serving and source only change the haystack), the id of a `file` task, else the content (rl/orchestrator/tasks.py
    `task_key`)."""
    from k3rl.envs.longctx.taskfile import FILE_FAMILY

    if isinstance(task, dict) and "family" in task and "seed" in task:
        if task["family"] != FILE_FAMILY:
            return f"{task['family']} seed {task['seed']}"
        if "id" in task:
            return f"{FILE_FAMILY} task {task['id']}"
    return task_key(task)


def check_disjoint(train: Sequence[Any], evaluated: Sequence[Any], what: str, keys: str) -> None:
    """A ConfigError naming the tasks of `evaluated` that are also training tasks (`task_identity`); `what` names
    the evaluated set, `keys` the config keys that choose it."""
    seen = {task_identity(t) for t in train}
    both = sorted({i for i in map(task_identity, evaluated) if i in seen})
    if both:
        shown = "; ".join(s[:120] for s in both[:3]) + ("; …" if len(both) > 3 else "")
        raise ConfigError(f"{keys}: {len(both)} of the {what} are training tasks ({shown}); choose another {keys}")


def grid_tasks(cfg: Any) -> list[dict[str, Any]]:
    """The tasks of the grid of `cfg.eval`, as rl/eval/cells.py `build_grid` draws them (`env.tasks(eval.num_tasks,
    seed=eval.seed)` per cell), without building their haystacks."""
    import k3rl.envs as envs
    from k3rl.rl.eval.cells import Cell, env_kwargs

    ev, out = cfg.eval, []
    for family in ev.families:
        for serve in ev.serve:
            for length in ev.context_lengths:
                try:
                    env = envs.make(family, **env_kwargs(cfg, Cell(family, serve, int(length)), None))
                except TypeError as e:
                    raise ConfigError(f"env.args: environment {family!r} does not take these arguments ({e})") from None
                out += env.tasks(ev.num_tasks, seed=ev.seed)
    return out


GRID_ANSWER_TOKENS = 1024
"""Tokens the in-training grid allows past its longest cell for the episode's turns (configs/longctx/eval.yaml:
16K cells in a 17,408-token context)."""


class EvalGrid:
    """The in-training grid of one run: `due(step)`, `run(step, learner, logger)` → the step's scalars.

    Its context limit is the training one (`rollout.max_context_tokens`) or, when the grid is longer than what the
    run trains on (a length curriculum's short stage), its longest cell + GRID_ANSWER_TOKENS: a cell is never an
    error row just because the run trains at a shorter length. `k3rl eval` gives the same numbers with
    `rollout.max_context_tokens` set to `max_context_tokens`."""

    def __init__(self, cfg: Any, run_dir: Path):
        from omegaconf import OmegaConf

        ev = cfg.eval
        self.every, self.baselines = int(ev.grid_every), list(ev.baselines)
        num_tasks = ev.num_tasks if ev.grid_num_tasks is None else ev.grid_num_tasks
        self.cfg = OmegaConf.merge(cfg, {"eval": {"num_tasks": int(num_tasks), "model_path": str(cfg.rl.model_path)}})
        self.root = Path(run_dir) / GRID_DIR
        self.max_context_tokens = max(int(cfg.rollout.max_context_tokens),
                                      max(ev.context_lengths, default=0) + GRID_ANSWER_TOKENS)

    @classmethod
    def for_job(cls, cfg: Any, run_dir: Path, tasks: Any) -> tuple[Optional[EvalGrid], list[str]]:
        """The run's grid (None when `eval.grid_every` is 0) and the lines that record the disjointness checks of
        the held-out and grid tasks (rl/orchestrator/tasks.py `JobTasks` `tasks`); an overlap is a ConfigError."""
        from k3rl.rl.eval.grid import check

        train = [t for _, t in tasks.train]
        held_out = [t for _, t in tasks.held_out]
        check_disjoint(train, held_out, "held-out tasks", "eval.seed / eval.tasks_path")
        lines = [f"held-out: {len(held_out)} tasks, disjoint from {len(train)} training tasks"] if held_out else []
        if cfg.eval.grid_every <= 0:
            return None, lines
        grid = cls(cfg, run_dir)
        check(grid.cfg)
        grid.check_lengths()
        drawn = grid_tasks(grid.cfg)
        check_disjoint(train, drawn, "eval grid's tasks", "eval.seed")
        ev = grid.cfg.eval
        cells = len(ev.families) * len(ev.serve) * len(ev.context_lengths)
        lines.append(f"eval grid: {len({task_identity(t) for t in drawn})} tasks ({ev.num_tasks} in each of {cells} "
                     f"cells) every {grid.every} steps, disjoint from {len(train)} training tasks")
        return grid, lines

    def check_lengths(self) -> None:
        """Build each family's first task at the shortest length with the model's tokenizer (rl/eval/cells.py
        `build_grid`): a length too short for a family is a ConfigError now, not at the first grid."""
        from omegaconf import OmegaConf

        from k3rl.model.tokenizer import load_tokenizer
        from k3rl.rl.eval.cells import build_grid

        ev = self.cfg.eval
        tokenizer = load_tokenizer(str(ev.model_path), trust_remote_code=bool(self.cfg.run.trust_remote_code))
        build_grid(OmegaConf.merge(self.cfg, {"eval": {"num_tasks": 1, "serve": [ev.serve[0]],
                                                       "context_lengths": [min(ev.context_lengths)]}}), tokenizer)

    def due(self, step: int, last: bool) -> bool:
        return step % self.every == 0 or last

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def run(self, step: int, learner: Any, logger: Any = None) -> dict[str, float]:
        """The grid on the policy at `step` (step 0: `rl.model_path`, with the baselines; else the learner's
        weights); writes its outputs and the heatmap, returns its scalars."""
        from omegaconf import OmegaConf

        from k3rl.rl.eval.grid import eval_model_grid

        self.forget_after(step - 1)
        out = self.step_dir(step)
        out.mkdir(parents=True)
        model = Path(self.cfg.rl.model_path) if step == 0 else out / "model"
        if step > 0:
            learner.save(model)
        cfg = OmegaConf.merge(self.cfg, {"eval": {"baselines": self.baselines if step == 0 else []}})
        ro = cfg.rollout
        with _paused(logger):
            eval_model_grid(cfg, model, out, list(cfg.eval.context_lengths), max_context_tokens=self.max_context_tokens,
                            max_position_embeddings=cfg.eval.max_position_embeddings, engine=str(ro.engine))
        if step > 0:
            shutil.rmtree(model)
        heatmap_by_step(self.root, self.root / "heatmap.png")
        return scalars(json.loads((out / "results.json").read_text()))

    def forget_after(self, step: int) -> None:
        """Remove the grids of the steps after `step`: an attempt a crash ended left them, and the run resumed from
        a checkpoint before them trains those steps again."""
        for s, path in grid_steps(self.root):
            if s > step:
                shutil.rmtree(path)


def grid_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every grid under `root` (`<run_dir>/eval_grid`), in step order."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return sorted(found)


def scalars(result: dict[str, Any], runner: str = "model") -> dict[str, float]:
    """The scalars of one grid's results.json (rl/eval/report.py `aggregate`) for `runner`: success and its 95%
    Wilson interval per cell, effective length per family and serving (0: none)."""
    out: dict[str, float] = {}
    for c in result["cells"]:
        if c["runner"] == runner and c["success"] is not None:
            name = f"eval_grid/{c['family']}/{c['serve']}/{c['length']}"
            lo, hi = c["success_ci95"]
            out.update({f"{name}/success": c["success"], f"{name}/ci_low": lo, f"{name}/ci_high": hi})
    for e in result["effective_lengths"]:
        if e["runner"] == runner:
            out[f"eval_grid/{e['family']}/{e['serve']}/effective_length"] = float(e["effective_length"] or 0)
    return out


def success_by_step(root: Path, runner: str = "model") -> dict[tuple[str, str], tuple[list[int], list[int], list]]:
    """(family, serving) → (steps, lengths, success[step][length], None where a cell has no score), from every
    grid's results.json under `root`."""
    table: dict[tuple[str, str], dict[tuple[int, int], Optional[float]]] = {}
    for step, path in grid_steps(root):
        results = path / "results.json"
        if not results.is_file():
            continue
        for c in json.loads(results.read_text())["cells"]:
            if c["runner"] == runner:
                table.setdefault((c["family"], c["serve"]), {})[(step, c["length"])] = c["success"]
    out = {}
    for panel, cells in sorted(table.items()):
        steps = sorted({s for s, _ in cells})
        lengths = sorted({n for _, n in cells})
        out[panel] = (steps, lengths, [[cells.get((s, n)) for n in lengths] for s in steps])
    return out


def heatmap_by_step(root: Path, path: Path) -> Optional[Path]:
    """Success by context length (columns) × training step (rows), one panel per family and serving; None when no
    grid has results yet. Drawn like rl/eval/report.py's `heatmap` (viridis 0–1, grey: no score)."""
    table = success_by_step(root)
    if not table:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = max(len(steps) for steps, _, _ in table.values())
    fig, axes = plt.subplots(1, len(table), figsize=(3.2 * len(table) + 1.2, 0.35 * rows + 1.6), squeeze=False)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#e8e8e8")
    im = None
    for ax, ((family, serve), (steps, lengths, grid)) in zip(axes[0], table.items()):
        values = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)
        im = ax.imshow(values, vmin=0, vmax=1, cmap=cmap, aspect="auto", origin="upper")
        for (i, j), v in np.ndenumerate(values):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="white" if v < 0.6 else "black", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
                                            for n in lengths])
        ax.set_yticks(range(len(steps)), [str(s) for s in steps])
        ax.set_title(f"{family} · {serve}", fontsize=10)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("training step")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="success (EM)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


@contextmanager
def _paused(logger: Any) -> Iterator[None]:
    """The trainer's progress bar stopped while the grid draws its own (two live displays garble a terminal)."""
    progress = getattr(logger, "progress", None)
    if progress is not None:
        progress.stop()
    try:
        yield
    finally:
        if progress is not None:
            progress.start()
