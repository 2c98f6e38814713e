"""Evaluation of finished episodes: success by the environment's own rule, every numeric reward
component with a 95% interval, breakdowns by any task field. The episodes come from a `Runner`
(rl/eval/runners.py).

One scorer for every caller: the trainer's held-out evaluation (rollouts on its Ray workers,
rl/orchestrator/trainer.py), SFT's held-out check, `k3rl eval`'s reports (rl/eval/report.py) and the quickstart
score with `score`, so "success" means the same everywhere. The rule is declared by the environment (`Env.success_metric`, e.g. `em`
for the search and long-context environments): an episode succeeds when that reward component
is ≥ 1, or, for an environment that declares none (or an episode that does not report it), when
its reward is ≥ 1. `env.success_key` overrides it for a job.

Intervals: Wilson for the success rate (rl/metrics.py), and mean ± 1.96 standard errors for each
reward component (its sample standard deviation over √n; NaN with fewer than two episodes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from k3rl.rl.metrics import Z95, wilson_interval
from k3rl.rollout.trajectory import episodes


def success_rule(env: Any, override: Optional[str] = None) -> Optional[str]:
    """The reward component that marks success for `env` (an instance or class): `override` if given,
    else the environment's `success_metric`; None means reward ≥ 1."""
    return override or getattr(env, "success_metric", None)


def is_success(trajectory: Any, success_key: Optional[str]) -> bool:
    """`rewards[success_key] ≥ 1` when the episode reports that component, else reward ≥ 1."""
    rewards = trajectory.rewards
    value = rewards[success_key] if success_key is not None and success_key in rewards else trajectory.reward
    return float(value) >= 1.0


def mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its normal-approximation 95% interval (NaN bounds for n < 2)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if x.size < 2:
        return mean, math.nan, math.nan
    half = z * float(x.std(ddof=1)) / math.sqrt(x.size)
    return mean, mean - half, mean + half


@dataclass
class Score:
    """What a set of episodes achieved."""

    n: int
    successes: int
    success_key: Optional[str]
    reward: tuple[float, float, float]
    """Mean reward with its interval."""
    components: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    """Every numeric reward component any episode reported (`Trajectory.rewards`): mean, low, high over
    the episodes that report it."""
    tool_calls: float = 0.0

    @property
    def rate(self) -> float:
        return self.successes / self.n if self.n else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.successes, self.n)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat scalars for metrics.jsonl/TensorBoard: success rate and interval, counts, mean reward,
        tool calls, and `{component}` means with `{component}_ci_low/high` (when ≥ 2 episodes report it)."""
        low, high = self.interval
        out = {f"{prefix}success_rate": self.rate, f"{prefix}ci_low": low, f"{prefix}ci_high": high,
               f"{prefix}num_tasks": float(self.n), f"{prefix}successes": float(self.successes),
               f"{prefix}reward_mean": self.reward[0], f"{prefix}tool_calls": self.tool_calls}
        for name, (mean, lo, hi) in self.components.items():
            out[f"{prefix}{name}"] = mean
            if not math.isnan(lo):  # (no interval from a single episode)
                out[f"{prefix}{name}_ci_low"] = lo
                out[f"{prefix}{name}_ci_high"] = hi
        return out

    def line(self) -> str:
        """One line: success k/n with its interval, then each component's mean [interval]."""
        low, high = self.interval
        parts = [f"success {self.rate:.3f} = {self.successes}/{self.n} [{low:.3f}, {high:.3f}]"]
        for name, (mean, lo, hi) in [("reward", self.reward), *self.components.items()]:
            parts.append(f"{name} {mean:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if not math.isnan(lo) else ""))
        return "; ".join(parts)


def score(trajectories: Sequence[Any], success_key: Optional[str]) -> Score:
    """Score finished episodes (`rollout.trajectory.Trajectory`, or anything with `reward`, `rewards`
    and `metrics`) by the rule `success_key` (see `is_success`); the sequences of one episode count once
    (rollout/trajectory.py `episodes`)."""
    trajectories = episodes(list(trajectories))
    names = sorted({k for t in trajectories for k, v in t.rewards.items() if isinstance(v, (int, float))})
    components = {k: mean_interval([float(t.rewards[k]) for t in trajectories if k in t.rewards]) for k in names}
    return Score(n=len(trajectories), successes=sum(is_success(t, success_key) for t in trajectories),
                 success_key=success_key, reward=mean_interval([float(t.reward) for t in trajectories]),
                 components=components,
                 tool_calls=float(np.mean([t.metrics.get("tool_calls", 0.0) for t in trajectories]))
                 if trajectories else 0.0)


def breakdown(trajectories: Sequence[Any], tasks: Sequence[Any], by: Sequence[str],
              success_key: Optional[str]) -> dict[tuple, Score]:
    """`Score` per combination of the task fields `by` (e.g. family, length, depth); `tasks[i]` is the
    task of `trajectories[i]`. A task without a field counts under None."""
    if len(tasks) != len(trajectories):
        raise ValueError(f"breakdown: {len(tasks)} tasks for {len(trajectories)} trajectories")
    cells: dict[tuple, list[Any]] = {}
    for t, task in zip(trajectories, tasks):
        key = tuple(task.get(f) if isinstance(task, dict) else getattr(task, f, None) for f in by)
        cells.setdefault(key, []).append(t)
    return {key: score(group, success_key) for key, group in sorted(cells.items(), key=lambda kv: repr(kv[0]))}


def held_out_summary(trajectories: Sequence[Any], tokenizer: Any, tool_names: set[str], success_key: Optional[str],
                     seconds: float) -> dict[str, Any]:
    """SFT's `eval.json` (rl/eval/runners.py `greedy_report`): `score` of token-level episodes by the rule
    `success_key`, and how many sampled turns are well-formed tool calls (parse to one of `tool_names`)."""
    from k3rl.envs.tools import ToolCall, parse

    turns_ok, turns, first_ok = 0, 0, 0
    for t in trajectories:
        for k, (a, b) in enumerate(t.turn_spans.tolist()):
            ids = t.tokens[a:b].tolist()
            if ids and ids[-1] == tokenizer.eos_token_id:
                ids = ids[:-1]
            call = parse(tokenizer.decode(ids, skip_special_tokens=False))
            ok = isinstance(call, ToolCall) and call.name in tool_names
            turns_ok += ok
            turns += 1
            first_ok += ok and k == 0
    result = score(trajectories, success_key)
    n = max(1, len(trajectories))
    return {"tasks": result.n, "success": result.rate, "success_ci95": list(result.interval),
            "success_key": success_key, "mean_reward": sum(t.reward for t in trajectories) / n,
            "components": {k: list(v) for k, v in result.components.items()},
            "first_turn_well_formed": first_ok / n, "turns_well_formed": turns_ok / max(1, turns),
            "mean_turns": turns / n, "seconds": seconds}
