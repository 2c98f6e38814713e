"""kernels/short_conv: the vectorised causal conv against the per-token reference and against
torch's padded Conv1d, outputs and gradients (float64), with and without a carried state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3rl.kernels.short_conv import causal_conv1d, naive_causal_conv1d


@pytest.mark.parametrize("B,T,C,W", [(1, 1, 3, 4), (2, 37, 8, 4), (3, 65, 5, 2), (2, 9, 4, 1)])
def test_causal_conv1d_matches_reference_with_state(B, T, C, W):
    torch.manual_seed(T)
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, W, dtype=torch.float64, requires_grad=True)
    y, state = causal_conv1d(x, w)
    y_ref, state_ref = naive_causal_conv1d(x, w)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(state, state_ref)
    padded = F.silu(F.conv1d(x.transpose(1, 2), w[:, None], padding=W - 1, groups=C)[..., :T]).transpose(1, 2)
    torch.testing.assert_close(y, padded)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), g)
    grads_ref = torch.autograd.grad(y_ref, (x, w), g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b)
    split = T // 2
    y1, s1 = causal_conv1d(x[:, :split], w)
    y2, s2 = causal_conv1d(x[:, split:], w, s1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)
    torch.testing.assert_close(s2, state)


def test_bf16_input_with_fp32_weight_and_bad_args():
    x = torch.randn(2, 5, 4).bfloat16()
    w = torch.randn(4, 3)
    y, state = causal_conv1d(x, w, activation=None)
    assert y.dtype == state.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), naive_causal_conv1d(x.float(), w, activation=None)[0], atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, torch.randn(5, 3))


@pytest.mark.parametrize("lengths,W", [([5, 1, 12, 0, 3], 4), ([1, 1, 1], 4), ([7, 9], 2), ([6, 4], 1)])
def test_causal_conv1d_varlen(lengths, W):
    """Packed sequences (`cu_seqlens`): outputs, per-sequence states and gradients equal each sequence alone."""
    torch.manual_seed(len(lengths) + W)
    C = 5
    x = torch.randn(1, sum(lengths), C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, W, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    y, state = causal_conv1d(x, w, cu_seqlens=cu)
    parts = [naive_causal_conv1d(x[:, a:b], w) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    torch.testing.assert_close(y, torch.cat([p[0] for p in parts], 1))
    assert state.shape == (len(lengths), C, W - 1)
    torch.testing.assert_close(state, torch.cat([p[1] for p in parts], 0))
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), g)
    grads_ref = torch.autograd.grad(torch.cat([p[0] for p in parts], 1), (x, w), g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b)


def test_causal_conv1d_varlen_bad_args():
    x = torch.randn(2, 6, 3)
    w = torch.randn(3, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x[:1], w, state=torch.zeros(1, 3, 3), cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x[:1], w, cu_seqlens=torch.tensor([0, 4, 2, 6]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x[:1], w, cu_seqlens=torch.tensor([0, 5]))
