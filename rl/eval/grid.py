"""Long-context evidence-retrieval evaluation: the grid `k3rl eval` (rl/commands/eval.py) runs and pretraining
runs after each stage (`eval_model_grid`).

The grid (rl/eval/cells.py): `eval.families` (envs/longctx/; `file`: the real tasks of `eval.tasks_path`) × `eval.serve` (in
context, or behind the search tool over the same haystack) × `eval.context_lengths` (tokens of the in-context
prompt, counted with the evaluated model's tokenizer), `eval.num_tasks` tasks per cell, deterministic in
`eval.seed`. Each task also records its evidence depths (where each evidence passage sits in the haystack,
0 = start; `depth` is the first one's, the heatmap bins by the deepest: rl/eval/report.py).

Who is evaluated on the same tasks (rl/eval/evaluated.py): the model of `eval.model_path` on the
engine of `rollout.engine` (k3rl's own or vLLM, greedy, the rollout limits of `rollout:`), or a served model
behind the OpenAI-compatible endpoint `eval.endpoint`; its tokenizer counts the lengths. Beside it the
baselines of `eval.baselines` — the environment's `oracle` (the ceiling) and `closed_book` (answers at once
with another task's answer, envs/teachers.py: the floor; rl/eval/baselines.py) — so a reader sees the scale.

Scoring is rl/eval/evaluate.py's `score` (success by the environment's rule with a Wilson interval, every
reward component — EM, F1, evidence recall — with its interval, tool calls), per cell and runner, plus
prompt tokens, tokens the model read and wall time. Effective length (per runner, family and serving):
the longest length whose success is ≥ `eval.effective_ratio` × the success at the shortest length.

Outputs under `run.output_dir/run.name/`: `tasks.jsonl` (one row per task and runner: the task, its
metrics, the transcript after the prompt — the prompt is regenerated from the task), `results.json`,
`results.md` (a table; results.json's `config` names the backend and model evaluated), `heatmap.png` (success by
length × depth per family and serving; rl/eval/report.py). Rows are
appended and flushed as they finish: an interrupted eval started again with the same config skips every
finished task and never repeats one. A task the model cannot hold (prompt longer than
`rollout.max_context_tokens` or the model's positions; a served model's `max_model_len`) or whose episode fails is an error row; the
run goes on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from k3rl.rl.config import ConfigError, EvalJob, validate
from k3rl.rl.eval.baselines import run_baseline
from k3rl.rl.eval.cells import BASELINES, SERVINGS, Cell, GridTask, build_grid
from k3rl.rl.eval.evaluated import check_evaluated, evaluated_model
from k3rl.rl.eval.report import aggregate, heatmap, markdown, write_results
from k3rl.rl.eval.rows import TASKS_FILE, RowWriter, is_transient, read_rows


def check(cfg: Any) -> None:
    """Named errors for an eval config that cannot run, before anything is written."""
    from k3rl.envs.longctx.families import FAMILIES
    from k3rl.envs.longctx.taskfile import FILE_FAMILY, TaskFileError, read_task_file

    ev = cfg.eval
    families = [*FAMILIES, FILE_FAMILY]
    unknown = [f for f in ev.families if f not in families]
    if unknown or not ev.families:
        raise ConfigError(f"eval.families: {unknown or 'empty'}; choose from {', '.join(families)}")
    if FILE_FAMILY in ev.families:  # the whole file is checked: a bad line is named before any work
        if not ev.tasks_path:
            raise ConfigError(f"eval.tasks_path: the {FILE_FAMILY!r} family needs a JSONL task file (envs/README.md)")
        try:
            read_task_file(ev.tasks_path)
        except TaskFileError as e:
            raise ConfigError(f"eval.tasks_path: {e}") from None
    bad = [s for s in ev.serve if s not in SERVINGS]
    if bad or not ev.serve:
        raise ConfigError(f"eval.serve: {bad or 'empty'}; choose from {', '.join(SERVINGS)}")
    bad = [b for b in ev.baselines if b not in BASELINES]
    if bad:
        raise ConfigError(f"eval.baselines: {bad}; choose from {', '.join(BASELINES)}")
    validate(cfg, EvalJob)  # the schema's value checks (rl/config/checks.py), for a config not read by the loader
    check_evaluated(cfg)
    if ev.model_path is not None:
        from k3rl.rl.checkpoint import check_model_path

        # with an endpoint only its tokenizer is read; else every weight once (finite, shapes, manifest)
        check_model_path("eval.model_path", ev.model_path, allow_nonfinite=cfg.run.allow_nonfinite_weights,
                         weights=ev.endpoint is None)


def run_grid(cfg: Any) -> Path:
    """Run (or continue) the grid of a loaded `JobConfig`; returns the output directory."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from k3rl.rl.config import to_yaml

    check(cfg)
    ev = cfg.eval
    out = Path(cfg.run.output_dir) / cfg.run.name
    model = evaluated_model(cfg)  # an endpoint is probed here: unreachable is a ConfigError before any work
    tokenizer = model.tokenizer
    evaluated = model.describe()
    print(f"k3rl eval: {evaluated['model']} on {evaluated['backend']}", flush=True)
    started = time.perf_counter()
    grid = build_grid(cfg, tokenizer)
    print(f"k3rl eval: {len(grid)} tasks in {len({gt.cell for gt in grid})} cells, built in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    # what decides the rows (not where they are written): a resumed eval must have the same
    from omegaconf import OmegaConf

    identity = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("eval", "rollout", "env")}
    # how patient the client is decides no row's content: a resume may raise them to retry the timeouts
    for key in ("endpoint_timeout_s", "endpoint_retries", "endpoint_task_timeout_s"):
        identity["eval"].pop(key, None)
    identity = json.dumps({**identity, "evaluated": evaluated}, sort_keys=True, default=str)
    saved = out / "grid.json"
    rows = read_rows(out / TASKS_FILE)
    if rows and saved.is_file() and saved.read_text() != identity:
        raise ConfigError(f"{out} holds an eval of other eval/rollout/env settings; choose another run.name "
                          f"(or delete {out})")
    saved.write_text(identity)
    (out / "config.yaml").write_text(to_yaml(cfg))
    # error rows of a transient failure (the server was down, slow, overloaded) are run again
    retry = frozenset((r["runner"], r["task_id"]) for r in rows if is_transient(r))
    rows = [r for r in rows if (r["runner"], r["task_id"]) not in retry]
    done = {(r["runner"], r["task_id"]) for r in rows}
    runners = [(model.name, model.rows)] + [(b, lambda tasks, b=b: run_baseline(b, cfg, tasks, tokenizer))
                                         for b in ev.baselines]
    cells: dict[Cell, list[GridTask]] = {}
    for gt in grid:
        cells.setdefault(gt.cell, []).append(gt)
    todo = [(name, fn, [gt for gt in tasks if (name, gt.task_id) not in done]) for name, fn in runners
            for tasks in cells.values()]
    total = sum(len(t) for _, _, t in todo)
    if done:
        print(f"resuming: {len(done)} finished task rows kept, {total} to run", flush=True)
    if retry:
        print(f"resuming: {len(retry)} error rows of a transient failure (connection, timeout, 5xx, 429) run again",
              flush=True)
    writer = RowWriter(out / TASKS_FILE, retry)
    progress = Progress(TextColumn("[bold]eval {task.fields[cell]}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[score]}"), TimeElapsedColumn(), TimeRemainingColumn())
    try:
        with progress:
            bar = progress.add_task("tasks", total=total, cell="", score="")
            for name, fn, tasks in todo:
                for i in range(0, len(tasks), ev.batch_size):
                    batch = tasks[i:i + ev.batch_size]
                    new = fn(batch)
                    writer.write(new)
                    rows.extend(new)
                    mine = [r for r in rows if r["runner"] == name and r["task_id"].startswith(batch[0].cell.name + "/")]
                    rate = sum(r["success"] for r in mine) / max(1, len(mine))
                    progress.update(bar, advance=len(batch), cell=f"{name} {batch[0].cell.name}",
                                    score=f"success {rate:.2f} on {len(mine)}")
                    if i + ev.batch_size >= len(tasks) and not progress.console.is_terminal:
                        # a captured log (a file, CI) gets no live bar: one line per finished cell instead
                        print(f"eval {name} {batch[0].cell.name}: success {rate:.2f} on {len(mine)} "
                              f"[{time.perf_counter() - started:.0f} s, {progress.tasks[0].completed}/{total}]",
                              flush=True)
    finally:
        writer.close()
    result = {"config": {"families": list(ev.families), "serve": list(ev.serve), "lengths": list(ev.context_lengths),
                         "num_tasks": ev.num_tasks, "seed": ev.seed, "model_path": ev.model_path,
                         **evaluated},
              **aggregate(rows, ev.effective_ratio, ev.depth_bins)}
    write_results(result, out)
    shown = heatmap(result, ["model", *ev.baselines], out / "heatmap.png", ev.depth_bins)
    print(markdown(result), end="", flush=True)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {shown}, {out / TASKS_FILE} "
          f"[{time.perf_counter() - started:.0f} s]", flush=True)
    return out


def eval_model_grid(cfg: Any, model_path: str | Path, out: Path, lengths: Sequence[int], *, max_context_tokens: int,
                    max_position_embeddings: Optional[int] = None, engine: str = "torch") -> Path:
    """`run_grid` on the model at `model_path` with the job's `eval`, `env` and `rollout` settings, at `lengths`,
    on `engine` with `max_context_tokens` (and the model's positions set to `max_position_embeddings`), written
    (resumably) to `out`; returns `out`."""
    from omegaconf import OmegaConf

    evaluated: dict[str, Any] = {"model_path": str(model_path), "context_lengths": list(lengths)}
    if max_position_embeddings is not None:
        evaluated["max_position_embeddings"] = max_position_embeddings
    return run_grid(OmegaConf.merge(cfg, {"run": {"output_dir": str(out.parent), "name": out.name}, "eval": evaluated,
                                          "rollout": {"engine": engine, "max_context_tokens": max_context_tokens}}))
