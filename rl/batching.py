"""Training sequences and micro-batches: how the learner turns trajectories into padded model inputs.

A trajectory of N tokens becomes one sequence of n = N − 1 positions: inputs `tokens[:-1]`,
targets `tokens[1:]`, trained where `loss_mask[1:]` is 1 (the hidden state at position t scores
token t + 1). Sequences are never split: `pack_micro_batches` groups whole sequences, longest
first, so that the padded size B·T of each micro-batch stays within a token budget; `collate`
right-pads them and packs the loss-mask tokens flat in row-major order, which is the `[T]`
layout `rl.algos.base.LossInputs` wants. Right padding needs no attention mask for causal
models (a real token never attends to a later position); the mask is still passed to HF models.

Shapes: B sequences of a micro-batch, T its padded length, N its loss-mask tokens, L MoE layers,
k experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch


@dataclass
class TrainSequence:
    """One trajectory as the learner trains on it (numpy, unpadded, length n = len(tokens) − 1)."""

    inputs: np.ndarray
    """[n] int, tokens[:-1]."""
    targets: np.ndarray
    """[n] int, tokens[1:]."""
    mask: np.ndarray
    """[n] bool, loss_mask[1:]."""
    behaviour: np.ndarray
    """[n] float32, behaviour logprob of each target."""
    advantage: float
    routed: Optional[np.ndarray]
    """[n, L, k] int16 routing of each input token (-1: not recorded), or None."""


@dataclass
class MicroBatch:
    """Right-padded sequences and their loss-mask tokens packed flat, as the loss wants them."""

    input_ids: torch.Tensor
    """[B, T] int64 (padding: 0)."""
    valid: torch.Tensor
    """[B, T] bool, real tokens."""
    loss_mask: torch.Tensor
    """[B, T] bool, positions whose next token is trained on."""
    targets: torch.Tensor
    """[N] int64, the trained tokens in row-major order of `loss_mask`."""
    behaviour: torch.Tensor
    """[N] float32, their behaviour logprobs."""
    advantages: torch.Tensor
    """[N] float32, their sequence's advantage."""
    seq_ids: torch.Tensor
    """[N] int64 in [0, B)."""
    routed: Optional[torch.Tensor]
    """[B, T, L, k] int64 routing to replay (-1: route yourself), or None."""

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]


def to_train_sequence(trajectory: Any, advantage: float) -> Optional[TrainSequence]:
    """A trajectory as a training sequence; None when it has no trainable token."""
    if len(trajectory.tokens) < 2 or not trajectory.loss_mask[1:].any():
        return None
    routed = trajectory.routed_experts
    return TrainSequence(inputs=np.asarray(trajectory.tokens[:-1]), targets=np.asarray(trajectory.tokens[1:]),
                         mask=np.asarray(trajectory.loss_mask[1:], dtype=bool),
                         behaviour=np.asarray(trajectory.logprobs[1:], dtype=np.float32),
                         advantage=float(advantage), routed=None if routed is None else np.asarray(routed[:-1]))


def pack_micro_batches(lengths: Sequence[int], token_budget: int, max_seqs: Optional[int] = None) -> list[list[int]]:
    """Group sequence indices into micro-batches with padded size (count × longest) ≤ token_budget
    and at most `max_seqs` sequences each (None: no limit).

    Longest first, so each micro-batch holds sequences of similar length; a sequence longer than
    the budget is alone. Deterministic.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= token_budget and (
                max_seqs is None or len(batches[-1]) < max_seqs):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def collate(seqs: list[TrainSequence], device: torch.device, routing_shape: Optional[tuple[int, int]]) -> MicroBatch:
    """Right-pad `seqs` into one micro-batch on `device`; with `routing_shape` = (L, k) and any
    sequence carrying recorded routing, also the [B, T, L, k] ids to replay (-1 elsewhere)."""
    B, T = len(seqs), max(len(s.inputs) for s in seqs)
    ids = np.zeros((B, T), dtype=np.int64)
    valid = np.zeros((B, T), dtype=bool)
    mask = np.zeros((B, T), dtype=bool)
    targets = np.zeros((B, T), dtype=np.int64)
    behaviour = np.zeros((B, T), dtype=np.float32)
    adv = np.zeros((B, T), dtype=np.float32)
    recorded = routing_shape is not None and any(s.routed is not None for s in seqs)
    routed = np.full((B, T, *routing_shape), -1, dtype=np.int64) if recorded else None
    for b, s in enumerate(seqs):
        n = len(s.inputs)
        ids[b, :n], valid[b, :n], mask[b, :n] = s.inputs, True, s.mask
        targets[b, :n], behaviour[b, :n], adv[b, :n] = s.targets, s.behaviour, s.advantage
        if routed is not None and s.routed is not None:
            if s.routed.shape[1:] != routing_shape:
                raise ValueError(f"Trajectory.routed_experts has [L, k] = {list(s.routed.shape[1:])}, "
                                 f"the model routes [L, k] = {list(routing_shape)}")
            routed[b, :n] = s.routed
    rows = np.broadcast_to(np.arange(B)[:, None], (B, T))  # [B, T]

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return MicroBatch(input_ids=t(ids), valid=t(valid), loss_mask=t(mask), targets=t(targets[mask]),
                      behaviour=t(behaviour[mask]), advantages=t(adv[mask]), seq_ids=t(rows[mask]),
                      routed=None if routed is None else t(routed))


__all__ = ["MicroBatch", "TrainSequence", "collate", "pack_micro_batches", "to_train_sequence"]
