"""Recurrent KDA decode step in Triton: docs/model_spec.md §5.3 for T ≤ ~16 tokens per sequence, forward only.

One program per (sequence, head, V-block) holds its [K, BV] slice of the fp32 state in registers for all of the
sequence's tokens: per token it loads q_t, k_t, g_t (K values), v_t (BV values) and β_t, and the state is read
from memory once before the first token and written once after the last, which is what bounds a decode step
(a 128×128 fp32 state is 64 KB per head; the token's inputs are < 1 KB). The per-token math is the reference's:

    S ← Diag(e^{g_t}) S,    u = β_t (v_t − Sᵀ k_t),    S ← S + k_t uᵀ,    o_t = Sᵀ q_t

What is fused into the kernel, and is a separate pass in the PyTorch path (`kernels/kda/recurrent.py`):
* the per-head L2 norm of q and k (`use_qk_l2norm_in_kernel`, §5.1) and the q scale;
* the decay gate when `g` is a `FusedGate` (§5.2, both forms: −e^{A_log}·softplus(f + dt_bias) with
  softplus's threshold 20, or lb·σ(e^{A_log}·(f + dt_bias))), in fp32 as `kda_gate` computes it;
* the engine's state cache: with `state_indices` the state of sequence n is read from and written back to
  slot `state_indices[n]` of a pool [P, H, K, V] in place (vLLM's `ssm_state_indices`); a negative index
  is a padding slot: that sequence starts from a zero state and writes nothing back.

Departures from the reference: inputs must be fp32/bf16/fp16 (computed in fp32, output in q's dtype, state
fp32); float64 is left to `fused_recurrent_kda`. No backward: calling it on tensors that require grad with
autograd on raises. Programs of one head recompute the K-length work (norms, gate) once per V-block: K values,
cheap next to the [K, BV] state slice each program owns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3rl.kernels.kda.gate import FusedGate
from k3rl.kernels.kda.utils import L2NORM_EPS, check_inputs

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Gate modes of the kernel: g given, or computed from the raw inputs in one of the two forms of §5.2.
GATE_GIVEN, GATE_SOFTPLUS, GATE_LOWER_BOUND = 0, 1, 2
# torch.nn.functional.softplus's default threshold: above it softplus(z) = z.
SOFTPLUS_THRESHOLD = 20.0


@triton.jit
def _softplus(z):
    """log(1 + e^z), = z above the threshold; log1p written as log(u)·e/(u − 1), u = 1 + e (exact where 1 + e
    rounds, and tl has no log1p under the interpreter)."""
    e = tl.exp(tl.minimum(z, 20.0))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * e / tl.where(u == 1.0, 1.0, u - 1.0))
    return tl.where(z > 20.0, z, log1p)


@triton.jit(do_not_specialize=["T"])
def _kda_recurrent_fwd_kernel(
    q, k, v, g, beta, o,
    h0, ht, A_log, dt_bias, cu_seqlens, state_indices,
    scale, lower_bound, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr, L2_EPS: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IN_PLACE: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n.to(tl.int64) * T
        T_n = T

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    # offsets of this program's [BK, BV] slice inside one head's [K, V] state
    o_h = o_k[:, None] * V + o_v[None, :]

    if IN_PLACE:
        slot = tl.load(state_indices + i_n).to(tl.int64)
        # a padding slot (< 0) reads zeros and is not written; the address is clamped to slot 0, masked off
        m_slot = m_h & ((o_h * 0 + slot) >= 0)
        p_state = h0 + (tl.maximum(slot, 0) * H + i_h) * K * V + o_h
        b_h = tl.load(p_state, mask=m_slot, other=0.0).to(tl.float32)  # [BK, BV]
    elif USE_H0:
        b_h = tl.load(h0 + (i_n.to(tl.int64) * H + i_h) * K * V + o_h, mask=m_h, other=0.0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)

    if GATE != 0:
        b_a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if HAS_DT_BIAS:
            b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]

    for t in range(0, T_n):
        i_tok = (bos + t) * H + i_h
        b_q = tl.load(q + i_tok * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_k = tl.load(k + i_tok * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
        b_v = tl.load(v + i_tok * V + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
        b_beta = tl.load(beta + i_tok).to(tl.float32)
        b_g = tl.load(g + i_tok * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK] g, or the raw f
        if GATE != 0:
            if HAS_DT_BIAS:
                b_g = b_g + b_bias
            if GATE == 1:
                b_g = -b_a * _softplus(b_g)
            else:
                b_g = lower_bound * tl.sigmoid(b_a * b_g)
        if L2NORM:
            b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q) + L2_EPS) * scale)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + L2_EPS)
        else:
            b_q = b_q * scale
        # masked key channels: their state rows are 0 and stay 0 (k = 0 there), whatever their decay
        b_h = b_h * tl.exp(b_g)[:, None]
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], axis=0))  # [BV]
        b_h = b_h + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0)  # [BV]
        tl.store(o + i_tok * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)

    if IN_PLACE:
        tl.store(p_state, b_h.to(p_state.dtype.element_ty), mask=m_slot)
    elif STORE_HT:
        p_ht = ht + (i_n.to(tl.int64) * H + i_h) * K * V + o_h
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=m_h)


def fused_recurrent_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | FusedGate,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA by the recurrence in one Triton kernel, for decode and short multi-token (speculative) steps.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; fp32, bf16 or fp16 (may differ per tensor).
        g: [B, T, H, K] log decay ≤ 0, or a `FusedGate` (f [B, T, H*K] or [B, T, H, K], A_log [H],
            dt_bias [H*K] or None, lower_bound) whose gate the kernel computes (= `kda_gate`).
        scale: multiplies q; default K^-1/2.
        initial_state: [B or N, H, K, V] (any float dtype, read as fp32); zeros if None. With
            `state_indices`: the state pool [P, H, K, V], fp32, contiguous, updated in place.
        output_final_state: also return the state after each sequence's last token (with `state_indices`:
            return the pool itself).
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first (docs/model_spec.md §5.1).
        cu_seqlens: int32/int64 [N + 1] boundaries of N sequences packed along T (then B must be 1).
        state_indices: int32/int64 [N] (N = B, or the number of packed sequences): sequence n's state lives
            in pool slot state_indices[n]; < 0 means a padding slot (zero state, nothing written). The
            indices ≥ 0 must be distinct (two programs would race on one slot).

    Returns:
        o [B, T, H, V] in q's dtype; the final state [B or N, H, K, V] fp32 (the pool [P, H, K, V] with
        `state_indices`), or None unless `output_final_state`.
    """
    gate_mode, lower_bound, A_log, dt_bias = GATE_GIVEN, 0.0, None, None
    if isinstance(g, FusedGate):
        A_log, dt_bias, f = g.A_log, g.dt_bias, g.f
        H = A_log.shape[0]
        if f.dim() == 3:
            if f.shape[-1] % H != 0:
                raise ValueError(f"FusedGate.f's last dim {f.shape[-1]} is not a multiple of H={H} (len(A_log))")
            f = f.unflatten(-1, (H, f.shape[-1] // H))  # [B, T, H, K]
        if dt_bias is not None and dt_bias.numel() != f.shape[-2] * f.shape[-1]:
            raise ValueError(f"dt_bias must be flat [H*K]={f.shape[-2] * f.shape[-1]}, got {tuple(dt_bias.shape)}")
        if g.lower_bound is None:
            gate_mode = GATE_SOFTPLUS
        else:
            lower_bound = float(g.lower_bound)
            if not -5.0 <= lower_bound < 0.0:
                raise ValueError(f"gate_lower_bound must be in [-5, 0), got {g.lower_bound}")
            gate_mode = GATE_LOWER_BOUND
        g_in, gate_tensors = f, [f, A_log] + ([dt_bias] if dt_bias is not None else [])
    else:
        g_in, gate_tensors = g, [g]

    tensors = [q, k, v, beta, initial_state] + gate_tensors
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        raise RuntimeError(
            "fused_recurrent_kda_triton is forward-only (decode) and has no backward; call it under "
            "torch.no_grad()/inference_mode, or use fused_recurrent_kda / chunk_kda for gradients"
        )
    check_inputs(q, k, v, g_in, beta, None if state_indices is not None else initial_state, cu_seqlens)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g_in), ("beta", beta)):
        if x.dtype not in KERNEL_DTYPES:
            raise ValueError(f"{name} is {x.dtype}; the Triton kernel takes fp32/bf16/fp16 (fused_recurrent_kda "
                             "computes float64)")
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1

    final_state = None
    if state_indices is not None:
        if initial_state is None:
            raise ValueError("state_indices needs the state pool [P, H, K, V] as initial_state")
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (H, K, V):
            raise ValueError(f"the state pool must be [P, {H}, {K}, {V}], got {tuple(initial_state.shape)}")
        if initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
            raise ValueError("the state pool must be a contiguous float32 tensor (it is updated in place)")
        if state_indices.shape != (N,) or state_indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"state_indices must be int32/int64 [{N}], got {state_indices.dtype} "
                             f"{tuple(state_indices.shape)}")
        h0, ht = initial_state, initial_state
        if output_final_state:
            final_state = initial_state
    else:
        h0 = initial_state.contiguous() if initial_state is not None else None
        ht = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None  # [N, H, K, V]
        final_state = ht

    q, k, v, g_in, beta = (x.contiguous() for x in (q, k, v, g_in, beta))
    o = q.new_empty(B, T, H, V)  # [B, T, H, V]
    if gate_mode != GATE_GIVEN:
        A_log = A_log.contiguous()
        dt_bias = dt_bias.contiguous() if dt_bias is not None else None

    # The whole key dim in one block (K ≤ 256 in every KDA config); V split so a batch of decode sequences
    # fills the GPU: 64 sequences × 16 heads × 4 blocks of 32 = 4096 programs of a [128, 32] fp32 tile.
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32)
    if N * H > 0:
        grid = (triton.cdiv(V, BV), N * H)
        _kda_recurrent_fwd_kernel[grid](
            q, k, v, g_in, beta, o,
            h0, ht, A_log, dt_bias, cu_seqlens, state_indices,
            float(K ** -0.5 if scale is None else scale), lower_bound, T,
            H=H, K=K, V=V, BK=BK, BV=BV,
            GATE=gate_mode, HAS_DT_BIAS=dt_bias is not None, L2NORM=use_qk_l2norm_in_kernel, L2_EPS=L2NORM_EPS,
            IS_VARLEN=cu_seqlens is not None, USE_H0=h0 is not None, STORE_HT=ht is not None,
            IN_PLACE=state_indices is not None,
            num_warps=4 if BK * BV >= 4096 else 2,
        )
    return o, final_state
