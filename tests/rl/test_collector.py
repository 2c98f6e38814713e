"""rl/orchestrator/collector.py without Ray or a model: a fake pool whose workers "collect" synthetic trajectories.

Checks: tasks are handed out as one seeded permutation per epoch; a collection lost with its worker
is handed out again before new tasks (training) or re-run (held-out); async prefetch stays within
its cap; a state_dict round trip continues the exact task sequence with nothing lost."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from k3rl.rl.orchestrator.collector import Collector
from k3rl.rl.orchestrator.pool_runner import PoolRunner
from k3rl.rollout.trajectory import Trajectory


def traj(group_id: str, version: int) -> Trajectory:
    n = 4
    mask = np.array([0, 1, 1, 0], dtype=np.uint8)
    return Trajectory(tokens=np.arange(n, dtype=np.int32), loss_mask=mask, logprobs=np.zeros(n, np.float32),
                      versions=np.where(mask == 1, version, -1).astype(np.int32), turn_spans=np.zeros((0, 2), np.int32),
                      prompt_len=1, reward=1.0, group_id=group_id)


@dataclass
class FakeChunk:
    kind: str
    tasks: list
    named: list
    group_size: int
    prefix: str


@dataclass
class FakeSlot:
    chunk: Optional[FakeChunk] = None
    held: dict = field(default_factory=dict)


@dataclass
class FakeFinished:
    chunk: FakeChunk
    trajectories: Optional[list]


class FakePool:
    """`RolloutPool`'s collection interface; `lose` names chunk numbers whose worker dies."""

    def __init__(self, num_workers: int, lose: set[int] = frozenset()):
        self.num_workers = num_workers
        self.slots = [FakeSlot() for _ in range(num_workers)]
        self.lose, self.calls, self.version = set(lose), 0, 0
        self.dispatched: list[FakeChunk] = []
        self.counters = {"spawned": num_workers, "restarts": 0, "chunk_counter": 0}
        self.lost: list = []

    def held_tasks(self):
        return []

    def take_lost(self):
        lost, self.lost = self.lost, []
        return lost

    def idle(self):
        return [s for s in self.slots if s.chunk is None]

    def busy(self):
        return any(s.chunk is not None for s in self.slots)

    def in_flight(self, kind):
        return sum(len(s.chunk.tasks) for s in self.slots if s.chunk is not None and s.chunk.kind == kind)

    def dispatch(self, slot, kind, tasks, group_size, prefix=None, sampling=None, named=None):
        self.counters["chunk_counter"] += 1
        slot.chunk = FakeChunk(kind, list(tasks), list(named or tasks), group_size,
                               prefix or f"c{self.counters['chunk_counter']}/")
        self.dispatched.append(slot.chunk)

    def wait(self, timeout=None):
        out = []
        for slot in self.slots:
            if slot.chunk is None:
                continue
            chunk, slot.chunk = slot.chunk, None
            self.calls += 1
            if self.calls in self.lose:
                out.append(FakeFinished(chunk, None))
            else:
                out.append(FakeFinished(chunk, [traj(chunk.prefix + task_id, self.version)
                                                for task_id, _ in chunk.named for _ in range(chunk.group_size)]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return dict(self.counters)

    def load_state_dict(self, state):
        self.counters = {k: int(state[k]) for k in self.counters}


TASKS = [(f"t{i}", {"q": i}) for i in range(5)]


def collector(pool, **kw) -> Collector:
    args = dict(seed=7, group_size=2, tasks_per_step=3, max_staleness=0, eval_sampling=None)
    return Collector(pool, TASKS, **{**args, **kw})


def test_tasks_follow_one_seeded_permutation_per_epoch_and_lost_ones_come_first():
    c = collector(FakePool(2))
    first = [task_id for task_id, _ in c.next_tasks(10)]
    for epoch in (first[:5], first[5:]):
        assert sorted(epoch) == [t for t, _ in TASKS]
    assert first[:5] != first[5:] and c.cursor == 10
    assert [t for t, _ in collector(FakePool(2)).next_tasks(10)] == first  # deterministic in the seed
    c.requeue.extend([("t9", {}), ("t8", {})])
    assert [t for t, _ in c.next_tasks(3)][:2] == ["t9", "t8"] and c.cursor == 11


def test_collect_fills_the_step_and_a_lost_training_chunk_is_collected_again():
    pool = FakePool(2, lose={1})
    c = collector(pool)
    c.collect(version=0)
    taken = c.take(0)
    assert len(taken.groups) == 3 and all(len(g) == 2 for g in taken.groups)
    lost = pool.dispatched[0].tasks
    assert [len(ch.tasks) for ch in pool.dispatched] == [2, 1, 2]
    assert pool.dispatched[2].tasks == lost  # handed out again, before any new task
    assert c.cursor == 3
    assert c.gen_tokens == 2 * (len(taken.trajectories) + c.buffer.num_trajectories)  # 2 sampled tokens each


def test_async_prefetch_respects_its_cap():
    pool = FakePool(4)
    c = collector(pool, max_staleness=1, tasks_per_step=4)
    c.prefetch_while_training(version=0)
    assert pool.in_flight("train") <= 4 * 1
    c.collect(version=0)
    assert c.buffer.available(0, 1) >= 4 and pool.in_flight("train") == 0


def test_evaluation_reruns_a_lost_chunk_and_returns_one_episode_per_task():
    """The trainer's held-out evaluation plays through `PoolRunner` (the Runner of the Ray pool)."""
    pool = FakePool(2, lose={2})
    c = collector(pool)
    results = PoolRunner(c, step=3).play(TASKS)
    assert sorted(t.group_id for t in results) == [f"eval3/{t}" for t, _ in TASKS]
    assert all(ch.prefix == "eval3/" for ch in pool.dispatched)


def test_state_dict_round_trip_continues_the_task_sequence_with_nothing_lost():
    a = collector(FakePool(2))
    a.collect(version=0)
    a.requeue.append(("t4", {"q": 4}))
    state = a.state_dict()
    b = collector(FakePool(2))
    b.load_state_dict(state)
    assert b.cursor == a.cursor and list(b.requeue) == list(a.requeue)
    assert [t.group_id for t in b.buffer.trajectories()] == [t.group_id for t in a.buffer.trajectories()]
    assert b.pool.counters == a.pool.counters
    assert b.next_tasks(4) == a.next_tasks(4)
