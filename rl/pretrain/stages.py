"""The stages of the staged context climb: what each one is, checked before any work starts.

A stage (`pretrain.stages[i]`, rl/config/pretrain.py `StageConfig`) trains the next-token objective (rl/algos/nll.py) on
the learner of RL and SFT (rl/train/learner.py) at one sequence length: `steps` optimizer steps of `rows` packed rows
of `seq_len` tokens (rl/pretrain/packing.py), at its own learning-rate schedule, RoPE base and data mixture, starting
from the previous stage's final checkpoint. This module turns a stage into the learner's settings
(`learner_config`), names its run directory (`stage_dir`) and refuses a stage list that cannot run
(`check_stages`, beyond the schema's checks in rl/config/checks.py: a length above the model's maximum, an unknown
source) with the key that is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3rl.rl.config import ConfigError, StageConfig
from k3rl.rl.config.pretrain import decay_steps, num_steps


def human_tokens(n: int) -> str:
    """512, 2K, 64K, 1M: a sequence length as the recipe says it."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def stage_dir(run_dir: Path, index: int, stage: StageConfig) -> Path:
    """`run_dir/stage1-512`, `run_dir/stage2-2K`, …: one directory per stage."""
    return Path(run_dir) / f"stage{index + 1}-{human_tokens(stage.seq_len)}"


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
    """Named errors (ConfigError) for a stage list that cannot run beyond the schema's checks (rl/config/checks.py,
    run first by `climb.check`): what needs the model (its maximum length) and the sources; returns notes worth
    printing once (e.g. a RoPE base that a NoPE model ignores)."""
    stages = list(cfg.pretrain.stages)
    max_len = int(getattr(model_config, "max_position_embeddings", 0) or 0)
    notes: list[str] = []
    for i, stage in enumerate(stages):
        key = f"pretrain.stages[{i}]"
        if max_len and stage.seq_len > max_len:
            raise ConfigError(f"{key}.seq_len: {stage.seq_len} is above the model's maximum "
                              f"(max_position_embeddings = {max_len}); raise model.max_position_embeddings")
        if stage.rope_theta is not None and not uses_rope(model_config) and not notes:
            notes.append("pretrain.stages[*].rope_theta: ignored — the model's MLA layers are NoPE "
                         "(mla_use_nope: true) and KDA uses no positions")
        unknown = sorted(set(stage.mixture) - set(sources))
        if unknown:
            raise ConfigError(f"{key}.mixture: unknown source(s) {unknown}; pretrain.sources has {sorted(sources)}")
    pre = cfg.pretrain
    if pre.heldout_source is not None and pre.heldout_source not in sources:
        raise ConfigError(f"pretrain.heldout_source: {pre.heldout_source!r} is not one of pretrain.sources "
                          f"{sorted(sources)}")
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


__all__ = ["check_stages", "eval_lengths", "human_tokens", "learner_config", "mixture", "schedule_name", "stage_dir",
           "uses_rope"]
