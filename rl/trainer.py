"""The RL driver (`k3rl train CONFIG [key=value…]`): rollout workers → buffer → learner → weights back.

`Trainer(cfg)` runs on the Ray driver. It starts (or joins, `ray.address=auto`) a Ray cluster,
creates `rl.num_rollout_workers` rollout actors (engine `rl.engine`) and a `LearnerGroup` of
`rl.num_learners` ranks, and runs `rl.steps` steps. It never looks inside an algorithm: the
learner computes advantages and losses (`rl.algo`); the driver moves trajectories and weights.

One step:
1. collect until the buffer holds `rl.tasks_per_step` groups (`rl.group_size` samples per task)
   within the staleness bound; tasks come from a shuffled pass over the training tasks (one fixed
   permutation per epoch, so the cursor alone says where the run is);
2. `learner.train_step` on those groups (the version goes up by one unless the learner skipped the
   step on a non-finite loss or gradient);
3. push the new weights to every engine with the version number;
4. evaluate every `rl.eval_every` steps (also before the first and after the last) on held-out
   tasks, at `rl.eval_temperature`, and report the success rate with a 95% Wilson interval;
5. log (console, TensorBoard, metrics.jsonl), then checkpoint every `rl.save_every` steps (and
   after the last).

Modes. `sync`: a step's rollouts all use the current weights (staleness 0), and no rollout runs
while the learner trains. `async`: each worker keeps one collection in flight at all times, also
while the learner trains; new weights are queued behind the worker's running collection, so a
collection that started before a push samples with the previous version. Prefetch is capped so
that what is collected can be trained within the bound: `tasks_per_step × (1 + max_staleness)`
groups waiting or in flight while the learner waits, `tasks_per_step × max_staleness` while it
trains (its update will raise the version once more); `max_staleness=0` therefore never
overlaps and equals `sync`. Drops still happen when collections finish out of order (a slow
worker, a replaced one). Staleness of a trajectory = learner version at the step that trains it
− the policy version of its oldest sampled token. A group beyond `rl.max_staleness` is dropped,
not re-collected: it is counted (`buffer/dropped_stale_groups` per step, `buffer/dropped_stale_total`) and its ids go
to metrics.jsonl; it is never trained on. Each collection is checked on arrival: every sampled
token must carry the version last pushed to that worker, otherwise a weight push was lost and
the run stops (`WeightSyncError`) rather than train on tokens from unknown weights.

Failures. A rollout actor that dies (`RayActorError` from a collection or a weight push) is
replaced by a new actor that first receives the current weights; its tasks are collected again
(an eval chunk is re-run). `workers/restarts` counts replacements; `rl.max_worker_restarts`
bounds them. A learner failure ends the run; `rl.resume=true` continues from the last checkpoint.

Zero-variance groups (every sample of a task scored the same, so a group-relative advantage is 0)
are trained on like any other and reported: `groups/zero_variance` per step, and the fraction of
zero-reward trajectories as `reward/zero_frac`.

Checkpoints (`rl/checkpoint.py`, one atomic `checkpoints/step-XXXXXX` directory): the learner
(HF model, optimizer, RNG per rank) and the driver's state: step, RNG states, task cursor,
collection counter, tasks waiting to be collected again, and every collected trajectory not yet
trained on. Before a checkpoint, in-flight collections are awaited and buffered (in async mode a
short pause of the rollouts at each checkpoint), so the checkpoint holds everything collected
from tasks dispatched before it. `rl.resume=true` continues from the newest complete checkpoint:
the learner and driver states are restored, weights are pushed, metrics.jsonl is cut back to the
checkpoint's step and appended to. A fresh run refuses a run directory that already holds one.

Metrics of a step (metrics.jsonl; TensorBoard gets the numbers): `reward/*`, `success/rate`
(`rewards[rl.success_key] ≥ 1`), `evidence_recall/mean` (when the environment reports it),
`episode/*` (tokens, sampled tokens, turns, tool calls, truncated fraction), `groups/*`,
`staleness/mean|max`, `buffer/*`, `workers/restarts`, `policy/version`, `train/*` (everything
the learner reports: loss, `mismatch_kl`, `kl_ref`, clip fractions, grad norm, `maxvio/<layer>`
of MoE models, …), `perf/*` (step time, time waiting for rollouts, training and weight-sync
time; `gen_tokens_per_s` = tokens sampled by the collections that arrived during the step ÷ the
step's wall time, `train_tokens_per_s` from the learner), `eval/*` on evaluation steps, and
`batch` / `dropped`: [group_id, trajectories, oldest policy version] of every group trained or
dropped. Callbacks `fn(trainer, StepResult)` run after each step is logged and saved. Every
held-out evaluation also writes its episodes as text to `eval/step_NNNN.jsonl` (`rl/transcripts.py`).

`rl.model_path` is the initial policy (an HF directory: `k3rl init`, an SFT output, or any HF
causal LM). Training tasks are `env.tasks(rl.num_tasks, seed=run.seed)` or the JSONL file
`rl.tasks_path`; held-out tasks are `env.tasks(rl.eval_tasks, seed=rl.eval_seed)` or
`rl.eval_tasks_path`, minus any task that is also a training task.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import ray
from ray.exceptions import RayActorError

from rl.buffer import Taken, TrajectoryBuffer
from rl.cluster import init_ray
from rl.config import ConfigError, JobConfig, load_config, to_yaml
from rl.metrics import METRICS_FILE, MetricsLogger, plot, wilson_interval
from rl.tasks import make_tasks, remove_training_tasks
from rl.transcripts import write_eval_episodes
from rollout.worker import RolloutWorker, WorkerSpec


TrainJobConfig = JobConfig


class WeightSyncError(RuntimeError):
    """A rollout engine sampled with weights other than the ones the driver last pushed to it."""


@dataclass
class _Chunk:
    """One `collect` call in flight."""

    kind: str
    """`train` or `eval`."""
    tasks: list[tuple[str, Any]]
    version: int
    """Weights version the worker holds when it runs this call (the last one pushed before it)."""
    ref: Any


@dataclass
class _Slot:
    """A rollout worker position: its actor (replaced when it dies) and what is queued on it."""

    actor: Any
    version: int = 0
    pushes: list = field(default_factory=list)
    """(ObjectRef, version) of weight pushes not yet confirmed."""
    chunk: Optional[_Chunk] = None


@dataclass
class StepResult:
    """What a step trained on, given to callbacks after it is logged."""

    step: int
    learner_version: int
    """The learner's version when it trained this batch (staleness is measured against it)."""
    taken: Taken
    metrics: dict[str, float]


def _task_id(task: Any, fallback: str) -> str:
    return str(task["id"]) if isinstance(task, dict) and "id" in task else fallback


def read_tasks(path: str | Path) -> list[Any]:
    """Tasks of a JSONL file, one JSON value per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"task file not found: {path}")
    tasks = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    return tasks


class Trainer:
    """The driver; see module docstring. `train()` runs to `rl.steps` and returns the run directory."""

    def __init__(self, cfg: Any, callbacks: Sequence[Callable[["Trainer", StepResult], None]] = ()):
        from omegaconf import OmegaConf

        import envs
        from envs.base import with_budget
        from rl import checkpoint as ckpt
        from rl.learner import LearnerConfig, LearnerGroup
        from rollout.engine import SamplingParams

        self.cfg, self.rl = cfg, cfg.rl
        self.callbacks = list(callbacks)
        rl = self.rl
        self._check_config()
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.checkpoints = ckpt.CheckpointManager(self.run_dir / "checkpoints", keep=rl.keep_checkpoints)
        latest = self._resume_point()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed)
        import torch

        torch.manual_seed(cfg.run.seed)

        self.env_args = OmegaConf.to_container(rl.env_args, resolve=True) if OmegaConf.is_config(rl.env_args) \
            else dict(rl.env_args)
        env = envs.make(rl.env, **self.env_args)
        self.train_tasks, self.eval_tasks = self._load_tasks(env)
        self.max_staleness = rl.max_staleness if rl.mode == "async" else 0
        self.chunk_tasks = math.ceil(rl.tasks_per_step / rl.num_rollout_workers)
        self.spec = WorkerSpec(
            model_dir=str(rl.model_path), env=rl.env, engine=rl.engine, env_kwargs=self.env_args,
            sampling=SamplingParams(temperature=rl.temperature, top_p=rl.top_p, max_tokens=rl.max_new_tokens),
            max_context_tokens=rl.max_context_tokens, budget=with_budget(env.budget, max_turns=rl.max_turns),
            seed=cfg.run.seed, device=cfg.run.device)
        self.eval_sampling = SamplingParams(temperature=rl.eval_temperature, top_p=1.0,
                                            max_tokens=rl.max_new_tokens, seed=cfg.run.seed)

        self.step = 0
        self.version = 0
        self.cursor = 0
        """Training tasks handed out so far, over all epochs."""
        self.chunk_counter = 0
        self.spawned = 0
        self.restarts = 0
        self.requeue: deque[tuple[str, Any]] = deque()
        """Tasks whose collection was lost with a worker, handed out again before new ones."""
        self.buffer = TrajectoryBuffer()
        self.resumed_from: Optional[Path] = latest
        self.restored_trajectories = 0
        self._eval_pending: deque[list[tuple[str, Any]]] = deque()
        self._eval_results: list = []
        self._gen_tokens = 0
        self._tok: Any = None

        self._owns_ray = not ray.is_initialized()
        init_ray(cfg.ray, py_modules=self._env_modules)
        self._worker_env = None
        if self._env_modules and not self._owns_ray:
            # This process was connected to Ray before the trainer (a notebook, a test): the job's runtime
            # env is fixed, and Ray uploads local modules only at the job level, so the rollout actors find
            # the user's module through PYTHONPATH instead, which reaches workers on this machine only.
            paths = [str(p.parent) for p in self._env_modules] + [p for p in [os.environ.get("PYTHONPATH")] if p]
            self._worker_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}}
        self._remote_worker = ray.remote(RolloutWorker)
        self.learner = None
        self.slots: list[_Slot] = []
        self.logger: Optional[MetricsLogger] = None
        try:
            self._check_resources()
            learner_cfg = LearnerConfig.from_job(cfg, rl.model_path)
            self.learner = LearnerGroup(learner_cfg, num_ranks=rl.num_learners, num_cpus_per_rank=rl.learner_num_cpus,
                                        num_gpus_per_rank=rl.learner_num_gpus)
            if latest is not None:
                self._restore(latest)
            self.slots = [_Slot(self._spawn()) for _ in range(rl.num_rollout_workers)]
            self._weights: tuple[int, Any] = (0, None)
            if self.version > 0:
                self._push_weights(blocking=True)
            resume_step = self.step if latest is not None else (-1 if rl.resume else None)
            self.logger = MetricsLogger(self.run_dir, rl.steps, resume_step=resume_step)
        except BaseException:
            self.close()
            raise
        if latest is not None:
            self.logger.print(f"resumed from {latest} at step {self.step} (policy version {self.version}, "
                              f"{self.restored_trajectories} collected trajectories waiting)")
        if self._dropped_line:
            self.logger.print(f"[yellow]{self._dropped_line}")
        if rl.eval_every > 0 and not self.eval_tasks:
            self.logger.print("[yellow]no held-out tasks left after removing training tasks: evaluation is off")

    def _check_resources(self) -> None:
        """The learner ranks and rollout workers all live at once: a cluster too small for them would
        leave an actor pending forever, so say which keys ask for what instead."""
        rl, have = self.rl, ray.cluster_resources()
        for kind, learner, rollout in (("CPU", rl.learner_num_cpus, rl.rollout_num_cpus),
                                       ("GPU", rl.learner_num_gpus, rl.rollout_num_gpus)):
            need = rl.num_learners * learner + rl.num_rollout_workers * rollout
            if need > have.get(kind, 0.0) + 1e-9:
                key = "num_cpus" if kind == "CPU" else "num_gpus"
                raise ConfigError(
                    f"rl.num_learners × rl.learner_{key} + rl.num_rollout_workers × rl.rollout_{key} = "
                    f"{rl.num_learners} × {learner:g} + {rl.num_rollout_workers} × {rollout:g} = {need:g} {kind}s, "
                    f"but the Ray cluster has {have.get(kind, 0.0):g} (ray.num_cpus / ray.address)")

    def _check_config(self) -> None:
        rl = self.rl
        if rl.mode not in ("sync", "async"):
            raise ConfigError(f"rl.mode: {rl.mode!r} is not one of sync, async")
        if not rl.model_path:
            raise ConfigError("rl.model_path: set the initial policy's HF directory (`k3rl init`, `k3rl sft`, …)")
        positive = ("steps", "tasks_per_step", "group_size", "num_rollout_workers", "num_learners", "keep_checkpoints")
        for name in positive:
            if getattr(rl, name) < 1:
                raise ConfigError(f"rl.{name}: must be ≥ 1, got {getattr(rl, name)}")
        for name in ("max_staleness", "eval_every", "save_every", "max_worker_restarts"):
            if getattr(rl, name) < 0:
                raise ConfigError(f"rl.{name}: must be ≥ 0, got {getattr(rl, name)}")
        from envs.registry import UnknownEnvironment, resolve, user_module_path
        from rl.learner import LearnerConfig

        try:
            LearnerConfig.from_job(self.cfg, rl.model_path)
        except ValueError as e:
            raise ConfigError(f"learner.{e}") from None

        try:
            resolve(rl.env)
            self._env_modules = [p for p in [user_module_path(rl.env)] if p is not None]
        except UnknownEnvironment as e:
            raise ConfigError(f"rl.env: {e}") from None
        if str(self.cfg.run.device).startswith("cuda") and (rl.learner_num_gpus <= 0 or rl.rollout_num_gpus <= 0):
            raise ConfigError("run.device=cuda: set rl.learner_num_gpus and rl.rollout_num_gpus (> 0; fractions share "
                              "a GPU) so that Ray gives the actors a GPU")

    def _resume_point(self) -> Optional[Path]:
        from rl import checkpoint as ckpt

        has_run = (self.run_dir / METRICS_FILE).exists() or bool(ckpt.list_checkpoints(self.checkpoints.root))
        if not self.rl.resume:
            if has_run:
                raise ConfigError(f"run directory {self.run_dir} already holds a run; set rl.resume=true to continue "
                                  f"it, or choose another run.name")
            return None
        return self.checkpoints.latest()

    def _load_tasks(self, env: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        rl = self.rl
        self._dropped_line: Optional[str] = None
        train = read_tasks(rl.tasks_path) if rl.tasks_path else make_tasks(env, rl.num_tasks, self.cfg.run.seed,
                                                                           "rl.num_tasks / rl.env_args")
        if not train:
            raise ConfigError("no training tasks (rl.tasks_path is empty, or rl.num_tasks is 0)")
        held_out = []
        if rl.eval_every > 0:
            held_out = read_tasks(rl.eval_tasks_path) if rl.eval_tasks_path else (
                make_tasks(env, rl.eval_tasks, rl.eval_seed, "rl.eval_tasks / rl.env_args") if rl.eval_tasks > 0 else [])
            held_out, self._dropped_line = remove_training_tasks(held_out, train)
        named = ([(_task_id(t, f"train-{i}"), t) for i, t in enumerate(train)],
                 [(_task_id(t, f"eval-{i}"), t) for i, t in enumerate(held_out)])
        for kind, tasks in zip(("training", "held-out"), named):
            repeated = [task_id for task_id, n in Counter(task_id for task_id, _ in tasks).items() if n > 1]
            if repeated:
                raise ConfigError(f"{kind} task ids must be unique; repeated: {', '.join(repeated[:5])}")
        return named

    # ---- workers and weights

    def _spawn(self) -> Any:
        """A new rollout actor, seeded apart from every earlier one; SPREAD places actors across nodes."""
        from dataclasses import replace

        self.spawned += 1
        spec = replace(self.spec, seed=self.spec.seed + 7919 * self.spawned)
        options: dict[str, Any] = {"num_cpus": self.rl.rollout_num_cpus, "max_restarts": 0,
                                   "scheduling_strategy": "SPREAD"}
        if self.rl.rollout_num_gpus:
            options["num_gpus"] = self.rl.rollout_num_gpus
        if self._worker_env:
            options["runtime_env"] = self._worker_env
        return self._remote_worker.options(**options).remote(spec)

    @property
    def worker_actors(self) -> list:
        return [s.actor for s in self.slots]

    def _push_weights(self, blocking: bool) -> None:
        """Queue the learner's weights (with its version) on every worker; `blocking` waits for each to confirm."""
        ref = ray.put(self.learner.named_weights())
        self._weights = (self.version, ref)
        for slot in self.slots:
            slot.pushes.append((slot.actor.load_weights.remote(ref, self.version), self.version))
            slot.version = self.version
        if blocking:
            for slot in self.slots:
                try:
                    self._confirm(slot)
                except RayActorError as e:
                    self._replace(slot, e)

    def _confirm(self, slot: _Slot) -> None:
        for ref, version in slot.pushes:
            got = ray.get(ref)
            if got != version:
                raise WeightSyncError(f"a rollout engine reports version {got} after a push of version {version}")
        slot.pushes = []

    def _replace(self, slot: _Slot, error: BaseException) -> None:
        """Swap a dead actor for a new one holding the current weights."""
        self.restarts += 1
        if self.restarts > self.rl.max_worker_restarts:
            raise RuntimeError(f"rollout workers died {self.restarts} times (rl.max_worker_restarts="
                               f"{self.rl.max_worker_restarts}); last error: {error}") from error
        if self.logger is not None:
            self.logger.print(f"[yellow]rollout worker died ({type(error).__name__}); starting a replacement")
        ray.kill(slot.actor, no_restart=True)
        slot.actor, slot.pushes, slot.version, slot.chunk = self._spawn(), [], 0, None
        version, ref = self._weights
        if ref is not None:
            slot.pushes.append((slot.actor.load_weights.remote(ref, version), version))
            slot.version = version
            try:
                self._confirm(slot)
            except RayActorError as e:
                self._replace(slot, e)

    # ---- collection

    def _next_tasks(self, k: int) -> list[tuple[str, Any]]:
        """k training tasks: first any waiting to be collected again, then the shuffled pass at the cursor."""
        out = []
        while self.requeue and len(out) < k:
            out.append(self.requeue.popleft())
        n = len(self.train_tasks)
        while len(out) < k:
            epoch, i = divmod(self.cursor, n)
            order = np.random.default_rng([self.cfg.run.seed, epoch]).permutation(n)
            out.append(self.train_tasks[int(order[i])])
            self.cursor += 1
        return out

    def _dispatch(self, slot: _Slot, kind: str, tasks: list[tuple[str, Any]]) -> None:
        self.chunk_counter += 1
        if kind == "train":
            # a call spanning two epochs may hold a task twice: its second group gets its own id
            seen: Counter = Counter()
            named = []
            for task_id, task in tasks:
                seen[task_id] += 1
                named.append((task_id if seen[task_id] == 1 else f"{task_id}#{seen[task_id]}", task))
            ref = slot.actor.collect.remote(named, self.rl.group_size, f"c{self.chunk_counter}/")
        else:
            ref = slot.actor.collect.remote(tasks, 1, f"eval{self.step}/", self.eval_sampling)
        slot.chunk = _Chunk(kind, tasks, slot.version, ref)

    def _in_flight(self, kind: str) -> int:
        return sum(len(s.chunk.tasks) for s in self.slots if s.chunk is not None and s.chunk.kind == kind)

    def _fill(self, target_groups: int) -> None:
        """Hand training tasks to idle workers while waiting + in-flight groups stay below `target_groups`."""
        missing = target_groups - self.buffer.available(self.version, self.max_staleness) - self._in_flight("train")
        idle = [s for s in self.slots if s.chunk is None]
        for slot in idle:
            if missing <= 0:
                break
            k = min(self.chunk_tasks, missing)
            self._dispatch(slot, "train", self._next_tasks(k))
            missing -= k

    def _wait(self, timeout: Optional[float] = None) -> int:
        """Wait for at least one collection (or `timeout`), then take in every finished one; returns how many."""
        busy = [s for s in self.slots if s.chunk is not None]
        if not busy:
            return 0
        refs = [s.chunk.ref for s in busy]
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if not ready:
            return 0
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(ready)
        for slot in busy:
            if slot.chunk.ref in done:
                self._finish(slot)
        return len(done)

    def _finish(self, slot: _Slot) -> None:
        chunk, slot.chunk = slot.chunk, None
        try:
            trajectories = ray.get(chunk.ref)
        except RayActorError as e:
            if chunk.kind == "train":
                self.requeue.extendleft(reversed(chunk.tasks))
            else:
                self._eval_pending.appendleft(chunk.tasks)
            self._replace(slot, e)
            return
        try:
            self._confirm(slot)
        except RayActorError as e:
            # the collection came back; the actor died afterwards, on a weight push queued behind it
            self._replace(slot, e)
        for t in trajectories:
            sampled = t.versions[t.loss_mask.astype(bool)]
            if len(sampled) and not (sampled == chunk.version).all():
                versions = sorted(set(sampled.tolist()))
                raise WeightSyncError(f"trajectory {t.group_id!r} holds tokens of versions {versions}, but version "
                                      f"{chunk.version} was the last pushed to its worker")
        if chunk.kind == "train":
            self.buffer.add(trajectories)
            self._gen_tokens += sum(t.num_sampled for t in trajectories)
        else:
            self._eval_results.extend(trajectories)

    def _collect(self) -> None:
        """Until `tasks_per_step` groups within the bound wait in the buffer."""
        n = self.rl.tasks_per_step
        target = n * (1 + self.max_staleness) if self.rl.mode == "async" else n
        while self.buffer.available(self.version, self.max_staleness) < n:
            self._fill(target)
            self._wait()

    def _drain(self) -> None:
        while any(s.chunk is not None for s in self.slots):
            self._wait()

    # ---- the loop

    def train(self) -> Path:
        """Run the remaining steps; write the plots; release the actors. Returns the run directory."""
        try:
            if self.step == 0 and self.resumed_from is None and self.rl.eval_every > 0 and self.eval_tasks:
                self.logger.log(0, self._evaluate())
            while self.step < self.rl.steps:
                self._train_step()
            plot(self.run_dir)
        finally:
            self.close()
        return self.run_dir

    def _train_step(self) -> None:
        rl = self.rl
        start = time.perf_counter()
        self._gen_tokens = 0
        self._collect()
        waited = time.perf_counter() - start
        learner_version = self.version
        taken = self.buffer.take(rl.tasks_per_step, learner_version, self.max_staleness)
        if rl.mode == "async":
            # this step's update will raise the version by one before anything collected now is trained
            self._fill(rl.tasks_per_step * self.max_staleness)
        t0 = time.perf_counter()
        learner_metrics = self.learner.train_step(taken.trajectories)
        train_s = time.perf_counter() - t0
        self.version = int(learner_metrics["version"])
        self.step += 1
        t0 = time.perf_counter()
        if rl.mode == "async":
            self._wait(timeout=0)
        self._push_weights(blocking=rl.mode == "sync")
        sync_s = time.perf_counter() - t0
        elapsed = time.perf_counter() - start
        scalars = self._step_metrics(taken, learner_version, learner_metrics)
        scalars.update({"perf/step_time_s": elapsed, "perf/rollout_wait_s": waited, "perf/train_s": train_s,
                        "perf/weight_sync_s": sync_s, "perf/gen_tokens_per_s": self._gen_tokens / elapsed,
                        "perf/train_tokens_per_s": float(learner_metrics.get("train_tokens_per_s", 0.0))})
        last = self.step == rl.steps
        if self.eval_tasks and rl.eval_every > 0 and (self.step % rl.eval_every == 0 or last):
            scalars.update(self._evaluate())
        extra = {k: v for k, v in learner_metrics.items() if isinstance(v, str) and v}
        extra["batch"] = [[g.group_id, len(g), g.min_version] for g in taken.groups]
        if taken.dropped:
            extra["dropped"] = [[g.group_id, len(g), g.min_version] for g in taken.dropped]
        self.logger.log(self.step, scalars, extra)
        if (rl.save_every > 0 and self.step % rl.save_every == 0) or last:
            self.save()
        result = StepResult(self.step, learner_version, taken, scalars)
        for callback in self.callbacks:
            callback(self, result)

    def _success(self, t: Any) -> bool:
        key = self.rl.success_key
        return (t.rewards[key] if key in t.rewards else t.reward) >= 1.0

    def _step_metrics(self, taken: Taken, learner_version: int, learner_metrics: dict) -> dict[str, float]:
        trajs = taken.trajectories
        rewards = np.array([t.reward for t in trajs], dtype=np.float64)
        stale = [learner_version - t.min_version for t in trajs if t.num_sampled > 0]
        zero_var = sum(1 for g in taken.groups if np.ptp([t.reward for t in g.trajectories]) == 0)
        out = {
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "reward/zero_frac": float((rewards == 0).mean()),
            "success/rate": float(np.mean([self._success(t) for t in trajs])),
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
            "buffer/dropped_stale_total": float(self.buffer.dropped_groups),
            "buffer/waiting_groups": float(len(self.buffer)),
            "workers/restarts": float(self.restarts), "policy/version": float(self.version),
        }
        recall = [t.rewards["evidence_recall"] for t in trajs if "evidence_recall" in t.rewards]
        if recall:
            out["evidence_recall/mean"] = float(np.mean(recall))
        for key, value in learner_metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "version":
                out[f"train/{key}"] = float(value)
        return out

    def _evaluate(self) -> dict[str, float]:
        """Held-out tasks, one greedy (or `eval_temperature`) episode each, spread over the workers."""
        size = math.ceil(len(self.eval_tasks) / len(self.slots))
        self._eval_pending = deque(self.eval_tasks[i:i + size] for i in range(0, len(self.eval_tasks), size))
        self._eval_results = []
        while self._eval_pending or self._in_flight("eval"):
            for slot in self.slots:
                if slot.chunk is None and self._eval_pending:
                    self._dispatch(slot, "eval", self._eval_pending.popleft())
            self._wait()
        results, self._eval_results = self._eval_results, []
        write_eval_episodes(self.run_dir, self.step, results, self._tokenizer())
        n = len(results)
        k = sum(self._success(t) for t in results)
        low, high = wilson_interval(k, n)
        out = {"eval/success_rate": k / n, "eval/ci_low": low, "eval/ci_high": high, "eval/num_tasks": float(n),
               "eval/successes": float(k), "eval/reward_mean": float(np.mean([t.reward for t in results])),
               "eval/tool_calls": float(np.mean([t.metrics.get("tool_calls", 0.0) for t in results]))}
        for key in ("em", "f1", "evidence_recall"):  # the answer-quality components environments report
            values = [t.rewards[key] for t in results if key in t.rewards]
            if values:
                out[f"eval/{key}"] = float(np.mean(values))
        return out

    def _tokenizer(self) -> Any:
        """The policy's tokenizer (for the held-out transcripts), loaded on first use."""
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(self.rl.model_path))
        return self._tok

    # ---- checkpoints

    def save(self) -> Path:
        """Checkpoint the learner and the driver at the current step (collections in flight are awaited first)."""
        from rl import checkpoint as ckpt

        self._drain()
        with self.checkpoints.begin(self.step) as tmp:
            self.learner.save_into(tmp)
            ckpt.save_trainer_state(tmp, {
                "step": self.step, "version": self.version, "cursor": self.cursor,
                "chunk_counter": self.chunk_counter, "spawned": self.spawned, "restarts": self.restarts,
                "requeue": list(self.requeue), "unconsumed": self.buffer.trajectories(),
                "dropped_groups": self.buffer.dropped_groups,
                "dropped_trajectories": self.buffer.dropped_trajectories})
        return self.checkpoints.root / ckpt.step_dir_name(self.step)

    def _restore(self, path: Path) -> None:
        from rl import checkpoint as ckpt

        version = self.learner.load(path)
        state = ckpt.load_trainer_state(path)
        if int(state["version"]) != version:
            raise ckpt.CorruptCheckpointError(f"{path}: the learner is at version {version}, the trainer state "
                                              f"says {state['version']}")
        self.step, self.version, self.cursor = int(state["step"]), version, int(state["cursor"])
        self.chunk_counter, self.spawned = int(state["chunk_counter"]), int(state["spawned"])
        self.restarts = int(state["restarts"])
        self.requeue = deque(tuple(t) for t in state["requeue"])
        self.buffer.load_state_dict({"trajectories": state["unconsumed"], "dropped_groups": state["dropped_groups"],
                                     "dropped_trajectories": state["dropped_trajectories"]})
        self.restored_trajectories = self.buffer.num_trajectories

    def close(self) -> None:
        """Kill the rollout actors and the learner group; shut Ray down if this trainer started it."""
        for slot in self.slots:
            ray.kill(slot.actor, no_restart=True)
        self.slots = []
        if self.learner is not None:
            learner, self.learner = self.learner, None
            try:
                learner.shutdown()
            except RayActorError as e:
                # a learner rank already gone: its placement group is released with the job
                print(f"k3rl train: learner shutdown: {e}", file=sys.stderr)
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


def main(argv: Optional[list[str]] = None) -> int:
    """`k3rl train CONFIG [key=value…]`."""
    from rl.cli import config_parser

    argv = sys.argv[1:] if argv is None else argv
    args = config_parser("k3rl train", "RL post-training: rollout workers, learner, weight sync, "
                                       "checkpoints (rl.resume=true continues a run)").parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, schema=TrainJobConfig)
        trainer = Trainer(cfg)
    except ConfigError as e:
        print(f"k3rl train: {e}", file=sys.stderr)
        return 2
    print(f"run directory: {trainer.run_dir.resolve()}", flush=True)
    run_dir = trainer.train()
    print(f"finished: {run_dir.resolve()} (metrics.jsonl, tb/, plots/, checkpoints/)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
