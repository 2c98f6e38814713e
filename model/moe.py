"""Feed-forward blocks of K3: the dense MLP, the routed MoE, and the router with its balancing statistics.

Checkpoint names and shapes are those of docs/model_spec.md §4.6 (`mlp.{gate,up,down}_proj`,
`block_sparse_moe.gate.{weight,e_score_correction_bias}`, `experts.{e}.w{1,2,3}` (held stacked here,
per-expert in checkpoints: model/formats/names.py),
`shared_experts.*`, `routed_expert_{down_proj,norm,up_proj}`); the math is §8:
router logits in (at least) fp32 → sigmoid (or softmax) scores `s` → top-k of the biased scores `s + b`
(DeepSeek grouped top-k when `num_expert_group > 1`) → weights from the unbiased `s`,
renormalised, times `routed_scaling_factor` → experts in the latent width d_m → optional
RMSNorm → up-projection → plus the shared experts on the original x.

Routed experts run token-dropless through kernels/moe: the (token, slot) pairs are sorted by expert and
all experts run in one grouped matmul per projection; no expert computes on tokens it was not chosen
for. Routing replay ("R3" in RL): `MoE.forward(x, routed_expert_ids=ids, mask=valid)` uses the given
ids instead of the top-k (rows with -1, and padding, are routed; weights still come from the current
scores); every forward leaves the ids it used in `MoE.last_expert_ids` so rollouts can store them.

Router balancing (docs/model_spec.md Part A) adjusts `e_score_correction_bias` after each optimizer step
from statistics the routers collect during that step's forward passes (`Router._record`: the loads and,
for quantile balancing, the margins of every counted token); the update itself, with its all-reduce over
learner ranks, is training code: rl/train/router_balance.py. This module stays single-device.

Departures and choices:
* With grouped top-k the margins are computed as for a plain top-k over all experts (exact
  for `num_expert_group = 1`, which K3 appears to use).
* Statistics are collected in training mode, outside backward: activation-checkpoint
  recomputation does not count twice, while no-grad forwards do count (reentrant checkpointing
  runs the real forward under no_grad). Put the model in eval() (or set `collect_stats =
  False` on the routers) for passes that should not count, such as old log-probs.
* MaxVio is computed from the ids the layer actually used (replayed ids under R3).
* SiTU is computed in the input dtype by `kernels.situ.situ_glu` on the CPU (fp32 in the fused
  kernel); the spec states fp32. The zero-width shared MLP that vLLM builds for
  `num_shared_experts = 0` is omitted.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from k3rl.kernels.moe import SituGLU, routed_experts
from k3rl.kernels.situ import situ_glu
from k3rl.model.config import RouterBalanceConfig

BALANCE_METHODS = ("quantile", "sign", "none")


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Spec §1: the FFN of 0-based layer `layer_idx` is MoE (`block_sparse_moe`), else dense (`mlp`)."""
    return (config.num_experts is not None and layer_idx >= config.first_k_dense_replace
            and layer_idx % config.moe_layer_freq == 0)


def build_ffn(config: Any, layer_idx: int) -> nn.Module:
    """`MoE(config)` on MoE layers, `MLP(config)` otherwise; name it `block_sparse_moe` / `mlp`."""
    return MoE(config) if is_moe_layer(config, layer_idx) else MLP(config)


class GLUActivation:
    """act(gate, up): SiTU-GLU (β = activation_situ_beta or 1.0) or SwiGLU, per `hidden_act`."""

    def __init__(self, config: Any):
        if config.hidden_act not in ("silu", "situ"):
            raise ValueError(f"hidden_act must be 'silu' or 'situ', got {config.hidden_act!r}")
        self.situ = config.hidden_act == "situ"
        self.beta, self.linear_beta = config.activation_situ_beta or 1.0, config.activation_situ_linear_beta

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.situ:
            return situ_glu(gate, up, self.beta, self.linear_beta)
        return F.silu(gate) * up


class MLP(nn.Module):
    """Gated MLP `down(act(gate(x), up(x)))`: the dense FFN (width `intermediate_size`) and the
    shared experts (width `moe_intermediate_size × num_shared_experts`)."""

    def __init__(self, config: Any, intermediate_size: Optional[int] = None):
        super().__init__()
        d, width = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(d, width, bias=False)
        self.up_proj = nn.Linear(d, width, bias=False)
        self.down_proj = nn.Linear(width, d, bias=False)
        self.act = GLUActivation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] → [..., d]."""
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class Experts(nn.Module):
    """`block_sparse_moe.experts`: the E routed experts in the latent width d_m, stacked — one parameter
    per projection, `w1` (gate) and `w3` (up) [E, I, d_m], `w2` (down) [E, d_m, I], each row block
    `w*[e]` in `nn.Linear` layout — and run through `kernels.moe.routed_experts` (`impl`: `auto` — Triton
    on CUDA, `grouped` on the CPU — or `triton`, `grouped`, the `naive` per-expert loop). Checkpoints keep
    the per-expert names `experts.{e}.w{1,2,3}.weight`: model/formats/names.py converts at save and load."""

    def __init__(self, config: Any, width: int):
        super().__init__()
        e, inter = config.num_experts, config.moe_intermediate_size
        self.num_experts = e
        self.w1 = nn.Parameter(torch.empty(e, inter, width))
        self.w2 = nn.Parameter(torch.empty(e, width, inter))
        self.w3 = nn.Parameter(torch.empty(e, inter, width))
        act = GLUActivation(config)
        # SiTU-GLU as a value kernels/moe recognises, so its Triton path fuses it into the gate/up GEMM.
        self.act = SituGLU(act.beta, act.linear_beta) if act.situ else act
        self.impl = "auto"
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """`nn.Linear`'s default init of each expert's w1, w2, w3 in that order, expert by expert: the
        random stream of the per-expert modules these weights replace, so a seed builds the same model."""
        with torch.no_grad():
            for e in range(self.num_experts):
                for w in (self.w1, self.w2, self.w3):
                    nn.init.kaiming_uniform_(w[e], a=math.sqrt(5))

    def per_expert(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(w1[e], w2[e], w3[e]) for every expert e, views of the stacked weights."""
        return [(self.w1[e], self.w2[e], self.w3[e]) for e in range(self.num_experts)]

    def forward(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """z [N, d_m], ids [N, k], weights [N, k] → Σ_k weights·expert_ids(z) [N, d_m]."""
        return routed_experts(z, ids, weights, self.w1, self.w3, self.w2, self.act, self.impl)


def _balance_config(config: Any) -> RouterBalanceConfig:
    rb = getattr(config, "router_balance", None)
    if rb is None:
        return RouterBalanceConfig()
    if isinstance(rb, dict):
        return RouterBalanceConfig(**rb)
    return RouterBalanceConfig(method=rb.method, step_size=rb.step_size, sign_gamma=rb.sign_gamma)


class Router(nn.Module):
    """`block_sparse_moe.gate`: router weight [E, d] and the fp32 selection bias [E] (a buffer,
    saved in the state_dict, never a parameter); collects the balancing statistics."""

    def __init__(self, config: Any):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_token
        self.activation = config.moe_router_activation_func
        if self.activation not in ("sigmoid", "softmax"):
            raise ValueError(f"moe_router_activation_func must be sigmoid or softmax, got {self.activation!r}")
        self.renormalize, self.scaling = config.moe_renormalize, config.routed_scaling_factor
        self.num_groups = getattr(config, "num_expert_group", None) or 1
        self.topk_group = getattr(config, "topk_group", None) or 1
        if not getattr(config, "use_grouped_topk", True):
            self.num_groups = self.topk_group = 1
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_experts {self.num_experts} not divisible by num_expert_group {self.num_groups}")
        self.balance = _balance_config(config)
        if self.balance.method not in BALANCE_METHODS:
            raise ValueError(f"router_balance.method must be one of {BALANCE_METHODS}, got {self.balance.method!r}")
        self.init_std = config.initializer_range
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        # Set False to stop collecting balancing statistics altogether (e.g. frozen routers).
        self.collect_stats = True
        self.reset_parameters()
        self.clear_stats()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        nn.init.zeros_(self.e_score_correction_bias)

    def _apply(self, fn, recurse=True):
        # Keep the bias fp32 under model.to(bf16) & co, as vLLM does ("preserve FP32 values").
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        new = self.e_score_correction_bias
        if new.dtype != torch.float32:
            keep = bias.is_meta or new.is_meta
            self.e_score_correction_bias = new.float() if keep else bias.to(new.device, torch.float32)
        return self

    def clear_stats(self) -> None:
        self._margins: list[torch.Tensor] = []
        self._loads: Optional[torch.Tensor] = None
        self._tokens = 0

    def _collecting(self) -> bool:
        in_backward = torch._C._current_graph_task_id() != -1
        return self.collect_stats and self.training and not in_backward

    def _select(self, biased: torch.Tensor) -> torch.Tensor:
        """Top-k ids [N, k] of the biased scores [N, E], restricted to the best groups."""
        if self.num_groups > 1:
            n = biased.shape[0]
            grouped = biased.view(n, self.num_groups, -1)  # [N, G, E/G]
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
            keep = group_score.topk(self.topk_group, dim=-1).indices  # [N, topk_group]
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            biased = grouped.masked_fill(~mask[..., None], float("-inf")).view(n, -1)
        return biased.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor, expert_ids: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] → (ids [N, k] int64, weights [N, k] fp32).

        `expert_ids` [N, k] replays a recorded routing (R3); a row with an id < 0 (nothing recorded: prompt
        and observation tokens, the last sampled token) is routed by this router — a token's k experts are
        one decision, replayed whole or not at all. `mask` [N] bool marks the tokens that count: the others
        (padding) are routed by this router, never replayed, and left out of the balancing statistics.
        Weights always come from the current scores, so they stay differentiable under replay."""
        dt = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dt), self.weight.to(dt))  # [N, E], at least fp32
        scores = logits.sigmoid() if self.activation == "sigmoid" else logits.softmax(-1)
        biased = scores.detach() + self.e_score_correction_bias  # [N, E], selection only
        if mask is not None:
            mask = mask.to(device=x.device, dtype=torch.bool).reshape(-1)
            if mask.numel() != x.shape[0]:
                raise ValueError(f"router mask has {mask.numel()} entries for {x.shape[0]} tokens")
        if expert_ids is None:
            ids = self._select(biased)
        else:
            ids = expert_ids.to(device=x.device, dtype=torch.long)
            if ids.shape != (x.shape[0], self.top_k):
                raise ValueError(f"replayed expert ids {tuple(ids.shape)} != {(x.shape[0], self.top_k)}")
            if bool((ids >= self.num_experts).any()):
                raise ValueError(f"replayed expert ids must be < num_experts = {self.num_experts}, "
                                 f"got {int(ids.max())}")
            replay = (ids >= 0).all(-1)  # [N]
            if mask is not None:
                replay = replay & mask
            if not bool(replay.all()):
                ids = torch.where(replay[:, None], ids, self._select(biased))
        weights = scores.gather(1, ids)  # [N, k]
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self._collecting():
            if mask is None:
                self._record(biased, ids)
            else:
                self._record(biased[mask], ids[mask])
        return ids, weights * self.scaling

    @torch.no_grad()
    def _record(self, biased: torch.Tensor, ids: torch.Tensor) -> None:
        k = self.top_k
        if self.balance.method == "quantile" and k < self.num_experts:
            vals, idx = biased.topk(k + 1, dim=-1)  # [N, k+1]
            in_top = torch.zeros_like(biased, dtype=torch.bool).scatter_(1, idx[:, :k], True)
            # τ_ij: the k-th largest among the other experts is v_{k+1} for chosen j, v_k otherwise.
            tau = torch.where(in_top, vals[:, k:k + 1], vals[:, k - 1:k])  # [N, E]
            self._margins.append(biased - tau)
        loads = torch.bincount(ids.flatten(), minlength=self.num_experts)  # [E]
        self._loads = loads if self._loads is None else self._loads + loads
        self._tokens += ids.shape[0]


class MoE(nn.Module):
    """`block_sparse_moe`: router, routed experts (optionally latent), shared experts."""

    def __init__(self, config: Any):
        super().__init__()
        d = config.hidden_size
        self.top_k = config.num_experts_per_token
        self.gate = Router(config)
        d_m = config.routed_expert_hidden_size or d
        self.experts = Experts(config, d_m)
        if config.routed_expert_hidden_size is not None:
            self.routed_expert_down_proj = nn.Linear(d, d_m, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = nn.RMSNorm(d_m, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(d_m, d, bias=False)
        if config.num_shared_experts:
            self.shared_experts = MLP(config, config.moe_intermediate_size * config.num_shared_experts)
        # The ids [..., k] (int64, leading shape of x) the latest forward used, for R3 replay.
        self.last_expert_ids: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor, routed_expert_ids: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, d] (any leading shape) → [B, T, d]; `routed_expert_ids` [B, T, k] replays a routing
        (-1 rows: route), `mask` [B, T] marks the tokens that count (see `Router.forward`)."""
        lead, d = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, d)  # [N, d]
        replay = None if routed_expert_ids is None else routed_expert_ids.reshape(-1, self.top_k)
        ids, weights = self.gate(flat, replay, None if mask is None else mask.reshape(-1))  # [N, k], [N, k]
        self.last_expert_ids = ids.detach().view(*lead, self.top_k)
        latent = hasattr(self, "routed_expert_down_proj")
        z = self.routed_expert_down_proj(flat) if latent else flat  # [N, d_m]
        r = self.experts(z, ids, weights)  # [N, d_m]
        if hasattr(self, "routed_expert_norm"):
            r = self.routed_expert_norm(r)
        if latent:
            r = self.routed_expert_up_proj(r)  # [N, d]
        if hasattr(self, "shared_experts"):
            r = r + self.shared_experts(flat)
        return r.view(*lead, d)
