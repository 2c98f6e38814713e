"""Tests of the Triton grouped GEMM (kernels/moe/grouped_gemm.py), run by Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1, tests/conftest.py) with 16×16×16 tiles, against one float64 matmul per expert on the same
(rounded) inputs: output and the gradients of x and w, by relative error ‖a − b‖ / ‖b‖.

Precisions and tolerances: float32 kernels 1e-5 (exact IEEE fp32 products, fp32 accumulation over a few dozen
terms); bfloat16 3e-2 (8 mantissa bits, the output and gradients rounded to bf16). Widths are not multiples of
the 16-wide tiles; groups include empty experts (their weight gradients must be written zeros: fresh memory is
NaN-poisoned) and every row on one expert.
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe.grouped_gemm import grouped_linear_triton, tile_map

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("nan_poison")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def per_expert_matmul(x, w, counts):
    """x [M, d_in] in groups of counts, w [E, d_out, d_in] → [M, d_out], one matmul per expert."""
    outs, start = [], 0
    for e, c in enumerate(counts.tolist()):
        outs.append(x[start:start + c] @ w[e].T)
        start += c
    return torch.cat(outs)


@pytest.mark.parametrize("counts, d_in, d_out", [
    ([5, 0, 19, 0, 1, 33], 20, 13),  # empty experts, groups shorter and longer than a tile
    ([0, 0, 17], 7, 40),  # every row on the last expert
    ([0, 0, 0, 0], 9, 5),  # no rows at all: empty output, zero weight gradients
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear(counts, d_in, d_out, dtype):
    g = torch.Generator().manual_seed(len(counts) + d_in)
    counts = torch.tensor(counts)
    m, e = int(counts.sum()), counts.shape[0]
    x = torch.randn(m, d_in, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(e, d_out, d_in, generator=g, dtype=torch.float64).to(dtype)
    dy = torch.randn(m, d_out, generator=g, dtype=torch.float64).to(dtype)
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_linear_triton(xt, wt, counts)
    y.backward(dy)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref = per_expert_matmul(x64, w64, counts)
    ref.backward(dy.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert y.dtype == dtype and y.shape == (m, d_out) and wt.grad.dtype == dtype
    assert torch.isfinite(wt.grad).all()
    for got, want in ((y.detach(), ref.detach()), (xt.grad, x64.grad), (wt.grad, w64.grad)):
        if want.numel() and want.norm() > 0:
            assert rel(got, want) < tol
    for ex in (counts == 0).nonzero().flatten().tolist():
        assert torch.count_nonzero(wt.grad[ex]) == 0


def test_tile_map_covers_each_group_once():
    counts = torch.tensor([0, 3, 16, 17, 0, 40, 1])
    rows = int(counts.sum())
    tiles = tile_map(counts, 16, rows)
    covered = torch.zeros(rows, dtype=torch.long)
    stop = counts.cumsum(0)
    for r, end, ex in zip(tiles.row.tolist(), tiles.end.tolist(), tiles.expert.tolist()):
        if r == end:  # a tile past the last real one
            continue
        assert end == stop[ex] and stop[ex] - counts[ex] <= r < end
        covered[r:min(r + 16, end)] += 1
    assert torch.equal(covered, torch.ones(rows, dtype=torch.long))
    assert tiles.row.shape[0] <= rows and tiles.row.shape[0] >= int(((counts + 15) // 16).sum())

