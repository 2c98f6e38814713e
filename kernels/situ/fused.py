"""Fused SiTU-GLU in Triton: one pass over (gate, up) forward, one pass backward.

The activation is elementwise and memory-bound, so fusing it saves the intermediate tensors the
PyTorch expression materialises (two tanh, one sigmoid, two products): forward reads g and u
once and writes y; backward reads g, u, dy and writes dg, du, recomputing the activations
instead of saving them. Math in fp32 whatever the storage dtype. tanh is written through the
sigmoid (tanh x = 2σ(2x) − 1) so the kernel runs under TRITON_INTERPRET=1 as well as on a GPU.

    y  = s(g)·l(u),        s(g) = β·tanh(g/β)·σ(g),    l(u) = β_l·tanh(u/β_l)   (docs/model_spec.md §8.3)
    dg = dy·l(u)·[(1 − tanh²(g/β))·σ(g) + β·tanh(g/β)·σ(g)·(1 − σ(g))]
    du = dy·s(g)·(1 − tanh²(u/β_l))
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.situ.naive import naive_situ_glu

BLOCK = 1024


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _situ_glu_fwd_kernel(g_ptr, u_ptr, y_ptr, n, beta, lin_beta, HAS_LIN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = beta * _tanh(g / beta) * tl.sigmoid(g)
    if HAS_LIN:
        u = lin_beta * _tanh(u / lin_beta)
    tl.store(y_ptr + offs, (s * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_glu_bwd_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, n, beta, lin_beta,
                         HAS_LIN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(g / beta)
    sg = tl.sigmoid(g)
    s = beta * t * sg
    ds = (1.0 - t * t) * sg + beta * t * sg * (1.0 - sg)
    if HAS_LIN:
        tu = _tanh(u / lin_beta)
        lin = lin_beta * tu
        dlin = 1.0 - tu * tu
    else:
        lin = u
        dlin = 1.0
    tl.store(dg_ptr + offs, (dy * lin * ds).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dy * s * dlin).to(du_ptr.dtype.element_ty), mask=mask)


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
    """SiTU-GLU [..., N] × [..., N] → [..., N]: Triton on CUDA, the PyTorch expression on the CPU."""
    if gate.is_cuda and os.environ.get("K3RL_DISABLE_TRITON") != "1":
        return situ_glu_triton(gate, up, beta, linear_beta)
    return naive_situ_glu(gate, up, beta, linear_beta)
