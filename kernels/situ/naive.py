"""Plain PyTorch reference of the SiTU-GLU activation (docs/model_spec.md §8.3).

    SiTU-GLU(g, u) = β·tanh(g/β)·σ(g) ⊙ β_lin·tanh(u/β_lin)

The gate half is a SiLU whose input is soft-clipped to (-β, β); the linear half is soft-clipped
to (-β_lin, β_lin). `linear_beta=None` leaves the linear half unclipped (u itself).
"""

from __future__ import annotations

import torch


def situ(x: torch.Tensor, beta: float) -> torch.Tensor:
    """SiTU(x) = β·tanh(x/β)·σ(x), the gate activation."""
    return beta * torch.tanh(x / beta) * torch.sigmoid(x)


def naive_situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU(gate) ⊙ β_lin·tanh(up/β_lin); all shapes equal, computed in the input dtype."""
    lin = up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta)
    return situ(gate, beta) * lin
