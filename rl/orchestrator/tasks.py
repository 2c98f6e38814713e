"""Task sets of a job: read from JSONL files row by row or drawn from an environment, with named errors,
and compared by content.

`k3rl sft` and `k3rl train` draw their training and held-out tasks here, so both keep held-out
tasks apart from training tasks by the same rule; `job_tasks` is the trainer's pair of named task lists.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from k3rl.envs.jsonl import JsonlError, jsonl_lines, parse_line
from k3rl.rl.config import BadRows, ConfigError


def make_tasks(env: Any, n: int, seed: int, keys: str) -> list[Any]:
    """`env.tasks(n, seed)`; an environment that cannot make them is a `ConfigError` naming `keys`
    (the config keys that asked for them)."""
    try:
        return env.tasks(n, seed=seed)
    except (NotImplementedError, ValueError) as e:
        raise ConfigError(f"{keys}: environment {type(env).__name__} cannot make {n} tasks (seed {seed}): {e}") from None


def task_key(task: Any) -> str:
    """Identity of a task's content (its id left out): tasks drawn with different seeds may coincide."""
    body = {k: v for k, v in task.items() if k != "id"} if isinstance(task, dict) else task
    return json.dumps(body, sort_keys=True, default=str)


def remove_training_tasks(held_out: list[Any], train: list[Any]) -> tuple[list[Any], str | None]:
    """Held-out tasks minus those whose content equals a training task, and a line saying how many
    were dropped (None when none were): a held-out set that silently shrinks misleads a reader."""
    seen = {task_key(t) for t in train}
    kept = [t for t in held_out if task_key(t) not in seen]
    dropped = len(held_out) - len(kept)
    if not dropped:
        return kept, None
    return kept, (f"held-out tasks: dropped {dropped} of {len(held_out)} that equal a training task, "
                  f"{len(kept)} left")


BAD_ROW_POLICIES = tuple(m.value for m in BadRows)  # the choices of `env.bad_task_rows`


def read_tasks(path: str | Path, env: Any = None, bad_rows: str = "refuse",
               skipped: Optional[list[str]] = None) -> list[Any]:
    """Tasks of a JSONL file, one JSON value per non-empty line. With `env`, every task is checked by
    starting an episode on it (`env.reset`), so a row of the wrong shape is named (file and line)
    before anything runs instead of failing later inside a rollout worker.

    `bad_rows`: `refuse` (the first bad row is a ConfigError) or `skip` (bad rows are left out and
    described in `skipped`, "file:line: reason" each). A file that is not UTF-8 is refused either way.
    Lines are split on `\n` only (envs/jsonl.py reads them)."""
    if bad_rows not in BAD_ROW_POLICIES:
        raise ConfigError(f"bad task rows: {bad_rows!r} is not one of {', '.join(BAD_ROW_POLICIES)}")
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"task file not found: {path}")
    tasks = []
    try:
        # split on `\n` only: a JSON string may hold U+2028 and the other Unicode line breaks
        lines = list(jsonl_lines(path))
    except JsonlError as e:
        raise ConfigError(str(e)) from None
    for i, line in lines:
        try:
            task = parse_line(f"{path}:{i}", line)
            if env is not None:
                try:
                    env.reset(task)
                except Exception as e:  # whatever the environment raises for a task it cannot start
                    raise ConfigError(f"not a task of environment {type(env).__name__} "
                                      f"({type(e).__name__}: {e})") from None
        except JsonlError as e:
            problem = str(e)
        except ConfigError as e:
            problem = f"{path}:{i}: {e}"
        else:
            tasks.append(task)
            continue
        if bad_rows == "refuse":
            raise ConfigError(problem + " (env.bad_task_rows=skip leaves such rows out)")
        if skipped is not None:
            skipped.append(problem)
    return tasks


@dataclass
class JobTasks:
    """The training and held-out tasks of a `k3rl train` job, each as (task id, task)."""

    train: list[tuple[str, Any]]
    held_out: list[tuple[str, Any]]
    dropped_line: Optional[str] = None
    """How many held-out tasks equal a training task and were dropped (None: none)."""
    skipped_rows: list[str] = field(default_factory=list)
    """Bad task-file rows left out under `env.bad_task_rows=skip`, "file:line: reason" each."""


def _task_id(task: Any, fallback: str) -> str:
    return str(task["id"]) if isinstance(task, dict) and "id" in task else fallback


def job_tasks(cfg: Any, env: Any) -> JobTasks:
    """Training tasks (`env.tasks_path`, else `env.tasks(env.num_tasks, seed=run.seed)`) and held-out tasks
    (`eval.tasks_path`, else `env.tasks(eval.num_tasks, seed=eval.seed)`; none when `eval.every` is 0) minus
    any that equal a training task; ids must be unique within each list."""
    skipped: list[str] = []
    en, ev = cfg.env, cfg.eval
    train = read_tasks(en.tasks_path, env, en.bad_task_rows, skipped) if en.tasks_path else \
        make_tasks(env, en.num_tasks, cfg.run.seed, "env.num_tasks / env.args")
    if not train:
        raise ConfigError("no training tasks (env.tasks_path is empty, or env.num_tasks is 0)")
    held_out, dropped_line = [], None
    if ev.every > 0:
        held_out = read_tasks(ev.tasks_path, env, en.bad_task_rows, skipped) if ev.tasks_path else (
            make_tasks(env, ev.num_tasks, ev.seed, "eval.num_tasks / env.args") if ev.num_tasks > 0 else [])
        held_out, dropped_line = remove_training_tasks(held_out, train)
    named = ([(_task_id(t, f"train-{i}"), t) for i, t in enumerate(train)],
             [(_task_id(t, f"eval-{i}"), t) for i, t in enumerate(held_out)])
    for kind, tasks in zip(("training", "held-out"), named):
        repeated = [task_id for task_id, n in Counter(task_id for task_id, _ in tasks).items() if n > 1]
        if repeated:
            raise ConfigError(f"{kind} task ids must be unique; repeated: {', '.join(repeated[:5])}")
    return JobTasks(*named, dropped_line=dropped_line, skipped_rows=skipped)
