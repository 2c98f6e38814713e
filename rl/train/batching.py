"""Training sequences and micro-batches: how the learner turns trajectories into padded model inputs.

A trajectory of N tokens becomes one sequence of n = N − 1 positions: inputs `tokens[:-1]`,
targets `tokens[1:]`, trained where `loss_mask[1:]` is 1 (the hidden state at position t scores
token t + 1). `pack_micro_batches` groups whole sequences, longest first, so that the padded size
B·T of each micro-batch stays within a token budget (a sequence longer than a segment is then trained
segment by segment, rl/train/segments.py); sequences that start alike run as prefix trees
(rl/train/prefix_tree.py); `collate`
right-pads them and packs the loss-mask tokens flat in row-major order, which is the `[T]`
layout `rl.algos.base.LossInputs` wants. Right padding needs no attention mask for causal
models (a real token never attends to a later position); the mask is still passed to HF models.

Shapes: B sequences of a micro-batch, T its padded length, N its loss-mask tokens, L MoE layers,
k experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

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
    group: str = ""
    """The trajectory's `group_id` (samples of one task: candidates for a shared prefix)."""
    positions: Optional[np.ndarray] = None
    """[n] int positions of the inputs when several documents are packed in the sequence (restarting at 0 at each
    document's first token), or None: one document."""
    patch_at: Optional[np.ndarray] = None
    """[n] int32: at each image placeholder among the inputs, the index of its patch in `patches`; -1 elsewhere.
    None: no image."""
    patches: Optional[np.ndarray] = None
    """[m, C, p, p] uint8, the patches of the trajectory's images in placeholder order (model/vision.py)."""

    def tail(self, start: int) -> TrainSequence:
        """The positions from `start` on (what is left after a shared prefix)."""
        return self.piece(start, len(self.inputs))

    def piece(self, start: int, end: int) -> TrainSequence:
        """Positions [start, end) as a sequence of their own."""
        cut = slice(start, end)
        return TrainSequence(self.inputs[cut], self.targets[cut], self.mask[cut], self.behaviour[cut], self.advantage,
                             None if self.routed is None else self.routed[cut], self.group,
                             None if self.positions is None else self.positions[cut],
                             None if self.patch_at is None else self.patch_at[cut], self.patches)

    def document_starts(self) -> np.ndarray:
        """Where each packed document starts ([0] for one document)."""
        if self.positions is None or len(self.positions) == 0:
            return np.zeros(1, dtype=np.int64)
        restart = np.flatnonzero(self.positions[1:] != self.positions[:-1] + 1) + 1
        return np.concatenate([[0], restart]).astype(np.int64)


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
    position_ids: Optional[torch.Tensor] = None
    """[B, T] int64 positions of packed documents (padding continues the count), or None: one document per row."""
    patch_ids: Optional[torch.Tensor] = None
    """[B, T] int64: at each image placeholder the row of its patch in `patch_table`, -1 elsewhere; None: no image."""
    patch_table: Optional[torch.Tensor] = None
    """[M, C, p, p] uint8, the patches of every row's images."""

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]

    def images(self) -> dict:
        """The model's image arguments for the batch's placeholders (model/vision.py `image_inputs`)."""
        from k3rl.model.vision import image_inputs

        return image_inputs(self.patch_table, self.patch_ids)


def to_train_sequence(trajectory: Any, advantage: float, media: Optional[tuple[int, int]] = None
                      ) -> Optional[TrainSequence]:
    """A trajectory as a training sequence; None when it has no trainable token. `media` (placeholder token id,
    patch size) for a model that reads images: the trajectory's images become its patches, one per placeholder."""
    if len(trajectory.tokens) < 2 or not trajectory.loss_mask[1:].any():
        return None
    patch_at, patches = _patches(trajectory, media)
    routed = trajectory.routed_experts
    positions = getattr(trajectory, "position_ids", None)
    if positions is not None:
        positions = np.asarray(positions[:-1], dtype=np.int64)
        if len(positions) and positions[0] != 0:
            raise ValueError(f"Trajectory.position_ids must start at 0, got {positions[0]}")
        if not np.all((positions[1:] == positions[:-1] + 1) | (positions[1:] == 0)):
            raise ValueError("Trajectory.position_ids must count up by 1 and restart at 0 at each packed document")
        if (positions[1:] == positions[:-1] + 1).all():
            positions = None  # one document
    return TrainSequence(inputs=np.asarray(trajectory.tokens[:-1]), targets=np.asarray(trajectory.tokens[1:]),
                         mask=np.asarray(trajectory.loss_mask[1:], dtype=bool),
                         behaviour=np.asarray(trajectory.logprobs[1:], dtype=np.float32),
                         advantage=float(advantage), routed=None if routed is None else np.asarray(routed[:-1]),
                         group=str(trajectory.group_id or ""), positions=positions, patch_at=patch_at,
                         patches=patches)


def _patches(trajectory: Any, media: Optional[tuple[int, int]]) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(patch index per input position, the patches) of a trajectory's images (see `TrainSequence`)."""
    images = getattr(trajectory, "images", None)
    if media is None:
        if images is not None:
            raise ValueError("a trajectory with images, but the model reads none (no media_placeholder_token_id)")
        return None, None
    placeholder, patch = media
    tokens = np.asarray(trajectory.tokens)
    context = np.asarray(trajectory.loss_mask) == 0  # a placeholder the model sampled is an ordinary token
    slots = (tokens == placeholder) & context
    if images is None and not slots.any():
        return None, None
    from k3rl.model.vision import image_patches

    pixels = trajectory.pixels() if images is not None else []
    patches = (np.concatenate([image_patches(p, patch) for p in pixels]) if pixels
               else np.zeros((0, 3, patch, patch), dtype=np.uint8))
    if int(slots.sum()) != len(patches) or slots[-1]:
        raise ValueError(f"a trajectory with {int(slots.sum())} image placeholders (id {placeholder}) but "
                         f"{len(patches)} patches in its {len(pixels)} images")
    slots = slots[:-1]
    patch_at = np.where(slots, np.cumsum(slots) - 1, -1).astype(np.int32)
    return patch_at, patches


def split_documents(seq: TrainSequence, max_len: int) -> list[TrainSequence]:
    """A packed sequence cut for segment-recurrent training (rl/train/segments.py, which runs one document per row):
    every document longer than `max_len` alone (positions None), the shorter ones packed again, in order, into
    sequences of at most `max_len` positions. Training on the pieces equals training on the packed sequence (each
    document is computed as if alone either way, and a document's last input, which would predict the next
    document's first token, is never trained). Pieces without a loss row are dropped."""
    starts = seq.document_starts().tolist() + [len(seq.inputs)]
    pieces: list[TrainSequence] = []
    run: list[tuple[int, int]] = []  # consecutive short documents packed together

    def flush():
        if run:
            piece = seq.piece(run[0][0], run[-1][1])
            if len(run) == 1:
                piece.positions = None
            pieces.append(piece)
            run.clear()

    for a, b in zip(starts[:-1], starts[1:]):
        if not seq.mask[a:b].any():
            continue
        if b - a > max_len:
            flush()
            piece = seq.piece(a, b)
            piece.positions = None
            pieces.append(piece)
        else:
            if run and (b - run[0][0] > max_len or run[-1][1] != a):
                flush()
            run.append((a, b))
    flush()
    return pieces


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
    patch_ids, table = _collate_patches(seqs, T, device)
    recorded = routing_shape is not None and any(s.routed is not None for s in seqs)
    routed = np.full((B, T, *routing_shape), -1, dtype=np.int64) if recorded else None
    packed = any(s.positions is not None for s in seqs)
    positions = np.broadcast_to(np.arange(T), (B, T)).copy() if packed else None  # [B, T]
    for b, s in enumerate(seqs):
        n = len(s.inputs)
        ids[b, :n], valid[b, :n], mask[b, :n] = s.inputs, True, s.mask
        if packed and s.positions is not None:
            positions[b, :n] = s.positions
            positions[b, n:] = s.positions[-1] + 1 + np.arange(T - n)  # padding continues the last document
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
                      routed=None if routed is None else t(routed),
                      position_ids=None if positions is None else t(positions), patch_ids=patch_ids, patch_table=table)


def collate_patches(rows: list[tuple[TrainSequence, int, int]], width: int, device: torch.device
                    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """([b, width] patch ids, the patch table) of rows that are slices [start, end) of sequences (right-padded): each
    distinct sequence's patches once in the table, the rows' ids shifted to them; (None, None) without images."""
    if all(s.patch_at is None for s, _, _ in rows):
        return None, None
    ids = np.full((len(rows), width), -1, dtype=np.int64)
    tables, offset = [], {}
    for r, (s, start, end) in enumerate(rows):
        if s.patch_at is None:
            continue
        if id(s.patches) not in offset:
            offset[id(s.patches)] = sum(len(x) for x in tables)
            tables.append(s.patches)
        at = s.patch_at[start:end]
        ids[r, :end - start] = np.where(at >= 0, at + offset[id(s.patches)], -1)
    return torch.from_numpy(ids).to(device), torch.from_numpy(np.concatenate(tables)).to(device)


def _collate_patches(seqs: list[TrainSequence], width: int, device: torch.device):
    return collate_patches([(s, 0, len(s.inputs)) for s in seqs], width, device)


__all__ = ["MicroBatch", "TrainSequence", "collate", "collate_patches", "pack_micro_batches",
           "split_documents", "to_train_sequence"]
