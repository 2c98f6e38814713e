"""Packed training rows of a stage: documents of the token caches back to back, a pure function of (seed, stage, row).

Each source is an endless stream: epochs of a seeded permutation of its training documents (held-out ones
excluded), concatenated. Row k of a source is stream tokens [k·S, k·S + S + 1) — S + 1 tokens train S next-token
predictions, and the last one is the first of row k + 1, so every token is predicted once. A document cut by a row
boundary continues in the next row. Global row r draws its source by the mixture weights from an RNG seeded with
(seed, stage, block of r), so `row(r)` depends on r alone: reading rows out of order, or resuming in a fresh
process, gives the same rows. Positions restart at 0 at every document start (and at the row's first token, even
mid-document); `loss_mask` is 0 exactly there: the first token of a document is never predicted from the previous
one.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from k3rl.rl.pretrain.token_cache import TokenStore

_ROWS_PER_BLOCK = 4096
_MIXTURE = 0x6D6978


@dataclass
class PackedRow:
    """One training row: seq_len + 1 tokens of one source, documents packed back to back."""

    row: int
    """Global row index r."""
    source: str
    index: int
    """Row index k within the source's stream (its tokens are stream[k·S, k·S + S + 1))."""
    tokens: np.ndarray
    """[S + 1] int32."""
    position_ids: np.ndarray
    """[S + 1] int32: 0 at the row's first token and at each document start, then counting up."""
    loss_mask: np.ndarray
    """[S + 1] uint8: 0 where position_ids is 0 (nothing predicts them), 1 elsewhere."""
    doc_ids: tuple[int, ...]
    """The documents the row touches, in order (a document id may repeat across an epoch boundary)."""

    def trajectory(self):
        """The row as the learner's `Trajectory` (rollout/trajectory.py): its tokens, loss mask and packed
        positions; no sampling policy (behaviour log-probs 0, versions -1), which the `nll` objective ignores."""
        from k3rl.rollout.trajectory import Trajectory

        n = len(self.tokens)
        return Trajectory(tokens=self.tokens.astype(np.int32), loss_mask=self.loss_mask.astype(np.uint8),
                          logprobs=np.zeros(n, np.float32), versions=np.full(n, -1, np.int32),
                          turn_spans=np.zeros((0, 2), np.int32), prompt_len=0,
                          position_ids=self.position_ids.astype(np.int32))


class PackedRows:
    """Rows of `seq_len + 1` tokens drawn from `stores` by mixture `weights`; `row(r)` is a pure function of r."""

    def __init__(self, stores: Mapping[str, TokenStore], weights: Mapping[str, float], seq_len: int, seed: int,
                 stage: int, exclude: Optional[Mapping[str, Sequence[int]]] = None):
        unknown = sorted((set(weights) | set(exclude or {})) - set(stores))
        if unknown:
            raise ValueError(f"mixture or held-out list names unknown sources {unknown}; the sources are "
                             f"{sorted(stores)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be ≥ 1, got {seq_len}")
        self.names = list(stores)
        self.stores = dict(stores)
        self.seq_len, self.seed, self.stage = seq_len, seed, stage
        self.docs: dict[str, np.ndarray] = {}
        self._lengths: dict[str, np.ndarray] = {}
        for name, store in stores.items():
            held = np.asarray(sorted((exclude or {}).get(name, [])), dtype=np.int64)
            self.docs[name] = np.setdiff1d(np.arange(store.num_docs), held)  # [n_train] int64
            self._lengths[name] = store.doc_lengths  # [num_docs] int64
        self._per_epoch = {n: int(self._lengths[n][self.docs[n]].sum()) for n in self.names}
        if weights:
            w = np.array([float(weights.get(n, 0.0)) for n in self.names])
        else:
            w = np.array([float(self._per_epoch[n]) for n in self.names])
        if (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
            raise ValueError(f"mixture weights must be ≥ 0 with a positive sum, got {dict(zip(self.names, w))}")
        for n, wi in zip(self.names, w):
            if wi > 0 and len(self.docs[n]) == 0:
                raise ValueError(f"source {n!r} has weight {wi} but no training document (all held out)")
        self.weights = dict(zip(self.names, w / w.sum()))
        self._cdf = np.cumsum(w / w.sum())  # [n_sources]
        self._cdf /= self._cdf[-1]
        self._choices: list[np.ndarray] = []
        self._counts = [np.zeros(len(self.names), dtype=np.int64)]
        self._epochs: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, b: int) -> np.ndarray:
        """Source index of each row of block b ([_ROWS_PER_BLOCK] int16); blocks before it are drawn first."""
        while len(self._choices) <= b:
            rng = np.random.default_rng([self.seed, self.stage, _MIXTURE, len(self._choices)])
            pick = np.searchsorted(self._cdf, rng.random(_ROWS_PER_BLOCK), side="right").astype(np.int16)
            self._choices.append(pick)
            self._counts.append(self._counts[-1] + np.bincount(pick, minlength=len(self.names)))
        return self._choices[b]

    def locate(self, r: int) -> tuple[str, int]:
        """(source, k): the source that fills global row r and the row's index in that source's stream."""
        b, i = divmod(r, _ROWS_PER_BLOCK)
        block = self._block(b)
        s = int(block[i])
        return self.names[s], int(self._counts[b][s] + np.count_nonzero(block[:i] == s))

    def _epoch(self, name: str, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order [n_train], cumulative lengths [n_train + 1]) of epoch e of a source's stream."""
        if (name, e) not in self._epochs:
            if len(self._epochs) >= 4 * len(self.names):
                self._epochs.pop(next(iter(self._epochs)))
            rng = np.random.default_rng([self.seed, self.stage, zlib.crc32(name.encode()), e])
            order = self.docs[name][rng.permutation(len(self.docs[name]))]
            cum = np.concatenate([[0], np.cumsum(self._lengths[name][order])])
            self._epochs[(name, e)] = order, cum
        return self._epochs[(name, e)]

    def _spans(self, name: str, k: int) -> list[tuple[int, int, int]]:
        """(document, offset in it, length) of the pieces of stream[k·S, k·S + S + 1)."""
        pos, left, spans = k * self.seq_len, self.seq_len + 1, []
        while left:
            e, q = divmod(pos, self._per_epoch[name])
            order, cum = self._epoch(name, e)
            j = int(np.searchsorted(cum, q, side="right")) - 1
            offset = q - int(cum[j])
            n = min(left, int(cum[j + 1]) - q)
            spans.append((int(order[j]), offset, n))
            pos, left = pos + n, left - n
        return spans

    def row(self, r: int) -> PackedRow:
        name, k = self.locate(r)
        spans = self._spans(name, k)
        store = self.stores[name]
        tokens = np.concatenate([store.doc(d)[o:o + n] for d, o, n in spans]).astype(np.int32)  # [S + 1]
        position_ids = np.concatenate([np.arange(n, dtype=np.int32) for _, _, n in spans])  # [S + 1]
        # a piece that starts mid-document is the row's first piece: position 0 there too
        loss_mask = (position_ids != 0).astype(np.uint8)  # [S + 1]
        return PackedRow(r, name, k, tokens, position_ids, loss_mask, tuple(d for d, _, _ in spans))

    def batch(self, step: int, rows_per_step: int) -> list[PackedRow]:
        """Rows [step·R, (step + 1)·R)."""
        return [self.row(r) for r in range(step * rows_per_step, (step + 1) * rows_per_step)]

    def digest(self, step: int, rows_per_step: int) -> str:
        """Short hash of which (source, document, offset) pieces fill the step's rows: the data order, for logs."""
        h = hashlib.sha256()
        for r in range(step * rows_per_step, (step + 1) * rows_per_step):
            name, k = self.locate(r)
            h.update(f"{name}:{self._spans(name, k)};".encode())
        return h.hexdigest()[:12]


__all__ = ["PackedRow", "PackedRows"]
