"""A `CorpusConfig` from a YAML file or a built-in source name, plus dotted overrides.

Used by `k3rl corpus build` (rl/commands/corpus.py) and by the search environment when its `corpus` is a YAML path
(envs/search.py `get_corpus`). Read with the loader every k3rl config goes through (util/yaml_config.py): an unknown
key names the valid ones, a value of the wrong type names its key.
"""

from __future__ import annotations

from typing import Any


def read_config(path_or_name: str, overrides: list[str]) -> Any:
    """A ``CorpusConfig`` from a YAML file (or built-in source name) plus dotted overrides; a ValueError names an
    unknown key (with the valid ones) or a file that is not a corpus config."""
    from omegaconf import OmegaConf

    from k3rl.envs.corpus import CorpusConfig
    from k3rl.envs.sources import BUILTIN_SOURCES
    from k3rl.util.yaml_config import ConfigError, load

    try:
        if path_or_name in BUILTIN_SOURCES:
            merged = load(CorpusConfig, None, [f"name={path_or_name}", f"source={path_or_name}", *overrides])
        else:
            merged = load(CorpusConfig, path_or_name, overrides)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return OmegaConf.to_object(merged)
