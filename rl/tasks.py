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
