"""Oracle policies for the long-context families: each family's solver played through the protocol.

A family's solver (``solve`` in its module) is a generator that asks for passages by
query and returns ``(answer, evidence ids)``; it reaches the answer from the text alone
(plus the generators' synonym tables), never from the gold. ``ContextOracle`` feeds it
the whole haystack from the prompt and answers in one turn, citing passages;
``FamilySearchOracle`` turns each query into a ``search`` call. Their turns are SFT
demonstrations (rl/orchestrator/demonstrations.py), and running them shows the tasks are solvable.

Real questions (the ``file`` family, taskfile.py) have no solver: ``PassageContextOracle`` and
``PassageSearchOracle`` know the gold answer and evidence texts, and show where the evidence is — in
the prompt, or by searching the question — saying so when they cannot find it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from k3rl.envs.base import last_observation, user_prompt
from k3rl.envs.longctx.families import SOLVERS
from k3rl.envs.longctx.haystack import parse_context
from k3rl.envs.longctx.task import Passages, Solver
from k3rl.envs.search_oracle import parse_results
from k3rl.envs.tools import format_call


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


class PassageContextOracle:
    """Finds the gold evidence passages in the prompt by their text, and answers the gold answer citing them."""

    def __init__(self, answer: str, evidence: Sequence[str]):
        self.answer, self.evidence = answer, set(evidence)

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        _, passages = parse_context(user_prompt(messages))
        cited = [pid for pid, text in passages if text in self.evidence]
        found = {text for _, text in passages} & self.evidence
        note = (f"The evidence is in {', '.join(cited)}." if cited else "There is no evidence passage.")
        if len(found) < len(self.evidence):
            note += f" {len(self.evidence) - len(found)} evidence passage(s) are not in the text; I answer anyway."
        return note + "\n" + format_call("answer", {"text": self.answer, "evidence": cited})


class PassageSearchOracle:
    """Searches the question, then the titles (or first words) of the evidence passages not yet found; opens
    evidence passages whose results were cut; answers the gold answer — saying which evidence search missed."""

    def __init__(self, question: str, answer: str, evidence: Mapping[str, str], k: int = 20):
        """``evidence``: passage id → what to search for it when the question does not find it."""
        self.question, self.answer, self.evidence, self.k = question, answer, dict(evidence), k
        self.found: set[str] = set()
        self.to_open: list[str] = []
        self.queries = 0

    def _search(self, why: str, query: str) -> str:
        self.queries += 1
        return f"{why}\n" + format_call("search", {"query": query, "k": self.k})

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        obs = last_observation(messages) or ""
        if obs.startswith("Results for"):
            for pid, text in parse_results(obs):
                if pid in self.evidence and pid not in self.found:
                    self.found.add(pid)
                    if text.endswith(" …"):  # the result showed only the passage's beginning
                        self.to_open.append(pid)
        if self.queries == 0:
            return self._search("I will search for the question.", self.question)
        missing = [pid for pid in self.evidence if pid not in self.found]
        if missing and self.queries == 1:
            return self._search("Some evidence is still missing; I search for it by name.",
                                " ".join(self.evidence[pid] for pid in missing))
        if self.to_open:
            pid = self.to_open.pop(0)
            return f"Passage {pid} was cut; I read it.\n" + format_call("open", {"doc_id": pid})
        if missing:
            note = f"Search did not find evidence passage(s) {', '.join(missing)}; I answer from the gold answer."
        else:
            note = f"The evidence is in {', '.join(sorted(self.found))}." if self.found else "There is no evidence passage."
        return note + "\n" + format_call("answer", {"text": self.answer})
