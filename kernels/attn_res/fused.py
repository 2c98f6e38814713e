"""Fused AttnRes mixing in Triton (docs/model_spec.md §7): sources read once forward, twice backward.

    r_i = 1/sqrt(mean(v_i²) + eps)     logit_i = r_i·(q·v_i)     α = softmax_i(logit_i)     y = Σ_i α_i v_i

Forward: one program per block of BLOCK_M tokens holds whole rows (BLOCK_D = next power of two ≥ d,
masked), walks the sources once with an online softmax (running max m, running sum l, running
weighted sum acc, all fp32) and writes y and the per-token log-sum-exp (fp32, [M]) for the
backward. The op is memory-bound (N·d reads and d writes per token, O(N·d) flops), so tiles are
sized for bandwidth, not for tensor cores: there is no matmul in it.

Backward, from the saved per-token lse, two passes over the sources of each block of tokens (the
second mostly from L2, the block's sources having just been read) and one write of each gradient:

    α_i = exp(logit_i − lse) / A,  A = Σ_i exp(logit_i − lse)    (A = 1 up to lse's rounding)
    δ = Σ_i α_i·(dy·v_i)  (= dy·y in fp32)
    dlogit_i = α_i·(dy·v_i − δ)
    dv_i = α_i·dy + dlogit_i·(r_i·q − logit_i·r_i²·v_i/d)       (d logit_i/d v_i through the RMS)
    dq = Σ_tokens Σ_i dlogit_i·r_i·v_i

Accuracy: with a peaked softmax (α_top → 1) dy·v_top − δ is a difference of two nearly equal
numbers, wrong by α_top's rounding × dy·v_top; the kernel forms it as (Σ_{i≠top} α_i·(dy·v_top − dy·v_i))
from the other sources' sums instead, which is exact in form (fp32 PyTorch autograd of the same
formula is off by 8e-3 on dq for one token and three sources; this kernel by 2e-6). δ is not
FlashAttention's rowsum(dO∘O) over the stored output either: y rounded to bf16 made the bf16
gradients 10× less accurate (3e-2 against 3e-3). dq is reduced per program into a [P, d] fp32
buffer and summed by torch (deterministic, no atomics); each of the P ≤ 512 programs walks token
blocks pid, pid+P, ….

Layout: the kernels read the sources as one stacked [N, M, d] tensor. It is built transiently in
forward and again in backward from the caller's list and never saved (the sources themselves are
saved, and they are alive in the model anyway), which costs one extra read and write of the sources
per pass; a model keeping its bank B as one preallocated [N, M, d] tensor would remove that copy.

Departures from the reference (kernels/attn_res/naive.py): float64 inputs are computed in fp32
(the entry point keeps them on the reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# one [BLOCK_M, BLOCK_D] tile: at most 8 tokens and about 1024 elements, num_warps = elements / 256
# (4 to 16), i.e. ≤ 8 fp32 per thread per tile. The backward keeps ~10 per-token vectors beside the
# tiles; ptxas (sm_90a, bf16) reports 96–144 registers and no spills at d in {64, 100, 4096}, 48
# bytes at d = 7168 (16 per thread); 32 tokens × 64 spilled 2.4 KB.
_TILE_ELEMS = 1024
_MAX_TOKENS = 8
_MAX_PROGRAMS_BWD = 512


@triton.jit
def _rms_logit(v, q, D, eps):
    # v [BLOCK_M, BLOCK_D] fp32 (zeros past d), q [BLOCK_D] fp32 → (logit [BLOCK_M], r [BLOCK_M])
    r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
    return r * tl.sum(v * q[None, :], axis=1), r


@triton.jit
def _attn_res_fwd_kernel(v_ptr, q_ptr, y_ptr, lse_ptr, n_src, M, D, stride_src, eps,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.arange(0, BLOCK_D)  # [BD]
    rmask = rows < M
    mask = rmask[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]  # [BM, BD]
    q = tl.load(q_ptr + cols, mask=cols < D, other=0.0)
    # the first source starts the online softmax: m = its logit, l = 1, acc = its values
    acc = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [BM, BD]
    m, _r = _rms_logit(acc, q, D, eps)  # [BM]
    l = tl.full([BLOCK_M], 1.0, tl.float32)
    # the source pointer advances by stride_src: 64-bit pointer arithmetic even where N·M·d ≥ 2³¹
    src_ptr = v_ptr
    for _i in range(1, n_src):
        src_ptr += stride_src
        v = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        logit, _r = _rms_logit(v, q, D, eps)
        m_new = tl.maximum(m, logit)
        scale = tl.exp(m - m_new)
        p = tl.exp(logit - m_new)
        acc = acc * scale[:, None] + p[:, None] * v
        l = l * scale + p
        m = m_new
    y = acc / l[:, None]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + rows, m + tl.log(l), mask=rmask)


@triton.jit
def _attn_res_bwd_kernel(v_ptr, q_ptr, dy_ptr, lse_ptr, dv_ptr, dq_part_ptr,
                         n_src, M, D, stride_src, eps, n_blocks,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)  # [BD]
    cmask = cols < D
    q = tl.load(q_ptr + cols, mask=cmask, other=0.0)
    dq = tl.zeros([BLOCK_D], tl.float32)
    for blk in range(pid, n_blocks, tl.num_programs(0)):
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]  # [BM, BD]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
        # pass 1, per token: α_i = exp(logit_i − lse) and gv_i = dy·v_i of every source, summed apart
        # for the source with the largest logit ("top") and the rest: A = Σα (renormalises α to
        # sum 1 exactly, removing lse's rounding) and δ = Σ α_i gv_i / A = dy·y in fp32. This
        # block's sources are re-read by pass 2 straight away, mostly from L2.
        top_logit = tl.full([BLOCK_M], float("-inf"), tl.float32)
        top_alpha = tl.zeros([BLOCK_M], tl.float32)
        top_gv = tl.zeros([BLOCK_M], tl.float32)
        top_idx = tl.zeros([BLOCK_M], tl.int32)
        rest_a = tl.zeros([BLOCK_M], tl.float32)
        rest_d = tl.zeros([BLOCK_M], tl.float32)
        src_ptr = v_ptr
        for i in range(n_src):
            v = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            logit, _r = _rms_logit(v, q, D, eps)
            alpha = tl.exp(logit - lse)
            gv = tl.sum(dy * v, axis=1)
            new_top = logit > top_logit
            rest_a += tl.where(new_top, top_alpha, alpha)
            rest_d += tl.where(new_top, top_alpha * top_gv, alpha * gv)
            top_logit = tl.where(new_top, logit, top_logit)
            top_alpha = tl.where(new_top, alpha, top_alpha)
            top_gv = tl.where(new_top, gv, top_gv)
            top_idx = tl.where(new_top, i, top_idx)
            src_ptr += stride_src
        inv_a = 1.0 / (rest_a + top_alpha)
        delta = (rest_d + top_alpha * top_gv) * inv_a
        # gv_top − δ = (rest_a·gv_top − rest_d)/A exactly: with a peaked softmax this avoids
        # gv_top − δ, two nearly equal numbers whose difference carries α_top's rounding × gv_top
        top_c = (rest_a * top_gv - rest_d) * inv_a
        # pass 2: rows past M load zeros (logit 0, gv 0, so dlogit = 0 and dq gets nothing)
        src_ptr, dsrc_ptr = v_ptr, dv_ptr
        for i in range(n_src):
            v = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            logit, r = _rms_logit(v, q, D, eps)
            alpha = tl.exp(logit - lse) * inv_a
            c = tl.where(top_idx == i, top_c, tl.sum(dy * v, axis=1) - delta)
            dlogit = alpha * c
            dv = alpha[:, None] * dy + dlogit[:, None] * (r[:, None] * q[None, :] - (logit * r * r / D)[:, None] * v)
            tl.store(dsrc_ptr + offs, dv.to(dv_ptr.dtype.element_ty), mask=mask)
            dq += tl.sum((dlogit * r)[:, None] * v, axis=0)
            src_ptr += stride_src
            dsrc_ptr += stride_src
    tl.store(dq_part_ptr + pid.to(tl.int64) * D + cols, dq, mask=cmask)


def _blocks(d: int) -> tuple[int, int, int]:
    block_d = triton.next_power_of_2(d)
    block_m = max(1, min(_MAX_TOKENS, _TILE_ELEMS // block_d))
    num_warps = min(16, max(4, block_m * block_d // 256))
    return block_m, block_d, num_warps


def _stack(sources: Sequence[torch.Tensor], d: int) -> torch.Tensor:
    return torch.stack([s.reshape(-1, d) for s in sources])  # [N, M, d], contiguous


class _AttnResMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, eps, max_programs, *sources):
        shape, d = sources[0].shape, sources[0].shape[-1]
        v = _stack(sources, d)  # [N, M, d]
        n_src, M = v.shape[0], v.shape[1]
        q = query.to(torch.float32).contiguous()  # [d]
        y = torch.empty((M, d), dtype=v.dtype, device=v.device)  # [M, d]
        lse = torch.empty(M, dtype=torch.float32, device=v.device)  # [M]
        block_m, block_d, num_warps = _blocks(d)
        if M > 0:
            _attn_res_fwd_kernel[(triton.cdiv(M, block_m),)](
                v, q, y, lse, n_src, M, d, v.stride(0), float(eps),
                BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps)
        ctx.save_for_backward(q, lse, *sources)
        ctx.eps, ctx.max_programs, ctx.query_dtype = eps, max_programs, query.dtype
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        q, lse, *sources = ctx.saved_tensors
        shape, d = sources[0].shape, sources[0].shape[-1]
        v = _stack(sources, d)  # [N, M, d]
        n_src, M = v.shape[0], v.shape[1]
        dy = dy.reshape(M, d).contiguous()  # [M, d]
        dv = torch.empty_like(v)  # [N, M, d]
        block_m, block_d, num_warps = _blocks(d)
        n_blocks = triton.cdiv(M, block_m)
        n_prog = max(1, min(n_blocks, ctx.max_programs))
        dq_part = torch.empty((n_prog, d), dtype=torch.float32, device=v.device)  # [P, d]
        if M > 0:
            _attn_res_bwd_kernel[(n_prog,)](
                v, q, dy, lse, dv, dq_part, n_src, M, d, v.stride(0), float(ctx.eps), n_blocks,
                BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps)
        else:
            dq_part.zero_()
        dq = dq_part.sum(0).to(ctx.query_dtype)  # [d]
        return (dq, None, None, *(g.view(shape) for g in dv.unbind(0)))


def attn_res_mix_triton(sources: Sequence[torch.Tensor], query: torch.Tensor, eps: float,
                        max_programs: int = _MAX_PROGRAMS_BWD) -> torch.Tensor:
    """The Triton path, differentiable in the sources and the query: N ≥ 1 sources [..., d] of one
    shape and dtype, query [d] → [..., d] in the sources' dtype. On CPU tensors it needs
    TRITON_INTERPRET=1. `max_programs` caps the backward grid (the number of dq partial rows)."""
    sources = list(sources)
    if not sources:
        raise ValueError("attn_res_mix: needs at least one source")
    shape, dtype = sources[0].shape, sources[0].dtype
    for s in sources[1:]:
        if s.shape != shape or s.dtype != dtype:
            raise ValueError(f"attn_res_mix: sources differ: {tuple(shape)} {dtype} vs {tuple(s.shape)} {s.dtype}")
    if query.shape != (shape[-1],):
        raise ValueError(f"attn_res_mix: query {tuple(query.shape)} does not match d = {shape[-1]}")
    return _AttnResMix.apply(query, eps, max_programs, *sources)
