"""Decode states the native engine keeps between an episode's turns, and what its prefills cost.

A session is one sample's state after a turn, kept under an id the agent loop chose: the tokens it has
consumed and the decode state over exactly those tokens (model/policy.py `Policy.split`: one sequence,
no padding), with the weights version that computed each token's part of it. The next turn's prompt
continues it when it extends those tokens exactly and the weights that computed it are still the
engine's: only the new tokens (the pending token, the tool observation, the chat scaffold) are
prefilled, on top of the kept state. Otherwise the prompt is prefilled from its first token and the
fallback is counted (`PrefillStats`).

A stale state (partial rollouts with `rollout.partial_resume=keep_state`: an episode paused across a
weight update) may be continued anyway when the caller asks (`take(..., stale_ok=True)`): the new turn
then reads context that older weights computed, and `Session.stale_tokens` counts how much of it, so the
mismatch with the version the new turn's tokens carry is reported rather than hidden.

The last sampled token of a turn stays pending, not fed: the state covers the prompt and every sampled
token but the last, which the next prompt carries anyway. So an episode that ends costs no extra
forward, and a resumed prompt always has at least one new token to take its logits from.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np


@dataclass
class Session:
    """One sample's kept state."""

    tokens: np.ndarray
    """[L] int64, every token the state has consumed (prompt and sampled tokens but the pending last one)."""
    state: dict
    """The policy's decode state of this one sequence over `tokens` (model/policy.py)."""
    version: int
    """Policy version of the weights of the turn that kept it (the newest in `computed_by`)."""
    computed_by: np.ndarray
    """[L] int64, the policy version whose weights computed each token's part of `state` (older ones when an
    earlier turn continued a stale state)."""

    def stale_tokens(self, version: int) -> int:
        """Tokens whose part of the state other weights than `version`'s computed (older ones: versions grow)."""
        return int(np.count_nonzero(self.computed_by != version))


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
    stale_state_tokens: int = 0
    """Kept tokens whose state older weights computed, read by a resumed prompt (`resume_stale` only)."""


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

    def take(self, keys: Iterable[Hashable], prompt: np.ndarray, version: int,
             stale_ok: bool = False) -> tuple[Session | None, str | None]:
        """Remove the sessions `keys` (the samples one prompt is asked for); return the longest whose tokens
        `prompt` extends and whose state weights `version` computed (any weights with `stale_ok`), else None
        and why: None (no key had a session), `prefix` or `version`. Removed either way: the turn about to
        run replaces them."""
        found = [s for s in (self._sessions.pop(k, None) for k in keys) if s is not None]
        if not found:
            return None, None
        current = [s for s in found if stale_ok or s.stale_tokens(version) == 0]
        usable = [s for s in current
                  if len(s.tokens) < len(prompt) and np.array_equal(prompt[:len(s.tokens)], s.tokens)]
        if usable:
            return max(usable, key=lambda s: len(s.tokens)), None
        return None, "prefix" if current else "version"

    def end(self, keys: Iterable[Hashable]) -> None:
        """Drop sessions `keys` (unknown ids are ignored)."""
        for k in keys:
            self._sessions.pop(k, None)

    def clear(self) -> None:
        self._sessions.clear()
