"""The stages of the staged context climb: what each one is, checked before any work starts.

A stage (`pretrain.stages[i]`, rl/config/pretrain.py `StageConfig`) trains the next-token objective (rl/algos/nll.py) on
the learner of RL and SFT (rl/train/learner.py) at one sequence length: `steps` optimizer steps of `rows` packed rows
of `seq_len` tokens (rl/pretrain/packing.py), at its own learning-rate schedule, RoPE base and data mixture, starting
from the previous stage's final checkpoint. This module turns a stage into the learner's settings
(`learner_config`), names its run directory (`stage_dir`) and refuses a stage list that cannot run
(`check_stages`) — lengths not increasing, zero tokens, a length above the model's maximum, … — with the key that
is wrong.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from k3rl.rl.config import ConfigError, StageConfig


def num_steps(stage: StageConfig) -> int:
    """Optimizer steps of a stage: its token budget in whole steps of `batch_tokens` (rounded up)."""
    return max(1, math.ceil(stage.tokens / stage.batch_tokens))


def rows_per_step(stage: StageConfig) -> int:
    """Packed rows of `seq_len` tokens per optimizer step (over all ranks)."""
    return stage.batch_tokens // stage.seq_len


def human_tokens(n: int) -> str:
    """512, 2K, 64K, 1M: a sequence length as the recipe says it."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def stage_dir(run_dir: Path, index: int, stage: StageConfig) -> Path:
    """`run_dir/stage1-512`, `run_dir/stage2-2K`, …: one directory per stage."""
    return Path(run_dir) / f"stage{index + 1}-{human_tokens(stage.seq_len)}"


def decay_steps(stage: StageConfig) -> int:
    """`wsd`: the steps of the decay (the last `decay_fraction` of the stage)."""
    return round(stage.decay_fraction * num_steps(stage)) if str(stage.learner.lr_scheduler) == "wsd" else 0


def schedule_name(stage: StageConfig) -> str:
    """The learner's `lr_scheduler` for a stage's `learner.lr_scheduler` (rl/train/optim.py): `constant` with a warmup
    is `constant_with_warmup`."""
    shape = str(stage.learner.lr_scheduler)
    if shape == "constant":
        return "constant_with_warmup" if stage.learner.warmup_steps else "constant"
    return shape


def uses_rope(model_config: Any) -> bool:
    """Whether the model has RoPE layers a stage's `rope_theta` reaches (K3's MLA with `mla_use_nope: false`)."""
    return hasattr(model_config, "mla_use_nope") and not model_config.mla_use_nope


def learner_config(cfg: Any, index: int, model_path: str | Path, model_config: Any):
    """The `LearnerConfig` of stage `index`: the job's `learner:` section with `pretrain.learner`, the stage's
    `learner` (rate, schedule, segment length), its objective (`nll`) and RoPE base on top."""
    from k3rl.rl.config import learner_overrides
    from k3rl.rl.train.learner import LearnerConfig

    stage, pre = cfg.pretrain.stages[index], cfg.pretrain
    theta = stage.rope_theta if stage.rope_theta is not None and uses_rope(model_config) else None
    try:
        return LearnerConfig.from_job(
            cfg, model_path, algo="nll", algo_args={}, **{**learner_overrides(pre.learner, stage.learner),
                                                          "lr_scheduler": schedule_name(stage)},
            total_steps=num_steps(stage), decay_steps=decay_steps(stage), rope_theta=theta, share_prefix=False)
    except ValueError as e:
        raise ConfigError(f"pretrain.stages[{index}]: {e}") from None


def check_stages(cfg: Any, model_config: Any, sources: dict[str, Any]) -> list[str]:
    """Named errors (ConfigError) for a stage list that cannot run; returns notes worth printing once (e.g. a
    RoPE base that a NoPE model ignores)."""
    stages = list(cfg.pretrain.stages)
    if not stages:
        raise ConfigError("pretrain.stages: empty; give at least one stage (seq_len, tokens, batch_tokens, lr)")
    max_len = int(getattr(model_config, "max_position_embeddings", 0) or 0)
    notes: list[str] = []
    for i, stage in enumerate(stages):
        key = f"pretrain.stages[{i}]"
        if stage.seq_len < 2:
            raise ConfigError(f"{key}.seq_len: must be ≥ 2, got {stage.seq_len}")
        if i and stage.seq_len <= stages[i - 1].seq_len:
            raise ConfigError(f"{key}.seq_len: {stage.seq_len} is not longer than stage {i - 1}'s "
                              f"{stages[i - 1].seq_len}; a context climb's lengths must increase")
        if max_len and stage.seq_len > max_len:
            raise ConfigError(f"{key}.seq_len: {stage.seq_len} is above the model's maximum "
                              f"(max_position_embeddings = {max_len}); raise model.max_position_embeddings")
        if stage.tokens <= 0:
            raise ConfigError(f"{key}.tokens: must be > 0, got {stage.tokens}")
        if stage.batch_tokens <= 0 or stage.batch_tokens % stage.seq_len:
            raise ConfigError(f"{key}.batch_tokens: must be a positive multiple of seq_len {stage.seq_len}, got "
                              f"{stage.batch_tokens}")
        if rows_per_step(stage) % cfg.learner.num_ranks:
            raise ConfigError(f"{key}.batch_tokens: {rows_per_step(stage)} rows per step do not split evenly over "
                              f"learner.num_ranks = {cfg.learner.num_ranks} ranks")
        if not stage.learner.lr > 0:
            raise ConfigError(f"{key}.learner.lr: must be > 0, got {stage.learner.lr}")
        if not 0.0 <= stage.decay_fraction <= 1.0:
            raise ConfigError(f"{key}.decay_fraction: must be in [0, 1], got {stage.decay_fraction}")
        if not 0.0 <= stage.learner.min_lr_ratio <= 1.0:
            raise ConfigError(f"{key}.learner.min_lr_ratio: must be in [0, 1], got {stage.learner.min_lr_ratio}")
        warmup = stage.learner.warmup_steps
        if warmup < 0 or warmup + decay_steps(stage) > num_steps(stage):
            raise ConfigError(f"{key}.learner.warmup_steps: {warmup} warmup + {decay_steps(stage)} decay steps "
                              f"do not fit in the stage's {num_steps(stage)} steps")
        if stage.learner.segment_tokens is not None and stage.learner.segment_tokens < 1:
            raise ConfigError(f"{key}.learner.segment_tokens: must be ≥ 1 or null, got {stage.learner.segment_tokens}")
        if stage.rope_theta is not None:
            if not stage.rope_theta > 1.0:
                raise ConfigError(f"{key}.rope_theta: must be > 1, got {stage.rope_theta}")
            if not uses_rope(model_config) and not notes:
                notes.append("pretrain.stages[*].rope_theta: ignored — the model's MLA layers are NoPE "
                             "(mla_use_nope: true) and KDA uses no positions")
        unknown = sorted(set(stage.mixture) - set(sources))
        if unknown:
            raise ConfigError(f"{key}.mixture: unknown source(s) {unknown}; pretrain.sources has {sorted(sources)}")
        if any(w < 0 for w in stage.mixture.values()) or (stage.mixture and sum(stage.mixture.values()) <= 0):
            raise ConfigError(f"{key}.mixture: weights must be ≥ 0 with a positive sum, got {dict(stage.mixture)}")
    pre = cfg.pretrain
    for name in ("save_every", "keep_checkpoints", "log_every"):
        if getattr(pre, name) < 1:
            raise ConfigError(f"pretrain.{name}: must be ≥ 1, got {getattr(pre, name)}")
    if pre.heldout_docs < 0 or pre.heldout_every < 0:
        raise ConfigError(f"pretrain.heldout_docs / heldout_every: must be ≥ 0, got {pre.heldout_docs} / "
                          f"{pre.heldout_every}")
    if pre.heldout_source is not None and pre.heldout_source not in sources:
        raise ConfigError(f"pretrain.heldout_source: {pre.heldout_source!r} is not one of pretrain.sources "
                          f"{sorted(sources)}")
    if any(n < 256 for n in pre.eval_lengths):
        raise ConfigError(f"pretrain.eval_lengths: each ≥ 256 tokens, got {list(pre.eval_lengths)}")
    return notes


def mixture(stage: StageConfig, sources: dict[str, Any], tokens: dict[str, int]) -> dict[str, float]:
    """A stage's source weights, normalised; an empty mixture weighs every source by its tokens."""
    weights = dict(stage.mixture) if stage.mixture else {name: float(tokens[name]) for name in sources}
    total = sum(weights.values())
    return {name: w / total for name, w in weights.items() if w > 0}


def eval_lengths(cfg: Any, stage: StageConfig) -> list[int]:
    """The retrieval grid's lengths after a stage: `pretrain.eval_lengths` up to the stage's length, or powers of 4
    from 512 up to it."""
    lengths = list(cfg.pretrain.eval_lengths) or [512 * 4**k for k in range(12)]
    return [n for n in lengths if n <= stage.seq_len] or [min(lengths)]


__all__ = ["check_stages", "decay_steps", "eval_lengths", "human_tokens", "learner_config", "mixture", "num_steps",
           "rows_per_step", "schedule_name", "stage_dir", "uses_rope"]
