"""The one interface every RL algorithm implements: sequence advantages for a group, a token-level loss.

The trainer is algorithm-blind (STYLE rule 8). It
1. groups the finished trajectories of one task and calls `algo.advantages(rewards [G]) -> [G]`
   (or `algo.batch_advantages(rewards [B], group_ids) -> [B]` for a whole batch);
2. broadcasts each trajectory's advantage to its loss-mask tokens and packs the loss-mask tokens
   of a micro-batch into flat `[T]` tensors (`LossInputs`), whole sequences only: a sequence
   is never split across micro-batches (per-sequence means and GSPO's sequence ratio need all
   of its tokens);
3. calls `loss, metrics = algo.loss(inputs)`, then `loss.backward()` — the same call for every
   algorithm, micro-batch, epoch and data-parallel rank.

Normalisation contract (what makes accumulation equal one big batch). `num_tokens_global` and
`num_seqs_global` count the loss-mask tokens and the sequences of the whole optimiser step: every
micro-batch of every data-parallel rank. Each algorithm divides by these global counts only, never
by a count of the micro-batch, so summing `loss` over micro-batches (and, through the usual DP
gradient all-reduce with SUM, over ranks) gives exactly the loss and gradient of one big batch.
A DP wrapper that averages gradients over ranks (DDP's default) must be given the global counts
divided by the world size. The rule of each algorithm is in its docstring.

Metrics follow the same rule: each value is a detached 0-dim tensor holding this micro-batch's
share of a global-batch mean, so the trainer adds them up over micro-batches and ranks
(`all_reduce(SUM)`) and never averages.

Shapes: T = loss-mask tokens of the micro-batch (packed across its sequences), S = its sequences,
G = trajectories in one group, B = trajectories in a batch.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar, Optional

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
TIS_LEVELS = ("token", "sequence", "none")
TIS_MODES = ("truncate", "mask", "icepop")


@dataclass
class AlgoConfig:
    """Settings every algorithm shares: the KL penalty to a reference and rollout/training IS correction.

    Algorithms subclass this with their own fields (clip ranges, …). Only OmegaConf-compatible
    field types (float, int, str, bool, Optional of those).
    """

    kl_coef: float = 0.0
    """β of the per-token KL penalty to the reference policy (0: off; needs `ref_logprobs`)."""
    kl_estimator: str = "k3"
    """`k1` (log π − log π_ref), `k2` (½(log π − log π_ref)²) or `k3` (the GRPO paper's Eq. 4)."""
    tis_level: str = "token"
    """Truncated importance sampling against the rollout engine's logprobs: `token`, `sequence` or `none`."""
    tis_cap: float = 2.0
    """C: IS weights π_old/μ above C are truncated to C (`truncate`) or masked (`mask`); `icepop` masks those
    outside [1/C, C] (all no-ops when the engine and learner agree)."""
    tis_mode: str = "truncate"
    """What a weight outside the band becomes (rl/algos/common.py `tis_weights`): `truncate`, min(w, C) (TIS);
    `mask`, 0 above C (MIS: the token, or with `tis_level=sequence` the whole sequence, is left out of the
    gradient); `icepop`, 0 outside [1/C, C], the ratio kept inside (IcePop's two-sided mask)."""

    def __post_init__(self):
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator: {self.kl_estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
        if self.tis_level not in TIS_LEVELS:
            raise ValueError(f"tis_level: {self.tis_level!r} is not one of {', '.join(TIS_LEVELS)}")
        if self.tis_mode not in TIS_MODES:
            raise ValueError(f"tis_mode: {self.tis_mode!r} is not one of {', '.join(TIS_MODES)}")
        if self.tis_mode == "icepop" and self.tis_cap <= 1:
            raise ValueError(f"tis_cap: icepop's band [1/C, C] needs C > 1, got {self.tis_cap}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef: must be ≥ 0, got {self.kl_coef}")
        if self.tis_cap <= 0:
            raise ValueError(f"tis_cap: must be > 0, got {self.tis_cap}")


@dataclass
class ClipConfig(AlgoConfig):
    """AlgoConfig plus the trust region of a clipped ratio: clip(ρ, 1 − eps_low, 1 + eps_high)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    """Above eps_low this is DAPO's clip-higher: more room for raising unlikely tokens."""

    def __post_init__(self):
        super().__post_init__()
        if self.eps_low < 0 or self.eps_high < 0:
            raise ValueError(f"eps_low/eps_high: must be ≥ 0, got {self.eps_low}/{self.eps_high}")


@dataclass
class LossInputs:
    """One micro-batch of loss-mask tokens, packed flat across its sequences.

    All `[T]` tensors are aligned: entry t is the t-th loss-mask token of the micro-batch.
    """

    logprobs: torch.Tensor
    """[T] float, log π_θ(token) of the current policy, with grad."""
    old_logprobs: torch.Tensor
    """[T] float, log π_old(token): the learner's own pre-update logprobs (PPO ratios);
    `logprobs.detach()` on the first epoch over a batch."""
    behaviour_logprobs: torch.Tensor
    """[T] float, log μ(token) reported by the rollout engine that sampled it."""
    advantages: torch.Tensor
    """[T] float, the sequence advantage broadcast to each of its tokens."""
    seq_ids: torch.Tensor
    """[T] int64 in [0, num_seqs): the micro-batch sequence each token belongs to."""
    num_seqs: int
    """S, the sequences of this micro-batch (each with at least one loss-mask token)."""
    num_tokens_global: float
    """Loss-mask tokens in the whole optimiser step (all micro-batches, all DP ranks)."""
    num_seqs_global: float
    """Sequences in the whole optimiser step (all micro-batches, all DP ranks)."""
    ref_logprobs: Optional[torch.Tensor] = None
    """[T] float, log π_ref(token) of the reference policy, or None (no KL term)."""

    def __post_init__(self):
        t = self.logprobs.shape
        if self.logprobs.dim() != 1:
            raise ValueError(f"LossInputs.logprobs must be [T], got shape {list(t)}")
        for name in ("old_logprobs", "behaviour_logprobs", "advantages", "seq_ids", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and value.shape != t:
                raise ValueError(f"LossInputs.{name} has shape {list(value.shape)}, logprobs has {list(t)}")
        if self.seq_ids.dtype != torch.long:
            raise ValueError(f"LossInputs.seq_ids must be int64, got {self.seq_ids.dtype}")
        if self.num_tokens_global <= 0 or self.num_seqs_global <= 0:
            raise ValueError(f"LossInputs: global normalisers must be > 0, got num_tokens_global="
                             f"{self.num_tokens_global}, num_seqs_global={self.num_seqs_global}")


class Algorithm(abc.ABC):
    """An RL algorithm: `advantages` for one group, `loss` for one micro-batch (see module docstring)."""

    name: ClassVar[str]
    Config: ClassVar[type] = AlgoConfig
    uses_rewards: ClassVar[bool] = True
    """False for supervised objectives (rl/algos/nll.py): no rewards, no groups, every advantage 1."""

    def __init__(self, cfg: Optional[AlgoConfig] = None):
        self.cfg = cfg if cfg is not None else self.Config()
        if not isinstance(self.cfg, self.Config):
            raise TypeError(f"{type(self).__name__} needs a {self.Config.__name__}, got {type(self.cfg).__name__}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> Algorithm:
        """Build with `Config(**kwargs)`; an unknown key is a ValueError naming the valid ones."""
        valid = [f.name for f in fields(cls.Config)]
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise ValueError(f"algorithm {cls.name!r}: unknown setting(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(valid)}")
        return cls(cls.Config(**kwargs))

    @property
    def needs_reference(self) -> bool:
        """Whether `loss` needs `LossInputs.ref_logprobs`, i.e. the learner must load a reference policy: a KL
        penalty (`kl_coef > 0` of an `AlgoConfig`); objectives without one (rl/algos/nll.py) never do."""
        return isinstance(self.cfg, AlgoConfig) and self.cfg.kl_coef > 0

    @abc.abstractmethod
    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """rewards [G] of one group (same task) -> sequence advantages [G]; finite for any G ≥ 1."""

    @abc.abstractmethod
    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(0-dim loss to minimise, additive metrics) for one micro-batch."""

    def batch_advantages(self, rewards: torch.Tensor, group_ids: Sequence[Hashable]) -> torch.Tensor:
        """rewards [B] with a group id per trajectory -> advantages [B], `advantages` applied per group."""
        if len(group_ids) != rewards.shape[0]:
            raise ValueError(f"{len(group_ids)} group ids for {rewards.shape[0]} rewards")
        members: dict[Hashable, list[int]] = {}
        for i, g in enumerate(group_ids):
            members.setdefault(g, []).append(i)
        out = torch.empty_like(rewards, dtype=torch.promote_types(rewards.dtype, torch.float32))
        for idx in members.values():
            index = torch.tensor(idx, device=rewards.device)
            out[index] = self.advantages(rewards[index].to(out.dtype))
        return out
