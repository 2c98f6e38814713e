"""GSPO: one importance ratio per sequence — the geometric mean of its token ratios — clipped per sequence.

Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), Eqs. 5–7:

    s_i = (π_θ(o_i) / π_old(o_i))^(1/|o_i|) = exp( 1/|o_i| Σ_t log(π_θ(o_it) / π_old(o_it)) )
    J   = 1/G Σ_i min( s_i Â_i, clip(s_i, 1−ε_low, 1+ε_high) Â_i ),   Â_i = (r_i − mean(r)) / std(r)

The paper's ranges are tiny (ε_low 3e-4, ε_high 4e-4) because s_i is a per-token geometric mean;
a clipped sequence contributes no gradient to any of its tokens. The gradient flows to every
token of a sequence through s_i (the sequence form, not the token-wise GSPO-token variant).

Token normalisation: one term per sequence (its length already divided out inside s_i), summed
and divided by the number of sequences in the global batch (`num_seqs_global`); the KL penalty,
when on, is averaged per sequence the same way. Accumulation over micro-batches and ranks equals
one big batch. Truncated IS: with `tis_level=sequence` each sequence term is multiplied by its
capped sequence IS weight; with `token`, by the mean of its tokens' capped weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3rl.rl.algos.base import Algorithm, ClipConfig, LossInputs
from k3rl.rl.algos.common import (
    clipped_surrogate,
    finish_loss,
    group_normalised,
    log_ratio,
    seq_lengths,
    seq_mean_token_mean,
    seq_sum,
    share,
)


@dataclass
class GSPOConfig(ClipConfig):
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    adv_eps: float = 1e-6


class GSPO(Algorithm):
    name = "gspo"
    Config = GSPOConfig

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return group_normalised(rewards, self.cfg.adv_eps)  # [G]

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        log_s = seq_sum(log_ratio(inputs.logprobs, inputs.old_logprobs), inputs) / seq_lengths(inputs)  # [S]
        # advantages are one value per sequence, broadcast to its tokens; take it back
        seq_adv = (seq_sum(inputs.advantages, inputs) / seq_lengths(inputs)).detach()  # [S]
        seq_pg, clipped = clipped_surrogate(torch.exp(log_s), seq_adv, self.cfg.eps_low, self.cfg.eps_high)
        # Each token carries its sequence's term; the per-sequence token mean gives it back once.
        pg = seq_pg[inputs.seq_ids]  # [T]
        metrics = {"seq_clip_frac": share(clipped, inputs.num_seqs_global, inputs)}
        return finish_loss(pg, inputs, self.cfg, seq_mean_token_mean, metrics)
