"""The RL driver (`k3rl train CONFIG [key=value…]`): rollout workers → buffer → learner → weights back.

`Trainer(cfg)` runs on the Ray driver. It starts (or joins, `ray.address=auto`) a Ray cluster,
creates `rollout.num_workers` rollout actors (engine `rollout.engine`) and a `LearnerGroup` of
`rl.num_learners` ranks, and runs `rl.steps` steps. It never looks inside an algorithm: the
learner computes advantages and losses (`algo.name`); the driver moves trajectories and weights.

One step (`_train_step`; the collector, rl/orchestrator/collector.py, decides what the workers collect and routes
what comes back; the pool, rl/orchestrator/rollout_pool.py, owns the actors):
1. collect until the buffer holds `rl.tasks_per_step` groups (`rl.group_size` samples per task)
   within the staleness bound; tasks come from a shuffled pass over the training tasks (one fixed
   permutation per epoch, so the cursor alone says where the run is);
2. `learner.train_step` on those groups (the version goes up by one unless the learner skipped the
   step on a non-finite loss or gradient);
3. push the new weights to every engine with the version number;
4. evaluate every `eval.every` steps (also before the first and after the last) on held-out
   tasks, at `eval.temperature`, and report the success rate with a 95% Wilson interval;
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

Partial rollouts (`rollout.partial_rounds` = k > 0, `rollout.partial_resume`). A training collection
call runs each episode for at most k turns; an episode still running is paused at that turn
boundary and its worker keeps it (and the ended samples of its group) for its next call, which
continues it with the weights pushed in between: one episode spans several learner steps without
holding any of them up. Its sampled tokens carry the version of the call that sampled them (checked
on arrival against the versions pushed before those calls); the staleness bound applies to the
oldest (a group whose first turns are more than `rl.max_staleness` versions behind when trained is
dropped, as above). A held group is in flight: it counts against the prefetch cap, is never handed
out twice, and if its actor dies its task is collected again; a checkpoint lists held groups' tasks
to be collected again on resume (the episodes live only in the workers' memory). Per step:
`episode/stale_sampled_tokens` (mean per trajectory of sampled tokens older than its newest
version), `episode/pauses`, `rollout/held_groups`. `reprefill` prefills the paused context again
under the new weights; `keep_state` (native engine, K3 models) continues from the KV/recurrent state
the old weights computed, prefilling only the new tokens, and reports the mismatch:
`episode/stale_state_tokens` (mean per trajectory of context tokens a turn read from a state older
weights computed; 0 under `reprefill`). vLLM and models without session states refuse `keep_state`
before anything starts.

Failures (rl/orchestrator/rollout_pool.py owns the actors). A rollout actor that dies (`RayActorError` from a
collection or a weight push) is
replaced by a new actor that first receives the current weights; its tasks are collected again
(an eval chunk is re-run). `workers/restarts` counts replacements; `rollout.max_restarts`
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
(the environment's success rule, rl/eval/evaluate.py), `rewards/<component>` (the batch mean of every numeric
reward component the environment reports: exact match, F1, evidence recall, …),
`episode/*` (tokens, sampled tokens, turns, tool calls, truncated fraction), `groups/*`,
`staleness/mean|max`, `buffer/*`, `workers/restarts`, `policy/version`, `train/*` (everything
the learner reports: loss, `mismatch_kl`, `kl_ref`, clip fractions, grad norm, `maxvio/<layer>`
of MoE models, …), `perf/*` (step time, time waiting for rollouts, training and weight-sync
time; `gen_tokens_per_s` = tokens sampled by the collections that arrived during the step ÷ the
step's wall time, `train_tokens_per_s` from the learner), `eval/*` on evaluation steps, and
`batch` / `dropped`: [group_id, trajectories, oldest policy version] of every group trained or
dropped. `eval/*` comes from `rl.eval.evaluate.score`: success rate with its Wilson interval, and every
numeric reward component the environment reports with `_ci_low/_ci_high`. Callbacks `fn(trainer, StepResult)` run
after each step is logged and saved. Every
held-out evaluation also writes its episodes as text to `eval/step_NNNN.jsonl` (`rl/eval/transcripts.py`).

`rl.model_path` is the initial policy (an HF directory: `k3rl init`, an SFT output, or any HF
causal LM). Training tasks are `env.tasks(env.num_tasks, seed=run.seed)` or the JSONL file
`env.tasks_path`; held-out tasks are `env.tasks(eval.num_tasks, seed=eval.seed)` or
`eval.tasks_path`, minus any task that is also a training task.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import ray
from ray.exceptions import RayActorError

from k3rl.rl.config import ConfigError, JobConfig, check_model_code, load_config, to_yaml
from k3rl.rl.eval.evaluate import is_success, score, success_rule
from k3rl.rl.eval.transcripts import write_eval_episodes
from k3rl.rl.metrics import METRICS_FILE, MetricsLogger, plot
from k3rl.rl.orchestrator.buffer import Taken
from k3rl.rl.orchestrator.cluster import init_ray
from k3rl.rl.orchestrator.collector import Collector
from k3rl.rl.orchestrator.pool_runner import PoolRunner
from k3rl.rl.orchestrator.rollout_pool import RolloutPool, WeightSyncError  # noqa: F401  (WeightSyncError: re-exported)
from k3rl.rl.orchestrator.tasks import make_tasks, read_tasks, remove_training_tasks
from k3rl.rollout.worker import WorkerSpec, check_engine_args, check_partial_resume

TrainJobConfig = JobConfig


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


class Trainer:
    """The driver; see module docstring. `train()` runs to `rl.steps` and returns the run directory."""

    def __init__(self, cfg: Any, callbacks: Sequence[Callable[[Trainer, StepResult], None]] = ()):
        from omegaconf import OmegaConf

        import k3rl.envs as envs
        from k3rl.envs.base import with_budget
        from k3rl.rl import checkpoint as ckpt
        from k3rl.rl.train.learner import LearnerConfig, LearnerGroup
        from k3rl.rollout.engine import SamplingParams

        self.cfg, self.rl = cfg, cfg.rl
        self.callbacks = list(callbacks)
        rl = self.rl
        self._check_config()
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.checkpoints = ckpt.CheckpointManager(self.run_dir / "checkpoints", keep=rl.keep_checkpoints)
        self._resume_notes: list[str] = []
        latest = self._resume_point()
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed)
        import torch

        torch.manual_seed(cfg.run.seed)

        ro, en = cfg.rollout, cfg.env
        self.env_args = OmegaConf.to_container(en.args, resolve=True) if OmegaConf.is_config(en.args) else dict(en.args)
        try:
            env = envs.make(en.name, **self.env_args)
        except TypeError as e:  # an argument the environment does not take (`env.args.lenght`)
            raise ConfigError(f"env.args: environment {en.name!r} does not take these arguments ({e})") from None
        self.success_key = success_rule(env, en.success_key)
        """The reward component whose value ≥ 1 is a success (None: reward ≥ 1), rl/eval/evaluate.py."""
        self.train_tasks, self.eval_tasks = self._load_tasks(env)
        self.max_staleness = rl.max_staleness if rl.mode == "async" else 0
        self.spec = WorkerSpec(
            model_dir=str(rl.model_path), env=en.name, engine=str(ro.engine), env_kwargs=self.env_args,
            engine_kwargs=OmegaConf.to_container(ro.engine_args, resolve=True),
            sampling=SamplingParams(temperature=ro.temperature, top_p=ro.top_p, max_tokens=ro.max_new_tokens),
            max_context_tokens=ro.max_context_tokens, budget=with_budget(env.budget, max_turns=ro.max_turns),
            seed=cfg.run.seed, device=cfg.run.device, partial_resume=str(ro.partial_resume),
            trust_remote_code=bool(cfg.run.trust_remote_code))
        self.eval_sampling = SamplingParams(temperature=cfg.eval.temperature, top_p=1.0,
                                            max_tokens=ro.max_new_tokens, seed=cfg.run.seed)

        self.step = 0
        self.version = 0
        self.resumed_from: Optional[Path] = latest
        self.restored_trajectories = 0
        self._tok: Any = None

        self._owns_ray = not ray.is_initialized()
        init_ray(cfg.ray, py_modules=self._env_modules)
        worker_env = None
        if self._env_modules and not self._owns_ray:
            # This process was connected to Ray before the trainer (a notebook, a test): the job's runtime
            # env is fixed, and Ray uploads local modules only at the job level, so the rollout actors find
            # the user's module through PYTHONPATH instead, which reaches workers on this machine only.
            paths = [str(p.parent) for p in self._env_modules] + [p for p in [os.environ.get("PYTHONPATH")] if p]
            worker_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}}
        self.learner = None
        self.logger: Optional[MetricsLogger] = None
        self.pool = RolloutPool(self.spec, ro.num_workers, ro.num_cpus, ro.num_gpus,
                                max_restarts=ro.max_restarts, runtime_env=worker_env,
                                log=lambda line: self.logger.print(line) if self.logger is not None else None,
                                partial_rounds=ro.partial_rounds)
        self.collector = Collector(self.pool, self.train_tasks, seed=cfg.run.seed, group_size=rl.group_size,
                                   tasks_per_step=rl.tasks_per_step, max_staleness=self.max_staleness,
                                   eval_sampling=self.eval_sampling)
        try:
            self._check_resources()
            learner_cfg = LearnerConfig.from_job(cfg, rl.model_path)
            self.learner = LearnerGroup(learner_cfg, num_ranks=rl.num_learners, num_cpus_per_rank=rl.learner_num_cpus,
                                        num_gpus_per_rank=rl.learner_num_gpus)
            if latest is not None:
                self._restore(latest)
            self.pool.start()
            if self.version > 0:
                self._push_weights(blocking=True)
            # Only now that the resume point has loaded is anything in the run directory written.
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
            resume_step = self.step if latest is not None else None
            self.logger = MetricsLogger(self.run_dir, rl.steps, resume_step=resume_step)
        except BaseException:
            self.close()
            raise
        for line in self._resume_notes:
            self.logger.print(line)
        if latest is not None:
            self.logger.print(f"resumed from {latest} at step {self.step} (policy version {self.version}, "
                              f"{self.restored_trajectories} collected trajectories waiting)")
        if self._dropped_line:
            self.logger.print(f"[yellow]{self._dropped_line}")
        if self.skipped_rows:
            shown = "; ".join(self.skipped_rows[:3]) + ("; …" if len(self.skipped_rows) > 3 else "")
            self.logger.print(f"[yellow]skipped {len(self.skipped_rows)} bad task row(s) (env.bad_task_rows=skip): {shown}")
        if self.cfg.eval.every > 0 and not self.eval_tasks:
            self.logger.print("[yellow]no held-out tasks left after removing training tasks: evaluation is off")

    def _check_resources(self) -> None:
        """The learner ranks and rollout workers all live at once: a cluster too small for them would
        leave an actor pending forever, so say which keys ask for what instead."""
        rl, have = self.rl, ray.cluster_resources()
        for kind, learner, rollout in (("CPU", rl.learner_num_cpus, self.cfg.rollout.num_cpus),
                                       ("GPU", rl.learner_num_gpus, self.cfg.rollout.num_gpus)):
            need = rl.num_learners * learner + self.cfg.rollout.num_workers * rollout
            if need > have.get(kind, 0.0) + 1e-9:
                key = "num_cpus" if kind == "CPU" else "num_gpus"
                raise ConfigError(
                    f"rl.num_learners × rl.learner_{key} + rollout.num_workers × rollout.{key} = "
                    f"{rl.num_learners} × {learner:g} + {self.cfg.rollout.num_workers} × {rollout:g} = {need:g} {kind}s, "
                    f"but the Ray cluster has {have.get(kind, 0.0):g} (ray.num_cpus / ray.address)")

    def _check_config(self) -> None:
        from omegaconf import OmegaConf

        rl = self.rl  # choices (rl.mode, rollout.engine, env.bad_task_rows, …) are enums checked by the loader
        if not rl.model_path:
            raise ConfigError("rl.model_path: set the initial policy's HF directory (`k3rl init`, `k3rl sft`, …)")
        model_dir = Path(rl.model_path)
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"rl.model_path: no Hugging Face model at {model_dir} (config.json missing)")
        if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ConfigError(f"rl.model_path: {model_dir} has no tokenizer (tokenizer.json / tokenizer_config.json); "
                              f"the rollout engines and the chat template need one (`k3rl init` writes both)")
        check_model_code(self.cfg, "rl.model_path", model_dir)
        if self.cfg.learner.ref_model_path:
            check_model_code(self.cfg, "learner.ref_model_path", self.cfg.learner.ref_model_path)
        positive = ("rl.steps", "rl.tasks_per_step", "rl.group_size", "rollout.num_workers", "rl.num_learners",
                    "rl.keep_checkpoints")
        for key in positive:
            if OmegaConf.select(self.cfg, key) < 1:
                raise ConfigError(f"{key}: must be ≥ 1, got {OmegaConf.select(self.cfg, key)}")
        non_negative = ("rl.max_staleness", "eval.every", "rl.save_every", "rollout.max_restarts",
                        "rollout.partial_rounds")
        for key in non_negative:
            if OmegaConf.select(self.cfg, key) < 0:
                raise ConfigError(f"{key}: must be ≥ 0, got {OmegaConf.select(self.cfg, key)}")
        from k3rl.envs.registry import UnknownEnvironment, resolve, user_module_path
        from k3rl.rl.train.learner import LearnerConfig

        try:
            learner_cfg = LearnerConfig.from_job(self.cfg, rl.model_path)
        except ValueError as e:
            raise ConfigError(f"learner.{e}") from None
        from k3rl.rl.algos import get_algo

        try:
            get_algo(self.cfg.algo.name, **learner_cfg.algo_args)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"algo.name / algo.args: {e}") from None

        try:
            check_partial_resume(str(self.cfg.rollout.partial_resume), str(self.cfg.rollout.engine),
                                 dict(self.cfg.rollout.engine_args), str(rl.model_path))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:
            check_engine_args(str(self.cfg.rollout.engine), dict(self.cfg.rollout.engine_args))
        except ValueError as e:
            raise ConfigError(f"rollout.engine_args: {e}") from None
        try:
            resolve(self.cfg.env.name)
            self._env_modules = [p for p in [user_module_path(self.cfg.env.name)] if p is not None]
        except UnknownEnvironment as e:
            raise ConfigError(f"env.name: {e}") from None
        if str(self.cfg.run.device).startswith("cuda") and (rl.learner_num_gpus <= 0 or self.cfg.rollout.num_gpus <= 0):
            raise ConfigError("run.device=cuda: set rl.learner_num_gpus and rollout.num_gpus (> 0; fractions share "
                              "a GPU) so that Ray gives the actors a GPU")
        from k3rl.rl.checkpoint import check_model_path

        # last of the checks (it reads every weight once): here, not as a traceback from a Ray actor
        check_model_path("rl.model_path", model_dir, trains=True)
        if self.cfg.learner.ref_model_path:
            check_model_path("learner.ref_model_path", self.cfg.learner.ref_model_path, trains=True)

    def _resume_point(self) -> Optional[Path]:
        from k3rl.rl import checkpoint as ckpt

        metrics = self.run_dir / METRICS_FILE
        saved = ckpt.list_checkpoints(self.checkpoints.root)
        has_run = metrics.exists() or bool(saved)
        if not self.rl.resume:
            if has_run:
                raise ConfigError(f"run directory {self.run_dir} already holds a run; set rl.resume=true to continue "
                                  f"it, or choose another run.name")
            return None
        skipped: list[str] = []

        def corrupt(path: Path, error: Exception) -> None:
            skipped.append(f"{path.name}: {error}")

        latest = ckpt.find_latest(self.checkpoints.root, on_corrupt=corrupt)
        self._resume_notes = [f"[yellow]skipped checkpoint {line}" for line in skipped]
        if latest is None and has_run:
            why = "; ".join(skipped) if skipped else "no checkpoint directory holds a COMPLETE manifest"
            raise ConfigError(f"rl.resume=true: {self.run_dir} holds a run but no checkpoint that loads ({why}); "
                              f"nothing was changed. Start a new run with another run.name")
        if latest is not None and skipped:
            self._resume_notes.append(f"[yellow]resuming from the newest checkpoint that verifies, {latest.name}: "
                                      f"the steps after it are trained again")
        return latest

    def _load_tasks(self, env: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        self._dropped_line: Optional[str] = None
        self.skipped_rows: list[str] = []
        en, ev = self.cfg.env, self.cfg.eval
        train = read_tasks(en.tasks_path, env, en.bad_task_rows, self.skipped_rows) if en.tasks_path else \
            make_tasks(env, en.num_tasks, self.cfg.run.seed, "env.num_tasks / env.args")
        if not train:
            raise ConfigError("no training tasks (env.tasks_path is empty, or env.num_tasks is 0)")
        held_out = []
        if ev.every > 0:
            held_out = read_tasks(ev.tasks_path, env, en.bad_task_rows, self.skipped_rows) if ev.tasks_path else (
                make_tasks(env, ev.num_tasks, ev.seed, "eval.num_tasks / env.args") if ev.num_tasks > 0 else [])
            held_out, self._dropped_line = remove_training_tasks(held_out, train)
        named = ([(_task_id(t, f"train-{i}"), t) for i, t in enumerate(train)],
                 [(_task_id(t, f"eval-{i}"), t) for i, t in enumerate(held_out)])
        for kind, tasks in zip(("training", "held-out"), named):
            repeated = [task_id for task_id, n in Counter(task_id for task_id, _ in tasks).items() if n > 1]
            if repeated:
                raise ConfigError(f"{kind} task ids must be unique; repeated: {', '.join(repeated[:5])}")
        return named

    @property
    def worker_actors(self) -> list:
        return self.pool.actors

    @property
    def buffer(self):
        """The collected groups waiting to be trained (rl/orchestrator/buffer.py, owned by the collector)."""
        return self.collector.buffer

    def _push_weights(self, blocking: bool) -> None:
        """The learner's weights (with its version) to every rollout worker; `blocking` waits for each."""
        self.pool.push_weights(self.learner.named_weights(), self.version, blocking)

    # ---- the loop

    def train(self) -> Path:
        """Run the remaining steps; write the plots; release the actors. Returns the run directory."""
        try:
            if self.step == 0 and self.resumed_from is None and self.cfg.eval.every > 0 and self.eval_tasks:
                self.logger.log(0, self._evaluate())
            while self.step < self.rl.steps:
                self._train_step()
            plot(self.run_dir)
        finally:
            self.close()
        return self.run_dir

    def _train_step(self) -> None:
        rl, collector = self.rl, self.collector
        start = time.perf_counter()
        collector.gen_tokens = 0
        collector.collect(self.version)
        waited = time.perf_counter() - start
        learner_version = self.version
        taken = collector.take(learner_version)
        if rl.mode == "async":
            collector.prefetch_while_training(learner_version)
        t0 = time.perf_counter()
        learner_metrics = self.learner.train_step(taken.trajectories)
        train_s = time.perf_counter() - t0
        self.version = int(learner_metrics["version"])
        self.step += 1
        t0 = time.perf_counter()
        if rl.mode == "async":
            collector.wait(timeout=0)
        self._push_weights(blocking=rl.mode == "sync")
        sync_s = time.perf_counter() - t0
        elapsed = time.perf_counter() - start
        scalars = self._step_metrics(taken, learner_version, learner_metrics)
        scalars.update({"perf/step_time_s": elapsed, "perf/rollout_wait_s": waited, "perf/train_s": train_s,
                        "perf/weight_sync_s": sync_s, "perf/gen_tokens_per_s": collector.gen_tokens / elapsed,
                        "perf/train_tokens_per_s": float(learner_metrics.get("train_tokens_per_s", 0.0))})
        last = self.step == rl.steps
        if self.eval_tasks and self.cfg.eval.every > 0 and (self.step % self.cfg.eval.every == 0 or last):
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
        return is_success(t, self.success_key)

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
            "workers/restarts": float(self.pool.restarts), "policy/version": float(self.version),
            "episode/stale_sampled_tokens": float(np.mean([t.metrics.get("stale_sampled_tokens", 0.0) for t in trajs])),
            "episode/stale_state_tokens": float(np.mean([t.metrics.get("stale_state_tokens", 0.0) for t in trajs])),
            "episode/pauses": float(np.mean([t.metrics.get("pauses", 0.0) for t in trajs])),
            "rollout/held_groups": float(len(self.pool.held_tasks())),
        }
        components = sorted({k for t in trajs for k, v in t.rewards.items() if isinstance(v, (int, float))})
        for key in components:  # whatever the environment reports (exact match, F1, evidence recall, …)
            out[f"rewards/{key}"] = float(np.mean([t.rewards[key] for t in trajs if key in t.rewards]))
        for key, value in learner_metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "version":
                out[f"train/{key}"] = float(value)
        return out

    def _evaluate(self) -> dict[str, float]:
        """Held-out tasks, one greedy (or `eval.temperature`) episode each, spread over the workers."""
        results = PoolRunner(self.collector, self.step).play(self.eval_tasks)
        write_eval_episodes(self.run_dir, self.step, results, self._tokenizer())
        return score(results, self.success_key).metrics("eval/")

    def _tokenizer(self) -> Any:
        """The policy's tokenizer (for the held-out transcripts), loaded on first use."""
        if self._tok is None:
            from k3rl.model.tokenizer import load_tokenizer

            self._tok = load_tokenizer(str(self.rl.model_path), trust_remote_code=bool(self.cfg.run.trust_remote_code))
        return self._tok

    # ---- checkpoints

    def save(self) -> Path:
        """Checkpoint the learner and the driver at the current step (collections in flight are awaited first)."""
        from k3rl.rl import checkpoint as ckpt

        self.collector.drain()
        with self.checkpoints.begin(self.step) as tmp:
            self.learner.save_into(tmp)
            ckpt.save_trainer_state(tmp, {"step": self.step, "version": self.version, **self.collector.state_dict()})
        return self.checkpoints.root / ckpt.step_dir_name(self.step)

    def _restore(self, path: Path) -> None:
        from k3rl.rl import checkpoint as ckpt

        version = self.learner.load(path)
        state = ckpt.load_trainer_state(path)
        if int(state["version"]) != version:
            raise ckpt.CorruptCheckpointError(f"{path}: the learner is at version {version}, the trainer state "
                                              f"says {state['version']}")
        self.step, self.version = int(state["step"]), version
        self.collector.load_state_dict(state)
        self.restored_trajectories = self.buffer.num_trajectories

    def close(self) -> None:
        """Kill the rollout actors and the learner group; shut Ray down if this trainer started it."""
        self.pool.close()
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
    from k3rl.rl.commands.cli import config_parser

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
