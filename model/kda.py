"""Kimi Delta Attention layer (docs/model_spec.md §4.3–4.4, §5): the linear-attention token mixer of K3.

    q̃, k̃, ṽ = W_q x, W_k x, W_v x                           [B, T, H·K]
    q, k, v  = SiLU(CausalConv(q̃)), SiLU(CausalConv(k̃)), SiLU(CausalConv(ṽ))
    g        = kda_gate(W_fb W_fa x, A_log, dt_bias, lb)     per-channel log decay (both forms; computed by the
                                                             op from `FusedGate`, in-kernel on a GPU)
    β        = σ(W_b x)
    o        = KDA(l2norm(q)·K^-½, l2norm(k), v, g, β)      chunked (train/prefill) or recurrent (decode)
    y        = W_o · concat_h( RMSNorm_{o_norm, eps=1e-5}(o_h) ⊙ σ(gate_h) )

The gate is full rank (`g_proj`, K3) or low rank (`g_a_proj`→`g_b_proj`, Kimi-Linear) per
`use_full_rank_gate`. The layer owns the parameters; the math lives in `kernels/kda` (delta rule,
gate; `chunk_kda` / `fused_recurrent_kda` pick Triton on CUDA, PyTorch elsewhere) and `kernels/short_conv`
(conv with decode state). `A_log`, `dt_bias` and the conv
weights stay fp32 under `model.to(bf16)` (spec §13.2); the gate is computed in ≥ fp32.
Left-padding tokens (`StepInfo.valid`) enter as zero inputs, which leaves conv and recurrent
state exactly as if the padding were absent. Packed documents (`StepInfo.cu_seqlens`, training only) run
as one packed sequence of B·T tokens: conv and recurrent state start from zero at every document.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3rl.kernels.kda import FusedGate, chunk_kda, fused_recurrent_kda
from k3rl.kernels.short_conv import causal_conv1d
from k3rl.model.cache import StepInfo

_FP32_PARAMS = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


class ShortConv(nn.Module):
    """Holds one depthwise causal conv weight [C, 1, W] (checkpoint `{q,k,v}_conv1d.weight`)."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[-1])
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C], state [B, C, W-1] or None → (SiLU(conv) [B, T, C], new state); `cu_seqlens`: x is
        [1, T, C] packed sequences, each from a zero state."""
        return causal_conv1d(x, self.weight.squeeze(1), state, activation="silu", cu_seqlens=cu_seqlens)


class GatedRMSNorm(nn.Module):
    """`RMSNorm_{weight[K]}(o) ⊙ σ(gate)` over the head dim, weight shared by heads (spec §5.4)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o, gate [..., K] → [...,  K] in gate's dtype (computed in ≥ fp32)."""
        dt = torch.promote_types(o.dtype, torch.float32)
        of = o.to(dt)
        normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(dt)
        return (normed * torch.sigmoid(gate.to(dt))).to(gate.dtype)


class KimiDeltaAttention(nn.Module):
    """KDA token mixer of layer `layer_idx`; checkpoint names of spec §4.3 (prefix `self_attn.`)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        lac = config.linear_attn_config
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = H, K = lac["num_heads"], lac["head_dim"]
        self.conv_width = W = lac["short_conv_kernel_size"]
        self.lower_bound = lac["gate_lower_bound"]
        d, P = config.hidden_size, H * K
        self.q_proj = nn.Linear(d, P, bias=False)
        self.k_proj = nn.Linear(d, P, bias=False)
        self.v_proj = nn.Linear(d, P, bias=False)
        if lac["use_full_rank_gate"]:
            self.g_proj = nn.Linear(d, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, K, bias=False)
            self.g_b_proj = nn.Linear(K, P, bias=False)
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.q_conv1d = ShortConv(P, W)
        self.k_conv1d = ShortConv(P, W)
        self.v_conv1d = ShortConv(P, W)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.o_norm = GatedRMSNorm(K, eps=1e-5)
        self.o_proj = nn.Linear(P, d, bias=False)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        A_log, dt_bias = self.initial_gate_values()
        self.A_log.copy_(A_log)
        self.dt_bias.copy_(dt_bias)

    def initial_gate_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A_log = log U(1, 16); dt_bias = softplus⁻¹(dt), dt log-uniform in [1e-3, 1e-1] (Mamba/FLA init)."""
        A_log = torch.empty_like(self.A_log).uniform_(1.0, 16.0).log()
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        return A_log, dt + torch.log(-torch.expm1(-dt))

    def _decode_step(self, x: torch.Tensor, cache) -> torch.Tensor:
        """One decode token per row (x [B, 1, d], no grad): `forward`'s math with the six input projections as one
        GEMM and the three short convolutions as one window product over the cache's concatenated conv state —
        a decode step is bound by the number of ops, not their size (bench/README.md, the same-size comparison)."""
        B, H, K, P = x.shape[0], self.num_heads, self.head_dim, self.num_heads * self.head_dim
        w_in, w_conv = self._fused_decode_weights()
        y = F.linear(x[:, 0], w_in)  # [B, 3P + K + H + gate]
        qkv, f_a, b, g = y.split([3 * P, K, H, y.shape[-1] - 3 * P - K - H], dim=-1)
        i = self.layer_idx
        window = torch.cat([cache.conv[i].to(x.dtype), qkv.unsqueeze(-1)], dim=-1)  # [B, 3P, W] raw inputs
        dtype = torch.promote_types(x.dtype, w_conv.dtype)
        q, k, v = F.silu((window.to(dtype) * w_conv.to(dtype)).sum(-1)).to(x.dtype).split(P, dim=-1)
        cache.conv[i] = window[..., 1:].to(cache.dtype)
        gate_in = FusedGate(self.f_b_proj(f_a).view(B, 1, P), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(b.to(torch.promote_types(x.dtype, torch.float32)))  # [B, H]
        o, final = fused_recurrent_kda(q.view(B, 1, H, K), k.view(B, 1, H, K), v.view(B, 1, H, K), gate_in,
                                       beta.view(B, 1, H), scale=K ** -0.5, initial_state=cache.recurrent[i],
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
        cache.recurrent[i] = final.to(cache.state_dtype)
        gate = g if hasattr(self, "g_proj") else self.g_b_proj(g)  # [B, P]
        o = self.o_norm(o.reshape(B, 1, H, K).to(x.dtype), gate.view(B, 1, H, K))
        return self.o_proj(o.reshape(B, 1, P))

    def _fused_decode_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([q; k; v; f_a; b; g or g_a] [3P + K + H + ·, d], [q; k; v] conv taps [3P, W]), concatenated once and
        again whenever a parameter is replaced or written in place (a weight sync): its version counter moves."""
        parts = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.f_a_proj.weight, self.b_proj.weight,
                 self.g_proj.weight if hasattr(self, "g_proj") else self.g_a_proj.weight,
                 self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]
        key = tuple((p.data_ptr(), p._version) for p in parts)
        fused = getattr(self, "_fused_decode", None)
        if fused is None or fused[0] != key:
            with torch.no_grad():
                w_in = torch.cat([p.detach() for p in parts[:6]], dim=0)
                w_conv = torch.cat([p.detach().squeeze(1) for p in parts[6:]], dim=0)
            fused = self._fused_decode = (key, w_in, w_conv)
        return fused[1], fused[2]

    def _apply(self, fn, recurse: bool = True):
        # Casts to half types (model.to(bf16), .half()) leave the fp32 gate and conv parameters alone;
        # fp64 (for exactness tests) is allowed.
        keep = {name: p.data for name, p in self.named_parameters() if name in _FP32_PARAMS}
        super()._apply(fn, recurse)
        for name, p in self.named_parameters():
            if name in keep and p.dtype in (torch.float16, torch.bfloat16):
                p.data = keep[name].to(device=p.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor, step: StepInfo) -> torch.Tensor:
        """x [B, T, d] (the normalised layer input) → [B, T, d]; reads/updates `step.cache`."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        if step.valid is not None:
            x = torch.where(step.valid[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))
        cache, cu = step.cache, step.cu_seqlens
        if T == 1 and cu is None and cache is not None and not torch.is_grad_enabled():
            return self._decode_step(x, cache)
        # Packed documents: the rows laid end to end as one sequence [1, B·T, ·] cut at cu_seqlens.
        rows = (1, B * T) if cu is not None else (B, T)
        conv_state = cache.conv[self.layer_idx] if cache is not None else None  # [B, 3P, W-1]
        qkv_states = (None,) * 3 if conv_state is None else conv_state.chunk(3, dim=1)
        q, q_state = self.q_conv1d(self.q_proj(x).view(*rows, -1), qkv_states[0], cu)  # [B, T, P]
        k, k_state = self.k_conv1d(self.k_proj(x).view(*rows, -1), qkv_states[1], cu)
        v, v_state = self.v_conv1d(self.v_proj(x).view(*rows, -1), qkv_states[2], cu)
        # raw gate inputs: the op computes g (in-kernel on a GPU, where the lower bound picks the matmul tiles)
        gate_in = FusedGate(self.f_b_proj(self.f_a_proj(x)).view(*rows, H * K), self.A_log, self.dt_bias,
                            self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).to(torch.promote_types(x.dtype, torch.float32)))  # [B, T, H]
        initial = cache.recurrent[self.layer_idx] if cache is not None else None  # [B, H, K, V]

        # Recurrent for a one-token decode step, chunked for training and prefill.
        kda = fused_recurrent_kda if T == 1 and cu is None else chunk_kda
        varlen = {} if cu is None else {"cu_seqlens": cu}
        o, final = kda(q.view(*rows, H, K), k.view(*rows, H, K), v.view(*rows, H, K), gate_in,
                       beta.view(*rows, H), scale=K ** -0.5, initial_state=initial,
                       output_final_state=cache is not None, use_qk_l2norm_in_kernel=True, **varlen)  # o [B, T, H, V]
        o = o.reshape(B, T, H, K)
        if cache is not None:
            cache.conv[self.layer_idx] = torch.cat([q_state, k_state, v_state], dim=1).to(cache.dtype)
            cache.recurrent[self.layer_idx] = final.to(cache.state_dtype)

        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))  # [B, T, P]
        o = self.o_norm(o.to(x.dtype), gate.view(B, T, H, K))  # [B, T, H, V]
        return self.o_proj(o.reshape(B, T, H * K))
