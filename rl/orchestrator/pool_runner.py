"""`PoolRunner`: the trainer's held-out episodes on its Ray rollout workers, as a `Runner` (rl/eval/runners.py).

It plays through the collector (rl/orchestrator/collector.py `Collector.evaluate`): the tasks are spread over the
workers in chunks, one episode each at the collector's `eval_sampling`, group ids prefixed `eval{step}/`; a chunk
lost with a worker is run again. The trajectories come back in arrival order, which is the order the trainer
scores and writes them in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from k3rl.rl.orchestrator.collector import Collector


class PoolRunner:
    """The held-out evaluation of training step `step` on `collector`'s rollout pool."""

    def __init__(self, collector: Collector, step: int):
        self.collector, self.step = collector, step

    def play(self, tasks: Sequence[tuple[str, Any]]) -> list[Any]:
        return self.collector.evaluate(list(tasks), self.step)


__all__ = ["PoolRunner"]
