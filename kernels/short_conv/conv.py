"""Vectorised depthwise causal conv over [state ; x] (docs/model_spec.md §5.1, §5.6).

Prefill and decode share the code: the state (last W−1 raw inputs, zeros for a fresh
sequence) is prepended, the W sliding windows are taken with `unfold` and contracted with the
taps in one einsum, and the new state is the last W−1 columns of the concatenation. This equals
`nn.Conv1d(C, C, W, groups=C, padding=W-1)` truncated to the first T outputs when the state is
zero. A grouped `F.conv1d` computes the same, but its CPU path is slow for depthwise float64
(~0.1 s per call at toy sizes) and re-plans on every new length; with W = 4 the window product
is cheap. The products run in the promoted dtype of input and weight (the conv weights stay
fp32 under bf16, spec §13.2).

With `cu_seqlens` (packed variable-length sequences along T, B = 1, as in `chunk_kda`) the window
taps that reach back across a sequence start are zeroed, so each sequence is convolved exactly as
if it were alone, and the new state is one per sequence [N, C, W−1].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv with SiLU; returns the output and the updated conv state.

    Args:
        x: [B, T, C] raw inputs (T ≥ 0).
        weight: [C, W] per-channel taps, oldest first.
        state: [B, C, W-1] last raw inputs before `x`, or None for a fresh sequence.
        activation: "silu" or None.
        cu_seqlens: int64 [N + 1] boundaries of N fresh sequences packed along T (then B must be 1 and
            state None).
    Returns:
        y [B, T, C] in x.dtype and the new state [B, C, W-1] ([N, C, W-1] with cu_seqlens) in x.dtype.
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation: must be 'silu' or None, got {activation!r}")
    B, T, C = x.shape
    if weight.shape[0] != C:
        raise ValueError(f"weight: expected {C} channels, got shape {tuple(weight.shape)}")
    W = weight.shape[-1]
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, B, T, state)
    if state is None:
        state = x.new_zeros(B, C, W - 1)
    xs = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, W-1+T]
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if cu_seqlens is not None:
        new_state = _packed_state(xs, cu_seqlens, W)
    else:
        new_state = xs[..., xs.shape[-1] - (W - 1):].contiguous()
    if T == 0:
        return x.new_zeros(B, 0, C), new_state
    windows = xs.to(dtype).unfold(-1, W, 1)  # [B, C, T, W]
    if cu_seqlens is not None:
        # Tap i of token t reads token t−(W−1)+i: keep it only if that token is in t's own sequence.
        offset = torch.arange(T, device=x.device) - _sequence_start(cu_seqlens, T).to(x.device)  # [T]
        lag = torch.arange(W - 1, -1, -1, device=x.device)  # [W]
        own = lag[None, :] <= offset[:, None]  # [T, W]
        windows = torch.where(own, windows, torch.zeros((), dtype=dtype, device=x.device))
    y = torch.einsum("bctw,cw->bct", windows, weight.to(dtype))  # [B, C, T]
    if activation == "silu":
        y = F.silu(y)
    return y.transpose(1, 2).to(x.dtype), new_state


def _check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int, state: torch.Tensor | None) -> None:
    if B != 1:
        raise ValueError(f"cu_seqlens: the batch must be 1 (packed), got B={B}")
    if state is not None:
        raise ValueError("cu_seqlens: packed sequences start fresh; pass state=None")
    cu = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else None
    if cu is None or len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: must be a 1-D tensor rising from 0 to T={T}, got {cu_seqlens.tolist()}")


def _sequence_start(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[T] the first token of each token's sequence."""
    cu = cu_seqlens.to(dtype=torch.long)
    return torch.repeat_interleave(cu[:-1], cu.diff(), output_size=T)


def _packed_state(xs: torch.Tensor, cu_seqlens: torch.Tensor, W: int) -> torch.Tensor:
    """[N, C, W-1]: each sequence's last W−1 raw inputs (zeros before its start), from xs [1, C, W-1+T]."""
    cu = cu_seqlens.to(device=xs.device, dtype=torch.long)
    j = torch.arange(W - 1, device=xs.device)
    src = cu[1:, None] - (W - 1) + j  # [N, W-1] token index of state column j
    own = src >= cu[:-1, None]  # [N, W-1]
    cols = xs[0][:, src + W - 1]  # [C, N, W-1]; xs starts with W−1 zero columns, so the index is ≥ 0
    return torch.where(own[None], cols, torch.zeros((), dtype=xs.dtype, device=xs.device)).transpose(0, 1).contiguous()
