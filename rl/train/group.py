"""The learner group: `num_ranks` learner ranks (rl/train/learner.py `Learner`) as Ray actors, data-parallel over
torch.distributed — the public interface of rl/train/ that the orchestrator (rl/orchestrator/trainer.py) and the
commands drive. `LearnerGroup` has the same methods as `Learner`:

    group = LearnerGroup(LearnerConfig.from_job(job, model_dir), num_ranks=job.learner.num_ranks)
    metrics = group.train_step(batch)                         # one optimizer step, global metrics
    weights, version = group.weights_ref(), group.version     # → Engine.load_weights on every worker
    with CheckpointManager(run_dir / "checkpoints", keep=3).begin(step) as tmp:
        group.save_into(tmp)
        save_trainer_state(tmp, {"step": step, "cursor": ..., "unconsumed": trajectories})
    # resume: path = find_latest(run_dir / "checkpoints"); group.load(path); load_trainer_state(path)

One-process supervised training (SFT: rl/orchestrator/sft.py) drives a local `Learner` through the steps of
rl/train/supervised.py, exported here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from k3rl.rl import checkpoint as ckpt
from k3rl.rl.algos import get_algo
from k3rl.rl.train import parallel
from k3rl.rl.train.advantages import compute_advantages
from k3rl.rl.train.learner import Learner, LearnerConfig
from k3rl.rl.train.supervised import as_trajectory, num_steps, step_batches, train_supervised
from k3rl.rollout.weight_transfer import pack_weights


class LearnerWorker:
    """The Ray actor body of one `LearnerGroup` rank: joins the process group, then owns a `Learner`."""

    def __init__(self, num_threads: int = 1):
        torch.set_num_threads(max(1, num_threads))
        self.learner: Optional[Learner] = None
        self._pack_buffer = None
        self._broadcast = None  # rollout/weight_broadcast.py BroadcastGroup, rank 0 of it (rollout.weight_sync)
        self._packed = None

    def address(self) -> tuple[str, int]:
        return parallel.node_address(), parallel.free_port()

    def setup(self, cfg: LearnerConfig, rank: int, world_size: int, master_addr: str, master_port: int,
              backend: str) -> None:
        # this process is the rank's own: seed it (the Learner itself leaves a caller's RNG alone)
        torch.manual_seed(cfg.seed + rank)
        if cfg.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(cfg.device).index or 0)
        if world_size > 1:
            parallel.init_process_group(rank, world_size, master_addr, master_port, backend)
        self.learner = Learner(cfg)

    def train_step(self, trajectories: list, advantages: list[float]) -> dict[str, Any]:
        return self.learner.train_step(trajectories, advantages)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return self.learner.named_weights()

    def weights_ref(self) -> list:
        """The weights packed into one buffer (rollout/weight_transfer.py) and put into Ray's object store by this
        actor, as `[ObjectRef]` (a list, so Ray hands the caller the reference instead of resolving it): rollout
        workers map the buffer from the store without the driver fetching and re-putting the weights. Rank 0 gets
        `[ref]`, other ranks of a sharded group `[None]`."""
        import ray

        packed = self._pack()
        return [None if packed is None else ray.put(packed)]  # the store copies it: the buffer can be refilled

    def _pack(self):
        """The weights packed into this rank's reused buffer (rollout/weight_transfer.py); None on the ranks of a
        sharded group other than 0, which only take part in gathering them."""
        named = self.learner.push_weights(copy=False)
        if not named:
            return None
        packed = pack_weights(named, reuse=self._pack_buffer)
        self._pack_buffer = packed.buffer
        return packed

    def broadcast_address(self) -> str:
        """"host:port" for a weight-broadcast group's store on this rank's node (rl/orchestrator/weight_sync.py)."""
        return f"{parallel.node_address()}:{parallel.free_port()}"

    def broadcast_join(self, address: str, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        from k3rl.rollout.weight_broadcast import BroadcastGroup

        self._broadcast = None  # the previous group (its members changed)
        self._broadcast = BroadcastGroup(address, rank, world_size, backend, timeout_s)

    def broadcast_pack(self):
        """Pack the weights for the next `broadcast_send` and return their layout (rank 0; None on other ranks of a
        sharded group, which take part in gathering them)."""
        from k3rl.rollout.weight_broadcast import WeightLayout

        self._packed = self._pack()
        return None if self._packed is None else WeightLayout.of(self._packed)

    def broadcast_send(self) -> None:
        """Broadcast what `broadcast_pack` packed; returns when every worker of the group has received it."""
        packed, self._packed = self._packed, None
        if packed is None:
            raise RuntimeError("broadcast_send: nothing packed (call broadcast_pack first)")
        self._broadcast.send(packed)

    def save_into(self, directory: str) -> None:
        self.learner.save_into(directory)

    def load(self, path: str) -> int:
        self.learner.load(path)
        return self.learner.version

    def load_optimizer(self, path: str) -> None:
        self.learner.load_optimizer(path)

    def score(self, trajectories: list) -> list[np.ndarray]:
        return self.learner.score(trajectories)

    def version(self) -> int:
        return self.learner.version

    def shutdown(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class LearnerGroup:
    """`num_ranks` Learner ranks as Ray actors in one placement group, data-parallel over torch.distributed.

    Bundles are `{CPU: num_cpus_per_rank, GPU: num_gpus_per_rank}`; `strategy` STRICT_PACK keeps
    CPU ranks on one node, PACK/SPREAD let GPU ranks span nodes. Rank 0 picks the rendezvous
    address and a free port on its node. `train_step` computes advantages on the driver, splits
    the trajectories across ranks balanced by tokens (groups may be split: advantages are known)
    and returns rank 0's metrics, which are global. A sharded group (`expert_parallel`/`fsdp`) calls every rank
    for `named_weights` and `score` (split like `train_step`), since both are collective there. Checkpoint paths must be visible to the
    driver and every rank (one node, or a shared filesystem).
    """

    def __init__(self, cfg: LearnerConfig, num_ranks: int = 1, num_cpus_per_rank: float = 1.0,
                 num_gpus_per_rank: float = 0.0, strategy: str = "STRICT_PACK", backend: Optional[str] = None):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.cfg, self.num_ranks = cfg, num_ranks
        cfg.check_ranks(num_ranks)
        self.algo = get_algo(cfg.algo, **dict(cfg.algo_args))
        bundle = {"CPU": num_cpus_per_rank, **({"GPU": num_gpus_per_rank} if num_gpus_per_rank else {})}
        self.placement_group = placement_group([dict(bundle) for _ in range(num_ranks)], strategy=strategy)
        ray.get(self.placement_group.ready())
        actor = ray.remote(LearnerWorker)
        self.actors = [
            actor.options(num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, i)
                          ).remote(max(1, int(num_cpus_per_rank)))
            for i in range(num_ranks)]
        addr, port = ray.get(self.actors[0].address.remote())
        backend = backend or parallel.default_backend(cfg.device)
        self.sharded = cfg.sharded and num_ranks > 1
        """Expert-parallel / FSDP2 ranks: weights and scoring are collective, every rank takes part."""
        ray.get([a.setup.remote(cfg, r, num_ranks, addr, port, backend) for r, a in enumerate(self.actors)])

    def train_step(self, trajectories: Sequence[Any]) -> dict[str, Any]:
        import ray

        advantages = compute_advantages(self.algo, trajectories)
        parts = parallel.split_balanced([len(t.tokens) for t in trajectories], self.num_ranks)
        results = ray.get([a.train_step.remote([trajectories[i] for i in part], [float(advantages[i]) for i in part])
                           for a, part in zip(self.actors, parts)])
        return {**results[0], "num_ranks": self.num_ranks}

    def named_weights(self, rank: int = 0) -> list[tuple[str, torch.Tensor]]:
        """The weights of rank `rank` (the same on every rank); a sharded group gathers them with every rank and
        returns rank 0's whole state dict (internal names, stacked experts)."""
        import ray

        if self.sharded:
            return ray.get([a.named_weights.remote() for a in self.actors])[0]
        return ray.get(self.actors[rank].named_weights.remote())

    def weights_ref(self):
        """`named_weights` as a Ray object put by the learner actor itself: an ObjectRef the rollout pool hands to
        every worker (rl/orchestrator/rollout_pool.py `push_weights`), so the weights never pass through the driver."""
        import ray

        actors = self.actors if self.sharded else self.actors[:1]
        return ray.get([a.weights_ref.remote() for a in actors])[0][0]

    @property
    def version(self) -> int:
        import ray

        return ray.get(self.actors[0].version.remote())

    def save_into(self, directory: str | Path) -> None:
        import ray

        ray.get([a.save_into.remote(str(directory)) for a in self.actors])

    def save(self, path: str | Path) -> None:
        """An atomic learner checkpoint at `path` (the trainer uses save_into inside CheckpointManager.begin)."""
        with ckpt.atomic_dir(path) as tmp:
            self.save_into(tmp)

    def load(self, path: str | Path) -> int:
        """Every rank loads the checkpoint; returns the restored version."""
        import ray

        versions = ray.get([a.load.remote(str(path)) for a in self.actors])
        return versions[0]

    def load_optimizer(self, path: str | Path) -> None:
        """Every rank takes the optimizer moments of `path` (`Learner.load_optimizer`)."""
        import ray

        ray.get([a.load_optimizer.remote(str(path)) for a in self.actors])

    def score(self, trajectories: Sequence[Any]) -> list[np.ndarray]:
        """`Learner.score` on rank 0 (the weights are the same on every rank); a sharded group splits the
        trajectories across its ranks as `train_step` does and returns the results in the given order."""
        import ray

        trajectories = list(trajectories)
        if not self.sharded:
            return ray.get(self.actors[0].score.remote(trajectories))
        parts = parallel.split_balanced([len(t.tokens) for t in trajectories], self.num_ranks)
        results = ray.get([a.score.remote([trajectories[i] for i in part]) for a, part in zip(self.actors, parts)])
        out: list[np.ndarray] = [np.zeros(0)] * len(trajectories)
        for part, scored in zip(parts, results):
            for i, logp in zip(part, scored):
                out[i] = logp
        return out

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        ray.get([a.shutdown.remote() for a in self.actors])
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.placement_group)


__all__ = ["Learner", "LearnerConfig", "LearnerGroup", "LearnerWorker", "as_trajectory", "num_steps", "step_batches",
           "train_supervised"]
