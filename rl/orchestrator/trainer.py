"""The RL trainer loop (what `k3rl train`, rl/commands/train.py, runs): rollout workers → buffer → learner → weights back.

`Trainer(cfg)` runs on the Ray driver. It starts (or joins, `ray.address=auto`) a Ray cluster,
creates `rollout.num_workers` rollout actors (engine `rollout.engine`) and a `LearnerGroup` of
`learner.num_ranks` ranks, and runs `rl.steps` steps. It never looks inside an algorithm: the
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
   tasks, at `eval.temperature`, and report the success rate with a 95% Wilson interval; run `k3rl eval`'s
   retrieval grid on the policy every `eval.grid_every` steps (rl/orchestrator/eval_grid.py: `eval_grid/*`);
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
the run stops (`WeightSyncError`, rl/orchestrator/rollout_pool.py) rather than train on tokens from unknown weights.

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

Checkpoints (`rl/checkpoint.py`, one atomic `checkpoints/step-XXXXXX` directory; rl/orchestrator/checkpointing.py
says what the driver adds and where a run resumes from): the learner
(HF model, optimizer, RNG per rank) and the driver's state: step, RNG states, task cursor,
collection counter, tasks waiting to be collected again, and every collected trajectory not yet
trained on. Before a checkpoint, in-flight collections are awaited and buffered (in async mode a
short pause of the rollouts at each checkpoint), so the checkpoint holds everything collected
from tasks dispatched before it. `rl.resume=true` continues from the newest complete checkpoint:
the learner and driver states are restored, weights are pushed, metrics.jsonl is cut back to the
checkpoint's step and appended to. A fresh run refuses a run directory that already holds one.

Metrics of a step (metrics.jsonl; TensorBoard gets the numbers; rl/orchestrator/step_metrics.py): `reward/*`, `success/rate`
(the environment's success rule, rl/eval/evaluate.py), `rewards/<component>` (the batch mean of every numeric
reward component the environment reports: exact match, F1, evidence recall, …),
`episode/*` (tokens, sampled tokens, turns, tool calls, truncated fraction), `groups/*`,
`staleness/mean|max`, `buffer/*`, `workers/restarts`, `policy/version`, `train/*` (everything
the learner reports: loss, `mismatch_kl`, `kl_ref`, clip fractions, grad norm, `maxvio/<layer>`
of MoE models, …), `perf/*` (step time, time waiting for rollouts, training and weight-sync
time; `gen_tokens_per_s` = tokens sampled by the collections that arrived during the step ÷ the
step's wall time, `train_tokens_per_s` from the learner), `eval/*` on evaluation steps, and
`batch` / `dropped`: [group_id, trajectories, oldest policy version] of every group trained or
dropped. `eval/*` comes from `score` (rl/eval/evaluate.py): success rate with its Wilson interval, and every
numeric reward component the environment reports with `_ci_low/_ci_high`. Callbacks `fn(trainer, StepResult)` run
after each step is logged and saved. Every
held-out evaluation also writes its episodes as text to `eval/step_NNNN.jsonl` (`rl/eval/transcripts.py`).

`rl.model_path` is the initial policy (an HF directory: `k3rl init`, an SFT output, or any HF
causal LM). Training tasks are `env.tasks(env.num_tasks, seed=run.seed)` or the JSONL file
`env.tasks_path`; held-out tasks are `env.tasks(eval.num_tasks, seed=eval.seed)` or
`eval.tasks_path`, minus any task that is also a training task (rl/orchestrator/tasks.py `job_tasks`).
A job that cannot run is a ConfigError before Ray starts (rl/orchestrator/preflight.py).
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import ray
from ray.exceptions import RayActorError

from k3rl.rl import checkpoint as ckpt
from k3rl.rl.config import ConfigError, to_yaml
from k3rl.rl.eval.evaluate import score, success_rule
from k3rl.rl.eval.transcripts import write_eval_episodes
from k3rl.rl.log_sinks import open_sinks
from k3rl.rl.metrics import MetricsLogger, plot
from k3rl.rl.orchestrator import checkpointing
from k3rl.rl.orchestrator.buffer import Taken
from k3rl.rl.orchestrator.cluster import init_ray
from k3rl.rl.orchestrator.collector import Collector
from k3rl.rl.orchestrator.eval_grid import EvalGrid
from k3rl.rl.orchestrator.pool_runner import PoolRunner
from k3rl.rl.orchestrator.preflight import check_job, check_resources
from k3rl.rl.orchestrator.rollout_pool import RolloutPool
from k3rl.rl.orchestrator.step_metrics import step_metrics
from k3rl.rl.orchestrator.tasks import job_tasks
from k3rl.rl.orchestrator.weight_sync import BroadcastSync
from k3rl.rollout.agent_loop import Compaction
from k3rl.rollout.worker import WorkerSpec


@dataclass
class StepResult:
    """What a step trained on, given to callbacks after it is logged."""

    step: int
    learner_version: int
    """The learner's version when it trained this batch (staleness is measured against it)."""
    taken: Taken
    metrics: dict[str, float]


class Trainer:
    """The driver; see module docstring. `train()` runs to `rl.steps` and returns the run directory."""

    def __init__(self, cfg: Any, callbacks: Sequence[Callable[[Trainer, StepResult], None]] = ()):
        from omegaconf import OmegaConf

        import k3rl.envs as envs
        from k3rl.envs.base import with_budget
        from k3rl.rl.train.group import LearnerConfig, LearnerGroup
        from k3rl.rollout.engine import SamplingParams

        self.cfg, self.rl = cfg, cfg.rl
        self.callbacks = list(callbacks)
        rl = self.rl
        self._env_modules = check_job(cfg)
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.checkpoints = ckpt.CheckpointManager(self.run_dir / "checkpoints", keep=rl.keep_checkpoints)
        latest, resume_notes = checkpointing.resume_point(self.run_dir, self.checkpoints.root, rl.resume)
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
        tasks = job_tasks(cfg, env)
        self.train_tasks, self.eval_tasks = tasks.train, tasks.held_out
        # `k3rl eval`'s grid every eval.grid_every steps (None: off); held-out and grid tasks checked disjoint
        self.grid, task_notes = EvalGrid.for_job(cfg, self.run_dir, tasks)
        self.max_staleness = rl.max_staleness if rl.mode == "async" else 0
        self.spec = WorkerSpec(
            model_dir=str(rl.model_path), env=en.name, engine=str(ro.engine), env_kwargs=self.env_args,
            engine_kwargs=OmegaConf.to_container(ro.engine_args, resolve=True),
            sampling=SamplingParams(temperature=ro.temperature, top_p=ro.top_p, max_tokens=ro.max_new_tokens),
            max_context_tokens=ro.max_context_tokens, budget=with_budget(env.budget, max_turns=ro.max_turns),
            seed=cfg.run.seed, device=cfg.run.device, partial_resume=str(ro.partial_resume),
            trust_remote_code=bool(cfg.run.trust_remote_code),
            adapter_rank=int(cfg.learner.lora.rank) if cfg.learner.lora.push == "adapters" else 0,
            compaction=Compaction(ro.compaction_tokens, ro.compaction_prompt, ro.summary_tokens, ro.max_compactions)
            if ro.compaction_tokens > 0 else None)
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
            check_resources(cfg, ray.cluster_resources())
            learner_cfg = LearnerConfig.from_job(cfg, rl.model_path)
            ln = cfg.learner
            self.learner = LearnerGroup(learner_cfg, num_ranks=ln.num_ranks, num_cpus_per_rank=ln.num_cpus,
                                        num_gpus_per_rank=ln.num_gpus)
            if latest is not None:
                self.step, self.version = checkpointing.restore(latest, self.learner, self.collector)
                if self.grid is not None:
                    self.grid.forget_after(self.step)
                self.restored_trajectories = self.buffer.num_trajectories
            if ro.weight_sync == "broadcast":
                gpus = cfg.run.device.startswith("cuda") and ro.num_gpus > 0 and ln.num_gpus > 0
                self.pool.sync = BroadcastSync(self.learner.actors, self.learner.sharded, "nccl" if gpus else "gloo")
            self.pool.start()
            if self.version > 0:
                self._push_weights(blocking=True)
            # Only now that the resume point has loaded is anything in the run directory written.
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
            resume_step = self.step if latest is not None else None
            self.logger = MetricsLogger(self.run_dir, rl.steps, resume_step=resume_step,
                                        sinks=open_sinks(cfg, self.run_dir, resume_step))
        except BaseException:
            self.close()
            raise
        self._print_notes(resume_notes + task_notes, tasks)

    def _print_notes(self, resume_notes: list[str], tasks: Any) -> None:
        """What the run starts from: skipped checkpoints, the resume point, held-out tasks dropped, bad task rows."""
        for line in resume_notes:
            self.logger.print(line)
        if self.resumed_from is not None:
            self.logger.print(f"resumed from {self.resumed_from} at step {self.step} (policy version {self.version}, "
                              f"{self.restored_trajectories} collected trajectories waiting)")
        if tasks.dropped_line:
            self.logger.print(f"[yellow]{tasks.dropped_line}")
        if tasks.skipped_rows:
            shown = "; ".join(tasks.skipped_rows[:3]) + ("; …" if len(tasks.skipped_rows) > 3 else "")
            self.logger.print(f"[yellow]skipped {len(tasks.skipped_rows)} bad task row(s) (env.bad_task_rows=skip): {shown}")
        if self.cfg.eval.every > 0 and not self.eval_tasks:
            self.logger.print("[yellow]no held-out tasks left after removing training tasks: evaluation is off")

    @property
    def worker_actors(self) -> list:
        return self.pool.actors

    @property
    def buffer(self):
        """The collected groups waiting to be trained (rl/orchestrator/buffer.py, owned by the collector)."""
        return self.collector.buffer

    def _push_weights(self, blocking: bool) -> None:
        """The learner's weights (with its version) to every rollout worker; `blocking` waits for each."""
        self.pool.push_weights(None if self.pool.sync else self.learner.weights_ref(), self.version, blocking)

    def train(self) -> Path:
        """Run the remaining steps; write the plots; release the actors. Returns the run directory."""
        try:
            if self.step == 0 and self.resumed_from is None:
                first = self._evaluate() if self.cfg.eval.every > 0 and self.eval_tasks else {}
                first.update(self._eval_grid())
                if first:
                    self.logger.log(0, first)
            while self.step < self.rl.steps:
                self._train_step()
            self.logger.images(plot(self.run_dir))
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
        scalars = step_metrics(taken, learner_version, self.version, learner_metrics, self.buffer, self.pool,
                               self.success_key)
        scalars.update({"perf/step_time_s": elapsed, "perf/rollout_wait_s": waited, "perf/train_s": train_s,
                        "perf/weight_sync_s": sync_s, "perf/gen_tokens_per_s": collector.gen_tokens / elapsed,
                        "perf/train_tokens_per_s": float(learner_metrics.get("train_tokens_per_s", 0.0))})
        last = self.step == rl.steps
        if self.eval_tasks and self.cfg.eval.every > 0 and (self.step % self.cfg.eval.every == 0 or last):
            scalars.update(self._evaluate())
        scalars.update(self._eval_grid())
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

    def _evaluate(self) -> dict[str, float]:
        """Held-out tasks, one greedy (or `eval.temperature`) episode each, spread over the workers."""
        results = PoolRunner(self.collector, self.step).play(self.eval_tasks)
        write_eval_episodes(self.run_dir, self.step, results, self._tokenizer())
        return score(results, self.success_key).metrics("eval/")

    def _eval_grid(self) -> dict[str, float]:
        """`k3rl eval`'s grid on the policy when `eval.grid_every` says so (rl/orchestrator/eval_grid.py)."""
        if self.grid is None or not self.grid.due(self.step, self.step == self.rl.steps):
            return {}
        return self.grid.run(self.step, self.learner, self.logger)

    def _tokenizer(self) -> Any:
        """The policy's tokenizer (for the held-out transcripts), loaded on first use."""
        if self._tok is None:
            from k3rl.model.tokenizer import load_tokenizer

            self._tok = load_tokenizer(str(self.rl.model_path), trust_remote_code=bool(self.cfg.run.trust_remote_code))
        return self._tok

    def save(self) -> Path:
        """Checkpoint the learner and the driver at the current step (collections in flight are awaited first)."""
        return checkpointing.save(self.checkpoints, self.step, self.version, self.learner, self.collector)

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
