"""Recurrent KDA for decoding: docs/model_spec.md §5.3 token by token, vectorised over sequences and heads.

Same math as `naive.py`; what differs is the work per step. The decays exp(g), the casts, the L2 norm and
the q scale are done once for the whole input, the state update is one batched rank-1 `baddbmm`, and with
autograd off the state is updated in place. It is the path for T = 1 decode steps that carry the state
from a `chunk_kda` prefill (§5.6), and for short multi-token steps (speculative decode).
`cu_seqlens` runs N packed sequences, each with its own initial/final state [N, H, K, V].
"""

from __future__ import annotations

import torch

from k3rl.kernels.kda.utils import check_inputs, compute_dtype, pack_to_padded, padded_to_packed, prepare_qk, varlen_index


def fused_recurrent_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA by the recurrence, one step per token.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log decay ≤ 0; beta: [B, T, H].
        scale: multiplies q; default K^-1/2.
        initial_state: [B, H, K, V] (or [N, H, K, V] with cu_seqlens); zeros if None.
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first (docs/model_spec.md §5.1).
        cu_seqlens: int64 [N + 1] boundaries of N sequences packed along T (then B must be 1).

    Returns:
        o [B, T, H, V] in the input dtype, final state [B or N, H, K, V] (compute dtype) or None.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if cu_seqlens is not None:
        seq_idx, pos_idx, t_max = varlen_index(cu_seqlens)
        n = cu_seqlens.numel() - 1
        padded = [pack_to_padded(x, seq_idx, pos_idx, n, t_max) for x in (q, k, v, g, beta)]
        o, state = _recurrent(*padded, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)
        return padded_to_packed(o, seq_idx, pos_idx), state
    return _recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)


def _recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    q, k = prepare_qk(q, k, scale, use_qk_l2norm_in_kernel, dtype)
    # Token-major, with B and H merged, so each step reads contiguous [B*H, ·] slices.
    q = q.transpose(0, 1).reshape(T, B * H, 1, K)  # [T, B*H, 1, K]
    k = k.transpose(0, 1).reshape(T, B * H, K)  # [T, B*H, K]
    v = v.to(dtype).transpose(0, 1).reshape(T, B * H, 1, V)  # [T, B*H, 1, V]
    decay = g.to(dtype).exp().transpose(0, 1).reshape(T, B * H, K, 1)  # [T, B*H, K, 1]
    beta = beta.to(dtype).transpose(0, 1).reshape(T, B * H, 1, 1)  # [T, B*H, 1, 1]
    if initial_state is None:
        S = q.new_zeros(B * H, K, V)  # [B*H, K, V]
    else:
        S = initial_state.to(dtype).reshape(B * H, K, V)
    track_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, decay, beta, S)
    )
    if not track_grad:
        S = S.clone()
    outputs = []
    for t in range(T):
        kt = k[t]  # [B*H, K]
        if track_grad:
            S = S * decay[t]
            u = beta[t] * (v[t] - torch.bmm(kt.unsqueeze(1), S))  # [B*H, 1, V]
            S = torch.baddbmm(S, kt.unsqueeze(2), u)
        else:
            S.mul_(decay[t])
            u = beta[t] * (v[t] - torch.bmm(kt.unsqueeze(1), S))  # [B*H, 1, V]
            S.baddbmm_(kt.unsqueeze(2), u)
        outputs.append(torch.bmm(q[t], S))  # [B*H, 1, V]
    if T > 0:
        o = torch.stack(outputs, dim=0).view(T, B, H, V).transpose(0, 1).contiguous()  # [B, T, H, V]
    else:
        o = v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (S.view(B, H, K, V) if output_final_state else None)
