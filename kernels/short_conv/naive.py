"""Plain per-token reference of the depthwise causal conv (docs/model_spec.md §5.1).

    y[t, c] = Σ_{i=0}^{W-1} w[c, i] · x[t-(W-1)+i, c]

Positions before the sequence start are zero, or come from `state`, which holds the last W−1
raw (pre-conv) inputs of each channel. Written as the decode loop a serving engine runs: one
token at a time, shifting the window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C], weight [C, W], state [B, C, W-1] or None → (y [B, T, C], new state [B, C, W-1])."""
    B, T, C = x.shape
    W = weight.shape[-1]
    window = x.new_zeros(B, C, W) if state is None else torch.cat([state, x.new_zeros(B, C, 1)], dim=-1)
    dtype = torch.promote_types(x.dtype, weight.dtype)
    ys = []
    for t in range(T):
        window = torch.cat([window[..., 1:], x[:, t, :, None]], dim=-1)  # [B, C, W]
        y = (window.to(dtype) * weight.to(dtype)).sum(-1)  # [B, C]
        ys.append(F.silu(y) if activation == "silu" else y)
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(B, 0, C, dtype=dtype)
    return y.to(x.dtype), window[..., 1:].contiguous()
