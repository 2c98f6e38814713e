"""The baselines of `k3rl eval` (rl/eval/grid.py), played on the same tasks as the evaluated model so a reader sees
the scale: the environment's `oracle` (the ceiling) and `closed_book` (answers at once with another task's answer,
envs/teachers.py: the floor), message-level policies through `envs.base.run_episode`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from k3rl.rl.eval.cells import REPORTED, env_kwargs
from k3rl.rl.eval.rows import task_row, tokens_read, transcript

if TYPE_CHECKING:
    from k3rl.rl.eval.cells import GridTask


def run_baseline(name: str, cfg: Any, cell_tasks: Sequence[GridTask], tokenizer: Any) -> list[dict[str, Any]]:
    """The `oracle` or `closed_book` policy on the tasks of one cell (envs.base.run_episode)."""
    import random

    import k3rl.envs as envs
    from k3rl.envs.base import as_token_counter, run_episode, with_budget
    from k3rl.envs.teachers import ClosedBookPolicy, terminal_call
    from k3rl.rl.eval.evaluate import success_rule

    cell = cell_tasks[0].cell
    env = envs.make(cell.family, **env_kwargs(cfg, cell, tokenizer))
    key = success_rule(env, cfg.env.success_key)
    budget = with_budget(env.budget, max_turns=cfg.rollout.max_turns)
    count = as_token_counter(tokenizer)
    guesses = []
    if name == "closed_book":  # another task's final call: an answer of the right kind, not this task's
        for gt in cell_tasks:
            result = run_episode(env, gt.task, env.oracle(gt.task), budget, count)
            guesses.append(terminal_call(env, result.messages))
    rng = random.Random(f"closed_book:{cfg.eval.seed}:{cell.name}")
    rows = []
    for i, gt in enumerate(cell_tasks):
        started = time.perf_counter()
        try:
            if name == "oracle":
                policy = env.oracle(gt.task)
            else:
                others = [g for j, g in enumerate(guesses) if j != i and g is not None]
                policy = ClosedBookPolicy(rng.choice(others)) if others else (lambda messages: "unanswerable")
            result = run_episode(env, gt.task, policy, budget, count)
            info = result.info
            metrics = {"tool_calls": info.get("tool_calls", 0), "tokens_read": tokens_read(result.messages, tokenizer)}
            rewards = {k: v for k, v in info.items() if k in REPORTED}
            rows.append(task_row(name, gt, result.reward, rewards, metrics, time.perf_counter() - started,
                                 transcript(result.messages), key))
        except Exception as e:  # one task's failure is its row, not the run's end
            rows.append(task_row(name, gt, 0.0, {}, {}, time.perf_counter() - started, "", key,
                                 error=f"{type(e).__name__}: {e}"))
    return rows
