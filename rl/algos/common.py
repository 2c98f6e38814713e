"""Pieces every algorithm shares: group baselines, ratios, the clipped surrogate, the four
normalisation rules, KL to a reference, and truncated importance sampling (TIS) against the
rollout engine's behaviour logprobs with the mismatch KL it reports.

`finish_loss` is the single place where an algorithm's per-token policy-gradient loss becomes the
micro-batch loss: TIS weights (detached) multiply the policy-gradient term, the KL penalty is
added per token, and the algorithm's reduction divides by the global normalisers. No algorithm
file repeats any of this.

Shapes: T loss-mask tokens, S sequences of the micro-batch, G trajectories of a group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch

from k3rl.rl.algos.base import AlgoConfig, LossInputs

Reduce = Callable[[torch.Tensor, LossInputs], torch.Tensor]

# exp() of a log-ratio beyond ±20 (ratios above 4.8e8) would only feed overflow into the loss;
# such tokens are already outside every trust region, so the clamp changes no clipped objective.
MAX_LOG_RATIO = 20.0


def group_centered(rewards: torch.Tensor) -> torch.Tensor:
    """r − mean(r) for one group [G] -> [G] (Dr. GRPO, and the PPO-without-critic baseline).

    Exactly 0 when all rewards are equal (a float mean of equal values can be off by an ulp).
    """
    if rewards.numel() == 0 or rewards.max() == rewards.min():
        return torch.zeros_like(rewards)
    return rewards - rewards.mean()


def group_normalised(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """(r − mean(r)) / (std(r) + eps) for one group [G] -> [G], std unbiased (n − 1).

    A group of one has no spread to normalise by and gets advantage 0; so does a group whose
    rewards are all equal, without NaN.
    """
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    centered = group_centered(rewards)
    if not centered.any():
        # all-equal rewards: 0, not 0/0 (eps = 0 is allowed) nor an ulp divided by an ulp
        return centered
    return centered / (rewards.std() + eps)


def seq_sum(x: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Per-sequence sums: x [T] -> [S]."""
    return x.new_zeros(inputs.num_seqs).index_add(0, inputs.seq_ids, x)


def seq_lengths(inputs: LossInputs) -> torch.Tensor:
    """Loss-mask tokens of each sequence [S] (float, at least 1)."""
    counts = torch.bincount(inputs.seq_ids, minlength=inputs.num_seqs)
    return counts.clamp(min=1).to(inputs.logprobs.dtype)


def log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """log π_θ/π_old per token [T], clamped to ±MAX_LOG_RATIO."""
    return (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float,
                      dual_clip: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip loss −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) per token or sequence, and where it is clipped.

    Asymmetric bounds are DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476, §3.1). With
    `dual_clip = c > 1` (Ye et al. 2020, arXiv:1912.09729, dual-clip PPO), a negative-advantage
    term is also bounded by −cA, so a token whose ratio exploded (ρ > c) contributes a constant
    and no gradient. Returns (loss [*], clipped [*] bool: the term has zero gradient).
    """
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(-ratio * adv, -clipped_ratio * adv)
    clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    if dual_clip is not None:
        dual = (adv < 0) & (ratio > dual_clip)
        loss = torch.where(dual, -dual_clip * adv, loss)
        clipped = clipped | dual
    return loss, clipped


def share(mask: torch.Tensor, denom: float, inputs: LossInputs) -> torch.Tensor:
    """A count metric as a share of a global normaliser: mask.sum() / denom, in the logprobs' dtype."""
    return mask.to(inputs.logprobs.dtype).sum() / denom


def token_mean(x: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Sum over tokens ÷ loss-mask tokens in the global batch (DAPO's token-level rule)."""
    return x.sum() / inputs.num_tokens_global


def seq_mean_token_mean(x: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Mean over each sequence's tokens, summed over sequences ÷ sequences in the global batch (GRPO)."""
    return (seq_sum(x, inputs) / seq_lengths(inputs)).sum() / inputs.num_seqs_global


def seq_sum_mean(x: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Sum over tokens ÷ sequences in the global batch: each sequence's log-likelihood term (REINFORCE/RLOO)."""
    return x.sum() / inputs.num_seqs_global


def constant_token_sum(max_tokens: int) -> Reduce:
    """Sum over tokens ÷ (sequences in the global batch × a constant token budget) (Dr. GRPO)."""

    def reduce(x: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        return x.sum() / (inputs.num_seqs_global * max_tokens)

    return reduce


def _k1(logprobs, ref):
    return logprobs - ref


def _k2(logprobs, ref):
    return 0.5 * (logprobs - ref) ** 2


def _k3(logprobs, ref):
    d = ref - logprobs
    return torch.exp(d) - d - 1.0


KL = {"k1": _k1, "k2": _k2, "k3": _k3}
"""Per-token estimators of KL(π_θ ‖ π_ref) on samples (Schulman 2020, "Approximating KL divergence");
k3 is Eq. 4 of the GRPO paper (Shao et al. 2024, arXiv:2402.03300)."""


def _tis_token(log_w: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    return log_w


def _tis_sequence(log_w: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    return seq_sum(log_w, inputs)[inputs.seq_ids]


def _tis_none(log_w: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    return torch.zeros_like(log_w)


TIS = {"token": _tis_token, "sequence": _tis_sequence, "none": _tis_none}
"""log IS weight per token [T] from the token log-ratios log π_old/μ: the token's own (token TIS),
the sum over its sequence (sequence TIS: the product of token ratios), or 0 (off)."""


def tis_weights(inputs: LossInputs, level: str, cap: float, mode: str = "truncate"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(IS weights [T], detached; where the weight left the band [T] bool; where it was masked to 0 [T] bool).

    They correct for the rollout engine (μ) not being the learner's policy before the update (π_old): other
    kernels, precision, routing. w = π_old/μ per token, or at sequence level the product of the sequence's token
    ratios, then by `mode`:
    * `truncate`: min(w, C) — truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
      off-policy RL training"; at sequence level Ionides 2008, "Truncated importance sampling");
    * `mask`: w, or 0 where w > C — masked IS (MIS, Liu et al. 2025, "When speed kills stability"): a token or
      sequence the engine sampled far more readily than the learner would is dropped, not down-weighted;
    * `icepop`: w inside [1/C, C], else 0 — IcePop (Ling team 2025, "Every step evolves"): the two-sided mask
      drops tokens whose probabilities disagree in either direction and keeps the ratio of the rest.
    """
    log_w = TIS[level]((inputs.old_logprobs - inputs.behaviour_logprobs).detach(), inputs)
    above = log_w > math.log(cap)
    if mode == "truncate":
        return torch.exp(log_w.clamp(max=math.log(cap))), above, torch.zeros_like(above)
    masked = above if mode == "mask" else above | (log_w < -math.log(cap))
    return torch.exp(log_w).masked_fill(masked, 0.0), masked, masked


def mismatch_kl(inputs: LossInputs) -> torch.Tensor:
    """k3 estimate of KL(μ ‖ π_old) per token [T] on tokens sampled from μ: r − 1 − log r with
    r = π_old/μ; ≥ 0, and exactly 0 where the engine and the learner agree."""
    d = (inputs.old_logprobs - inputs.behaviour_logprobs).detach()
    return torch.exp(d) - d - 1.0


def finish_loss(pg: torch.Tensor, inputs: LossInputs, cfg: AlgoConfig, reduce: Reduce,
                metrics: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Micro-batch loss = reduce(w·pg + β·KL) from the per-token policy-gradient loss pg [T].

    w are the IS weights (`cfg.tis_level`, `cfg.tis_cap`, `cfg.tis_mode`); the KL term needs `ref_logprobs`
    whenever `cfg.kl_coef > 0`. Adds the shared metrics, each a share of a global token mean.
    """
    w, capped, masked = tis_weights(inputs, cfg.tis_level, cfg.tis_cap, cfg.tis_mode)  # [T], [T], [T]
    per_token = w * pg
    n = inputs.num_tokens_global
    if cfg.kl_coef > 0:
        if inputs.ref_logprobs is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} needs LossInputs.ref_logprobs")
        kl = KL[cfg.kl_estimator](inputs.logprobs, inputs.ref_logprobs.detach())  # [T]
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl_ref"] = kl.detach().sum() / n
    loss = reduce(per_token, inputs)
    metrics["loss"] = loss.detach()
    metrics["tis_weight"] = w.sum() / n
    metrics["tis_capped_frac"] = share(capped, n, inputs)
    metrics["tis_masked_frac"] = share(masked, n, inputs)
    metrics["mismatch_kl"] = mismatch_kl(inputs).sum() / n
    return loss, metrics
