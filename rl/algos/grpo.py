"""GRPO: group-normalised advantages and the PPO-clip token loss, averaged per sequence then over sequences.

Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), Eq. 3 with outcome supervision (§4.1.2):

    Â_i = (r_i − mean(r)) / (std(r) + eps)                      for the G outputs of one prompt
    J   = 1/G Σ_i 1/|o_i| Σ_t [ min(ρ_it Â_i, clip(ρ_it, 1−ε, 1+ε) Â_i) − β D_KL,it ]
    ρ_it = π_θ(o_it) / π_old(o_it),   D_KL per Eq. 4 (the k3 estimator)

Token normalisation: the per-token terms of each sequence are averaged over its own loss-mask
tokens, those sequence means are summed and divided by the number of sequences in the global
batch (`num_seqs_global`), so gradient accumulation over micro-batches and ranks equals one big
batch. Short and long answers weigh the same per sequence, which is the length bias Dr. GRPO
removes.

Departures: std is the unbiased sample std, and a group of one gets advantage 0; the ratio's
log is clamped to ±20; truncated IS against the rollout engine's logprobs (common.tis_weights)
multiplies the clipped term, per `AlgoConfig.tis_level`, which the paper does not have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3rl.rl.algos.base import Algorithm, ClipConfig, LossInputs
from k3rl.rl.algos.common import clipped_surrogate, finish_loss, group_normalised, log_ratio, seq_mean_token_mean, share


@dataclass
class GRPOConfig(ClipConfig):
    adv_eps: float = 1e-6
    """eps in (r − mean) / (std + eps)."""


class GRPO(Algorithm):
    name = "grpo"
    Config = GRPOConfig

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return group_normalised(rewards, self.cfg.adv_eps)  # [G]

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp(log_ratio(inputs.logprobs, inputs.old_logprobs))  # [T]
        pg, clipped = clipped_surrogate(ratio, inputs.advantages, self.cfg.eps_low, self.cfg.eps_high)
        metrics = {"clip_frac": share(clipped, inputs.num_tokens_global, inputs)}
        return finish_loss(pg, inputs, self.cfg, seq_mean_token_mean, metrics)
