"""Triton grouped GEMM over rows sorted by expert: the building block of the routed experts' Triton path.

The rows of a routing, sorted by expert (kernels/moe/permute.py `Dispatch`), form consecutive groups of
`counts[e]` rows; expert e's weight is `w[e]` of a stack [E, d_out, d_in] in nn.Linear layout.

    forward   Y[g] = X[g] · w[e]ᵀ          (`_rows_kernel`, tiles over (rows of one expert, output columns))
    backward  dX[g] = dY[g] · w[e]         (`_rows_kernel` again, the weight read the other way round)
              dw[e] = dY[g]ᵀ · X[g]        (`_weight_grad_kernel`, one program per (expert, output tile),
                                           a reduction over that expert's rows)

Row tiles never straddle two experts and are not padded to the largest expert: `tile_map` cuts each
group into ceil(count / BLOCK_M) tiles on the host (torch ops on the counts' device, no synchronisation:
the grid is an upper bound on the tile count and the tiles past the last one have an empty row range, so
their programs run no loop iteration and store nothing). An expert with no rows owns no row tile, and its
weight gradient is written as zeros by the program that would have reduced its rows.

Both kernels take an optional second operand pair summed into the same output (`TWO`), which the fused
gate/up path uses: dX = dG·W1 + dU·W3 in one pass, and dW1, dW3 from one read of X (kernels/moe/gate_up.py).

Numerics: tiles are multiplied with `tl.dot` in the input dtype with fp32 accumulation (bf16 tensor cores
on a GPU); fp32 inputs use IEEE fp32 products, not TF32, as torch.matmul does by default. Row offsets are
computed in int64 (M·d can pass 2³¹). Departure forced by the interpreter: Triton 3.9's interpreter
multiplies bf16 tiles as their raw uint16 bits (`create_dot` calls np.matmul on the storage), so under
TRITON_INTERPRET=1 the tiles are widened to fp32 first — the same products, since a product of two bf16
values is exact in fp32.

Block sizes for a GPU (`blocks`) are chosen from the average rows per expert, not tuned (no GPU was at hand
when this was written); the interpreter uses 16×16×16 tiles to keep the CPU tests fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def tile_dot(a, b, acc, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a·b for tiles a [BM, BK], b [BK, BN] with an fp32 accumulator (see module docstring)."""
    if INTERPRET:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _rows_kernel(a_ptr, b_ptr, a2_ptr, b2_ptr, c_ptr, tile_row_ptr, tile_end_ptr, tile_expert_ptr,
                 N, K, s_am, s_ak, s_be, s_bk, s_bn, s_cm, s_cn,
                 TWO: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[rows, cols] = A[rows, :] · B_e (+ A2[rows, :] · B2_e) for one row tile of expert e."""
    pid_t, pid_n = tl.program_id(0), tl.program_id(1)
    row0 = tl.load(tile_row_ptr + pid_t)
    row_end = tl.load(tile_end_ptr + pid_t)
    e = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    # A tile past the last one has row0 == row_end: no iteration, nothing stored.
    k_end = tl.where(row0 < row_end, K, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a_off = rows[:, None] * s_am + ks[None, :] * s_ak  # [BM, BK]
        b_off = e * s_be + ks[:, None] * s_bk + cols[None, :] * s_bn  # [BK, BN]
        a_m = row_mask[:, None] & k_mask[None, :]
        b_m = k_mask[:, None] & col_mask[None, :]
        a = tl.load(a_ptr + a_off, mask=a_m, other=0.0)
        b = tl.load(b_ptr + b_off, mask=b_m, other=0.0)
        acc = tile_dot(a, b, acc, IEEE, INTERPRET)
        if TWO:
            a2 = tl.load(a2_ptr + a_off, mask=a_m, other=0.0)
            b2 = tl.load(b2_ptr + b_off, mask=b_m, other=0.0)
            acc = tile_dot(a2, b2, acc, IEEE, INTERPRET)
    c_off = rows[:, None] * s_cm + cols[None, :] * s_cn
    tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _weight_grad_kernel(a_ptr, a2_ptr, b_ptr, c_ptr, c2_ptr, group_start_ptr, group_end_ptr,
                        N, K, s_am, s_an, s_bm, s_bk, s_ce, s_cn, s_ck,
                        TWO: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[e, cols, ks] = Σ_{rows of e} A[rows, cols]ᵀ B[rows, ks] (and C2 from A2 with the same B); zeros for
    an expert without rows."""
    e = tl.program_id(0).to(tl.int64)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_n, pid_k = tl.program_id(1) % n_tiles, tl.program_id(1) // n_tiles
    start = tl.load(group_start_ptr + e)
    end = tl.load(group_end_ptr + e)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    col_mask, k_mask = cols < N, ks < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        rows = rows.to(tl.int64)
        # A read transposed, [BN, BM], so the reduction over rows is the inner dimension of the dot.
        at_off = cols[:, None] * s_an + rows[None, :] * s_am
        at_m = col_mask[:, None] & row_mask[None, :]
        b = tl.load(b_ptr + rows[:, None] * s_bm + ks[None, :] * s_bk, mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BM, BK]
        acc = tile_dot(tl.load(a_ptr + at_off, mask=at_m, other=0.0), b, acc, IEEE, INTERPRET)
        if TWO:
            acc2 = tile_dot(tl.load(a2_ptr + at_off, mask=at_m, other=0.0), b, acc2, IEEE, INTERPRET)
    c_off = e * s_ce + cols[:, None] * s_cn + ks[None, :] * s_ck
    c_m = col_mask[:, None] & k_mask[None, :]
    tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=c_m)
    if TWO:
        tl.store(c2_ptr + c_off, acc2.to(c2_ptr.dtype.element_ty), mask=c_m)


@dataclass
class Blocks:
    """Tile sizes and launch settings of one grouped GEMM call."""

    m: int
    n: int
    k: int
    warps: int = 4
    stages: int = 3


def blocks(rows: int, experts: int, dtype: torch.dtype, accumulators: int = 1) -> Blocks:
    """Tiles for `rows` sorted rows over `experts`: 16³ under the interpreter; on a GPU the row tile follows
    the average group (16 for decoding, up to 128 for training) and the column tile shrinks when a program
    holds several accumulators (fused gate/up backward: three) so they stay in registers."""
    if INTERPRET:
        return Blocks(16, 16, 16, warps=1, stages=1)
    avg = max(1, rows // max(1, experts))
    m = min(128, max(16, triton.next_power_of_2(avg)))
    n = 128 if accumulators == 1 else 64
    k = 64 if dtype != torch.float32 else 32
    return Blocks(m, n, k, warps=4 if m <= 32 else 8, stages=3)


@dataclass
class TileMap:
    """Row tiles of sorted groups: tile t covers rows [row[t], end[t]) of expert `expert[t]`; tiles past the
    last real one have row == end == 0. `start`/`stop` [E] are each group's row range."""

    row: torch.Tensor  # [T] int32
    end: torch.Tensor  # [T] int32
    expert: torch.Tensor  # [T] int32
    start: torch.Tensor  # [E] int64
    stop: torch.Tensor  # [E] int64
    block_m: int


def tile_map(counts: torch.Tensor, block_m: int, rows: int) -> TileMap:
    """counts [E] (rows per expert, summing to `rows`) → the row tiles of BLOCK_M rows, on counts' device
    without reading the counts back: T = min(ceil(rows / BLOCK_M) + E, rows) bounds the tile count (each
    group adds at most one partial tile, and every real tile holds a row)."""
    e = counts.shape[0]
    stop = counts.cumsum(0)  # [E]
    start = stop - counts  # [E]
    per_expert = (counts + block_m - 1) // block_m  # [E] tiles
    tile_stop = per_expert.cumsum(0)  # [E]
    n_tiles = max(1, min(triton.cdiv(rows, block_m) + e, rows))
    t = torch.arange(n_tiles, device=counts.device)
    expert = torch.searchsorted(tile_stop, t, right=True)  # [T], E past the last real tile
    real = expert < e
    ex = expert.clamp(max=e - 1)
    row = start[ex] + (t - (tile_stop - per_expert)[ex]) * block_m  # [T]
    row = torch.where(real, row, 0)
    end = torch.where(real, stop[ex], 0)
    return TileMap(row.to(torch.int32), end.to(torch.int32), torch.where(real, ex, 0).to(torch.int32),
                   start, stop, block_m)


def rows_matmul(a: torch.Tensor, b: torch.Tensor, tiles: TileMap, b_transposed: bool,
                a2: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted rows a [M, K] times each group's b[e] → [M, N] in a's dtype. `b_transposed`: b is [E, N, K]
    (nn.Linear layout, the forward); else b is [E, K, N] (dX = dY·w). a2/b2 (same shapes): added product."""
    m, k = a.shape
    n = b.shape[1] if b_transposed else b.shape[2]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)  # [M, N]
    if m == 0:
        return c
    two = a2 is not None
    a, b = a.contiguous(), b.contiguous()
    a2 = a2.contiguous() if two else a
    b2 = b2.contiguous() if two else b
    s_bk, s_bn = (b.stride(2), b.stride(1)) if b_transposed else (b.stride(1), b.stride(2))
    bl = blocks(m, b.shape[0], a.dtype, 2 if two else 1)
    bl.m = tiles.block_m
    grid = (tiles.row.shape[0], triton.cdiv(n, bl.n))
    _rows_kernel[grid](a, b, a2, b2, c, tiles.row, tiles.end, tiles.expert, n, k,
                       a.stride(0), a.stride(1), b.stride(0), s_bk, s_bn, c.stride(0), c.stride(1),
                       TWO=two, IEEE=a.dtype == torch.float32, INTERPRET=INTERPRET,
                       BLOCK_M=bl.m, BLOCK_N=bl.n, BLOCK_K=bl.k, num_warps=bl.warps, num_stages=bl.stages)
    return c


def weight_grad(a: torch.Tensor, b: torch.Tensor, tiles: TileMap, dtype: torch.dtype,
                a2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per expert e: a[g]ᵀ · b[g] for sorted rows a [M, N], b [M, K] → [E, N, K] in `dtype` (zeros for an
    expert without rows); with a2 [M, N] also a2[g]ᵀ · b[g]."""
    e = tiles.start.shape[0]
    (m, n), k = a.shape, b.shape[1]
    a, b = a.contiguous(), b.contiguous()
    two = a2 is not None
    a2 = a2.contiguous() if two else a
    c = torch.empty(e, n, k, dtype=dtype, device=a.device)  # [E, N, K]
    c2 = torch.empty(e, n, k, dtype=dtype, device=a.device) if two else c
    if e == 0 or n == 0 or k == 0:
        return c, (c2 if two else None)
    bl = blocks(m, e, a.dtype, 2 if two else 1)
    grid = (e, triton.cdiv(n, bl.n) * triton.cdiv(k, bl.k))
    _weight_grad_kernel[grid](a, a2, b, c, c2, tiles.start, tiles.stop, n, k,
                              a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                              c.stride(2), TWO=two, IEEE=a.dtype == torch.float32, INTERPRET=INTERPRET,
                              BLOCK_M=bl.m, BLOCK_N=bl.n, BLOCK_K=bl.k, num_warps=bl.warps, num_stages=bl.stages)
    return c, (c2 if two else None)


def row_tiles(counts: torch.Tensor, rows: int, dtype: torch.dtype, accumulators: int = 1) -> TileMap:
    """The tile map of `rows` sorted rows in groups of `counts`, with the row tile `blocks` picks."""
    return tile_map(counts, blocks(rows, counts.shape[0], dtype, accumulators).m, rows)


class GroupedLinear(torch.autograd.Function):
    """y [M, d_out] = x[g] · w[e]ᵀ per group; gradients for x and w (counts are not differentiable)."""

    @staticmethod
    def forward(ctx, x, w, counts):
        tiles = row_tiles(counts, x.shape[0], x.dtype)
        ctx.save_for_backward(x, w)
        ctx.tiles = tiles
        return rows_matmul(x, w, tiles, b_transposed=True)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = rows_matmul(dy, w, ctx.tiles, b_transposed=False) if ctx.needs_input_grad[0] else None  # [M, d_in]
        dw = weight_grad(dy, x, ctx.tiles, w.dtype)[0] if ctx.needs_input_grad[1] else None  # [E, d_out, d_in]
        return dx, dw, None


def grouped_linear_triton(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows x [M, d_in] in consecutive groups of `counts` [E] rows, w [E, d_out, d_in] (same dtype) → [M, d_out],
    group e times w[e]ᵀ; differentiable in x and w. On CPU tensors it needs TRITON_INTERPRET=1."""
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_linear_triton: x is {x.dtype} but w is {w.dtype}")
    if x.shape[1] != w.shape[2] or counts.shape[0] != w.shape[0]:
        raise ValueError(f"grouped_linear_triton: x {tuple(x.shape)}, w {tuple(w.shape)}, counts "
                         f"{tuple(counts.shape)} do not fit")
    return GroupedLinear.apply(x, w, counts)
