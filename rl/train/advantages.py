"""Sequence advantages from rewards: the rule every objective's learner step starts from (rl/train/learner.py,
rl/train/group.py, which computes them on the driver so a group may be split across ranks)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from k3rl.rl.algos.base import Algorithm


def compute_advantages(algo: Algorithm, trajectories: Sequence[Any]) -> np.ndarray:
    """Sequence advantages [B] (float32) from each trajectory's reward, per `group_id` (all 1 for an
    objective that uses no rewards, rl/algos/nll.py). The samples of a group are its episodes: the sequences of one
    episode (a shared non-empty `episode_id`) count once, with their episode's reward, and each gets the
    episode's advantage, applied to every sampled token of it."""
    if not trajectories:
        return np.zeros(0, dtype=np.float32)
    if not algo.uses_rewards:
        return np.ones(len(trajectories), dtype=np.float32)
    missing = [i for i, t in enumerate(trajectories) if not t.group_id]
    if missing:
        raise ValueError(f"trajectories {missing[:5]} have no group_id; group-relative advantages need one "
                         f"(the trainer sets it to the task's sample group)")
    episodes: dict[tuple[str, str], int] = {}
    rewards, groups, of = [], [], []
    for i, t in enumerate(trajectories):
        key = (t.group_id, getattr(t, "episode_id", "") or f"#{i}")
        if key not in episodes:
            episodes[key] = len(rewards)
            rewards.append(float(t.reward))
            groups.append(t.group_id)
        elif float(t.reward) != rewards[episodes[key]]:
            raise ValueError(f"episode {key[1]!r} of group {key[0]!r}: its sequences carry different rewards "
                             f"({rewards[episodes[key]]} and {t.reward})")
        of.append(episodes[key])
    per_episode = algo.batch_advantages(torch.tensor(rewards, dtype=torch.float64), groups)  # [episodes]
    return per_episode[torch.tensor(of)].float().numpy()


__all__ = ["compute_advantages"]
