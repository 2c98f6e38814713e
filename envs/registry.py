"""Environment registry: configs say ``env: search``; ``k3rl envs`` (rl/commands/envs.py) lists what is registered.

A config names an environment in one of three ways (``resolve`` turns each into an ``Entry``):

* a registered name: ``@register("name")`` on an ``Env`` subclass or on a factory function
  returning one (the long-context families use a factory that picks in-context or search
  serving). Built-in environments register themselves when their module is imported; ``make``
  and ``list_envs`` import those modules on first use, so importing ``envs`` stays cheap.
* a name an installed package declares in the ``k3rl.envs`` entry-point group
  (``[project.entry-points."k3rl.envs"] guess = "my_pkg.envs:Guess"``): it is on every node
  where the package is installed.
* ``module.path:ClassName``: a class (or factory) in the user's own module — or an agent function
  ``run(client, task)`` written against the OpenAI API, which envs/agent.py wraps. The module is
  imported as Python would, and also from the current directory (as ``python -m`` does), so
  ``env.name=guess_env:Guess`` works beside ``guess_env.py``. ``user_module_path`` tells the
  driver which file or package to ship to Ray workers (rl/orchestrator/cluster.py) so that they import it too.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, TypeVar

from k3rl.envs.base import Env

BUILTIN_MODULES = ("k3rl.envs.search", "k3rl.envs.longctx", "k3rl.envs.visual")
ENTRY_POINT_GROUP = "k3rl.envs"

_REGISTRY: dict[str, Entry] = {}
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


class EnvArgumentError(TypeError, ValueError):
    """An environment refused the arguments it was built with (``env.args``): a name it does not take or a value
    it cannot use. ``make`` raises it for the constructor's TypeError or ValueError, so a driver that builds the
    environment before writing anything names the argument instead of failing inside a rollout worker."""


class UnknownEnvironment(KeyError):
    """An environment name that is neither registered, nor an entry point, nor an importable
    ``module:Class``; the message says which and how to name one."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def _load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _summary(target: Any) -> str:
    return ((getattr(target, "__doc__", None) or "").strip().splitlines() or [""])[0]


def _import_user_module(module: str):
    """Import `module` as Python would, else from the current directory (as `python -m` does)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0] or os.getcwd() in sys.path:
            raise
    sys.path.insert(0, os.getcwd())
    return importlib.import_module(module)


def resolve(name: str) -> Entry:
    """The `Entry` a config's environment name stands for (see module docstring); raises
    `UnknownEnvironment` naming what was tried."""
    if ":" in name:
        module, _, attr = name.partition(":")
        if not module or not attr:
            raise UnknownEnvironment(f"environment {name!r}: a class of your own is named 'module.path:ClassName'")
        try:
            mod = _import_user_module(module)
        except ModuleNotFoundError as e:
            raise UnknownEnvironment(
                f"environment {name!r}: cannot import module {module!r} ({e}); it must be importable from the "
                f"current directory {os.getcwd()}, PYTHONPATH or an installed package") from None
        target = getattr(mod, attr, None)
        if target is None:
            raise UnknownEnvironment(f"environment {name!r}: module {module!r} ({getattr(mod, '__file__', '?')}) "
                                     f"has no attribute {attr!r}")
        from k3rl.envs.agent import AgentEnv, is_agent_function

        if is_agent_function(target):  # an agent of the user's own, run(client, task) (envs/agent.py)
            return Entry(name, functools.partial(AgentEnv, target), _summary(target))
        if not (isinstance(target, type) and issubclass(target, Env)) and (isinstance(target, type)
                                                                           or not callable(target)):
            raise UnknownEnvironment(f"environment {name!r}: {attr!r} is a {type(target).__name__}, not an Env "
                                     f"subclass or a factory returning one")
        return Entry(name, target, _summary(target))
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    points = _entry_points()
    if name in points:
        target = points[name].load()
        return _REGISTRY.get(name) or Entry(name, target, _summary(target))
    known = sorted(set(_REGISTRY) | set(points))
    raise UnknownEnvironment(f"unknown environment {name!r}; registered: {', '.join(known)}; a class of your own is "
                             f"named 'module.path:ClassName' (e.g. guess_env:Guess beside guess_env.py)")


def make(name: str, tokenizer: Any = None, **kwargs: Any) -> Env:
    """Build the environment ``name`` (registered, entry point or ``module:Class``) with ``kwargs``; arguments it
    refuses are an ``EnvArgumentError``.

    ``tokenizer``: the policy's tokenizer, passed on to environments that count tokens (those taking a
    ``tokenizer`` argument: the long-context families size their haystacks with it) and not to the others,
    so every part that has a model (rollout workers, evaluation, SFT) sizes tasks in that model's tokens."""
    entry = resolve(name)
    if tokenizer is not None and "tokenizer" not in kwargs and counts_tokens(entry.target):
        kwargs["tokenizer"] = tokenizer
    try:
        env = entry.target(**kwargs)
    except EnvArgumentError:
        raise
    except (TypeError, ValueError) as e:
        raise EnvArgumentError(str(e)) from e
    if not isinstance(env, Env):
        raise TypeError(f"environment {name!r} built a {type(env).__name__}, not an Env")
    return env


def counts_tokens(target: Callable[..., Any]) -> bool:
    """Whether an environment class or factory takes a ``tokenizer`` argument."""
    import inspect

    try:
        return "tokenizer" in inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False


def user_module_path(name: str) -> Path | None:
    """For ``module:Class`` names whose module lives outside the installed packages and outside
    k3rl itself: the file or top-level package directory Ray workers need (``py_modules``)."""
    if ":" not in name:
        return None
    resolve(name)  # imports it
    if name.startswith("k3rl."):
        return None
    top = sys.modules[name.partition(":")[0].split(".")[0]]
    path = Path(top.__path__[0]) if hasattr(top, "__path__") else Path(top.__file__)
    installed = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib", "stdlib")}
    own = Path(__file__).resolve().parents[1]
    resolved = path.resolve()
    if any(resolved.is_relative_to(root) for root in installed | {own}):
        return None
    return resolved


def list_envs() -> list[Entry]:
    """All registered environments and installed entry points, sorted by name."""
    _load_builtins()
    entries = dict(_REGISTRY)
    for name, ep in _entry_points().items():
        entries.setdefault(name, Entry(name, ep, f"(from {ep.value})"))
    return [entries[k] for k in sorted(entries)]


PROTOCOL_REPEATS = 100
"""How often `tokenizer_texts` repeats the tool protocol, so that its words become single tokens."""


def protocol_texts() -> list[str]:
    """The tool-protocol text every built-in environment shows a model: its system message
    (preamble, call syntax, tool schemas) and one call of each tool. Tokenizers are trained
    on these as well as on prose (`k3rl init`), so the JSON of schemas and calls costs a few
    tokens per word rather than a few per character."""
    from k3rl.envs import tools as T

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


def tokenizer_texts() -> Iterator[str]:
    """What the built-in tokenizer is trained on (model/init.py `init_model`, passed in by the commands): the
    built-in wiki text, then the tool protocol (schemas, calls, framing) `PROTOCOL_REPEATS` times."""
    from k3rl.envs.sources import builtin_texts

    return chain(builtin_texts("wiki"), protocol_texts() * PROTOCOL_REPEATS)
