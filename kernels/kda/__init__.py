"""Kimi Delta Attention ops (docs/model_spec.md §5): the entry points the model calls.

- `chunk_kda`: chunked KDA for training and prefill (forward and backward);
- `fused_recurrent_kda`: the token-by-token state update for decode (and short multi-token steps);
- `kda_gate` / `FusedGate`: the per-channel log decay g, computed here or handed to the op as raw inputs so
  the Triton kernels compute it in-kernel (with the lower bound set, the chunked kernel factors its diagonal
  tiles by plain matmuls, §5.7).
Both ops take g as a tensor or a `FusedGate` and pick their path per call (kernels/dispatch.py): the Triton
kernels (chunk_triton.py + chunk_fwd.py / chunk_bwd.py, recurrent_triton.py) on CUDA tensors, the
PyTorch paths (chunk.py `chunk_kda_torch`, recurrent.py `fused_recurrent_kda_torch`) elsewhere. The names are
flash-linear-attention's (`fla.ops.kda`): a reader from fla who calls `chunk_kda` gets the fast path. Every
path equals `naive_recurrent_kda` (naive.py), the literal §5.3 recurrence, and `naive_chunk_kda`, the §5.5
chunked form written plainly.
"""

from __future__ import annotations

import torch

from k3rl.kernels.dispatch import use_triton
from k3rl.kernels.kda.chunk import chunk_kda_torch
from k3rl.kernels.kda.gate import FusedGate, kda_gate
from k3rl.kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda
from k3rl.kernels.kda.recurrent import fused_recurrent_kda_torch


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | FusedGate,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA, q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K] or FusedGate, beta [B, T, H]
    → o [B, T, H, V] (input dtype), final state [B or N, H, K, V] (fp32) or None. See chunk.py `chunk_kda_torch`."""
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    # float64 (exactness tests on a GPU) stays on PyTorch: the kernels compute in fp32
    if use_triton(q) and q.dtype != torch.float64:
        from k3rl.kernels.kda.chunk_triton import chunk_kda_triton

        return chunk_kda_triton(q, k, v, g, beta, **kw)
    return chunk_kda_torch(q, k, v, g.log_decay() if isinstance(g, FusedGate) else g, beta, **kw)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | FusedGate,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent KDA (decode), same tensors and result as `chunk_kda`; see recurrent.py `fused_recurrent_kda_torch`."""
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    gate_in = (g.f, g.A_log, g.dt_bias) if isinstance(g, FusedGate) else (g,)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, beta, initial_state, *gate_in))
    # the Triton decode kernel is forward-only; a differentiable call (tests, a short prefill) takes PyTorch
    if use_triton(q) and not needs_grad and q.dtype != torch.float64:
        from k3rl.kernels.kda.recurrent_triton import fused_recurrent_kda_triton

        return fused_recurrent_kda_triton(q, k, v, g, beta, **kw)
    return fused_recurrent_kda_torch(q, k, v, g.log_decay() if isinstance(g, FusedGate) else g, beta, **kw)


__all__ = ["FusedGate", "chunk_kda", "kda_gate", "fused_recurrent_kda", "naive_chunk_kda", "naive_recurrent_kda"]
