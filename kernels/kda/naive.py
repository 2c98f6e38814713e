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

import torch

from kernels.kda.utils import check_inputs, compute_dtype, prepare_qk


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
