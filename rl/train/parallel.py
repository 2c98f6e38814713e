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

Expert parallelism and FSDP2 (`learner_mesh`: `make_mesh`, then `apply_parallelism`, before the optimizer is built),
applied from outside the model:

* the ranks form a DeviceMesh ("dp", "ep") of DP × EP, the EP ranks of one data-parallel replica
  adjacent (rank = dp·EP + ep), as torchtitan lays them out;
* EP (rl/train/expert_parallel.py): every MoE block's `experts` is replaced by a module that keeps E/EP
  experts per rank (DTensors `Shard(0)` on the "ep" dimension) and moves tokens with all-to-all; the
  router stays replicated, so routing replay and the balancing statistics (rl/train/router_balance.py, reduced
  over every rank) work unchanged and the router biases stay equal on all ranks;
* FSDP2 (`fully_shard`): each decoder layer and the root are sharded over all DP × EP ranks; the routed
  experts of a layer are a separate FSDP unit sharded over "dp" only — they are already split over "ep",
  and sharding them again over "dp" (as torchtitan does) divides the largest part of the model by the
  whole world instead of keeping DP copies of each expert shard;
* gradients are SUMS across ranks, as with `all_reduce_grads` (FSDP's divide factor is set to 1 with
  sum-only collectives), so the gradient equals one rank's on the global batch under the loss contract
  of rl/algos/base.py; the expert units zero-fill the gradients of experts a rank's tokens never reached
  (`set_reduce_scatter_unused_params`), other units keep FSDP's rule (a parameter unused on every rank keeps
  `grad = None`; one used on some ranks only would mismatch the collectives, so every rank must run the
  same modules, e.g. image patches on all ranks or none);
* without FSDP, EP gradients are summed by `sync_grads` (replicated parameters over all ranks, expert
  shards over "dp");
* every rank of the mesh must run the same number of forward and backward passes (all-gathers and
  all-to-alls are collectives): the ranks agree on the largest count first (`idle_count`) and a rank with fewer runs
  idle passes that change nothing (rl/train/learner.py); hence no reference model, segments or prefix sharing there,
  and AdamW only (Muon orthogonalises whole matrices);
* the gradient norm is `grad_norm` over the shards (`reduce_grads`), clipping multiplies by a python float
  (`clip_grads`).

Checkpoints of a parallel model: `save_sharded` / `load_sharded` write and read model and optimizer state
with torch.distributed.checkpoint (every rank its shards; the global tensors keep their internal names and
shapes, so a checkpoint loads under another DP × EP layout); `full_state_dict` gathers the whole model on
rank 0 in internal names (stacked experts [E, …]) for export (model/formats/names.py converts the expert names).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, Optional

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


MESH_DIMS = ("dp", "ep")


def make_mesh(expert_parallel: int = 1, device_type: str = "cpu", ranks: Optional[Sequence[int]] = None):
    """DeviceMesh ("dp", "ep") over `ranks` (default: the whole default group) with EP = `expert_parallel`
    adjacent ranks per data-parallel replica. Every rank of the default group must call it."""
    from torch.distributed.device_mesh import DeviceMesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("make_mesh: torch.distributed is not initialised (init_process_group first)")
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    if expert_parallel < 1 or len(ranks) % expert_parallel:
        raise ValueError(f"learner.expert_parallel = {expert_parallel} must divide the number of ranks {len(ranks)}")
    grid = torch.tensor(ranks, dtype=torch.int).view(len(ranks) // expert_parallel, expert_parallel)  # [DP, EP]
    mesh = DeviceMesh(device_type, grid, mesh_dim_names=MESH_DIMS)
    # Create the flattened group now: new groups need every rank of the default group, members or not.
    flat_mesh(mesh)
    return mesh



def learner_mesh(cfg: Any, policy: Any, group: Optional[dist.ProcessGroup] = None, device_type: str = "cpu"):
    """The ("dp", "ep") mesh of an expert-parallel / FSDP2 learner (`cfg`: rl/train/learner.py `LearnerConfig` with
    `sharded`) with `policy`'s model sharded on it (`apply_parallelism`), or None: not sharded, or one rank. Refuses
    a model family that cannot be sharded (model/policy.py `shardable`) and a number of ranks that `expert_parallel`
    does not divide. Every rank calls it, before the optimizer is built."""
    if not cfg.sharded:
        return None
    world_size = get_world_size(group)
    if not policy.shardable:
        raise ValueError(f"learner.expert_parallel / learner.fsdp: K3 models only; {cfg.model_path} is a "
                         f"{getattr(policy.model.config, 'model_type', '?')} model")
    if world_size == 1 and cfg.expert_parallel > 1:
        raise ValueError(f"learner.expert_parallel = {cfg.expert_parallel} needs that many learner ranks or a "
                         f"multiple (learner.num_ranks); this learner has one")
    cfg.check_ranks(world_size)
    if world_size == 1:
        return None
    if group is not None and world_size != get_world_size():
        raise ValueError("learner.expert_parallel / learner.fsdp: the learner must span the whole default "
                         "process group")
    mesh = make_mesh(cfg.expert_parallel, device_type)
    apply_parallelism(policy.model, mesh, fsdp=bool(cfg.fsdp))
    return mesh

def flat_mesh(mesh):
    """The 1-D mesh of all ranks of a ("dp", "ep") `mesh` (created once, then cached by DeviceMesh)."""
    return mesh._flatten("dp_ep")


def mesh_group(mesh) -> dist.ProcessGroup:
    """The process group of all ranks of `mesh`."""
    return flat_mesh(mesh).get_group()


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers (`model.model.layers` of a causal LM, or `model.layers`)."""
    for owner in (getattr(model, "model", None), model):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__}: no decoder layers found (model.model.layers or model.layers)")


def apply_parallelism(model: torch.nn.Module, mesh, fsdp: bool = True,
                      reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shard `model` in place over `mesh` (from `make_mesh`): expert parallelism over "ep" when its size is
    > 1, FSDP2 over all ranks with `fsdp` (experts over "dp"); see the module docstring.
    `reshard_after_forward` applies to the decoder layers (the root's parameters stay gathered from its
    forward to its backward). Returns `model`."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from k3rl.rl.train.expert_parallel import ExpertParallelExperts, shard_experts

    if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(f"apply_parallelism: mesh dims must be {MESH_DIMS}, got {mesh.mesh_dim_names}")
    if mesh["ep"].size() > 1:
        shard_experts(model, mesh["ep"])
    if not fsdp:
        return model
    world = flat_mesh(mesh)
    for layer in decoder_layers(model):
        for m in layer.modules():
            if isinstance(m, ExpertParallelExperts):
                fully_shard(m, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
                m.set_reduce_scatter_unused_params(True, recurse=False)
        fully_shard(layer, mesh=world, reshard_after_forward=reshard_after_forward)
    # The root stays unsharded after forward: the learner applies the final norm and the LM head weight
    # outside the model's forward (model/policy.py), and backward would gather them again at once.
    fully_shard(model, mesh=world, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # SUM, not FSDP's mean: the loss is already divided by the global counts.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def _replicas(t: torch.Tensor, world: int) -> int:
    """How many ranks of a `world`-rank mesh hold each element of t (a plain tensor: all of them)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return world
    shards = 1
    for size, placement in zip(t.device_mesh.shape, t.placements):
        if not placement.is_replicate():
            shards *= size
    return world // shards


def sync_grads(model: torch.nn.Module, mesh) -> None:
    """SUM the gradients of a model parallelised without FSDP: replicated parameters over all ranks of
    `mesh` (`all_reduce_grads`), expert shards over "dp". A no-op under FSDP (its reduce-scatter sums)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if isinstance(model, FSDPModule):
        return
    params = [p for p in model.parameters() if p.requires_grad]
    plain = [p for p in params if not isinstance(p, DTensor)]
    if plain:
        all_reduce_grads(plain, mesh_group(mesh))
    shards = [p for p in params if isinstance(p, DTensor)]
    dp = mesh["dp"].get_group()
    for p in shards:
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # this rank's experts got no token; others may have
        if mesh["dp"].size() > 1:
            dist.all_reduce(p.grad.to_local(), op=dist.ReduceOp.SUM, group=dp)


def grad_norm(params: Sequence[torch.Tensor], mesh) -> torch.Tensor:
    """Global L2 norm of the gradients of `params` (plain tensors or DTensor shards, after the gradient
    sum) over all ranks of `mesh`; every rank gets the same value. Each element counts once."""
    from torch.distributed.tensor import DTensor

    world = mesh.size()
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        total += g.detach().double().pow(2).sum().cpu() / _replicas(p.grad, world)
    dev = "cuda" if str(mesh.device_type).startswith("cuda") else "cpu"
    total = total.to(dev)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mesh_group(mesh))
    return total.sqrt()



def reduce_grads(model: torch.nn.Module, params: Sequence[torch.Tensor], mesh=None,
                 group: Optional[dist.ProcessGroup] = None, device: Any = "cpu") -> torch.Tensor:
    """Sum the gradients of `params` over the ranks and return their global L2 norm: under a mesh `sync_grads` (a no-op
    under FSDP, whose reduce-scatters summed them) and `grad_norm`, else `all_reduce_grads` and torch's norm."""
    if mesh is not None:
        sync_grads(model, mesh)
        return grad_norm(params, mesh)
    all_reduce_grads(params, group)
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)


def clip_grads(params: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor, mesh=None) -> None:
    """Scale the gradients to at most `max_norm`, given their global `norm` (torch's rule: × min(1, max / (norm +
    1e-6)))."""
    if mesh is None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return
    # A python float: DTensor gradients (shards of different meshes) do not take a plain tensor factor.
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)


def idle_count(mine: int, mesh=None, device: Any = "cpu") -> int:
    """Under a mesh, how many idle passes a rank adds to its own `mine` passes (forward, and backward in training) so
    that every rank runs as many as the busiest: each forward and backward of a sharded model holds collectives (FSDP2
    all-gathers and reduce-scatters, the experts' all-to-alls) that every rank must join in the same order. A
    collective itself, before any pass; 0 without a mesh."""
    if mesh is None:
        return 0
    most = all_reduce(torch.tensor([mine], dtype=torch.int64, device=device), "max")
    return int(most.item()) - mine

def save_sharded(directory, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (),
                 group: Optional[dist.ProcessGroup] = None) -> None:
    """Write model and optimizer state to `directory` with torch.distributed.checkpoint (each rank its own
    shards, internal names, global shapes). Every rank of `group` (default: all; the model's mesh must span
    it, e.g. `mesh_group(mesh)`) calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, list(optimizers))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory), process_group=group)


def load_sharded(directory, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (),
                 group: Optional[dist.ProcessGroup] = None) -> None:
    """Read a `save_sharded` checkpoint into a parallelised model and its optimizers (in place); the
    layout may differ from the one that saved it. Every rank of `group` (as in `save_sharded`) calls it.

    Parameters that had no optimizer state when saved (no gradient yet, e.g. unused ones) get none after
    loading either, as in the run that saved it; a model tensor missing from the checkpoint raises a
    KeyError naming it, a misshapen one torch.distributed.checkpoint's error."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (Path(directory) / ".metadata").is_file():
        raise FileNotFoundError(f"{directory}: not a torch.distributed.checkpoint directory (no .metadata)")
    reader = dcp.FileSystemReader(str(directory))
    saved = set(reader.read_metadata().state_dict_metadata)
    model_sd, optim_sd = get_state_dict(model, list(optimizers))
    missing = [k for k in model_sd if f"model.{k}" not in saved]
    if missing:
        raise KeyError(f"{directory}: model tensors missing from the checkpoint: {missing[:5]}"
                       f"{' …' if len(missing) > 5 else ''}")
    # get_state_dict gives every parameter an optimizer state (a zero step); the checkpoint has none for
    # parameters that had none, so those keys are left out of the load and their state dropped after it.
    stateless = {fqn for fqn in optim_sd.get("state", {}) if f"optim.state.{fqn}.step" not in saved}
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=reader, planner=dcp.DefaultLoadPlanner(allow_partial_load=True),
             process_group=group)
    set_state_dict(model, list(optimizers), model_state_dict=state["model"], optim_state_dict=state["optim"])
    if stateless:
        params = dict(model.named_parameters())
        for opt in optimizers:
            for fqn in stateless:
                opt.state.pop(params[fqn], None)


def full_state_dict(model: torch.nn.Module, mesh=None) -> dict[str, torch.Tensor]:
    """The whole model state, gathered one tensor at a time onto the CPU of the first rank of `mesh` (default:
    global rank 0), in internal names with the experts stacked [E, …]; empty on the other ranks. Every rank
    of the mesh calls it (DTensor shards are all-gathered over their own meshes)."""
    from torch.distributed.tensor import DTensor

    keep = (get_rank() == 0) if mesh is None else (get_rank() == int(mesh.mesh.flatten()[0]))
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            # A copy: buffers and unsharded parameters are the model's own tensors, changed by the next step.
            out[name] = full.detach().to("cpu", copy=True)
    return out


__all__ = ["MESH_DIMS", "all_reduce", "all_reduce_grads", "apply_parallelism", "decoder_layers", "default_backend",
           "flat_mesh", "free_port", "full_state_dict", "get_rank", "get_world_size", "grad_norm", "init_process_group",
           "is_distributed", "load_sharded", "make_mesh", "mesh_group", "node_address", "save_sharded",
           "split_balanced", "sync_grads", "union_keys"]
