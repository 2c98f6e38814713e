"""Segment-recurrent training and group prefix sharing: forward and backward of long sequences, and of a group's
shared prompt, through the K3 model's own recurrence (docs/model_spec.md §5.6, §6; model/cache.py).

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

Group prefix sharing: the samples of a group start with the same prompt. A `Unit` is such a prefix [1, P] plus the
members' suffixes [n, T']: the prefix runs once with batch 1, its state is repeated to the n members
(`K3Cache.select`) and the members' gradients flow back into it summed — one autograd graph when the unit fits in a
segment (for any HF model too, through its KV cache), the two passes above otherwise (K3; the branch reduces the
state gradients over the members).
The prefix holds no loss row (`rl/train/batching.py` `build_units` cuts it before the first one), and its tokens count once
in the router statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from k3rl.model.cache import K3Cache
from k3rl.rl.train.batching import MicroBatch


@dataclass
class Unit:
    """What one forward/backward trains: an optional prefix shared by every row, then a micro-batch of suffixes."""

    mb: MicroBatch
    """The suffixes (right-padded rows, loss rows packed as rl/algos/base.py `LossInputs` wants them)."""
    prefix: Optional[torch.Tensor] = None
    """[1, P] int64 tokens every row starts with (no loss row among them), or None."""
    prefix_routed: Optional[torch.Tensor] = None
    """[1, P, L, k] routing to replay on the prefix (-1: route), or None."""

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix is None else self.prefix.shape[1]

    @property
    def length(self) -> int:
        """Positions of the longest row, prefix included."""
        return self.prefix_len + self.mb.input_ids.shape[1]


@dataclass
class _Segment:
    ids: torch.Tensor
    """[b, t] tokens (b = 1 on the prefix)."""
    routed: Optional[torch.Tensor]
    routing_mask: Optional[torch.Tensor]
    rows: Optional[torch.Tensor]
    """[b, t] bool loss rows (None on the prefix)."""
    order: torch.Tensor
    """[n] positions of those rows in the unit's flat [N] (row-major over the suffix's loss mask)."""
    lo: int
    hi: int
    """Positions [lo, hi) of the segment in the unit's sequence (prefix first)."""
    branch: bool
    """First suffix segment after a prefix: the state is repeated to every row before it."""


def plan(unit: Unit, segment_tokens: Optional[int]) -> list[_Segment]:
    """The segments of a unit in order: the prefix, then the suffix, each cut every `segment_tokens` positions."""
    mb, P = unit.mb, unit.prefix_len
    B, T = mb.input_ids.shape
    device = mb.input_ids.device
    empty = torch.zeros(0, dtype=torch.long, device=device)
    segs: list[_Segment] = []
    if P:
        step = segment_tokens or P
        for lo in range(0, P, step):
            hi = min(P, lo + step)
            routed = None if unit.prefix_routed is None else unit.prefix_routed[:, lo:hi]
            segs.append(_Segment(unit.prefix[:, lo:hi], routed, None, None, empty, lo, hi, False))
    order = torch.full((B, T), -1, dtype=torch.long, device=device)
    order[mb.loss_mask] = torch.arange(int(mb.loss_mask.sum()), device=device)
    step = segment_tokens or T
    for lo in range(0, T, step):
        hi = min(T, lo + step)
        rows = mb.loss_mask[:, lo:hi]
        routed = None if mb.routed is None else mb.routed[:, lo:hi]
        segs.append(_Segment(mb.input_ids[:, lo:hi], routed, mb.valid[:, lo:hi], rows, order[:, lo:hi][rows],
                             P + lo, P + hi, bool(P) and lo == 0))
    return segs


def needs_segments(unit: Unit, segment_tokens: Optional[int]) -> bool:
    """True when the prefix or the suffix is longer than one segment."""
    return bool(segment_tokens) and max(unit.prefix_len, unit.mb.input_ids.shape[1]) > segment_tokens


Scorer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, Optional[torch.Tensor]]]
"""(normed hidden rows [n, d], their [N]-positions [n]) → (log π [n], entropy [n] or None)."""


def _run(model, seg: _Segment, cache: K3Cache) -> torch.Tensor:
    """One segment through the cache → normed hidden states of its loss rows [n, d] (n may be 0)."""
    out = model(seg.ids, cache=cache, routed_expert_ids=seg.routed, routing_mask=seg.routing_mask,
                return_hidden_states=True, logits_to_keep=1)
    if seg.rows is None or not seg.order.numel():
        return out.hidden_states.new_zeros(0, out.hidden_states.shape[-1])
    return model.model.norm(out.hidden_states[seg.rows])


def graph_logprobs(policy, unit: Unit, score: Scorer) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log π (and entropy) of a unit's loss rows as one autograd graph: the prefix once, its state repeated to the
    rows (model/policy.py `Policy.branch_hidden`; K3 and HF models). For units within one segment; the caller
    backpropagates its loss through the result."""
    mb = unit.mb
    hidden = policy.branch_hidden(unit.prefix, mb.input_ids, mb.valid, mb.loss_mask, unit.prefix_routed, mb.routed)
    return score(hidden, torch.arange(hidden.shape[0], device=hidden.device))


@dataclass
class _Forward:
    """What pass 1 keeps: log π and entropy of every loss row, each segment's entering KDA states, the latents."""

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    entering: list[tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]]
    latents: dict[int, torch.Tensor]


@torch.no_grad()
def forward(model, unit: Unit, segment_tokens: Optional[int], score: Scorer, keep_states: bool = True) -> _Forward:
    """Pass 1: the unit segment by segment without grad (also what scoring a long sequence needs)."""
    mb = unit.mb
    if mb.position_ids is not None:
        raise ValueError("segments run one document per row: cut packed sequences first (rl/train/batching.py "
                         "split_documents)")
    segs = plan(unit, segment_tokens)
    cache = model.new_cache(1 if unit.prefix_len else mb.num_seqs, capacity=unit.length)
    n = int(mb.loss_mask.sum())
    logp = entropy = None
    entering = []
    for seg in segs:
        if seg.branch:
            cache = cache.select(torch.zeros(mb.num_seqs, dtype=torch.long, device=mb.input_ids.device))
        if keep_states:
            entering.append(({i: t.clone() for i, t in cache.conv.items()},
                             {i: t.clone() for i, t in cache.recurrent.items()}))
        hidden = _run(model, seg, cache)
        if not seg.order.numel():
            continue
        lp, ent = score(hidden, seg.order)
        if logp is None:
            logp = lp.new_zeros(n)
            entropy = None if ent is None else ent.new_zeros(n)
        logp[seg.order] = lp
        if ent is not None:
            entropy[seg.order] = ent
    if logp is None:
        logp = torch.zeros(n, device=mb.input_ids.device)
    return _Forward(logp, entropy, entering, cache.latent)


def backward(model, unit: Unit, segment_tokens: Optional[int], fwd: _Forward, grad_logprobs: torch.Tensor,
             score: Scorer) -> None:
    """Pass 2: recompute each segment with grad, last first, and accumulate every parameter's gradient of
    Σ grad_logprobs · log π (see the module docstring)."""
    segs = plan(unit, segment_tokens)
    config = model.config
    device = unit.mb.input_ids.device
    g_lat = {i: torch.zeros_like(t) for i, t in fwd.latents.items()}  # [rows, capacity, D]
    g_conv: dict[int, Optional[torch.Tensor]] = {}
    g_rec: dict[int, Optional[torch.Tensor]] = {}
    for s in reversed(range(len(segs))):
        seg = segs[s]
        b, lo, hi = seg.ids.shape[0], seg.lo, seg.hi
        conv0, rec0 = fwd.entering[s]
        conv_in = {i: t.clone().requires_grad_() for i, t in conv0.items()}
        rec_in = {i: t.clone().requires_grad_() for i, t in rec0.items()}
        lat_in = {i: t[:b, :lo].clone().requires_grad_() for i, t in fwd.latents.items()} if lo else {}
        cache = K3Cache.create(config, b, capacity=0, dtype=model.lm_head.weight.dtype, device=device)
        cache.conv, cache.recurrent = dict(conv_in), dict(rec_in)
        for i, t in fwd.latents.items():
            fresh = t.new_zeros(b, hi - lo, t.shape[-1])
            cache.latent[i] = torch.cat([lat_in[i], fresh], dim=1) if lo else fresh
        cache.capacity, cache.seq_len = hi, lo

        hidden = _run(model, seg, cache)
        outputs, grads = [], []
        if seg.order.numel():
            lp, _ = score(hidden, seg.order)
            outputs.append(lp)
            grads.append(grad_logprobs[seg.order].to(lp.dtype))
        for i in conv_in:
            if g_conv.get(i) is not None:
                outputs.append(cache.conv[i])
                grads.append(g_conv[i])
            if g_rec.get(i) is not None:
                outputs.append(cache.recurrent[i])
                grads.append(g_rec[i])
        for i, buf in cache.latent.items():
            own = g_lat[i][:b, lo:hi]
            if bool(own.any()):
                outputs.append(buf[:, lo:hi])
                grads.append(own)
        if outputs:
            torch.autograd.backward(outputs, grads)
        g_conv = {i: t.grad for i, t in conv_in.items()}
        g_rec = {i: t.grad for i, t in rec_in.items()}
        for i, t in lat_in.items():
            if t.grad is not None:
                g_lat[i][:b, :lo] += t.grad
        if seg.branch:  # the rows' entering state was the prefix's final state, repeated: sum their gradients
            g_conv = {i: None if g is None else g.sum(0, keepdim=True) for i, g in g_conv.items()}
            g_rec = {i: None if g is None else g.sum(0, keepdim=True) for i, g in g_rec.items()}
            g_lat = {i: g.sum(0, keepdim=True) for i, g in g_lat.items()}


__all__ = ["Unit", "backward", "forward", "graph_logprobs", "needs_segments", "plan"]
