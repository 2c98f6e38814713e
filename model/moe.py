"""Feed-forward blocks of K3: the dense MLP, the routed MoE, and loss-free router balancing.

Checkpoint names and shapes are those of docs/model_spec.md §4.6 (`mlp.{gate,up,down}_proj`,
`block_sparse_moe.gate.{weight,e_score_correction_bias}`, `experts.{e}.w{1,2,3}`,
`shared_experts.*`, `routed_expert_{down_proj,norm,up_proj}`); the math is §8:
router logits in (at least) fp32 → sigmoid (or softmax) scores `s` → top-k of the biased scores `s + b`
(DeepSeek grouped top-k when `num_expert_group > 1`) → weights from the unbiased `s`,
renormalised, times `routed_scaling_factor` → experts in the latent width d_m → optional
RMSNorm → up-projection → plus the shared experts on the original x.

Routed experts run token-dropless: the (token, slot) pairs are sorted by expert and each expert
runs once on its contiguous slice; no expert computes on tokens it was not chosen for. Routing
replay ("R3" in RL): `MoE.forward(x, routed_expert_ids=ids)` uses the given ids instead of
the top-k (weights still come from the current scores); every forward leaves the ids it used in
`MoE.last_expert_ids` so rollouts can store them.

Router balancing (docs/model_spec.md Part A) adjusts `e_score_correction_bias` after each optimizer step,
from statistics the routers collect during that step's forward passes: `balance_routers(model)`.
Quantile balancing (QB) gives expert j the bias change `Δb_j = −Q_{1−T/m}(a_ij − τ_ij)`, with
`a = s + b`, `τ_ij` the k-th largest biased score among the other experts of token i and `T =
m·k/E`: the shift that, applied to that batch with the other biases held fixed, would have given
expert j exactly T tokens. It is damped by `router_balance.step_size`. `Q` is the exact order
statistic: the midpoint between the round(T)-th and the next largest margin. The alternative
is DeepSeek-V3's `b_j += γ·sign(T − load_j)`; `none` leaves the bias alone.

Departures and choices:
* Under torch.distributed the quantile is found by bisection on all-reduced counts (one
  all-reduce of an [L, E] count tensor per bisection step, all layers at once; each rank sorts
  its own margins once so a count is a binary search), then refined to the exact global order
  statistics with a MIN/MAX all-reduce, so the result equals the single-process result on the
  concatenated batch; no margins are gathered. The same code runs in one process. Each rank
  keeps its margins, [tokens seen this step, E] fp32 per MoE layer (only under `quantile`),
  until `balance_routers`.
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

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels.situ import situ_glu
from model.config import RouterBalanceConfig

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


class Expert(nn.Module):
    """One routed expert in the latent width d_m: `w2(act(w1 z, w3 z))` (w1 gate, w3 up)."""

    def __init__(self, config: Any, width: int):
        super().__init__()
        self.w1 = nn.Linear(width, config.moe_intermediate_size, bias=False)
        self.w2 = nn.Linear(config.moe_intermediate_size, width, bias=False)
        self.w3 = nn.Linear(width, config.moe_intermediate_size, bias=False)
        self.act = GLUActivation(config)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """[n, d_m] → [n, d_m]."""
        return self.w2(self.act(self.w1(z), self.w3(z)))


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

    def forward(self, x: torch.Tensor, expert_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d], optional replayed ids [N, k] → (ids [N, k] int64, weights [N, k] fp32)."""
        dt = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dt), self.weight.to(dt))  # [N, E], at least fp32
        scores = logits.sigmoid() if self.activation == "sigmoid" else logits.softmax(-1)
        biased = scores.detach() + self.e_score_correction_bias  # [N, E], selection only
        if expert_ids is None:
            ids = self._select(biased)
        else:
            ids = expert_ids.to(device=x.device, dtype=torch.long)
            if ids.shape != (x.shape[0], self.top_k):
                raise ValueError(f"replayed expert ids {tuple(ids.shape)} != {(x.shape[0], self.top_k)}")
        weights = scores.gather(1, ids)  # [N, k]
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self._collecting():
            self._record(biased, ids)
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
        self.experts = nn.ModuleList(Expert(config, d_m) for _ in range(config.num_experts))
        if config.routed_expert_hidden_size is not None:
            self.routed_expert_down_proj = nn.Linear(d, d_m, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = nn.RMSNorm(d_m, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(d_m, d, bias=False)
        if config.num_shared_experts:
            self.shared_experts = MLP(config, config.moe_intermediate_size * config.num_shared_experts)
        # The ids [..., k] (int64, leading shape of x) the latest forward used, for R3 replay.
        self.last_expert_ids: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor, routed_expert_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, d] (any leading shape) → [B, T, d]; `routed_expert_ids` [B, T, k] replays a routing."""
        lead, d = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, d)  # [N, d]
        replay = None if routed_expert_ids is None else routed_expert_ids.reshape(-1, self.top_k)
        ids, weights = self.gate(flat, replay)  # [N, k], [N, k]
        self.last_expert_ids = ids.detach().view(*lead, self.top_k)
        latent = hasattr(self, "routed_expert_down_proj")
        z = self.routed_expert_down_proj(flat) if latent else flat  # [N, d_m]
        r = self._routed(z, ids, weights)  # [N, d_m]
        if hasattr(self, "routed_expert_norm"):
            r = self.routed_expert_norm(r)
        if latent:
            r = self.routed_expert_up_proj(r)  # [N, d]
        if hasattr(self, "shared_experts"):
            r = r + self.shared_experts(flat)
        return r.view(*lead, d)

    def _routed(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_k w_k·expert_{ids_k}(z): sort (token, slot) pairs by expert, one call per expert."""
        n, k = ids.shape
        order = ids.flatten().argsort(stable=True)  # [N·k]
        token = order // k  # [N·k], token of each sorted pair
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        z_sorted = z[token]  # [N·k, d_m]
        outs, start = [], 0
        for e, c in enumerate(counts):
            if c:
                outs.append(self.experts[e](z_sorted[start:start + c]))
                start += c
        dt = torch.promote_types(z.dtype, torch.float32)
        out = torch.zeros(n, z.shape[-1], dtype=dt, device=z.device)  # [N, d_m], at least fp32
        if outs:
            y = torch.cat(outs).to(dt) * weights.flatten()[order, None].to(dt)  # [N·k, d_m]
            out = out.index_add(0, token, y)
        return out.to(z.dtype)


def _all_reduce(t: torch.Tensor, op, group, distributed: bool) -> torch.Tensor:
    if distributed:
        dist.all_reduce(t, op=op, group=group)
    return t


def _quantile_bias_delta(margins: list[torch.Tensor], target: torch.Tensor, group, distributed: bool,
                         max_iters: int = 64) -> torch.Tensor:
    """QB bias change [L, E] for L layers: −(c-th + (c+1)-th largest margin)/2 per expert over the
    global batch, with c = target[l]. margins[l] is this rank's [m_l, E]; target [L] int64.
    Each rank sorts its margins once; a count is then a binary search, and only [L, E] tensors
    cross ranks."""
    e = margins[0].shape[1]
    cols = [m.T.contiguous().sort(-1).values for m in margins]  # [E, m_l] ascending per expert
    inf = torch.tensor(float("inf"), dtype=margins[0].dtype, device=margins[0].device)

    def at(col: torch.Tensor, idx: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:  # col[e, idx[e]] or fill
        ok = (idx >= 0) & (idx < col.shape[1])
        got = col.gather(1, idx.clamp(0, max(col.shape[1] - 1, 0))[:, None])[:, 0] if col.shape[1] else fill.expand(e)
        return torch.where(ok, got, fill)

    def n_at_most(t: torch.Tensor) -> list[torch.Tensor]:  # per layer [E]: local #{m ≤ t}
        return [torch.searchsorted(col, t[i][:, None].contiguous(), right=True)[:, 0] for i, col in enumerate(cols)]

    def count_above(t: torch.Tensor) -> torch.Tensor:  # [L, E]: global #{m > t}
        cnt = torch.stack([col.shape[1] - n for col, n in zip(cols, n_at_most(t))])
        return _all_reduce(cnt, dist.ReduceOp.SUM, group, distributed)

    zero = torch.zeros(e, dtype=torch.long, device=inf.device)
    lo = _all_reduce(torch.stack([at(col, zero, inf) for col in cols]), dist.ReduceOp.MIN, group, distributed) - 1
    hi = _all_reduce(torch.stack([at(col, zero + col.shape[1] - 1, -inf) for col in cols]),
                     dist.ReduceOp.MAX, group, distributed)
    c = target[:, None]  # [L, 1]
    # Invariant: #{m > lo} > c ≥ #{m > hi}, so the (c+1)-th largest margin lies in (lo, hi].
    for _ in range(max_iters):
        mid = (lo + hi) / 2
        if not ((mid > lo) & (mid < hi)).any():
            break
        above = count_above(mid) > c
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    below = n_at_most(hi)
    upper = torch.stack([at(col, n, inf) for col, n in zip(cols, below)])  # smallest > hi
    lower = torch.stack([at(col, n - 1, -inf) for col, n in zip(cols, below)])  # largest ≤ hi
    upper = _all_reduce(upper, dist.ReduceOp.MIN, group, distributed)  # c-th largest
    lower = _all_reduce(lower, dist.ReduceOp.MAX, group, distributed)  # (c+1)-th largest
    # Fewer than c margins above hi means the c-th and (c+1)-th are tied (to bisection precision).
    upper = torch.where(count_above(hi) < c, lower, upper)
    return -(upper + lower) / 2


@torch.no_grad()
def balance_routers(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
    """Update every router bias from the statistics of the step and clear them; call after
    `optimizer.step()`. Returns MaxVio `(max_j load_j − T)/T` of the step per MoE module name
    (layers that saw no tokens are left out). Under torch.distributed every rank of `group`
    must call it: statistics are reduced over the group, so all ranks apply the same update."""
    routers = [(name.rpartition(".")[0] if name.rpartition(".")[2] == "gate" else name, m)
               for name, m in model.named_modules() if isinstance(m, Router)]
    if not routers:
        return {}
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    bias0 = routers[0][1].e_score_correction_bias
    e = routers[0][1].num_experts
    if any(r.num_experts != e for _, r in routers):
        raise ValueError("balance_routers expects the same num_experts in every MoE layer")
    zeros = torch.zeros(e, dtype=torch.long, device=bias0.device)
    stats = torch.stack([torch.cat([r._loads.to(bias0.device) if r._loads is not None else zeros,
                                    zeros.new_tensor([r._tokens])]) for _, r in routers])  # [L, E+1]
    stats = _all_reduce(stats, dist.ReduceOp.SUM, group, distributed)
    loads, tokens = stats[:, :e].double(), stats[:, e]  # [L, E], [L]

    quantile = [i for i, (_, r) in enumerate(routers)
                if r.balance.method == "quantile" and tokens[i] > 1 and r.top_k < e]
    if quantile:
        margins = [torch.cat(routers[i][1]._margins).to(bias0.device) if routers[i][1]._margins
                   else torch.empty(0, e, device=bias0.device) for i in quantile]
        k = torch.tensor([routers[i][1].top_k for i in quantile], device=bias0.device)
        # c = round(T), kept in [1, m − 1] so both order statistics exist.
        target = torch.minimum((tokens[quantile] * k / e).round().long().clamp(1, None), tokens[quantile] - 1)
        deltas = dict(zip(quantile, _quantile_bias_delta(margins, target, group, distributed)))

    maxvio = {}
    for i, (name, r) in enumerate(routers):
        if tokens[i] > 0:
            t = float(tokens[i]) * r.top_k / e
            maxvio[name] = (loads[i].max().item() - t) / t
            bias = r.e_score_correction_bias
            if i in quantile:
                bias.add_(r.balance.step_size * deltas[i].to(bias.device, bias.dtype))
            elif r.balance.method == "sign":
                bias.add_(r.balance.sign_gamma * torch.sign(t - loads[i]).to(bias.device, bias.dtype))
        r.clear_stats()
    return maxvio
