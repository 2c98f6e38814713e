"""KDA decay gate (docs/model_spec.md §5.2): the per-channel natural-log decay g ≤ 0 fed to the KDA ops.

    z[h, c] = f[h, c] + dt_bias[h·K + c],    a_h = exp(A_log[h])
    unbounded (Kimi-Linear / released K3):   g = −a_h · softplus(z)        (softplus threshold 20 → identity)
    lower bound lb ∈ [−5, 0) (K3 report):    g = lb · σ(a_h · z)           so every per-token decay is > e^{lb}

The lower-bound form is what lets `chunk_kda` factor its 16×16 diagonal tiles through plain matmuls
(§5.7: |Γ_t − Γ_n| < 8·|lb| ≤ 40 nats around the tile midpoint). Computed in at least float32, as vLLM keeps
A_log and dt_bias in fp32 (§13.2); a float64 model (exactness tests) gets a float64 gate. β = σ(b̃) is not computed
here: it is one sigmoid in the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class FusedGate:
    """The raw gate inputs, passed to a KDA op in place of g so the op computes g itself (in-kernel on GPU).

    `chunk_kda(q, k, v, FusedGate(f, A_log, dt_bias, lb), beta)` equals
    `chunk_kda(q, k, v, kda_gate(f, A_log, dt_bias, lb), beta)`, with gradients for f, A_log and dt_bias.
    With `lower_bound` set, the chunked Triton kernel factors its diagonal tiles by plain matmuls (§5.7).
    """

    f: torch.Tensor  # [B, T, H*K] or [B, T, H, K] raw gate input (output of f_b_proj)
    A_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor | None  # [H*K] or None
    lower_bound: float | None = None

    def log_decay(self) -> torch.Tensor:
        """g [B, T, H, K] ≥ fp32, by the plain PyTorch gate."""
        return kda_gate(self.f, self.A_log, self.dt_bias, self.lower_bound)


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """Per-channel log decay g from the raw gate input f.

    Args:
        f: [B, T, H*K] or [B, T, H, K] raw gate input (output of f_b_proj).
        A_log: [H] log of the decay scale (unbounded) or of the sigmoid's inverse temperature (bounded).
        dt_bias: [H*K] flat bias added to f (docs/model_spec.md §13.3), or None for no bias.
        lower_bound: None for the softplus form; else lb ∈ [−5, 0) (config key `gate_lower_bound`).

    Returns:
        g: [B, T, H, K] in float32 (float64 for float64 f), ≤ 0.
    """
    H = A_log.shape[0]
    if f.dim() == 3:
        if f.shape[-1] % H != 0:
            raise ValueError(f"f's last dim {f.shape[-1]} is not a multiple of H={H} (len(A_log))")
        f = f.unflatten(-1, (H, f.shape[-1] // H))  # [B, T, H, K]
    elif f.dim() != 4 or f.shape[2] != H:
        raise ValueError(f"f must be [B, T, H*K] or [B, T, H, K] with H={H}, got {tuple(f.shape)}")
    K = f.shape[-1]
    dtype = torch.promote_types(f.dtype, torch.float32)  # fp32 for half models, fp64 for a float64 one (tests)
    z = f.to(dtype)
    if dt_bias is not None:
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias must be flat [H*K]={H * K}, got {tuple(dt_bias.shape)}")
        z = z + dt_bias.to(dtype).view(H, K)
    a = A_log.to(dtype).exp().unsqueeze(-1)  # [H, 1]
    if lower_bound is None:
        return -a * F.softplus(z, beta=1.0, threshold=20.0)  # [B, T, H, K]
    lb = float(lower_bound)
    if not -5.0 <= lb < 0.0:
        raise ValueError(f"gate_lower_bound must be in [-5, 0), got {lower_bound}")
    return lb * torch.sigmoid(a * z)  # [B, T, H, K]
