"""Plain per-token reference of the KDA recurrence (docs/model_spec.md §5.3): the ground truth the fast paths are tested against.

For every token t, head h (state S ∈ R^{K×V}, the transpose of vLLM's [H, V, K] cache layout):

    S ← Diag(exp(g_t)) S                     decay along the key dim, g_t ≤ 0 is a natural-log decay per channel
    u = β_t (v_t − Sᵀ k_t)                   delta-rule error against the *decayed* state
    S ← S + k_t uᵀ
    o_t = Sᵀ q_t                             read after the update; q already scaled by `scale` (default K^-1/2)

i.e. S_t = (I − β_t k_t k_tᵀ) D_t S_{t−1} + β_t k_t v_tᵀ with D_t = Diag(e^{g_t}).

q/k L2 norm: the spec (§5.1) does it inside the kernel, behind vLLM's `use_qk_l2norm_in_kernel` flag; every
KDA op here takes the same keyword (default False, as in fla; the K3 layer passes True).
Computes in the input dtype (float32 for bf16/fp16), one token at a time: slow on purpose, exact in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3rl.kernels.kda.utils import check_inputs, compute_dtype, prepare_qk


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA by the per-token recurrence of docs/model_spec.md §5.3.

    Args:
        q, k: [B, T, H, K] queries and keys.
        v: [B, T, H, V] values.
        g: [B, T, H, K] natural-log decay per channel (≤ 0), e.g. from `kda_gate`.
        beta: [B, T, H] delta-rule step size in (0, 1).
        scale: multiplies q; default K^-1/2.
        initial_state: [B, H, K, V] state before the first token; zeros if None.
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first (docs/model_spec.md §5.1).

    Returns:
        o [B, T, H, V] in the input dtype, and the final state [B, H, K, V] in the compute dtype or None.
    """
    check_inputs(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    q, k = prepare_qk(q, k, scale, use_qk_l2norm_in_kernel, dtype)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    if initial_state is None:
        S = q.new_zeros(B, H, K, V)  # [B, H, K, V]
    else:
        S = initial_state.to(dtype)
    outputs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))  # [B, H, V]
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))  # [B, H, V]
    o = torch.stack(outputs, dim=1) if T > 0 else v.new_zeros(B, 0, H, V)  # [B, T, H, V]
    return o.to(out_dtype), (S if output_final_state else None)


@dataclass
class ChunkIntermediates:
    """What the chunked form (docs/model_spec.md §5.5) computes per 64-token chunk, in the layout the Triton
    kernels share (kernels/kda/chunk_fwd.py writes it, kernels/kda/chunk_bwd.py reads it). Chunks start at
    every sequence start (each `cu_seqlens` segment, or each batch row); "j in chunk" is t's chunk's column.

    gk:   [B, T, H, K] Γ_t, the chunk-local inclusive cumsum of g (natural log)
    Aqk:  [B, T, H, 64] Σ_c q_t[c] k_j[c] e^{Γ_t[c]−Γ_j[c]} for j ≤ t, 0 for j > t (q scaled/normalised)
    Ainv: [B, T, H, 64] (I + Diag(β) Akk)⁻¹, Akk[t, j] = Σ_c k_t[c] k_j[c] e^{Γ_t[c]−Γ_j[c]} (j < t); unit lower
    w:    [B, T, H, K] Ainv (β ⊙ K ⊙ e^Γ)          u: [B, T, H, V] Ainv (β ⊙ V)
    h:    [B, NT, H, K, V] the state entering each chunk (B = 1 and NT over all sequences with cu_seqlens)
    v_new:[B, T, H, V] u − w h
    Padding columns/rows (past a sequence's end) are 0.
    """

    gk: torch.Tensor
    Aqk: torch.Tensor
    Ainv: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    h: torch.Tensor
    v_new: torch.Tensor


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, ChunkIntermediates]:
    """The chunked form of §5.5 written plainly (a loop over chunks, each pair decay e^{Γ_t − Γ_j} formed
    directly): o [B, T, H, V], the final state [B or N, H, K, V] and the `ChunkIntermediates`. Computes in the
    compute dtype; in float64 it is the reference the Triton stages are tested against. Not differentiable
    in any useful way (slow); use `naive_recurrent_kda` for gradients."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    dtype = compute_dtype(q.dtype)
    q, k = prepare_qk(q, k, scale, use_qk_l2norm_in_kernel, dtype)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, cu[s], cu[s + 1]) for s in range(len(cu) - 1)]
    n_chunks = [-(-(end - start) // C) for _, start, end in spans]
    NT = max(n_chunks, default=0) if cu_seqlens is None else sum(n_chunks)
    gk, Aqk, Ainv = g.new_zeros(B, T, H, K), g.new_zeros(B, T, H, C), g.new_zeros(B, T, H, C)
    w, u = q.new_zeros(B, T, H, K), v.new_zeros(B, T, H, V)
    v_new, o = v.new_zeros(B, T, H, V), v.new_zeros(B, T, H, V)
    hs = q.new_zeros(B, NT, H, K, V)
    finals = []
    chunk_id = 0
    for s, (b, start, end) in enumerate(spans):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[s].to(dtype).clone()  # [H, K, V]
        if cu_seqlens is None:
            chunk_id = 0
        for c0 in range(start, end, C):
            c1 = min(c0 + C, end)
            n = c1 - c0
            qc, kc, vc, bc = (x[b, c0:c1].transpose(0, 1) for x in (q, k, v, beta))  # [H, n, ·], beta [H, n]
            G = g[b, c0:c1].transpose(0, 1).cumsum(1)  # [H, n, K]
            # e^{Γ_t − Γ_j} for j ≤ t; j > t is masked below, clamped first so it cannot overflow into inf·0
            pair = (G.unsqueeze(2) - G.unsqueeze(1)).clamp_max(0.0).exp()  # [H, n, n, K]
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            aqk = torch.einsum("htc,hjc,htjc->htj", qc, kc, pair) * causal
            akk = torch.einsum("htc,hjc,htjc->htj", kc, kc, pair) * causal.tril(-1)
            eye = torch.eye(n, dtype=dtype, device=q.device)
            ainv = torch.linalg.inv(eye + bc.unsqueeze(-1) * akk)  # [H, n, n]
            wc = ainv @ (bc.unsqueeze(-1) * kc * G.exp())  # [H, n, K]
            uc = ainv @ (bc.unsqueeze(-1) * vc)  # [H, n, V]
            hs[b, chunk_id] = S
            vn = uc - wc @ S  # [H, n, V]
            o[b, c0:c1] = ((qc * G.exp()) @ S + aqk @ vn).transpose(0, 1)
            S = S * G[:, -1].exp().unsqueeze(-1) + (kc * (G[:, -1:] - G).exp()).transpose(1, 2) @ vn
            gk[b, c0:c1] = G.transpose(0, 1)
            Aqk[b, c0:c1, :, :n] = aqk.transpose(0, 1)
            Ainv[b, c0:c1, :, :n] = ainv.transpose(0, 1)
            w[b, c0:c1], u[b, c0:c1], v_new[b, c0:c1] = wc.transpose(0, 1), uc.transpose(0, 1), vn.transpose(0, 1)
            chunk_id += 1
        finals.append(S)
    final = torch.stack(finals) if finals else q.new_zeros(0, H, K, V)  # [B or N, H, K, V]
    return o, final, ChunkIntermediates(gk, Aqk, Ainv, w, u, hs, v_new)
