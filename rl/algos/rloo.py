"""RLOO: REINFORCE with a leave-one-out baseline from the other samples of the same prompt.

Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024,
"Back to Basics" (arXiv:2402.14740), §3.2:

    Â_i = r_i − 1/(G−1) Σ_{j≠i} r_j  =  G/(G−1) · (r_i − mean(r))
    ∇J  = 1/G Σ_i Â_i ∇ log π(o_i),   log π(o_i) = Σ_t log π(o_it)

The baseline of each sample excludes its own reward, so the estimator stays unbiased. For the
epochs after the first (when π_θ ≠ π_old) each token's term is the PPO-clip surrogate
−min(ρÂ, clip(ρ)Â); on the first epoch ρ = 1 and its gradient is exactly REINFORCE's.

Token normalisation: a sequence's terms are summed over its tokens (the sequence log-likelihood
of REINFORCE, not a per-token mean), then divided by the number of sequences in the global batch
(`num_seqs_global`), so accumulation over micro-batches and ranks equals one big batch.
A group of one has no other sample to form a baseline and gets advantage 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3rl.rl.algos.base import Algorithm, ClipConfig, LossInputs
from k3rl.rl.algos.common import clipped_surrogate, finish_loss, group_centered, log_ratio, seq_sum_mean, share


@dataclass
class RLOOConfig(ClipConfig):
    pass


class RLOO(Algorithm):
    name = "rloo"
    Config = RLOOConfig

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        g = rewards.numel()
        if g < 2:
            return torch.zeros_like(rewards)
        return group_centered(rewards) * (g / (g - 1))  # [G]

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp(log_ratio(inputs.logprobs, inputs.old_logprobs))  # [T]
        pg, clipped = clipped_surrogate(ratio, inputs.advantages, self.cfg.eps_low, self.cfg.eps_high)
        metrics = {"clip_frac": share(clipped, inputs.num_tokens_global, inputs)}
        return finish_loss(pg, inputs, self.cfg, seq_sum_mean, metrics)
