"""Chunked KDA backward, stages 1-2 in Triton: the local value gradient and the reverse state pass (§5.5).

Per 64-token chunk (one head), with Γ the chunk-local cumsum of g, Γ_C its last row, h the state entering
the chunk and h' the state leaving it (h' = e^{Γ_C} ⊙ h + Kdᵀ Vnew, Kd = K ⊙ e^{Γ_C − Γ}, q̃ = Q ⊙ e^Γ):

    dv_local = Aqkᵀ dO                                         (stage 1, all chunks in parallel)
    dVnew    = dv_local + Kd dh'                               (stage 2, sequential over chunks)
    dh       = e^{Γ_C} ⊙ dh' + q̃ᵀ dO − wᵀ dVnew                  dh of chunk c is dh' of chunk c − 1

Stage 2 runs one program per (sequence, head, V-block) that walks its sequence's chunks from last to first
with its [K, BV] slice of dh' in registers (fp32); it writes dh' of every chunk (the intra stage needs it) and
dVnew, and dh of the first chunk is dh0. Every decay it forms is e^{Γ_C − Γ_t} or e^{Γ_t} (exponent ≤ 0);
rows past a sequence's end get exponent 0 and zero inputs, so no inf ever meets a 0.

Also here: what the backward's stages share (the chunk bounds of plain and packed batches, block sizes, the dot
operand precision). Loads and dots are written inline, not in jit helpers: the interpreter pays ~10 ms per
nested jit call. Dot operands are bf16 when the inputs are bf16 on a GPU (fp32 accumulation, fla's choice),
else fp32 with IEEE products (no TF32): Triton 3.9's interpreter computes bf16 `tl.dot` wrongly (it
multiplies the raw bit patterns), so CPU runs always take fp32 operands.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

CHUNK = 64
SUB_CHUNK = 16
# Largest V-block a program owns; module-level so a test can shrink it to exercise V tiling.
BV_MAX = 64
BV_STATE_MAX = 32
# Launch of the state pass, w/y and intra kernels (bwd stages 2-4). Compiled for sm_90 (bench/compile_sm90.py,
# bf16, K = V = 128) Triton's default 4 warps / 3 stages spilled 100-1000 B per thread in all three and gave the
# state pass 233 KB of shared memory (over the 227 KB a block may have); 8 warps without pipelining: no
# spills in the state pass and intra kernels, 40-68 B in w/y, at most 32 KB shared. The interpreter ignores both.
LAUNCH = dict(num_warps=8, num_stages=1)


def block_size(n: int, cap: int) -> int:
    """Power-of-two block ≥ 16 (tl.dot's smallest side) covering n, at most cap."""
    return min(cap, max(16, triton.next_power_of_2(n)))


def dot_args(*inputs: torch.Tensor) -> dict:
    """The kernels' dot operand dtype and precision: fp32 operands with IEEE products (no TF32) by default, for bf16
    inputs too; bf16 operands (fp32 accumulation) for bf16/fp16 inputs on a GPU only with K3RL_KDA_BWD_BF16_DOTS=1.

    Why fp32 by default: the gate's gradient is a reverse cumulative sum of terms that cancel to a small remainder,
    and bf16 operands (2^-9 relative) lose it. On an H200 (bench/README.md, "One GPU check"), with decays near the
    lower bound or −30 next to −0.01 nats, bf16 operands gave df and dA_log relative errors of 3.6 and 18, while
    the same kernels on fp32 operands passed at 1e-3 (tests/kernels/test_cuda_parity.py). The fp32 form is also the
    only one the interpreter runs right, so it is the form the CPU suite tests. Its speed on a GPU against the bf16
    form is not measured yet."""
    fast = os.environ.get("K3RL_KDA_BWD_BF16_DOTS") == "1"
    if fast and any(x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) for x in inputs):
        return dict(DT=tl.bfloat16, PREC="tf32")
    return dict(DT=tl.float32, PREC="ieee")


@triton.jit
def _chunk_bounds(i_t, i_b, chunk_indices, cu_seqlens, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first token of the chunk's sequence in the flat [B·T] token axis, the chunk's start inside it, its number
    of real tokens, its state slot in h [B·NT]) for grid chunk i_t of batch row i_b."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        slot = i_t.to(tl.int64)
    else:
        i_c = i_t.to(tl.int64)
        bos = i_b.to(tl.int64) * T
        T_n = T
        slot = i_b.to(tl.int64) * NT + i_t
    t0 = i_c * BT
    return bos, t0, tl.minimum(T_n - t0, BT), slot


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_bwd_dv_local_kernel(
    Aqk, do, dv_local, chunk_indices, cu_seqlens, T, NT,
    H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """dv_local [B, T, H, V] = Aqkᵀ dO per chunk, for one (V-block, chunk, batch·head)."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos, t0, n, slot = _chunk_bounds(i_t, i_b, chunk_indices, cu_seqlens, T, NT, BT, IS_VARLEN)
    row0 = (bos + t0) * H + i_h
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < n
    m_a = m_t[:, None] & m_t[None, :] & (o_t[:, None] >= o_t[None, :])
    b_a = tl.load(Aqk + row0 * BT + o_t[:, None] * (H * BT) + o_t[None, :], mask=m_a, other=0.0)  # [BT, BT]
    o_tv = o_t[:, None] * (H * V) + o_v[None, :]
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    b_do = tl.load(do + row0 * V + o_tv, mask=m_tv, other=0.0)  # [BT, BV]
    b_dv = tl.dot(tl.trans(b_a).to(DT), b_do.to(DT), input_precision=PREC)  # [BT, BV]
    tl.store(dv_local + row0 * V + o_tv, b_dv, mask=m_tv)


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_bwd_dh_kernel(
    q, k, w, gk, do, dv_local, dht, dh, dv_new, dh0, cu_seqlens, chunk_offsets, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Reverse state pass for one (V-block, sequence·head): dh' of every chunk into dh [B, NT, H, K, V],
    dVnew into dv_new [B, T, H, V], and the gradient of the initial state into dh0 [N, H, K, V]."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        NT_n = tl.cdiv(T_n, BT)
        first = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        T_n = T
        NT_n = NT
        first = i_n.to(tl.int64) * NT

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    # this program's [BK, BV] slice of one head's [K, V] state
    o_h = o_k[:, None] * V + o_v[None, :]
    o_tk = o_t[:, None] * (H * K) + o_k[None, :]
    o_tv = o_t[:, None] * (H * V) + o_v[None, :]
    if USE_DHT:
        b_dh = tl.load(dht + i_nh.to(tl.int64) * K * V + o_h, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)

    for step in range(0, NT_n):
        i_c = NT_n - 1 - step
        tl.store(dh + ((first + i_c) * H + i_h) * K * V + o_h, b_dh, mask=m_kv)
        t0 = i_c * BT
        n = tl.minimum(T_n - t0, BT)
        row0 = (bos + t0) * H + i_h
        m_t = o_t < n
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_k = tl.load(k + row0 * K + o_tk, mask=m_tk, other=0.0).to(tl.float32)  # [BT, BK]
        b_g = tl.load(gk + row0 * K + o_tk, mask=m_tk, other=0.0).to(tl.float32)  # [BT, BK] Γ
        b_gc = tl.load(gk + (row0 + (n - 1) * H) * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK] Γ_C
        # Kd = K e^{Γ_C − Γ}: exponent ≤ 0 on real rows, 0 on the rows past the end (whose k is 0)
        b_kd = b_k * tl.exp(tl.where(m_t[:, None], b_gc[None, :] - b_g, 0.0))  # [BT, BK]
        b_dv = tl.load(dv_local + row0 * V + o_tv, mask=m_tv, other=0.0)  # [BT, BV]
        b_dv += tl.dot(b_kd.to(DT), b_dh.to(DT), input_precision=PREC)
        tl.store(dv_new + row0 * V + o_tv, b_dv, mask=m_tv)
        b_q = tl.load(q + row0 * K + o_tk, mask=m_tk, other=0.0).to(tl.float32)
        b_qt = b_q * tl.exp(tl.where(m_t[:, None], b_g, 0.0))  # [BT, BK] q̃ = Q e^Γ
        b_w = tl.load(w + row0 * K + o_tk, mask=m_tk, other=0.0)  # [BT, BK]
        b_do = tl.load(do + row0 * V + o_tv, mask=m_tv, other=0.0)  # [BT, BV]
        b_dh = b_dh * tl.exp(b_gc)[:, None]
        b_dh += tl.dot(tl.trans(b_qt).to(DT), b_do.to(DT), input_precision=PREC)
        b_dh -= tl.dot(tl.trans(b_w).to(DT), b_dv.to(DT), input_precision=PREC)

    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + o_h, b_dh, mask=m_kv)


def chunk_bwd_dv_local(Aqk, do, chunk_indices, cu_seqlens, NT_grid, NT, dots):
    """Stage 1: dv_local = Aqkᵀ dO, fp32 [B, T, H, V]."""
    B, T, H, V = do.shape
    BV = block_size(V, BV_MAX)
    dv_local = torch.empty(B, T, H, V, dtype=torch.float32, device=do.device)
    grid = (triton.cdiv(V, BV), NT_grid, B * H)
    chunk_bwd_dv_local_kernel[grid](
        Aqk, do, dv_local, chunk_indices, cu_seqlens, T, NT,
        H=H, V=V, BT=CHUNK, BV=BV, IS_VARLEN=cu_seqlens is not None, **dots,
    )
    return dv_local


def chunk_bwd_dh(q, k, w, gk, do, dv_local, dht, n_states, NT, h_shape, cu_seqlens, chunk_offsets, store_dh0, dots):
    """Stage 2, the reverse state pass: dh' per chunk [B, NT, H, K, V] fp32, dVnew [B, T, H, V] fp32, and dh0
    [N, H, K, V] fp32 (None unless store_dh0)."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    BK = block_size(K, triton.next_power_of_2(K))
    BV = block_size(V, BV_STATE_MAX)
    dh = torch.empty(h_shape, dtype=torch.float32, device=q.device)  # [B, NT, H, K, V]
    dv_new = torch.empty(B, T, H, V, dtype=torch.float32, device=q.device)
    dh0 = torch.empty(n_states, H, K, V, dtype=torch.float32, device=q.device) if store_dh0 else None
    grid = (triton.cdiv(V, BV), n_states * H)
    chunk_bwd_dh_kernel[grid](
        q, k, w, gk, do, dv_local, dht, dh, dv_new, dh0, cu_seqlens, chunk_offsets, T, NT,
        H=H, K=K, V=V, BT=CHUNK, BK=BK, BV=BV, IS_VARLEN=cu_seqlens is not None,
        USE_DHT=dht is not None, STORE_DH0=store_dh0, **dots, **LAUNCH,
    )
    return dh, dv_new, dh0
