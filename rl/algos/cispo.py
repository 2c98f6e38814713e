"""CISPO: clip the importance-sampling weight, not the update — every token keeps its gradient.

MiniMax 2025, "MiniMax-M1" (arXiv:2506.13585), §3.1, Eqs. 4–5:

    J   = 1/Σ_i|o_i| Σ_i Σ_t sg(r̂_it) Â_it log π_θ(o_it)
    r̂_it = clip(ρ_it, 1 − ε_low, 1 + ε_high),   ρ_it = π_θ(o_it) / π_old(o_it),   sg = stop-gradient

so ∇J = Σ r̂ Â ∇log π / N: unlike PPO-clip, a token outside the trust region still contributes
(with a bounded weight) — the rare "fork" tokens that PPO's clip drops are what long reasoning
needs. As in the paper, the lower side is left open (ε_low = 1: weights never clip below 0) and
only ε_high is tuned. Â is GRPO's group-normalised reward, broadcast to the tokens.

Token normalisation: sum over loss-mask tokens ÷ loss-mask tokens in the global batch
(`num_tokens_global`), the paper's 1/Σ|o_i|; accumulation over micro-batches and ranks equals one
big batch. The loss value is −Σ r̂ Â log π / N, so only its gradient, not its level, is meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3rl.rl.algos.base import Algorithm, ClipConfig, LossInputs
from k3rl.rl.algos.common import finish_loss, group_normalised, log_ratio, share, token_mean


@dataclass
class CISPOConfig(ClipConfig):
    eps_low: float = 1.0
    eps_high: float = 0.28
    adv_eps: float = 1e-6


class CISPO(Algorithm):
    name = "cispo"
    Config = CISPOConfig

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return group_normalised(rewards, self.cfg.adv_eps)  # [G]

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp(log_ratio(inputs.logprobs, inputs.old_logprobs)).detach()  # [T]
        weight = ratio.clamp(1.0 - self.cfg.eps_low, 1.0 + self.cfg.eps_high)  # [T]
        pg = -weight * inputs.advantages * inputs.logprobs  # [T]
        metrics = {"clip_frac": share(weight != ratio, inputs.num_tokens_global, inputs)}
        return finish_loss(pg, inputs, self.cfg, token_mean, metrics)
