"""Supervised training through the learner: token sequences with loss masks, the `nll` objective.

What `k3rl sft` runs on demonstrations (loss mask = the assistant's tokens), and what the staged
pretraining backbone will run on documents (loss mask = every token): the same `rl.train.learner.Learner`
as RL — its micro-batching, chunked log-probs, NaN guard, optimizers, learning-rate schedule, router
balancing and checkpoints — with `rl/algos/nll.py` as the objective. There is no second training loop
and no second log-prob path.

* `as_trajectory` turns (input_ids, loss_mask) into the `Trajectory` the learner reads (no sampling
  policy: behaviour log-probs 0, versions -1; the `nll` objective ignores both).
* `step_batches` decides which examples each optimizer step trains on: epoch after epoch of a seeded
  shuffle, cut into steps of `per_step` examples (an epoch's last step may be smaller).
* `train_supervised` runs the steps and logs the means since the last row every `log_every` steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np

from k3rl.rollout.trajectory import Trajectory

# metrics averaged over a logging window (the rest are the window's last value)
_MEAN_KEYS = ("loss", "nll", "entropy", "grad_norm", "grad_clipped", "skipped", "step_time_s", "maxvio_max")
_SUM_KEYS = ("num_loss_tokens", "num_tokens", "num_seqs")


def as_trajectory(input_ids: Sequence[int], loss_mask: Sequence[int], images: bytes | None = None,
                  image_shapes: Sequence[Sequence[int]] | None = None) -> Trajectory:
    """A supervised sequence as a learner trajectory (trained where `loss_mask` is 1, predicting each
    token from the ones before it); `images` (flat RGB uint8 bytes) and their (H, W) `image_shapes` ride along
    (rl/orchestrator/demonstrations.py)."""
    tokens = np.asarray(input_ids, dtype=np.int32)
    mask = np.asarray(loss_mask, dtype=np.uint8)
    if tokens.ndim != 1 or mask.shape != tokens.shape:
        raise ValueError(f"input_ids {tokens.shape} and loss_mask {mask.shape} must be equal 1-D sequences")
    n = len(tokens)
    pixels = shapes = None
    if images is not None:
        pixels = np.frombuffer(images, dtype=np.uint8)
        shapes = np.asarray(image_shapes, dtype=np.int32).reshape(-1, 2)
    return Trajectory(tokens=tokens, loss_mask=mask, logprobs=np.zeros(n, np.float32),
                      versions=np.full(n, -1, np.int32), turn_spans=np.zeros((0, 2), np.int32), prompt_len=0,
                      images=pixels, image_shapes=shapes)


def num_steps(n: int, per_step: int, max_steps: int, epochs: float) -> int:
    """`max_steps` when > 0, else the steps of `epochs` passes over `n` examples (as transformers counts them)."""
    if max_steps > 0:
        return max_steps
    return max(1, math.ceil(epochs * math.ceil(n / per_step)))


def step_batches(n: int, per_step: int, steps: int, seed: int) -> list[list[int]]:
    """Example indices of each of `steps` optimizer steps: every epoch a fresh permutation of
    `range(n)` (numpy, seeded by `seed` and the epoch), cut into consecutive runs of `per_step`."""
    if n <= 0 or per_step <= 0:
        raise ValueError(f"need examples and a positive step size, got n={n}, per_step={per_step}")
    out: list[list[int]] = []
    epoch = 0
    while len(out) < steps:
        order = np.random.default_rng([seed, epoch]).permutation(n).tolist()
        out.extend(order[i:i + per_step] for i in range(0, n, per_step))
        epoch += 1
    return out[:steps]


def _window_row(window: list[dict[str, Any]]) -> dict[str, float]:
    row: dict[str, float] = {}
    for key in _MEAN_KEYS:
        values = [float(m[key]) for m in window if key in m and not (key == "loss" and m.get("skipped"))]
        if values:
            row[key] = sum(values) / len(values)
    for key in _SUM_KEYS:
        row[key] = float(sum(m.get(key, 0) for m in window))
    row["lr"] = float(window[-1]["lr"])
    row["window_steps"] = float(len(window))
    seconds = sum(m["step_time_s"] for m in window)
    row["train_tokens_per_s"] = row["num_tokens"] / seconds if seconds > 0 else 0.0
    return row


def train_supervised(learner: Any, examples: Sequence[Trajectory], batches: Sequence[Sequence[int]],
                     log: Callable[[int, dict[str, float]], None], log_every: int = 10,
                     on_step: Optional[Callable[[int, dict[str, Any]], None]] = None) -> list[dict[str, float]]:
    """One `learner.train_step` per entry of `batches`; `log(step, row)` at step 1, every `log_every`
    steps and at the last, with the window's means (loss, grad_norm, …), token sums and throughput.
    Returns the logged rows (each with its `step`)."""
    rows, window = [], []
    started = time.perf_counter()
    for step, idx in enumerate(batches, 1):
        metrics = learner.train_step([examples[i] for i in idx])
        window.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
        if step == 1 or step % log_every == 0 or step == len(batches):
            row = {**_window_row(window), "time_s": time.perf_counter() - started}
            log(step, row)
            rows.append({"step": step, **row})
            window = []
    return rows


__all__ = ["as_trajectory", "num_steps", "step_batches", "train_supervised"]
