"""Task sets of a job: drawn from an environment with named errors, and compared by content.

`k3rl sft` and `k3rl train` draw their training and held-out tasks here, so both keep held-out
tasks apart from training tasks by the same rule.
"""

from __future__ import annotations

import json
from typing import Any

from rl.config import ConfigError


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
