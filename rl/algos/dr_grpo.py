"""Dr. GRPO: GRPO without its two normalisation biases — no std in the advantage, no 1/|o_i|.

Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (arXiv:2503.20783),
§3.2: dividing by std up-weights too-easy and too-hard prompts, and dividing by the response
length |o_i| lets long wrong answers off lightly. Dr. GRPO keeps the PPO-clip token loss of GRPO
(Eq. 3 of arXiv:2402.03300) with

    Â_i = r_i − mean(r)
    J   = 1/G Σ_i 1/L Σ_t [ min(ρ_it Â_i, clip(ρ_it, 1−ε, 1+ε) Â_i) − β D_KL,it ]

where L is a constant (the generation budget `max_tokens`), as in the authors' code.

Token normalisation: sum over the micro-batch's loss-mask tokens ÷ (sequences in the global batch
× `max_tokens`). Both factors are constants of the step, so accumulation over micro-batches and
ranks equals one big batch and every token weighs the same whatever its sequence's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3rl.rl.algos.base import Algorithm, ClipConfig, LossInputs
from k3rl.rl.algos.common import clipped_surrogate, constant_token_sum, finish_loss, group_centered, log_ratio, share


@dataclass
class DrGRPOConfig(ClipConfig):
    max_tokens: int = 1024
    """L, the constant token count each sequence's sum is divided by (set it to the sampling budget)."""

    def __post_init__(self):
        super().__post_init__()
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens: must be > 0, got {self.max_tokens}")


class DrGRPO(Algorithm):
    name = "dr_grpo"
    Config = DrGRPOConfig

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return group_centered(rewards)  # [G]

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp(log_ratio(inputs.logprobs, inputs.old_logprobs))  # [T]
        pg, clipped = clipped_surrogate(ratio, inputs.advantages, self.cfg.eps_low, self.cfg.eps_high)
        metrics = {"clip_frac": share(clipped, inputs.num_tokens_global, inputs)}
        return finish_loss(pg, inputs, self.cfg, constant_token_sum(self.cfg.max_tokens), metrics)
