"""The scalars `k3rl train` logs for one step, from what the step trained on and what the learner reported.

`reward/*`, `success/rate` (the environment's success rule, rl/eval/evaluate.py), `rewards/<component>` (the
batch mean of every numeric reward component the environment reports), `episode/*`, `groups/*`,
`staleness/mean|max`, `buffer/*`, `batch/sequences` (sequences trained: an episode may hold several; the other
statistics count episodes), `workers/restarts`, `policy/version`, `rollout/held_groups` and `train/*` (every
number the learner reports but its version). The trainer adds `perf/*` and, on evaluation steps, `eval/*`.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from k3rl.rl.eval.evaluate import is_success
from k3rl.rl.orchestrator.buffer import Taken, TrajectoryBuffer
from k3rl.rl.orchestrator.rollout_pool import RolloutPool
from k3rl.rollout.trajectory import episodes


def step_metrics(taken: Taken, learner_version: int, version: int, learner_metrics: dict[str, Any],
                 buffer: TrajectoryBuffer, pool: RolloutPool, success_key: Optional[str]) -> dict[str, float]:
    """The step's scalars; `learner_version` trained the batch (staleness is measured against it), `version`
    is the learner's after the step."""
    trajs = episodes(taken.trajectories)  # rewards and episode statistics per episode (sequences: `batch/sequences`)
    rewards = np.array([t.reward for t in trajs], dtype=np.float64)
    stale = [learner_version - t.min_version for t in taken.trajectories if t.num_sampled > 0]
    zero_var = sum(1 for g in taken.groups if np.ptp([t.reward for t in g.trajectories]) == 0)
    out = {
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
        "batch/sequences": float(len(taken.trajectories)),
        "reward/zero_frac": float((rewards == 0).mean()),
        "success/rate": float(np.mean([is_success(t, success_key) for t in trajs])),
        "episode/tokens": float(np.mean([len(t) for t in trajs])),
        "episode/sampled_tokens": float(np.mean([t.num_sampled for t in trajs])),
        "episode/turns": float(np.mean([t.metrics.get("turns", 0.0) for t in trajs])),
        "episode/tool_calls": float(np.mean([t.metrics.get("tool_calls", 0.0) for t in trajs])),
        "episode/truncated_frac": float(np.mean([t.finish_reason.startswith("truncated") for t in trajs])),
        "groups/trained": float(len(taken.groups)), "groups/zero_variance": float(zero_var),
        "groups/zero_variance_frac": zero_var / max(1, len(taken.groups)),
        "staleness/mean": float(np.mean(stale)) if stale else 0.0,
        "staleness/max": float(max(stale)) if stale else 0.0,
        "buffer/dropped_stale_groups": float(len(taken.dropped)),
        "buffer/dropped_stale_total": float(buffer.dropped_groups),
        "buffer/waiting_groups": float(len(buffer)),
        "workers/restarts": float(pool.restarts), "policy/version": float(version),
        "episode/stale_sampled_tokens": float(np.mean([t.metrics.get("stale_sampled_tokens", 0.0) for t in trajs])),
        "episode/stale_state_tokens": float(np.mean([t.metrics.get("stale_state_tokens", 0.0) for t in trajs])),
        "episode/pauses": float(np.mean([t.metrics.get("pauses", 0.0) for t in trajs])),
        "rollout/held_groups": float(len(pool.held_tasks())),
    }
    components = sorted({k for t in trajs for k, v in t.rewards.items() if isinstance(v, (int, float))})
    for key in components:  # whatever the environment reports (exact match, F1, evidence recall, …)
        out[f"rewards/{key}"] = float(np.mean([t.rewards[key] for t in trajs if key in t.rewards]))
    for key, value in learner_metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "version":
            out[f"train/{key}"] = float(value)
    return out
