"""Plain PyTorch K3 text model for `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`.

k3rl copies this file and configuration_kimi_k3.py into every checkpoint directory it writes
(model/formats/save.py `save_model`), so a process that never imports k3rl can load the checkpoint with
transformers and get the logits k3rl's native model (model/modeling.py) computes. It imports only torch,
transformers and the standard library. It is a reference reader, written for reading rather than speed:

    h = embed(ids)                                            [B, T, d]
    per layer i:  x = AttnRes mix of the block sums and the partial sum (or the plain residual h)
                  h += Mixer_i(RMSNorm(x))    Mixer = KDA if (i+1) ∈ kda_layers, else gated MLA
                  h += FFN_i(RMSNorm(mix))    FFN = MoE if i ≥ first_k_dense_replace and i % freq == 0
    logits = lm_head(RMSNorm(final mix)) · logit_scale

* KDA (docs/model_spec.md §5): q/k/v causal depthwise conv + SiLU, per-head L2 norm of q and k, the decay gate
  in both forms (`-exp(A_log)·softplus(f+dt_bias)`, or `lb·σ(exp(A_log)·(f+dt_bias))` with
  `gate_lower_bound`), β = σ(b), and the delta rule token by token in (at least) fp32 — the plain
  recurrence, not a chunked kernel, so long prompts are slow.
* Gated MLA (§6): NoPE as released; RoPE (interleaved pairs, base `rope_theta`) on the rope part when
  `mla_use_nope` is false, as k3rl computes it. Attention is written out (scores, causal mask, softmax
  in fp32).
* Block AttnRes (§7), following the released code: the current partial sum is always the last source.
* MoE (§8): sigmoid/softmax router in fp32, selection on the biased scores `s + e_score_correction_bias`
  (grouped top-k when `num_expert_group > 1`), weights from the unbiased scores, renormalised, times
  `routed_scaling_factor`; latent MoE (down-projection, optional RMSNorm, up-projection) and shared
  experts; SiTU-GLU or SwiGLU for every gated MLP.

Restrictions: no KV cache (every call, and every `generate` step, recomputes the whole sequence);
`attention_mask` may mark only left padding (zeros before each row's first token); no packed `position_ids`;
no MTP layers (their tensors `model.layers.{L+j}.…` are skipped on load) and no vision tower
(`KimiK3ForConditionalGeneration` is text-only: `vision_tower.*` / `mm_projector.*` tensors of a released
checkpoint are skipped, and k3rl's native image-patch weight lives in `k3rl_patch_embed.safetensors`,
outside the index, which transformers never reads). A checkpoint with MXFP4 experts (`quantization_config`
compressed-tensors) is left to transformers' compressed-tensors support, which this file does not exercise.

Loading: routed experts are one `nn.Linear` per projection and expert, so names match the checkpoint one to
one and no conversion mapping is needed; transformers' own `kimi_linear` mapping (which would rename and
fuse them) is skipped for remote code, unless something in the process registers a mapping for `kimi_linear`
itself (`register_checkpoint_conversion_mapping`). Loading in bf16/fp16 keeps `A_log`, `dt_bias`, the conv
weights and the routing bias in fp32 (`_keep_in_fp32_modules_strict`), as vLLM does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_kimi_k3 import KimiK3Config, KimiLinearConfig

KDA_NORM_EPS = 1e-5
"""eps of KDA's gated output RMSNorm (fixed, not `rms_norm_eps`; spec §5.4)."""
L2NORM_EPS = 1e-6
"""eps of the per-head q/k L2 norm in KDA (spec §5.1)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32: half models compute norms, gates, the recurrence and softmaxes in fp32."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class Padding:
    """Left padding of a batch: `pad` [B] leading pad tokens per row; `valid` [B, T] bool or None (no padding)."""

    pad: torch.Tensor
    valid: torch.Tensor | None

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor | None, shape: tuple[int, int], device) -> "Padding":
        B, T = shape
        if attention_mask is None:
            return cls(torch.zeros(B, dtype=torch.long, device=device), None)
        if tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask: expected shape [{B}, {T}], got {list(attention_mask.shape)}")
        mask = attention_mask.to(device=device, dtype=torch.bool)
        pad = T - mask.sum(1)  # [B]
        left = torch.arange(T, device=device)[None, :] >= pad[:, None]  # [B, T]
        if not torch.equal(mask, left):
            raise ValueError("attention_mask: only left padding (zeros before each row's first token) is supported")
        return cls(pad, mask if bool(pad.any()) else None)

    def positions(self, T: int) -> torch.Tensor:
        """[B, T] position of each token in its own sequence (0 at the first real token; padding clamps to 0)."""
        return (torch.arange(T, device=self.pad.device)[None, :] - self.pad[:, None]).clamp_min(0)


class KimiRMSNorm(nn.Module):
    """`weight ⊙ x / sqrt(mean(x²) + eps)` (weight starts at ones, not a 1+γ form), computed in ≥ fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_compute_dtype(x.dtype))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(xf.dtype) * y).to(x.dtype)


def glu_activation(config: KimiLinearConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU `β·tanh(g/β)·σ(g) ⊙ β_lin·tanh(u/β_lin)` (spec §8.3; β = activation_situ_beta or 1, no clip
    of u when β_lin is null) or SwiGLU `silu(g) ⊙ u`."""
    if config.hidden_act == "silu":
        return F.silu(gate) * up
    beta, linear_beta = config.activation_situ_beta or 1.0, config.activation_situ_linear_beta
    lin = up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta)
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * lin


class KimiMLP(nn.Module):
    """Gated MLP `down(act(gate(x), up(x)))`: the dense FFN (`mlp`) and the shared experts."""

    def __init__(self, config: KimiLinearConfig, width: int) -> None:
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu_activation(self.config, self.gate_proj(x), self.up_proj(x)))


class KimiExpert(nn.Module):
    """One routed expert `w2(act(w1(z), w3(z)))` in the latent width d_m (`experts.{e}.w{1,2,3}`)."""

    def __init__(self, config: KimiLinearConfig, width: int) -> None:
        super().__init__()
        self.config = config
        self.w1 = nn.Linear(width, config.moe_intermediate_size, bias=False)
        self.w2 = nn.Linear(config.moe_intermediate_size, width, bias=False)
        self.w3 = nn.Linear(width, config.moe_intermediate_size, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.w2(glu_activation(self.config, self.w1(z), self.w3(z)))


class KimiRouter(nn.Module):
    """`block_sparse_moe.gate`: router weight [E, d] and the fp32 selection bias [E] (a buffer)."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] → expert ids [N, k] and routing weights [N, k] (fp32)."""
        c = self.config
        dt = _compute_dtype(x.dtype)
        logits = F.linear(x.to(dt), self.weight.to(dt))  # [N, E]
        scores = logits.sigmoid() if c.moe_router_activation_func == "sigmoid" else logits.softmax(-1)
        # The bias steers the choice only; the weights come from the unbiased scores.
        biased = scores + self.e_score_correction_bias.to(dt)  # [N, E]
        groups = c.num_expert_group if c.use_grouped_topk else 1
        if groups > 1:
            n = biased.shape[0]
            grouped = biased.view(n, groups, -1)  # [N, G, E/G]
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
            best = group_score.topk(c.topk_group, dim=-1).indices  # [N, topk_group]
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
            biased = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, -1)
        ids = biased.topk(c.num_experts_per_token, dim=-1).indices  # [N, k]
        weights = scores.gather(1, ids)  # [N, k]
        if c.moe_renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * c.routed_scaling_factor


class KimiSparseMoE(nn.Module):
    """`block_sparse_moe`: router, routed experts (optionally in a latent width), shared experts."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        d = config.hidden_size
        d_m = config.routed_expert_hidden_size or d
        self.gate = KimiRouter(config)
        self.experts = nn.ModuleList(KimiExpert(config, d_m) for _ in range(config.num_experts))
        if config.routed_expert_hidden_size is not None:
            self.routed_expert_down_proj = nn.Linear(d, d_m, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = nn.RMSNorm(d_m, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(d_m, d, bias=False)
        if config.num_shared_experts:
            self.shared_experts = KimiMLP(config, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] → [B, T, d]."""
        B, T, d = x.shape
        flat = x.reshape(B * T, d)  # [N, d]
        ids, weights = self.gate(flat)  # [N, k], [N, k]
        latent = hasattr(self, "routed_expert_down_proj")
        z = self.routed_expert_down_proj(flat) if latent else flat  # [N, d_m]
        routed = torch.zeros_like(z)  # [N, d_m]
        for e, expert in enumerate(self.experts):
            token, slot = (ids == e).nonzero(as_tuple=True)  # the (token, slot) pairs routed to e
            if token.numel():
                out = expert(z[token]) * weights[token, slot, None].to(z.dtype)  # [n_e, d_m]
                routed.index_add_(0, token, out)
        if hasattr(self, "routed_expert_norm"):
            routed = self.routed_expert_norm(routed)
        if latent:
            routed = self.routed_expert_up_proj(routed)  # [N, d]
        if hasattr(self, "shared_experts"):
            routed = routed + self.shared_experts(flat)
        return routed.view(B, T, d)


class KimiGatedRMSNorm(nn.Module):
    """KDA's `o_norm`: `RMSNorm_{weight[K]}(o) ⊙ σ(gate)` over the head dim, weight shared by the heads (§5.4)."""

    def __init__(self, dim: int, eps: float = KDA_NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o, gate [..., K] → [..., K] in gate's dtype, computed in ≥ fp32."""
        dt = _compute_dtype(o.dtype)
        of = o.to(dt)
        normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(dt)
        return (normed * torch.sigmoid(gate.to(dt))).to(gate.dtype)


class KimiShortConv(nn.Module):
    """Depthwise causal conv, no bias, weight [C, 1, W] (`{q,k,v}_conv1d.weight`), followed by SiLU."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] → SiLU(conv) [B, T, C], zeros before the first token, in the promoted dtype of x and weight."""
        W = self.weight.shape[-1]
        dt = torch.promote_types(x.dtype, self.weight.dtype)
        xs = F.pad(x.to(dt).transpose(1, 2), (W - 1, 0))  # [B, C, W-1+T]
        y = F.conv1d(xs, self.weight.to(dt), groups=self.weight.shape[0])  # [B, C, T]
        return F.silu(y).transpose(1, 2).to(x.dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σ x² + 1e-6) over the last dim."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def kda_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> torch.Tensor:
    """The delta rule of spec §5.3, one token at a time from a zero state; q, k [B, T, H, K] (normalised,
    q scaled), v [B, T, H, V], g [B, T, H, K] log decay, beta [B, T, H] → o [B, T, H, V]. Per head:
    S ← Diag(e^g) S;  S ← S + β k (v − Sᵀk)ᵀ;  o = Sᵀ q."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])  # [B, H, K, V]
    outputs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))  # [B, H, V]
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))  # [B, H, V]
    return torch.stack(outputs, dim=1)  # [B, T, H, V]


class KimiDeltaAttention(nn.Module):
    """KDA token mixer (`self_attn.` of a KDA layer; names of spec §4.3 / §4.4)."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        lac = config.linear_attn_config
        d = config.hidden_size
        self.num_heads, self.head_dim = H, K = lac["num_heads"], lac["head_dim"]
        self.lower_bound = lac.get("gate_lower_bound")
        P, W = H * K, lac["short_conv_kernel_size"]
        self.q_proj = nn.Linear(d, P, bias=False)
        self.k_proj = nn.Linear(d, P, bias=False)
        self.v_proj = nn.Linear(d, P, bias=False)
        if lac.get("use_full_rank_gate", False):
            self.g_proj = nn.Linear(d, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, K, bias=False)
            self.g_b_proj = nn.Linear(K, P, bias=False)
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.q_conv1d = KimiShortConv(P, W)
        self.k_conv1d = KimiShortConv(P, W)
        self.v_conv1d = KimiShortConv(P, W)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.o_norm = KimiGatedRMSNorm(K)
        self.o_proj = nn.Linear(P, d, bias=False)

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """f [B, T, H·K] (output of f_b_proj) → log decay g [B, T, H, K] ≤ 0 in ≥ fp32 (spec §5.2)."""
        H, K = self.num_heads, self.head_dim
        dt = _compute_dtype(f.dtype)
        z = f.to(dt).unflatten(-1, (H, K)) + self.dt_bias.to(dt).view(H, K)  # [B, T, H, K]
        a = self.A_log.to(dt).exp().view(H, 1)  # [H, 1]
        if self.lower_bound is None:
            return -a * F.softplus(z, beta=1.0, threshold=20.0)
        return float(self.lower_bound) * torch.sigmoid(a * z)

    def forward(self, x: torch.Tensor, padding: Padding) -> torch.Tensor:
        """x [B, T, d] (the normalised layer input) → [B, T, d]."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        if padding.valid is not None:
            # A left-padding token enters as zeros: k = v = 0 leaves the (zero) state and the conv window as
            # if the padding were absent.
            x = x * padding.valid[..., None].to(x.dtype)
        dt = _compute_dtype(x.dtype)
        q = self.q_conv1d(self.q_proj(x)).view(B, T, H, K).to(dt)  # [B, T, H, K]
        k = self.k_conv1d(self.k_proj(x)).view(B, T, H, K).to(dt)
        v = self.v_conv1d(self.v_proj(x)).view(B, T, H, K).to(dt)
        g = self.decay(self.f_b_proj(self.f_a_proj(x)))  # [B, T, H, K]
        beta = torch.sigmoid(self.b_proj(x).to(dt))  # [B, T, H]
        o = kda_recurrence(l2norm(q) * K ** -0.5, l2norm(k), v, g.to(dt), beta)  # [B, T, H, V]
        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))  # [B, T, H·V]
        o = self.o_norm(o.to(x.dtype), gate.view(B, T, H, K))  # [B, T, H, V]
        return self.o_proj(o.reshape(B, T, H * K))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate interleaved pairs (x[2m], x[2m+1]) of x [B, T, ..., D] by positions [B, T] · theta^(-2m/D)."""
    D = x.shape[-1]
    dt = _compute_dtype(x.dtype)
    inv_freq = theta ** -(torch.arange(0, D, 2, device=x.device, dtype=dt) / D)  # [D/2]
    angle = positions.to(dt)[..., None] * inv_freq  # [B, T, D/2]
    angle = angle.view(*angle.shape[:2], *([1] * (x.ndim - 3)), D // 2)  # [B, T, 1.., D/2]
    cos, sin = angle.cos(), angle.sin()
    pairs = x.to(dt).unflatten(-1, (D // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).to(x.dtype)


class KimiMLAAttention(nn.Module):
    """Gated Multi-head Latent Attention (`self_attn.` of a full-attention layer; names of spec §4.5)."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.config = config
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
            self.q_a_layernorm = KimiRMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = KimiRMSNorm(self.kv_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope_dim + self.v_dim), bias=False)
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)

    def forward(self, x: torch.Tensor, padding: Padding) -> torch.Tensor:
        """x [B, T, d] (the normalised layer input) → [B, T, d]."""
        B, T, _ = x.shape
        H, dn, dr, dv = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(B, T, H, dn + dr).split([dn, dr], dim=-1)  # [B, T, H, dn], [B, T, H, dr]
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, dr], dim=-1)  # [B, T, Lkv], [B, T, dr]
        if not self.config.mla_use_nope:
            positions = padding.positions(T)  # [B, T]
            q_pe = apply_rope(q_pe, positions, self.config.rope_theta)
            k_pe = apply_rope(k_pe, positions, self.config.rope_theta)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(kv_c)).view(B, T, H, dn + dv).split([dn, dv], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, T, H, dr)], dim=-1)  # [B, T, H, dn + dr], k_pe shared
        q = torch.cat([q_nope, q_pe], dim=-1)  # [B, T, H, dn + dr]

        dt = _compute_dtype(x.dtype)
        scores = torch.einsum("bthc,bshc->bhts", q.to(dt), k.to(dt)) * self.scale  # [B, H, T, S=T]
        idx = torch.arange(T, device=x.device)
        causal = idx[None, :] <= idx[:, None]  # [T, S]
        real_key = idx[None, :] >= padding.pad[:, None]  # [B, S]
        # A padding query attends to itself only, so no row is empty; real queries never see padding keys.
        allowed = causal[None] & (real_key[:, None, :] | (idx[None, :] == idx[:, None])[None])  # [B, T, S]
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        probs = scores.softmax(-1)  # [B, H, T, S]
        out = torch.einsum("bhts,bshv->bthv", probs, v.to(dt)).to(x.dtype).reshape(B, T, H * dv)  # [B, T, H·dv]
        if hasattr(self, "g_proj"):
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)


class AttnResProj(nn.Linear):
    """The pseudo-query w [1, d] of one AttnRes mix (zero at initialisation: a uniform mix)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, 1, bias=False)


def attn_res_mix(sources: list[torch.Tensor], proj: AttnResProj, norm: KimiRMSNorm) -> torch.Tensor:
    """Spec §7 Mix: α = softmax_i(w · RMSNorm_γ(v_i)) over the sources (each [B, T, d]), Σ α_i v_i of the RAW
    sources, in ≥ fp32. One source is returned unchanged (its weight is exactly 1)."""
    if len(sources) == 1:
        return sources[0]
    v = torch.stack(sources, dim=-2)  # [B, T, N, d]
    vf = v.to(_compute_dtype(v.dtype))
    query = norm.weight.to(vf.dtype) * proj.weight.to(vf.dtype).squeeze(0)  # [d]: only γ ⊙ w matters
    keys = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + norm.eps)  # [B, T, N, d]
    alpha = torch.softmax(keys @ query, dim=-1)  # [B, T, N]
    return (alpha.unsqueeze(-2) @ vf).squeeze(-2).to(v.dtype)  # [B, T, d]


class KimiDecoderLayer(nn.Module):
    """One layer: token mixer (`self_attn`), FFN (`block_sparse_moe` or `mlp`), norms, AttnRes queries."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.block_size = config.attn_res_block_size
        self.self_attn = (KimiDeltaAttention(config) if config.is_kda_layer(layer_idx)
                          else KimiMLAAttention(config))
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            self.block_sparse_moe = KimiSparseMoE(config)
        else:
            self.mlp = KimiMLP(config, config.intermediate_size)
        self.input_layernorm = KimiRMSNorm(d, eps)
        self.post_attention_layernorm = KimiRMSNorm(d, eps)
        if self.block_size is not None:
            self.self_attention_res_norm = KimiRMSNorm(d, eps)
            self.self_attention_res_proj = AttnResProj(d)
            self.mlp_res_norm = KimiRMSNorm(d, eps)
            self.mlp_res_proj = AttnResProj(d)

    def forward(self, blocks: list[torch.Tensor], partial: torch.Tensor | None,
                padding: Padding) -> tuple[list[torch.Tensor], torch.Tensor]:
        """AttnRes state (block sums `blocks`, partial sum `partial`, each [B, T, d]) → the state after this layer.

        Without AttnRes `blocks` stays empty and `partial` is the ordinary residual stream h."""
        if self.block_size is None:
            x = partial
        else:
            x = attn_res_mix([*blocks, partial], self.self_attention_res_proj, self.self_attention_res_norm)
            if self.layer_idx % self.block_size == 0:
                # This layer opens a block: the partial sum joins the bank, the mixer output starts the next one.
                blocks, partial = [*blocks, partial], None
        out = self.self_attn(self.input_layernorm(x), padding)  # [B, T, d]
        partial = out if partial is None else partial + out
        ffn_in = partial if self.block_size is None else attn_res_mix([*blocks, partial], self.mlp_res_proj,
                                                                      self.mlp_res_norm)
        ffn_in = self.post_attention_layernorm(ffn_in)
        ffn_out = self.block_sparse_moe(ffn_in) if self.is_moe else self.mlp(ffn_in)
        return blocks, partial + ffn_out


class KimiPreTrainedModel(PreTrainedModel):
    config_class = KimiLinearConfig
    config: KimiLinearConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiDecoderLayer"]
    # The gate parameters, conv weights and routing bias stay fp32 when the model is loaded in bf16/fp16 (§13.2).
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "e_score_correction_bias"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Fresh weights (only for tensors a checkpoint does not provide): normal(0, initializer_range) linears
        and embeddings, ones for norms, zero AttnRes queries and routing bias, the Mamba/FLA gate init."""
        std = self.config.initializer_range
        if isinstance(module, AttnResProj):
            nn.init.zeros_(module.weight)
        elif isinstance(module, (nn.Linear, nn.Embedding, KimiRouter)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, KimiRouter):
                nn.init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, (KimiRMSNorm, KimiGatedRMSNorm, nn.RMSNorm)):
            nn.init.ones_(module.weight)
        elif isinstance(module, KimiShortConv):
            bound = module.weight.shape[-1] ** -0.5
            nn.init.uniform_(module.weight, -bound, bound)
        elif isinstance(module, KimiDeltaAttention):
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


class KimiLinearModel(KimiPreTrainedModel):
    """Embeddings, decoder layers and the final AttnRes mix; returns the pre-norm final hidden state."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(KimiDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = KimiRMSNorm(d, config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm = KimiRMSNorm(d, config.rms_norm_eps)
            self.output_attn_res_proj = AttnResProj(d)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(self, input_ids: torch.Tensor, padding: Padding) -> torch.Tensor:
        """input_ids [B, T] → final hidden state [B, T, d], before `norm`."""
        blocks: list[torch.Tensor] = []
        partial = self.embed_tokens(input_ids)  # [B, T, d]
        for layer in self.layers:
            blocks, partial = layer(blocks, partial, padding)
        if self.config.attn_res_block_size is None:
            return partial
        return attn_res_mix([*blocks, partial], self.output_attn_res_proj, self.output_attn_res_norm)


def _mtp_patterns(config: KimiLinearConfig, prefix: str) -> list[str]:
    """Regexes of the MTP layers' tensors (`model.layers.{L..L+n-1}.`), which this model does not build."""
    L, n = config.num_hidden_layers, config.num_nextn_predict_layers or 0
    return [rf"^{re.escape(prefix)}model\.layers\.{i}\." for i in range(L, L + n)]


class KimiLinearForCausalLM(KimiPreTrainedModel, GenerationMixin):
    """The K3 / Kimi-Linear text model with its separate (untied) lm_head; checkpoint names `model.*`,
    `lm_head.weight`, routed experts `model.layers.{i}.block_sparse_moe.experts.{e}.w{1,2,3}.weight`."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__(config)
        self.model = KimiLinearModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self._keys_to_ignore_on_load_unexpected = set(self._keys_to_ignore_on_load_unexpected) | set(
            _mtp_patterns(config, ""))

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # No cache: `generate` must hand the whole sequence to every step instead of a DynamicCache and new tokens.
        return False

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      **kwargs) -> dict:
        """Every `generate` step recomputes the whole sequence (tokens so far and their mask)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, past_key_values=None, position_ids: torch.Tensor | None = None,
                **kwargs) -> CausalLMOutput:
        """input_ids [B, T] → logits [B, T, V]; `labels` [B, T] (aligned with input_ids, shifted here, -100
        ignored) adds the mean next-token cross-entropy. `attention_mask` [B, T] may mark left padding only.
        Other keyword arguments (`use_cache`, `return_dict`, …) are accepted and ignored: there is no cache."""
        if input_ids is None or input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids: expected [B, T] with T ≥ 1, got "
                             f"{None if input_ids is None else list(input_ids.shape)}")
        if past_key_values is not None:
            raise ValueError("past_key_values: this reference model keeps no cache; call it with use_cache=False")
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("inputs_embeds: not supported; pass input_ids")
        padding = Padding.from_mask(attention_mask, tuple(input_ids.shape), input_ids.device)
        if position_ids is not None and not torch.equal(position_ids.to(padding.pad.device),
                                                        padding.positions(input_ids.shape[1])):
            raise ValueError("position_ids: packed or shifted positions are not supported; leave them None")
        h = self.model(input_ids, padding)  # [B, T, d]
        logits = self.lm_head(self.model.norm(h)) * self.config.logit_scale  # [B, T, V]
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].flatten(0, 1).to(_compute_dtype(logits.dtype))  # [B·(T-1), V]
            loss = F.cross_entropy(shifted, labels[:, 1:].flatten().to(logits.device), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    config: KimiK3Config
    base_model_prefix = "language_model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["KimiDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # Every parameter lives in the text model, whose own `_init_weights` runs on it.
        if isinstance(module, KimiPreTrainedModel):
            module._init_weights(module)


class KimiK3ForConditionalGeneration(KimiK3PreTrainedModel, GenerationMixin):
    """K3 (`kimi_k3`), TEXT ONLY: `language_model` is the `KimiLinearForCausalLM` of `config.text_config`
    (names `language_model.model.…`, `language_model.lm_head.weight`). No vision tower or projector is built:
    a released checkpoint's `vision_tower.*` / `mm_projector.*` tensors are skipped, and `pixel_values` are
    refused. The `language_model.layers.{i}.` spelling that vLLM also accepts is not read here."""

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__(config)
        self.language_model = KimiLinearForCausalLM(config.text_config)
        self.post_init()
        self._keys_to_ignore_on_load_unexpected = set(self._keys_to_ignore_on_load_unexpected) | {
            r"^vision_tower\.", r"^mm_projector\.", *_mtp_patterns(config.text_config, "language_model.")}

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      **kwargs) -> dict:
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def get_input_embeddings(self) -> nn.Embedding:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Linear:
        return self.language_model.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, pixel_values=None, **kwargs) -> CausalLMOutput:
        """As `KimiLinearForCausalLM.forward`; `pixel_values` raise (no vision tower in this remote code)."""
        if pixel_values is not None:
            raise ValueError("pixel_values: this remote code is text-only (no vision tower); use vLLM or k3rl "
                             "for image input")
        return self.language_model(input_ids, attention_mask=attention_mask, labels=labels, **kwargs)


__all__ = ["KimiLinearForCausalLM", "KimiLinearModel", "KimiK3ForConditionalGeneration", "KimiPreTrainedModel"]
