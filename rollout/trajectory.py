"""`Trajectory`: one episode as the learner sees it — tokens, what to train on, and how it scored.

Arrays, not lists: a million-token trajectory is ~10 MB (int32 tokens, uint8 mask, float32
logprobs, int32 versions) and moves between Ray actors without per-token Python objects. The
token sequence is exactly what the engine consumed and produced: prompt and tool observations
rendered once (loss_mask 0), model tokens as sampled (loss_mask 1, with their behaviour logprob
and the policy version that sampled them). Nothing is ever re-tokenised.

Saved as Parquet, one row per trajectory, written and read with pyarrow straight from and into
numpy: each array column is a list column built from one flat values buffer and its offsets (no
per-token Python objects; a single trajectory's arrays go to Arrow without a copy), and loaded
arrays are read-only zero-copy views of the Arrow buffers, as `ray.get` gives. At 1,048,576 tokens
with routing [N, 3, 2] a save or a load takes a fraction of a second. The columns keep the names and
types `datasets` gave them (`load_dataset("parquet", …)` reads the files; files written by
`datasets` load here). Imports without torch, Ray or vLLM.

Images (envs/media.py) travel beside the tokens: their fitted RGB pixels in the order of their media runs
(rollout/chat.py), one flat uint8 array with each image's (H, W) — two list columns, bit-exact through Parquet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Trajectory:
    tokens: np.ndarray
    """[N] int32, the whole episode."""
    loss_mask: np.ndarray
    """[N] uint8, 1 on model-sampled tokens."""
    logprobs: np.ndarray
    """[N] float32, behaviour logprob of each sampled token (0 elsewhere)."""
    versions: np.ndarray
    """[N] int32, policy version that sampled each token (-1 elsewhere)."""
    turn_spans: np.ndarray
    """[turns, 2] int32, [start, end) of each sampled segment."""
    prompt_len: int
    reward: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)
    """Reward components (e.g. exact match, F1, evidence recall)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Episode statistics (tool calls, turns, tokens, …)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Environment metadata (JSON-serialisable)."""
    env: str = ""
    task_id: str = ""
    group_id: str = ""
    """Trajectories sampled for the same task share a group (group-relative advantages)."""
    finish_reason: str = ""
    """`done` (the environment ended the episode) or `truncated:<budget>`."""
    episode_id: str = ""
    """The episode this sequence belongs to when an episode has several (an agent that edits or summarises its
    history, rollout/agent_endpoint.py): its sequences share the id and the reward, and count as one sample of
    their group (rl/train/advantages.py `compute_advantages`). "": the trajectory is its episode."""
    routed_experts: np.ndarray | None = None
    """[N, moe_layers, top_k] int16 expert ids chosen for each token (routing replay), or None."""
    position_ids: np.ndarray | None = None
    """[N] int32 positions restarting at 0 at each packed document (pretraining rows, rl/pretrain/packing.py): each
    document is computed as if alone; None: one sequence, positions 0 … N−1. Not a Parquet column: packed rows
    are rebuilt from the data order, never stored."""
    images: np.ndarray | None = None
    """[Σ H·W·3] uint8: the pixels of every image the episode showed (fitted, RGB, row-major), in the order of their
    media runs in `tokens`, concatenated; None: no image."""
    image_shapes: np.ndarray | None = None
    """[n, 2] int32 (H, W) of each image of `images`."""

    def __post_init__(self):
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has {len(getattr(self, name))} entries for {n} tokens")
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise ValueError(f"Trajectory.routed_experts has {len(self.routed_experts)} rows for {n} tokens")
        if self.position_ids is not None and len(self.position_ids) != n:
            raise ValueError(f"Trajectory.position_ids has {len(self.position_ids)} entries for {n} tokens")
        if (self.images is None) != (self.image_shapes is None):
            raise ValueError("Trajectory.images and Trajectory.image_shapes come together")
        if self.images is not None:
            shapes = np.asarray(self.image_shapes).reshape(-1, 2)
            if int((shapes[:, 0].astype(np.int64) * shapes[:, 1] * 3).sum()) != self.images.size:
                raise ValueError(f"Trajectory.images has {self.images.size} values for image shapes "
                                 f"{shapes.tolist()}")

    def pixels(self) -> list[np.ndarray]:
        """Each image as a [H, W, 3] uint8 view of `images`, in media-run order."""
        if self.images is None:
            return []
        out, at = [], 0
        for h, w in np.asarray(self.image_shapes).reshape(-1, 2).tolist():
            out.append(self.images[at:at + h * w * 3].reshape(h, w, 3))
            at += h * w * 3
        return out

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_sampled(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def min_version(self) -> int:
        """Oldest policy version among the sampled tokens (staleness is measured against it)."""
        sampled = self.versions[self.loss_mask.astype(bool)]
        return int(sampled.min()) if len(sampled) else -1

    def to_row(self) -> dict[str, Any]:
        row = {
            "tokens": self.tokens, "loss_mask": self.loss_mask, "logprobs": self.logprobs,
            "versions": self.versions, "turn_spans": self.turn_spans.reshape(-1), "prompt_len": self.prompt_len,
            "reward": float(self.reward), "rewards": json.dumps(self.rewards), "metrics": json.dumps(self.metrics),
            "info": json.dumps(self.info), "env": self.env, "task_id": self.task_id, "group_id": self.group_id,
            "finish_reason": self.finish_reason, "episode_id": self.episode_id,
            "routed_experts": None if self.routed_experts is None else self.routed_experts.reshape(-1),
            "routed_shape": None if self.routed_experts is None else list(self.routed_experts.shape[1:]),
            "images": self.images, "image_shapes": None if self.image_shapes is None else self.image_shapes.reshape(-1),
        }
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Trajectory:
        routed = row.get("routed_experts")
        if routed is not None:
            routed = np.asarray(routed, dtype=np.int16).reshape(-1, *row["routed_shape"])
        images, shapes = row.get("images"), row.get("image_shapes")
        return cls(
            tokens=np.asarray(row["tokens"], dtype=np.int32), loss_mask=np.asarray(row["loss_mask"], dtype=np.uint8),
            logprobs=np.asarray(row["logprobs"], dtype=np.float32), versions=np.asarray(row["versions"], dtype=np.int32),
            turn_spans=np.asarray(row["turn_spans"], dtype=np.int32).reshape(-1, 2), prompt_len=int(row["prompt_len"]),
            reward=float(row["reward"]), rewards=json.loads(row["rewards"]), metrics=json.loads(row["metrics"]),
            info=json.loads(row["info"]), env=row["env"], task_id=row["task_id"], group_id=row["group_id"],
            finish_reason=row["finish_reason"], episode_id=row.get("episode_id") or "", routed_experts=routed,
            images=None if images is None else np.asarray(images, dtype=np.uint8),
            image_shapes=None if shapes is None else np.asarray(shapes, dtype=np.int32).reshape(-1, 2),
        )


def episodes(trajectories: list[Any]) -> list[Any]:
    """One trajectory per episode, in order of first appearance: a multi-sequence episode (shared `episode_id`
    within its group) is stood for by its last sequence, which carries the episode's reward and components like
    every one of them. Rewards, success rates and group statistics count episodes, not sequences."""
    last: dict[Any, Any] = {}
    for i, t in enumerate(trajectories):
        episode = getattr(t, "episode_id", "")
        last[(t.group_id, episode) if episode else i] = t
    return list(last.values())


class TrajectoryBuilder:
    """Appends the segments of an episode as they happen; `finish()` makes the Trajectory."""

    def __init__(self, prompt_tokens: list[int]):
        self._tokens: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._logprobs: list[np.ndarray] = []
        self._versions: list[np.ndarray] = []
        self._spans: list[tuple[int, int]] = []
        self._routed: list[tuple[int, np.ndarray]] = []
        self._images: list[np.ndarray] = []
        self._patch_cache: list[np.ndarray] = []
        self.length = 0
        self.prompt_len = len(prompt_tokens)
        self.append_context(prompt_tokens)

    def append_context(self, tokens: list[int]) -> None:
        """Tokens the model reads but did not sample (prompt, tool observations, chat scaffolding)."""
        n = len(tokens)
        self._tokens.append(np.asarray(tokens, dtype=np.int32))
        self._mask.append(np.zeros(n, dtype=np.uint8))
        self._logprobs.append(np.zeros(n, dtype=np.float32))
        self._versions.append(np.full(n, -1, dtype=np.int32))
        self.length += n

    def append_sampled(self, tokens: list[int], logprobs: list[float], version: int,
                       routed_experts: np.ndarray | None = None) -> None:
        """Tokens the model sampled, kept exactly as sampled."""
        if len(tokens) != len(logprobs):
            raise ValueError(f"{len(tokens)} sampled tokens but {len(logprobs)} logprobs")
        n = len(tokens)
        self._tokens.append(np.asarray(tokens, dtype=np.int32))
        self._mask.append(np.ones(n, dtype=np.uint8))
        self._logprobs.append(np.asarray(logprobs, dtype=np.float32))
        self._versions.append(np.full(n, version, dtype=np.int32))
        if routed_experts is not None:
            self._routed.append((self.length, np.asarray(routed_experts, dtype=np.int16)))
        self._spans.append((self.length, self.length + n))
        self.length += n

    def patches(self, patch: int) -> np.ndarray | None:
        """The patches of every image so far [n, 3, p, p] uint8, in placeholder order (what an engine takes beside
        the tokens, rollout/torch_engine.py), or None without images; cut once per image."""
        if not self._images:
            return None
        from k3rl.model.vision import image_patches

        cut = self._patch_cache
        while len(cut) < len(self._images):
            cut.append(image_patches(self._images[len(cut)], patch))
        return np.concatenate(cut)

    def append_images(self, pixels: list[np.ndarray]) -> None:
        """The pixels [H, W, 3] uint8 of the images whose media runs the tokens just appended hold, in order."""
        for p in pixels:
            p = np.asarray(p)
            if p.dtype != np.uint8 or p.ndim != 3 or p.shape[2] != 3:
                raise ValueError(f"an image must be [H, W, 3] uint8 (envs/media.py check_image), got {p.dtype} "
                                 f"{list(p.shape)}")
            self._images.append(p)

    @property
    def num_sampled(self) -> int:
        return sum(end - start for start, end in self._spans)

    def tokens(self) -> list[int]:
        """The tokens so far as Python ints (one object per token: for decoding, not for long episodes)."""
        return self.token_array().tolist()

    def token_array(self) -> np.ndarray:
        """[N] int32, the tokens so far as one array (no per-token Python objects; the segments are merged in place)."""
        if len(self._tokens) > 1:
            self._tokens = [np.concatenate(self._tokens)]
        return self._tokens[0] if self._tokens else np.zeros(0, dtype=np.int32)

    def finish(self, **fields) -> Trajectory:
        routed = None
        if self._routed:
            shape = self._routed[0][1].shape[1:]
            routed = np.full((self.length, *shape), -1, dtype=np.int16)
            for start, ids in self._routed:
                routed[start:start + len(ids)] = ids
        images = shapes = None
        if self._images:
            images = np.concatenate([p.reshape(-1) for p in self._images])
            shapes = np.asarray([p.shape[:2] for p in self._images], dtype=np.int32)
        return Trajectory(
            tokens=np.concatenate(self._tokens), loss_mask=np.concatenate(self._mask),
            logprobs=np.concatenate(self._logprobs), versions=np.concatenate(self._versions),
            turn_spans=np.asarray(self._spans, dtype=np.int32).reshape(-1, 2), prompt_len=self.prompt_len,
            routed_experts=routed, images=images, image_shapes=shapes, **fields)


_COLUMNS = {"tokens": ("int32", True), "loss_mask": ("uint8", True), "logprobs": ("float32", True),
            "versions": ("int32", True), "turn_spans": ("int32", True), "prompt_len": ("int64", False),
            "reward": ("float64", False), "rewards": ("string", False), "metrics": ("string", False),
            "info": ("string", False), "env": ("string", False), "task_id": ("string", False),
            "group_id": ("string", False), "finish_reason": ("string", False), "episode_id": ("string", False),
            "routed_experts": ("int16", True),
            "routed_shape": ("int64", True), "images": ("uint8", True), "image_shapes": ("int32", True)}
"""Parquet columns of `Trajectory.to_row` in `datasets`' order: element type, and whether a list (flattened array)."""
_ROW_GROUP_VALUES = 2**23
"""Trajectories go into row groups of up to this many array elements (more only for a single trajectory):
Arrow's Parquet writer holds 10–20 bytes per list element of a row group while it writes."""


def _schema(large: set[str]):
    """The columns as `datasets` wrote them (`list<element: …>`); `large` list columns get 64-bit offsets
    (one row of 2**31 values or more, e.g. the routing of a multi-million-token episode)."""
    import pyarrow as pa

    fields = []
    for name, (dtype, is_list) in _COLUMNS.items():
        type_ = pa.string() if dtype == "string" else pa.from_numpy_dtype(np.dtype(dtype))
        if is_list:
            type_ = (pa.large_list if name in large else pa.list_)(pa.field("element", type_))
        fields.append((name, type_))
    return pa.schema(fields)


def _list_column(values: list[np.ndarray | None], type_, dtype: str):
    """One Arrow list array from per-row arrays (None → null): one flat values buffer and its offsets."""
    import pyarrow as pa

    large = pa.types.is_large_list(type_)
    flat = [np.ascontiguousarray(v, dtype=dtype).reshape(-1) for v in values if v is not None]
    offsets = np.zeros(len(values) + 1, dtype=np.int64 if large else np.int32)
    np.cumsum([0 if v is None else np.size(v) for v in values], out=offsets[1:])
    # a single row (a long trajectory is alone in its row group) goes to Arrow without a copy
    data = flat[0] if len(flat) == 1 else np.concatenate(flat) if flat else np.zeros(0, dtype)
    mask = pa.array([v is None for v in values]) if any(v is None for v in values) else None
    return (pa.LargeListArray if large else pa.ListArray).from_arrays(pa.array(offsets), pa.array(data),
                                                                      type=type_, mask=mask)


def _row_groups(trajectories: list[Trajectory]) -> list[list[Trajectory]]:
    groups, size = [], 0
    for t in trajectories:
        n = 4 * len(t) + t.turn_spans.size + (0 if t.routed_experts is None else t.routed_experts.size)
        n += 0 if t.images is None else t.images.size // 8  # a byte each, not 10–20 bytes of a list element
        if not groups or size + n > _ROW_GROUP_VALUES:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    return groups


def save_trajectories(trajectories: list[Trajectory], path: str | Path) -> Path:
    """Write trajectories as one Parquet file (written to a temporary name, then renamed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    large = {name for name, (_, is_list) in _COLUMNS.items() for t in trajectories
             if is_list and getattr(t, name, None) is not None and getattr(t, name).size >= 2**31}
    schema = _schema(large)
    with pq.ParquetWriter(str(tmp), schema, compression="zstd", use_dictionary=False) as writer:
        for group in _row_groups(trajectories):
            rows = [t.to_row() for t in group]
            columns = [_list_column([r[f.name] for r in rows], f.type, _COLUMNS[f.name][0]) if _COLUMNS[f.name][1]
                       else pa.array([r[f.name] for r in rows], type=f.type) for f in schema]
            writer.write_table(pa.Table.from_arrays(columns, schema=schema), row_group_size=len(group))
    tmp.replace(path)
    return path


def _column_rows(column) -> list:
    """Per-row values of an Arrow column: list columns as numpy views of its values buffer (None for nulls)."""
    import pyarrow as pa

    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return column.to_pylist()
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(column))]


def load_trajectories(path: str | Path) -> list[Trajectory]:
    """The trajectories of a Parquet file (from `save_trajectories`, or from `datasets` before it);
    the arrays are read-only views of the file's decoded Arrow buffers (no per-token copies)."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no trajectory file at {path}")
    out = []
    with pq.ParquetFile(str(path)) as f:
        for i in range(f.num_row_groups):
            for batch in f.read_row_group(i).to_batches():
                columns = {name: _column_rows(batch.column(name)) for name in batch.schema.names}
                out.extend(Trajectory.from_row({name: rows[j] for name, rows in columns.items()})
                           for j in range(batch.num_rows))
    return out
