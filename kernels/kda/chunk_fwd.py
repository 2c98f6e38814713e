"""Chunked KDA forward (docs/model_spec.md §5.5): the inter-chunk state pass, the output, and the host
function `chunk_fwd` that runs all stages.

Stages (the first three in kernels/kda/chunk_fwd_intra.py, one program per chunk and head):
  1. `chunk_cumsum_gate`  Γ (and the fused gate)                          grid (NT, B·H)
  2. `chunk_intra`        Aqk, Ainv = (I + Diag(β) Akk)⁻¹                  grid (NT, B·H)
  3. `recompute_w_u`      w, u                                            grid (NT, B·H)
  4. `chunk_state`        h entering each chunk, v_new = u − w h, final    grid (⌈V/BV⌉, N·H), sequential over
                          the chunks of one sequence:  h ← e^{Γ_C} ⊙ h + (K ⊙ e^{Γ_C − Γ})ᵀ v_new
  5. `chunk_output`       o = (Q ⊙ e^Γ) h + Aqk v_new                     grid (⌈V/BV⌉, NT, B·H)
The backward (kernels/kda/chunk_bwd.py) recomputes stages 3-4 with the same functions instead of saving
w, u, h, v_new.

q and k arrive already L2-normalised (if asked) and q scaled: the autograd wrapper (chunk_triton.py) does
that in PyTorch. The state pass holds h as two 64-row K halves (K ≤ 128) of a BV = 16 column block, fp32;
every exponent is ≤ 0 (Γ_C − Γ_t, Γ_t), with rows past the sequence's end given exponent 0 before exp.
Launch options (8 warps, no pipelining) and block sizes were chosen from sm_90 compiles (register use and
spills, see chunk_fwd_intra.LAUNCH); nothing here has been timed on a GPU.
Varlen (`cu_seqlens`, B = 1) uses `kernels.kda.utils.chunk_indices`: chunk i of the grid is chunk c of
sequence s, state slot i, and chunks restart at every sequence start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k3rl.kernels.kda.chunk_fwd_intra import (
    CHUNK,
    LAUNCH,
    _chunk_span,
    _load_rows,
    block_size,
    chunk_cumsum_gate,
    chunk_grid,
    chunk_intra,
    dot_precision,
    recompute_w_u,
)
from k3rl.kernels.kda.naive import ChunkIntermediates
from k3rl.kernels.kda.utils import chunk_indices as make_chunk_indices

__all__ = [
    "GateSpec", "chunk_fwd", "chunk_cumsum_gate", "chunk_intra", "recompute_w_u", "chunk_state", "chunk_output",
]


@dataclass(frozen=True)
class GateSpec:
    """The fused gate's parameters: `chunk_fwd` then reads the raw gate input f in place of g (docs §5.2)."""

    A_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor | None  # [H*K] or None
    lower_bound: float | None = None  # None: −e^{A_log}·softplus(z); lb ∈ [−5, 0): lb·σ(e^{A_log}·z)


@triton.jit
def chunk_state_kernel(
    k, w, u, gk, h, v_new, h0, ht, cu_seqlens, chunk_offsets, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # the state is held as two K-halves of BK rows (the second only when K > BK; K ≤ 2·BK): one [K, BV]
    # tile and its [BT, K] operands would not fit the registers at K = 128 (they spill on sm_90)
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_seq = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        n_chunks = (T_seq + BT - 1) // BT
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        T_seq = T
        n_chunks = NT
        boh = i_n.to(tl.int64) * NT
    rows = tl.arange(0, BT)
    c1 = tl.arange(0, BK)
    c2 = BK + tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m1, m2, vm = c1 < K, c2 < K, cv < V
    # [BK, BV] offsets and masks of the two halves inside one [K, V] state
    o1, o2 = c1[:, None] * V + cv[None, :], c2[:, None] * V + cv[None, :]
    hm1, hm2 = m1[:, None] & vm[None, :], m2[:, None] & vm[None, :]
    b_h1 = tl.zeros([BK, BV], dtype=tl.float32)
    b_h2 = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h1 += tl.load(h0 + i_nh.to(tl.int64) * K * V + o1, mask=hm1, other=0.0).to(tl.float32)
        if K > BK:
            b_h2 += tl.load(h0 + i_nh.to(tl.int64) * K * V + o2, mask=hm2, other=0.0).to(tl.float32)
    for i_c in range(n_chunks):
        p_h = h + ((boh + i_c) * H + i_h) * K * V
        tl.store(p_h + o1, b_h1, mask=hm1)
        if K > BK:
            tl.store(p_h + o2, b_h2, mask=hm2)
        tok0 = bos + i_c * BT
        NV = tl.minimum(T_seq - i_c * BT, BT)
        rmask = rows < NV
        last = tok0 + NV - 1  # Γ_C is Γ at the chunk's last valid row
        r_k = (tok0 + rows[:, None]) * (H * K) + i_h * K  # [BT, 1] row offsets into [B·T, H, K]
        r_v = (tok0 + rows[:, None]) * (H * V) + i_h * V + cv[None, :]  # [BT, BV]
        b_u = tl.load(u + r_v, mask=rmask[:, None] & vm[None, :], other=0.0)
        b_w1 = tl.load(w + r_k + c1[None, :], mask=rmask[:, None] & m1[None, :], other=0.0)  # [BT, BK]
        b_v = b_u - tl.dot(b_w1, b_h1, input_precision=DOT_PRECISION)  # [BT, BV] v_new = u − w h
        if K > BK:
            b_w2 = tl.load(w + r_k + c2[None, :], mask=rmask[:, None] & m2[None, :], other=0.0)
            b_v -= tl.dot(b_w2, b_h2, input_precision=DOT_PRECISION)
        tl.store(v_new + r_v, b_v, mask=rmask[:, None] & vm[None, :])
        # h ← e^{Γ_C} ⊙ h + (K ⊙ e^{Γ_C − Γ})ᵀ v_new, both exponents ≤ 0 (rows past the end: exponent 0, k = 0)
        g_last = tl.load(gk + last * (H * K) + i_h * K + c1, mask=m1, other=0.0)  # [BK]
        b_g = tl.load(gk + r_k + c1[None, :], mask=rmask[:, None] & m1[None, :], other=0.0)
        b_k = tl.load(k + r_k + c1[None, :], mask=rmask[:, None] & m1[None, :], other=0.0).to(tl.float32)
        k_dec = b_k * tl.exp(tl.where(rmask[:, None], g_last[None, :] - b_g, 0.0))  # [BT, BK]
        b_h1 = b_h1 * tl.exp(g_last)[:, None] + tl.dot(tl.trans(k_dec), b_v, input_precision=DOT_PRECISION)
        if K > BK:
            g_last = tl.load(gk + last * (H * K) + i_h * K + c2, mask=m2, other=0.0)
            b_g = tl.load(gk + r_k + c2[None, :], mask=rmask[:, None] & m2[None, :], other=0.0)
            b_k = tl.load(k + r_k + c2[None, :], mask=rmask[:, None] & m2[None, :], other=0.0).to(tl.float32)
            k_dec = b_k * tl.exp(tl.where(rmask[:, None], g_last[None, :] - b_g, 0.0))
            b_h2 = b_h2 * tl.exp(g_last)[:, None] + tl.dot(tl.trans(k_dec), b_v, input_precision=DOT_PRECISION)
    if STORE_FINAL_STATE:
        tl.store(ht + i_nh.to(tl.int64) * K * V + o1, b_h1, mask=hm1)
        if K > BK:
            tl.store(ht + i_nh.to(tl.int64) * K * V + o2, b_h2, mask=hm2)


@triton.jit
def chunk_output_kernel(
    q, gk, h, Aqk, v_new, o, cu_seqlens, chunk_indices, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    tok0, NV = _chunk_span(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN, BT)
    if IS_VARLEN:
        slot = i_t.to(tl.int64)
    else:
        slot = i_b.to(tl.int64) * NT + i_t
    rows = tl.arange(0, BT)
    rmask = rows < NV
    cv = i_v * BV + tl.arange(0, BV)
    vm = cv < V
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range((K + BK - 1) // BK):
        ck = i_k * BK + tl.arange(0, BK)
        km = ck < K
        b_q = _load_rows(q, tok0, rows, rmask, ck, km, i_h, H, K)  # [BT, BK]
        b_g = _load_rows(gk, tok0, rows, rmask, ck, km, i_h, H, K)
        b_h = tl.load(h + (slot * H + i_h) * K * V + ck[:, None] * V + cv[None, :],
                      mask=km[:, None] & vm[None, :], other=0.0)  # [BK, BV]
        acc += tl.dot(b_q * tl.exp(b_g), b_h, input_precision=DOT_PRECISION)
    b_A = _load_rows(Aqk, tok0, rows, rmask, rows, rows < BT, i_h, H, BT)  # [BT, BT]
    b_v = _load_rows(v_new, tok0, rows, rmask, cv, vm, i_h, H, V)  # [BT, BV]
    acc += tl.dot(b_A, b_v, input_precision=DOT_PRECISION)
    tl.store(o + (tok0 + rows[:, None]) * (H * V) + i_h * V + cv[None, :], acc.to(o.dtype.element_ty),
             mask=rmask[:, None] & vm[None, :])


def chunk_state(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    gk: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices=None,
    dot_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The sequential pass: h [B, NT, H, K, V] (state entering each chunk), v_new [B, T, H, V], final state
    [B or N, H, K, V] or None; all fp32. dot_dtype: the dtype of the op's inputs, for the dot precision
    (default k's)."""
    B, T, H, K = k.shape
    V = u.shape[-1]
    _, offsets, NT, N = chunk_grid(B, T, cu_seqlens, chunk_indices)
    h = torch.empty(B, NT, H, K, V, dtype=torch.float32, device=k.device)  # [B, NT, H, K, V]
    v_new = torch.empty(B, T, H, V, dtype=torch.float32, device=k.device)  # [B, T, H, V]
    final = torch.empty(N, H, K, V, dtype=torch.float32, device=k.device) if output_final_state else None
    # BV = 16: no spills at K = 128 (LAUNCH), and V/16 programs per sequence and head fill the GPU at B·H = 16
    BK, BV = block_size(K, 64), block_size(V, 16)
    if K > 2 * BK:
        raise ValueError(f"chunk_state holds K ≤ 128 (two 64-row halves of the state), got K={K}")
    chunk_state_kernel[(triton.cdiv(V, BV), N * H)](
        k.contiguous(), w.contiguous(), u.contiguous(), gk.contiguous(), h, v_new,
        initial_state.contiguous() if initial_state is not None else None, final, cu_seqlens, offsets, T, NT,
        H=H, K=K, V=V, BT=CHUNK, BK=BK, BV=BV,
        USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=output_final_state,
        IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(dot_dtype or k.dtype), **LAUNCH,
    )
    return h, v_new, final


def chunk_output(
    q: torch.Tensor,
    gk: torch.Tensor,
    h: torch.Tensor,
    Aqk: torch.Tensor,
    v_new: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices=None,
) -> torch.Tensor:
    """o = (Q ⊙ e^Γ) h + Aqk v_new, [B, T, H, V] in out_dtype (default q's)."""
    B, T, H, K = q.shape
    V = v_new.shape[-1]
    indices, _, NT, _ = chunk_grid(B, T, cu_seqlens, chunk_indices)
    o = torch.empty(B, T, H, V, dtype=out_dtype or q.dtype, device=q.device)  # [B, T, H, V]
    if NT == 0:
        return o
    BV = block_size(V, 32)
    chunk_output_kernel[(triton.cdiv(V, BV), NT, B * H if cu_seqlens is None else H)](
        q.contiguous(), gk.contiguous(), h.contiguous(), Aqk.contiguous(), v_new.contiguous(), o,
        cu_seqlens, indices, T, NT,
        H=H, K=K, V=V, BT=CHUNK, BK=block_size(K, 64), BV=BV,
        IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(q.dtype), **LAUNCH,
    )
    return o


def chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    gate: GateSpec | None = None,
    save_for_backward: bool = True,
    chunk_indices=None,
) -> tuple[torch.Tensor, torch.Tensor | None, ChunkIntermediates | None]:
    """All forward stages. q, k [B, T, H, K] (prepared: normalised/scaled), v [B, T, H, V], beta [B, T, H],
    g [B, T, H, K] the log decay, or the raw gate input f when `gate` is given; fp32/bf16/fp16.

    Returns o [B, T, H, V] in q's dtype, the final state [B or N, H, K, V] fp32 (or None), and the
    `ChunkIntermediates` (gk, Aqk, Ainv, w, u, h, v_new; fp32), or None when save_for_backward is False
    (then they are freed on return). The diagonal tiles take the matmul path iff the gate has a lower bound."""
    B, T, H, K = q.shape
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = make_chunk_indices(cu_seqlens, CHUNK)
    grid = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    if gate is None:
        gk = chunk_cumsum_gate(g, **grid)
    else:
        gk = chunk_cumsum_gate(g, A_log=gate.A_log, dt_bias=gate.dt_bias, lower_bound=gate.lower_bound,
                               fused=True, **grid)
    safe_gate = gate is not None and gate.lower_bound is not None
    Aqk, Ainv = chunk_intra(q, k, gk, beta, safe_gate=safe_gate, **grid)
    w, u = recompute_w_u(k, v, beta, gk, Ainv, **grid)
    h, v_new, final = chunk_state(k, w, u, gk, initial_state=initial_state, output_final_state=output_final_state,
                                  **grid)
    o = chunk_output(q, gk, h, Aqk, v_new, **grid)
    inter = ChunkIntermediates(gk, Aqk, Ainv, w, u, h, v_new) if save_for_backward else None
    return o, final, inter
