"""The learner: one data-parallel rank of training (`Learner`); `train_step(trajectories)` is one optimizer step of
the configured objective (rl/algos/) on this rank's share of the batch.

Advantages per group (rl/train/advantages.py `compute_advantages`); trajectories become sequences run as micro-batch units within
`micro_batch_tokens` (rl/train/batching.py, rl/train/units.py): shared prefixes computed once as prefix trees
(rl/train/prefix_tree.py), a unit longer
than `segment_tokens` run segment by segment (rl/train/segments.py). log π comes from the policy's final hidden states
through the chunked LM head (model/policy.py, model/logprobs.py), never full logits; π_old is the current weights
(`old_logprobs = logprobs.detach()`: the PPO ratio is 1 at the step), the behaviour policy enters through truncated IS,
and MoE models replay the recorded routing (`routing_replay`). Every loss divides by the global counts
(rl/algos/base.py); gradients are summed over ranks (rl/train/parallel.py, which also holds expert parallelism and
FSDP2); a non-finite loss or gradient on any rank skips the step on every rank; then clipping, the optimizer
(rl/train/optim.py) and router-bias balancing (rl/train/router_balance.py). Checkpoints: rl/train/learner_state.py;
N ranks as Ray actors: rl/train/group.py.

Shapes: B sequences of a micro-batch, T its padded length, N loss-mask tokens of the micro-batch, d hidden size.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from k3rl.model.policy import Policy, load_policy
from k3rl.rl import checkpoint as ckpt
from k3rl.rl.algos import get_algo
from k3rl.rl.algos.base import LossInputs
from k3rl.rl.config import LearnerSettings
from k3rl.rl.config.checks import check_learner_settings
from k3rl.rl.config.learner import LoraSettings
from k3rl.rl.train import learner_state, lora, parallel, router_balance, segments, units
from k3rl.rl.train.advantages import compute_advantages
from k3rl.rl.train.batching import TrainSequence, collate, to_train_sequence
from k3rl.rl.train.optim import build_optimizers, build_schedulers, state_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class LearnerConfig(LearnerSettings):
    """Everything one learner rank needs: the job's `learner:` section (rl/config/learner.py `LearnerSettings`:
    optimizer, dtype, micro-batching, …) plus what the driver decides (OmegaConf-compatible types)."""

    model_path: str = ""
    """Hugging Face directory of the initial policy (K3 or any HF causal LM)."""
    trust_remote_code: bool = False
    """Whether that directory's own Python code may run and be copied into checkpoints (`run.trust_remote_code`,
    model/formats/trust.py)."""
    algo: str = "grpo"
    """Name of an algorithm in `rl/algos/`."""
    algo_args: dict[str, Any] = field(default_factory=dict)
    """Settings of that algorithm (clip bounds, KL, TIS, …)."""
    device: str = "cpu"
    """`cpu`, `cuda` (the GPU Ray gives the actor), or `cuda:<i>`."""
    seed: int = 0
    rope_theta: Optional[float] = None
    """RoPE base of the model's MLA layers from now on (a staged pretraining stage, rl/pretrain/climb.py; saved with
    the model's config); null: the model's own. Only a K3 model with `mla_use_nope: false` takes one."""

    def __post_init__(self):
        if not isinstance(self.lora, LoraSettings):  # an override section's (OmegaConf or plain dict)
            from omegaconf import OmegaConf

            self.lora = LoraSettings(**(OmegaConf.to_container(self.lora) if OmegaConf.is_config(self.lora)
                                        else dict(self.lora)))
        check_learner_settings(self)

    @property
    def sharded(self) -> bool:
        """Expert parallelism or FSDP2 is asked for (it takes effect with more than one rank)."""
        return self.expert_parallel > 1 or bool(self.fsdp)

    def check_ranks(self, num_ranks: int, key: str = "learner.num_ranks") -> None:
        """Refuse a number of learner ranks that `expert_parallel` does not divide (`key` names where it is set)."""
        if num_ranks % self.expert_parallel:
            raise ValueError(f"expert_parallel: {self.expert_parallel} must divide the number of learner ranks "
                             f"({key} = {num_ranks})")

    @classmethod
    def from_job(cls, job: Any, model_path: str | Path, **overrides: Any) -> LearnerConfig:
        """From a `JobConfig`: every field of its `learner:` section, the objective of `algo:`, seed and device
        of `run:`; explicit overrides on top. Enum choices become their plain strings (what Ray ships)."""
        from omegaconf import OmegaConf

        section = job.learner if "learner" in job else LearnerSettings()
        values = {f.name: getattr(section, f.name) for f in dataclasses.fields(LearnerSettings)}
        values = {k: str(v) if isinstance(v, Enum) else v for k, v in values.items()}
        if values["total_steps"] is None and "rl" in job:
            values["total_steps"] = int(job.rl.steps)
        values.update(model_path=str(model_path), algo=job.algo.name, algo_args=OmegaConf.to_container(job.algo.args)
                      if OmegaConf.is_config(job.algo.args) else dict(job.algo.args), seed=job.run.seed,
                      device=job.run.device, trust_remote_code=bool(getattr(job.run, "trust_remote_code", False)))
        cfg = cls(**{**values, **overrides})
        if getattr(section, "num_ranks", None) is not None:
            cfg.check_ranks(int(section.num_ranks))
        return cfg


class Learner:
    """One data-parallel rank: policy, optimizer, `train_step`, weights for sync, checkpoints.

    Under torch.distributed (initialised by the caller, e.g. `LearnerGroup`, rl/train/group.py) every rank must call
    `train_step` together, each with its own share of the batch (possibly empty).
    """

    def __init__(self, cfg: LearnerConfig, group: Optional[torch.distributed.ProcessGroup] = None):
        self.cfg = cfg
        self.group = group
        self.rank = parallel.get_rank(group)
        self.world_size = parallel.get_world_size(group)
        self.device = torch.device(cfg.device)
        self.algo = get_algo(cfg.algo, **dict(cfg.algo_args))
        self.policy = load_policy(cfg.model_path, DTYPES[cfg.dtype], self.device,
                                  trust_remote_code=cfg.trust_remote_code)
        self.model = self.policy.model
        if cfg.rope_theta is not None:
            self.policy.set_rope_theta(cfg.rope_theta)
        self.policy.set_recompute(cfg.recompute)
        self.lora = None
        """The `PeftModel` when `learner.lora.rank > 0` (rl/train/lora.py): `self.model` then runs base + adapters and
        only the adapters train."""
        if cfg.lora.rank:
            self.lora = lora.apply_lora(self.policy, cfg.lora)
        self.model.train()
        self.policy.check_head()
        bad = self.policy.nonfinite_parameters()
        if bad:
            # every step would be skipped by the non-finite guard, forever: refuse instead
            raise ValueError(f"{cfg.model_path}: non-finite weights in {len(bad)} parameter tensor(s) "
                             f"({', '.join(bad[:3])}{', …' if len(bad) > 3 else ''}); the learner refuses to start")
        self._routers = router_balance.routers(self.model)
        self._replay = bool(cfg.routing_replay and self._routers and self.policy.routing_replay)
        self.ref_policy: Optional[Policy] = None
        if self.algo.needs_reference:
            self.ref_policy = load_policy(cfg.ref_model_path or cfg.model_path, DTYPES[cfg.dtype], self.device,
                                          trust_remote_code=cfg.trust_remote_code)
            self.ref_policy.model.eval().requires_grad_(False)
        self.mesh = parallel.learner_mesh(cfg, self.policy, group, self.device.type)
        """The ("dp", "ep") DeviceMesh of an expert-parallel / FSDP2 learner (rl/train/parallel.py), else None."""
        # after sharding: FSDP2 and expert parallelism replace the parameters with DTensors
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # foreach kernels cannot mix DTensors of different meshes (experts on "dp"/"ep", the rest on all ranks)
        self.optimizers = build_optimizers(self.model, self.params, cfg,
                                           foreach=False if self.mesh is not None else None)
        self.schedulers = build_schedulers(self.optimizers, cfg)
        self.version = 0
        self.tokenizer_path = Path(cfg.model_path)

    @property
    def routing_shape(self) -> Optional[tuple[int, int]]:
        """(L, k) of the model's routing, or None for dense models."""
        return (len(self._routers), self._routers[0].top_k) if self._routers else None

    @property
    def _media(self) -> Optional[tuple[int, int]]:
        """(placeholder token id, patch size) of a model that reads images, else None (rl/train/batching.py)."""
        config = self.model.config
        placeholder = getattr(config, "media_placeholder_token_id", None) if self.policy.is_k3 else None
        return None if placeholder is None else (int(placeholder), int(config.image_patch_size))

    @property
    def _replay_shape(self) -> Optional[tuple[int, int]]:
        return self.routing_shape if self._replay else None

    def _scorer(self, policy: Policy, targets: torch.Tensor, entropy: bool = False) -> segments.Scorer:
        """(normed hidden rows, their positions in `targets`) → (log π, entropy or None), chunked (model/logprobs.py)."""
        def score(hidden: torch.Tensor, order: torch.Tensor):
            result = policy.selected_logprobs(hidden, targets[order], self.cfg.logprob_chunk_size, entropy=entropy)
            return result if entropy else (result, None)
        return score

    def _segmented(self, unit: segments.Unit) -> bool:
        return self.policy.segments and segments.needs_segments(unit, self.cfg.segment_tokens)

    def logprobs(self, policy: Policy, unit: segments.Unit, entropy: bool = False
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """log π(target) [N] (and entropy [N]) on the loss-mask positions of a unit, as one autograd graph (or
        segment by segment without grad when the unit is longer than a segment and grad is off)."""
        mb, score = unit.mb, self._scorer(policy, unit.targets, entropy)
        if self._segmented(unit):
            if torch.is_grad_enabled():
                raise RuntimeError("a unit longer than learner.segment_tokens trains through segments.forward/backward")
            with router_balance.stats_paused(self._routers):
                fwd = segments.forward(policy.model, unit, self.cfg.segment_tokens, score, keep_states=False)
            logp, ent = fwd.logprobs, fwd.entropy
        elif unit.tree is not None:
            logp, ent = segments.graph_logprobs(policy, unit, score)
        else:
            hidden = policy.final_hidden(mb.input_ids, attention_mask=mb.valid.long(), routed_expert_ids=mb.routed,
                                         rows=mb.loss_mask, position_ids=mb.position_ids,
                                         images=mb.images())  # [N, d]
            logp, ent = score(hidden, torch.arange(hidden.shape[0], device=hidden.device))
        return unit.to_tokens(logp), None if ent is None else unit.to_tokens(ent)

    def _units(self, seqs: list[TrainSequence], share_prefix: bool) -> list[segments.Unit]:
        return units.make_units(seqs, self.cfg, self.policy, self.device, self._replay_shape, share_prefix)

    @torch.no_grad()
    def score(self, trajectories: Sequence[Any]) -> list[np.ndarray]:
        """log π(token) of each trajectory's loss-mask tokens (after the first) under the current
        weights, [n_i] float64 each, in trajectory order; routing replayed as in training, and not
        counted in the router-balancing statistics. Under a mesh every rank calls it together, each with its own
        share of the trajectories (possibly none): a rank with fewer micro-batches runs idle forwards."""
        # every trajectory's pieces (one, or its documents when packed and longer than a segment), in order
        pieces, owner = [], []
        for i, s in enumerate(to_train_sequence(t, 0.0, self._media) for t in trajectories):
            for piece in ([] if s is None else units.pieces(s, self.cfg.segment_tokens, self.policy.segments)):
                pieces.append(piece)
                owner.append(i)
        parts: list[list[np.ndarray]] = [[] for _ in pieces]
        with router_balance.stats_paused(self._routers):
            batches = units.pack(pieces, self.cfg.micro_batch_tokens, self.cfg.micro_batch_seqs)
            idle = parallel.idle_count(len(batches), self.mesh, self.device)
            for idx in batches:
                unit = segments.Unit(collate([pieces[j] for j in idx], self.device, self._replay_shape))
                logp, _ = self.logprobs(self.policy, unit)
                per_seq = torch.bincount(unit.mb.seq_ids, minlength=unit.mb.num_seqs).tolist()
                for j, part in zip(idx, logp.double().cpu().split(per_seq)):
                    parts[j] = part.numpy()
        for _ in range(idle):
            units.idle_pass(self.policy, self._routers, self.cfg.logprob_chunk_size, self.device, grad=False)
        out: list[list[np.ndarray]] = [[] for _ in trajectories]
        for i, part in zip(owner, parts):
            out[i].append(part)
        return [np.concatenate(p) if p else np.zeros(0) for p in out]

    def _micro_batch(self, unit: segments.Unit, n_tokens: float, n_seqs: float) -> tuple[torch.Tensor, dict]:
        """Forward, loss and backward of one unit (gradients accumulate). A unit longer than a segment runs the two
        passes of rl/train/segments.py: log π without grad, the loss on it as a leaf, then the segments' backward."""
        mb = unit.mb
        ref = None
        if self.ref_policy is not None:
            with torch.no_grad():  # the reference routes itself
                ref, _ = self.logprobs(self.ref_policy, unit.without_routing())
        fwd = None
        if self._segmented(unit):
            score = self._scorer(self.policy, unit.targets, self.cfg.compute_entropy)
            with router_balance.stats_paused(self._routers):  # counted once, in the backward's recomputation
                fwd = segments.forward(self.model, unit, self.cfg.segment_tokens, score)
            scored = fwd.logprobs.detach().requires_grad_()  # [M]: the pairs of a tree, else the tokens
            logp = unit.to_tokens(scored)
            entropy = None if fwd.entropy is None else unit.to_tokens(fwd.entropy)
        else:
            logp, entropy = self.logprobs(self.policy, unit, entropy=self.cfg.compute_entropy)
        inputs = LossInputs(logprobs=logp, old_logprobs=logp.detach(),
                            behaviour_logprobs=mb.behaviour.to(logp.dtype), advantages=mb.advantages.to(logp.dtype),
                            seq_ids=mb.seq_ids, num_seqs=mb.num_seqs, num_tokens_global=n_tokens,
                            num_seqs_global=n_seqs, ref_logprobs=ref)
        loss, metrics = self.algo.loss(inputs)
        loss.backward()
        if fwd is not None:
            segments.backward(self.model, unit, self.cfg.segment_tokens, fwd, scored.grad,
                              self._scorer(self.policy, unit.targets))
        if entropy is not None:
            metrics["entropy"] = entropy.detach().sum() / n_tokens
        return loss.detach(), metrics

    def train_step(self, trajectories: Sequence[Any], advantages: Optional[Sequence[float]] = None) -> dict[str, Any]:
        """One optimizer step on this rank's share of the batch; returns global metrics (same on every rank).

        `advantages` [B] (one per trajectory) are computed here when not given (`LearnerGroup`
        computes them on the driver so that a group may be split across ranks).

        Metrics: the algorithm's (`loss`, `clip_frac`, `tis_weight`, `tis_capped_frac`,
        `mismatch_kl`, `kl_ref`, …, each a global-batch mean), `entropy` when configured,
        `grad_norm` (before clipping), `grad_clipped`, `skipped` (0/1) with `skip_reason` (``,
        `nonfinite_loss`, `nonfinite_grad` or `empty_batch`), `version`, `lr`, the global counts
        `num_loss_tokens`, `num_seqs`, `num_tokens`, this rank's `micro_batches`, `step_time_s`,
        `train_tokens_per_s`, `peak_rss_gib` (the peak resident memory of rank 0's process so far), and for
        MoE models `maxvio/<MoE module>` and `maxvio_max`.
        """
        start = time.perf_counter()
        lr = self.optimizers[0].param_groups[0]["lr"]  # this step's (the schedule moves on after it)
        if advantages is None:
            advantages = compute_advantages(self.algo, trajectories)
        if len(advantages) != len(trajectories):
            raise ValueError(f"{len(advantages)} advantages for {len(trajectories)} trajectories")
        seqs = [s for s in (to_train_sequence(t, a, self._media) for t, a in zip(trajectories, advantages))
                if s is not None]
        counts = torch.tensor([sum(int(s.mask.sum()) for s in seqs), len(seqs), sum(len(s.inputs) for s in seqs)],
                              dtype=torch.float64, device=self.device)
        n_tokens, n_seqs, n_inputs = parallel.all_reduce(counts, "sum", self.group).tolist()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        router_balance.clear_stats(self.model)
        if n_seqs == 0:
            return self._finish(start, {}, skipped="empty_batch", n=(0, 0, 0), micro_batches=0, lr=lr)

        sums: dict[str, torch.Tensor] = {}
        bad_loss = False
        batches = self._units(seqs, self.cfg.share_prefix)
        idle = parallel.idle_count(len(batches), self.mesh, self.device)
        for unit in batches:
            loss, metrics = self._micro_batch(unit, n_tokens, n_seqs)
            bad_loss |= not bool(torch.isfinite(loss))
            for k, v in metrics.items():
                sums[k] = sums[k] + v.double() if k in sums else v.double()
        for _ in range(idle):
            units.idle_pass(self.policy, self._routers, self.cfg.logprob_chunk_size, self.device, grad=True)
        keys = parallel.union_keys(sums, self.group)
        totals = torch.stack([sums.get(k, torch.zeros((), dtype=torch.float64)).to(self.device) for k in keys]
                             ) if keys else torch.zeros(0, dtype=torch.float64, device=self.device)
        parallel.all_reduce(totals, "sum", self.group)
        grad_norm = parallel.reduce_grads(self.model, self.params, self.mesh, self.group, self.device)
        flags = torch.tensor([bad_loss, not bool(torch.isfinite(grad_norm))], dtype=torch.float64, device=self.device)
        parallel.all_reduce(flags, "max", self.group)
        metrics = {k: float(v) for k, v in zip(keys, totals.tolist())}
        metrics["grad_norm"] = float(grad_norm)
        skipped = "nonfinite_loss" if flags[0] else "nonfinite_grad" if flags[1] else ""
        if not skipped:
            if self.cfg.max_grad_norm > 0:
                parallel.clip_grads(self.params, self.cfg.max_grad_norm, grad_norm, self.mesh)
            metrics["grad_clipped"] = float(0 < self.cfg.max_grad_norm < metrics["grad_norm"])
            for opt in self.optimizers:
                opt.step()
            for sched in self.schedulers:
                sched.step()
            self.version += 1
            metrics.update(self._balance_routers())
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return self._finish(start, metrics, skipped, (n_tokens, n_seqs, n_inputs), len(batches), lr)

    def _balance_routers(self) -> dict[str, float]:
        if not self._routers:
            return {}
        maxvio = router_balance.balance_routers(self.model, group=self.group)
        out = {f"maxvio/{name}": v for name, v in maxvio.items()}
        if maxvio:
            out["maxvio_max"] = max(maxvio.values())
        return out

    def _finish(self, start: float, metrics: dict[str, Any], skipped: str, n: tuple, micro_batches: int,
                lr: float) -> dict:
        if skipped:
            router_balance.clear_stats(self.model)
        elapsed = time.perf_counter() - start
        metrics.update(skipped=float(bool(skipped)), skip_reason=skipped, version=self.version,
                       lr=lr, num_loss_tokens=n[0], num_seqs=n[1],
                       num_tokens=n[2], micro_batches=micro_batches, step_time_s=elapsed,
                       train_tokens_per_s=n[2] / elapsed if elapsed > 0 else 0.0,
                       peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                       trainable_params=float(sum(p.numel() for p in self.params)),
                       optimizer_state_mib=state_bytes(self.optimizers) / 2**20)
        return metrics

    def named_weights(self, copy: bool = True) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the state dict (buffers such as router biases and `lm_head.weight` included),
        as CPU copies under checkpoint names: what `Engine.load_weights` takes (with LoRA: base + adapters merged).
        `copy=False` returns CPU parameters themselves (detached) for a caller that copies them at once
        (rl/train/group.py packs them for a push). Under a mesh every rank calls it (the shards are gathered,
        rl/train/parallel.py `full_state_dict`) and only rank 0 gets the tensors (the others an empty list)."""
        if self.mesh is not None:
            return list(parallel.full_state_dict(self.model, self.mesh).items())
        state = self.model.state_dict() if self.lora is None else lora.merged_state_dict(self.model)
        return [(name, t.detach().to("cpu", copy=copy)) for name, t in state.items()]

    def push_weights(self, copy: bool = True) -> list[tuple[str, torch.Tensor]]:
        """What the rollout engines get after a step: `named_weights`, or with `learner.lora.push: adapters` the
        adapters' factors and the buffers alone (rl/train/lora.py `push_tensors`)."""
        if self.lora is not None and self.cfg.lora.push == "adapters":
            return [(name, t.detach().to("cpu", copy=copy)) for name, t in lora.push_tensors(self.model)]
        return self.named_weights(copy=copy)

    def save_into(self, directory: str | Path) -> None:
        """Write this rank's part of a checkpoint into `directory` (rank 0: model, tokenizer, optimizer; every rank:
        its RNG states; under a mesh every rank its shards): rl/train/learner_state.py. Not atomic by itself: see
        `save` and `CheckpointManager.begin`."""
        learner_state.save_into(self, directory)

    def save(self, path: str | Path) -> None:
        """An atomic single-rank checkpoint at `path` (replacing one that is there)."""
        if self.world_size > 1:
            raise RuntimeError("Learner.save is for one rank; use LearnerGroup.save or save_into on every rank")
        with ckpt.atomic_dir(path, version=self.version) as tmp:
            self.save_into(tmp)

    def load(self, path: str | Path) -> None:
        """Restore weights, optimizer states, `version` and this rank's RNG states from a complete checkpoint.
        Under a mesh every rank calls it; a checkpoint written under a mesh loads only into the same layout."""
        learner_state.load(self, path)

    def load_optimizer(self, path: str | Path) -> None:
        """Take the optimizer moments of another run's checkpoint (a staged pretraining hand-off) and keep this
        learner's own hyperparameters (learning rate, schedule from step `version`, weight decay, betas)."""
        learner_state.load_optimizer(self, path)


__all__ = ["DTYPES", "Learner", "LearnerConfig", "compute_advantages"]
