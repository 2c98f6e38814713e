"""Block Attention Residuals (docs/model_spec.md §7) and the RMSNorm every K3 layer uses (§13.1).

AttnRes replaces the additive residual stream. Each token carries a bank of block sums
`B[0..]` (`B[0]` is the embedding) and the partial sum `P` of the current block; the input
of every sublayer is a softmax mix of the sources `B[0..] ∪ {P}`:

    logit_i = w · RMSNorm_γ(v_i)        α = softmax_i(logit_i)        Mix = Σ_i α_i v_i

with raw (un-normalised) values, no temperature and fp32 arithmetic (rounded back to the
activation dtype). A block of S layers closes at the mixer input of its first layer: layer ℓ
with ℓ % S == 0 mixes `B ∪ {P}` and then moves P into the bank; its mixer output starts the new
P. The FFN input and the model output mix `B ∪ {P}` as well; the output then goes to `model.norm`.

Departure from the spec's closed form (§7): at a block-closing layer ℓ > 0 the spec lists the
mixer sources as `B[0..ℓ/S−1]` without P (and counts `ceil(ℓ/S)+[ℓ%S≠0]` sources). The
released implementations (vLLM/SGLang `_apply_attn_res(prefix_sum, block_residual, …,
prev_valid_blocks)`, HF `modeling_kimi_linear._forward_attn_residual`) always mix the current
prefix sum as the last source, i.e. `B[0..ℓ/S−1] ∪ {P}` = `B[0..ℓ/S]` after the write. We follow
the released code, since checkpoints must load there; every other count matches §7.
With AttnRes off (`attn_res_block_size=None`) the same code is the plain pre-norm residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3rl.kernels.attn_res import attn_res_mix as kernel_attn_res_mix


class RMSNorm(nn.Module):
    """`γ ⊙ x / sqrt(mean(x²) + eps)` with γ initialised to ones (not a (1+γ) form), computed in ≥ fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(xf.dtype) * y).to(x.dtype)


def attn_res_mix(sources: list[torch.Tensor], proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
    """Softmax mix of `sources` (each [..., d]) scored by `proj.weight` [1, d] · RMSNorm_{norm}(source).

    One source returns that source unchanged (the softmax weight is exactly 1).
    """
    if len(sources) == 1:
        return sources[0]
    dtype = torch.promote_types(sources[0].dtype, torch.float32)
    query = norm.weight.to(dtype) * proj.weight.to(dtype).squeeze(0)  # [d]; only γ ⊙ w matters
    return kernel_attn_res_mix(sources, query, norm.eps)  # [..., d]


@dataclass(eq=False)
class ResidualStream:
    """The per-token residual state threaded through the decoder layers.

    With AttnRes (`block_size` set): `blocks` is the bank B and `partial` is P. Without it,
    `blocks` stays empty and `partial` is the ordinary residual stream h, so the same three
    calls give `h = h + Mixer(norm(h)); h = h + FFN(norm(h))`.
    The object is rebuilt, never mutated, so a layer can be re-run under activation checkpointing.
    A dataclass so that module hooks which look for tensors in a layer's inputs and outputs find them
    (FSDP2 gathers a layer's parameters again for backward from hooks on its output tensors).
    """

    blocks: tuple[torch.Tensor, ...]
    partial: torch.Tensor | None
    block_size: int | None

    @classmethod
    def start(cls, embeddings: torch.Tensor, block_size: int | None) -> ResidualStream:
        """Layer 0 sees the embedding as its only source; it becomes B[0] at the first block write."""
        return cls((), embeddings, block_size)

    def mixer_input(self, layer_idx: int, proj: nn.Linear | None, norm: RMSNorm | None, recompute: bool = False
                    ) -> tuple[torch.Tensor, ResidualStream]:
        """Input of layer `layer_idx`'s token mixer (before `input_layernorm`) and the updated stream; `recompute`:
        the mix keeps only its sources (which the stream holds anyway) and runs again in backward."""
        if self.block_size is None:
            return self.partial, self
        x = _mix([*self.blocks, self.partial], proj, norm, recompute)
        if layer_idx % self.block_size == 0:
            return x, ResidualStream((*self.blocks, self.partial), None, self.block_size)
        return x, self

    def add(self, output: torch.Tensor) -> ResidualStream:
        """Accumulate a sublayer output into P (a new block starts with its mixer output)."""
        partial = output if self.partial is None else self.partial + output
        return ResidualStream(self.blocks, partial, self.block_size)

    def mix(self, proj: nn.Linear | None, norm: RMSNorm | None, recompute: bool = False) -> torch.Tensor:
        """FFN input / final hidden state: Mix(B ∪ {P}) with AttnRes, h without (`recompute` as `mixer_input`)."""
        if self.block_size is None:
            return self.partial
        return _mix([*self.blocks, self.partial], proj, norm, recompute)


def _mix(sources: list[torch.Tensor], proj: nn.Linear, norm: RMSNorm, recompute: bool) -> torch.Tensor:
    """attn_res_mix, under `recompute` without its saved tensors (the stacked sources and their fp32 keys, n × d
    values per token: a fifth of a K3 layer's, rl/pretrain/cost.py) — a weighted sum, cheap to run again."""
    if not recompute:
        return attn_res_mix(sources, proj, norm)
    return checkpoint(lambda *src: attn_res_mix(list(src), proj, norm), *sources, use_reentrant=False)
