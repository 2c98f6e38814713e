"""Weights in transit from the learner to the rollout engines: every tensor packed into one byte buffer.

Through Ray, a list of (name, tensor) pairs is pickled tensor by tensor: a few hundred small objects, each its own
copy and header, ~100× a memcpy of the same bytes (bench/weight_sync.py). `pack_weights` copies the tensors once
into one contiguous uint8 numpy buffer (64-byte aligned) beside their names, dtypes and shapes. Ray stores a numpy
buffer out of band and a reader maps it without a copy, so an engine's `load_weights` reads views of the shared
buffer and copies each straight into its own parameter. `PackedWeights` iterates as (name, tensor) pairs, which is
what every engine's `load_weights` (rollout/engine.py) already takes.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 64


@dataclass
class PackedWeights:
    """Named tensors in one buffer: tensor i is `buffer[offsets[i]:offsets[i] + nbytes]` viewed as dtypes[i],
    shapes[i]."""

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    buffer: np.ndarray | torch.Tensor
    """uint8 bytes: a numpy array (through Ray's object store) or a tensor (a broadcast's, on its device)."""

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) views of the buffer (read-only when it came out of Ray's object store: copy, don't write)."""
        if isinstance(self.buffer, torch.Tensor):
            flat = self.buffer
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                flat = torch.from_numpy(self.buffer)
        for name, dtype, shape, offset in zip(self.names, self.dtypes, self.shapes, self.offsets):
            dt = getattr(torch, dtype)
            n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
            yield name, flat[offset:offset + n].view(dt).view(shape)


ADAPTER_SUFFIXES = ("@lora_P", "@lora_Q")


def split_adapters(named: Iterable[tuple[str, torch.Tensor]]
                   ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
    """(the plain (name, tensor) pairs, {name: {"P": …, "Q": …}}) of a push: a LoRA learner's adapter factors
    (rl/train/lora.py `push_tensors`) apart from the tensors loaded as they are."""
    plain, factors = [], {}
    for name, t in named:
        stem, sep, part = name.rpartition("@lora_")
        if sep:
            factors.setdefault(stem, {})[part] = t
        else:
            plain.append((name, t))
    return plain, factors


def merge_adapters(factors: dict[str, dict[str, torch.Tensor]], state: dict[str, torch.Tensor],
                   base: dict[str, torch.Tensor]) -> None:
    """Set `state[name] = base[name] + P @ Q` in place for every factor pair; `base` keeps the engine's own value
    of `name` from before its first adapter push (an engine built from the learner's base model), so every push
    is exact, never a sum of the previous ones. Every pair is checked before anything is written."""
    for name, f in factors.items():
        if set(f) != {"P", "Q"} or name not in state:
            raise ValueError(f"adapter push '{name}': incomplete factors ({sorted(f)}) or a tensor this model "
                             f"does not have")
        shape = (*f["P"].shape[:-1], f["Q"].shape[-1])
        if shape != tuple(state[name].shape) or f["P"].shape[-1] != f["Q"].shape[-2]:
            raise ValueError(f"adapter push '{name}': P {list(f['P'].shape)} @ Q {list(f['Q'].shape)} does not "
                             f"give the tensor's {list(state[name].shape)}")
    with torch.no_grad():
        for name, f in factors.items():
            target = state[name]
            if name not in base:
                base[name] = target.detach().clone()
            target.copy_(base[name] + torch.matmul(f["P"].to(target.dtype), f["Q"].to(target.dtype)))


def pack_weights(named: Iterable[tuple[str, torch.Tensor]], reuse: np.ndarray | None = None) -> PackedWeights:
    """Copy (name, tensor) pairs (any device, any dtype) into one CPU buffer: `reuse` when it has the right size
    (a sender that pushes every step keeps its buffer: a fresh one costs a page fault per 4 KiB on every push)."""
    items = [(name, t.detach()) for name, t in named]
    offsets, end = [], 0
    for _, t in items:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buffer = reuse if reuse is not None and reuse.dtype == np.uint8 and reuse.shape == (end,) else np.empty(end, np.uint8)
    flat = torch.from_numpy(buffer)
    for (_, t), offset in zip(items, offsets):
        n = t.numel() * t.element_size()
        if n:
            flat[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
    return PackedWeights(names=[n for n, _ in items], dtypes=[str(t.dtype).removeprefix("torch.") for _, t in items],
                         shapes=[tuple(t.shape) for _, t in items], offsets=offsets, buffer=buffer)
