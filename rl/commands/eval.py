"""Long-context evidence-retrieval evaluation (`k3rl eval CONFIG [key=value …]`).

The grid: `eval.families` (envs/longctx/; `file`: the real tasks of `eval.tasks_file`) × `eval.serve` (in
context, or behind the search tool over the same haystack) × `eval.context_lengths` (tokens of the in-context
prompt, counted with the evaluated model's tokenizer), `eval.num_tasks` tasks per cell, deterministic in
`eval.seed`. Each task also records its evidence depths (where each evidence passage sits in the haystack,
0 = start; `depth` is the first one's, the heatmap bins by the deepest: rl/eval/report.py).

Who is evaluated on the same tasks ("runners", rl/eval/runners.py): the model of `eval.model_path` on the
engine of `rollout.engine` (k3rl's own or vLLM, greedy, the rollout limits of `rollout:`), or a served model
behind the OpenAI-compatible endpoint `eval.endpoint`; its tokenizer counts the lengths. Beside it the
baselines of `eval.baselines` — the environment's `oracle` (the ceiling) and `closed_book` (answers at once
with another task's answer, envs/teachers.py: the floor) — so a reader sees the scale.

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
import math
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from k3rl.rl.config import ConfigError, JobConfig
from k3rl.rl.eval.report import aggregate, heatmap, markdown, write_results
from k3rl.rl.eval.runners import check_evaluated, evaluated_runner, run_baseline

TASKS_FILE = "tasks.jsonl"
SERVINGS = ("context", "search")
BASELINES = ("oracle", "closed_book")
REPORTED = ("em", "f1", "evidence_recall", "evidence_recall_at_5", "search_calls", "open_calls")
"""The reward components and counters a task row keeps (the environments report them; rl/eval/evaluate.py scores them)."""


@dataclass(frozen=True)
class Cell:
    family: str
    serve: str
    length: int

    @property
    def name(self) -> str:
        return f"{self.family}/{self.serve}/{self.length}"


@dataclass
class GridTask:
    """One task of the grid: its cell, id, the environment's task dict, and what its instance looks like."""

    cell: Cell
    task_id: str
    task: dict[str, Any]
    depths: list[float]
    """Position of every evidence passage in the haystack, in [0, 1], in reading order (`Instance.evidence_depths`;
    empty when it has none: unanswerable)."""
    prompt_tokens: int
    """Tokens of the whole in-context prompt (chat template, system message with the tools, the user message)."""

    @property
    def depth(self) -> float:
        """The first (shallowest) evidence passage's position (NaN when there is none): rows' `depth`, as before
        `depths` was recorded."""
        return self.depths[0] if self.depths else math.nan


def scaffold_tokens(env: Any, tokenizer: Any) -> int:
    """Tokens the chat template and the system message (tools, call syntax) add to an in-context prompt's user
    message, so a cell's length counts the whole prompt the model reads, not the user message alone
    (0 for a tokenizer without a chat template: then only the user message is counted)."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        return 0
    from k3rl.rollout.chat import ChatRenderer

    messages = [{"role": "system", "content": env.system_message()}, {"role": "user", "content": ""}]
    return len(ChatRenderer(tokenizer).prompt_tokens(messages))


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
        if not ev.tasks_file:
            raise ConfigError(f"eval.tasks_file: the {FILE_FAMILY!r} family needs a JSONL task file (envs/README.md)")
        try:
            read_task_file(ev.tasks_file)
        except TaskFileError as e:
            raise ConfigError(f"eval.tasks_file: {e}") from None
    bad = [s for s in ev.serve if s not in SERVINGS]
    if bad or not ev.serve:
        raise ConfigError(f"eval.serve: {bad or 'empty'}; choose from {', '.join(SERVINGS)}")
    bad = [b for b in ev.baselines if b not in BASELINES]
    if bad:
        raise ConfigError(f"eval.baselines: {bad}; choose from {', '.join(BASELINES)}")
    if not ev.context_lengths or any(int(n) < 256 for n in ev.context_lengths):
        raise ConfigError(f"eval.context_lengths: each ≥ 256 tokens, got {list(ev.context_lengths)}")
    for key in ("num_tasks", "batch_size", "depth_bins"):
        if getattr(ev, key) < 1:
            raise ConfigError(f"eval.{key}: must be ≥ 1, got {getattr(ev, key)}")
    if not 0 < ev.effective_ratio <= 1:
        raise ConfigError(f"eval.effective_ratio: in (0, 1], got {ev.effective_ratio}")
    check_evaluated(cfg)
    if ev.model_path is not None:
        from k3rl.rl.checkpoint import check_model_path

        # with an endpoint only its tokenizer is read; else every weight once (finite, shapes, manifest)
        check_model_path("eval.model_path", ev.model_path, allow_nonfinite=cfg.run.allow_nonfinite_weights,
                         weights=ev.endpoint is None)


def env_kwargs(cfg: Any, cell: Cell, tokenizer: Any) -> dict[str, Any]:
    """Constructor arguments of a cell's environment: `env.args` when `env.name` is that family (minus the
    grid's own keys), the cell's serving and length, and the tokenizer lengths are counted with."""
    from omegaconf import OmegaConf

    from k3rl.envs.longctx.taskfile import FILE_FAMILY

    base = OmegaConf.to_container(cfg.env.args, resolve=True) if cfg.env.name == cell.family else {}
    base = {k: v for k, v in (base or {}).items() if k not in ("serve", "length", "tokenizer", "path")}
    own = {"path": cfg.eval.tasks_file} if cell.family == FILE_FAMILY else {}
    return {**base, **own, "serve": cell.serve, "length": cell.length, "tokenizer": tokenizer}


def build_grid(cfg: Any, tokenizer: Any) -> list[GridTask]:
    """Every task of the grid, in cell order (family, serving, length), deterministic in `eval.seed`."""
    import k3rl.envs as envs

    ev, out = cfg.eval, []
    for family in ev.families:
        try:
            first = envs.make(family, **env_kwargs(cfg, Cell(family, "context", 0), tokenizer))
        except TypeError as e:  # envs.registry.EnvArgumentError: `env.args` the family refuses
            raise ConfigError(f"env.args: environment {family!r} does not take these arguments ({e})") from None
        # both servings get the haystack of the in-context prompt of the cell's length
        scaffold = scaffold_tokens(first, tokenizer)
        for serve in ev.serve:
            for length in ev.context_lengths:
                cell = Cell(family, serve, int(length))
                env = envs.make(family, **env_kwargs(cfg, cell, tokenizer))
                # the same task seeds at every length and serving: cells differ only in the haystack
                tasks = env.tasks(ev.num_tasks, seed=ev.seed)
                if len(tasks) < ev.num_tasks and (not out or out[-1].cell.family != family):  # said once
                    print(f"k3rl eval: {family} has {len(tasks)} tasks (eval.tasks_file), fewer than "
                          f"eval.num_tasks={ev.num_tasks}: each of its cells runs all of them", flush=True)
                for i, task in enumerate(tasks):
                    task = {**task, "length": cell.length - scaffold}
                    try:
                        inst = env.instance(task)
                    except ValueError as e:  # a length too short for the family's facts, a source too small
                        raise ConfigError(f"eval.context_lengths: cannot build {cell.name} task {i}: {e} (the cell's "
                                          f"{cell.length} tokens minus {scaffold} of chat template and system "
                                          f"message)") from None
                    out.append(GridTask(cell, f"{cell.name}/{i}", task, inst.evidence_depths(),
                                        scaffold + int(inst.meta["tokens"])))
    return out


# ---- per-task results (append-only, resumable)

def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a tasks.jsonl (a line torn by a crash, or anything else that is not a row, is dropped; lines
    end at `\n` only)."""
    if not path.is_file():
        return []
    lines = path.read_text(errors="surrogateescape").split("\n")
    return [row for row in map(_row, lines) if row is not None]


LEGACY_TRANSIENT = ("APIConnectionError:", "APITimeoutError:", "InternalServerError:", "RateLimitError:")
"""How the error of an endpoint row written before rows had an `error_kind` starts when it was transient (the
`openai` client's exceptions for a refused connection, a timeout, a 5xx, a 429)."""


def is_transient(row: dict[str, Any]) -> bool:
    """Whether an error row failed for a reason that may be gone (rl/eval/endpoint_client.py's TRANSIENT kinds): a
    resumed eval runs its task again. A row without `error_kind` (older k3rl) is judged by its error's
    exception name."""
    from k3rl.rl.eval.endpoint_client import TRANSIENT

    if not row.get("error"):
        return False
    if "error_kind" in row:
        return row["error_kind"] in TRANSIENT
    return str(row["error"]).startswith(LEGACY_TRANSIENT)


class RowWriter:
    """Appends rows to tasks.jsonl, flushed and fsynced per batch, after cutting a torn last line and the rows
    of `drop` ((runner, task_id): error rows run again), so the file keeps one row per task; the file is
    replaced whole (os.replace) when it changes, so a crash leaves the old one or the new one."""

    def __init__(self, path: Path, drop: frozenset[tuple[str, str]] = frozenset()):
        self.path = path
        if path.is_file():
            text = path.read_text(errors="surrogateescape")
            keep = text[:text.rfind("\n") + 1]
            if drop:
                keep = "".join(line + "\n" for line in keep.split("\n")[:-1] if _key(line) not in drop)
            if keep != text:
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(keep, errors="surrogateescape")
                os.replace(tmp, path)
        self._file = open(path, "a")

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _row(line: str) -> Optional[dict[str, Any]]:
    """The row of a tasks.jsonl line; None for a line that is not one."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    ok = isinstance(row, dict) and isinstance(row.get("runner"), str) and isinstance(row.get("task_id"), str)
    return row if ok else None


def _key(line: str) -> Optional[tuple[str, str]]:
    """(runner, task_id) of a tasks.jsonl line; None for a line that is not a row."""
    row = _row(line)
    return None if row is None else (row["runner"], row["task_id"])


# ---- the driver

def run_eval(cfg: Any) -> Path:
    """Run (or continue) the grid of a loaded `JobConfig`; returns the output directory."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from k3rl.rl.config import to_yaml

    check(cfg)
    ev = cfg.eval
    out = Path(cfg.run.output_dir) / cfg.run.name
    runner = evaluated_runner(cfg)  # an endpoint is probed here: unreachable is a ConfigError before any work
    tokenizer = runner.tokenizer
    evaluated = runner.describe()
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
    runners = [(runner.name, runner.run)] + [(b, lambda tasks, b=b: run_baseline(b, cfg, tasks, tokenizer))
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


def main(argv: Optional[list[str]] = None) -> int:
    """`k3rl eval CONFIG [key=value …]`."""
    from k3rl.rl.commands.cli import config_parser
    from k3rl.rl.config import load_config

    argv = sys.argv[1:] if argv is None else argv
    args = config_parser("k3rl eval", "long-context evidence-retrieval evaluation: families × lengths × "
                                      "servings, with oracle and closed-book baselines").parse_args(argv)
    try:
        run_eval(load_config(args.config, args.overrides, JobConfig))
    except ConfigError as e:
        print(f"k3rl eval: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
