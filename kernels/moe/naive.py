"""Reference routed experts: the sorted pairs of each expert through its own three matmuls, one expert at a
time in a Python loop (what model/moe.py did before the grouped path). Exact in any dtype, float64
included; slow when there are many experts and few tokens each, as in decoding."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from k3rl.kernels.moe.permute import dispatch


def expert_loop(zs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Sorted rows zs [M, d] in groups of `counts` [E] → each group through its expert's MLP, [M, d]."""
    outs, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if c:
            x = zs[start:start + c]
            outs.append(F.linear(act(F.linear(x, w1[e]), F.linear(x, w3[e])), w2[e]))
            start += c
    return torch.cat(outs) if outs else zs.new_zeros(0, w2.shape[1])


def naive_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                  w2: torch.Tensor, act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """z [N, d], ids/weights [N, k], w1/w3 [E, I, d], w2 [E, d, I] → [N, d] in z's dtype."""
    plan = dispatch(ids, w1.shape[0])
    return plan.combine(expert_loop(plan.gather(z), plan.counts, w1, w3, w2, act), weights, z.dtype)
