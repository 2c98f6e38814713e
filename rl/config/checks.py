"""Value and cross-field checks of each command's schema: each names the dotted key that is wrong, before any work
starts. The loader runs a command schema's checks after merging the recipe and its overrides
(rl/config/loader.py); a component handed a config from elsewhere (a test, the quickstart's composed jobs) runs
them with `validate(cfg, schema)`. `JobConfig`, a recipe seen whole, has none of its own: each command checks
what it reads. What needs more than the config (a model directory, a data file, the environment registry, the
model's maximum length) stays with the component that reads it."""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum
from typing import Any

from omegaconf import OmegaConf

from k3rl.util.yaml_config import ConfigError


def _at_least(cfg: Any, keys: tuple[str, ...], low: int, strict: bool = False) -> None:
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if value is not None and (value <= low if strict else value < low):
            raise ConfigError(f"{key}: must be {'>' if strict else '≥'} {low}, got {value}")


def check_learner_settings(s: Any) -> None:
    """The value and cross-field checks of a learner's settings (`LearnerSettings` fields, plus `total_steps`,
    `algo` and `algo_args` as the driver decides them): a ValueError starting with the field's name. Run on every
    rl/train/learner.py `LearnerConfig` (whatever built it) and, by the loader, on the `learner:` section."""
    if s.micro_batch_tokens < 1 or s.logprob_chunk_size < 1:
        raise ValueError("micro_batch_tokens and logprob_chunk_size must be ≥ 1")
    if s.max_grad_norm < 0:
        raise ValueError(f"max_grad_norm: must be ≥ 0, got {s.max_grad_norm}")
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio: must be in [0, 1], got {s.min_lr_ratio}")
    schedule = str(s.lr_scheduler)
    if schedule == "wsd" and not (s.total_steps and 0 <= s.decay_steps <= s.total_steps
                                  and s.warmup_steps + s.decay_steps <= s.total_steps):
        raise ValueError(f"wsd: warmup_steps {s.warmup_steps} + decay_steps {s.decay_steps} must fit in "
                         f"total_steps {s.total_steps}")
    if s.warmup_steps < 0 or (s.warmup_steps and schedule == "constant"):
        raise ValueError(f"warmup_steps: {s.warmup_steps} with lr_scheduler {s.lr_scheduler!r} (`constant` "
                         f"has no warmup: use constant_with_warmup)")
    if schedule in ("linear", "cosine", "wsd") and not (s.total_steps and s.total_steps > 0):
        raise ValueError(f"total_steps: lr_scheduler {s.lr_scheduler!r} decays over total_steps, got "
                         f"{s.total_steps}")
    if s.segment_tokens is not None and s.segment_tokens < 1:
        raise ValueError(f"segment_tokens: must be ≥ 1 or null, got {s.segment_tokens}")
    if s.micro_batch_seqs is not None and s.micro_batch_seqs < 1:
        raise ValueError(f"micro_batch_seqs: must be ≥ 1 or null, got {s.micro_batch_seqs}")
    if s.expert_parallel < 1:
        raise ValueError(f"expert_parallel: must be ≥ 1, got {s.expert_parallel}")
    lora = s.lora
    if lora.rank < 0 or lora.alpha <= 0 or not 0 <= lora.dropout < 1:
        raise ValueError(f"lora: rank ≥ 0, alpha > 0 and dropout in [0, 1) needed, got rank {lora.rank}, alpha "
                         f"{lora.alpha}, dropout {lora.dropout}")
    if lora.push not in ("adapters", "merged"):
        raise ValueError(f"lora.push: `adapters` or `merged`, got {lora.push!r}")
    if lora.rank and (s.expert_parallel > 1 or bool(s.fsdp)):
        raise ValueError(f"lora: adapters on a sharded learner (expert_parallel = {s.expert_parallel}, fsdp = "
                         f"{str(bool(s.fsdp)).lower()}) are not supported yet; train LoRA on unsharded ranks")
    if s.expert_parallel > 1 or bool(s.fsdp):
        # Every rank must run the same sequence of forwards and backwards (their all-gathers and all-to-alls are
        # collectives); the features below would make the passes of a rank depend on its own data.
        from k3rl.rl.algos import get_algo

        what = f"expert_parallel = {s.expert_parallel}, fsdp = {str(bool(s.fsdp)).lower()}"
        if str(s.optimizer) != "adamw":
            raise ValueError(f"optimizer: {s.optimizer!r} with {what}: only adamw (Muon orthogonalises whole "
                             f"matrices, which are sharded across ranks here)")
        if get_algo(s.algo, **dict(s.algo_args)).needs_reference:
            raise ValueError(f"expert_parallel / fsdp ({what}): a reference model (algo.args.kl_coef > 0) is not "
                             f"supported on a sharded learner; set algo.args.kl_coef=0")
        if s.segment_tokens is not None:
            raise ValueError(f"segment_tokens: must be null with {what} (a segmented sequence runs a number of "
                             f"passes that depends on its length)")
        if s.share_prefix:
            raise ValueError(f"share_prefix: must be false with {what} (a prefix tree runs more forwards than its micro-batch)")


def check_learner(cfg: Any) -> None:
    _at_least(cfg, ("learner.num_ranks",), 1)
    ln = cfg.learner
    if ln.expert_parallel >= 1 and ln.num_ranks % ln.expert_parallel:
        raise ConfigError(f"learner.expert_parallel: {ln.expert_parallel} must divide the number of learner ranks "
                          f"(learner.num_ranks = {ln.num_ranks})")


def check_train_learner(cfg: Any) -> None:
    """The `learner:` section as the trainer runs it: total steps `rl.steps` when null, the objective of `algo:`."""
    from types import SimpleNamespace

    ln = cfg.learner
    values = {k: str(v) if isinstance(v, Enum) else v for k, v in ln.items()}
    settings = SimpleNamespace(**{**values, "algo": cfg.algo.name, "algo_args": OmegaConf.to_container(cfg.algo.args),
                                  "total_steps": ln.total_steps if ln.total_steps is not None else int(cfg.rl.steps)})
    if ln.expert_parallel > 1 or ln.fsdp:
        from k3rl.rl.algos import get_algo

        try:
            get_algo(settings.algo, **settings.algo_args)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"algo.name / algo.args: {e}") from None
    try:
        check_learner_settings(settings)
    except ValueError as e:
        raise ConfigError(f"learner.{e}") from None


def check_device(cfg: Any) -> None:
    if cfg.run.device not in ("cpu", "cuda"):
        raise ConfigError(f"run.device: `cpu` or `cuda`, got {cfg.run.device!r}")


def check_train(cfg: Any) -> None:
    """The trainer's schedule, workers and devices (rl/orchestrator/preflight.py checks the model and environment)."""
    _at_least(cfg, ("rl.steps", "rl.tasks_per_step", "rl.group_size", "rollout.num_workers", "rl.keep_checkpoints"), 1)
    ro = cfg.rollout
    if ro.compaction_tokens:
        _at_least(cfg, ("rollout.summary_tokens", "rollout.max_compactions"), 1)
        need = ro.compaction_tokens + ro.summary_tokens
        if ro.compaction_tokens < 0 or need >= ro.max_context_tokens:
            raise ConfigError(f"rollout.compaction_tokens: {ro.compaction_tokens} + summary_tokens {ro.summary_tokens} "
                              f"= {need} must stay under rollout.max_context_tokens {ro.max_context_tokens}: the "
                              f"summary is written after the context reached the budget (an episode whose request "
                              f"and summary do not fit ends truncated)")
    _at_least(cfg, ("rl.max_staleness", "eval.every", "rl.save_every", "rollout.max_restarts", "rollout.partial_rounds",
                    "eval.grid_every"), 0)
    _at_least(cfg, ("eval.grid_num_tasks",), 1)
    if str(cfg.run.device).startswith("cuda") and (cfg.learner.num_gpus <= 0 or cfg.rollout.num_gpus <= 0):
        raise ConfigError("run.device=cuda: set learner.num_gpus and rollout.num_gpus (> 0; fractions share "
                          "a GPU) so that Ray gives the actors a GPU")


def check_sft(cfg: Any) -> None:
    sft = cfg.sft
    _at_least(cfg, ("sft.num_tasks", "sft.batch_size", "sft.grad_accum", "sft.logging_steps",
                    "sft.learner.logprob_chunk_size"), 0, strict=True)
    for key in ("closed_book_rate", "hedging_rate"):
        if not 0.0 <= sft[key] < 1.0:
            raise ConfigError(f"sft.{key}: must be in [0, 1), got {sft[key]}")
    if sft.closed_book_rate + sft.hedging_rate >= 1.0:
        raise ConfigError(f"sft.closed_book_rate + sft.hedging_rate: must be < 1 (some tasks are the oracle's), got "
                          f"{sft.closed_book_rate} + {sft.hedging_rate}")
    if sft.hedging_rate > 0 and not sft.hedge.strip():
        raise ConfigError("sft.hedge: empty, so the hedging teacher would answer as the oracle does; give it a "
                          "hedge such as ', I think' or set sft.hedging_rate=0")
    ln = sft.learner
    if str(ln.lr_scheduler) == "constant" and ln.warmup_steps > 0:
        raise ConfigError(f"sft.learner.warmup_steps: {ln.warmup_steps} with sft.learner.lr_scheduler=constant, which "
                          f"has no warmup; use constant_with_warmup or sft.learner.warmup_steps=0")
    _at_least(cfg, ("sft.eval_tasks",), 0)


def check_pretrain(cfg: Any) -> None:
    """The stages and settings of a climb that the config alone decides (rl/pretrain/stages.py `check_stages` adds
    the model's maximum length and the sources)."""
    from k3rl.rl.config.pretrain import decay_steps, num_steps, rows_per_step

    stages = list(cfg.pretrain.stages)
    if not stages:
        raise ConfigError("pretrain.stages: empty; give at least one stage (seq_len, tokens, batch_tokens, lr)")
    for i, stage in enumerate(stages):
        key, ln = f"pretrain.stages[{i}]", stage.learner
        if stage.seq_len < 2:
            raise ConfigError(f"{key}.seq_len: must be ≥ 2, got {stage.seq_len}")
        if i and stage.seq_len <= stages[i - 1].seq_len:
            raise ConfigError(f"{key}.seq_len: {stage.seq_len} is not longer than stage {i - 1}'s "
                              f"{stages[i - 1].seq_len}; a context climb's lengths must increase")
        if stage.tokens <= 0:
            raise ConfigError(f"{key}.tokens: must be > 0, got {stage.tokens}")
        if stage.batch_tokens <= 0 or stage.batch_tokens % stage.seq_len:
            raise ConfigError(f"{key}.batch_tokens: must be a positive multiple of seq_len {stage.seq_len}, got "
                              f"{stage.batch_tokens}")
        if rows_per_step(stage) % cfg.learner.num_ranks:
            raise ConfigError(f"{key}.batch_tokens: {rows_per_step(stage)} rows per step do not split evenly over "
                              f"learner.num_ranks = {cfg.learner.num_ranks} ranks")
        if not ln.lr > 0:
            raise ConfigError(f"{key}.learner.lr: must be > 0, got {ln.lr}")
        if not 0.0 <= stage.decay_fraction <= 1.0:
            raise ConfigError(f"{key}.decay_fraction: must be in [0, 1], got {stage.decay_fraction}")
        if not 0.0 <= ln.min_lr_ratio <= 1.0:
            raise ConfigError(f"{key}.learner.min_lr_ratio: must be in [0, 1], got {ln.min_lr_ratio}")
        if ln.warmup_steps < 0 or ln.warmup_steps + decay_steps(stage) > num_steps(stage):
            raise ConfigError(f"{key}.learner.warmup_steps: {ln.warmup_steps} warmup + {decay_steps(stage)} decay steps "
                              f"do not fit in the stage's {num_steps(stage)} steps")
        if ln.segment_tokens is not None and ln.segment_tokens < 1:
            raise ConfigError(f"{key}.learner.segment_tokens: must be ≥ 1 or null, got {ln.segment_tokens}")
        if stage.rope_theta is not None and not stage.rope_theta > 1.0:
            raise ConfigError(f"{key}.rope_theta: must be > 1, got {stage.rope_theta}")
        if any(w < 0 for w in stage.mixture.values()) or (stage.mixture and sum(stage.mixture.values()) <= 0):
            raise ConfigError(f"{key}.mixture: weights must be ≥ 0 with a positive sum, got {dict(stage.mixture)}")
    pre = cfg.pretrain
    _at_least(cfg, ("pretrain.save_every", "pretrain.keep_checkpoints", "pretrain.log_every"), 1)
    if pre.heldout_docs < 0 or pre.heldout_every < 0:
        raise ConfigError(f"pretrain.heldout_docs / heldout_every: must be ≥ 0, got {pre.heldout_docs} / "
                          f"{pre.heldout_every}")
    if any(n < 256 for n in pre.eval_lengths):
        raise ConfigError(f"pretrain.eval_lengths: each ≥ 256 tokens, got {list(pre.eval_lengths)}")
    score = pre.retrieval_score
    _at_least(cfg, ("pretrain.retrieval_score.num_tasks",), 1)
    if any(n < 256 for n in score.lengths):
        raise ConfigError(f"pretrain.retrieval_score.lengths: each ≥ 256 tokens, got {list(score.lengths)}")


def check_eval(cfg: Any) -> None:
    """`k3rl eval`'s grid sizes and endpoint limits (rl/eval/ checks the families, servings and baselines by name,
    the model directory and the task file)."""
    ev = cfg.eval
    if not ev.context_lengths or any(int(n) < 256 for n in ev.context_lengths):
        raise ConfigError(f"eval.context_lengths: each ≥ 256 tokens, got {list(ev.context_lengths)}")
    _at_least(cfg, ("eval.num_tasks", "eval.batch_size", "eval.depth_bins"), 1)
    if not 0 < ev.effective_ratio <= 1:
        raise ConfigError(f"eval.effective_ratio: in (0, 1], got {ev.effective_ratio}")
    if ev.endpoint is not None:
        if not 0 < ev.endpoint_timeout_s < math.inf or ev.endpoint_retries < 0:
            raise ConfigError(f"eval.endpoint_timeout_s must be > 0 (and finite) and eval.endpoint_retries ≥ 0; got "
                              f"{ev.endpoint_timeout_s} and {ev.endpoint_retries}")
        if ev.endpoint_task_timeout_s is not None and not 0 < ev.endpoint_task_timeout_s < math.inf:
            raise ConfigError(f"eval.endpoint_task_timeout_s: must be > 0 and finite (or null), got "
                              f"{ev.endpoint_task_timeout_s}")
        _at_least(cfg, ("eval.endpoint_max_reply_chars",), 1)


CHECKS: dict[str, tuple[Callable[[Any], None], ...]] = {
    "TrainJob": (check_learner, check_train, check_train_learner),
    "SFTJob": (check_learner, check_sft, check_device),
    "QuickstartJob": (check_learner, check_train, check_train_learner, check_sft, check_device),
    "PretrainJob": (check_learner, check_device, check_pretrain),
    "EvalJob": (check_eval,),
}
"""A command schema's name → its checks, in order."""


def validate(cfg: Any, schema: type) -> None:
    """Run the checks of `schema` (a command's) on a merged config: a ConfigError names the first wrong key."""
    for check in CHECKS.get(schema.__name__, ()):
        check(cfg)
