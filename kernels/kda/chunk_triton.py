"""Chunked KDA on the Triton kernels, with autograd: `chunk_kda_triton`, same contract as kernels/kda/chunk.py
`chunk_kda_torch` (docs/model_spec.md §5.5).

q/k L2 norm and the q scale are done here in PyTorch (`prepare_qk`, so autograd differentiates them) and
the prepared q, k are cast back to the input dtype before the kernels, as fla's l2norm kernel returns them.
`ChunkKDAFunction` runs kernels/kda/chunk_fwd.py `chunk_fwd` forward and saves only q, k, v, β, Γ (or the
raw gate input f, from which the backward recomputes Γ), Aqk, Ainv and the initial state; the backward
recomputes w, u (`recompute_w_u`) and h, v_new (`chunk_state`) rather than keeping them (two [T, K|V] and
one [T/64, K, V] fp32 tensors per head), then calls kernels/kda/chunk_bwd.py `chunk_bwd` and, for a fused
gate, `gate_bwd`.

A `FusedGate` in place of g computes the gate inside the cumsum kernel; with its lower bound set the
diagonal 16×16 tiles are plain matmuls (§5.7), otherwise the exact token-pair path. A plain g tensor takes
the token-pair path (nothing bounds its decays). Float64 is refused (the kernels compute in fp32; the
PyTorch `chunk_kda_torch` is the float64 path).
"""

from __future__ import annotations

import torch

from k3rl.kernels.kda.chunk_fwd import CHUNK, GateSpec, chunk_cumsum_gate, chunk_fwd, chunk_state, recompute_w_u
from k3rl.kernels.kda.gate import FusedGate
from k3rl.kernels.kda.naive import ChunkIntermediates
from k3rl.kernels.kda.utils import check_inputs, chunk_indices, prepare_qk


class ChunkKDAFunction(torch.autograd.Function):
    """o, final state = chunked KDA of prepared q, k (normalised, scaled) and g (or raw f with the gate)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, lower_bound, fused, initial_state, output_final_state,
                cu_seqlens, indices):
        gate = GateSpec(A_log, dt_bias, lower_bound) if fused else None
        o, final, inter = chunk_fwd(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, gate=gate, chunk_indices=indices,
        )
        # the fused gate saves raw f (input dtype) and recomputes Γ in backward; a plain g saves Γ
        ctx.save_for_backward(q, k, v, g if fused else inter.gk, beta, inter.Aqk, inter.Ainv, initial_state,
                              A_log, dt_bias)
        ctx.lower_bound, ctx.fused, ctx.cu_seqlens, ctx.indices = lower_bound, fused, cu_seqlens, indices
        ctx.g_dtype = g.dtype
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        # imported here so the forward works without the backward module
        from k3rl.kernels.kda.chunk_bwd import chunk_bwd, gate_bwd

        q, k, v, g_saved, beta, Aqk, Ainv, h0, A_log, dt_bias = ctx.saved_tensors
        grid = dict(cu_seqlens=ctx.cu_seqlens, chunk_indices=ctx.indices)
        if ctx.fused:
            gk = chunk_cumsum_gate(g_saved, A_log=A_log, dt_bias=dt_bias, lower_bound=ctx.lower_bound, fused=True,
                                   **grid)
        else:
            gk = g_saved
        w, u = recompute_w_u(k, v, beta, gk, Ainv, **grid)
        h, v_new, _ = chunk_state(k, w, u, gk, initial_state=h0, output_final_state=False, **grid)
        inter = ChunkIntermediates(gk, Aqk, Ainv, w, u, h, v_new)
        dq, dk, dv, dg, dbeta, dh0 = chunk_bwd(
            q, k, v, beta, inter, do, dht, initial_state=h0, cu_seqlens=ctx.cu_seqlens,
            safe_gate=ctx.fused and ctx.lower_bound is not None,
        )
        dA_log = ddt_bias = None
        if ctx.fused:
            dg, dA_log, ddt_bias = gate_bwd(g_saved, A_log, dt_bias, ctx.lower_bound, dg)
            dA_log = dA_log.to(A_log.dtype)
            ddt_bias = None if ddt_bias is None or dt_bias is None else ddt_bias.to(dt_bias.dtype)
        if dh0 is not None and h0 is not None:
            dh0 = dh0.to(h0.dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(ctx.g_dtype),
                dbeta.to(beta.dtype), dA_log, ddt_bias, None, None, dh0, None, None, None)


def chunk_kda_triton(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA by the Triton kernels; same results as `naive_recurrent_kda`.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; fp32, bf16 or fp16.
        g: [B, T, H, K] log decay ≤ 0, or a `FusedGate` (raw f [B, T, H*K] or [B, T, H, K], A_log [H],
            dt_bias [H*K] or None, lower_bound None or in [−5, 0)): the gate is computed in the kernel and
            differentiated w.r.t. f, A_log and dt_bias.
        scale: multiplies q; default K^-1/2.
        initial_state: [B, H, K, V] (or [N, H, K, V] with cu_seqlens); zeros if None.
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first (docs/model_spec.md §5.1).
        cu_seqlens: int [N + 1] boundaries of N sequences packed along T (then B must be 1).

    Returns:
        o [B, T, H, V] in q's dtype, final state [B or N, H, K, V] fp32 or None.
    """
    fused = isinstance(g, FusedGate)
    if fused:
        gate = g
        H = gate.A_log.shape[0]
        f = gate.f.unflatten(-1, (H, gate.f.shape[-1] // H)) if gate.f.dim() == 3 else gate.f  # [B, T, H, K]
        lb = gate.lower_bound
        if lb is not None and not -5.0 <= float(lb) < 0.0:
            # the matmul path's exponents are bounded by 8·|lb|; past −5 they could overflow fp32
            raise ValueError(f"gate_lower_bound must be in [-5, 0), got {lb}")
        g_in, A_log, dt_bias = f, gate.A_log, gate.dt_bias
        lb = None if lb is None else float(lb)
    else:
        g_in, A_log, dt_bias, lb = g, None, None, None
    check_inputs(q, k, v, g_in, beta, initial_state, cu_seqlens)
    if q.dtype == torch.float64:
        raise TypeError("chunk_kda_triton computes in fp32; use kernels.kda.chunk.chunk_kda_torch for float64")
    dtype = q.dtype
    q, k = prepare_qk(q, k, scale, use_qk_l2norm_in_kernel, torch.float32)
    q, k = q.to(dtype), k.to(dtype)
    indices = None if cu_seqlens is None else chunk_indices(cu_seqlens, CHUNK)
    return ChunkKDAFunction.apply(
        q, k, v, g_in, beta, A_log, dt_bias, lb, fused, initial_state, output_final_state, cu_seqlens, indices,
    )
