"""Chunked KDA backward, stages 3-4 in Triton: the WY-representation gradients, then the intra-chunk pair terms
and the chunk-local reverse cumsum that turns dΓ into dg (§5.5, §5.7).

Stage 3, one program per (chunk, head), with dVnew and dh' from the reverse state pass:

    dAqk = dO Vnewᵀ (j ≤ t)     dq̃ = dO hᵀ     dw = −dVnew hᵀ     dKd = Vnew dh'ᵀ
    u = Ainv (βV), w = Ainv (β Kg):   dAinv = dVnew (βV)ᵀ + dw (βKg)ᵀ
                                       d(βV) = Ainvᵀ dVnew,   d(βKg) = Ainvᵀ dw
    Ainv = (I + Diag(β) Akk)⁻¹:        dM = −Ainvᵀ dAinv Ainvᵀ (strictly lower; dAkk = Diag(β) dM)

It writes dv (final), dAqk and dM, and the partial dq, dk, dβ, dΓ of these terms; dΓ_C (the terms through
e^{Γ_C}) is added to the chunk's last row, so the reverse cumsum hands it to every g of the chunk.

Stage 4, one program per (chunk, head) over its four 16-token sub-chunks from last to first: the pair terms of
Aqk[t, j] = Σ_c q_t k_j e^{Γ_t − Γ_j} and Akk (rows k_t):

    dq_t  += Σ_j dAqk[t, j] k_j e^{Γ_t − Γ_j}      X_t = Σ_j dM[t, j] k_j e^{Γ_t − Γ_j}   (dk_t += β_t X_t)
    dk_j  += Σ_t (dAqk[t, j] q_t + β_t dM[t, j] k_t) e^{Γ_t − Γ_j}
    dβ_t  += k_t · X_t       (= Σ_j dM[t, j] Akk[t, j], without forming Akk)
    dΓ    += q ⊙ dq_pair + k ⊙ (β X − dk_col)

Off-diagonal 16×16 blocks are plain matmuls factored so both factors are ≤ 1: the row side through the first
token r of the row sub-chunk (e^{Γ_t − Γ_r}, e^{Γ_r − Γ_j}), the column side through the last token e of the
column sub-chunk (e^{Γ_t − Γ_e}, e^{Γ_e − Γ_j}). Diagonal tiles take one of two paths, picked by the constexpr
SAFE_GATE (vLLM's name and the forward's: the gate is "safe", i.e. its lower bound is set):
* SAFE_GATE = True, the lower-bound gate's fast path: one matmul each around the midpoint n of the tile,
  e^{Γ_t − Γ_n} and e^{Γ_n − Γ_j}, both within e^{±40} when every g ≥ lb ≥ −5 (§5.7);
* SAFE_GATE = False (any gate): the exact token-pair form, one column j of the tile per step against all rows,
  with the exponent Γ_t − Γ_j replaced by 0 wherever j > t or t is past the end BEFORE the exp: no e^{positive}
  is ever formed, so a tile that holds −30-nat decays beside −0.01 ones stays finite (the PyTorch path's NaN).
dg is then the reverse cumsum of dΓ inside each chunk, carried from sub-chunk to sub-chunk in registers; the
diagonal tile's own pair terms are cumsummed inside the tile only (they sum to zero over it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3rl.kernels.kda.chunk_bwd_inter import CHUNK, LAUNCH, SUB_CHUNK, _chunk_bounds, block_size

# Largest K-block of stage 3's [64, BK] accumulators; module-level so a test can shrink it to exercise K tiling.
BK_WY_MAX = 64
BV_WY_MAX = 64


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_bwd_wy_kernel(
    q, k, v, beta, gk, Ainv, h, v_new, do, dh, dv_new,
    dv, dAqk, dM, dq_p, dk_p, dg_p, db_p, chunk_indices, cu_seqlens, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Stage 3 for one (chunk, batch·head)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos, t0, n, slot = _chunk_bounds(i_t, i_b, chunk_indices, cu_seqlens, T, NT, BT, IS_VARLEN)
    row0 = (bos + t0) * H + i_h
    o_t = tl.arange(0, BT)
    m_t = o_t < n
    m_tt = m_t[:, None] & m_t[None, :]
    o_tt = o_t[:, None] * (H * BT) + o_t[None, :]
    b_ai = tl.load(Ainv + row0 * BT + o_tt, mask=m_tt & (o_t[:, None] >= o_t[None, :]), other=0.0)  # [BT, BT]
    b_ait = tl.trans(b_ai).to(DT)
    b_beta = tl.load(beta + row0 + o_t * H, mask=m_t, other=0.0).to(tl.float32)  # [BT]
    p_h = h + (slot * H + i_h) * K * V
    p_dh = dh + (slot * H + i_h) * K * V

    # values: dAinv from u, dv and dβ from βV, and dAqk
    b_dai = tl.zeros([BT, BT], dtype=tl.float32)
    b_daqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        o_tv = row0 * V + o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + o_tv, mask=m_tv, other=0.0).to(tl.float32)  # [BT, BV]
        b_dvn = tl.load(dv_new + o_tv, mask=m_tv, other=0.0)
        b_vn = tl.load(v_new + o_tv, mask=m_tv, other=0.0)
        b_do = tl.load(do + o_tv, mask=m_tv, other=0.0)
        b_dai += tl.dot(b_dvn.to(DT), tl.trans(b_v * b_beta[:, None]).to(DT), input_precision=PREC)
        b_dbv = tl.dot(b_ait, b_dvn.to(DT), input_precision=PREC)  # [BT, BV] d(βV)
        b_db += tl.sum(b_v * b_dbv, 1)
        tl.store(dv + o_tv, (b_dbv * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        b_daqk += tl.dot(b_do.to(DT), tl.trans(b_vn).to(DT), input_precision=PREC)
    b_daqk = tl.where(m_tt & (o_t[:, None] >= o_t[None, :]), b_daqk, 0.0)
    tl.store(dAqk + row0 * BT + o_tt, b_daqk, mask=m_t[:, None])

    # keys: dq̃, dw, dKd against the entering/leaving state, dAinv from w, and the direct dq, dk, dΓ terms
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        o_tk = row0 * K + o_t[:, None] * (H * K) + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + o_tk, mask=m_tk, other=0.0).to(tl.float32)  # [BT, BK]
        b_k = tl.load(k + o_tk, mask=m_tk, other=0.0).to(tl.float32)
        b_g = tl.load(gk + o_tk, mask=m_tk, other=0.0)
        b_gc = tl.load(gk + (row0 + (n - 1) * H) * K + o_k, mask=m_k, other=0.0)  # [BK] Γ_C
        b_dqt = tl.zeros([BT, BK], dtype=tl.float32)
        b_dkd = tl.zeros([BT, BK], dtype=tl.float32)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        b_hdh = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            o_tv = row0 * V + o_t[:, None] * (H * V) + o_v[None, :]
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            o_kv = o_k[:, None] * V + o_v[None, :]
            m_kv = m_k[:, None] & (o_v < V)[None, :]
            b_h = tl.load(p_h + o_kv, mask=m_kv, other=0.0)  # [BK, BV]
            b_dhp = tl.load(p_dh + o_kv, mask=m_kv, other=0.0)  # [BK, BV] dh'
            b_do = tl.load(do + o_tv, mask=m_tv, other=0.0)  # [BT, BV]
            b_vn = tl.load(v_new + o_tv, mask=m_tv, other=0.0)
            b_dvn = tl.load(dv_new + o_tv, mask=m_tv, other=0.0)
            b_dqt += tl.dot(b_do.to(DT), tl.trans(b_h).to(DT), input_precision=PREC)
            b_dkd += tl.dot(b_vn.to(DT), tl.trans(b_dhp).to(DT), input_precision=PREC)
            b_dw -= tl.dot(b_dvn.to(DT), tl.trans(b_h).to(DT), input_precision=PREC)
            b_hdh += tl.sum(b_h * b_dhp, 1)
        e_g = tl.exp(tl.where(m_t[:, None], b_g, 0.0))  # [BT, BK] e^Γ ≤ 1
        e_d = tl.exp(tl.where(m_t[:, None], b_gc[None, :] - b_g, 0.0))  # [BT, BK] e^{Γ_C − Γ} ≤ 1
        b_kg = b_k * e_g
        b_dai += tl.dot(b_dw.to(DT), tl.trans(b_kg * b_beta[:, None]).to(DT), input_precision=PREC)
        b_dbkg = tl.dot(b_ait, b_dw.to(DT), input_precision=PREC)  # [BT, BK] d(βKg)
        b_db += tl.sum(b_kg * b_dbkg, 1)
        b_dk_kg = b_dbkg * b_beta[:, None] * e_g
        b_dk_kd = b_dkd * e_d
        b_dq = b_dqt * e_g
        b_dgam = b_q * b_dq + b_k * (b_dk_kg - b_dk_kd)  # [BT, BK] dΓ of these terms
        # Γ_C enters through Kd and through e^{Γ_C} ⊙ h; add it to the last real row
        b_dgc = tl.sum(b_k * b_dk_kd, 0) + tl.exp(b_gc) * b_hdh  # [BK]
        b_dgam += tl.where((o_t == n - 1)[:, None], b_dgc[None, :], 0.0)
        tl.store(dq_p + o_tk, b_dq, mask=m_tk)
        tl.store(dk_p + o_tk, b_dk_kg + b_dk_kd, mask=m_tk)
        tl.store(dg_p + o_tk, b_dgam, mask=m_tk)

    # dM = −Ainvᵀ dAinv Ainvᵀ; only the strictly lower part is a gradient (Akk[t, j] exists for j < t)
    b_dm = tl.dot(b_ait, b_dai.to(DT), input_precision=PREC)
    b_dm = -tl.dot(b_dm.to(DT), b_ait, input_precision=PREC)
    b_dm = tl.where(m_tt & (o_t[:, None] > o_t[None, :]), b_dm, 0.0)
    tl.store(dM + row0 * BT + o_tt, b_dm, mask=m_t[:, None])
    tl.store(db_p + row0 + o_t * H, b_db, mask=m_t)


@triton.jit(do_not_specialize=["T", "NT"])
def chunk_bwd_intra_kernel(
    q, k, beta, gk, dAqk, dM, dq_p, dk_p, dg_p, db_p,
    dq, dk, dg, db, chunk_indices, cu_seqlens, T, NT,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, SAFE_GATE: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Stage 4 for one (chunk, batch·head): final dq, dk, dg, dβ."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos, t0, n, slot = _chunk_bounds(i_t, i_b, chunk_indices, cu_seqlens, T, NT, BT, IS_VARLEN)
    row0 = (bos + t0) * H + i_h
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    # offsets inside a sub-chunk: [BC, BK] rows of q/k/Γ, [BC, BC] entries of dAqk/dM
    o_ck = o_c[:, None] * (H * K) + o_k[None, :]
    o_cc = o_c[:, None] * (H * BT) + o_c[None, :]
    # dΓ summed over the later sub-chunks of the chunk: the reverse cumsum's carry
    b_carry = tl.zeros([BK], dtype=tl.float32)
    # sub-chunks last to first; i_i is the loop variable itself so it stays a constexpr (the GPU front end
    # turns a plain local computed from one into an int32 tensor, which tl.static_range(i_i) below refuses)
    for i_i in tl.static_range(BT // BC - 1, -1, -1):
        s0 = i_i * BC
        if s0 < n:
            m_s = o_c < n - s0  # real rows of this sub-chunk
            m_sk = m_s[:, None] & m_k[None, :]
            rs = row0 + s0 * H
            b_q = tl.load(q + rs * K + o_ck, mask=m_sk, other=0.0).to(tl.float32)  # [BC, BK]
            b_k = tl.load(k + rs * K + o_ck, mask=m_sk, other=0.0).to(tl.float32)
            b_g = tl.load(gk + rs * K + o_ck, mask=m_sk, other=0.0)
            b_beta = tl.load(beta + rs + o_c * H, mask=m_s, other=0.0).to(tl.float32)  # [BC]
            b_dq = tl.zeros([BC, BK], dtype=tl.float32)
            b_x = tl.zeros([BC, BK], dtype=tl.float32)
            b_dkc = tl.zeros([BC, BK], dtype=tl.float32)

            # row side, columns of the earlier sub-chunks (all real), through Γ_r of this sub-chunk's first token
            if i_i > 0:
                b_gr = tl.load(gk + rs * K + o_k, mask=m_k, other=0.0)  # [BK]
                for i_m in tl.static_range(i_i):
                    rm = row0 + i_m * BC * H
                    m_mk = (o_c < BC)[:, None] & m_k[None, :]
                    b_km = tl.load(k + rm * K + o_ck, mask=m_mk, other=0.0).to(tl.float32)  # [BC, BK]
                    b_gm = tl.load(gk + rm * K + o_ck, mask=m_mk, other=0.0)
                    b_kr = (b_km * tl.exp(b_gr[None, :] - b_gm)).to(DT)  # e^{Γ_r − Γ_j} ≤ 1
                    p_a = rs * BT + i_m * BC + o_cc
                    b_da = tl.load(dAqk + p_a, mask=m_s[:, None], other=0.0)  # [BC, BC]
                    b_dm = tl.load(dM + p_a, mask=m_s[:, None], other=0.0)
                    b_dq += tl.dot(b_da.to(DT), b_kr, input_precision=PREC)
                    b_x += tl.dot(b_dm.to(DT), b_kr, input_precision=PREC)
                e_r = tl.exp(tl.where(m_s[:, None], b_g - b_gr[None, :], 0.0))  # e^{Γ_t − Γ_r} ≤ 1
                b_dq *= e_r
                b_x *= e_r

            # column side, rows of the later sub-chunks, through Γ_e of this sub-chunk's last token (real here)
            if s0 + BC < n:
                b_ge = tl.load(gk + (rs + (BC - 1) * H) * K + o_k, mask=m_k, other=0.0)  # [BK]
                for i_m in tl.static_range(i_i + 1, BT // BC):
                    if i_m * BC < n:
                        rm = row0 + i_m * BC * H
                        m_m = o_c < n - i_m * BC
                        m_mk = m_m[:, None] & m_k[None, :]
                        b_qm = tl.load(q + rm * K + o_ck, mask=m_mk, other=0.0).to(tl.float32)  # [BC, BK]
                        b_km = tl.load(k + rm * K + o_ck, mask=m_mk, other=0.0).to(tl.float32)
                        b_gm = tl.load(gk + rm * K + o_ck, mask=m_mk, other=0.0)
                        b_bm = tl.load(beta + rm + o_c * H, mask=m_m, other=0.0).to(tl.float32)  # [BC]
                        e_m = tl.exp(tl.where(m_m[:, None], b_gm - b_ge[None, :], 0.0))  # e^{Γ_t − Γ_e} ≤ 1
                        p_a = rm * BT + s0 + o_cc
                        b_da = tl.load(dAqk + p_a, mask=m_m[:, None], other=0.0)  # [BC, BC] rows m, cols i
                        b_dm = tl.load(dM + p_a, mask=m_m[:, None], other=0.0) * b_bm[:, None]
                        b_dkc += tl.dot(tl.trans(b_da).to(DT), (b_qm * e_m).to(DT), input_precision=PREC)
                        b_dkc += tl.dot(tl.trans(b_dm).to(DT), (b_km * e_m).to(DT), input_precision=PREC)
                b_dkc *= tl.exp(b_ge[None, :] - b_g)  # e^{Γ_e − Γ_j} ≤ 1, every row of this sub-chunk is real

            # the diagonal tile, in accumulators of its own (see the cumsum below)
            b_dq_d = tl.zeros([BC, BK], dtype=tl.float32)
            b_x_d = tl.zeros([BC, BK], dtype=tl.float32)
            b_dkc_d = tl.zeros([BC, BK], dtype=tl.float32)
            if SAFE_GATE:
                # midpoint of the tile (a real token): |Γ_t − Γ_mid| ≤ 8·|lb| ≤ 40 nats for the bounded gate
                i_mid = tl.minimum(BC // 2, n - s0 - 1)
                b_gn = tl.load(gk + (rs + i_mid * H) * K + o_k, mask=m_k, other=0.0)  # [BK]
                x = tl.where(m_s[:, None], b_g - b_gn[None, :], 0.0)  # [BC, BK]
                e_p = tl.exp(x)
                e_n = tl.exp(-x)
                m_ss = m_s[:, None] & m_s[None, :]
                b_da = tl.load(dAqk + rs * BT + s0 + o_cc, mask=m_ss, other=0.0)  # [BC, BC]
                b_dm = tl.load(dM + rs * BT + s0 + o_cc, mask=m_ss, other=0.0)
                b_kn = (b_k * e_n).to(DT)
                b_dq_d += e_p * tl.dot(b_da.to(DT), b_kn, input_precision=PREC)
                b_x_d += e_p * tl.dot(b_dm.to(DT), b_kn, input_precision=PREC)
                b_src = tl.dot(tl.trans(b_da).to(DT), (b_q * e_p).to(DT), input_precision=PREC)
                b_src += tl.dot(tl.trans(b_dm * b_beta[:, None]).to(DT), (b_k * e_p).to(DT), input_precision=PREC)
                b_dkc_d += e_n * b_src
            else:
                # column j of the tile against every row t: e^{Γ_t − Γ_j} with the exponent set to 0 wherever
                # j > t or t is past the end, BEFORE the exp (those lanes meet dAqk = dM = 0); the same pairs
                # give the row terms (dq, X) of every t and the column term (dk) of j
                p_kj = rs * K + o_k
                p_aj = rs * BT + o_c * (H * BT) + s0
                for jj in range(0, tl.minimum(BC, n - s0)):
                    b_kj = tl.load(k + p_kj + jj * (H * K), mask=m_k, other=0.0).to(tl.float32)  # [BK]
                    b_gj = tl.load(gk + p_kj + jj * (H * K), mask=m_k, other=0.0)
                    b_daj = tl.load(dAqk + p_aj + jj, mask=m_s, other=0.0)  # [BC] column j of the tile
                    b_dmj = tl.load(dM + p_aj + jj, mask=m_s, other=0.0)
                    e_tj = tl.exp(tl.where((m_s & (o_c >= jj))[:, None], b_g - b_gj[None, :], 0.0))  # [BC, BK]
                    b_kj_t = b_kj[None, :] * e_tj
                    b_dq_d += b_daj[:, None] * b_kj_t
                    b_x_d += b_dmj[:, None] * b_kj_t
                    b_col = tl.sum((b_daj[:, None] * b_q + (b_beta * b_dmj)[:, None] * b_k) * e_tj, 0)  # [BK]
                    b_dkc_d += tl.where((o_c == jj)[:, None], b_col[None, :], 0.0)

            o_out = rs * K + o_ck
            # dΓ of the pairs with j in earlier sub-chunks / t in later ones, and of the tile's own pairs
            b_dgam = tl.load(dg_p + o_out, mask=m_sk, other=0.0) + b_q * b_dq + b_k * (b_beta[:, None] * b_x - b_dkc)
            b_dgam = tl.where(m_sk, b_dgam, 0.0)
            b_dgd = b_q * b_dq_d + b_k * (b_beta[:, None] * b_x_d - b_dkc_d)
            b_dq += b_dq_d
            b_x += b_x_d
            b_dkc += b_dkc_d
            b_dq_all = tl.load(dq_p + o_out, mask=m_sk, other=0.0) + b_dq
            b_dk_all = tl.load(dk_p + o_out, mask=m_sk, other=0.0) + b_beta[:, None] * b_x + b_dkc
            b_dgd = tl.where(m_sk, b_dgd, 0.0)
            b_db = tl.load(db_p + rs + o_c * H, mask=m_s, other=0.0) + tl.sum(b_k * b_x, 1)
            # dg_s = Σ_{t ≥ s} dΓ_t inside the chunk: this sub-chunk's reverse cumsum plus the later ones' sum.
            # The tile's own pairs (t, j both in it) add +P at t and −P at j: their sum over the tile is exactly 0,
            # so it is left out of the carry rather than cancelled in fp32 by every earlier row (2.5× smaller
            # error in dg with decays at the bound)
            b_dg = tl.cumsum(b_dgam + b_dgd, axis=0, reverse=True) + b_carry[None, :]
            b_carry += tl.sum(b_dgam, 0)
            tl.store(dq + o_out, b_dq_all.to(dq.dtype.element_ty), mask=m_sk)
            tl.store(dk + o_out, b_dk_all.to(dk.dtype.element_ty), mask=m_sk)
            tl.store(dg + o_out, b_dg.to(dg.dtype.element_ty), mask=m_sk)
            tl.store(db + rs + o_c * H, b_db.to(db.dtype.element_ty), mask=m_s)


def chunk_bwd_wy(q, k, v, beta, gk, Ainv, h, v_new, do, dh, dv_new, chunk_indices, cu_seqlens, NT_grid, NT, dots):
    """Stage 3: dv [B, T, H, V] (v's dtype), and fp32 dAqk, dM [B, T, H, 64], partial dq, dk, dΓ [B, T, H, K],
    partial dβ [B, T, H]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K, BK_WY_MAX)
    BV = block_size(V, BV_WY_MAX)
    f32 = dict(dtype=torch.float32, device=q.device)
    dv = torch.empty_like(v)
    dAqk, dM = torch.empty(B, T, H, CHUNK, **f32), torch.empty(B, T, H, CHUNK, **f32)
    dq_p, dk_p, dg_p = (torch.empty(B, T, H, K, **f32) for _ in range(3))
    db_p = torch.empty(B, T, H, **f32)
    chunk_bwd_wy_kernel[(NT_grid, B * H)](
        q, k, v, beta, gk, Ainv, h, v_new, do, dh, dv_new,
        dv, dAqk, dM, dq_p, dk_p, dg_p, db_p, chunk_indices, cu_seqlens, T, NT,
        H=H, K=K, V=V, BT=CHUNK, BK=BK, BV=BV, IS_VARLEN=cu_seqlens is not None, **dots, **LAUNCH,
    )
    return dv, dAqk, dM, dq_p, dk_p, dg_p, db_p


def chunk_bwd_intra(q, k, beta, gk, dAqk, dM, dq_p, dk_p, dg_p, db_p, chunk_indices, cu_seqlens, NT_grid, NT,
                    safe_gate, dots):
    """Stage 4: dq, dk (their inputs' dtypes), dg fp32 [B, T, H, K], dβ [B, T, H] (beta's dtype)."""
    B, T, H, K = q.shape
    BK = block_size(K, triton.next_power_of_2(K))
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg = torch.empty(B, T, H, K, dtype=torch.float32, device=q.device)
    db = torch.empty_like(beta)
    chunk_bwd_intra_kernel[(NT_grid, B * H)](
        q, k, beta, gk, dAqk, dM, dq_p, dk_p, dg_p, db_p,
        dq, dk, dg, db, chunk_indices, cu_seqlens, T, NT,
        H=H, K=K, BT=CHUNK, BC=SUB_CHUNK, BK=BK, IS_VARLEN=cu_seqlens is not None,
        SAFE_GATE=bool(safe_gate), **dots, **LAUNCH,
    )
    return dq, dk, dg, db
