"""Environment registry: configs say ``env: search``; ``k3rl envs`` lists what is registered.

``@register("name")`` works on an ``Env`` subclass or on a factory function returning
one (the long-context families use a factory that picks in-context or search serving).
Built-in environments register themselves when their module is imported; ``make`` and
``list_envs`` import those modules on first use, so importing ``envs`` stays cheap.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from envs.base import Env

BUILTIN_MODULES = ("envs.search", "envs.longctx")

_REGISTRY: dict[str, "Entry"] = {}
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Entry:
    """A registered environment: its name, what builds it, and a one-line summary."""

    name: str
    target: Callable[..., Env]
    summary: str


def register(name: str | None = None, *, summary: str | None = None) -> Callable[[F], F]:
    """Register an ``Env`` subclass or factory under ``name`` (default: the class name, lowercased)."""

    def deco(target: F) -> F:
        key = name or target.__name__.lower()
        if key in _REGISTRY and _REGISTRY[key].target is not target:
            old = _REGISTRY[key].target
            raise ValueError(f"environment {key!r} is already registered to {old.__module__}.{old.__qualname__}")
        line = summary or ((target.__doc__ or "").strip().splitlines() or [""])[0]
        _REGISTRY[key] = Entry(key, target, line)
        return target

    return deco


def _load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def make(name: str, **kwargs: Any) -> Env:
    """Build the environment registered as ``name`` with constructor arguments ``kwargs``."""
    _load_builtins()
    if name not in _REGISTRY:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    env = _REGISTRY[name].target(**kwargs)
    if not isinstance(env, Env):
        raise TypeError(f"environment {name!r} built a {type(env).__name__}, not an Env")
    return env


def list_envs() -> list[Entry]:
    """All registered environments, sorted by name."""
    _load_builtins()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def protocol_texts() -> list[str]:
    """The tool-protocol text every built-in environment shows a model: its system message
    (preamble, call syntax, tool schemas) and one call of each tool. Tokenizers are trained
    on these as well as on prose (`k3rl init`), so the JSON of schemas and calls costs a few
    tokens per word rather than a few per character."""
    from envs import tools as T

    _load_builtins()
    texts, stack, seen = [], list(Env.__subclasses__()), set()
    while stack:
        cls = stack.pop(0)
        if cls in seen:
            continue
        seen.add(cls)
        stack.extend(cls.__subclasses__())
        specs = cls.tool_specs()
        if not specs:
            continue
        texts += [T.render_tools_prompt(specs, cls.system_prompt, style) for style in T.TOOL_PROMPT_STYLES]
        for spec in specs.values():
            args = {name: "" for name in spec.schema()["function"]["parameters"].get("required", [])}
            texts.append(T.format_call(spec.name, args))
    return texts


def main(argv: list[str]) -> int:
    """``k3rl envs``: print one line per registered environment."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: k3rl envs\n\nList the registered environments, one line each.")
        return 0
    if argv:
        print(f"k3rl envs: unexpected arguments {argv}", file=sys.stderr)
        return 2
    entries = list_envs()
    width = max((len(e.name) for e in entries), default=0)
    for e in entries:
        print(f"{e.name:<{width}}  {e.summary}")
    return 0


if __name__ == "__main__":
    # Run through the package module so built-ins register into the same registry.
    from envs.registry import main as _main

    sys.exit(_main(sys.argv[1:]))
