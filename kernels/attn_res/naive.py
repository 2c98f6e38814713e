"""Plain PyTorch reference of the AttnRes mixing operator (docs/model_spec.md §7, the "Mix" paragraph).

    logit_i = q · v_i / sqrt(mean(v_i²) + eps)      q = γ ⊙ w (the RMSNorm weight times the projection row)
    α = softmax_i(logit_i)                           per token, over the sources only, no temperature
    Mix = Σ_i α_i v_i                                the RAW sources, not the normalised ones

In ≥ fp32 (float64 stays float64), rounded back to the sources' dtype. These are exactly the
operations model/attn_res.py ran before the op moved here, in the same order, so the CPU path of
the model is unchanged bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def naive_attn_res_mix(v: torch.Tensor | Sequence[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """Mix of N sources: `v` a list of N tensors [..., d] or one stacked [N, ..., d]; query [d] → [..., d]."""
    if isinstance(v, torch.Tensor):
        v = v.movedim(0, -2).contiguous()  # [..., N, d], laid out as torch.stack(dim=-2) makes it
    else:
        v = torch.stack(list(v), dim=-2)  # [..., N, d]
    vf = v.to(torch.promote_types(v.dtype, torch.float32))
    keys = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)  # [..., N, d]
    alpha = torch.softmax(keys @ query.to(vf.dtype), dim=-1)  # [..., N]
    return (alpha.unsqueeze(-2) @ vf).squeeze(-2).to(v.dtype)  # [..., d]
