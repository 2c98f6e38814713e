"""Value and cross-field checks of the sections, run by the loader after a recipe and its overrides are merged
(rl/config/loader.py): each names the dotted key that is wrong, before any work starts. A check belongs to the
section it reads first; a command runs the checks of its schema's sections only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf

from k3rl.util.yaml_config import ConfigError


def _at_least(cfg: Any, keys: tuple[str, ...], low: int, strict: bool = False) -> None:
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if value is not None and (value <= low if strict else value < low):
            raise ConfigError(f"{key}: must be {'>' if strict else '≥'} {low}, got {value}")


def check_sft(cfg: Any) -> None:
    _at_least(cfg, ("sft.learner.logprob_chunk_size",), 0, strict=True)
    ln = cfg.sft.learner
    if str(ln.lr_scheduler) == "constant" and ln.warmup_steps > 0:
        raise ConfigError(f"sft.learner.warmup_steps: {ln.warmup_steps} with sft.learner.lr_scheduler=constant, which "
                          f"has no warmup; use constant_with_warmup or sft.learner.warmup_steps=0")


def check_learner(cfg: Any) -> None:
    _at_least(cfg, ("learner.num_ranks",), 1)


CHECKS: dict[str, tuple[Callable[[Any], None], ...]] = {
    "learner": (check_learner,),
    "sft": (check_sft,),
}
"""Section name → its checks, in order."""


def check_sections(cfg: Any, sections: list[str]) -> None:
    """Run the checks of `sections` (those of a command's schema) on a merged config."""
    for section in sections:
        for check in CHECKS.get(section, ()):
            check(cfg)
