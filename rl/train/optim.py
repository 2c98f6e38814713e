"""The learner's optimizers: AdamW, or Muon for the hidden matrices (`optimizer: muon`) with AdamW for the rest.

Muon orthogonalises each update matrix (Newton–Schulz), so it is defined per matrix. `torch.optim.Muon`
takes 2-D parameters only; the routed experts are stacked [E, out, in] (model/moe.py `Experts`), so
`ExpertMuon` applies exactly `torch.optim.Muon`'s update to each expert's matrix `p[e]` — the same
momentum, Newton–Schulz iteration (torch's own), learning-rate adjustment by the matrix shape and
decoupled weight decay — as if the experts were separate 2-D parameters (tests/rl/test_optim.py).
Embeddings and the LM head stay with AdamW (Muon is for hidden layers).

The learning-rate schedule (`build_schedulers`) is transformers' scheduler of the configured name on
each optimizer, a pure function of the optimizer step: a resumed learner recomputes it from its
`version` (`restore_schedulers`) instead of saving its state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch


class ExpertMuon(torch.optim.Optimizer):
    """Muon on stacked matrices [E, A, B]: `torch.optim.Muon`'s step for every p[e] (see module docstring)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, eps: float = 1e-7,
                 adjust_lr_fn: str | None = None):
        from torch.optim import _muon

        params = list(params)
        for p in params:
            if p.ndim != 3:
                raise ValueError(f"ExpertMuon takes stacked matrices [E, A, B], got a parameter of shape {list(p.shape)}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=(_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C), ns_steps=ns_steps,
                        eps=eps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim import _muon

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mom)
                update = p.grad.lerp(buf, mom) if group["nesterov"] else buf
                adjusted = _muon._adjust_lr(lr, group["adjust_lr_fn"], p.shape[1:])
                p.mul_(1 - lr * wd)
                for e in range(p.shape[0]):
                    ortho = _muon._zeropower_via_newtonschulz(update[e], group["ns_coefficients"], group["ns_steps"],
                                                             group["eps"])
                    p[e].add_(ortho, alpha=-adjusted)
        return loss


def build_optimizers(model: torch.nn.Module, params: list[torch.Tensor], cfg: Any,
                     foreach: Optional[bool] = None) -> list[torch.optim.Optimizer]:
    """AdamW over `params` (weight decay on matrices only), or with `cfg.optimizer == "muon"` Muon for the
    hidden matrices (2-D: `torch.optim.Muon`; stacked experts: `ExpertMuon`) and AdamW for the rest.
    `cfg` has lr, weight_decay, adam_beta1/2, adam_eps, muon_momentum, optimizer. `foreach` is AdamW's (None: torch
    chooses; False for DTensor parameters on several device meshes, which its foreach kernels cannot mix)."""
    head = {id(model.get_output_embeddings().weight), id(model.get_input_embeddings().weight)}
    muon2, muon3, decay, no_decay = [], [], [], []
    for p in params:
        hidden_matrix = p.ndim in (2, 3) and min(p.shape[-2:]) > 1 and id(p) not in head
        if cfg.optimizer == "muon" and hidden_matrix:
            (muon2 if p.ndim == 2 else muon3).append(p)
        elif p.ndim >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    # no AdamW when Muon takes every tensor (LoRA adapters are all matrices)
    optimizers: list[torch.optim.Optimizer] = [torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, foreach=foreach)] if groups \
        or not (muon2 or muon3) else []
    if muon2 or muon3:
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(f"optimizer: muon needs torch.optim.Muon, which torch {torch.__version__} "
                               f"does not have; use optimizer: adamw")
        kw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, adjust_lr_fn="match_rms_adamw")
        if muon2:
            optimizers.append(torch.optim.Muon(muon2, **kw))
        if muon3:
            optimizers.append(ExpertMuon(muon3, **kw))
    return optimizers


def build_schedulers(optimizers: list[torch.optim.Optimizer], cfg: Any) -> list[torch.optim.lr_scheduler.LRScheduler]:
    """One transformers scheduler per optimizer (`cfg.lr_scheduler`, `warmup_steps`, `total_steps`);
    call `.step()` on each after every optimizer step that was taken."""
    from transformers import get_scheduler

    name, extra = str(cfg.lr_scheduler), {}
    floor = float(getattr(cfg, "min_lr_ratio", 0.0) or 0.0)
    if name == "wsd":  # warmup, stable, cosine decay over the last decay_steps
        name = "warmup_stable_decay"
        extra = {"num_decay_steps": int(cfg.decay_steps), "min_lr_ratio": floor}
    elif name == "cosine" and floor > 0:
        name, extra = "cosine_with_min_lr", {"min_lr_rate": floor}
    return [get_scheduler(name, opt, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.total_steps,
                          scheduler_specific_kwargs=extra or None) for opt in optimizers]


def restore_schedulers(schedulers: list[torch.optim.lr_scheduler.LRScheduler], step: int) -> None:
    """Set every scheduler (and its optimizer's learning rates) to optimizer step `step`."""
    import warnings

    for sched in schedulers:
        sched.last_epoch = step - 1
        with warnings.catch_warnings():  # "step() before optimizer.step()": intended, nothing is skipped
            warnings.simplefilter("ignore", UserWarning)
            sched.step()



def state_bytes(optimizers) -> int:
    """Bytes of the optimizers' states on this rank (moments, momenta, step counters; local shards under a mesh)."""
    total = 0
    for opt in optimizers:
        for state in opt.state.values():
            for t in state.values():
                if torch.is_tensor(t):
                    t = getattr(t, "_local_tensor", t)  # a DTensor's own shard
                    total += t.numel() * t.element_size()
    return total

__all__ = ["ExpertMuon", "build_optimizers", "build_schedulers", "restore_schedulers", "state_bytes"]
