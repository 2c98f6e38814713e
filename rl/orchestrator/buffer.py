"""`TrajectoryBuffer`: collected trajectories waiting for the learner, as whole groups, with a staleness bound.

Rollout workers return every sample of a task at once, so the buffer holds complete groups
(trajectories sharing a `group_id`) in arrival order. The trainer asks for `n` groups with
`take(n, learner_version, max_staleness)`:

- the staleness of a group is `learner_version − min_version`, its oldest sampled token's policy
  version against the version the learner would train it at; a group with no sampled token
  at all (every episode ran out of context before generating) has no staleness;
- every group beyond `max_staleness` is removed and reported (`Taken.dropped`, and the running
  totals `dropped_groups` / `dropped_trajectories`): it is never trained on, never silently lost;
- of the rest, the oldest `n` groups are returned (first in, first out: the groups closest to
  the bound go first, which keeps drops rare).

Groups are never split: group-relative advantages need every sample of a task.

`state_dict()` / `load_state_dict()` carry the waiting trajectories (a flat list of
`Trajectory`, which `rl.checkpoint.save_trainer_state` writes as Parquet) and the counters, so a
resumed run trains on exactly what the interrupted one had collected.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

from k3rl.rollout.trajectory import Trajectory


@dataclass
class Group:
    """All samples of one task in one collection (one `group_id`)."""

    group_id: str
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def min_version(self) -> Optional[int]:
        """Oldest policy version among the group's sampled tokens; None when nothing was sampled."""
        versions = [t.min_version for t in self.trajectories if t.num_sampled > 0]
        return min(versions) if versions else None

    def staleness(self, learner_version: int) -> int:
        """Policy versions between the oldest sampled token and the learner (0 without sampled tokens)."""
        v = self.min_version
        return 0 if v is None else learner_version - v

    def __len__(self) -> int:
        return len(self.trajectories)


@dataclass
class Taken:
    """What one `take` returned and what it threw away."""

    groups: list[Group]
    dropped: list[Group]
    """Groups removed because they were more than `max_staleness` versions behind."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


class TrajectoryBuffer:
    """Whole groups of trajectories in arrival order; see module docstring."""

    def __init__(self):
        self._groups: list[Group] = []
        self.dropped_groups = 0
        self.dropped_trajectories = 0

    def add(self, trajectories: Iterable[Trajectory]) -> int:
        """Append trajectories, grouped by `group_id` (a group must arrive in one call); returns groups added."""
        new: dict[str, Group] = {}
        for t in trajectories:
            if not t.group_id:
                raise ValueError(f"trajectory of task {t.task_id!r} has no group_id; the buffer keeps whole groups")
            new.setdefault(t.group_id, Group(t.group_id)).trajectories.append(t)
        waiting = {g.group_id for g in self._groups}
        again = sorted(waiting & set(new))
        if again:
            raise ValueError(f"group(s) {again[:3]} are already in the buffer; group ids must be unique per collection")
        self._groups.extend(new.values())
        return len(new)

    def __len__(self) -> int:
        """Groups waiting."""
        return len(self._groups)

    @property
    def num_trajectories(self) -> int:
        return sum(len(g) for g in self._groups)

    def available(self, learner_version: int, max_staleness: int) -> int:
        """Groups a `take` at this learner version could return."""
        return sum(g.staleness(learner_version) <= max_staleness for g in self._groups)

    def take(self, n_groups: int, learner_version: int, max_staleness: int) -> Taken:
        """Drop (and report) groups beyond the bound, then remove and return the oldest `n_groups` of the rest.

        Fewer than `n_groups` are returned when fewer are available (see `available`).
        """
        if n_groups < 0 or max_staleness < 0:
            raise ValueError(f"take: n_groups and max_staleness must be ≥ 0, got {n_groups}, {max_staleness}")
        fresh, dropped = [], []
        for g in self._groups:
            (fresh if g.staleness(learner_version) <= max_staleness else dropped).append(g)
        self.dropped_groups += len(dropped)
        self.dropped_trajectories += sum(len(g) for g in dropped)
        self._groups = fresh[n_groups:]
        return Taken(groups=fresh[:n_groups], dropped=dropped)

    def trajectories(self) -> list[Trajectory]:
        """Every waiting trajectory, groups in arrival order."""
        return [t for g in self._groups for t in g.trajectories]

    def state_dict(self) -> dict[str, Any]:
        """The waiting trajectories (a flat list; group ids keep the grouping) and the drop counters."""
        return {"trajectories": self.trajectories(), "dropped_groups": self.dropped_groups,
                "dropped_trajectories": self.dropped_trajectories}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._groups = []
        groups: dict[str, Group] = {}
        for t in state["trajectories"]:
            if t.group_id not in groups:
                groups[t.group_id] = Group(t.group_id)
                self._groups.append(groups[t.group_id])
            groups[t.group_id].trajectories.append(t)
        self.dropped_groups = int(state["dropped_groups"])
        self.dropped_trajectories = int(state["dropped_trajectories"])


__all__ = ["Group", "Taken", "TrajectoryBuffer"]
