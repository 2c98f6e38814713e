"""Loading a command's config: a recipe and its overrides checked against the command's schema (util/yaml_config.py)
with the moved keys named, then the schema's value and cross-field checks; the `model:` section alone as a
`K3Config`; the remote-code check of a model directory named by its key."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from k3rl.rl.config.checks import validate
from k3rl.rl.config.moved import MOVED_KEYS
from k3rl.rl.config.schemas import JobConfig
from k3rl.util.yaml_config import ConfigError, load
from k3rl.util.yaml_config import to_yaml as to_yaml


def load_config(path: str | Path | None, overrides: list[str] = (), schema: type = JobConfig) -> DictConfig:
    """Schema defaults ← `base:` recipes ← the YAML file ← `key=value` overrides, checked at each step against
    `JobConfig` (every section a recipe may hold); a command's `schema` then keeps its own sections, resolved, and
    runs its value and cross-field checks (rl/config/checks.py)."""
    cfg = load(JobConfig, path, overrides, MOVED_KEYS)
    if schema is JobConfig:
        return cfg
    own = {f.name: OmegaConf.to_container(cfg[f.name], resolve=True) for f in dataclasses.fields(schema)}
    cfg = OmegaConf.merge(OmegaConf.structured(schema), own)
    validate(cfg, schema)
    return cfg


def load_model_config(path: str | Path, overrides: list[str] = ()) -> Any:
    """The `model:` section of any recipe (a model file or a job recipe, `base:` recipes included) as a
    validated `K3Config`. Overrides may leave out the `model.` prefix (`hidden_size=64`)."""
    sections = {f.name for f in dataclasses.fields(JobConfig)}

    def qualified(item: str) -> str:
        bare = item.removeprefix("~")
        if bare.split(".", 1)[0].split("=", 1)[0] in sections:
            return item
        return ("~" if item.startswith("~") else "") + "model." + bare

    cfg = load_config(path, [qualified(o) for o in overrides])
    from k3rl.model.config import K3Config

    try:
        return K3Config.from_model_config(cfg.model)
    except ValueError as e:
        raise ConfigError(f"{path}: model.{e}") from None


def check_model_code(cfg: Any, key: str, path: str | Path, model: bool = True) -> None:
    """A ConfigError naming `key` when the model directory `path` asks to run its own code (an `auto_map`;
    only the tokenizer's unless `model`) and `run.trust_remote_code` is off (model/formats/trust.py): before any work."""
    from k3rl.model.formats.trust import RemoteCodeError, check_remote_code

    try:
        check_remote_code(path, bool(cfg.run.trust_remote_code), model=model)
    except RemoteCodeError as e:
        raise ConfigError(f"{key}: {e}") from None
