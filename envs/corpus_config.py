"""A `CorpusConfig` from a YAML file or a built-in source name, plus dotted overrides.

Used by `k3rl corpus build` (rl/commands/corpus.py) and by the search environment when its `corpus` is a YAML path
(envs/search.py `get_corpus`).
"""

from __future__ import annotations

from typing import Any


def read_config(path_or_name: str, overrides: list[str]) -> Any:
    """A ``CorpusConfig`` from a YAML file (or built-in source name) plus dotted overrides; a ValueError names an
    unknown key (with the valid ones) or a file that is not a corpus config."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    from k3rl.envs.corpus import CorpusConfig
    from k3rl.envs.sources import BUILTIN_SOURCES

    base = OmegaConf.structured(CorpusConfig)
    try:
        if path_or_name in BUILTIN_SOURCES:
            layers = [OmegaConf.create({"name": path_or_name, "source": path_or_name})]
        else:
            layers = [OmegaConf.load(path_or_name)]
        layers.append(OmegaConf.from_dotlist(overrides))
        merged = OmegaConf.merge(base, *layers)
    except ConfigKeyError as exc:
        valid = ", ".join(CorpusConfig.__dataclass_fields__)
        raise ValueError(f"{exc.msg.splitlines()[0]}; valid keys: {valid}") from None
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path_or_name}: not a corpus config YAML ({first})") from None
    return OmegaConf.to_object(merged)
