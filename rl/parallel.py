"""Data parallelism for the learner, applied from outside the model: process groups, gradient SUM, batch splits.

The learner ranks are plain replicas (every rank holds the whole model and optimizer state).
Gradients are accumulated locally over all micro-batches of a step and then summed across
ranks once, in flat buckets (`all_reduce_grads`), instead of wrapping the model in DDP:

* the loss contract of `rl/algos/base.py` divides by global token/sequence counts, so a SUM
  across ranks (not DDP's mean) is exactly the gradient of the whole batch;
* MoE experts that one rank's tokens never reach have no gradient on that rank; DDP needs
  `find_unused_parameters` (an extra pass over the graph) for that, here a parameter with a
  gradient on any rank gets zeros on the others, and one with a gradient on no rank keeps
  `grad = None` everywhere, so AdamW/Muon treat it the same as with one rank;
* one all-reduce per step, whatever the number of micro-batches (DDP would need `no_sync`).
The price is no overlap of communication with the backward pass; FSDP2 is the path for models
that do not fit one device.

The backend is gloo on CPU and NCCL with CUDA (`default_backend`). `init_process_group` is
called by every rank with the address and a free port picked on rank 0's node (`free_port`).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist


def default_backend(device: str) -> str:
    """`nccl` for CUDA devices, `gloo` otherwise."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def free_port() -> int:
    """A TCP port that is free on this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_address() -> str:
    """This node's IP as Ray sees it (what other nodes can reach), or the loopback without Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int,
                       backend: str = "gloo", timeout_s: float = 600.0) -> None:
    """Join the default process group (TCP rendezvous at master_addr:master_port)."""
    dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def is_distributed(group: Optional[dist.ProcessGroup] = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def get_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def get_world_size(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_reduce(t: torch.Tensor, op: str = "sum", group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """In-place all-reduce (`sum`, `max` or `min`) of t; a no-op with one rank. Returns t."""
    if is_distributed(group):
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op],
                        group=group)
    return t


def union_keys(keys: Iterable[str], group: Optional[dist.ProcessGroup] = None) -> list[str]:
    """Sorted union of every rank's keys (ranks without data still take part in the reductions)."""
    mine = sorted(set(keys))
    if not is_distributed(group):
        return mine
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(gathered, mine, group=group)
    return sorted(set().union(*gathered))


def all_reduce_grads(params: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup] = None,
                     bucket_bytes: int = 64 << 20) -> None:
    """SUM the gradients of `params` across ranks, in flat buckets of at most `bucket_bytes`.

    A parameter with a gradient on some rank gets a zero gradient where it has none; one with no
    gradient on any rank stays `None` (so the optimizer skips it as it would with one rank).
    """
    if not is_distributed(group):
        return
    device = params[0].device
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=device)  # [P]
    all_reduce(has, "max", group)
    live = [p for p, h in zip(params, has.tolist()) if h]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    filled: dict[tuple, int] = {}
    for p in live:
        key, nbytes = (p.grad.dtype, p.grad.device), p.grad.numel() * p.grad.element_size()
        groups = buckets.setdefault(key, [[]])
        if groups[-1] and filled[key] + nbytes > bucket_bytes:
            groups.append([])
            filled[key] = 0
        groups[-1].append(p.grad)
        filled[key] = filled.get(key, 0) + nbytes
    for groups in buckets.values():
        for grads in groups:
            flat = torch.cat([g.reshape(-1) for g in grads])  # [sum numel]
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def split_balanced(costs: Sequence[float], n: int) -> list[list[int]]:
    """Indices of `costs` split into n lists with nearly equal total cost (longest first, to the lightest).

    Deterministic; each list keeps ascending index order. Lists may be empty when len(costs) < n.
    """
    if n < 1:
        raise ValueError(f"split_balanced: n must be ≥ 1, got {n}")
    loads = [0.0] * n
    parts: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        j = min(range(n), key=lambda j: (loads[j], j))
        parts[j].append(i)
        loads[j] += costs[i]
    return [sorted(p) for p in parts]


__all__ = ["all_reduce", "all_reduce_grads", "default_backend", "free_port", "get_rank", "get_world_size",
           "init_process_group", "is_distributed", "node_address", "split_balanced", "union_keys"]
