"""Expert parallelism for K3's MoE layers, applied from outside the model: each rank of an expert-parallel
group keeps E/EP of the routed experts and the tokens travel to them with all-to-all.

`shard_experts(model, ep_mesh)` replaces the `experts` module of every `model.moe.MoE` with an
`ExpertParallelExperts` holding only its rank's slice of the stacked weights (w1/w3 [E/EP, I, d_m],
w2 [E/EP, d_m, I]) as DTensors `Shard(0)` on the expert-parallel mesh, so that state dicts and
torch.distributed.checkpoint see the global [E, …] tensors while each rank stores 1/EP of them.
Nothing else in the MoE changes: the router runs replicated on every rank's own tokens (so routing
replay and the balancing statistics of rl/train/router_balance.py are untouched), and the module is called
exactly like `Experts`: `(z [N, d_m], ids [N, k], weights [N, k]) → [N, d_m]`.

One forward, on every rank of the group (all must call it, also with zero tokens):
1. the (token, slot) pairs are sorted by expert (`kernels.moe.dispatch`); experts are owned in
   contiguous blocks (rank r: experts r·E/EP … (r+1)·E/EP − 1), so the sorted pairs are already grouped by
   destination rank;
2. the per-expert counts [EP, E/EP] are exchanged (one all-to-all of EP·E/EP integers), then the pair
   inputs go with `all_to_all_single` and uneven splits;
3. the received rows (source rank-major, then local expert) run through the same grouped expert path
   as one rank (`kernels.moe.routed_experts` with k = 1 and weight 1, on the local experts); an expert
   that receives no rows contributes nothing, a rank that receives none still takes part;
4. the outputs return by the reverse all-to-all into the sorted order and are combined per token with the
   routing weights, in the same order as on one rank (`Dispatch.combine`).
Both all-to-alls are differentiable (`AllToAll`: the backward is the all-to-all with the splits swapped),
so gradients reach z, the routing weights and the local experts. The expert weight gradients are the
sums over every token the owning rank received, i.e. the one-rank gradient of the EP group's tokens;
across data-parallel replicas they are summed by FSDP or `rl.train.parallel.sync_grads`.

Departures: the received rows are computed with k = 1 and weight 1 and the routing weights applied on the
sending rank after the return trip, so the per-expert outputs pass once through the model dtype before
weighting, as they do on one rank. Token dropping, capacity factors and overlap of communication with
compute are not implemented (dropless, synchronous).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from k3rl.kernels.moe import dispatch, routed_experts
from k3rl.model.moe import Experts, MoE


class AllToAll(torch.autograd.Function):
    """Differentiable `dist.all_to_all_single` of the rows of x [M, …] with uneven splits: rank r receives
    `out_splits[s]` rows from each rank s; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])  # [R, …]
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """x [sum(in_splits), …] → [sum(out_splits), …]; differentiable (see `AllToAll`)."""
    return AllToAll.apply(x, list(out_splits), list(in_splits), group)


class ExpertParallelExperts(nn.Module):
    """Drop-in for `model.moe.Experts` holding E/EP experts per rank (see the module docstring).

    `w1`, `w3` [E, I, d_m] and `w2` [E, d_m, I] are DTensor parameters `Shard(0)` on `ep_mesh` (global
    shape [E, …], local [E/EP, …]); `impl` and `act` are those of the replaced `Experts`."""

    def __init__(self, experts: Experts, ep_mesh: DeviceMesh):
        super().__init__()
        if ep_mesh.ndim != 1:
            raise ValueError(f"ExpertParallelExperts: ep_mesh must be 1-D, got {ep_mesh.ndim}-D")
        ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
        self.num_experts = experts.num_experts
        if self.num_experts % ep:
            raise ValueError(f"num_experts {self.num_experts} is not divisible by expert_parallel {ep}")
        self.ep_mesh, self.ep_size, self.ep_rank = ep_mesh, ep, rank
        self.local_experts = self.num_experts // ep
        self.act, self.impl = experts.act, experts.impl
        lo, hi = rank * self.local_experts, (rank + 1) * self.local_experts
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            if isinstance(full, DTensor):
                raise ValueError(f"experts.{name} is already distributed; shard the experts before FSDP")
            local = full.detach()[lo:hi].clone()  # [E/EP, …]: the only copy this rank keeps
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(self, name, nn.Parameter(dt, requires_grad=full.requires_grad))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, local={self.local_experts}, ep={self.ep_size}, rank={self.ep_rank}"

    def _local(self, w: torch.Tensor) -> torch.Tensor:
        # Under FSDP the unsharded parameter is the DTensor on the EP mesh; to_local keeps autograd.
        return w.to_local() if isinstance(w, DTensor) else w

    def forward(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """z [N, d_m], ids [N, k] (global expert ids), weights [N, k] → Σ_k weights·expert_ids(z) [N, d_m]."""
        group = self.ep_mesh.get_group()
        ep, el = self.ep_size, self.local_experts
        plan = dispatch(ids, self.num_experts)
        zs = plan.gather(z)  # [M = N·k, d_m], sorted by expert, hence by owning rank
        send = plan.counts.view(ep, el)  # [EP, E/EP] pairs for each rank's local experts
        recv = torch.empty_like(send)  # [EP, E/EP]: row s = pairs rank s sends to my experts
        dist.all_to_all_single(recv, send.contiguous(), group=group)
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        x = all_to_all(zs, out_splits, in_splits, group)  # [R, d_m], source-rank-major, then local expert
        if x.shape[0]:
            local_ids = torch.arange(el, device=z.device).repeat(ep).repeat_interleave(recv.flatten())  # [R]
            ones = x.new_ones(x.shape[0], 1, dtype=weights.dtype)  # [R, 1]
            y = routed_experts(x, local_ids[:, None], ones, self._local(self.w1), self._local(self.w3),
                               self._local(self.w2), self.act, self.impl)  # [R, d_m]
        else:
            # No rows for my experts: the (empty) result must still hang on x's graph, or this rank would skip
            # the backward all-to-alls that the other ranks wait in.
            y = x * 0  # [0, d_m]
        back = all_to_all(y, in_splits, out_splits, group)  # [M, d_m], the sorted order again
        return plan.combine(back, weights, z.dtype)


def moe_modules(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, module) of every MoE block of `model`, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh) -> list[str]:
    """Replace the experts of every MoE block with their expert-parallel shard (in place). Returns the
    names of the replaced modules. Every MoE layer must have a number of experts divisible by EP."""
    done = []
    for name, moe in moe_modules(model):
        if not isinstance(moe.experts, Experts):
            raise ValueError(f"{name}.experts is a {type(moe.experts).__name__}, not model.moe.Experts "
                             f"(already sharded?)")
        moe.experts = ExpertParallelExperts(moe.experts, ep_mesh)
        done.append(f"{name}.experts")
    return done


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the expert-parallel weights of `model`."""
    return [(f"{mod}.{n}" if mod else n, p) for mod, m in model.named_modules()
            if isinstance(m, ExpertParallelExperts) for n, p in m.named_parameters(recurse=False)]


def local_nbytes(params: Any) -> int:
    """Bytes this rank stores for `params` (the local shard of a DTensor, the whole of a plain tensor)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in params)


__all__ = ["AllToAll", "ExpertParallelExperts", "all_to_all", "expert_parameters", "local_nbytes", "moe_modules",
           "shard_experts"]
