"""Segment-recurrent training and prefix trees: forward and backward of long sequences, and of prefix trees of
sequences (rl/train/prefix_tree.py), through the K3 model's own recurrence (docs/model_spec.md §5.6, §6; model/cache.py).

A K3 sequence's past is small: per KDA layer a conv window and a recurrent state [H, K, V], per MLA layer the
latent of every earlier token (Lkv + dr values). So a long sequence trains a segment at a time:

  pass 1 (no grad)  the segments run in order through a `K3Cache`; the KDA states entering each segment are kept
                    (constant size), and at the end every MLA latent; the loss-mask rows are scored (log π).
  the loss          the objective (rl/algos/) is evaluated on the gathered log π as a leaf; its backward gives
                    dL/dlog π [N]. Every objective sees the model only through log π, so this is exact for
                    sequence-level ones (GSPO's ratio) as well.
  pass 2            segments in reverse: the entering state is rebuilt as leaves (the kept KDA states, the
                    latents of all earlier tokens), the segment is recomputed with grad and backpropagated with
                    dL/dlog π of its rows plus the gradients its outputs received from the later segments (the
                    KDA states leaving it; its own latents, which every later segment read); the leaves'
                    gradients go to the segment before.

Loss and every gradient equal the unsegmented ones up to rounding (tests/rl/test_segments.py, float64); activation
memory is one segment's (the whole sequence's MLA latents and their gradient are kept: Lkv + dr values per token and
MLA layer); the price is one more forward. MLA inside a segment attends block by block, and under grad each block
is recomputed in backward (model/mla.py), so no segment × sequence score matrix is ever held.

Prefix trees (rl/train/prefix_tree.py): a `Unit` may be a tree of nodes, each continuing its parent's state
repeated to its rows (`K3Cache.select`); the gradients of its rows flow back into the parent summed — one autograd
graph when the unit fits in a segment (model/policy.py `Policy.tree_hidden`, any HF model too, through its KV cache),
the two passes above otherwise (K3): nodes run parents first in pass 1 and children first in pass 2, a node's
entering-state gradients summed over its rows go to its parent's final state, and the gradients of the latents a
node read go to the ancestors that wrote them. A plain micro-batch is a tree of one node. A shared span's tokens
count once in the router statistics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from k3rl.model.cache import K3Cache
from k3rl.model.policy import BranchNode
from k3rl.model.vision import image_inputs
from k3rl.rl.train.batching import MicroBatch
from k3rl.rl.train.prefix_tree import PrefixTree


@dataclass
class Unit:
    """What one forward/backward trains: a micro-batch of sequences, run as they are or as a prefix tree."""

    mb: MicroBatch
    """The sequences (right-padded rows, loss rows packed as rl/algos/base.py `LossInputs` wants them); a tree unit
    carries no routing here (its nodes do)."""
    tree: Optional[PrefixTree] = None
    """The sequences' prefix tree (rl/train/prefix_tree.py), or None: the rows run as they are."""

    @property
    def prefix_len(self) -> int:
        """Positions of the tree's root span (0 without a tree)."""
        return 0 if self.tree is None else self.tree.root_len

    @property
    def length(self) -> int:
        """Positions of the longest path."""
        if self.tree is None:
            return self.mb.input_ids.shape[1]
        return max(n.start + n.ids.shape[1] for n in self.tree.nodes)

    @property
    def computed_tokens(self) -> int:
        """Positions a forward runs (padding excluded)."""
        return int(self.mb.valid.sum()) if self.tree is None else self.tree.computed_tokens

    @property
    def targets(self) -> torch.Tensor:
        """[M] the scored targets: one per loss token, or one per (position, target) pair of a tree."""
        return self.mb.targets if self.tree is None else self.tree.targets

    def to_tokens(self, scored: torch.Tensor) -> torch.Tensor:
        """Per-pair values [M] (log π, entropy) → per loss token [N] (a shared pair's gradients sum back)."""
        return scored if self.tree is None else scored[self.tree.gather]

    def without_routing(self) -> Unit:
        """The same unit routing itself (a reference policy's)."""
        return Unit(dataclasses.replace(self.mb, routed=None), None if self.tree is None else self.tree.without_routing())

    def nodes(self) -> tuple[list[BranchNode], list[torch.Tensor]]:
        """(nodes, per node the pair of each read position): the tree's, or one node of every row."""
        if self.tree is not None:
            return self.tree.nodes, self.tree.pairs
        mb = self.mb
        read_b, read_t = mb.loss_mask.nonzero(as_tuple=True)  # row-major: the [N] order
        return [BranchNode(-1, 0, mb.input_ids, mb.valid, mb.routed, read_b, read_t, mb.patch_ids)], [
            torch.arange(read_b.numel(), device=read_b.device)]

    @property
    def patch_table(self) -> Optional[torch.Tensor]:
        """The patches the nodes' `patch_ids` point at, or None."""
        return self.mb.patch_table if self.tree is None else self.tree.patch_table


def cuts(length: int, segment_tokens: Optional[int]) -> list[tuple[int, int]]:
    """[lo, hi) column ranges of a node cut every `segment_tokens` positions."""
    step = segment_tokens or length or 1
    return [(lo, min(length, lo + step)) for lo in range(0, length, step)]


def needs_segments(unit: Unit, segment_tokens: Optional[int]) -> bool:
    """True when a node of the unit is longer than one segment."""
    if not segment_tokens:
        return False
    nodes, _ = unit.nodes()
    return max(n.ids.shape[1] for n in nodes) > segment_tokens


Scorer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, Optional[torch.Tensor]]]
"""(normed hidden rows [n, d], their pairs [n], indices into `Unit.targets`) → (log π [n], entropy [n] or None)."""


def _run(model, node: BranchNode, lo: int, hi: int, cache: K3Cache, pairs: torch.Tensor,
         patch_table: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns [lo, hi) of a node through the cache → (normed hidden states of its read positions there [n, d],
    their pairs [n])."""
    routed = None if node.routed is None else node.routed[:, lo:hi]
    images = {} if node.patch_ids is None else image_inputs(patch_table, node.patch_ids[:, lo:hi])
    out = model(node.ids[:, lo:hi], cache=cache, routed_expert_ids=routed, routing_mask=node.valid[:, lo:hi],
                **images, return_hidden_states=True, logits_to_keep=1)
    inside = (node.read_t >= lo) & (node.read_t < hi)
    if not bool(inside.any()):
        return out.hidden_states.new_zeros(0, out.hidden_states.shape[-1]), pairs[:0]
    hidden = out.hidden_states[node.read_b[inside], node.read_t[inside] - lo]
    return model.model.norm(hidden), pairs[inside]


def graph_logprobs(policy, unit: Unit, score: Scorer) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log π (and entropy) [M] of a tree unit's pairs as one autograd graph (model/policy.py `Policy.tree_hidden`;
    K3 and HF models). For units within one segment; the caller maps them to tokens (`Unit.to_tokens`) and
    backpropagates its loss through the result."""
    nodes, pairs = unit.nodes()
    order = torch.cat(pairs)
    lp, ent = score(policy.tree_hidden(nodes, unit.patch_table), order)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return lp[inverse], None if ent is None else ent[inverse]


def _ancestors(nodes: list[BranchNode], k: int) -> list[int]:
    """The nodes on the path to node k, root first (k excluded)."""
    path = []
    while nodes[k].parent >= 0:
        k = nodes[k].parent
        path.append(k)
    return path[::-1]


@dataclass
class _Forward:
    """What pass 1 keeps: log π and entropy of every pair, each node's segments' entering KDA states, and the
    latents each node wrote."""

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    entering: list[list[tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]]]
    latents: list[dict[int, torch.Tensor]]
    """Per node, per MLA layer: [b, t, D], the latents of its own columns."""


@torch.no_grad()
def forward(model, unit: Unit, segment_tokens: Optional[int], score: Scorer, keep_states: bool = True) -> _Forward:
    """Pass 1: the unit's nodes, parents first, segment by segment without grad (also what scoring a long sequence
    needs). Log π and entropy per pair ([M], `Unit.targets`)."""
    if unit.mb.position_ids is not None:
        raise ValueError("segments run one document per row: cut packed sequences first (rl/train/batching.py "
                         "split_documents)")
    nodes, pairs = unit.nodes()
    M = unit.targets.numel()
    device = unit.mb.input_ids.device
    capacity = max(n.start + n.ids.shape[1] for n in nodes)
    parents = {n.parent for n in nodes}
    finals: dict[int, K3Cache] = {}
    logp = entropy = None
    entering: list = []
    latents: list = []
    for k, node in enumerate(nodes):
        b, t = node.ids.shape
        if node.parent < 0:
            cache = model.new_cache(b, capacity=capacity)
        else:
            cache = finals[node.parent].select(torch.zeros(b, dtype=torch.long, device=device))
        mine = []
        for lo, hi in cuts(t, segment_tokens):
            if keep_states:
                mine.append(({i: x.clone() for i, x in cache.conv.items()},
                             {i: x.clone() for i, x in cache.recurrent.items()}))
            hidden, order = _run(model, node, lo, hi, cache, pairs[k], unit.patch_table)
            if not order.numel():
                continue
            lp, ent = score(hidden, order)
            if logp is None:
                logp = lp.new_zeros(M)
                entropy = None if ent is None else ent.new_zeros(M)
            logp[order] = lp
            if ent is not None:
                entropy[order] = ent
        entering.append(mine)
        latents.append({i: x[:, node.start:node.start + t].clone() for i, x in cache.latent.items()}
                       if keep_states else {})
        if k in parents:
            finals[k] = cache
    if logp is None:
        logp = torch.zeros(M, device=device)
    return _Forward(logp, entropy, entering, latents)


def backward(model, unit: Unit, segment_tokens: Optional[int], fwd: _Forward, grad_logprobs: torch.Tensor,
             score: Scorer) -> None:
    """Pass 2: recompute each node's segments with grad, children before parents and last segment first, and
    accumulate every parameter's gradient of Σ grad_logprobs · log π over the pairs (see the module docstring)."""
    nodes, pairs = unit.nodes()
    config = model.config
    device = unit.mb.input_ids.device
    g_lat = [{i: torch.zeros_like(x) for i, x in own.items()} for own in fwd.latents]  # per node: [b, t, D]
    g_final: dict[int, tuple[dict, dict]] = {}  # node → gradients of its final KDA states (summed over children)
    for k in reversed(range(len(nodes))):
        node = nodes[k]
        b, t = node.ids.shape
        path = _ancestors(nodes, k)
        before = {i: [fwd.latents[a][i].expand(b, -1, -1) for a in path] for i in fwd.latents[k]}
        g_conv, g_rec = g_final.pop(k, ({}, {}))
        segs = cuts(t, segment_tokens)
        for s in reversed(range(len(segs))):
            lo, hi = segs[s]
            start = node.start + lo  # the segment's first position along the path
            conv0, rec0 = fwd.entering[k][s]
            conv_in = {i: x.clone().requires_grad_() for i, x in conv0.items()}
            rec_in = {i: x.clone().requires_grad_() for i, x in rec0.items()}
            lat_in = {i: torch.cat([*before[i], own[:, :lo]], dim=1).clone().requires_grad_()
                      for i, own in fwd.latents[k].items()} if start else {}
            cache = K3Cache.create(config, b, capacity=0, dtype=model.lm_head.weight.dtype, device=device)
            cache.conv, cache.recurrent = dict(conv_in), dict(rec_in)
            for i, own in fwd.latents[k].items():
                fresh = own.new_zeros(b, hi - lo, own.shape[-1])
                cache.latent[i] = torch.cat([lat_in[i], fresh], dim=1) if start else fresh
            cache.capacity, cache.seq_len = node.start + hi, start

            hidden, order = _run(model, node, lo, hi, cache, pairs[k], unit.patch_table)
            outputs, grads = [], []
            if order.numel():
                lp, _ = score(hidden, order)
                outputs.append(lp)
                grads.append(grad_logprobs[order].to(lp.dtype))
            for i in conv_in:
                if g_conv.get(i) is not None:
                    outputs.append(cache.conv[i])
                    grads.append(g_conv[i].expand_as(cache.conv[i]))
                if g_rec.get(i) is not None:
                    outputs.append(cache.recurrent[i])
                    grads.append(g_rec[i].expand_as(cache.recurrent[i]))
            for i, buf in cache.latent.items():
                own = g_lat[k][i][:, lo:hi]
                if bool(own.any()):
                    outputs.append(buf[:, start:node.start + hi])
                    grads.append(own)
            if outputs:
                torch.autograd.backward(outputs, grads)
            g_conv = {i: x.grad for i, x in conv_in.items()}
            g_rec = {i: x.grad for i, x in rec_in.items()}
            for i, x in lat_in.items():
                if x.grad is None:
                    continue
                g_lat[k][i][:, :lo] += x.grad[:, node.start:]
                shared = x.grad[:, :node.start].sum(0, keepdim=True)  # the ancestors' latents, read by every row
                for a in path:
                    g_lat[a][i] += shared[:, nodes[a].start:nodes[a].start + nodes[a].ids.shape[1]]
        if node.parent >= 0:  # the rows' entering state was the parent's final state, repeated: sum over them
            conv_p, rec_p = g_final.setdefault(node.parent, ({}, {}))
            for mine, theirs in ((g_conv, conv_p), (g_rec, rec_p)):
                for i, g in mine.items():
                    if g is not None:
                        g = g.sum(0, keepdim=True)
                        theirs[i] = g if theirs.get(i) is None else theirs[i] + g


__all__ = ["Scorer", "Unit", "backward", "cuts", "forward", "graph_logprobs", "needs_segments"]
