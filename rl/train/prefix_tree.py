"""Prefix-tree training: the sequences of a batch that start alike (a group's prompt, the first turns its samples
agree on, the system and task every context of a compacted episode restarts from) run as a tree whose every shared
prefix is computed once, its gradient the sum over everything after it. Exact: loss and every gradient equal those
of the sequences run apart, up to rounding (tests/rl/test_prefix_tree.py, float64).

    sequences (sorted)            tree                              nodes (parents first)
    S A x y                       root "S A" ── "x y"  (leaf)       0: S A          b=1
    S A B c d                               └─ "B" ── "c d" (leaf)  1: x y | …     b=leaves of 0, right-padded
    S A B e                                        └─ "e"   (leaf)  2: B            b=1, parent 0
                                                                    3: c d | e     b=2, parent 2

Planning (`plan_trees`): sequences that share their first `min_shared` positions (same tokens, same recorded
routing, the same image patch at a placeholder) form a cluster; a cluster is sorted (lexicographic order is the
trie's depth-first order) and cut into units of at most `token_budget` distinct tokens (a shared prefix longer than
half the budget counts as half: it would run in segments anyway) and `max_seqs` sequences.

Building (`build_tree`): a span shared by at least two sequences and `min_shared` positions long becomes a node with
one row; what is left of each sequence under a node (at least one position each) becomes a row of that node's leaf
batch. Shared spans may hold loss rows: where members of a node score the same position, its hidden state is
computed once and each (position, target) pair is scored once; every member's loss token then takes its pair
(`PrefixTree.gather`), so the objective (rl/algos/) sees its usual flat [N] layout, sequence by sequence, and the
gradients of a shared log π sum over the members that read it.

Run by rl/train/segments.py (K3 segment by segment, or one graph through model/policy.py `Policy.tree_hidden`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from k3rl.model.policy import BranchNode
from k3rl.rl.train.batching import TrainSequence

MIN_SHARED = 16
"""Positions a span must share to run once: a shorter one costs a forward call more than it saves."""


@dataclass
class PrefixTree:
    """The nodes of one unit and how its loss tokens read them."""

    nodes: list[BranchNode]
    """Parents before children (model/policy.py `BranchNode`); their read positions are the scored pairs' rows."""
    pairs: list[torch.Tensor]
    """Per node, [m_k] int64: the pair each of its read positions scores (a position read by several pairs, one per
    target, is listed once per pair)."""
    targets: torch.Tensor
    """[M] int64: the target token of each (position, target) pair."""
    gather: torch.Tensor
    """[N] int64: the pair of each loss token of the unit's sequences, row-major as rl/train/batching.py `collate`."""
    patch_table: Optional[torch.Tensor] = None
    """[M, C, p, p] uint8, the patches of the members' images (the nodes' `patch_ids` point here), or None."""

    @property
    def computed_tokens(self) -> int:
        """Positions the tree runs (padding excluded): each shared span once."""
        return int(sum(int(n.valid.sum()) for n in self.nodes))

    @property
    def root_len(self) -> int:
        return int(self.nodes[0].ids.shape[1])

    def without_routing(self) -> PrefixTree:
        """The same tree routing itself (a reference policy's)."""
        nodes = [BranchNode(n.parent, n.start, n.ids, n.valid, None, n.read_b, n.read_t, n.patch_ids)
                 for n in self.nodes]
        return PrefixTree(nodes, self.pairs, self.targets, self.gather, self.patch_table)


def _first_difference(a: TrainSequence, b: TrainSequence, start: int = 0) -> int:
    """The first position ≥ `start` where `a` and `b` differ (token, recorded routing, or the image patch at a
    placeholder), or the shorter length."""
    n = min(len(a.inputs), len(b.inputs))
    differ = a.inputs[start:n] != b.inputs[start:n]
    if (a.routed is None) != (b.routed is None):
        return start
    if a.routed is not None:
        differ = differ | (a.routed[start:n] != b.routed[start:n]).reshape(n - start, -1).any(-1)
    if a.patch_at is not None or b.patch_at is not None:
        pa, pb = _patch_at(a)[start:n], _patch_at(b)[start:n]
        both = np.flatnonzero((pa >= 0) & (pb >= 0))
        differ = differ | ((pa >= 0) != (pb >= 0))
        if len(both):
            other = (a.patches[pa[both]] != b.patches[pb[both]]).reshape(len(both), -1).any(-1)
            differ[both[other]] = True
    hits = np.flatnonzero(differ)
    return start + int(hits[0]) if len(hits) else n


def _patch_at(s: TrainSequence) -> np.ndarray:
    return s.patch_at if s.patch_at is not None else np.full(len(s.inputs), -1, dtype=np.int32)


def _compare(a: TrainSequence, b: TrainSequence) -> int:
    """Lexicographic order over (token, routing) per position: the trie's depth-first order."""
    i = _first_difference(a, b)
    if i >= min(len(a.inputs), len(b.inputs)):
        return (len(a.inputs) > len(b.inputs)) - (len(a.inputs) < len(b.inputs))
    ka, kb = _key(a, i), _key(b, i)
    return (ka > kb) - (ka < kb)


def _key(s: TrainSequence, i: int) -> tuple:
    patch = b"" if s.patch_at is None or s.patch_at[i] < 0 else s.patches[s.patch_at[i]].tobytes()
    return (int(s.inputs[i]), () if s.routed is None else tuple(s.routed[i].ravel().tolist()), patch)


def plan_trees(seqs: Sequence[TrainSequence], token_budget: int, max_seqs: Optional[int] = None,
               min_shared: int = MIN_SHARED) -> tuple[list[list[int]], list[int]]:
    """Sequences into tree units (index lists in trie order) and the rest (run without sharing). Packed sequences
    (several documents) are never shared; a unit saving fewer than `min_shared` positions is dissolved."""
    clusters: dict[tuple, list[int]] = {}
    for i, s in enumerate(seqs):
        if s.positions is None and len(s.inputs) > min_shared:
            head = tuple(_key(s, i) for i in range(min_shared))
            clusters.setdefault(head, []).append(i)
    units: list[list[int]] = []
    for members in clusters.values():
        if len(members) < 2:
            continue
        order = sorted(members, key=functools.cmp_to_key(lambda i, j: _compare(seqs[i], seqs[j]) or (i > j) - (i < j)))
        unit: list[int] = []
        distinct = root = 0
        for i in order:
            n = len(seqs[i].inputs)
            if unit:  # each sequence keeps one position of its own
                lcp = min(_first_difference(seqs[unit[-1]], seqs[i]), n - 1, len(seqs[unit[-1]].inputs) - 1)
                grown, grown_root = distinct + n - lcp, min(root, lcp)
                cost = min(grown_root, token_budget // 2) + grown - grown_root
                if cost <= token_budget and (max_seqs is None or len(unit) < max_seqs):
                    unit.append(i)
                    distinct, root = grown, grown_root
                    continue
                units.append(unit)
            unit, distinct, root = [i], n, n - 1
        units.append(unit)
    kept = [u for u in units if len(u) > 1 and sum(len(seqs[i].inputs) for i in u) - _distinct(seqs, u) >= min_shared]
    shared = {i for u in kept for i in u}
    return kept, [i for i in range(len(seqs)) if i not in shared]


def _distinct(seqs: Sequence[TrainSequence], unit: list[int]) -> int:
    """Positions of the unit's trie (sequences in trie order), each keeping one position of its own."""
    total = len(seqs[unit[0]].inputs)
    for a, b in zip(unit[:-1], unit[1:]):
        n = len(seqs[b].inputs)
        total += n - min(_first_difference(seqs[a], seqs[b]), n - 1, len(seqs[a].inputs) - 1)
    return total


@dataclass
class _Span:
    members: list[int]
    """Indices into the unit's sequences."""
    start: int
    end: int
    parent: int


def build_tree(seqs: Sequence[TrainSequence], device: torch.device, routing_shape: Optional[tuple[int, int]],
               min_shared: int = MIN_SHARED) -> PrefixTree:
    """The prefix tree of `seqs` (one unit of `plan_trees`, in its order); routing is replayed with `routing_shape`
    (L, k), None: none."""
    spans: list[_Span] = []  # shared spans, parents first
    leaves: dict[int, list[int]] = {}  # span index → members whose own rest is a row of its leaf batch

    def grow(members: list[int], start: int, parent: int) -> None:
        end = min(len(seqs[m].inputs) for m in members) - 1  # each keeps one position of its own
        for m in members[1:]:
            end = min(end, _first_difference(seqs[members[0]], seqs[m], start))
        if len(members) < 2 or end - start < min_shared:
            leaves.setdefault(parent, []).extend(members)
            return
        spans.append(_Span(members, start, end, parent))
        k = len(spans) - 1
        children: dict[tuple, list[int]] = {}
        for m in members:
            children.setdefault(_key(seqs[m], end), []).append(m)
        for child in children.values():
            grow(child, end, k)

    grow(list(range(len(seqs))), 0, -1)
    if not spans:
        raise ValueError("build_tree: the sequences share no span of min_shared positions")
    # node list: each shared span, then its leaf batch (if any), in depth-first order (parents first)
    node_of_span: dict[int, int] = {}
    plan: list[tuple[str, int]] = []
    for k in range(len(spans)):
        plan.append(("span", k))
        if k in leaves:
            plan.append(("leaves", k))
    offsets, tables = {}, []  # each member's patches in the tree's table
    for m, s in enumerate(seqs):
        if s.patch_at is not None:
            offsets[m] = sum(len(t) for t in tables)
            tables.append(s.patches)
    pair_ids: dict[tuple[int, int, int, int], int] = {}  # (node, row, column, target) → pair
    gather: list[np.ndarray] = []
    pending: dict[int, list[int]] = {}  # member → pair of each of its loss tokens, in order
    nodes: list[BranchNode] = []
    pairs: list[list[int]] = []
    reads: list[tuple[list[int], list[int]]] = []

    def read(node: int, row: int, col: int, target: int) -> int:
        key = (node, row, col, target)
        if key not in pair_ids:
            pair_ids[key] = len(pair_ids)
            pairs[node].append(pair_ids[key])
            reads[node][0].append(row)
            reads[node][1].append(col)
        return pair_ids[key]

    for kind, k in plan:
        span = spans[k]
        if kind == "span":
            node_of_span[k] = len(nodes)
            rows = [(m, span.start, span.end) for m in span.members]
            parent = -1 if span.parent < 0 else node_of_span[span.parent]
            width, batch = span.end - span.start, 1
        else:
            rows = [(m, span.end, len(seqs[m].inputs)) for m in leaves[k]]
            parent = node_of_span[k]
            width, batch = max(b - a for _, a, b in rows), len(rows)
        node = len(nodes)
        pairs.append([])
        reads.append(([], []))
        ids = np.zeros((batch, width), dtype=np.int64)
        valid = np.zeros((batch, width), dtype=bool)
        patch_ids = np.full((batch, width), -1, dtype=np.int64) if tables else None
        routed = None
        if routing_shape is not None and any(seqs[m].routed is not None for m, _, _ in rows):
            routed = np.full((batch, width, *routing_shape), -1, dtype=np.int64)
        for r, (m, a, b) in enumerate(rows):
            s, row = seqs[m], 0 if kind == "span" else r
            if kind == "leaves" or r == 0:
                ids[row, :b - a] = s.inputs[a:b]
                valid[row, :b - a] = True
                if routed is not None and s.routed is not None:
                    routed[row, :b - a] = s.routed[a:b]
                if patch_ids is not None and s.patch_at is not None:
                    at = s.patch_at[a:b]
                    patch_ids[row, :b - a] = np.where(at >= 0, at + offsets[m], -1)
            for p in np.flatnonzero(s.mask[a:b]):
                pending.setdefault(m, []).append(read(node, row, int(p), int(s.targets[a + p])))
        start = span.start if kind == "span" else span.end
        nodes.append(BranchNode(parent, start, torch.from_numpy(ids).to(device), torch.from_numpy(valid).to(device),
                                None if routed is None else torch.from_numpy(routed).to(device),
                                torch.tensor(reads[node][0], dtype=torch.long, device=device),
                                torch.tensor(reads[node][1], dtype=torch.long, device=device),
                                None if patch_ids is None else torch.from_numpy(patch_ids).to(device)))
    targets = np.zeros(len(pair_ids), dtype=np.int64)
    for (_, _, _, target), pair in pair_ids.items():
        targets[pair] = target
    for m in range(len(seqs)):  # each member's loss tokens in position order: spans along its path, then its leaf
        gather.append(np.asarray(pending.get(m, []), dtype=np.int64))
    return PrefixTree(nodes, [torch.tensor(p, dtype=torch.long, device=device) for p in pairs],
                      torch.from_numpy(targets).to(device), torch.from_numpy(np.concatenate(gather)).to(device),
                      torch.from_numpy(np.concatenate(tables)).to(device) if tables else None)


__all__ = ["MIN_SHARED", "PrefixTree", "build_tree", "plan_trees"]
