"""`RolloutWorker`: a Ray actor that owns one engine and a pool of environments.

The trainer starts several side by side (rl/orchestrator/rollout_pool.py), sends each a share of the tasks
(`collect`), and pushes new weights to all of them after every learner step (`load_weights`,
with the policy version). A worker is plain Python: the same class runs in-process in tests
and as an actor on a cluster. The engine kind comes from the config (`torch` or `vllm`).

Partial rollouts (`collect_partial`, `rollout.partial_rounds`): each call runs its new tasks and
every episode paused by earlier calls for a few rounds, returns the groups whose every episode
has ended, and keeps the rest in memory — paused episodes and the ended trajectories of their
groups — for its next call, which samples with the weights loaded in between. If the actor dies,
what it held dies with it; the driver collects those tasks again. With `partial_resume=keep_state`
the native engine keeps the paused episodes' decode states across `load_weights` and continues them
under the new weights (rollout/torch_engine.py `resume_stale`); with `reprefill` it drops them and
prefills each paused context again.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from k3rl.rollout.engine import SamplingParams


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its engine and environments."""

    model_dir: str
    env: str
    """Registered environment name."""
    engine: str = "torch"
    """`torch` or `vllm`."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_context_tokens: int = 4096
    budget: Any = None
    """An envs.Budget overriding the environment's default, or None."""
    seed: int = 0
    device: str = "cpu"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    partial_resume: str = "reprefill"
    """How a paused episode continues under new weights (rl/config/sections.py `rollout.partial_resume`)."""
    trust_remote_code: bool = False
    """Whether the model directory's own Python code may run (`run.trust_remote_code`, model/formats/trust.py)."""
    compaction: Any = None
    """A `rollout.agent_loop.Compaction` (context compaction in k3rl's own agent loop), or None: off."""
    adapter_rank: int = 0
    """The rank of the LoRA adapters the learner pushes (`learner.lora.push: adapters`), 0 when it pushes weights:
    the vLLM engine is then built to serve them as LoRA adapters (rollout/vllm_engine.py)."""


@dataclass
class PartialCollection:
    """What one `collect_partial` call hands back."""

    trajectories: list
    """Every trajectory of the groups that ended in this call (whole groups, samples in order)."""
    paused: list[str]
    """Group ids still held by the worker (at least one episode paused), for its next call."""


# What each engine sets itself from the job (the model directory, context length, seed, device, whether the
# directory's own code may run, from `run.trust_remote_code`, and for the native engine whether a stale session
# state continues, from `rollout.partial_resume`).
_SET_BY_JOB = {"model", "model_dir", "tokenizer", "max_model_len", "seed", "device", "resume_stale",
               "trust_remote_code", "lora_rank"}


def check_partial_resume(partial_resume: str, engine: str, engine_args: dict[str, Any], model_dir: str) -> None:
    """Raise ValueError unless `partial_resume` can run on this engine and model: `keep_state` needs an engine
    that keeps each episode's decode state across a weight update — the native one, on a K3 model, with
    `reuse_state` on. vLLM's prefix cache is its own and cannot outlive a weight update here."""
    if partial_resume not in ("reprefill", "keep_state"):
        raise ValueError(f"rollout.partial_resume: {partial_resume!r}; choose reprefill or keep_state")
    if partial_resume == "reprefill":
        return
    if engine != "torch":
        raise ValueError(f"rollout.partial_resume=keep_state: engine {engine!r} keeps no episode state across a "
                         f"weight update (use rollout.engine=torch, whose sessions do, or partial_resume=reprefill)")
    if engine_args.get("reuse_state") is False:
        raise ValueError("rollout.partial_resume=keep_state continues the native engine's session states, which "
                         "rollout.engine_args.reuse_state=false turns off")
    from k3rl.model.formats.config_json import model_type_of
    from k3rl.model.formats.layouts import MODEL_TYPES

    model_type = model_type_of(model_dir)
    if model_type not in MODEL_TYPES:  # any K3 layout (model/formats/layouts.py)
        raise ValueError(f"rollout.partial_resume=keep_state: the native engine keeps session states of K3 models "
                         f"only; {model_dir} is {model_type!r} (use partial_resume=reprefill)")


def engine_settings(engine: str) -> list[str]:
    """The keys `rollout.engine_args` may hold for `engine`: the engine constructor's own keyword settings
    (`torch`: rollout/torch_engine.py `TorchEngine`; `vllm`: `vllm.EngineArgs`, passed on to `vllm.LLM`),
    without those the job sets."""
    import inspect

    if engine == "torch":
        from k3rl.rollout.torch_engine import TorchEngine

        params = inspect.signature(TorchEngine.__init__).parameters
        return sorted(n for n in params if n != "self" and n not in _SET_BY_JOB)
    if engine == "vllm":
        import dataclasses

        from vllm import EngineArgs

        return sorted({f.name for f in dataclasses.fields(EngineArgs)} - _SET_BY_JOB)
    raise ValueError(f"unknown rollout engine {engine!r}; choose 'torch' or 'vllm'")


def check_engine_args(engine: str, args: dict[str, Any]) -> None:
    """Raise ValueError naming any key of `args` that `engine` does not take (and the keys it does)."""
    valid = engine_settings(engine)
    unknown = sorted(set(args) - set(valid))
    if unknown:
        shown = ", ".join(valid) if len(valid) <= 30 else ", ".join(valid[:30]) + ", …"
        raise ValueError(f"engine {engine!r} does not take {', '.join(unknown)}; it takes: {shown}")


def build_engine(spec: WorkerSpec):
    """The engine named by `spec.engine`, loaded from `spec.model_dir` (its own code only with
    `spec.trust_remote_code`)."""
    if spec.engine == "torch":
        from k3rl.rollout.torch_engine import TorchEngine

        return TorchEngine.from_pretrained(spec.model_dir, device=spec.device, seed=spec.seed,
                                           resume_stale=spec.partial_resume == "keep_state",
                                           trust_remote_code=spec.trust_remote_code, **spec.engine_kwargs)
    if spec.engine == "vllm":
        from k3rl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(spec.model_dir, max_model_len=spec.max_context_tokens, seed=spec.seed,
                          trust_remote_code=spec.trust_remote_code, lora_rank=spec.adapter_rank, **spec.engine_kwargs)
    raise ValueError(f"unknown rollout engine {spec.engine!r}; choose 'torch' or 'vllm'")


class RolloutWorker:
    """Collects trajectories for tasks; see module docstring."""

    def __init__(self, spec: WorkerSpec):
        import k3rl.envs as envs
        from k3rl.envs.agent import builds_agent
        from k3rl.envs.registry import resolve
        from k3rl.rollout.agent_loop import AgentLoop

        check_partial_resume(spec.partial_resume, spec.engine, spec.engine_kwargs, spec.model_dir)
        self.spec = spec
        self.engine = build_engine(spec)
        self.keep_state = spec.partial_resume == "keep_state"
        if self.keep_state and not self.engine.keeps_state:
            raise ValueError("rollout.partial_resume=keep_state: this engine keeps no session states")
        tokenizer = self.engine.tokenizer  # environments that count tokens count the policy's
        if builds_agent(resolve(spec.env).target):  # an agent of the user's own, through this worker's endpoint
            from k3rl.rollout.agent_runner import AgentRunner

            self.loop = AgentRunner(self.engine, tokenizer, envs.make(spec.env, **spec.env_kwargs), spec.sampling,
                                    max_context_tokens=spec.max_context_tokens, env_name=spec.env)
        else:
            self.loop = AgentLoop(self.engine, tokenizer,
                                  lambda: envs.make(spec.env, tokenizer=tokenizer, **spec.env_kwargs), spec.sampling,
                                  budget=spec.budget, max_context_tokens=spec.max_context_tokens, env_name=spec.env,
                                  compaction=spec.compaction)
        self.started = time.time()
        self.episodes = 0
        self._broadcast = None  # rollout/weight_broadcast.py BroadcastGroup once `broadcast_join` ran
        self._held: dict[str, dict[int, Any]] = {}
        """Group id → sample index → its `PausedEpisode` or, once ended, its `Trajectory` (partial rollouts)."""

    def collect(self, tasks: list[tuple[str, Any]], n_per_task: int, group_prefix: str = "",
                sampling: SamplingParams | None = None) -> list:
        """Run `n_per_task` episodes of each (task_id, task); trajectories of a task share a group id.
        `sampling` overrides the worker's sampling for this call (e.g. greedy evaluation)."""
        from k3rl.rollout.agent_loop import EpisodeRequest, episode_trajectories

        requests = [EpisodeRequest(task, task_id, f"{group_prefix}{task_id}", j)
                    for task_id, task in tasks for j in range(n_per_task)]
        default = self.loop.params
        self.loop.params = sampling or default
        try:
            trajectories = [t for item in self.loop.run(requests) for t in episode_trajectories(item)]
        finally:
            self.loop.params = default
        self.episodes += len(trajectories)
        return trajectories

    def collect_partial(self, tasks: list[tuple[str, Any]], n_per_task: int, group_prefix: str = "",
                        max_rounds: int = 1) -> PartialCollection:
        """Start `tasks` (as `collect`) and continue every episode paused by earlier calls, for at most
        `max_rounds` turns each; hand back the groups that ended and keep the others (see module docstring)."""
        from k3rl.rollout.agent_loop import AgentLoop, EpisodeRequest, PausedEpisode, episode_trajectories

        if not isinstance(self.loop, AgentLoop):
            raise ValueError("partial rollouts (rollout.partial_rounds > 0) pause k3rl's own agent loop between "
                             "turns; an agent function's episodes run whole (set rollout.partial_rounds=0)")

        requests = [EpisodeRequest(task, task_id, f"{group_prefix}{task_id}", j)
                    for task_id, task in tasks for j in range(n_per_task)]
        again = sorted({r.group_id for r in requests} & set(self._held))
        if again:
            raise ValueError(f"collect_partial: group(s) {again[:3]} are already held by this worker")
        resume = [m for members in self._held.values() for m in members.values() if isinstance(m, PausedEpisode)]
        results = self.loop.run(requests, max_rounds=max_rounds, resume=resume)
        for request, result in zip([p.request for p in resume] + requests, results):
            self._held.setdefault(request.group_id, {})[request.sample_idx] = result
        ended = [g for g, members in self._held.items()
                 if not any(isinstance(m, PausedEpisode) for m in members.values())]
        trajectories = [t for g in ended for _, item in sorted(self._held.pop(g).items(), key=lambda m: m[0])
                        for t in episode_trajectories(item)]
        self.episodes += len(trajectories)
        return PartialCollection(trajectories, list(self._held))

    def node_id(self) -> str:
        """The Ray node this worker runs on (None outside Ray)."""
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def broadcast_join(self, address: str, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Join a weight-broadcast group as `rank` (rl/orchestrator/weight_sync.py), leaving the previous one."""
        from k3rl.rollout.weight_broadcast import BroadcastGroup

        self._broadcast = None
        self._broadcast = BroadcastGroup(address, rank, world_size, backend, timeout_s)

    def load_broadcast(self, layout: Any, version: int) -> int:
        """Receive the weights of `layout` from the group's broadcast and load them as `version`."""
        if self._broadcast is None:
            raise RuntimeError("load_broadcast: this worker has joined no weight-broadcast group")
        return self.load_weights(self._broadcast.receive(layout), version)

    def load_weights(self, named_tensors: Iterable, version: int) -> int:
        """Load `version`; with keep_state the engine keeps the paused episodes' states (ended episodes have
        dropped theirs) for their next turns to continue."""
        if self.keep_state:
            self.engine.load_weights(named_tensors, version, keep_sessions=True)
        else:
            self.engine.load_weights(named_tensors, version)
        return self.engine.version

    def health(self) -> dict[str, Any]:
        return {"ok": True, "pid": os.getpid(), "host": socket.gethostname(), "engine": self.spec.engine,
                "version": self.engine.version, "episodes": self.episodes,
                "uptime_s": round(time.time() - self.started, 1),
                "generated_tokens": self.loop.stats.generated_tokens, "paused_groups": len(self._held)}

    def stats(self) -> dict[str, float]:
        s = self.loop.stats
        return {"generated_tokens": s.generated_tokens, "generate_seconds": s.generate_seconds,
                "env_seconds": s.env_seconds, "rounds": s.rounds}


