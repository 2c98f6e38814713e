"""YAML recipes and dotted `key=value` overrides checked against a typed dataclass schema (OmegaConf).

`load(schema, path, overrides)` merges: schema defaults ← the `base:` recipes of the file (a path or a list of
paths, relative to it, recursively, in order) ← the file ← the overrides (`~key` resets a key to its default, a
dict to empty). Every layer is checked before it is merged: an unknown key names its whole dotted path and the
valid keys at its level; a key listed in `moved` names its new place; a value of the wrong type names the key,
the value and the type the schema expects. After the merge, `checks` (schema-specific value and cross-field
rules) run on the result and raise `ConfigError("dotted.key: what is wrong")`.

This is the utility floor: `model/`, `envs/` and `rl/` may all use it; it knows no schema of its own.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration file or override that does not fit the schema."""


def load(schema: type, path: str | Path | None, overrides: Iterable[str] = (), moved: Mapping[str, str] = {},
         checks: Callable[[DictConfig], None] | None = None) -> DictConfig:
    """Schema defaults ← `base:` recipes ← the YAML file ← `key=value` overrides, checked at each step."""
    cfg = OmegaConf.structured(schema)
    if path is not None:
        for layer, source in yaml_layers(Path(path)):
            check_keys(layer, schema, source, moved)
            cfg = _merge(cfg, layer, source, schema)
    for item in overrides:
        if item.startswith("~"):
            cfg = _reset(cfg, item[1:], schema, moved)
            continue
        key, value = parse_override(item)
        check_keys(_nest(key, value), schema, f"override '{item}'", moved)
        cfg = _merge(cfg, _nest(key, value), f"override '{item}'", schema)
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config key '{getattr(e, 'full_key', '?')}': {e.msg}") from None
    if checks is not None:
        checks(cfg)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def moved_to(key: str, moved: Mapping[str, str]) -> str | None:
    """The new place of `key` if it is an old one; list items are matched as `[i]` (`pretrain.stages[2].lr` is
    found as `pretrain.stages[i].lr`) and the new place keeps the user's index."""
    index = re.search(r"\[(\d+)\]", key)
    new = moved.get(re.sub(r"\[\d+\]", "[i]", key))
    return new.replace("[i]", f"[{index.group(1)}]") if new and index else new


def yaml_layers(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[dict, str]]:
    """The file's `base:` recipes (recursively, in order), then the file itself."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: `base:` recipes form a cycle")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    bases = data.pop("base", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: `base:` must be a path or a list of paths")
    layers: list[tuple[dict, str]] = []
    for base in bases:
        layers += yaml_layers(path.parent / base, seen + (path,))
    layers.append((data, str(path)))
    return layers


def parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"override '{item}' is not of the form dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _reset(cfg: DictConfig, key: str, schema: type, moved: Mapping[str, str]) -> DictConfig:
    """`~dotted.key`: a schema field goes back to its default (a dict field is emptied, so the
    overrides after it build a new one instead of merging into the recipe's); an entry of a free-form
    dict (`~env.args.length`) is removed."""
    if not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"override '~{key}' is not of the form ~dotted.key")
    if moved_to(key, moved):
        raise ConfigError(f"override '~{key}': config key '{key}' has moved to '{moved_to(key, moved)}'")
    defaults = OmegaConf.structured(schema)
    parent_key, _, leaf = key.rpartition(".")
    if OmegaConf.select(defaults, key, default=_MISSING) is not _MISSING:
        default = OmegaConf.select(defaults, key)
        value = OmegaConf.to_container(default) if isinstance(default, (DictConfig, ListConfig)) else default
        OmegaConf.update(cfg, key, value, merge=False)
        return cfg
    parent = OmegaConf.select(cfg, parent_key) if parent_key else None
    if isinstance(parent, DictConfig) and leaf in parent:
        del parent[leaf]
        return cfg
    raise ConfigError(f"override '~{key}': no config key '{key}' to reset")


def _nest(key: str, value: Any) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def schema_fields(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _unwrap(tp: Any) -> Any:
    """Optional[X] → X; list[X] → list[X] unchanged."""
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def check_keys(data: Any, schema: type, source: str, moved: Mapping[str, str] = {}, prefix: str = "") -> None:
    """Every key of `data` must exist in `schema`; nested dicts are checked against nested dataclasses."""
    if not isinstance(data, dict):
        return
    known = schema_fields(schema)
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in known:
            if moved_to(full, moved):
                raise ConfigError(f"{source}: config key '{full}' has moved to '{moved_to(full, moved)}'")
            level = prefix[:-1] or "the top level"
            named = _first_leaf_path(value, full)
            raise ConfigError(
                f"{source}: unknown config key '{named}' ('{key}' is not a key of {level}); "
                f"valid keys there: {', '.join(known)}"
            )
        tp = _unwrap(known[key])
        if dataclasses.is_dataclass(tp):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{source}: config key '{full}' is a section ({tp.__name__}); got value {value!r}")
            check_keys(value, tp, source, moved, f"{full}.")
        elif typing.get_origin(tp) is list and isinstance(value, list):
            (item_tp,) = typing.get_args(tp) or (Any,)
            if dataclasses.is_dataclass(item_tp):
                for i, item in enumerate(value):
                    check_keys(item, item_tp, source, moved, f"{full}[{i}].")
        elif typing.get_origin(tp) is dict and isinstance(value, dict):
            item_tp = (typing.get_args(tp) or (str, Any))[1]
            if dataclasses.is_dataclass(item_tp):
                for name, item in value.items():
                    check_keys(item, item_tp, source, moved, f"{full}.{name}.")


def _first_leaf_path(value: Any, path: str) -> str:
    """`no` with value {'such': {'key': 1}} → `no.such.key`: the whole key the user wrote."""
    while isinstance(value, dict) and len(value) == 1:
        (key, value), = value.items()
        path = f"{path}.{key}"
    return path


def _find_path(data: Any, leaf: str, path: str = "") -> str | None:
    """The dotted path (with [i] for list items) of the first key named `leaf` inside `data`."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        here = f"{path}[{key}]" if isinstance(data, list) else (f"{path}.{key}" if path else str(key))
        if key == leaf:
            return here
        found = _find_path(value, leaf, here)
        if found:
            return found
    return None


def _expected_type(schema: type, full_key: str) -> str:
    tp: Any = schema
    for part in full_key.replace("]", "").replace("[", ".").split("."):
        if part.isdigit():
            tp = (typing.get_args(tp) or (Any,))[0]
            continue
        tp = _unwrap(tp)
        if not dataclasses.is_dataclass(tp):
            break
        tp = schema_fields(tp).get(part, Any)
    choices = _unwrap(tp)
    if isinstance(choices, type) and issubclass(choices, Enum):
        return "one of " + ", ".join(m.value for m in choices)
    return getattr(tp, "__name__", str(tp)) if not typing.get_args(tp) else str(tp).replace("typing.", "")


def _merge(cfg: DictConfig, layer: dict, source: str, schema: type) -> DictConfig:
    try:
        return OmegaConf.merge(cfg, layer)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        value = _lookup(layer, key)
        if value is _MISSING:
            key = _find_path(layer, key.rsplit(".", 1)[-1]) or key
            value = _lookup(layer, key)
        raise ConfigError(
            f"{source}: config key '{key}' got {value!r} ({type(value).__name__}), "
            f"expected {_expected_type(schema, key)}"
        ) from None


def _lookup(data: Any, full_key: str) -> Any:
    for part in full_key.replace("]", "").replace("[", ".").split("."):
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return _MISSING
    return data


_MISSING = object()
