"""Chunked KDA backward in Triton (docs/model_spec.md §5.5, §5.7): host entry `chunk_bwd`, and `gate_bwd` for
the gate fused into the forward (§5.2).

`chunk_bwd` takes the forward's intermediates (`kernels.kda.naive.ChunkIntermediates`, fp32: Γ = gk the
chunk-local cumsum of g, Aqk, Ainv, w, h the state entering each chunk, v_new; q/k as the forward used them,
normalised and scaled) and the output gradient, and returns the gradients of q, k, v, g (the per-token log
decay), β and the initial state. Four launches, each a stage file's kernel:

1. chunk_bwd_inter: dv_local = Aqkᵀ dO                                all chunks in parallel
2. chunk_bwd_inter: reverse state pass → dh' per chunk, dVnew, dh0    sequential over chunks per (sequence, head,
                                                                      V-block)
3. chunk_bwd_intra: WY gradients → dv, dAqk, dM, partial dq/dk/dβ/dΓ  all chunks in parallel
4. chunk_bwd_intra: sub-chunk pair terms + reverse cumsum → dq, dk, dg, dβ

`safe_gate` picks the diagonal-tile path of stage 4 and means what it means in vLLM and in the forward
(kernels/kda/chunk_fwd_intra.py): True when the gate's lower bound is set, for the one-matmul midpoint form
that is only finite when every g ≥ lb ≥ −5; False (the default, any gate) for the exact token-pair form.
The autograd wrapper passes `safe_gate = lower_bound is not None` for a fused gate, False for a plain g.
Where this departs from fla's backward: no e^{±Γ} over a whole chunk is formed anywhere (Γ reaches −320 nats
with the bound, any value without it); dβ of the Akk term is k_t·X_t (X = dM against the decayed keys), so Akk
is never rebuilt; dg's reverse cumsum is fused into stage 4, and the diagonal tiles' own pair terms (which sum
to zero over the tile) are kept out of its carry, which cuts dg's fp32 cancellation error 2.5× at the bound.

`gate_bwd` is the gate's backward: one elementwise kernel for df (rows of the flat [B·T, H, K] input, one
head per program) that also sums dA_log and ddt_bias over its block of rows; the host adds the blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3rl.kernels.kda.chunk_bwd_inter import CHUNK, chunk_bwd_dh, chunk_bwd_dv_local, dot_args
from k3rl.kernels.kda.chunk_bwd_intra import chunk_bwd_intra, chunk_bwd_wy
from k3rl.kernels.kda.naive import ChunkIntermediates
from k3rl.kernels.kda.utils import chunk_indices as make_chunk_indices

# torch.nn.functional.softplus's threshold as kda_gate uses it: above it softplus(z) = z (and its slope is 1).
SOFTPLUS_THRESHOLD = 20.0
# Rows of the flat [B·T] token axis per gate_bwd program.
GATE_ROWS = 64


def chunk_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    inter: ChunkIntermediates,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    *,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    safe_gate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of chunked KDA from its intermediates.

    Args:
        q, k: [B, T, H, K] as the forward used them (normalised, q scaled); v: [B, T, H, V]; beta: [B, T, H].
        inter: the forward's `ChunkIntermediates` (fp32; h [B, NT, H, K, V], B = 1 and NT over all sequences
            with cu_seqlens).
        do: [B, T, H, V] gradient of the output.
        dht: [N or B, H, K, V] gradient of the final state, or None.
        initial_state: the forward's initial state or None; only decides whether dh0 is returned.
        cu_seqlens: int [N + 1] boundaries of packed sequences (B = 1), or None.
        safe_gate: True when every g ≥ lb ≥ −5 (the lower-bound gate): diagonal tiles by one midpoint matmul;
            False (any gate): the exact token-pair form.

    Returns:
        dq, dk [B, T, H, K], dv [B, T, H, V] and dbeta [B, T, H] in the dtypes of q, k, v, beta; dg [B, T, H, K]
        fp32 (gradient of the per-token g, not of Γ); dh0 [N or B, H, K, V] fp32, or None without initial_state.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K > 256 or V > 256:
        raise ValueError(f"chunk_bwd supports K, V ≤ 256, got K={K}, V={V}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"with cu_seqlens the batch must be 1 (packed), got B={B}")
    q, k, v, beta, do = (x.contiguous() for x in (q, k, v, beta, do))
    gk, Aqk, Ainv, w, h, v_new = (
        x.contiguous() for x in (inter.gk, inter.Aqk, inter.Ainv, inter.w, inter.h, inter.v_new)
    )
    n_states = B if cu_seqlens is None else cu_seqlens.numel() - 1
    NT = h.shape[1]
    if cu_seqlens is None:
        idx, offsets, NT_grid = None, None, NT
    else:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
        idx, offsets = make_chunk_indices(cu_seqlens, CHUNK)  # [NT, 2], [N + 1]
        NT_grid = idx.shape[0]
    dht = None if dht is None else dht.contiguous()
    store_dh0 = initial_state is not None
    if T == 0 or NT_grid == 0:
        dh0 = torch.zeros(n_states, H, K, V, dtype=torch.float32, device=q.device) if store_dh0 else None
        if dh0 is not None and dht is not None:
            dh0.copy_(dht)
        zeros = [torch.zeros_like(x) for x in (q, k, v)]
        return (*zeros, torch.zeros(B, T, H, K, dtype=torch.float32, device=q.device), torch.zeros_like(beta), dh0)

    dots = dot_args(q, k, v, beta, do)
    dv_local = chunk_bwd_dv_local(Aqk, do, idx, cu_seqlens, NT_grid, NT, dots)  # [B, T, H, V]
    dh, dv_new, dh0 = chunk_bwd_dh(q, k, w, gk, do, dv_local, dht, n_states, NT, h.shape, cu_seqlens, offsets,
                                   store_dh0, dots)  # [B, NT, H, K, V], [B, T, H, V], [N, H, K, V]
    dv, dAqk, dM, dq_p, dk_p, dg_p, db_p = chunk_bwd_wy(q, k, v, beta, gk, Ainv, h, v_new, do, dh, dv_new, idx,
                                                       cu_seqlens, NT_grid, NT, dots)
    dq, dk, dg, dbeta = chunk_bwd_intra(q, k, beta, gk, dAqk, dM, dq_p, dk_p, dg_p, db_p, idx, cu_seqlens,
                                        NT_grid, NT, safe_gate, dots)
    return dq, dk, dv, dg, dbeta, dh0


@triton.jit
def _log1p_exp(z, THRESHOLD: tl.constexpr):
    """softplus(z) = log(1 + e^z) for z ≤ THRESHOLD (the caller takes z above): log1p written as log(u)·e/(u − 1),
    u = 1 + e, exact where 1 + e rounds (tl has no log1p under the interpreter)."""
    e = tl.exp(tl.minimum(z, THRESHOLD))
    u = 1.0 + e
    return tl.where(u == 1.0, e, tl.log(u) * e / tl.where(u == 1.0, 1.0, u - 1.0))


@triton.jit(do_not_specialize=["R"])
def gate_bwd_kernel(
    f, A_log, dt_bias, dg, df, dA_part, ddt_part, R, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
    LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr, CDT: tl.constexpr, THRESHOLD: tl.constexpr,
):
    """df for BR rows × one head, and that block's sums of dA_log [1] and ddt_bias [K]."""
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    mask = (o_r < R)[:, None] & m_k[None, :]
    offs = (o_r.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
    z = tl.load(f + offs, mask=mask, other=0.0).to(CDT)  # [BR, BK]
    if HAS_DT_BIAS:
        z += tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(CDT)[None, :]
    a = tl.exp(tl.load(A_log + i_h).to(CDT))
    b_dg = tl.load(dg + offs, mask=mask, other=0.0).to(CDT)
    if LOWER_BOUND:
        # g = lb·σ(a z): dg/dz = lb·a·σ(1 − σ), dg/dA_log = lb·σ(1 − σ)·a z
        s = 1.0 / (1.0 + tl.exp(-(a * z)))
        ds = lower_bound * s * (1.0 - s)
        b_df = b_dg * ds * a
        b_da = b_df * z
    else:
        # g = −a·softplus(z): dg/dz = −a·σ(z) (1 above the threshold), dg/dA_log = g
        over = z > THRESHOLD
        sp = tl.where(over, z, _log1p_exp(z, THRESHOLD))
        sig = tl.where(over, 1.0, 1.0 / (1.0 + tl.exp(-z)))
        b_df = -b_dg * a * sig
        b_da = -b_dg * a * sp
    b_df = tl.where(mask, b_df, 0.0)
    b_da = tl.where(mask, b_da, 0.0)
    tl.store(df + offs, b_df.to(df.dtype.element_ty), mask=mask)
    tl.store(dA_part + i_r * H + i_h, tl.sum(tl.sum(b_da, 1), 0))
    tl.store(ddt_part + (i_r * H + i_h) * K + o_k, tl.sum(b_df, 0), mask=m_k)


def gate_bwd(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    dg: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward of `kernels.kda.gate.kda_gate` (both forms): the gradients of f, A_log and dt_bias from dg.

    Args:
        f: [B, T, H*K] or [B, T, H, K] raw gate input; A_log: [H]; dt_bias: [H*K] or None.
        lower_bound: None (softplus form) or lb ∈ [−5, 0).
        dg: [B, T, H, K] gradient of g.

    Returns:
        df in f's shape and dtype, dA_log [H] in A_log's dtype, ddt_bias [H*K] in dt_bias's dtype (None without
        dt_bias). Computed in fp32 (fp64 for a float64 f, as kda_gate does).
    """
    B, T, H, K = dg.shape
    if A_log.shape != (H,) or f.numel() != B * T * H * K:
        raise ValueError(f"gate_bwd: f {tuple(f.shape)}, A_log {tuple(A_log.shape)} do not fit dg {tuple(dg.shape)}")
    R = B * T
    cdt = torch.promote_types(f.dtype, torch.float32)
    f_c, dg_c, A_c = f.contiguous(), dg.contiguous(), A_log.contiguous()
    dt_c = None if dt_bias is None else dt_bias.contiguous()
    df = torch.empty_like(f_c)
    n_blocks = triton.cdiv(R, GATE_ROWS)
    dA_part = torch.empty(n_blocks, H, dtype=cdt, device=f.device)
    ddt_part = torch.empty(n_blocks, H, K, dtype=cdt, device=f.device)
    if n_blocks:
        gate_bwd_kernel[(n_blocks, H)](
            f_c, A_c, dt_c, dg_c, df, dA_part, ddt_part, R, float(lower_bound or 0.0),
            H=H, K=K, BR=GATE_ROWS, BK=triton.next_power_of_2(K),
            LOWER_BOUND=lower_bound is not None, HAS_DT_BIAS=dt_bias is not None,
            CDT=tl.float64 if cdt == torch.float64 else tl.float32, THRESHOLD=SOFTPLUS_THRESHOLD,
            # 8 warps: with the default 4 the sm_90 build spilled 52-220 B per thread at K = 128 (bf16 f)
            num_warps=8,
        )
    dA_log = dA_part.sum(0).to(A_log.dtype)  # [H]
    ddt_bias = None if dt_bias is None else ddt_part.sum(0).flatten().to(dt_bias.dtype)  # [H*K]
    return df.view(f.shape), dA_log, ddt_bias
