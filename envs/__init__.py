"""Agent environments for k3rl: the one-class ``Env`` API, the tool-call protocol, the registry.

Importing this package is cheap (no numpy, no retrieval libraries); the search and
long-context environments load their back-ends when first built. See ``envs/README.md``.
"""

from k3rl.envs.base import Budget, Env, Episode, EpisodeResult, Step, TextPolicy, as_token_counter, run_episode
from k3rl.envs.registry import list_envs, make, register
from k3rl.envs.tools import ParseError, ToolCall, format_call, parse, tool

__all__ = [
    "Budget",
    "Env",
    "Episode",
    "EpisodeResult",
    "ParseError",
    "TextPolicy",
    "Step",
    "ToolCall",
    "as_token_counter",
    "format_call",
    "list_envs",
    "make",
    "parse",
    "register",
    "run_episode",
    "tool",
]
