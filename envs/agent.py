"""`AgentEnv`: an agent of the user's own, written against the OpenAI chat API, as a k3rl environment.

A config names the agent's function like any environment of the user's own: `env.name=my_agent:run`, where
`my_agent.py` holds

    def run(client, task):          # client: an `openai.OpenAI` pointed at the rollout worker
        ...                          # any agent code: its own loop, tools, history edits, sub-calls
        return reward                # a number, or {"reward": r, "metrics": {name: number}}

(`async def run(client, task)` gets an `openai.AsyncOpenAI`). A function whose first two parameters are named
`client` and `task` is an agent; the registry (envs/registry.py) wraps it in this class, whose only job is to
carry it and its settings (`env.args.timeout_s`) to the rollout worker, where rollout/agent_runner.py runs each
episode and the worker's OpenAI endpoint (rollout/agent_endpoint.py) records every call. Tasks come from
`env.tasks_path` (JSON rows, any shape: the agent reads them).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from k3rl.envs.base import Env

AGENT_PARAMETERS = ("client", "task")
SANDBOXES = ("thread", "process")


def is_agent_function(target: Any) -> bool:
    """Whether `target` is an agent function: `run(client, task, …)` (module docstring)."""
    if isinstance(target, type) or not (inspect.isfunction(target) or inspect.iscoroutinefunction(target)):
        return False
    names = [p.name for p in inspect.signature(target).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(names[:2]) == AGENT_PARAMETERS


def builds_agent(target: Any) -> bool:
    """Whether a registry entry's target builds an `AgentEnv` (an agent function wrapped by envs/registry.py)."""
    return (isinstance(target, type) and issubclass(target, AgentEnv)) or getattr(target, "func", None) is AgentEnv


class AgentEnv(Env):
    """Carries an agent function to the rollout workers (module docstring); it has no tools of its own."""

    def __init__(self, run: Callable[..., Any], timeout_s: float = 600.0, sandbox: str = "thread"):
        """
        Args:
            run: the agent function `run(client, task)`.
            timeout_s: wall time of one episode; an agent still running then is a failed episode (reward 0), and
                its further calls are refused.
            sandbox: where an episode's agent runs: `thread` (a thread of the rollout worker: cheapest, shares its
                memory) or `process` (a subprocess of its own, started fresh and killed at the timeout: an agent
                that hangs, leaks or crashes the interpreter cannot touch the worker).
        """
        if not is_agent_function(run):
            raise TypeError(f"{getattr(run, '__name__', run)!r} is not an agent function run(client, task)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: > 0 seconds, got {timeout_s!r}")
        if sandbox not in SANDBOXES:
            raise ValueError(f"sandbox: one of {', '.join(SANDBOXES)}, got {sandbox!r}")
        self.run = run
        self.timeout_s = float(timeout_s)
        self.sandbox = sandbox

    def reset(self, task: Any) -> str:
        """The task as the agent gets it (any JSON value); checked to be JSON here."""
        return json.dumps(task, ensure_ascii=False)

    def reward(self) -> float:
        raise TypeError("an agent's episodes run through rollout/agent_runner.py, which takes the reward the agent "
                        "returns")


__all__ = ["AgentEnv", "builds_agent", "is_agent_function"]
