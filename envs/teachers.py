"""Imperfect teachers: policies that stand in for an environment's oracle on some SFT tasks, so that the
warm-started model has habits only the reward can correct (rl/orchestrator/demonstrations.py uses them).

`ClosedBookPolicy` answers at once with a guess of the right kind; `HedgingPolicy` plays the oracle
but pads the final answer ("grey" → "grey, I think"). Both speak the tool protocol of envs/tools.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ClosedBookPolicy:
    """A teacher that answers at once, without looking anything up: its only turn is the terminal
    call `call` (another task's final answer, so a plausible guess of the right kind), as a
    closed-book model answers from memory."""

    preamble = "I will answer from memory.\n"

    def __init__(self, call):
        self.call = call

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        from k3rl.envs.tools import format_call

        return self.preamble + format_call(self.call.name, self.call.arguments)


class HedgingPolicy:
    """A teacher that plays `oracle` but hedges its final answer: the first text argument of the
    terminal call gets `suffix` ("grey" → "grey, I think"), which exact match does not accept and F1
    scores lower (the longer the hedge, the lower), as a chatty model pads the answer field."""

    suffix = ", I think"

    def __init__(self, oracle, env, suffix: str | None = None):
        self.oracle, self.env = oracle, env
        if suffix is not None:
            self.suffix = suffix

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        from k3rl.envs.tools import TOOL_CALL_START, format_call

        text = self.oracle(messages)
        call = terminal_call(self.env, [{"role": "assistant", "content": text}])
        key = next((k for k, v in call.arguments.items() if isinstance(v, str)), None) if call else None
        if key is None:
            return text
        hedged = {**call.arguments, key: call.arguments[key] + self.suffix}
        return text[:text.index(TOOL_CALL_START)] + format_call(call.name, hedged)


def terminal_call(env, messages: Sequence[dict[str, Any]]):
    """The terminal tool call that ended a transcript (a `ToolCall` of a terminal tool of `env`), or None."""
    from k3rl.envs.tools import ToolCall, parse

    last = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
    call = parse(last["content"]) if last is not None else None
    spec = env.tool_specs().get(call.name) if isinstance(call, ToolCall) else None
    return call if spec is not None and spec.terminal else None
