"""Router control for the learner's forward passes on K3-style MoE models: partial routing replay and padding.

Routing replay (R3, arXiv:2510.11370) feeds the learner the experts the rollout
engine chose, so that training and sampling use the same sparse path. Two facts of k3rl's data
do not fit the model's own replay argument (`K3ForCausalLM.forward(routed_expert_ids=…)`, which
expects an id for every token):

* a `Trajectory.routed_experts` row is -1 where the engine recorded nothing: prompt and
  tool-observation tokens (the engine reports the routing of sampled tokens only) and the
  last sampled token (never fed back);
* the learner right-pads sequences into micro-batches, and padding tokens would otherwise be
  routed and counted in the router-balancing statistics (`model/moe.py: balance_routers`).

`RoutingControl` wraps the `forward(x [N, d], expert_ids [N, k] | None) -> (ids, weights)` of
every router for the duration of a `batch(valid)` block (forward *and* backward, so activation
checkpointing recomputes the same routing). Each call is split by rows:

    real token, recorded ids (no -1)  → replayed;   counted in the balancing statistics
    real token, any -1 in its row     → routed by the learner's own router;   counted
    padding token                     → routed by the router itself;   not counted

and the rows are put back in order; the router's weights stay differentiable. Only the public
router interface is used (`forward`, `top_k`, `collect_stats`). A row is replayed whole or not
at all: the k experts of one token are one decision.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of `model`: modules with a selection bias `e_score_correction_bias`,
    `top_k` and a `collect_stats` switch (K3's `model.moe.Router`)."""
    return [m for m in model.modules()
            if hasattr(m, "e_score_correction_bias") and hasattr(m, "top_k") and hasattr(m, "collect_stats")]


class RoutingControl:
    """Partial replay and padding handling for every router of a model (see module docstring)."""

    def __init__(self, model: nn.Module):
        self.routers = find_routers(model)
        self._valid: Optional[torch.Tensor] = None

    def __bool__(self) -> bool:
        return bool(self.routers)

    @property
    def top_k(self) -> int:
        return self.routers[0].top_k

    @contextmanager
    def batch(self, valid: Optional[torch.Tensor]) -> Iterator[None]:
        """Within the block, routers follow the row rules above; valid [B, T] bool marks real tokens
        of the [B, T] batch the model is called on (None: every token is real)."""
        self._valid = None if valid is None else valid.reshape(-1)  # [B·T]
        originals = []
        for router in self.routers:
            original = router.forward
            originals.append((router, original))
            router.forward = self._wrap(router, original)
        try:
            yield
        finally:
            for router, _ in originals:
                del router.forward
            self._valid = None

    def _wrap(self, router: nn.Module, original):
        def forward(x: torch.Tensor, expert_ids: Optional[torch.Tensor] = None):
            return self._route(router, original, x, expert_ids)

        return forward

    def _route(self, router: nn.Module, original, x: torch.Tensor,
               expert_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d], expert_ids [N, k] (-1 = not recorded) or None → (ids [N, k], weights [N, k])."""
        n = x.shape[0]
        valid = self._valid
        if valid is not None and valid.numel() != n:
            raise ValueError(f"RoutingControl: the router got {n} tokens but the batch mask has {valid.numel()}")
        unknown = None if expert_ids is None else (expert_ids < 0).any(dim=-1)  # [N]
        if valid is None and (unknown is None or not bool(unknown.any())):
            return original(x, expert_ids)
        valid = torch.ones(n, dtype=torch.bool, device=x.device) if valid is None else valid.to(x.device)
        own = torch.ones_like(valid) if unknown is None else unknown.to(x.device)
        parts = []
        for rows, replay, counted in ((valid & ~own, True, True), (valid & own, False, True), (~valid, False, False)):
            index = rows.nonzero()[:, 0]  # [n_rows]
            if index.numel() == 0:
                continue
            collect = router.collect_stats
            router.collect_stats = collect and counted
            try:
                ids, weights = original(x[index], expert_ids[index] if replay else None)  # [n_rows, k] ×2
            finally:
                router.collect_stats = collect
            parts.append((index, ids, weights))
        inverse = torch.cat([p[0] for p in parts]).argsort()  # [N]
        return torch.cat([p[1] for p in parts])[inverse], torch.cat([p[2] for p in parts])[inverse]


__all__ = ["RoutingControl", "find_routers"]
