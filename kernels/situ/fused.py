"""Fused SiTU-GLU in Triton: one pass over (gate, up) forward, one pass backward.

The activation is elementwise and memory-bound, so fusing it saves the intermediate tensors the
PyTorch expression materialises (two tanh, one sigmoid, two products): forward reads g and u
once and writes y; backward reads g, u, dy and writes dg, du, recomputing the activations
instead of saving them. Math in fp32 whatever the storage dtype.

    y  = s(g)·l(u),        s(g) = β·tanh(g/β)·σ(g),    l(u) = β_l·tanh(u/β_l)   (docs/model_spec.md §8.3)
    dg = dy·l(u)·s'(g),    s'(g) = sech²(g/β)·σ(g) + β·tanh(g/β)·σ(g)(1 − σ(g))
    du = dy·s(g)·sech²(u/β_l)

What is notable: every transcendental is written here in fp32 so that it is accurate to a few
fp32 ulps *relative* over the whole range and runs the same under TRITON_INTERPRET=1 (Triton
3.9's `tl` has no tanh, and libdevice calls do not run in the interpreter):
- `exp_tl` reduces the argument by Cody–Waite (x = k·ln2 + r, |r| ≤ ln2/2) and evaluates e^r by
  its Taylor series, so its relative error does not grow with |x| the way `tl.exp` does on a
  GPU (ex2.approx of x·log2 e: ≈ |x|·2⁻²⁴ relative, 60 ulps at |x| = 90).
- `tanh_tl` is an odd minimax polynomial for |x| < 0.625 (no cancellation near 0; the former
  2σ(2x) − 1 lost all digits below |x| ≈ 1e-7) and (1 − e)/(1 + e), e = e^{−2|x|}, above.
- the derivatives are formed from e, never as 1 − tanh² or 1 − σ, which round to 0 in fp32
  once |x| ≳ 9 and 17 while the true values (≈ 4e^{−2|x|}, e^{−|x|}) are still normal numbers.
These `@triton.jit` functions (`exp_tl`, `tanh_tl`, `tanh_with_grad_tl`, `sigmoid_with_grad_tl`,
`situ_tl`, `situ_with_grad_tl`, `situ_glu_fwd_tl`, `situ_glu_bwd_tl`) are the stable API other
kernels (the MoE grouped GEMM epilogue) import to fuse the activation.

Departures from the reference (kernels/situ/naive.py): the derivative s'(g) is summed before it
multiplies dy·l(u), so at |up| = inf the gradient is ±inf where autograd through the naive
expression adds two infinite terms of opposite sign and returns NaN (g < 0 there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3rl.kernels.dispatch import use_triton
from k3rl.kernels.situ.naive import naive_situ_glu

BLOCK = 1024

# ln 2 split for Cody–Waite: _LN2_HI has 15 significant bits, so k·_LN2_HI is exact for |k| ≤ 2⁸
_LN2_HI = tl.constexpr(0.693145751953125)
_LN2_LO = tl.constexpr(1.428606765330187e-06)
_LOG2E = tl.constexpr(1.4426950408889634)
# tanh(x) = x + x³·P(x²) on |x| < _TANH_SMALL: P fitted here by Lawson-weighted least squares
# (minimax in the relative error of tanh), max approximation error 0.07 fp32 ulp
_TANH_SMALL = tl.constexpr(0.625)
_P0 = tl.constexpr(-0.3333328068256378)
_P1 = tl.constexpr(0.13331441581249237)
_P2 = tl.constexpr(-0.05373971536755562)
_P3 = tl.constexpr(0.0206390842795372)
_P4 = tl.constexpr(-0.005704984068870544)


@triton.jit
def exp_tl(x):
    """e^x in fp32, ≈ 1 ulp relative for every x (subnormal results rounded once, inf above 88.7).

    x = k·ln2 + r with k = round(x·log2 e) and |r| ≤ ln2/2; e^r by its Taylor series to r⁸
    (truncation < 2⁻²⁷); 2^k built from exponent bits as 2^⌊k/2⌋·2^(k−⌊k/2⌋) so that subnormal
    and overflowing results each round once. NaN in, NaN out.
    """
    xc = tl.minimum(tl.maximum(x, -110.0), 89.0)
    k = tl.floor(xc * _LOG2E + 0.5)
    r = (xc - k * _LN2_HI) - k * _LN2_LO
    p = 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    ki = k.to(tl.int32)
    k1 = ki >> 1
    k2 = ki - k1
    s1 = ((k1 + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((k2 + 127) << 23).to(tl.float32, bitcast=True)
    y = (p * s1) * s2
    return tl.where(x != x, x, y)


@triton.jit
def _tanh_small(x):
    # odd minimax polynomial, valid for |x| < _TANH_SMALL
    s = x * x
    p = _P4
    p = p * s + _P3
    p = p * s + _P2
    p = p * s + _P1
    p = p * s + _P0
    # x + x·(s·p) would turn −0 into +0 (s·p ≤ 0); tanh(−0) is −0
    return tl.where(x == 0.0, x, x + x * (s * p))


@triton.jit
def tanh_tl(x):
    """tanh(x) in fp32, ≤ 2 ulp relative for every x (±1 at ±inf, NaN in → NaN out, tanh(−0) = −0)."""
    t, _ = tanh_with_grad_tl(x)
    return t


@triton.jit
def tanh_with_grad_tl(x):
    """(tanh x, 1 − tanh² x), each to a few fp32 ulps relative over the whole range.

    Above |x| = 0.625 both come from e = e^{−2|x|}: tanh = ±(1 − e)/(1 + e), sech² = 4e/(1 + e)²,
    which keeps sech² accurate where 1 − tanh² would round to 0 (|x| ≳ 9).
    """
    a = tl.abs(x)
    small = a < _TANH_SMALL
    # lanes that take the exp branch (inf, NaN included) evaluate the polynomial at 0 instead
    t_small = _tanh_small(tl.where(small, x, 0.0))
    e = exp_tl(-2.0 * a)
    inv = tl.math.div_rn(1.0, 1.0 + e)
    t_big = (1.0 - e) * inv
    t_big = tl.where(x < 0, -t_big, t_big)
    t = tl.where(small, t_small, t_big)
    d = tl.where(small, 1.0 - t_small * t_small, 4.0 * e * inv * inv)
    # NaN fails `a < _TANH_SMALL` and takes the exp branch, which already returns NaN
    return t, d


@triton.jit
def sigmoid_with_grad_tl(x):
    """(σ(x), σ(x)(1 − σ(x))) from e = e^{−|x|}, both accurate relative (σ(−90) ≈ 8e−40 stays nonzero)."""
    e = exp_tl(-tl.abs(x))
    inv = tl.math.div_rn(1.0, 1.0 + e)
    sig = tl.where(x >= 0, inv, e * inv)
    sig = tl.where(x != x, x, sig)
    return sig, e * inv * inv


@triton.jit
def situ_tl(x, beta):
    """SiTU(x) = β·tanh(x/β)·σ(x) in fp32 (x fp32, β a scalar)."""
    s, _ = situ_with_grad_tl(x, beta)
    return s


@triton.jit
def situ_with_grad_tl(x, beta):
    """(SiTU(x), SiTU'(x)) with SiTU'(x) = sech²(x/β)·σ(x) + β·tanh(x/β)·σ'(x)."""
    t, dt = tanh_with_grad_tl(x / beta)
    sig, dsig = sigmoid_with_grad_tl(x)
    s = beta * t * sig
    ds = dt * sig + beta * t * dsig
    return s, ds


@triton.jit
def situ_glu_fwd_tl(g, u, beta, lin_beta, HAS_LIN: tl.constexpr):
    """y = SiTU(g)·l(u) in fp32, l(u) = β_l·tanh(u/β_l) if HAS_LIN else u. g, u fp32 tiles."""
    s = situ_tl(g, beta)
    if HAS_LIN:
        u = lin_beta * tanh_tl(u / lin_beta)
    return s * u


@triton.jit
def situ_glu_bwd_tl(g, u, dy, beta, lin_beta, HAS_LIN: tl.constexpr):
    """(dg, du) of y = SiTU(g)·l(u) for the upstream dy, in fp32; recomputes the activations."""
    s, ds = situ_with_grad_tl(g, beta)
    if HAS_LIN:
        tu, dtu = tanh_with_grad_tl(u / lin_beta)
        lin = lin_beta * tu
        du = dy * s * dtu
    else:
        lin = u
        du = dy * s
    return dy * lin * ds, du


@triton.jit
def _situ_glu_fwd_kernel(g_ptr, u_ptr, y_ptr, n, beta, lin_beta, HAS_LIN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = situ_glu_fwd_tl(g, u, beta, lin_beta, HAS_LIN)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_glu_bwd_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, n, beta, lin_beta,
                         HAS_LIN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dg, du = situ_glu_bwd_tl(g, u, dy, beta, lin_beta, HAS_LIN)
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=mask)


class _SituGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, beta, linear_beta):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        has_lin = linear_beta is not None
        _situ_glu_fwd_kernel[(triton.cdiv(n, BLOCK),)](
            gate, up, y, n, float(beta), float(linear_beta or 1.0), HAS_LIN=has_lin, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        ctx.beta, ctx.linear_beta = beta, linear_beta
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _situ_glu_bwd_kernel[(triton.cdiv(n, BLOCK),)](
            gate, up, dy.contiguous(), dg, du, n, float(ctx.beta), float(ctx.linear_beta or 1.0),
            HAS_LIN=ctx.linear_beta is not None, BLOCK=BLOCK)
        return dg, du, None, None


def situ_glu_triton(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """The Triton path, differentiable; on CPU tensors it needs TRITON_INTERPRET=1."""
    if gate.shape != up.shape:
        raise ValueError(f"situ_glu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    return _SituGLU.apply(gate, up, beta, linear_beta)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU [..., N] × [..., N] → [..., N]: Triton where kernels/dispatch.py says so, else the PyTorch expression."""
    # float64 stays on the reference: the kernels compute in fp32
    if use_triton(gate) and gate.dtype != torch.float64:
        return situ_glu_triton(gate, up, beta, linear_beta)
    return naive_situ_glu(gate, up, beta, linear_beta)
