"""Decode states the native engine keeps between an episode's turns, and what its prefills cost.

A session is one sample's state after a turn, kept under an id the agent loop chose: the tokens it has
consumed and the decode state over exactly those tokens (model/policy.py `Policy.split`: one sequence,
no padding), with the weights version that computed it. The next turn's prompt continues it when it
extends those tokens exactly and the version is still the engine's: only the new tokens (the pending
token, the tool observation, the chat scaffold) are prefilled, on top of the kept state. Otherwise the
prompt is prefilled from its first token and the fallback is counted (`PrefillStats`).

The last sampled token of a turn stays pending, not fed: the state covers the prompt and every sampled
token but the last, which the next prompt carries anyway. So an episode that ends costs no extra
forward, and a resumed prompt always has at least one new token to take its logits from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable

import numpy as np


@dataclass
class Session:
    """One sample's kept state."""

    tokens: np.ndarray
    """[L] int64, every token the state has consumed (prompt and sampled tokens but the pending last one)."""
    state: dict
    """The policy's decode state of this one sequence over `tokens` (model/policy.py)."""
    version: int
    """Policy version of the weights that computed `state`."""


@dataclass
class PrefillStats:
    """Prompt tokens the engine ran through the model, and those a kept state spared it."""

    prefilled_tokens: int = 0
    """Prompt tokens fed through the model (padding not counted)."""
    reused_tokens: int = 0
    """Prompt tokens covered by a kept session state instead."""
    full_prompts: int = 0
    """Prompts prefilled from their first token."""
    resumed_prompts: int = 0
    """Prompts continued from a session."""
    prefix_fallbacks: int = 0
    """Prompts whose session was there but which do not extend its tokens (prefilled in full)."""
    version_fallbacks: int = 0
    """Prompts whose session was computed by other weights (prefilled in full)."""


class SessionStore:
    """Sessions by id; see module docstring."""

    def __init__(self) -> None:
        self._sessions: dict[Hashable, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sessions

    def put(self, key: Hashable, session: Session) -> None:
        self._sessions[key] = session

    def version(self, key: Hashable) -> int | None:
        """Weights version of session `key`'s state (None: no such session), for a caller that decides
        whether an old state may continue."""
        s = self._sessions.get(key)
        return None if s is None else s.version

    def take(self, keys: Iterable[Hashable], prompt: np.ndarray, version: int) -> tuple[Session | None, str | None]:
        """Remove the sessions `keys` (the samples one prompt is asked for); return the longest whose tokens
        `prompt` extends under weights `version`, else None and why: None (no key had a session), `prefix`
        or `version`. Removed either way: the turn about to run replaces them."""
        found = [s for s in (self._sessions.pop(k, None) for k in keys) if s is not None]
        if not found:
            return None, None
        usable = [s for s in found if s.version == version and len(s.tokens) < len(prompt)
                  and np.array_equal(prompt[:len(s.tokens)], s.tokens)]
        if usable:
            return max(usable, key=lambda s: len(s.tokens)), None
        return None, "version" if all(s.version != version for s in found) else "prefix"

    def end(self, keys: Iterable[Hashable]) -> None:
        """Drop sessions `keys` (unknown ids are ignored)."""
        for k in keys:
            self._sessions.pop(k, None)

    def clear(self) -> None:
        self._sessions.clear()
