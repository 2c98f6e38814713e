"""Gated Multi-head Latent Attention (docs/model_spec.md §4.5, §6, §11): the full-attention token mixer of K3.

    c_q = RMSNorm(W_qa x);  q = W_qb c_q   (or q = W_q x when q_lora_rank is null)  → [q_nope ; q_pe] per head
    [kv_c ; k_pe] = W_kva x;  kv_c = RMSNorm(kv_c)          the latent: Lkv + dr values per token
    [k_nope ; v] = W_kvb kv_c per head;  key = [k_nope ; k_pe] (k_pe shared by all heads)
    a = causal softmax attention, scale (dn + dr)^-½;   y = W_o (a ⊙ σ(W_g x))

NoPE (released K3, `mla_use_nope`) leaves q_pe and k_pe unrotated; otherwise both get RoPE with
base `config.rope_theta` (read at every call, so a staged context recipe can raise it),
interleaved pairs (x[2m], x[2m+1]) as in DeepSeek MLA, at each token's position in its sequence.
Packed documents (training, `StepInfo.documents`) take the expanded form under a block-diagonal causal
mask ([B, 1, T, T] bool, built only then), their positions restarting with each document.

The decode cache holds only the latent `[kv_c ; k_pe]` (k_pe after rotation). Attention takes one
of two equivalent forms, picked in `forward`:
  * expanded (training, short prefill): keys and values are up-projected per head from the latents,
    `F.scaled_dot_product_attention`;
  * absorbed, in matmul form (one-token decode; a long prefill segment over a long cache, as
    rollout/torch_engine.py's segmented prefill): W_UK folds into the query and W_UV into the output, so
    queries attend over the cached latents directly (Lkv + dr per key) as two batched matmuls per block of
    queries, [B, t·H, D] × [B, D, S] and [B, t·H, S] × [B, S, Lkv], with the heads sharing one latent: neither
    per-head keys [S, H, ·] (what SDPA over the latents expanded per head would materialise: ~20× slower at
    16K) nor a T×S score matrix or mask ever exist — at most `SCORE_BUDGET` scores at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3rl.model.attn_res import RMSNorm
from k3rl.model.cache import StepInfo

SCORE_BUDGET = 1 << 24
"""Most attention scores (B·H·queries·keys) one step holds at once; a cached prefill step above it attends
block by block (16M fp32 scores: 64 MiB, plus the softmax's copy)."""


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate interleaved pairs of x [B, T, ..., D] by positions [B, T] · theta^(-2m/D), m < D/2."""
    D = x.shape[-1]
    dt = torch.promote_types(x.dtype, torch.float32)
    inv_freq = theta ** -(torch.arange(0, D, 2, device=x.device, dtype=dt) / D)  # [D/2]
    angle = positions.to(dt)[..., None] * inv_freq  # [B, T, D/2]
    angle = angle.view(*angle.shape[:2], *([1] * (x.ndim - 3)), D // 2)  # [B, T, 1.., D/2]
    cos, sin = angle.cos(), angle.sin()
    pairs = x.to(dt).unflatten(-1, (D // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).to(x.dtype)


class MultiheadLatentAttention(nn.Module):
    """MLA token mixer of layer `layer_idx`; checkpoint names of spec §4.5 (prefix `self_attn.`)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        d = config.hidden_size
        self.num_heads = H = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_rank = config.v_head_dim, config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        self.scale = qk_dim ** -0.5
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope_dim + self.v_dim), bias=False)
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)

    def forward(self, x: torch.Tensor, step: StepInfo) -> torch.Tensor:
        """x [B, T, d] (the normalised layer input) → [B, T, d]; appends this step's latents to `step.cache`."""
        B, T, _ = x.shape
        H, dn, dr = self.num_heads, self.nope_dim, self.rope_dim
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(B, T, H, dn + dr).split([dn, dr], dim=-1)  # [B, T, H, dn], [B, T, H, dr]
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, dr], dim=-1)  # [B, T, Lkv], [B, T, dr]
        if not self.config.mla_use_nope:
            q_pe = apply_rope(q_pe, step.positions, self.config.rope_theta)
            k_pe = apply_rope(k_pe, step.positions, self.config.rope_theta)
        latent = torch.cat([self.kv_a_layernorm(kv_c), k_pe], dim=-1)  # [B, T, Lkv + dr]
        if step.cache is not None:
            latent = step.cache.append_latent(self.layer_idx, latent, step.start)  # [B, S, Lkv + dr]

        # Over the latents in matmul form (absorbed, blocked) for a one-token decode step and for a prefill
        # step too large to score at once; expanded for training and short prefill.
        S = latent.shape[1]
        if (T == 1 and step.documents is None) or (step.cache is not None and B * H * T * S > SCORE_BUDGET):
            attend = self._attend_blocked
        else:
            attend = self._attend_expanded
        out = attend(q_nope, q_pe, latent, step)  # [B, T, H, dv]
        out = out.reshape(B, T, H * self.v_dim)
        if hasattr(self, "g_proj"):
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)

    def _sdpa(self, q, k, v, step: StepInfo) -> torch.Tensor:
        """q [B, H, T, D], k [B, H, S, D], v [B, H, S, Dv] → [B, H, T, Dv], causal or step.mask."""
        mask = step.attn_mask()
        causal = mask is None and q.shape[2] > 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)

    def _attend_expanded(self, q_nope, q_pe, latent, step: StepInfo) -> torch.Tensor:
        B, S, _ = latent.shape
        H, dn, dr = self.num_heads, self.nope_dim, self.rope_dim
        kv_c, k_pe = latent.split([self.kv_rank, dr], dim=-1)
        k_nope, v = self.kv_b_proj(kv_c).view(B, S, H, dn + self.v_dim).split([dn, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, H, dr)], dim=-1)  # [B, S, H, dn + dr]
        q = torch.cat([q_nope, q_pe], dim=-1)  # [B, T, H, dn + dr]
        out = self._sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), step)  # [B, H, T, dv]
        return out.transpose(1, 2)

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, Lkv] and W_UV [H, dv, Lkv], the per-head slices of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def _attend_blocked(self, q_nope, q_pe, latent, step: StepInfo) -> torch.Tensor:
        """The absorbed form, `rows` queries at a time, each block over the keys up to its last query. A block
        of real tokens masks only what it must — the padding keys at the front, its own future in the diagonal
        tile — instead of building a [t, keys] mask; a block holding padding queries takes the full mask.
        Under grad (segment-recurrent training, rl/train/segments.py) each block is recomputed in backward, so the
        scores of one block at a time are held, never a segment × sequence matrix."""
        B, S, D = latent.shape
        T, H = q_nope.shape[1], self.num_heads
        w_uk, w_uv = self._absorbed_weights()
        q = torch.cat([torch.einsum("bthn,hnl->bthl", q_nope, w_uk), q_pe], dim=-1) * self.scale  # [B, T, H, D]
        rows = max(1, SCORE_BUDGET // (B * H * S))
        blocks = []
        for lo in range(0, T, rows):
            hi = min(T, lo + rows)
            if torch.is_grad_enabled():
                blocks.append(checkpoint(self._attend_block, q[:, lo:hi], latent[:, :step.start + hi], step, lo,
                                         use_reentrant=False))
            else:
                blocks.append(self._attend_block(q[:, lo:hi], latent[:, :step.start + hi], step, lo))
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)  # [B, T, H, Lkv]
        return torch.einsum("bthl,hvl->bthv", out, w_uv)  # [B, T, H, dv]

    def _attend_block(self, q: torch.Tensor, latent: torch.Tensor, step: StepInfo, lo: int) -> torch.Tensor:
        """Queries lo..lo+t−1 of the step, q [B, t, H, D] (absorbed, scaled), over latent [B, keys, D] = every key
        up to the block's last query → [B, t, H, Lkv]."""
        B, t, H, _ = q.shape
        keys = latent.shape[1]
        dt = torch.promote_types(latent.dtype, torch.float32)
        pad_end = int(step.pad.max())  # keys before this may be padding (of some row)
        scores = torch.matmul(q.flatten(1, 2), latent.transpose(1, 2))  # [B, t·H, keys]
        scores = scores.to(dt).view(B, t, H, keys)
        if step.start + lo >= pad_end:  # every query is a real token
            if pad_end:
                pad_keys = torch.arange(pad_end, device=latent.device)[None, :] < step.pad[:, None]  # [B, pad_end]
                scores[..., :pad_end].masked_fill_(pad_keys[:, None, None, :], float("-inf"))
            future = torch.ones(t, t, dtype=torch.bool, device=latent.device).triu_(1)  # [t, t]
            scores[..., keys - t:].masked_fill_(future[:, None, :], float("-inf"))
        else:
            scores.masked_fill_(~step.attn_mask(lo, lo + t, keys).transpose(1, 2), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(latent.dtype).flatten(1, 2)  # [B, t·H, keys]
        return torch.matmul(probs, latent[..., : self.kv_rank]).view(B, t, H, self.kv_rank)
