"""NLL: the supervised objective behind the same interface as the policy-gradient algorithms.

    L = −1/N Σ_t log π_θ(y_t)     over the loss-mask tokens t of the whole optimiser step (N of them)

The learner runs it like any algorithm — the same micro-batching, chunked log-probs, NaN guard,
router balancing and checkpoints — so SFT on demonstrations (loss mask = the assistant's tokens)
and next-token pretraining on documents (loss mask = every token after the first) are one objective
with different data. Rewards play no part (`uses_rewards = False`): trajectories need neither a
reward nor a `group_id`, and the advantage of every token is 1. Behaviour log-probs are ignored (a
demonstration has no sampling policy), so there is no importance weight.

Normalisation: a token mean over the global step (`num_tokens_global`), so accumulation over
micro-batches and ranks equals one big batch — the same rule as TRL's `num_items_in_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3rl.rl.algos.base import Algorithm, LossInputs


@dataclass
class NLLConfig:
    """NLL has no settings (the learner's own settings — lr, micro-batching — apply as for RL)."""


class NLL(Algorithm):
    name = "nll"
    Config = NLLConfig
    uses_rewards = False

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(rewards)

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = -inputs.logprobs.sum() / inputs.num_tokens_global
        return loss, {"loss": loss.detach(), "nll": loss.detach()}
