"""Vectorised depthwise causal conv over [state ; x] (docs/model_spec.md §5.1, §5.6).

Prefill and decode share the code: the state (last W−1 raw inputs, zeros for a fresh
sequence) is prepended, the W sliding windows are taken with `unfold` and contracted with the
taps in one einsum, and the new state is the last W−1 columns of the concatenation. This equals
`nn.Conv1d(C, C, W, groups=C, padding=W-1)` truncated to the first T outputs when the state is
zero. A grouped `F.conv1d` computes the same, but its CPU path is slow for depthwise float64
(~0.1 s per call at toy sizes) and re-plans on every new length; with W = 4 the window product
is cheap. The products run in the promoted dtype of input and weight (the conv weights stay
fp32 under bf16, spec §13.2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv with SiLU; returns the output and the updated conv state.

    Args:
        x: [B, T, C] raw inputs (T ≥ 0).
        weight: [C, W] per-channel taps, oldest first.
        state: [B, C, W-1] last raw inputs before `x`, or None for a fresh sequence.
        activation: "silu" or None.
    Returns:
        y [B, T, C] in x.dtype and the new state [B, C, W-1] in x.dtype.
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation: must be 'silu' or None, got {activation!r}")
    B, T, C = x.shape
    if weight.shape[0] != C:
        raise ValueError(f"weight: expected {C} channels, got shape {tuple(weight.shape)}")
    W = weight.shape[-1]
    if state is None:
        state = x.new_zeros(B, C, W - 1)
    xs = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, W-1+T]
    dtype = torch.promote_types(x.dtype, weight.dtype)
    new_state = xs[..., xs.shape[-1] - (W - 1):].contiguous()
    if T == 0:
        return x.new_zeros(B, 0, C), new_state
    windows = xs.to(dtype).unfold(-1, W, 1)  # [B, C, T, W]
    y = torch.einsum("bctw,cw->bct", windows, weight.to(dtype))  # [B, C, T]
    if activation == "silu":
        y = F.silu(y)
    return y.transpose(1, 2).to(x.dtype), new_state
