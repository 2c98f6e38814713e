"""`RolloutPool`: the rollout actors of a run, their weights and the collections in flight on them.

The collector (rl/orchestrator/collector.py) decides *what* to collect and where it goes; the pool owns *how*:
- one `RolloutWorker` actor per slot (rollout/worker.py), each seeded apart from every earlier one
  (`spec.seed + 7919 · n` for the n-th actor ever spawned) and placed with Ray's SPREAD strategy;
- weight pushes: the learner's weights go to the object store once and are queued on every actor
  with their version; a slot remembers the version its actor will hold when it runs the next call,
  and a collection's sampled tokens must all carry exactly that version (`WeightSyncError` otherwise);
- dead actors: a slot whose actor died is given a new actor holding the current weights (at most
  `max_restarts` times per run); the collection it was running is handed back as lost, so the collector
  queues its tasks again;
- `dispatch` / `wait`: one `collect` call per idle slot, and the finished ones taken in together;
- partial rollouts (`partial_rounds` > 0): a training call is `collect_partial` — its worker keeps the
  groups not yet ended (a slot's `held` groups, still in flight: counted by `in_flight`, never lost and
  never dispatched twice) and continues them in its next call. Each held group remembers the version of
  every call that sampled it; its tokens must all carry one of those versions. When the actor dies, its
  held groups' tasks go to `lost` for the collector to queue again.

Its counters (`spawned`, `restarts`, `chunk_counter`) are part of a checkpoint, so a resumed run
seeds and names its collections as the uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import ray
from ray.exceptions import RayActorError

from k3rl.rollout.weight_transfer import pack_weights
from k3rl.rollout.worker import PartialCollection, RolloutWorker, WorkerSpec


class WeightSyncError(RuntimeError):
    """A rollout engine sampled with weights other than the ones the driver last pushed to it."""


@dataclass
class Chunk:
    """One `collect` call in flight."""

    kind: str
    """`train` or `eval`."""
    tasks: list[tuple[str, Any]]
    version: int
    """Weights version the worker holds when it runs this call (the last one pushed before it)."""
    ref: Any
    groups: dict[str, tuple[str, Any]] = field(default_factory=dict)
    """A partial call's new groups: group id → the task it collects (empty for a whole-episode call)."""


@dataclass
class Held:
    """A training group whose episodes its worker keeps between partial calls."""

    task: tuple[str, Any]
    versions: list[int]
    """Weights version of every call that sampled it so far."""


@dataclass
class Slot:
    """A rollout worker position: its actor (replaced when it dies) and what is queued on it."""

    actor: Any
    version: int = 0
    pushes: list = field(default_factory=list)
    """(ObjectRef, version) of weight pushes not yet confirmed."""
    chunk: Optional[Chunk] = None
    held: dict[str, Held] = field(default_factory=dict)
    """Partial rollouts: group id → what the actor keeps of a group that has not ended."""


@dataclass
class Finished:
    """A collection that came back (`trajectories`), or was lost with its actor (`trajectories` None)."""

    chunk: Chunk
    trajectories: Optional[list]


class RolloutPool:
    """See module docstring."""

    def __init__(self, spec: WorkerSpec, num_workers: int, num_cpus: float, num_gpus: float = 0.0,
                 max_restarts: int = 10, runtime_env: Optional[dict] = None,
                 log: Callable[[str], None] = lambda line: None, partial_rounds: int = 0):
        if partial_rounds < 0:
            raise ValueError(f"partial_rounds: must be ≥ 0, got {partial_rounds}")
        self.spec, self.num_workers = spec, num_workers
        self.partial_rounds = partial_rounds
        """Turns per episode in one training call before it pauses; 0: whole episodes."""
        self.lost: list[tuple[str, Any]] = []
        """Tasks of held groups whose actor died, waiting for the collector to take them (`take_lost`)."""
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.max_restarts, self.runtime_env, self.log = max_restarts, runtime_env, log
        self.spawned = 0
        self.restarts = 0
        self.chunk_counter = 0
        self.slots: list[Slot] = []
        self._weights: tuple[int, Any] = (0, None)
        self._remote = ray.remote(RolloutWorker)
        self.sync = None
        """rl/orchestrator/weight_sync.py `BroadcastSync` under `rollout.weight_sync: broadcast`; None: pushes go
        through Ray's object store."""

    def state_dict(self) -> dict[str, int]:
        return {"spawned": self.spawned, "restarts": self.restarts, "chunk_counter": self.chunk_counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spawned, self.restarts = int(state["spawned"]), int(state["restarts"])
        self.chunk_counter = int(state["chunk_counter"])

    def start(self) -> None:
        """Spawn the actors (after `load_state_dict` on resume, so seeds continue the run's sequence)."""
        self.slots = [Slot(self._spawn()) for _ in range(self.num_workers)]

    @property
    def actors(self) -> list:
        return [s.actor for s in self.slots]

    def _spawn(self) -> Any:
        self.spawned += 1
        spec = replace(self.spec, seed=self.spec.seed + 7919 * self.spawned)
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "max_restarts": 0, "scheduling_strategy": "SPREAD"}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.runtime_env:
            options["runtime_env"] = self.runtime_env
        return self._remote.options(**options).remote(spec)

    def push_weights(self, named_weights: Any, version: int, blocking: bool) -> None:
        """Queue `named_weights` (with `version`) on every actor; `blocking` waits for each to confirm.
        `named_weights` is a list of (name, tensor) or, better, an ObjectRef to one that the learner put itself
        (rl/train/group.py `LearnerGroup.weights_ref`): then the driver never holds the weights.
        With a broadcast `sync` the learner sends the weights itself and `named_weights` is not used."""
        if self.sync is not None:
            self._weights = (version, None)
            confirmations = self.sync.push(self.actors, version)
        else:
            ref = named_weights if isinstance(named_weights, ray.ObjectRef) else ray.put(pack_weights(named_weights))
            self._weights = (version, ref)
            confirmations = [slot.actor.load_weights.remote(ref, version) for slot in self.slots]
        for slot, confirmation in zip(self.slots, confirmations):
            slot.pushes.append((confirmation, version))
            slot.version = version
        if blocking:
            for slot in self.slots:
                try:
                    self._confirm(slot)
                except RayActorError as e:
                    self._replace(slot, e)
            if self.sync is not None:
                self.sync.wait()

    def _confirm(self, slot: Slot) -> None:
        for ref, version in slot.pushes:
            got = ray.get(ref)
            if got != version:
                raise WeightSyncError(f"a rollout engine reports version {got} after a push of version {version}")
        slot.pushes = []

    def _replace(self, slot: Slot, error: BaseException) -> None:
        """Swap a dead actor for a new one holding the current weights."""
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise RuntimeError(f"rollout workers died {self.restarts} times (rollout.max_restarts="
                               f"{self.max_restarts}); last error: {error}") from error
        self.log(f"[yellow]rollout worker died ({type(error).__name__}); starting a replacement")
        ray.kill(slot.actor, no_restart=True)
        self.lost += [h.task for h in slot.held.values()]
        slot.actor, slot.pushes, slot.version, slot.chunk, slot.held = self._spawn(), [], 0, None, {}
        version, ref = self._weights
        if self.sync is not None and version > 0:
            # a new member: the group forms again with it, and every worker takes the current version once more
            for other, confirmation in zip(self.slots, self.sync.push(self.actors, version)):
                other.pushes.append((confirmation, version))
            slot.version = version
            try:
                self._confirm(slot)
            except RayActorError as e:
                self._replace(slot, e)
        elif ref is not None:
            slot.pushes.append((slot.actor.load_weights.remote(ref, version), version))
            slot.version = version
            try:
                self._confirm(slot)
            except RayActorError as e:
                self._replace(slot, e)

    def idle(self) -> list[Slot]:
        return [s for s in self.slots if s.chunk is None]

    def busy(self) -> bool:
        return any(s.chunk is not None for s in self.slots)

    def in_flight(self, kind: str) -> int:
        """Tasks of `kind` being collected (for `train`, also the groups held between partial calls)."""
        running = sum(len(s.chunk.tasks) for s in self.slots if s.chunk is not None and s.chunk.kind == kind)
        return running + (sum(len(s.held) for s in self.slots) if kind == "train" else 0)

    def held_tasks(self) -> list[tuple[str, Any]]:
        """Tasks of every group held between partial calls, slot by slot in dispatch order."""
        return [h.task for s in self.slots for h in s.held.values()]

    def take_lost(self) -> list[tuple[str, Any]]:
        """The tasks of held groups lost with their actors since the last call."""
        lost, self.lost = self.lost, []
        return lost

    def dispatch(self, slot: Slot, kind: str, tasks: list[tuple[str, Any]], group_size: int,
                 prefix: Optional[str] = None, sampling: Any = None,
                 named: Optional[list[tuple[str, Any]]] = None) -> None:
        """Start `collect` on an idle slot: `named` (default `tasks`) with `group_size` samples each, group
        ids prefixed by `prefix` (default `c<n>/` for the n-th call of the run), with `sampling` (default the
        worker's). The chunk remembers `tasks`, which are what a lost collection hands back."""
        self.chunk_counter += 1
        prefix = f"c{self.chunk_counter}/" if prefix is None else prefix
        named = named if named is not None else tasks
        if kind == "train" and self.partial_rounds:
            ref = slot.actor.collect_partial.remote(named, group_size, prefix, self.partial_rounds)
            groups = {f"{prefix}{task_id}": task for (task_id, _), task in zip(named, tasks)}
            slot.chunk = Chunk(kind, tasks, slot.version, ref, groups)
            return
        args = [named, group_size, prefix] + ([sampling] if sampling is not None else [])
        slot.chunk = Chunk(kind, tasks, slot.version, slot.actor.collect.remote(*args))

    def wait(self, timeout: Optional[float] = None) -> list[Finished]:
        """Wait for at least one collection (or `timeout`), then take in every finished one."""
        busy = [s for s in self.slots if s.chunk is not None]
        if not busy:
            return []
        refs = [s.chunk.ref for s in busy]
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if not ready:
            return []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(ready)
        return [self._finish(slot) for slot in busy if slot.chunk.ref in done]

    def _finish(self, slot: Slot) -> Finished:
        chunk, slot.chunk = slot.chunk, None
        try:
            result = ray.get(chunk.ref)
        except RayActorError as e:
            self._replace(slot, e)
            return Finished(chunk, None)
        partial = isinstance(result, PartialCollection)
        trajectories = self._take_partial(slot, chunk, result) if partial else result
        try:
            self._confirm(slot)
        except RayActorError as e:
            # the collection came back; the actor died afterwards, on a weight push queued behind it
            # (the groups it still held are lost with it: `_replace` hands their tasks to `lost`)
            self._replace(slot, e)
        for t in [] if partial else trajectories:
            sampled = t.versions[t.loss_mask.astype(bool)]
            if len(sampled) and not (sampled == chunk.version).all():
                versions = sorted(set(sampled.tolist()))
                raise WeightSyncError(f"trajectory {t.group_id!r} holds tokens of versions {versions}, but version "
                                      f"{chunk.version} was the last pushed to its worker")
        return Finished(chunk, trajectories)

    def _take_partial(self, slot: Slot, chunk: Chunk, result: Any) -> list:
        """Book a `collect_partial` result: the call sampled every group held before it and its new ones; the
        ended groups come back (their tokens checked against the versions of the calls that sampled them),
        the others stay held."""
        for held in slot.held.values():
            held.versions.append(chunk.version)
        slot.held.update((g, Held(task, [chunk.version])) for g, task in chunk.groups.items())
        ended = {t.group_id for t in result.trajectories}
        known = set(slot.held)
        if ended | set(result.paused) != known or ended & set(result.paused):
            raise RuntimeError(f"a rollout worker's groups disagree with the driver's: it ended {sorted(ended)[:3]}, "
                               f"holds {sorted(result.paused)[:3]}; the driver sent {sorted(known)[:3]}")
        for t in result.trajectories:
            versions = slot.held[t.group_id].versions
            sampled = set(t.versions[t.loss_mask.astype(bool)].tolist())
            if not sampled <= set(versions):
                raise WeightSyncError(f"trajectory {t.group_id!r} holds tokens of versions {sorted(sampled)}, but "
                                      f"the calls that sampled it ran with versions {versions}")
        for g in ended:
            del slot.held[g]
        return result.trajectories

    def close(self) -> None:
        for slot in self.slots:
            ray.kill(slot.actor, no_restart=True)
        self.slots = []
