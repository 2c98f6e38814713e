"""AttnRes mixing operator (docs/model_spec.md §7): `attn_res_mix(sources, query, eps)`.

Softmax over the sources of `query · RMSNorm(v_i)`, applied to the raw sources. Picks the Triton
kernels (kernels/attn_res/fused.py) where kernels/dispatch.py `use_triton` says so (CUDA tensors) and
the sources are not float64, the PyTorch reference (kernels/attn_res/naive.py) otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3rl.kernels.attn_res.fused import attn_res_mix_triton
from k3rl.kernels.attn_res.naive import naive_attn_res_mix
from k3rl.kernels.dispatch import use_triton


def attn_res_mix(sources: Sequence[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """Mix of N sources [..., d] scored by query [d] → [..., d]; one source is returned as is."""
    if len(sources) == 1:
        return sources[0]
    first = sources[0]
    # float64 stays on the reference: the kernels compute in fp32
    if use_triton(first) and first.dtype != torch.float64:
        return attn_res_mix_triton(sources, query, eps)
    return naive_attn_res_mix(sources, query, eps)


__all__ = ["attn_res_mix", "attn_res_mix_triton", "naive_attn_res_mix"]
