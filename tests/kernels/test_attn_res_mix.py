"""AttnRes mix: the Triton kernels (interpreted on the CPU) against the float64 reference.

Inputs are drawn in float64 and rounded to the tested dtype; the reference runs in float64 on
exactly those values, so the comparison measures the kernel's arithmetic alone. Errors are
relative in the Frobenius norm, per tensor, and for the source gradients per source (a source a
thousand times smaller than another must still get its own gradient right).
"""

import pytest
import torch

from k3rl.kernels.attn_res import attn_res_mix, attn_res_mix_triton, naive_attn_res_mix

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6

# fp32: y is a convex combination (≤ 3e-7 measured). The gradients go through dy·v_i − δ, which
# cancels when the softmax is peaked (logits here are ±10); the kernel takes the top source's
# difference in a cancellation-free form and measures ≤ 3e-6 where PyTorch's fp32 autograd of the
# same formula reaches 8e-3 on dq (one token, three sources). Bound: 1e-5.
# bf16: the kernel computes in fp32, so the error is the final rounding of y and dv to bf16
# (2⁻⁹ relative per element at most, ≈ 4e-3 in norm measured); dq is fp32 (the query is fp32).
TOL = {torch.float32: {"y": 1e-6, "dv": 1e-5, "dq": 1e-5},
       torch.bfloat16: {"y": 1e-2, "dv": 1e-2, "dq": 1e-5}}


def rel(a, b):
    return ((a.double().cpu() - b).norm() / b.norm()).item()


def run(shape, d, n_src, dtype, seed, max_programs=512):
    gen = torch.Generator().manual_seed(seed)
    # scales from 1e-3 to 1e3: the logits are scale-free (RMS-normalised), the values are not
    scales = torch.logspace(-3, 3, n_src).tolist()
    srcs = [(torch.randn(*shape, d, generator=gen, dtype=torch.float64) * s).to(dtype) for s in scales]
    query = torch.randn(d, generator=gen, dtype=torch.float64).float()  # [d]; logits ≈ ±|q| ≈ ±10
    dy = torch.randn(*shape, d, generator=gen, dtype=torch.float64).to(dtype)
    s64 = [s.double().requires_grad_() for s in srcs]
    q64 = query.double().requires_grad_()
    ref = naive_attn_res_mix(s64, q64, EPS)
    ref.backward(dy.double())
    st = [s.to(DEVICE).requires_grad_() for s in srcs]
    qt = query.to(DEVICE).requires_grad_()
    out = attn_res_mix_triton(st, qt, EPS, max_programs=max_programs)
    out.backward(dy.to(DEVICE))
    assert out.dtype == dtype and out.shape == ref.shape and qt.grad.dtype == torch.float32
    tol = TOL[dtype]
    assert rel(out.detach(), ref.detach()) < tol["y"]
    assert rel(qt.grad, q64.grad) < tol["dq"]
    for i, (a, b) in enumerate(zip(st, s64)):
        assert a.grad.dtype == dtype
        assert rel(a.grad, b.grad) < tol["dv"], f"source {i} (scale {scales[i]:g})"


@pytest.mark.parametrize("d", [48, 64, 100])
@pytest.mark.parametrize("n_src", [2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_res_mix(d, n_src, dtype, nan_poison):
    # M = 2·13 = 26 tokens: not a multiple of the 8-token block (d ≤ 128); d not a power of two
    run((2, 13), d, n_src, dtype, seed=d * 10 + n_src)


@pytest.mark.parametrize("shape,max_programs", [((1,), 512), ((3, 7), 2), ((45,), 1)])
def test_attn_res_mix_lengths_and_persistent_backward(shape, max_programs, nan_poison):
    # one token; and backward grids smaller than the number of token blocks, so that a program
    # walks several blocks and its dq partial sums them
    run(shape, 100, 3, torch.float32, seed=len(shape) + max_programs, max_programs=max_programs)


def test_one_source_passes_through(nan_poison):
    v = torch.randn(3, 5, 16, device=DEVICE)
    q = torch.randn(16, device=DEVICE)
    assert attn_res_mix([v], q, EPS) is v
    # the kernel itself with one source: α = 1, y = v, dv = dy, dq = 0
    vt, qt = v.clone().requires_grad_(), q.clone().requires_grad_()
    out = attn_res_mix_triton([vt], qt, EPS)
    dy = torch.randn(3, 5, 16, device=DEVICE)
    out.backward(dy)
    torch.testing.assert_close(out.detach(), v, rtol=1e-6, atol=0)
    torch.testing.assert_close(vt.grad, dy, rtol=1e-6, atol=1e-7)
    assert qt.grad.abs().max() < 1e-6


def test_dispatch_on_cpu_is_the_reference():
    srcs = [torch.randn(4, 8) for _ in range(3)]
    q = torch.randn(8)
    if DEVICE == "cpu":
        assert torch.equal(attn_res_mix(srcs, q, EPS), naive_attn_res_mix(srcs, q, EPS))
    # the stacked form of the reference is the list form
    assert torch.equal(naive_attn_res_mix(torch.stack(srcs), q, EPS), naive_attn_res_mix(srcs, q, EPS))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="sources differ"):
        attn_res_mix_triton([torch.randn(3, 8), torch.randn(4, 8)], torch.randn(8), EPS)
    with pytest.raises(ValueError, match="query"):
        attn_res_mix_triton([torch.randn(3, 8), torch.randn(3, 8)], torch.randn(9), EPS)
