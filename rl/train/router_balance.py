"""Loss-free router balancing: after each optimizer step, update every MoE router's selection bias
`e_score_correction_bias` from the statistics its forward passes collected (model/moe.py `Router._record`).
Training code, applied from outside the model: the reductions over learner ranks live here, the model
stays single-device.

Quantile balancing (QB, docs/model_spec.md Part A) gives expert j the bias change
`Δb_j = −Q_{1−T/m}(a_ij − τ_ij)`, with `a = s + b`, `τ_ij` the k-th largest biased score among the other
experts of token i and `T = m·k/E`: the shift that, applied to that batch with the other biases held
fixed, would have given expert j exactly T tokens. It is damped by `router_balance.step_size`. `Q` is
the exact order statistic: the midpoint between the round(T)-th and the next largest margin. The
alternative is DeepSeek-V3's `b_j += γ·sign(T − load_j)`; `none` leaves the bias alone.

Under torch.distributed the quantile is found by bisection on all-reduced counts (one all-reduce of an
[L, E] count tensor per bisection step, all layers at once; each rank sorts its own margins once so a
count is a binary search), then refined to the exact global order statistics with a MIN/MAX
all-reduce, so the result equals the single-process result on the concatenated batch; no margins are
gathered. The same code runs in one process. Each rank keeps its margins, [tokens seen this step, E]
fp32 per MoE layer (only under `quantile`), until `balance_routers`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from k3rl.model.moe import Router
from k3rl.rl.train.parallel import all_reduce


def named_routers(model: nn.Module) -> list[tuple[str, Router]]:
    """(MoE module name, router) for every router of `model`, in module order."""
    return [(name.rpartition(".")[0] if name.rpartition(".")[2] == "gate" else name, m)
            for name, m in model.named_modules() if isinstance(m, Router)]


def routers(model: nn.Module) -> list[Router]:
    """The MoE routers of `model` (empty for dense models)."""
    return [r for _, r in named_routers(model)]


def clear_stats(model: nn.Module) -> None:
    """Forget the balancing statistics collected so far (e.g. of a skipped step)."""
    for router in routers(model):
        router.clear_stats()


@contextmanager
def stats_paused(routers: list[Router]) -> Iterator[None]:
    """Leave the routing of the forwards inside out of the balancing statistics (the learner's scoring and idle passes,
    and a segmented forward whose backward recomputes and counts it)."""
    before = [r.collect_stats for r in routers]
    for r in routers:
        r.collect_stats = False
    try:
        yield
    finally:
        for r, c in zip(routers, before):
            r.collect_stats = c


def quantile_bias_delta(margins: list[torch.Tensor], target: torch.Tensor,
                        group: Optional[dist.ProcessGroup] = None, max_iters: int = 64) -> torch.Tensor:
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
        return all_reduce(cnt, "sum", group)

    zero = torch.zeros(e, dtype=torch.long, device=inf.device)
    lo = all_reduce(torch.stack([at(col, zero, inf) for col in cols]), "min", group) - 1
    hi = all_reduce(torch.stack([at(col, zero + col.shape[1] - 1, -inf) for col in cols]), "max", group)
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
    upper = all_reduce(upper, "min", group)  # c-th largest
    lower = all_reduce(lower, "max", group)  # (c+1)-th largest
    # Fewer than c margins above hi means the c-th and (c+1)-th are tied (to bisection precision).
    upper = torch.where(count_above(hi) < c, lower, upper)
    return -(upper + lower) / 2


@torch.no_grad()
def balance_routers(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
    """Update every router bias from the statistics of the step and clear them; call after
    `optimizer.step()`. Returns MaxVio `(max_j load_j − T)/T` of the step per MoE module name
    (layers that saw no tokens are left out). Under torch.distributed every rank of `group`
    must call it: statistics are reduced over the group, so all ranks apply the same update."""
    named = named_routers(model)
    if not named:
        return {}
    bias0 = named[0][1].e_score_correction_bias
    e = named[0][1].num_experts
    if any(r.num_experts != e for _, r in named):
        raise ValueError("balance_routers expects the same num_experts in every MoE layer")
    zeros = torch.zeros(e, dtype=torch.long, device=bias0.device)
    stats = torch.stack([torch.cat([r._loads.to(bias0.device) if r._loads is not None else zeros,
                                    zeros.new_tensor([r._tokens])]) for _, r in named])  # [L, E+1]
    stats = all_reduce(stats, "sum", group)
    loads, tokens = stats[:, :e].double(), stats[:, e]  # [L, E], [L]

    quantile = [i for i, (_, r) in enumerate(named)
                if r.balance.method == "quantile" and tokens[i] > 1 and r.top_k < e]
    if quantile:
        margins = [torch.cat(named[i][1]._margins).to(bias0.device) if named[i][1]._margins
                   else torch.empty(0, e, device=bias0.device) for i in quantile]
        k = torch.tensor([named[i][1].top_k for i in quantile], device=bias0.device)
        # c = round(T), kept in [1, m − 1] so both order statistics exist.
        target = torch.minimum((tokens[quantile] * k / e).round().long().clamp(1, None), tokens[quantile] - 1)
        deltas = dict(zip(quantile, quantile_bias_delta(margins, target, group)))

    maxvio = {}
    for i, (name, r) in enumerate(named):
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
