"""Token permutation shared by the expert implementations: sort the (token, slot) pairs by expert, and
scatter the expert outputs back to their tokens weighted by the router.

The sort is stable, so within an expert the pairs keep token order, and the result does not depend on
how many experts a batch touches; an expert no token chose has a zero count and an empty slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Dispatch:
    """The (token, slot) pairs of a routing, sorted by expert."""

    order: torch.Tensor  # [N·k] positions in ids.flatten(), sorted by expert
    token: torch.Tensor  # [N·k] the token of each sorted pair
    counts: torch.Tensor  # [E] pairs per expert (int64; zero for an expert no token chose)
    num_tokens: int

    def gather(self, z: torch.Tensor) -> torch.Tensor:
        """z [N, d] → the input of each sorted pair [N·k, d]."""
        return z[self.token]

    def combine(self, y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Expert outputs of the sorted pairs y [N·k, d] → Σ_k w·y per token [N, d], summed in at least fp32,
        returned in `dtype`."""
        acc = torch.promote_types(dtype, torch.float32)
        out = torch.zeros(self.num_tokens, y.shape[-1], dtype=acc, device=y.device)
        w = weights.flatten()[self.order, None].to(acc)  # [N·k, 1]
        return out.index_add(0, self.token, y.to(acc) * w).to(dtype)


def dispatch(ids: torch.Tensor, num_experts: int) -> Dispatch:
    """ids [N, k] int64 (each in [0, E)) → the sorted pairs of that routing."""
    n, k = ids.shape
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    return Dispatch(order=order, token=order // k, counts=torch.bincount(flat, minlength=num_experts), num_tokens=n)
