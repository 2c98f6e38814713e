"""Grouped routed experts: sort the (token, slot) pairs by expert, then each projection is one grouped matmul
over all experts (`grouped_linear`), the activation runs once on all pairs, and the outputs are scattered
back with the router weights. The number of kernel launches no longer grows with the number of experts,
which is what made decoding slow (bench/rollout.py measures both).

`grouped_linear` uses `torch.nn.functional.grouped_mm` (one kernel for all groups, offsets on the device,
no host sync) where PyTorch supports the case — on the CPU float32/bfloat16/float16, on CUDA bfloat16,
with rows whose byte stride is a multiple of 16 (not yet measured on a GPU here) — and otherwise a padded batched matmul: the pairs are placed in an [E, C, d] buffer,
C = the largest expert count, and multiplied by the stacked weights with one `bmm` (exact in float64,
any width). Both are differentiable; an expert with no pairs contributes nothing and gets a zero gradient.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kernels.moe.permute import dispatch

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm") or x.dtype not in _GROUPED_MM_DTYPES or w.dtype != x.dtype:
        return False
    if x.is_cuda and x.dtype != torch.bfloat16:  # the CUDA kernel is bf16 (Hopper and later)
        return False
    size = x.element_size()
    return (x.shape[1] * size) % 16 == 0 and (w.shape[1] * size) % 16 == 0


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward on the CPU
    rejects expanded gradients such as that of `.sum()`)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows x [M, d_in] sorted into consecutive groups of `counts` [E] rows; w [E, d_out, d_in] (nn.Linear
    layout) → [M, d_out], group e multiplied by w[e]ᵀ."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[1])
    if _grouped_mm_ok(x, w):
        offsets = counts.cumsum(0).to(torch.int32)  # [E], end of each group
        return _ContiguousGrad.apply(F.grouped_mm(x.contiguous(), w.transpose(1, 2), offs=offsets))
    e = w.shape[0]
    expert = torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=x.shape[0])  # [M]
    starts = counts.cumsum(0) - counts  # [E]
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert]  # [M], row within its group
    capacity = int(counts.max())
    buf = x.new_zeros(e, capacity, x.shape[1]).index_put((expert, slot), x)  # [E, C, d_in]
    return torch.bmm(buf, w.transpose(1, 2))[expert, slot]  # [M, d_out]


def grouped_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                    w2: torch.Tensor, act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """z [N, d], ids/weights [N, k], w1/w3 [E, I, d], w2 [E, d, I] → [N, d] in z's dtype."""
    plan = dispatch(ids, w1.shape[0])
    zs = plan.gather(z)  # [N·k, d]
    h = act(grouped_linear(zs, w1, plan.counts), grouped_linear(zs, w3, plan.counts))  # [N·k, I]
    return plan.combine(grouped_linear(h, w2, plan.counts), weights, z.dtype)
