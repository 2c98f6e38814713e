"""Routed experts on Triton kernels: `triton_experts(z, ids, weights, w1, w3, w2, act)`.

    sort the (token, slot) pairs by expert          kernels/moe/permute.py `dispatch` (argsort, bincount)
    h = SiTU-GLU(Z W1ᵀ, Z W3ᵀ), Y = h W2ᵀ per expert    kernels/moe/gate_up.py (fused, one autograd Function)
    out[t] = Σ_k w_k · Y[(t, k)]                     `Dispatch.combine` (index_add in ≥ fp32, PyTorch)

The activation is fused only when it is a `SituGLU` (the form model/moe.py hands the experts); any other
`act` runs as three grouped GEMMs (kernels/moe/grouped_gemm.py) with `act` applied in PyTorch between them.
The un-permute stays PyTorch's index_add (no Triton scatter): it reads Y once and is differentiable in the
router weights as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3rl.kernels.moe.gate_up import expert_mlp_situ
from k3rl.kernels.moe.grouped_gemm import grouped_linear_triton
from k3rl.kernels.moe.permute import dispatch
from k3rl.kernels.situ import situ_glu

# Storage dtypes the kernels multiply (tl.dot); others (float64) take the PyTorch paths.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SituGLU:
    """The SiTU-GLU activation act(gate, up) = situ_glu(gate, up, beta, linear_beta) as a value the Triton
    experts recognise and fuse into the gate/up GEMM (docs/model_spec.md §8.3)."""

    beta: float
    linear_beta: float | None

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return situ_glu(gate, up, self.beta, self.linear_beta)


def supports(z: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the Triton kernels take these tensors: one dtype they multiply."""
    return z.dtype in DTYPES and all(w.dtype == z.dtype for w in (w1, w3, w2))


def triton_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor, act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """z [N, d], ids/weights [N, k], w1/w3 [E, I, d], w2 [E, d, I] (z and the weights in one of `DTYPES`) →
    [N, d] in z's dtype. On CPU tensors it needs TRITON_INTERPRET=1."""
    if not supports(z, w1, w3, w2):
        raise ValueError(f"triton_experts: z and the weights must share one dtype of {DTYPES}, got "
                         f"{z.dtype}, {w1.dtype}, {w3.dtype}, {w2.dtype}")
    plan = dispatch(ids, w1.shape[0])
    zs = plan.gather(z)  # [M = N·k, d]
    if isinstance(act, SituGLU):
        y = expert_mlp_situ(zs, w1, w3, w2, plan.counts, act.beta, act.linear_beta)  # [M, d]
    else:
        h = act(grouped_linear_triton(zs, w1, plan.counts), grouped_linear_triton(zs, w3, plan.counts))  # [M, I]
        y = grouped_linear_triton(h, w2, plan.counts)  # [M, d]
    return plan.combine(y, weights, z.dtype)
