"""`Collector`: which tasks go to the rollout workers, and where what comes back goes.

The trainer (rl/orchestrator/trainer.py) asks for "the groups of the next step" and "the held-out episodes"; the
collector decides what to dispatch and routes what finishes; the pool (rl/orchestrator/rollout_pool.py) owns the
actors, their weights and the calls in flight.

- Training tasks come from a shuffled pass over the training set (one fixed permutation per epoch,
  seeded by `seed` and the epoch), so `cursor` — tasks handed out so far — alone says where the run
  is. Tasks whose collection was lost with a worker (`requeue`) are handed out again first.
- `collect(version)` keeps idle workers busy until `tasks_per_step` groups within the staleness
  bound wait in the buffer (rl/orchestrator/buffer.py). In async mode prefetch is capped at
  `tasks_per_step × (1 + max_staleness)` groups waiting or in flight while the learner waits, and
  `prefetch_while_training` tops up to `tasks_per_step × max_staleness` while it trains.
- `evaluate(tasks, step)` spreads held-out tasks over the workers (one episode each, `eval_sampling`);
  a chunk lost with a worker is run again.
- Partial rollouts (the pool's `partial_rounds`): a group whose episodes a worker keeps between calls
  is in flight, not lost and not handed out again. Every idle worker that holds such groups is called
  again (with new tasks only up to `chunk_tasks` groups on it), so paused episodes keep going; the
  tasks of held groups whose actor died are queued again like a lost collection's.
- `state_dict` (cursor, requeue, the pool's counters, every buffered trajectory) is the part of a
  checkpoint that makes a resumed run hand out the same tasks and lose no trajectory. Held groups
  live only in their workers' memory: the checkpoint lists their tasks first in `requeue`, so a
  resumed run collects them again from the start (the uninterrupted run finishes them instead:
  either way each task's group is trained once).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Any, Optional

import numpy as np

from k3rl.rl.orchestrator.buffer import Taken, TrajectoryBuffer
from k3rl.rl.orchestrator.rollout_pool import RolloutPool


class Collector:
    """Task hand-out, buffering and held-out collection over a `RolloutPool`; see module docstring."""

    def __init__(self, pool: RolloutPool, train_tasks: list[tuple[str, Any]], *, seed: int, group_size: int,
                 tasks_per_step: int, max_staleness: int, eval_sampling: Any):
        self.pool = pool
        self.train_tasks = train_tasks
        self.seed, self.group_size, self.tasks_per_step = seed, group_size, tasks_per_step
        self.max_staleness = max_staleness
        """0 in sync mode: every step's rollouts use the current weights and nothing is prefetched."""
        self.eval_sampling = eval_sampling
        self.chunk_tasks = math.ceil(tasks_per_step / pool.num_workers)
        self.cursor = 0
        """Training tasks handed out so far, over all epochs."""
        self.requeue: deque[tuple[str, Any]] = deque()
        """Tasks whose collection was lost with a worker, handed out again before new ones."""
        self.buffer = TrajectoryBuffer()
        self.gen_tokens = 0
        """Tokens sampled by the training collections that arrived since `reset_counters`."""
        self._eval_pending: deque[list[tuple[str, Any]]] = deque()
        self._eval_results: list = []

    def next_tasks(self, k: int) -> list[tuple[str, Any]]:
        """k training tasks: first any waiting to be collected again, then the shuffled pass at the cursor."""
        out = []
        while self.requeue and len(out) < k:
            out.append(self.requeue.popleft())
        n = len(self.train_tasks)
        while len(out) < k:
            epoch, i = divmod(self.cursor, n)
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
            out.append(self.train_tasks[int(order[i])])
            self.cursor += 1
        return out

    def _dispatch_train(self, slot: Any, tasks: list[tuple[str, Any]]) -> None:
        # a call spanning two epochs may hold a task twice: its second group gets its own id
        seen: Counter = Counter()
        named = []
        for task_id, task in tasks:
            seen[task_id] += 1
            named.append((task_id if seen[task_id] == 1 else f"{task_id}#{seen[task_id]}", task))
        self.pool.dispatch(slot, "train", tasks, self.group_size, named=named)

    def fill(self, target_groups: int, version: int) -> None:
        """Hand training tasks to idle workers while waiting + in-flight groups stay below `target_groups`;
        an idle worker holding paused groups is called again either way."""
        self._requeue_lost()
        missing = target_groups - self.buffer.available(version, self.max_staleness) - self.pool.in_flight("train")
        for slot in self.pool.idle():
            held = len(slot.held)
            k = max(0, min(self.chunk_tasks - held, missing))
            if k or held:
                self._dispatch_train(slot, self.next_tasks(k))
                missing -= k

    def _requeue_lost(self) -> None:
        self.requeue.extendleft(reversed(self.pool.take_lost()))

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for at least one collection (or `timeout`) and route every finished one: training groups to
        the buffer, held-out episodes to the evaluation; a collection lost with its actor is queued again."""
        finished = self.pool.wait(timeout)
        self._requeue_lost()
        for f in finished:
            chunk, trajectories = f.chunk, f.trajectories
            if trajectories is None:
                if chunk.kind == "train":
                    self.requeue.extendleft(reversed(chunk.tasks))
                else:
                    self._eval_pending.appendleft(chunk.tasks)
            elif chunk.kind == "train":
                self.buffer.add(trajectories)
                self.gen_tokens += sum(t.num_sampled for t in trajectories)
            else:
                self._eval_results.extend(trajectories)
        return len(finished)

    def collect(self, version: int) -> None:
        """Until `tasks_per_step` groups within the staleness bound of `version` wait in the buffer."""
        n = self.tasks_per_step
        target = n * (1 + self.max_staleness)
        while self.buffer.available(version, self.max_staleness) < n:
            self.fill(target, version)
            self.wait()

    def take(self, version: int) -> Taken:
        """The step's groups (the oldest within the bound; older ones are dropped and counted)."""
        return self.buffer.take(self.tasks_per_step, version, self.max_staleness)

    def prefetch_while_training(self, version: int) -> None:
        """Async mode: keep workers busy while the learner trains; its update will raise the version by
        one before anything collected now is trained."""
        self.fill(self.tasks_per_step * self.max_staleness, version)

    def drain(self) -> None:
        """Await every collection in flight (before a checkpoint) and route it."""
        while self.pool.busy():
            self.wait()

    def evaluate(self, tasks: list[tuple[str, Any]], step: int) -> list:
        """One episode per held-out task (at `eval_sampling`), spread over the workers, in arrival order: how
        rl/orchestrator/pool_runner.py's `PoolRunner` plays."""
        size = math.ceil(len(tasks) / self.pool.num_workers)
        self._eval_pending = deque(tasks[i:i + size] for i in range(0, len(tasks), size))
        self._eval_results = []
        while self._eval_pending or self.pool.in_flight("eval"):
            for slot in self.pool.idle():
                if self._eval_pending:
                    self.pool.dispatch(slot, "eval", self._eval_pending.popleft(), 1, prefix=f"eval{step}/",
                                       sampling=self.eval_sampling)
            self.wait()
        results, self._eval_results = self._eval_results, []
        return results

    def state_dict(self) -> dict[str, Any]:
        in_flight = self.pool.held_tasks() + self.pool.lost
        return {"cursor": self.cursor, **self.pool.state_dict(), "requeue": in_flight + list(self.requeue),
                "unconsumed": self.buffer.trajectories(), "dropped_groups": self.buffer.dropped_groups,
                "dropped_trajectories": self.buffer.dropped_trajectories}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])
        self.pool.load_state_dict(state)
        self.requeue = deque(tuple(t) for t in state["requeue"])
        self.buffer.load_state_dict({"trajectories": state["unconsumed"], "dropped_groups": state["dropped_groups"],
                                     "dropped_trajectories": state["dropped_trajectories"]})


__all__ = ["Collector"]
