"""Tests of the Triton routed experts (kernels/moe/triton.py, gate_up.py, grouped_gemm.py), run by Triton's
interpreter on CPU tensors (TRITON_INTERPRET=1, tests/conftest.py) with 16×16×16 tiles, against the per-expert
loop (naive.py) and a per-expert matmul loop computed in float64 on the same (rounded) inputs: outputs and
the gradients of every input, by relative error ‖a − b‖ / ‖b‖.

Precisions and tolerances:
- float32 kernels vs the float64 reference: 2e-6 (measured 1e-7 to 3e-7). The tiles are multiplied as exact
  IEEE fp32 products with fp32 accumulation over a few dozen terms, and the SiTU epilogue's tanh and σ
  (kernels/situ/fused.py) are accurate to a few fp32 ulps.
- bfloat16 kernels vs the float64 reference on the same bf16 inputs: 2e-2 (measured 3e-3 for one GEMM,
  6e-3 to 7e-3 for the experts). bf16 keeps 8 mantissa bits (half-ulp 2⁻⁹ ≈ 2e-3); the output, h and the
  gate/up gradients are each rounded to bf16 between the GEMMs, so several half-ulps add up.
Widths are not multiples of the 16-wide tiles; routings include experts no token chose (their weight
gradients must be written zeros: fresh memory is NaN-poisoned by tests/kernels/conftest.py) and every token
on one expert.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3rl.kernels.moe import SituGLU, grouped_experts, grouped_linear_triton, naive_experts, routed_experts, triton_experts
from k3rl.kernels.moe.grouped_gemm import tile_map
from k3rl.kernels.situ import naive_situ_glu

pytestmark = pytest.mark.triton
BETA = 4.0


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
    tol = 2e-6 if dtype == torch.float32 else 2e-2
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


def make_inputs(n, k, e, d, inter, dtype, seed, empty=(), one_expert=None):
    """Random tokens and weights rounded to `dtype`; top-k of random scores with the experts in `empty` never
    chosen, or every token's first slot on `one_expert`."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g, dtype=torch.float64)
    scores = torch.rand(n, e, generator=g, dtype=torch.float64)
    scores[:, list(empty)] = -1.0
    ids = scores.topk(k, dim=-1).indices
    if one_expert is not None:
        ids[:, 0] = one_expert
        ids[:, 1:] = (one_expert + 1 + torch.arange(k - 1)) % e
    weights = torch.rand(n, k, generator=g, dtype=torch.float64)
    w1, w3 = (torch.randn(e, inter, d, generator=g, dtype=torch.float64) * d ** -0.5 for _ in range(2))
    w2 = torch.randn(e, d, inter, generator=g, dtype=torch.float64) * inter ** -0.5
    return [t.to(dtype) if t.is_floating_point() else t for t in (z, ids, weights, w1, w3, w2)]


def run(fn, inputs, act, dtype=None):
    """Output and gradients of z, weights, w1, w3, w2 for a fixed random output gradient; inputs cast to
    `dtype` first when given."""
    ts = [t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in inputs]
    z, ids, weights, w1, w3, w2 = (t.clone().requires_grad_(t.is_floating_point()) for t in ts)
    out = fn(z, ids, weights, w1, w3, w2, act)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    out.backward(dy.to(out.dtype))
    return [out.detach()] + [t.grad for t in (z, weights, w1, w3, w2)]


def reference(inputs, linear_beta):
    return run(naive_experts, inputs, lambda g, u: naive_situ_glu(g, u, BETA, linear_beta), torch.float64)


CASES = {  # each a shape, a routing and a linear β (25: clipped up half, None: plain up)
    "empty_expert": dict(n=13, k=2, e=8, d=20, inter=12, empty=(3, 5), linear_beta=25.0),
    "top1_e3": dict(n=7, k=1, e=3, d=18, inter=24, linear_beta=None),
    "one_expert": dict(n=11, k=1, e=8, d=16, inter=20, one_expert=6, linear_beta=25.0),
    "top2_e3_wide": dict(n=5, k=2, e=3, d=33, inter=40, empty=(0,), linear_beta=None),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_triton_experts_float32(case):
    shape = {key: v for key, v in case.items() if key != "linear_beta"}
    inputs = make_inputs(**shape, dtype=torch.float32, seed=case["n"] + case["d"])
    got = run(triton_experts, inputs, SituGLU(BETA, case["linear_beta"]))
    want = reference(inputs, case["linear_beta"])
    assert got[0].dtype == torch.float32
    for name, a, b in zip(("out", "z", "weights", "w1", "w3", "w2"), got, want):
        assert rel(a, b) < 2e-6, (name, rel(a, b))
    unused = set(range(case["e"])) - set(inputs[1].flatten().tolist())
    assert unused or "empty" not in case
    for w_grad in got[3:]:
        assert torch.isfinite(w_grad).all()
        for ex in unused:
            assert torch.count_nonzero(w_grad[ex]) == 0


def test_triton_experts_bfloat16():
    inputs = make_inputs(n=13, k=2, e=8, d=20, inter=12, empty=(3, 5), dtype=torch.bfloat16, seed=3)
    got = run(triton_experts, inputs, SituGLU(BETA, 25.0))
    want = reference(inputs, 25.0)
    assert got[0].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    for name, a, b in zip(("out", "z", "weights", "w1", "w3", "w2"), got, want):
        assert rel(a, b) < 2e-2, (name, rel(a, b))


def test_other_activation_runs_unfused():
    """An activation that is not a SituGLU (SwiGLU here) runs as three Triton grouped GEMMs around it."""
    inputs = make_inputs(n=9, k=2, e=3, d=16, inter=8, dtype=torch.float32, seed=11, empty=(1,))

    def swiglu(g, u):
        return F.silu(g) * u

    got = run(triton_experts, inputs, swiglu)
    want = run(naive_experts, inputs, swiglu, torch.float64)
    for a, b in zip(got, want):
        assert rel(a, b) < 2e-6


def test_dispatch_and_edge_cases():
    inputs = make_inputs(n=6, k=2, e=4, d=8, inter=4, dtype=torch.float32, seed=12)
    act = SituGLU(BETA, 25.0)
    # On CPU tensors `auto` is the PyTorch grouped path; SituGLU computes what the plain activation does.
    assert torch.equal(routed_experts(*inputs, act), grouped_experts(*inputs, act))
    assert torch.equal(act(inputs[0], inputs[0]), naive_situ_glu(inputs[0], inputs[0], BETA, 25.0))
    z, ids, weights, w1, w3, w2 = inputs
    out = routed_experts(z[:0], ids[:0], weights[:0], w1, w3, w2, act, "triton")
    assert out.shape == (0, 8)
    with pytest.raises(ValueError, match="share one dtype"):
        triton_experts(z.double(), ids, weights, w1.double(), w3.double(), w2.double(), act)
