"""What the plan is compared with: the memory of one real learner step.

`measure_step_memory` runs one `Learner.train_step` under saved-tensor hooks and returns the peak of the bytes
autograd holds for backward (each storage once, parameters and buffers left out), the states rl/train/segments.py
keeps across segments, the optimizer states, the parameters and the gradients. tests/rl/test_pretrain_plan.py holds
rl/pretrain/cost.py and rl/pretrain/param_memory.py to it; bench/README.md records the measured numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class _Saved:
    """A tensor saved for backward, counted against its storage until autograd drops it."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter.release(self.key)


class _Meter:
    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.exclude:
            return t
        if key not in self.refs:
            self.refs[key] = 0
            self.sizes[key] = storage.nbytes()
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        return _Saved(t, key, self)

    @staticmethod
    def unpack(obj):
        return obj.tensor if isinstance(obj, _Saved) else obj

    def release(self, key):
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)


def measure_step_memory(learner: Any, trajectories: Sequence[Any]) -> dict[str, Any]:
    """Run one `learner.train_step(trajectories)` and measure what the plan predicts: the peak of the bytes saved
    for backward over the step (each storage counted once, parameters and buffers left out), the states
    rl/train/segments.py keeps across segments (KDA states at each boundary, the MLA latents and their gradient), the
    optimizer states after the step, the parameters and the gradients (at the optimizer step)."""
    import torch

    from k3rl.rl.train import segments

    model = learner.model
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    meter = _Meter(exclude)
    seg_bytes = [0]
    grad_bytes = [0]
    original = segments.forward

    def nbytes(tensors) -> int:
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def forward(*args, **kwargs):
        fwd = original(*args, **kwargs)
        # per node of the unit (rl/train/segments.py): each segment's entering KDA states, the latents it wrote
        states = [t for node in fwd.entering for conv, rec in node for t in (*conv.values(), *rec.values())]
        latents = [t for own in fwd.latents for t in own.values()]
        seg_bytes[0] = max(seg_bytes[0], nbytes(states) + 2 * nbytes(latents))  # latents + gradient
        return fwd

    def at_step(opt, args, kwargs):
        grad_bytes[0] += sum(p.grad.untyped_storage().nbytes() for g in opt.param_groups for p in g["params"]
                             if p.grad is not None)

    hooks = [opt.register_step_pre_hook(at_step) for opt in learner.optimizers]
    segments.forward = forward
    try:
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            metrics = learner.train_step(trajectories)
    finally:
        segments.forward = original
        for h in hooks:
            h.remove()
    opt_bytes = sum(t.untyped_storage().nbytes() for opt in learner.optimizers for state in opt.state.values()
                    for t in state.values() if torch.is_tensor(t))
    return {"activation_bytes": meter.peak + seg_bytes[0], "saved_peak_bytes": meter.peak,
            "segment_state_bytes": seg_bytes[0], "optimizer_state_bytes": opt_bytes,
            "param_bytes": sum(p.untyped_storage().nbytes() for p in model.parameters()),
            "grad_bytes": grad_bytes[0], "micro_batches": int(metrics.get("micro_batches", 0)), "metrics": metrics}


__all__ = ["measure_step_memory"]
