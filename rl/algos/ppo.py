"""PPO: the token-level clipped surrogate with dual clip and asymmetric (clip-higher) bounds.

Schulman et al. 2017 (arXiv:1707.06347), Eq. 7:  L = E_t[ min(ρ_t Â_t, clip(ρ_t, 1−ε_low, 1+ε_high) Â_t) ],
with ε_high > ε_low as DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476, §3.1), and the dual
clip of Ye et al. 2020 (arXiv:1912.09729): for Â_t < 0 the objective is also bounded below by
c·Â_t (c > 1), so a token whose ratio ran away (ρ > c) under a negative advantage contributes a
constant and no gradient, instead of an unbounded one.

Advantages: there is no critic in k3rl, so Â is the sequence reward minus its group's mean
(optionally divided by the group std), broadcast to every token — not GAE.

Token normalisation: sum over loss-mask tokens ÷ loss-mask tokens in the global batch
(`num_tokens_global`): every token weighs the same whatever its sequence length, and accumulation
over micro-batches and ranks equals one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3rl.rl.algos.base import Algorithm, ClipConfig, LossInputs
from k3rl.rl.algos.common import clipped_surrogate, finish_loss, group_centered, group_normalised, log_ratio, share, token_mean


@dataclass
class PPOConfig(ClipConfig):
    eps_high: float = 0.28
    dual_clip: float = 3.0
    """c of the dual clip (> 1)."""
    scale_by_std: bool = False
    """Divide the group-centred reward by the group std (+ adv_eps), as GRPO does."""
    adv_eps: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        if self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip: must be > 1, got {self.dual_clip}")


class PPO(Algorithm):
    name = "ppo"
    Config = PPOConfig

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        if self.cfg.scale_by_std:
            return group_normalised(rewards, self.cfg.adv_eps)  # [G]
        return group_centered(rewards)  # [G]

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp(log_ratio(inputs.logprobs, inputs.old_logprobs))  # [T]
        pg, clipped = clipped_surrogate(ratio, inputs.advantages, self.cfg.eps_low, self.cfg.eps_high,
                                        dual_clip=self.cfg.dual_clip)
        dual = (inputs.advantages < 0) & (ratio > self.cfg.dual_clip)
        metrics = {"clip_frac": share(clipped, inputs.num_tokens_global, inputs),
                   "dual_clip_frac": share(dual, inputs.num_tokens_global, inputs)}
        return finish_loss(pg, inputs, self.cfg, token_mean, metrics)
