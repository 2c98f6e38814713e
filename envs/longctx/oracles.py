"""Oracle policies for the long-context families: each family's solver played through the protocol.

A family's solver (``solve`` in its module) is a generator that asks for passages by
query and returns ``(answer, evidence ids)``; it reaches the answer from the text alone
(plus the generators' synonym tables), never from the gold. ``ContextOracle`` feeds it
the whole haystack from the prompt and answers in one turn, citing passages;
``FamilySearchOracle`` turns each query into a ``search`` call. Their turns are SFT
demonstrations (rl/demonstrations.py), and running them shows the tasks are solvable.
"""

from __future__ import annotations

from typing import Any

from envs.base import last_observation, user_prompt
from envs.longctx.families import SOLVERS
from envs.longctx.haystack import parse_context
from envs.longctx.task import Passages, Solver
from envs.search_oracle import parse_results
from envs.tools import format_call


def solve_in_context(family: str, question: str, passages: Passages) -> tuple[str, list[str]]:
    """Run a family's solver with the whole haystack as the answer to every query."""
    solver = SOLVERS[family](question)
    try:
        next(solver)
        while True:
            solver.send(passages)
    except StopIteration as stop:
        return stop.value


class ContextOracle:
    """Reads the haystack in the prompt and answers in one turn, citing the passages used."""

    def __init__(self, family: str):
        self.family = family

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        question, passages = parse_context(user_prompt(messages))
        answer, evidence = solve_in_context(self.family, question, passages)
        where = f"passages {', '.join(evidence)}" if evidence else "no passage"
        return (f"The relevant facts are in {where}.\n"
                + format_call("answer", {"text": answer, "evidence": evidence}))


class FamilySearchOracle:
    """Turns each query of the family's solver into a ``search`` call, then answers."""

    def __init__(self, family: str, k: int = 20):
        self.family, self.k = family, k
        self.solver: Solver | None = None

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        try:
            if self.solver is None:
                question = user_prompt(messages).split("Question: ", 1)[1].split("\n", 1)[0]
                self.solver = SOLVERS[self.family](question)
                query = next(self.solver)
            else:
                query = self.solver.send(parse_results(last_observation(messages) or ""))
        except StopIteration as stop:
            answer, _ = stop.value
            return "I have what I need.\n" + format_call("answer", {"text": answer})
        return f"Searching for {query!r}.\n" + format_call("search", {"query": query, "k": self.k})
