"""Weights from the learner to the rollout engines by one collective broadcast (`rollout.weight_sync: broadcast`).

The object-store path (rollout/weight_transfer.py) copies the packed weights into Ray's store and every engine maps
them from there: right on one node, but across nodes each engine pulls its own copy, and a GPU learner first copies
its weights to host memory. A broadcast sends the packed buffer once over a process group of the learner (rank 0)
and every rollout worker (ranks 1..N): NCCL between GPUs (the learner's buffer never leaves the device; NCCL's
tree/ring reaches N engines in about the time of one), gloo over TCP on the CPU, where the tests run it.

The group is its own: a TCP store hosted by rank 0 and a process group built on it directly (not
`init_process_group`), so it lives beside the learner ranks' data-parallel group and can be formed again when a
worker is replaced (rl/orchestrator/weight_sync.py). Only the layout (names, dtypes, shapes, offsets: a few KB)
goes through Ray with each push; every receiver posts a buffer of the layout's size and the learner sends.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from k3rl.rollout.weight_transfer import PackedWeights

BACKENDS = ("gloo", "nccl")


@dataclass
class WeightLayout:
    """Where each tensor sits in a packed buffer of `nbytes` (PackedWeights without its buffer)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    nbytes: int

    @classmethod
    def of(cls, packed: PackedWeights) -> WeightLayout:
        return cls(list(packed.names), list(packed.dtypes), list(packed.shapes), list(packed.offsets),
                   int(packed.buffer.shape[0]))

    def with_buffer(self, buffer: np.ndarray | torch.Tensor) -> PackedWeights:
        if tuple(buffer.shape) != (self.nbytes,):
            raise ValueError(f"weight broadcast: a buffer of {tuple(buffer.shape)} bytes for a layout of {self.nbytes}")
        return PackedWeights(self.names, self.dtypes, self.shapes, self.offsets, buffer)


class BroadcastGroup:
    """One rank of a weight-broadcast group: rank 0 hosts the TCP store at `address` ("host:port") and sends, the
    others receive. Every rank must construct it at about the same time (the constructor waits for all of them, up
    to `timeout_s`)."""

    def __init__(self, address: str, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 300.0):
        if backend not in BACKENDS:
            raise ValueError(f"weight broadcast backend: {backend!r} is not one of {', '.join(BACKENDS)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"weight broadcast: rank {rank} outside a group of {world_size}")
        host, _, port = address.rpartition(":")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout, wait_for_workers=False)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(self.store, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
            self.device = torch.device("cpu")

    def _broadcast(self, buffer: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([buffer], options).wait()

    def send(self, packed: PackedWeights) -> None:
        """Rank 0: broadcast the packed buffer (moved to this group's device first if it is not there)."""
        if self.rank != 0:
            raise RuntimeError("weight broadcast: only rank 0 sends")
        buffer = packed.buffer if isinstance(packed.buffer, torch.Tensor) else torch.from_numpy(packed.buffer)
        self._broadcast(buffer.to(self.device))

    def receive(self, layout: WeightLayout) -> PackedWeights:
        """Ranks 1..N: the packed weights of `layout`, in a buffer on this group's device."""
        if self.rank == 0:
            raise RuntimeError("weight broadcast: rank 0 sends, it does not receive")
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        self._broadcast(buffer)
        return layout.with_buffer(buffer)


__all__ = ["BACKENDS", "BroadcastGroup", "WeightLayout"]
