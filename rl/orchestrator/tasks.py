"""Task sets of a job: read from JSONL files row by row or drawn from an environment, with named errors,
and compared by content.

`k3rl sft` and `k3rl train` draw their training and held-out tasks here, so both keep held-out
tasks apart from training tasks by the same rule.
"""

from __future__ import annotations

import json
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
