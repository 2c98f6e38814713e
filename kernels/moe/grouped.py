"""Grouped routed experts: sort the (token, slot) pairs by expert, run all experts at once, scatter the outputs
back with the router weights. The number of kernel launches no longer grows with the number of experts,
which is what made decoding slow (bench/rollout.py measures both paths).

Three ways to run the sorted pairs, chosen per call from the expert counts (`strategy`):
- padded: the pairs are placed in an [E, C, d] buffer (C = the largest expert count) and the whole expert
  MLP runs on it as three batched matmuls (`bmm`) and one activation — the fewest operations, so the
  fastest when the buffer is small or nearly full (decoding, balanced routing); exact in any dtype.
  Padding rows are zeros and are never read back.
- grouped_mm: `torch.nn.functional.grouped_mm` over the sorted rows, one call per projection with the
  group offsets, no padding — for a skewed routing, where the padded buffer would be mostly empty. Used
  where PyTorch has the case: on the CPU float32/bfloat16/float16, on CUDA bfloat16, with rows whose
  byte stride is a multiple of 16 (not yet measured on a GPU here); on CUDA always, where it applies.
- loop, for a handful of rows on at most half the experts (decode at batch 1–2, top-2 of 8): the chosen experts'
  matmuls cost less than setting up the padded buffer (bench/moe_decode.py: at batch 1 the padded path took
  0.18 ms and the loop 0.13 ms; from batch 4 on the padded path is faster).
- loop: one matmul per expert (kernels/moe/naive.py `expert_loop`) once the experts have many rows each
  (over `LOOP_ROWS` on average): on the CPU the launch cost is then negligible, and MKL's plain GEMMs
  beat both batched forms (measured at 4288 tokens × top-2 over 8 experts: loop 58 ms, padded 81 ms,
  grouped_mm 77 ms, forward; so training shapes keep the speed they had).
All are differentiable; an expert with no pairs contributes nothing and gets a zero gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from k3rl.kernels.moe.naive import expert_loop
from k3rl.kernels.moe.permute import Dispatch, dispatch

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The padded buffer is used while it holds at most this many rows per sorted pair (or is tiny anyway).
PAD_WASTE = 2.0
PAD_SMALL_ROWS = 256
# Above this many sorted pairs per expert (on average) the CPU runs one plain matmul per expert.
LOOP_ROWS = 48


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


def _padded_index(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(expert [M], slot [M], capacity C) of `rows` sorted rows in groups of `counts` [E]."""
    e = counts.shape[0]
    expert = torch.repeat_interleave(torch.arange(e, device=counts.device), counts, output_size=rows)  # [M]
    slot = torch.arange(rows, device=counts.device) - (counts.cumsum(0) - counts)[expert]  # [M]
    return expert, slot, int(counts.max()) if rows else 0


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows x [M, d_in] sorted into consecutive groups of `counts` [E] rows; w [E, d_out, d_in] (nn.Linear
    layout) → [M, d_out], group e multiplied by w[e]ᵀ. grouped_mm where supported, else padded `bmm`."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[1])
    if _grouped_mm_ok(x, w):
        offsets = counts.cumsum(0).to(torch.int32)  # [E], end of each group
        return _ContiguousGrad.apply(F.grouped_mm(x.contiguous(), w.transpose(1, 2), offs=offsets))
    expert, slot, capacity = _padded_index(counts, x.shape[0])
    buf = x.new_zeros(w.shape[0], capacity, x.shape[1]).index_put((expert, slot), x)  # [E, C, d_in]
    return torch.bmm(buf, w.transpose(1, 2))[expert, slot]  # [M, d_out]


def strategy(plan: Dispatch, zs: torch.Tensor, w1: torch.Tensor) -> str:
    """`padded`, `grouped_mm` or `loop` for this routing (see module docstring)."""
    e = w1.shape[0]
    # first and cheapest: a handful of rows on at most half the experts (decode at batch 1–2), module docstring
    if not zs.is_cuda and zs.shape[0] <= e and 2 * sum(c > 0 for c in plan.counts.tolist()) <= e:
        return "loop"
    mm_ok = _grouped_mm_ok(zs, w1) and _grouped_mm_ok(zs.new_empty(0, w1.shape[1]), w1.transpose(1, 2))
    if zs.is_cuda and mm_ok:
        return "grouped_mm"
    if zs.shape[0] > LOOP_ROWS * e:
        return "loop"
    if e * int(plan.counts.max()) <= max(PAD_WASTE * zs.shape[0], PAD_SMALL_ROWS) or not mm_ok:
        return "padded"
    return "grouped_mm"


def grouped_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                    w2: torch.Tensor, act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    how: str | None = None) -> torch.Tensor:
    """z [N, d], ids/weights [N, k], w1/w3 [E, I, d], w2 [E, d, I] → [N, d] in z's dtype. `how` forces a
    path (`padded`, `grouped_mm`, `loop`; None: chosen per call by `strategy`)."""
    plan = dispatch(ids, w1.shape[0])
    zs = plan.gather(z)  # [M = N·k, d]
    if zs.shape[0] == 0:
        return plan.combine(zs.new_zeros(0, w2.shape[1]), weights, z.dtype)
    how = how or strategy(plan, zs, w1)
    if how == "loop":
        y = expert_loop(zs, plan.counts, w1, w3, w2, act)
    elif how == "padded":
        expert, slot, capacity = _padded_index(plan.counts, zs.shape[0])
        buf = zs.new_zeros(w1.shape[0], capacity, zs.shape[1]).index_put((expert, slot), zs)  # [E, C, d]
        h = act(torch.bmm(buf, w1.transpose(1, 2)), torch.bmm(buf, w3.transpose(1, 2)))  # [E, C, I]
        y = torch.bmm(h, w2.transpose(1, 2))[expert, slot]  # [M, d]
    elif how == "grouped_mm":
        h = act(grouped_linear(zs, w1, plan.counts), grouped_linear(zs, w3, plan.counts))  # [M, I]
        y = grouped_linear(h, w2, plan.counts)
    else:
        raise ValueError(f"grouped_experts: how must be padded, grouped_mm or loop, got {how!r}")
    return plan.combine(y, weights, z.dtype)
