"""How the learner runs a batch of training sequences (rl/train/batching.py): as pieces, packed into micro-batches,
as units (rl/train/segments.py `Unit`).

A packed sequence (several documents) longer than a segment is cut into its documents (`pieces`), since segments run
one document per row; micro-batches hold whole pieces within `micro_batch_tokens`, longest first, packed pieces apart
from the rest (`pack`); with prefix sharing, sequences that start alike form prefix trees whose shared spans are
computed once (rl/train/prefix_tree.py), the others are packed whole (`make_units`). Under a mesh, a rank with fewer units than the
busiest runs idle passes (`idle_pass`), since every forward and backward of a sharded model holds collectives.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from k3rl.rl.train import router_balance
from k3rl.rl.train.batching import TrainSequence, collate, pack_micro_batches, split_documents
from k3rl.rl.train.prefix_tree import build_tree, plan_trees
from k3rl.rl.train.segments import Unit


def pieces(seq: TrainSequence, segment_tokens: Optional[int], segmented: bool) -> list[TrainSequence]:
    """A sequence as the learner runs it: a packed sequence longer than a segment is cut into its documents
    (rl/train/batching.py `split_documents`) when the policy trains through segments (`segmented`)."""
    if seq.positions is None or not segmented or not segment_tokens or len(seq.inputs) <= segment_tokens:
        return [seq]
    return split_documents(seq, segment_tokens)


def pack(seqs: list[TrainSequence], token_budget: int, max_seqs: Optional[int]) -> list[list[int]]:
    """Micro-batches (indices into `seqs`) within `token_budget`, longest first; packed sequences (several documents,
    never longer than a segment after `pieces`) apart from the rest, since a micro-batch longer than a segment runs
    segment by segment, one document per row."""
    groups = [[i for i, s in enumerate(seqs) if (s.positions is not None) == packed] for packed in (False, True)]
    return [[group[j] for j in idx] for group in groups if group
            for idx in pack_micro_batches([len(seqs[i].inputs) for i in group], token_budget, max_seqs)]


def make_units(seqs: list[TrainSequence], cfg: Any, policy: Any, device: torch.device,
               routing_shape: Optional[tuple[int, int]], share_prefix: bool) -> list[Unit]:
    """Micro-batches as units: prefix trees of the sequences that start alike (with `share_prefix`, when the policy
    can branch from a shared prefix), then the rest packed whole, longest first, within `cfg.micro_batch_tokens`.
    `routing_shape` (L, k) replays recorded routings; None: none."""
    seqs = [piece for s in seqs for piece in pieces(s, cfg.segment_tokens, policy.segments)]
    units: list[Unit] = []
    rest = list(range(len(seqs)))
    if share_prefix and policy.can_share_prefix(cfg.recompute):
        trees, rest = plan_trees(seqs, cfg.micro_batch_tokens, cfg.micro_batch_seqs)
        for members in trees:
            chosen = [seqs[i] for i in members]
            units.append(Unit(collate(chosen, device, None), build_tree(chosen, device, routing_shape)))
    for idx in pack([seqs[i] for i in rest], cfg.micro_batch_tokens, cfg.micro_batch_seqs):
        units.append(Unit(collate([seqs[rest[j]] for j in idx], device, routing_shape)))
    return units


def idle_pass(policy: Any, routers: list, chunk_size: int, device: torch.device, grad: bool) -> None:
    """One forward (and backward) through every module a micro-batch uses, changing nothing: a one-token input
    (a real token, attended, so that every value is finite and 0 × it is 0), its routing left out of the
    balancing statistics, and a loss of 0 × log π, whose gradient is exactly zero on every parameter it
    reaches — the same parameters as a real micro-batch's, so FSDP2 reduces the same set on every rank."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)  # [1, 1]
    rows = torch.ones_like(ids, dtype=torch.bool)  # [1, 1]
    with router_balance.stats_paused(routers), torch.set_grad_enabled(grad):
        hidden = policy.final_hidden(ids, attention_mask=rows.long(), rows=rows)  # [1, d]
        logp = policy.selected_logprobs(hidden, ids[0], chunk_size)  # [1]
        if grad:
            (logp.sum() * 0.0).backward()
