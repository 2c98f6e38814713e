"""The routed experts' MLP on rows sorted by expert with SiTU-GLU fused into the gate/up GEMM (Triton).

    forward   h = SiTU-GLU(X·W1ᵀ, X·W3ᵀ)    one kernel, two accumulators per tile: the [M, I] gate and up
                                            pre-activations stay in registers and are never written
              Y = h·W2ᵀ                     grouped GEMM (kernels/moe/grouped_gemm.py)
    backward  dW2 = dYᵀ·h                    per expert
              dg, du                        one kernel, three accumulators per tile: it recomputes X·W1ᵀ and
                                            X·W3ᵀ and forms dh = dY·W2 in the same loop over d (all three
                                            reduce over the model width), so neither the pre-activations
                                            nor dh are ever stored; writes dg = dh·∂h/∂g, du = dh·∂h/∂u
              dX = dg·W1 + du·W3            one grouped GEMM with two operand pairs
              dW1, dW3 = dgᵀ·X, duᵀ·X        one reduction reading X once

Saved for backward: X (the sorted inputs) and h — the grouped PyTorch path keeps gate, up, h and the
activation's intermediates. Cost: the backward repeats the gate/up GEMM (2·M·I·d multiply-adds).

SiTU-GLU (docs/model_spec.md §8.3) is computed in fp32 in the epilogue whatever the storage dtype, by the
`@triton.jit` functions of kernels/situ/fused.py (`situ_glu_fwd_tl`, `situ_glu_bwd_tl`), so the fused and
the stand-alone activation share one implementation of tanh, σ and their derivatives:
    h = s(g)·l(u),  s(g) = β·tanh(g/β)·σ(g),  l(u) = β_l·tanh(u/β_l), or u when β_l is None
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3rl.kernels.moe.grouped_gemm import INTERPRET, TileMap, blocks, row_tiles, rows_matmul, tile_dot, weight_grad
from k3rl.kernels.situ.fused import situ_glu_bwd_tl, situ_glu_fwd_tl


@triton.jit
def _gate_up_fwd_kernel(x_ptr, w1_ptr, w3_ptr, h_ptr, tile_row_ptr, tile_end_ptr, tile_expert_ptr,
                        I, D, s_xm, s_xk, s_we, s_wn, s_wk, s_hm, s_hn, beta, lin_beta,
                        HAS_LIN: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[rows, cols] = SiTU-GLU(X·W1[e]ᵀ, X·W3[e]ᵀ) for one row tile of expert e and I-columns `cols`."""
    pid_t, pid_n = tl.program_id(0), tl.program_id(1)
    row0 = tl.load(tile_row_ptr + pid_t)
    row_end = tl.load(tile_end_ptr + pid_t)
    e = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < I
    k_end = tl.where(row0 < row_end, D, 0)
    g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        x = tl.load(x_ptr + rows[:, None] * s_xm + ks[None, :] * s_xk, mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BM, BK]
        w_off = e * s_we + ks[:, None] * s_wk + cols[None, :] * s_wn  # [BK, BN], W[e]ᵀ
        w_m = k_mask[:, None] & col_mask[None, :]
        g = tile_dot(x, tl.load(w1_ptr + w_off, mask=w_m, other=0.0), g, IEEE, INTERPRET)
        u = tile_dot(x, tl.load(w3_ptr + w_off, mask=w_m, other=0.0), u, IEEE, INTERPRET)
    h = situ_glu_fwd_tl(g, u, beta, lin_beta, HAS_LIN)
    tl.store(h_ptr + rows[:, None] * s_hm + cols[None, :] * s_hn, h.to(h_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _gate_up_bwd_kernel(x_ptr, dy_ptr, w1_ptr, w3_ptr, w2_ptr, dg_ptr, du_ptr,
                        tile_row_ptr, tile_end_ptr, tile_expert_ptr,
                        I, D, s_xm, s_xk, s_we, s_wn, s_wk, s_w2e, s_w2d, s_w2i, s_gm, s_gn, beta, lin_beta,
                        HAS_LIN: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """dg, du [rows, cols] from recomputed g = X·W1[e]ᵀ, u = X·W3[e]ᵀ and dh = dY·W2[e] (dY and X share
    strides: both are [M, d] contiguous)."""
    pid_t, pid_n = tl.program_id(0), tl.program_id(1)
    row0 = tl.load(tile_row_ptr + pid_t)
    row_end = tl.load(tile_end_ptr + pid_t)
    e = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < I
    k_end = tl.where(row0 < row_end, D, 0)
    g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dh = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        xy_off = rows[:, None] * s_xm + ks[None, :] * s_xk  # [BM, BK]
        xy_m = row_mask[:, None] & k_mask[None, :]
        w_off = e * s_we + ks[:, None] * s_wk + cols[None, :] * s_wn  # [BK, BN]
        w2_off = e * s_w2e + ks[:, None] * s_w2d + cols[None, :] * s_w2i  # [BK, BN], W2[e] as stored
        w_m = k_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + xy_off, mask=xy_m, other=0.0)
        g = tile_dot(x, tl.load(w1_ptr + w_off, mask=w_m, other=0.0), g, IEEE, INTERPRET)
        u = tile_dot(x, tl.load(w3_ptr + w_off, mask=w_m, other=0.0), u, IEEE, INTERPRET)
        dy = tl.load(dy_ptr + xy_off, mask=xy_m, other=0.0)
        dh = tile_dot(dy, tl.load(w2_ptr + w2_off, mask=w_m, other=0.0), dh, IEEE, INTERPRET)
    dg, du = situ_glu_bwd_tl(g, u, dh, beta, lin_beta, HAS_LIN)
    out_off = rows[:, None] * s_gm + cols[None, :] * s_gn
    out_m = row_mask[:, None] & col_mask[None, :]
    tl.store(dg_ptr + out_off, dg.to(dg_ptr.dtype.element_ty), mask=out_m)
    tl.store(du_ptr + out_off, du.to(du_ptr.dtype.element_ty), mask=out_m)


def gate_up_situ(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, tiles: TileMap, beta: float,
                 linear_beta: float | None) -> torch.Tensor:
    """Sorted rows x [M, d], w1/w3 [E, I, d] → h = SiTU-GLU(x·w1[e]ᵀ, x·w3[e]ᵀ) [M, I] in x's dtype."""
    (m, d), inter = x.shape, w1.shape[1]
    h = torch.empty(m, inter, dtype=x.dtype, device=x.device)  # [M, I]
    if m == 0:
        return h
    bl = blocks(m, w1.shape[0], x.dtype, accumulators=2)
    grid = (tiles.row.shape[0], triton.cdiv(inter, bl.n))
    _gate_up_fwd_kernel[grid](x, w1, w3, h, tiles.row, tiles.end, tiles.expert, inter, d,
                              x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2),
                              h.stride(0), h.stride(1), float(beta), float(linear_beta or 1.0),
                              HAS_LIN=linear_beta is not None, IEEE=x.dtype == torch.float32, INTERPRET=INTERPRET,
                              BLOCK_M=tiles.block_m, BLOCK_N=bl.n, BLOCK_K=bl.k, num_warps=bl.warps,
                              num_stages=bl.stages)
    return h


def gate_up_situ_grads(x: torch.Tensor, dy: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                       tiles: TileMap, beta: float, linear_beta: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) [M, I] in x's dtype: the gradients at the gate and up pre-activations for dY = dy [M, d]."""
    (m, d), inter = x.shape, w1.shape[1]
    dg = torch.empty(m, inter, dtype=x.dtype, device=x.device)  # [M, I]
    du = torch.empty(m, inter, dtype=x.dtype, device=x.device)  # [M, I]
    if m == 0:
        return dg, du
    bl = blocks(m, w1.shape[0], x.dtype, accumulators=3)
    grid = (tiles.row.shape[0], triton.cdiv(inter, bl.n))
    _gate_up_bwd_kernel[grid](x, dy, w1, w3, w2, dg, du, tiles.row, tiles.end, tiles.expert, inter, d,
                              x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2),
                              w2.stride(0), w2.stride(1), w2.stride(2), dg.stride(0), dg.stride(1),
                              float(beta), float(linear_beta or 1.0), HAS_LIN=linear_beta is not None,
                              IEEE=x.dtype == torch.float32, INTERPRET=INTERPRET,
                              BLOCK_M=tiles.block_m, BLOCK_N=bl.n, BLOCK_K=bl.k, num_warps=bl.warps,
                              num_stages=bl.stages)
    return dg, du


class ExpertMLPSitu(torch.autograd.Function):
    """Y [M, d] = (SiTU-GLU(x·w1[e]ᵀ, x·w3[e]ᵀ))·w2[e]ᵀ per group of sorted rows; see the module docstring."""

    @staticmethod
    def forward(ctx, x, w1, w3, w2, counts, beta, linear_beta):
        x, w1, w3, w2 = (t.contiguous() for t in (x, w1, w3, w2))
        tiles = row_tiles(counts, x.shape[0], x.dtype)
        h = gate_up_situ(x, w1, w3, tiles, beta, linear_beta)  # [M, I]
        ctx.save_for_backward(x, h, w1, w3, w2)
        ctx.tiles, ctx.beta, ctx.linear_beta = tiles, beta, linear_beta
        return rows_matmul(h, w2, tiles, b_transposed=True)  # [M, d]

    @staticmethod
    def backward(ctx, dy):
        x, h, w1, w3, w2 = ctx.saved_tensors
        dy = dy.contiguous()
        need_x, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:4]
        dx = dw1 = dw3 = dw2 = None
        if need_w2:
            dw2 = weight_grad(dy, h, ctx.tiles, w2.dtype)[0]  # [E, d, I]
        if need_x or need_w1 or need_w3:
            dg, du = gate_up_situ_grads(x, dy, w1, w3, w2, ctx.tiles, ctx.beta, ctx.linear_beta)  # [M, I] each
            if need_x:
                dx = rows_matmul(dg, w1, ctx.tiles, b_transposed=False, a2=du, b2=w3)  # [M, d]
            if need_w1 or need_w3:
                dw1, dw3 = weight_grad(dg, x, ctx.tiles, w1.dtype, a2=du)  # [E, I, d] each
        return dx, dw1, dw3, dw2, None, None, None


def expert_mlp_situ(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                    beta: float, linear_beta: float | None) -> torch.Tensor:
    """Sorted rows x [M, d] in groups of `counts` [E], w1/w3 [E, I, d], w2 [E, d, I] (all one dtype) → the
    expert outputs [M, d]; differentiable in x, w1, w3, w2."""
    return ExpertMLPSitu.apply(x, w1, w3, w2, counts, beta, linear_beta)
