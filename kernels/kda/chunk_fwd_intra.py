"""Chunked KDA forward, the chunk-parallel stages (docs/model_spec.md §5.5, §5.7) in Triton.

Every kernel here runs one program per (64-token chunk, batch·head), grid (NT, B·H) (with cu_seqlens: (NT over
all sequences, H)), and writes tensors of kernels/kda/naive.py `ChunkIntermediates` in its layout (fp32,
[B, T, H, ·] token-major, Aqk/Ainv rows of 64 columns indexed inside the row's chunk):

1. `chunk_cumsum_gate`: Γ = chunk-local inclusive cumsum of g; with a fused gate g is first computed from
   the raw input f (z = f + dt_bias, a = e^{A_log}: −a·softplus(z) with threshold 20, or lb·σ(a·z)).
2. `chunk_intra`: Aqk[t, j] = Σ_c q_t k_j e^{Γ_t − Γ_j} (j ≤ t) and L = Diag(β)·Akk (j < t) on 16×16 tiles,
   then Ainv = (I + L)⁻¹ in the same program (forward substitution on the four diagonal tiles, a tile at a
   time by tl.dot, see `_inv_unit_lower`; block products for the six below them), so Akk never goes to memory.
3. `recompute_w_u`: w = Ainv (β ⊙ K ⊙ e^Γ), u = Ainv (β ⊙ V).

Numerics: e^{−Γ} is never formed over a chunk (Γ reaches −320 nats with the bound −5, any value without it).
Off-diagonal tiles (row sub-chunk i, column sub-chunk m < i) are factored through Γ_s, s = 16·i − 1 the
last token before the row sub-chunk: (q_t e^{Γ_t − Γ_s}) · (k_j e^{Γ_s − Γ_j}), both factors ≤ 1 for any gate.
Diagonal tiles take one of two paths, picked by the constexpr SAFE_GATE (vLLM's name: the gate is "safe"
when its lower bound is set):
  SAFE_GATE=True  one tl.dot per tile, factored through the tile's midpoint n = min(16·i + 8, last row):
                  |Γ_t − Γ_n| ≤ 8·|lb| ≤ 40 nats, so e^{±(Γ_t − Γ_n)} stays finite in fp32 (§5.7);
  SAFE_GATE=False the token-pair path: each row t forms e^{Γ_t − Γ_j} for j ≤ t directly; the exponent is
                  replaced by 0 with tl.where before exp wherever the pair is masked, so no inf/NaN is
                  formed even in lanes that are discarded.
Every exponent of a row past the sequence's end is likewise set to 0 before exp: those rows load q = k = 0
and Γ = 0, and an inf there would turn into NaN in a tl.dot (0·inf) and reach the valid rows.

Dot precision (constexpr DOT_PRECISION): "ieee" for fp32 inputs (the caller asked for fp32), "tf32" for
bf16/fp16 inputs (the inputs already carry 8-11 bits). Triton's interpreter ignores it (numpy matmul),
so only the ieee behaviour is what the CPU tests see.

Departs from fla/vLLM: natural-log gates with tl.exp (not log2 with exp2), the solve fused into the intra
kernel for both gate forms (vLLM fuses it only on the safe-gate path), fp32 Aqk/Ainv outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3rl.kernels.kda.utils import chunk_indices as make_chunk_indices

CHUNK = 64
SUB = 16
# a constexpr global: plain globals are refused by the GPU compiler (the interpreter accepts them)
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


# Launch options of the tile kernels, from sm_90 compiles of K = V = 128 (`triton.compile` for
# GPUTarget("cuda", 90, 32) with cuobjdump --dump-resource-usage; no GPU was run): 8 warps and no software
# pipelining keep the intra, w/u, state and output kernels within 255 registers without spilling for bf16
# inputs (4 warps or 3 stages spill 0.1-2 KB per thread); fp32 inputs (ieee dots) still spill a little in
# the output kernel. The interpreter ignores both.
LAUNCH = dict(num_warps=8, num_stages=1)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision for fp32 intermediates, by the dtype of the op's inputs (module docstring)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def block_size(n: int, cap: int) -> int:
    """Power-of-two tile width ≥ 16 (tl.dot's minimum) covering n, at most cap; the rest is masked."""
    return max(16, min(cap, triton.next_power_of_2(n)))


def chunk_grid(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_indices=None):
    """(chunk_indices int32 [NT, 2] or None, chunk offsets int32 [N + 1] or None, NT, N).

    NT is the number of chunk programs along grid axis 0 (per batch row without cu_seqlens, over all
    sequences with it), N the number of sequences (states)."""
    if cu_seqlens is None:
        return None, None, triton.cdiv(T, CHUNK), B
    if chunk_indices is None:
        chunk_indices = make_chunk_indices(cu_seqlens, CHUNK)
    indices, offsets = chunk_indices
    return indices, offsets, indices.shape[0], cu_seqlens.numel() - 1


@triton.jit
def _chunk_span(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN: tl.constexpr, BT: tl.constexpr):
    """(first token of chunk i_t as a flat index into [B·T], number of valid rows NV ≤ BT)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        i_c = i_t.to(tl.int64)
        bos = i_b.to(tl.int64) * T
        eos = bos + T
    tok0 = bos + i_c * BT
    return tok0, tl.minimum(eos - tok0, BT).to(tl.int32)


@triton.jit
def _load_rows(ptr, tok0, rows, rmask, cols, cmask, i_h, H: tl.constexpr, D: tl.constexpr):
    """x[tok0 + rows, i_h, cols] of a [B·T, H, D] tensor as fp32, 0 where masked."""
    p = ptr + (tok0 + rows[:, None]) * (H * D) + i_h * D + cols[None, :]
    return tl.load(p, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def chunk_cumsum_gate_kernel(
    g, gk, A_log, dt_bias, cu_seqlens, chunk_indices, T, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    tok0, NV = _chunk_span(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN, BT)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BK)
    rmask, cmask = rows < NV, cols < K
    x = _load_rows(g, tok0, rows, rmask, cols, cmask, i_h, H, K)  # [BT, BK]
    if HAS_GATE:
        if HAS_BIAS:
            x += tl.load(dt_bias + i_h * K + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if USE_LOWER_BOUND:
            x = lower_bound * tl.sigmoid(a * x)
        else:
            # softplus(z) = log1p(e^z) (identity above the threshold); log1p(y) as log(1+y)·y/((1+y)−1),
            # exact to rounding for small y where log(1 + y) alone loses the digits of y
            y = tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))
            u = 1.0 + y
            log1p = tl.where(u == 1.0, y, tl.log(u) * y / tl.where(u == 1.0, 1.0, u - 1.0))
            x = -a * tl.where(x > SOFTPLUS_THRESHOLD, x, log1p)
        x = tl.where(rmask[:, None] & cmask[None, :], x, 0.0)
    gc = tl.cumsum(x, axis=0)  # [BT, BK] Γ, chunk-local
    p = gk + (tok0 + rows[:, None]) * (H * K) + i_h * K + cols[None, :]
    tl.store(p, gc, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _offdiag_tile(
    q, k, gk, tok0, NV, i_h, H: tl.constexpr, K: tl.constexpr, I: tl.constexpr, M: tl.constexpr,
    BK: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Tile (row sub-chunk I, column sub-chunk M < I) of Aqk and of Akk (before β), factored through Γ_s,
    s = I·BC − 1: both factors are ≤ 1 whatever the gate."""
    rows = I * BC + tl.arange(0, BC)
    colsj = M * BC + tl.arange(0, BC)
    s = I * BC - 1
    # a tile whose rows all lie past the end loads Γ_s = 0: its columns are masked too, so e^{−Γ_j} is never formed
    rmask, jmask = rows < NV, (colsj < NV) & (colsj * 0 + s < NV)
    aqk = tl.zeros([BC, BC], dtype=tl.float32)
    akk = tl.zeros([BC, BC], dtype=tl.float32)
    # loads are written out (no helper calls): each nested jit call costs milliseconds in the interpreter
    for i_k in range((K + BK - 1) // BK):
        c = i_k * BK + tl.arange(0, BK)
        cm = c < K
        o_r = (tok0 + rows[:, None]) * (H * K) + i_h * K + c[None, :]  # [BC, BK]
        o_j = (tok0 + colsj[:, None]) * (H * K) + i_h * K + c[None, :]
        m_r, m_j = rmask[:, None] & cm[None, :], jmask[:, None] & cm[None, :]
        g_s = tl.load(gk + (tok0 + s) * (H * K) + i_h * K + c, mask=cm & (c * 0 + s < NV), other=0.0)  # [BK]
        q_r = tl.load(q + o_r, mask=m_r, other=0.0).to(tl.float32)  # [BC, BK]
        k_r = tl.load(k + o_r, mask=m_r, other=0.0).to(tl.float32)
        g_r = tl.load(gk + o_r, mask=m_r, other=0.0)
        k_j = tl.load(k + o_j, mask=m_j, other=0.0).to(tl.float32)
        g_j = tl.load(gk + o_j, mask=m_j, other=0.0)
        e_r = tl.exp(tl.where(rmask[:, None], g_r - g_s[None, :], 0.0))  # e^{Γ_t − Γ_s} ≤ 1
        k_col = k_j * tl.exp(tl.where(jmask[:, None], g_s[None, :] - g_j, 0.0))  # k_j e^{Γ_s − Γ_j} ≤ k_j
        aqk += tl.dot(q_r * e_r, tl.trans(k_col), input_precision=DOT_PRECISION)
        akk += tl.dot(k_r * e_r, tl.trans(k_col), input_precision=DOT_PRECISION)
    return aqk, akk


@triton.jit
def _diag_tile(
    q, k, gk, tok0, NV, i_h, H: tl.constexpr, K: tl.constexpr, I: tl.constexpr,
    BK: tl.constexpr, BKP: tl.constexpr, BC: tl.constexpr, SAFE_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Diagonal tile I of Aqk (j ≤ t) and Akk (j < t, before β): midpoint matmul or token pairs."""
    rows = I * BC + tl.arange(0, BC)
    rmask = rows < NV
    aqk = tl.zeros([BC, BC], dtype=tl.float32)
    akk = tl.zeros([BC, BC], dtype=tl.float32)
    if SAFE_GATE:
        n = tl.minimum(I * BC + BC // 2, NV - 1)
        for i_k in range((K + BK - 1) // BK):
            c = i_k * BK + tl.arange(0, BK)
            cm = c < K
            o_r = (tok0 + rows[:, None]) * (H * K) + i_h * K + c[None, :]  # [BC, BK]
            m_r = rmask[:, None] & cm[None, :]
            g_n = tl.load(gk + (tok0 + n) * (H * K) + i_h * K + c, mask=cm & (c * 0 + n >= 0), other=0.0)  # [BK]
            q_r = tl.load(q + o_r, mask=m_r, other=0.0).to(tl.float32)  # [BC, BK]
            k_r = tl.load(k + o_r, mask=m_r, other=0.0).to(tl.float32)
            g_r = tl.load(gk + o_r, mask=m_r, other=0.0)
            # |Γ_t − Γ_n| ≤ 8·|lb| ≤ 40 nats: e^{±x} < 2.4e17, finite in fp32 (and in tf32/bf16 range)
            x = tl.where(rmask[:, None], g_r - g_n[None, :], 0.0)
            k_col = k_r * tl.exp(-x)
            e_r = tl.exp(x)
            aqk += tl.dot(q_r * e_r, tl.trans(k_col), input_precision=DOT_PRECISION)
            akk += tl.dot(k_r * e_r, tl.trans(k_col), input_precision=DOT_PRECISION)
    else:
        # [t, j, c] pairs of the tile, BKP channels at a time; j ≤ t < NV, exponent zeroed elsewhere before exp
        pair = (rows[:, None] >= rows[None, :]) & (rows[:, None] < NV)  # [BC, BC]
        for i_k in range((K + BKP - 1) // BKP):
            c = i_k * BKP + tl.arange(0, BKP)
            o_r = (tok0 + rows[:, None]) * (H * K) + i_h * K + c[None, :]  # [BC, BKP]
            m_r = rmask[:, None] & (c < K)[None, :]
            q_r = tl.load(q + o_r, mask=m_r, other=0.0).to(tl.float32)
            k_r = tl.load(k + o_r, mask=m_r, other=0.0).to(tl.float32)
            g_r = tl.load(gk + o_r, mask=m_r, other=0.0)
            d = tl.where(pair[:, :, None], g_r[:, None, :] - g_r[None, :, :], 0.0)  # [BC, BC, BKP] Γ_t − Γ_j ≤ 0
            kd = tl.where(pair[:, :, None], k_r[None, :, :] * tl.exp(d), 0.0)  # k_j e^{Γ_t − Γ_j}
            aqk += tl.sum(q_r[:, None, :] * kd, axis=2)
            akk += tl.sum(k_r[:, None, :] * kd, axis=2)
    lower = (rows[:, None] >= rows[None, :]) & rmask[:, None] & rmask[None, :]
    strict = (rows[:, None] > rows[None, :]) & rmask[:, None] & rmask[None, :]
    return tl.where(lower, aqk, 0.0), tl.where(strict, akk, 0.0)


@triton.jit
def _inv_unit_lower(L, BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(I + L)⁻¹ of a strictly lower BC×BC tile: X ← I − L·X, BC − 1 times from X = I.

    This is forward substitution (X[r] = e_r − Σ_{m<r} L[r, m] X[m]) done a whole tile at a time: row r of
    L·X reads only rows m < r (L is strictly lower), so row r is final after r steps and later steps
    recompute it from the same final rows. One tl.dot per step instead of a row extraction and reduction
    (two tl.sum, which also cost milliseconds each under the interpreter)."""
    r_idx = tl.arange(0, BC)
    eye = (r_idx[:, None] == r_idx[None, :]).to(tl.float32)
    X = eye
    for _ in range(BC - 1):
        X = eye - tl.dot(L, X, input_precision=DOT_PRECISION)
    return X


@triton.jit
def chunk_intra_kernel(
    q, k, gk, beta, Aqk, Ainv, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKP: tl.constexpr,
    SAFE_GATE: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    tok0, NV = _chunk_span(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN, BT)
    r_idx = tl.arange(0, BC)
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    # offsets of tile (I, 0) in the [B·T, H, 64] outputs, rows past the end masked; tile (I, M) is + M·BC
    o0 = (tok0 + r_idx[:, None]) * (H * BT) + i_h * BT + r_idx[None, :]
    o1, o2, o3 = o0 + BC * H * BT, o0 + 2 * BC * H * BT, o0 + 3 * BC * H * BT
    m0, m1 = (r_idx < NV)[:, None], (BC + r_idx < NV)[:, None]
    m2, m3 = (2 * BC + r_idx < NV)[:, None], (3 * BC + r_idx < NV)[:, None]
    p: tl.constexpr = DOT_PRECISION

    # row sub-chunk 0
    q00, k00 = _diag_tile(q, k, gk, tok0, NV, i_h, H, K, 0, BK, BKP, BC, SAFE_GATE, p)
    b0 = tl.load(beta + (tok0 + r_idx) * H + i_h, mask=r_idx < NV, other=0.0).to(tl.float32)
    L00 = k00 * b0[:, None]
    tl.store(Aqk + o0, q00, mask=m0)
    tl.store(Aqk + o0 + BC, zero, mask=m0)
    tl.store(Aqk + o0 + 2 * BC, zero, mask=m0)
    tl.store(Aqk + o0 + 3 * BC, zero, mask=m0)
    # row sub-chunk 1
    q10, k10 = _offdiag_tile(q, k, gk, tok0, NV, i_h, H, K, 1, 0, BK, BC, p)
    q11, k11 = _diag_tile(q, k, gk, tok0, NV, i_h, H, K, 1, BK, BKP, BC, SAFE_GATE, p)
    b1 = tl.load(beta + (tok0 + BC + r_idx) * H + i_h, mask=BC + r_idx < NV, other=0.0).to(tl.float32)
    L10, L11 = k10 * b1[:, None], k11 * b1[:, None]
    tl.store(Aqk + o1, q10, mask=m1)
    tl.store(Aqk + o1 + BC, q11, mask=m1)
    tl.store(Aqk + o1 + 2 * BC, zero, mask=m1)
    tl.store(Aqk + o1 + 3 * BC, zero, mask=m1)
    # row sub-chunk 2
    q20, k20 = _offdiag_tile(q, k, gk, tok0, NV, i_h, H, K, 2, 0, BK, BC, p)
    q21, k21 = _offdiag_tile(q, k, gk, tok0, NV, i_h, H, K, 2, 1, BK, BC, p)
    q22, k22 = _diag_tile(q, k, gk, tok0, NV, i_h, H, K, 2, BK, BKP, BC, SAFE_GATE, p)
    b2 = tl.load(beta + (tok0 + 2 * BC + r_idx) * H + i_h, mask=2 * BC + r_idx < NV, other=0.0).to(tl.float32)
    L20, L21, L22 = k20 * b2[:, None], k21 * b2[:, None], k22 * b2[:, None]
    tl.store(Aqk + o2, q20, mask=m2)
    tl.store(Aqk + o2 + BC, q21, mask=m2)
    tl.store(Aqk + o2 + 2 * BC, q22, mask=m2)
    tl.store(Aqk + o2 + 3 * BC, zero, mask=m2)
    # row sub-chunk 3
    q30, k30 = _offdiag_tile(q, k, gk, tok0, NV, i_h, H, K, 3, 0, BK, BC, p)
    q31, k31 = _offdiag_tile(q, k, gk, tok0, NV, i_h, H, K, 3, 1, BK, BC, p)
    q32, k32 = _offdiag_tile(q, k, gk, tok0, NV, i_h, H, K, 3, 2, BK, BC, p)
    q33, k33 = _diag_tile(q, k, gk, tok0, NV, i_h, H, K, 3, BK, BKP, BC, SAFE_GATE, p)
    b3 = tl.load(beta + (tok0 + 3 * BC + r_idx) * H + i_h, mask=3 * BC + r_idx < NV, other=0.0).to(tl.float32)
    L30, L31, L32, L33 = k30 * b3[:, None], k31 * b3[:, None], k32 * b3[:, None], k33 * b3[:, None]
    tl.store(Aqk + o3, q30, mask=m3)
    tl.store(Aqk + o3 + BC, q31, mask=m3)
    tl.store(Aqk + o3 + 2 * BC, q32, mask=m3)
    tl.store(Aqk + o3 + 3 * BC, q33, mask=m3)

    # (I + L)⁻¹, block lower: X_ii = (I + L_ii)⁻¹, X_ij = −X_ii Σ_{m=j}^{i−1} L_im X_mj
    X00 = _inv_unit_lower(L00, BC, p)
    X11 = _inv_unit_lower(L11, BC, p)
    X22 = _inv_unit_lower(L22, BC, p)
    X33 = _inv_unit_lower(L33, BC, p)
    X10 = -tl.dot(X11, tl.dot(L10, X00, input_precision=p), input_precision=p)
    X21 = -tl.dot(X22, tl.dot(L21, X11, input_precision=p), input_precision=p)
    X32 = -tl.dot(X33, tl.dot(L32, X22, input_precision=p), input_precision=p)
    X20 = -tl.dot(X22, tl.dot(L20, X00, input_precision=p) + tl.dot(L21, X10, input_precision=p), input_precision=p)
    X31 = -tl.dot(X33, tl.dot(L31, X11, input_precision=p) + tl.dot(L32, X21, input_precision=p), input_precision=p)
    acc = tl.dot(L30, X00, input_precision=p) + tl.dot(L31, X10, input_precision=p)
    X30 = -tl.dot(X33, acc + tl.dot(L32, X20, input_precision=p), input_precision=p)
    tl.store(Ainv + o0, X00, mask=m0)
    tl.store(Ainv + o0 + BC, zero, mask=m0)
    tl.store(Ainv + o0 + 2 * BC, zero, mask=m0)
    tl.store(Ainv + o0 + 3 * BC, zero, mask=m0)
    tl.store(Ainv + o1, X10, mask=m1)
    tl.store(Ainv + o1 + BC, X11, mask=m1)
    tl.store(Ainv + o1 + 2 * BC, zero, mask=m1)
    tl.store(Ainv + o1 + 3 * BC, zero, mask=m1)
    tl.store(Ainv + o2, X20, mask=m2)
    tl.store(Ainv + o2 + BC, X21, mask=m2)
    tl.store(Ainv + o2 + 2 * BC, X22, mask=m2)
    tl.store(Ainv + o2 + 3 * BC, zero, mask=m2)
    tl.store(Ainv + o3, X30, mask=m3)
    tl.store(Ainv + o3 + BC, X31, mask=m3)
    tl.store(Ainv + o3 + 2 * BC, X32, mask=m3)
    tl.store(Ainv + o3 + 3 * BC, X33, mask=m3)


@triton.jit
def recompute_w_u_kernel(
    k, v, beta, gk, Ainv, w, u, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    tok0, NV = _chunk_span(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN, BT)
    rows = tl.arange(0, BT)
    rmask = rows < NV
    A = _load_rows(Ainv, tok0, rows, rmask, rows, rows < BT, i_h, H, BT)  # [BT, BT]
    b = tl.load(beta + (tok0 + rows) * H + i_h, mask=rmask, other=0.0).to(tl.float32)  # [BT]
    for i_v in range((V + BV - 1) // BV):
        c = i_v * BV + tl.arange(0, BV)
        cm = c < V
        bv = _load_rows(v, tok0, rows, rmask, c, cm, i_h, H, V) * b[:, None]  # [BT, BV]
        uu = tl.dot(A, bv, input_precision=DOT_PRECISION)
        tl.store(u + (tok0 + rows[:, None]) * (H * V) + i_h * V + c[None, :], uu, mask=rmask[:, None] & cm[None, :])
    for i_k in range((K + BK - 1) // BK):
        c = i_k * BK + tl.arange(0, BK)
        cm = c < K
        kk = _load_rows(k, tok0, rows, rmask, c, cm, i_h, H, K)
        gg = _load_rows(gk, tok0, rows, rmask, c, cm, i_h, H, K)
        bk = kk * tl.exp(gg) * b[:, None]  # [BT, BK] β k e^Γ, Γ ≤ 0
        ww = tl.dot(A, bk, input_precision=DOT_PRECISION)
        tl.store(w + (tok0 + rows[:, None]) * (H * K) + i_h * K + c[None, :], ww, mask=rmask[:, None] & cm[None, :])


def chunk_cumsum_gate(
    g: torch.Tensor,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    fused: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices=None,
) -> torch.Tensor:
    """Γ [B, T, H, K] fp32: the chunk-local inclusive cumsum of g, or (fused=True) of the gate of raw f = g
    (A_log [H], dt_bias [H·K] or None, lower_bound None for softplus or lb ∈ [−5, 0))."""
    B, T, H, K = g.shape
    indices, _, NT, _ = chunk_grid(B, T, cu_seqlens, chunk_indices)
    gk = torch.empty(B, T, H, K, dtype=torch.float32, device=g.device)  # [B, T, H, K]
    if NT == 0:
        return gk
    if fused and A_log is None:
        raise ValueError("the fused gate needs A_log")
    if K > 256:
        raise ValueError(f"chunk_cumsum_gate holds a chunk's K channels in one tile (K ≤ 256), got K={K}")
    chunk_cumsum_gate_kernel[(NT, B * H if cu_seqlens is None else H)](
        g.contiguous(), gk,
        A_log.contiguous() if fused else gk, dt_bias.contiguous() if fused and dt_bias is not None else gk,
        cu_seqlens, indices, T, float(lower_bound) if lower_bound is not None else 0.0,
        H=H, K=K, BT=CHUNK, BK=block_size(K, 256),
        HAS_GATE=fused, HAS_BIAS=fused and dt_bias is not None, USE_LOWER_BOUND=lower_bound is not None,
        IS_VARLEN=cu_seqlens is not None,
    )
    return gk


def chunk_intra(
    q: torch.Tensor,
    k: torch.Tensor,
    gk: torch.Tensor,
    beta: torch.Tensor,
    *,
    safe_gate: bool,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Aqk and Ainv = (I + Diag(β) Akk)⁻¹, both [B, T, H, 64] fp32 (row t, column = j's index in t's chunk).

    safe_gate: True when the gate has its lower bound set (|Γ_t − Γ_mid| ≤ 40 nats inside a 16-token tile):
    the diagonal tiles are one matmul each; False takes the token-pair path, exact for any gate."""
    B, T, H, K = q.shape
    indices, _, NT, _ = chunk_grid(B, T, cu_seqlens, chunk_indices)
    Aqk = torch.empty(B, T, H, CHUNK, dtype=torch.float32, device=q.device)  # [B, T, H, 64]
    Ainv = torch.empty(B, T, H, CHUNK, dtype=torch.float32, device=q.device)  # [B, T, H, 64]
    if NT == 0:
        return Aqk, Ainv
    chunk_intra_kernel[(NT, B * H if cu_seqlens is None else H)](
        q.contiguous(), k.contiguous(), gk.contiguous(), beta.contiguous(), Aqk, Ainv, cu_seqlens, indices, T,
        H=H, K=K, BT=CHUNK, BC=SUB, BK=block_size(K, 64), BKP=SUB,
        SAFE_GATE=bool(safe_gate), IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(q.dtype),
        **LAUNCH,
    )
    return Aqk, Ainv


def recompute_w_u(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    gk: torch.Tensor,
    Ainv: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w = Ainv (β ⊙ K ⊙ e^Γ) [B, T, H, K] and u = Ainv (β ⊙ V) [B, T, H, V], fp32."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    indices, _, NT, _ = chunk_grid(B, T, cu_seqlens, chunk_indices)
    w = torch.empty(B, T, H, K, dtype=torch.float32, device=k.device)  # [B, T, H, K]
    u = torch.empty(B, T, H, V, dtype=torch.float32, device=k.device)  # [B, T, H, V]
    if NT == 0:
        return w, u
    recompute_w_u_kernel[(NT, B * H if cu_seqlens is None else H)](
        k.contiguous(), v.contiguous(), beta.contiguous(), gk.contiguous(), Ainv.contiguous(), w, u,
        cu_seqlens, indices, T,
        H=H, K=K, V=V, BT=CHUNK, BK=block_size(K, 64), BV=block_size(V, 64),
        IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(k.dtype), **LAUNCH,
    )
    return w, u
