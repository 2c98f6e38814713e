"""The learner: one data-parallel rank of policy-gradient training (`Learner`); N ranks as Ray actors (`LearnerGroup`).

One `train_step(trajectories)` is one optimizer step:

1. advantages per group with the configured algorithm (`Algorithm.batch_advantages`; every
   trajectory needs a `group_id`);
2. each trajectory becomes one sequence: inputs `tokens[:-1]`, targets `tokens[1:]`, trained
   where `loss_mask[1:]` is 1; the samples of a group that share their prompt form a unit whose prompt is
   computed once (`share_prefix`), the other sequences are packed whole into right-padded micro-batches
   whose padded size B·T stays within `micro_batch_tokens`, longest first (`rl/train/batching.py`); a unit longer
   than `segment_tokens` runs segment by segment with the same loss and gradients (K3, `rl/train/segments.py`);
   a trajectory with `position_ids` holds several packed documents (pretraining rows, rl/pretrain/data.py),
   each computed as if alone — in one block-diagonal forward, or, longer than a segment, cut into its
   documents (`rl/train/batching.py split_documents`);
3. the loss-mask token and sequence counts are all-reduced first, so every micro-batch of every
   rank divides by the global counts (`rl/algos/base.py`); each micro-batch runs forward, the
   algorithm's loss and backward; gradients accumulate;
4. gradients are summed across ranks (`rl/train/parallel.py`), then a NaN/inf guard: if a loss or a
   gradient is non-finite on any rank, every rank skips the optimizer step (weights, optimizer
   state, router biases and `version` unchanged) and the metrics say why;
5. gradient clipping, the optimizer step (AdamW; Muon for hidden matrices when `optimizer: muon`,
   rl/train/optim.py) and the learning-rate schedule's step, then router-bias balancing for MoE models
   (statistics reduced over ranks).

Log-probabilities never go through full logits: the policy adapter (model/policy.py) gives the
final hidden states of the loss-mask rows and `model.logprobs.selected_logprobs` scores them in
chunks; K3 and any other HF causal LM differ only inside the adapter. Logits with soft-capping or
an LM-head bias are refused.

One optimizer step per call, with π_old = the current weights (`old_logprobs =
logprobs.detach()`): the PPO ratio is 1 at the step and clipping acts through later reuse of
stale data only; the behaviour policy enters through truncated IS. Dropout is switched off
(every `*dropout*`/`*_pdrop` config value set to 0) so that the policy is compared with itself.

MoE models (K3): routed-expert replay (R3) passes `Trajectory.routed_experts` to the model
when `routing_replay` is on; tokens without a recorded routing (-1: prompt, tool output, the
last sampled token) are routed by the learner's router, and the padding mask keeps padding out
of the balancing statistics (both are arguments of the model's router: model/moe.py
`Router.forward`). After each step `rl.train.router_balance.balance_routers` updates the router
biases from the step's statistics (reduced over ranks) and reports MaxVio per MoE layer.

Checkpoints (`save`, `save_into`, `load`): a Hugging Face directory (K3: the released layout its config
chooses, model/formats/layouts.py; other models: `save_pretrained`; safetensors, the tokenizer when the model
directory has one) plus `optimizer.pt` (optimizer
states, `version`; rank 0) and `rng-rank{r}.pt` (each rank's RNG states). `save` is atomic on
its own (`rl.checkpoint.atomic_dir`); the trainer writes the learner and its own state into one
`CheckpointManager.begin(step)` directory with `save_into` and `save_trainer_state`.

Expert parallelism and FSDP2 (`learner.expert_parallel`, `learner.fsdp`, K3 only, more than one rank): the model is
sharded from outside before the optimizer is built (rl/train/parallel.py `make_mesh`, `apply_parallelism`: E/EP experts per
rank with all-to-all dispatch, FSDP2 over the ranks); gradients are summed by FSDP's reduce-scatters (or `sync_grads`),
the norm is `parallel.grad_norm`, clipping multiplies by a python float. Every forward and backward then holds
collectives, so every rank runs the same number of passes: the ranks agree on the largest micro-batch count first,
and a rank with fewer runs idle passes (one real token, router statistics off, loss 0 × log π: an exactly zero
gradient on the same parameters). Hence no reference model, segments or prefix sharing there (their passes depend on
a rank's own data), and AdamW only (Muon orthogonalises whole matrices). `score` and `named_weights` are collective
(rank 0 gets the gathered weights); checkpoints hold the shards (`SHARDED_DIR`, torch.distributed.checkpoint) plus
the gathered model in the released layout and `SHARDED_META`, and load only into the same layout.

How the trainer drives it (driver process; `LearnerGroup` has the same methods as `Learner`):

    group = LearnerGroup(LearnerConfig.from_job(job, model_dir), num_ranks=job.rl.num_learners)
    metrics = group.train_step(batch)                      # one optimizer step, global metrics
    weights, version = group.named_weights(), group.version   # → Engine.load_weights on every worker
    with CheckpointManager(run_dir / "checkpoints", keep=3).begin(step) as tmp:
        group.save_into(tmp)
        save_trainer_state(tmp, {"step": step, "cursor": ..., "unconsumed": trajectories})
    # resume: path = find_latest(run_dir / "checkpoints"); group.load(path); load_trainer_state(path)

Shapes: B sequences of a micro-batch, T its padded length, N loss-mask tokens of the micro-batch,
L MoE layers, k experts per token, d hidden size, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from k3rl.model.formats import layouts as hf_layout
from k3rl.model.formats.names import stack_experts
from k3rl.model.policy import Policy, load_policy
from k3rl.rl import checkpoint as ckpt
from k3rl.rl.algos import get_algo
from k3rl.rl.algos.base import Algorithm, LossInputs
from k3rl.rl.config import LearnerSettings
from k3rl.rl.train import parallel, router_balance, segments
from k3rl.rl.train.batching import TrainSequence, collate, group_prefixes, pack_micro_batches, split_documents, to_train_sequence
from k3rl.rl.train.optim import build_optimizers, build_schedulers, restore_schedulers

OPTIMIZER_FILE = "optimizer.pt"
SHARDED_DIR = "sharded"
"""A sharded learner's model and optimizer states (torch.distributed.checkpoint), inside its checkpoint."""
SHARDED_META = "sharded_learner.json"
"""What a sharded learner's checkpoint has instead of `OPTIMIZER_FILE`: version, world size, layout, optimizer."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _load_optimizer_file(path: Path, device: Any) -> dict:
    """`optimizer.pt` read as tensors and plain values only (`weights_only`): a checkpoint handed over from
    another run (`load_optimizer`) or downloaded is untrusted, and a full unpickler would run any code it names.
    Checkpoints written before the optimizer name was saved as a plain string hold the `Optimizer` enum."""
    from k3rl.rl.config import Optimizer

    with torch.serialization.safe_globals([Optimizer]):
        return torch.load(path, map_location=device, weights_only=True)


@dataclass
class LearnerConfig(LearnerSettings):
    """Everything one learner rank needs: the job's `learner:` section (rl/config.py `LearnerSettings`:
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
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer: {self.optimizer!r} is not one of adamw, muon")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.micro_batch_tokens < 1 or self.logprob_chunk_size < 1:
            raise ValueError("micro_batch_tokens and logprob_chunk_size must be ≥ 1")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm: must be ≥ 0, got {self.max_grad_norm}")
        if str(self.lr_scheduler) not in ("constant", "constant_with_warmup", "linear", "cosine", "wsd"):
            raise ValueError(f"lr_scheduler: {self.lr_scheduler!r} is not one of constant, constant_with_warmup, "
                             f"linear, cosine, wsd")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if str(self.lr_scheduler) == "wsd" and not (self.total_steps and 0 <= self.decay_steps <= self.total_steps
                                                    and self.warmup_steps + self.decay_steps <= self.total_steps):
            raise ValueError(f"wsd: warmup_steps {self.warmup_steps} + decay_steps {self.decay_steps} must fit in "
                             f"total_steps {self.total_steps}")
        if self.warmup_steps < 0 or (self.warmup_steps and str(self.lr_scheduler) == "constant"):
            raise ValueError(f"warmup_steps: {self.warmup_steps} with lr_scheduler {self.lr_scheduler!r} (`constant` "
                             f"has no warmup: use constant_with_warmup)")
        if str(self.lr_scheduler) in ("linear", "cosine", "wsd") and not (self.total_steps and self.total_steps > 0):
            raise ValueError(f"total_steps: lr_scheduler {self.lr_scheduler!r} decays over total_steps, got "
                             f"{self.total_steps}")
        if self.segment_tokens is not None and self.segment_tokens < 1:
            raise ValueError(f"segment_tokens: must be ≥ 1 or null, got {self.segment_tokens}")
        if self.micro_batch_seqs is not None and self.micro_batch_seqs < 1:
            raise ValueError(f"micro_batch_seqs: must be ≥ 1 or null, got {self.micro_batch_seqs}")
        if self.expert_parallel < 1:
            raise ValueError(f"expert_parallel: must be ≥ 1, got {self.expert_parallel}")
        if self.sharded:
            # Every rank must run the same sequence of forwards and backwards (their all-gathers and all-to-alls are
            # collectives); the features below would make the passes of a rank depend on its own data.
            what = f"expert_parallel = {self.expert_parallel}, fsdp = {str(bool(self.fsdp)).lower()}"
            if str(self.optimizer) != "adamw":
                raise ValueError(f"optimizer: {self.optimizer!r} with {what}: only adamw (Muon orthogonalises whole "
                                 f"matrices, which are sharded across ranks here)")
            if float(dict(self.algo_args).get("kl_coef", 0.0) or 0.0) > 0:
                raise ValueError(f"expert_parallel / fsdp ({what}): a reference model (algo.args.kl_coef > 0) is not "
                                 f"supported on a sharded learner; set algo.args.kl_coef=0")
            if self.segment_tokens is not None:
                raise ValueError(f"segment_tokens: must be null with {what} (a segmented sequence runs a number of "
                                 f"passes that depends on its length)")
            if self.share_prefix:
                raise ValueError(f"share_prefix: must be false with {what} (a shared prompt is an extra forward)")

    @property
    def sharded(self) -> bool:
        """Expert parallelism or FSDP2 is asked for (it takes effect with more than one rank)."""
        return self.expert_parallel > 1 or bool(self.fsdp)

    def check_ranks(self, num_ranks: int, key: str = "rl.num_learners") -> None:
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
        if "rl" in job and "num_learners" in job.rl:
            cfg.check_ranks(int(job.rl.num_learners))
        return cfg


def compute_advantages(algo: Algorithm, trajectories: Sequence[Any]) -> np.ndarray:
    """Sequence advantages [B] (float32) from each trajectory's reward, per `group_id` (all 1 for an
    objective that uses no rewards, rl/algos/nll.py)."""
    if not trajectories:
        return np.zeros(0, dtype=np.float32)
    if not algo.uses_rewards:
        return np.ones(len(trajectories), dtype=np.float32)
    missing = [i for i, t in enumerate(trajectories) if not t.group_id]
    if missing:
        raise ValueError(f"trajectories {missing[:5]} have no group_id; group-relative advantages need one "
                         f"(the trainer sets it to the task's sample group)")
    rewards = torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float64)  # [B]
    return algo.batch_advantages(rewards, [t.group_id for t in trajectories]).float().numpy()


class Learner:
    """One data-parallel rank: policy, optimizer, `train_step`, weights for sync, checkpoints.

    Under torch.distributed (initialised by the caller, e.g. `LearnerGroup`) every rank must call
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
            set_rope_theta(self.model, cfg.rope_theta)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.policy.check_head()
        bad = self.policy.nonfinite_parameters()
        if bad:
            # every step would be skipped by the non-finite guard, forever: refuse instead
            raise ValueError(f"{cfg.model_path}: non-finite weights in {len(bad)} parameter tensor(s) "
                             f"({', '.join(bad[:3])}{', …' if len(bad) > 3 else ''}); the learner refuses to start")
        self._routers = router_balance.routers(self.model)
        self._replay = bool(cfg.routing_replay and self._routers and self.policy.is_k3)
        self.ref_policy: Optional[Policy] = None
        if getattr(self.algo.cfg, "kl_coef", 0.0) > 0:
            self.ref_policy = load_policy(cfg.ref_model_path or cfg.model_path, DTYPES[cfg.dtype], self.device,
                                          trust_remote_code=cfg.trust_remote_code)
            self.ref_policy.model.eval().requires_grad_(False)
        self.mesh = None
        """The ("dp", "ep") DeviceMesh of an expert-parallel / FSDP2 learner (rl/train/parallel.py), else None."""
        if cfg.sharded:
            if not self.policy.is_k3:
                raise ValueError(f"learner.expert_parallel / learner.fsdp: K3 models only; {cfg.model_path} is a "
                                 f"{getattr(self.model.config, 'model_type', '?')} model")
            if self.world_size == 1 and cfg.expert_parallel > 1:
                raise ValueError(f"learner.expert_parallel = {cfg.expert_parallel} needs that many learner ranks or a "
                                 f"multiple (rl.num_learners); this learner has one")
            cfg.check_ranks(self.world_size)
            if self.world_size > 1:
                if group is not None and self.world_size != parallel.get_world_size():
                    raise ValueError("learner.expert_parallel / learner.fsdp: the learner must span the whole default "
                                     "process group")
                self.mesh = parallel.make_mesh(cfg.expert_parallel, self.device.type)
                parallel.apply_parallelism(self.model, self.mesh, fsdp=bool(cfg.fsdp))
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
    def _replay_shape(self) -> Optional[tuple[int, int]]:
        return self.routing_shape if self._replay else None

    def _scorer(self, policy: Policy, targets: torch.Tensor, entropy: bool = False) -> segments.Scorer:
        """(normed hidden rows, their positions in `targets`) → (log π, entropy or None), chunked (model/logprobs.py)."""
        def score(hidden: torch.Tensor, order: torch.Tensor):
            result = policy.selected_logprobs(hidden, targets[order], self.cfg.logprob_chunk_size, entropy=entropy)
            return result if entropy else (result, None)
        return score

    def _segmented(self, unit: segments.Unit) -> bool:
        return self.policy.is_k3 and segments.needs_segments(unit, self.cfg.segment_tokens)

    def logprobs(self, policy: Policy, unit: segments.Unit, entropy: bool = False
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """log π(target) [N] (and entropy [N]) on the loss-mask positions of a unit, as one autograd graph (or
        segment by segment without grad when the unit is longer than a segment and grad is off)."""
        mb, score = unit.mb, self._scorer(policy, unit.mb.targets, entropy)
        if self._segmented(unit):
            if torch.is_grad_enabled():
                raise RuntimeError("a unit longer than learner.segment_tokens trains through segments.forward/backward")
            with self._router_stats(False):
                fwd = segments.forward(policy.model, unit, self.cfg.segment_tokens, score, keep_states=False)
            return fwd.logprobs, fwd.entropy
        if unit.prefix is not None:
            return segments.graph_logprobs(policy, unit, score)
        hidden = policy.final_hidden(mb.input_ids, attention_mask=mb.valid.long(), routed_expert_ids=mb.routed,
                                     rows=mb.loss_mask, position_ids=mb.position_ids)  # [N, d]
        return score(hidden, torch.arange(hidden.shape[0], device=hidden.device))

    @contextlib.contextmanager
    def _router_stats(self, on: bool):
        """Count (or not) the routing of the forwards inside in the router-balancing statistics."""
        before = [r.collect_stats for r in self._routers]
        for r in self._routers:
            r.collect_stats = on and r.collect_stats
        try:
            yield
        finally:
            for r, c in zip(self._routers, before):
                r.collect_stats = c

    def _pieces(self, seq: TrainSequence) -> list[TrainSequence]:
        """A sequence as the learner runs it: a packed sequence (several documents) longer than a segment is cut
        into its documents (rl/train/batching.py `split_documents`), since segments run one document per row."""
        if seq.positions is None or not self.policy.is_k3 or not self.cfg.segment_tokens or (
                len(seq.inputs) <= self.cfg.segment_tokens):
            return [seq]
        return split_documents(seq, self.cfg.segment_tokens)

    def _pack(self, seqs: list[TrainSequence]) -> list[list[int]]:
        """Micro-batches (indices into `seqs`) within `micro_batch_tokens`, longest first; packed sequences (several
        documents, never longer than a segment after `_pieces`) apart from the rest, since a micro-batch longer than a
        segment runs segment by segment, one document per row."""
        groups = [[i for i, s in enumerate(seqs) if (s.positions is not None) == packed] for packed in (False, True)]
        return [[group[j] for j in idx] for group in groups if group
                for idx in pack_micro_batches([len(seqs[i].inputs) for i in group], self.cfg.micro_batch_tokens,
                                              self.cfg.micro_batch_seqs)]

    def _units(self, seqs: list[TrainSequence], share_prefix: bool) -> list[segments.Unit]:
        """Micro-batches as units: the groups' prefix-sharing units (with `share_prefix`), then the rest packed
        whole, longest first, within `micro_batch_tokens`."""
        seqs = [piece for s in seqs for piece in self._pieces(s)]
        units: list[segments.Unit] = []
        rest = list(range(len(seqs)))
        # an HF model under gradient checkpointing drops its KV cache in training: no branch to share from
        if share_prefix and (self.policy.is_k3 or not self.cfg.gradient_checkpointing):
            shared, rest = group_prefixes(seqs, self.cfg.micro_batch_tokens, self.cfg.micro_batch_seqs)
            for P, members in shared:
                first = seqs[members[0]]
                routed = None
                if self._replay and first.routed is not None:
                    routed = torch.from_numpy(first.routed[None, :P].astype(np.int64)).to(self.device)
                units.append(segments.Unit(
                    collate([seqs[i].tail(P) for i in members], self.device, self._replay_shape),
                    torch.from_numpy(first.inputs[None, :P].astype(np.int64)).to(self.device), routed))
        for idx in self._pack([seqs[i] for i in rest]):
            units.append(segments.Unit(collate([seqs[rest[j]] for j in idx], self.device, self._replay_shape)))
        return units

    @torch.no_grad()
    def score(self, trajectories: Sequence[Any]) -> list[np.ndarray]:
        """log π(token) of each trajectory's loss-mask tokens (after the first) under the current
        weights, [n_i] float64 each, in trajectory order; routing replayed as in training, and not
        counted in the router-balancing statistics. Under a mesh every rank calls it together, each with its own
        share of the trajectories (possibly none): a rank with fewer micro-batches runs idle forwards."""
        # every trajectory's pieces (one, or its documents when packed and longer than a segment), in order
        pieces, owner = [], []
        for i, s in enumerate(to_train_sequence(t, 0.0) for t in trajectories):
            for piece in ([] if s is None else self._pieces(s)):
                pieces.append(piece)
                owner.append(i)
        parts: list[list[np.ndarray]] = [[] for _ in pieces]
        with self._router_stats(False):
            batches = self._pack(pieces)
            idle = self._idle_count(len(batches))
            for idx in batches:
                unit = segments.Unit(collate([pieces[j] for j in idx], self.device, self._replay_shape))
                logp, _ = self.logprobs(self.policy, unit)
                per_seq = torch.bincount(unit.mb.seq_ids, minlength=unit.mb.num_seqs).tolist()
                for j, part in zip(idx, logp.double().cpu().split(per_seq)):
                    parts[j] = part.numpy()
        for _ in range(idle):
            self._idle_pass(grad=False)
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
            plain = segments.Unit(dataclasses.replace(mb, routed=None), unit.prefix, None)  # the reference routes itself
            with torch.no_grad():
                ref, _ = self.logprobs(self.ref_policy, plain)
        fwd = None
        if self._segmented(unit):
            score = self._scorer(self.policy, mb.targets, self.cfg.compute_entropy)
            with self._router_stats(False):  # counted once, in the backward's recomputation
                fwd = segments.forward(self.model, unit, self.cfg.segment_tokens, score)
            logp, entropy = fwd.logprobs.detach().requires_grad_(), fwd.entropy
        else:
            logp, entropy = self.logprobs(self.policy, unit, entropy=self.cfg.compute_entropy)
        inputs = LossInputs(logprobs=logp, old_logprobs=logp.detach(),
                            behaviour_logprobs=mb.behaviour.to(logp.dtype), advantages=mb.advantages.to(logp.dtype),
                            seq_ids=mb.seq_ids, num_seqs=mb.num_seqs, num_tokens_global=n_tokens,
                            num_seqs_global=n_seqs, ref_logprobs=ref)
        loss, metrics = self.algo.loss(inputs)
        loss.backward()
        if fwd is not None:
            segments.backward(self.model, unit, self.cfg.segment_tokens, fwd, logp.grad,
                              self._scorer(self.policy, mb.targets))
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
        seqs = [s for s in (to_train_sequence(t, a) for t, a in zip(trajectories, advantages)) if s is not None]
        counts = torch.tensor([sum(int(s.mask.sum()) for s in seqs), len(seqs), sum(len(s.inputs) for s in seqs)],
                              dtype=torch.float64, device=self.device)
        n_tokens, n_seqs, n_inputs = parallel.all_reduce(counts, "sum", self.group).tolist()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self._clear_router_stats()
        if n_seqs == 0:
            return self._finish(start, {}, skipped="empty_batch", n=(0, 0, 0), micro_batches=0, lr=lr)

        sums: dict[str, torch.Tensor] = {}
        bad_loss = False
        batches = self._units(seqs, self.cfg.share_prefix)
        idle = self._idle_count(len(batches))
        for unit in batches:
            loss, metrics = self._micro_batch(unit, n_tokens, n_seqs)
            bad_loss |= not bool(torch.isfinite(loss))
            for k, v in metrics.items():
                sums[k] = sums[k] + v.double() if k in sums else v.double()
        for _ in range(idle):
            self._idle_pass(grad=True)
        keys = parallel.union_keys(sums, self.group)
        totals = torch.stack([sums.get(k, torch.zeros((), dtype=torch.float64)).to(self.device) for k in keys]
                             ) if keys else torch.zeros(0, dtype=torch.float64, device=self.device)
        parallel.all_reduce(totals, "sum", self.group)
        if self.mesh is not None:
            parallel.sync_grads(self.model, self.mesh)  # a no-op under FSDP, whose reduce-scatters summed them
            grad_norm = parallel.grad_norm(self.params, self.mesh)
        else:
            parallel.all_reduce_grads(self.params, self.group)
            grads = [p.grad for p in self.params if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        flags = torch.tensor([bad_loss, not bool(torch.isfinite(grad_norm))], dtype=torch.float64, device=self.device)
        parallel.all_reduce(flags, "max", self.group)
        metrics = {k: float(v) for k, v in zip(keys, totals.tolist())}
        metrics["grad_norm"] = float(grad_norm)
        skipped = "nonfinite_loss" if flags[0] else "nonfinite_grad" if flags[1] else ""
        if not skipped:
            if self.cfg.max_grad_norm > 0:
                self._clip(grad_norm)
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

    def _clip(self, grad_norm: torch.Tensor) -> None:
        """Scale the gradients to at most `max_grad_norm` (torch's rule: × min(1, max / (norm + 1e-6)))."""
        if self.mesh is None:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.cfg.max_grad_norm, grad_norm)
            return
        # A python float: DTensor gradients (shards of different meshes) do not take a plain tensor factor.
        coef = min(1.0, self.cfg.max_grad_norm / (float(grad_norm) + 1e-6))
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(coef)

    def _idle_count(self, mine: int) -> int:
        """Under a mesh, how many idle passes this rank adds to its own `mine` passes (forward, and backward in
        training) so that every rank runs as many as the busiest: each forward and backward of a sharded model holds
        collectives (FSDP2 all-gathers and reduce-scatters, the experts' all-to-alls) that every rank must join in the
        same order. A collective itself, before any pass; 0 without a mesh."""
        if self.mesh is None:
            return 0
        most = parallel.all_reduce(torch.tensor([mine], dtype=torch.int64, device=self.device), "max")
        return int(most.item()) - mine

    def _idle_pass(self, grad: bool) -> None:
        """One forward (and backward) through every module a micro-batch uses, changing nothing: a one-token input
        (a real token, attended, so that every value is finite and 0 × it is 0), its routing left out of the
        balancing statistics, and a loss of 0 × log π, whose gradient is exactly zero on every parameter it
        reaches — the same parameters as a real micro-batch's, so FSDP2 reduces the same set on every rank."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # [1, 1]
        rows = torch.ones_like(ids, dtype=torch.bool)  # [1, 1]
        with self._router_stats(False), torch.set_grad_enabled(grad):
            hidden = self.policy.final_hidden(ids, attention_mask=rows.long(), rows=rows)  # [1, d]
            logp = self.policy.selected_logprobs(hidden, ids[0], self.cfg.logprob_chunk_size)  # [1]
            if grad:
                (logp.sum() * 0.0).backward()

    def _clear_router_stats(self) -> None:
        for router in self._routers:
            router.clear_stats()

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
            self._clear_router_stats()
        elapsed = time.perf_counter() - start
        metrics.update(skipped=float(bool(skipped)), skip_reason=skipped, version=self.version,
                       lr=lr, num_loss_tokens=n[0], num_seqs=n[1],
                       num_tokens=n[2], micro_batches=micro_batches, step_time_s=elapsed,
                       train_tokens_per_s=n[2] / elapsed if elapsed > 0 else 0.0,
                       peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
        return metrics

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the state dict (buffers such as router biases and `lm_head.weight` included),
        as CPU copies under checkpoint names: what `Engine.load_weights` takes. Under a mesh every rank calls it
        (the shards are gathered, rl/train/parallel.py `full_state_dict`) and only rank 0 gets the tensors (the others
        an empty list)."""
        if self.mesh is not None:
            return list(parallel.full_state_dict(self.model, self.mesh).items())
        return [(name, t.detach().to("cpu", copy=True)) for name, t in self.model.state_dict().items()]

    def save_into(self, directory: str | Path) -> None:
        """Write this rank's part of a checkpoint into `directory` (rank 0: model, tokenizer, optimizer;
        every rank: its RNG states). Not atomic by itself: see `save` and `CheckpointManager.begin`.

        Under a mesh (every rank calls it): every rank writes its shards of the model and optimizer states into
        `SHARDED_DIR` (torch.distributed.checkpoint), rank 0 the gathered model in the released layout (readable
        by any tool, and by an unsharded learner as `rl.model_path`) and `SHARDED_META` instead of `OPTIMIZER_FILE`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tokenizer = self.tokenizer_path if (self.tokenizer_path / "tokenizer_config.json").is_file() else None
        if self.mesh is not None:
            parallel.save_sharded(directory / SHARDED_DIR, self.model, self.optimizers)
            state = parallel.full_state_dict(self.model, self.mesh)
            if self.rank == 0:
                hf_layout.save_state_dict(self.model.config, state, directory, tokenizer_from=tokenizer,
                                          trust_remote_code=self.cfg.trust_remote_code)
                (directory / SHARDED_META).write_text(json.dumps(self._layout(), indent=1) + "\n")
        elif self.rank == 0:
            if self.policy.is_k3:  # the released layout the model config chooses (model/formats/layouts.py)
                hf_layout.save_model(self.model, directory, tokenizer_from=tokenizer,
                                     trust_remote_code=self.cfg.trust_remote_code)
            else:
                self.model.save_pretrained(directory, safe_serialization=True)
                self._save_tokenizer(directory)
            torch.save({"version": self.version, "optimizers": [o.state_dict() for o in self.optimizers],
                        "world_size": self.world_size, "optimizer": str(self.cfg.optimizer)},
                       directory / OPTIMIZER_FILE)
        torch.save(ckpt.capture_rng(), directory / f"rng-rank{self.rank:05d}.pt")

    def _save_tokenizer(self, directory: Path) -> None:
        if not (self.tokenizer_path / "tokenizer_config.json").is_file():
            return
        from k3rl.model.tokenizer import load_tokenizer

        load_tokenizer(self.tokenizer_path, trust_remote_code=self.cfg.trust_remote_code).save_pretrained(directory)

    def save(self, path: str | Path) -> None:
        """An atomic single-rank checkpoint at `path` (replacing one that is there)."""
        if self.world_size > 1:
            raise RuntimeError("Learner.save is for one rank; use LearnerGroup.save or save_into on every rank")
        with ckpt.atomic_dir(path, version=self.version) as tmp:
            self.save_into(tmp)

    def load_optimizer(self, path: str | Path) -> None:
        """Take the optimizer moments of another run's checkpoint (a staged pretraining hand-off) and keep this
        learner's own hyperparameters (learning rate, schedule from step `version`, weight decay, betas)."""
        mine = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in self.optimizers]
        path = Path(path)
        ckpt.verify(path)
        if self.mesh is not None or (path / SHARDED_META).is_file():
            raise ckpt.CheckpointError(f"{path}: taking another run's optimizer moments is not implemented for sharded "
                                       f"learners (learner.expert_parallel / learner.fsdp); reset them instead")
        try:
            state = _load_optimizer_file(path / OPTIMIZER_FILE, self.device)
        except Exception as e:
            raise ckpt.CorruptCheckpointError(f"{path}: cannot read {OPTIMIZER_FILE} ({type(e).__name__}: {e})") from e
        self._load_optimizer_state(path, state)
        for opt, groups in zip(self.optimizers, mine):
            for group, own in zip(opt.param_groups, groups):
                group.update(own)
        restore_schedulers(self.schedulers, self.version)

    def _load_optimizer_state(self, path: Path, state: dict) -> None:
        if state.get("optimizer") != self.cfg.optimizer or len(state["optimizers"]) != len(self.optimizers):
            raise ckpt.CheckpointError(f"{path}: saved with optimizer {state.get('optimizer')!r}, this learner "
                                       f"uses {self.cfg.optimizer!r}")
        try:
            for opt, sd in zip(self.optimizers, state["optimizers"]):
                opt.load_state_dict(sd)
        except (ValueError, KeyError) as e:  # e.g. saved before the routed experts were stacked
            raise ckpt.CheckpointError(f"{path}: its optimizer state does not fit this learner's parameters ({e}); "
                                       f"start a new run from its weights instead (rl.model_path={path})") from e

    def _layout(self) -> dict[str, Any]:
        """What a sharded checkpoint records about the learner that wrote it (`SHARDED_META`)."""
        return {"version": self.version, "world_size": self.world_size, "expert_parallel": self.cfg.expert_parallel,
                "fsdp": bool(self.cfg.fsdp), "optimizer": str(self.cfg.optimizer)}

    def _load_sharded(self, path: Path) -> None:
        """`load` of a checkpoint written under a mesh by a learner laid out as this one."""
        try:
            meta = json.loads((path / SHARDED_META).read_text())
        except (OSError, ValueError) as e:
            raise ckpt.CorruptCheckpointError(f"{path}: cannot read {SHARDED_META} ({type(e).__name__}: {e})") from e
        mine = self._layout()
        keys = ("world_size", "expert_parallel", "fsdp", "optimizer")
        if self.mesh is None or any(meta.get(k) != mine[k] for k in keys):
            saved = ", ".join(f"{k} {meta.get(k)}" for k in keys)
            this = ", ".join(f"{k} {mine[k]}" for k in keys)
            raise ckpt.CheckpointError(
                f"{path}: saved by a sharded learner ({saved}); this learner has {this}, and a sharded optimizer state "
                f"loads only into the same layout (rl.num_learners, learner.expert_parallel, learner.fsdp, "
                f"learner.optimizer). Resume with those, or start a new run from its weights (rl.model_path={path}: "
                f"the Hugging Face export beside the shards; the optimizer state starts anew)")
        try:
            parallel.load_sharded(path / SHARDED_DIR, self.model, self.optimizers)
        except (FileNotFoundError, KeyError, RuntimeError, ValueError) as e:
            raise ckpt.CorruptCheckpointError(f"{path}: cannot read the sharded learner state in {SHARDED_DIR}/ "
                                              f"({type(e).__name__}: {e})") from e
        self.version = int(meta["version"])

    def load(self, path: str | Path) -> None:
        """Restore weights, optimizer states, `version` and this rank's RNG states from a complete checkpoint.
        Under a mesh every rank calls it; a checkpoint written under a mesh loads only into the same layout."""
        path = Path(path)
        ckpt.verify(path)
        opt_file = path / OPTIMIZER_FILE
        if (path / SHARDED_META).is_file() or self.mesh is not None:
            if not (path / SHARDED_META).is_file():
                raise ckpt.CheckpointError(
                    f"{path}: saved by an unsharded learner ({OPTIMIZER_FILE}); this learner is sharded "
                    f"(learner.expert_parallel = {self.cfg.expert_parallel}, learner.fsdp = {bool(self.cfg.fsdp)}, "
                    f"{self.world_size} ranks) and takes sharded checkpoints only; start a new run from its weights "
                    f"(rl.model_path={path}) or resume without sharding")
            self._load_sharded(path)
            restore_schedulers(self.schedulers, self.version)
            self._restore_rng(path)
            return
        if not opt_file.is_file():
            raise ckpt.IncompleteCheckpointError(f"{path}: no {OPTIMIZER_FILE} (not a learner checkpoint)")
        from safetensors.torch import load_file

        try:
            if self.policy.is_k3:  # any K3 layout, internal names (model/formats/layouts.py)
                weights = hf_layout.read_state_dict(path)
            else:
                weights = {}
                for file in sorted(path.glob("*.safetensors")):
                    weights.update(load_file(file))
                weights = stack_experts(weights)
            state = _load_optimizer_file(opt_file, self.device)
        except Exception as e:  # truncated or foreign files: name the checkpoint
            raise ckpt.CorruptCheckpointError(f"{path}: cannot read the learner state ({type(e).__name__}: {e})") from e
        model_state = self.model.state_dict()
        # tied tensors (e.g. lm_head.weight = embed_tokens.weight) are saved once, under one name
        shared: dict[int, set[str]] = {}
        for name, t in model_state.items():
            shared.setdefault(t.data_ptr(), set()).add(name)
        missing = sorted(n for n, t in model_state.items() if not shared[t.data_ptr()] & weights.keys())
        unknown = sorted(set(weights) - set(model_state))
        if missing or unknown:
            raise ckpt.CorruptCheckpointError(f"{path}: does not match this model: missing {missing[:5]}, "
                                              f"unknown {unknown[:5]}")
        with torch.no_grad():
            for name, t in weights.items():
                model_state[name].copy_(t)
        self._load_optimizer_state(path, state)
        self.version = int(state["version"])
        restore_schedulers(self.schedulers, self.version)
        self._restore_rng(path)

    def _restore_rng(self, path: Path) -> None:
        rng_file = path / f"rng-rank{self.rank:05d}.pt"
        if rng_file.is_file():
            ckpt.restore_rng(torch.load(rng_file, weights_only=False))
        else:
            # more ranks than when saved: a fresh, distinct stream per rank and version
            torch.manual_seed(self.cfg.seed + self.rank + 1_000_003 * self.version)


class LearnerWorker:
    """The Ray actor body of one `LearnerGroup` rank: joins the process group, then owns a `Learner`."""

    def __init__(self, num_threads: int = 1):
        torch.set_num_threads(max(1, num_threads))
        self.learner: Optional[Learner] = None

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


def set_rope_theta(model: torch.nn.Module, theta: float) -> None:
    """Set the RoPE base of a K3 model's MLA layers (which read `config.rope_theta` at every call, model/mla.py;
    KDA uses no positions). Refused for a model without RoPE on MLA."""
    config = model.config
    if getattr(config, "mla_use_nope", True):  # K3 in RoPE mode only (other models have no such flag)
        raise ValueError(f"rope_theta: the model ({getattr(config, 'model_type', '?')}, mla_use_nope="
                         f"{getattr(config, 'mla_use_nope', None)}) has no RoPE layers to take a base")
    if not theta > 1.0:
        raise ValueError(f"rope_theta: must be > 1, got {theta}")
    config.rope_theta = float(theta)


__all__ = ["Learner", "LearnerConfig", "LearnerGroup", "LearnerWorker", "compute_advantages", "set_rope_theta"]
