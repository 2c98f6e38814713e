"""SiTU-GLU: the Triton kernel (interpreted on the CPU) against the float64 reference."""

import math

import pytest
import torch

from kernels.situ import naive_situ_glu, situ, situ_glu, situ_glu_triton

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_situ_formula_hand_checked():
    # β·tanh(x/β)·σ(x) at x = 2, β = 4: 4·tanh(0.5)·σ(2)
    x = torch.tensor([2.0, -3.0, 0.0], dtype=torch.float64)
    expected = [4 * math.tanh(0.5) / (1 + math.exp(-2)), 4 * math.tanh(-0.75) / (1 + math.exp(3)), 0.0]
    torch.testing.assert_close(situ(x, 4.0), torch.tensor(expected, dtype=torch.float64))
    # the linear half is soft-clipped to ±β_lin
    big = naive_situ_glu(torch.tensor([50.0]), torch.tensor([1e6]), 4.0, 25.0)
    assert abs(big.item() - 4.0 * 25.0) < 1e-3


def rel(a, b):
    return ((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 7, 129), (1031,)])
@pytest.mark.parametrize("linear_beta", [25.0, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused(shape, linear_beta, dtype):
    gen = torch.Generator().manual_seed(hash((shape, linear_beta)) % 2**31)
    # inputs representable in `dtype`, so the reference sees exactly what the kernel sees
    g, u, dy = (torch.randn(shape, generator=gen, dtype=torch.float64).mul(6).to(dtype).double() for _ in range(3))
    g64, u64 = g.clone().requires_grad_(), u.clone().requires_grad_()
    ref = naive_situ_glu(g64, u64, 4.0, linear_beta)
    ref.backward(dy)
    gt = g.to(DEVICE, dtype).requires_grad_()
    ut = u.to(DEVICE, dtype).requires_grad_()
    out = situ_glu_triton(gt, ut, 4.0, linear_beta)
    out.backward(dy.to(DEVICE, dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and gt.grad.dtype == dtype
    assert rel(out.detach(), ref.detach()) < tol
    assert rel(gt.grad, g64.grad) < tol
    assert rel(ut.grad, u64.grad) < tol


def test_dispatch_on_cpu_is_the_reference():
    g, u = torch.randn(4, 8), torch.randn(4, 8)
    if DEVICE == "cpu":
        assert torch.equal(situ_glu(g, u, 4.0, 25.0), naive_situ_glu(g, u, 4.0, 25.0))


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="gate .* up"):
        situ_glu_triton(torch.randn(3), torch.randn(4), 4.0, None)
