"""Oracle policies: solve tasks through the same text protocol a model uses.

An oracle is a policy (conversation so far -> next assistant text). Its turns are valid
SFT demonstrations, and running it over generated tasks proves they are solvable.

- ``SearchOracle`` (search environment): searches the question's words, opens a gold
  passage, answers. It is privileged: it knows the gold answer and evidence ids, and
  when the question's words do not retrieve the evidence it searches for the answer's
  name, as a model that guessed the entity would.
- Long-context families: one solver per family, written as a generator that asks for
  passages by query and returns ``(answer, evidence ids)``. ``ContextOracle`` feeds it
  the whole haystack from the prompt and answers in one turn, citing passages;
  ``FamilySearchOracle`` turns each query into a ``search`` call. Both reach the answer
  from the text alone (plus the generators' synonym tables), never from the gold.
"""

from __future__ import annotations

import json
import re
from typing import Any, Generator, Mapping

from envs.base import last_observation, user_prompt
from envs.longctx import COLOURS, ENTITY_PATTERN, OBJECTS, ORDINALS, RELATIONS, ROLES, UNANSWERABLE, Passages
from envs.tools import format_call

Solver = Generator[str, Passages, tuple[str, list[str]]]


class SearchOracle:
    """Solves a search task: search the question, answer from the results (or open a gold
    passage first when its result does not show the answer), answer.

    It is privileged (it knows the gold answer and evidence ids): when the question's
    own words do not retrieve the evidence it searches for the answer's name, as a
    model that guessed the entity would. Its turns are valid SFT demonstrations; its
    searches ask for ``k`` results.
    """

    def __init__(self, task: Mapping[str, Any], k: int = 10):
        self.task = task
        self.k = k
        self.evidence = set(task.get("evidence", []))
        self.queries = [task.get("query") or _question_keywords(task["question"])]
        if task.get("answers"):
            self.queries.append(str(task["answers"][0]))
        self.step = 0

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        obs = last_observation(messages)
        found = [pid for pid in _result_ids(obs or "") if pid in self.evidence]
        if found and obs and obs.startswith("Results for"):
            answer = str(self.task["answers"][0]) if self.task.get("answers") else None
            if answer is not None and json.dumps(answer, ensure_ascii=False) in _result_header(obs, found[0]):
                return f"Result {found[0]} is titled {json.dumps(answer, ensure_ascii=False)}.\n" + \
                    format_call("answer", {"text": answer})
            return f"Passage {found[0]} looks relevant; I will read it.\n" + format_call("open", {"doc_id": found[0]})
        if obs and obs.startswith("Document "):
            return "The document confirms it.\n" + format_call("answer", {"text": str(self.task["answers"][0])})
        if self.step < len(self.queries):
            q = self.queries[self.step]
            self.step += 1
            return f"I will search for {json.dumps(q)}.\n" + format_call("search", {"query": q, "k": self.k})
        return "I am fairly sure of the answer.\n" + format_call("answer", {"text": str(self.task["answers"][0])})


def _question_keywords(question: str) -> str:
    quoted = question.split('"')
    return quoted[1] if len(quoted) >= 3 else question


def _result_header(observation: str, passage_id: str) -> str:
    """The ``[rank] id (document …)`` line of ``passage_id`` in a search result ("" if absent)."""
    for line in observation.splitlines():
        if line.startswith("[") and "] " in line and line.split("] ", 1)[1].split(" ", 1)[0] == passage_id:
            return line
    return ""


def _result_ids(observation: str) -> list[str]:
    ids = []
    for line in observation.splitlines():
        if line.startswith("[") and "] " in line:
            ids.append(line.split("] ", 1)[1].split(" ", 1)[0])
    return ids


_SYNONYM = {syn: canon for table in (ROLES, OBJECTS, COLOURS) for canon, syns in table.items() for syn in syns}


def _solve_needle(question: str) -> Solver:
    colour_asked = re.match(r"What colour is the (.+?) (?:kept by|that) the (.+?)(?: looks after)?\?$", question)
    if colour_asked:
        obj, role = (_SYNONYM.get(g, g) for g in colour_asked.groups())
        pattern = re.compile(rf"The {role} keeps an? (\w+) {obj}, and its registry number is \d+\.")
        return (yield from _first_match(f"{role} keeps {obj}", pattern))
    m = re.match(r"What is the registry number of the (\w+) (.+?) kept by the (.+)\?$", question) or \
        re.match(r"Which figure is recorded for the (\w+) (.+?) that the (.+) looks after\?$", question)
    colour, obj, role = (_SYNONYM.get(g, g) for g in m.groups())
    pattern = re.compile(rf"The {role} keeps a {colour} {obj}, and its registry number is (\d+)\.")
    return (yield from _first_match(f"{role} {colour} {obj} registry number", pattern))


def _first_match(query: str, pattern: re.Pattern) -> Solver:
    """Ask for ``query``; the first passage ``pattern`` matches gives the answer (its group 1)."""
    passages = yield query
    for pid, text in passages:
        found = pattern.search(text)
        if found:
            return found.group(1), [pid]
    return UNANSWERABLE, []


def _solve_multihop(question: str) -> Solver:
    body = re.sub(r"^(Who is|Which town is|Which river is) ", "", question).rstrip("?")
    rels = []
    while True:
        for rel, (_, _, _, phrase, _) in RELATIONS.items():
            prefix = phrase.format(x="")
            if body.startswith(prefix):
                rels.append(rel)
                body = body[len(prefix):]
                break
        else:
            break
    current, evidence = body, []
    for rel in reversed(rels):
        _, kind, template, _, words = RELATIONS[rel]
        pattern = re.compile(re.escape(template).replace(r"\{a\}", re.escape(current)).replace(r"\{b\}", f"({ENTITY_PATTERN[kind]})"))
        passages = yield f"{current} {words}"
        hit = next(((pid, m.group(1)) for pid, text in passages if (m := pattern.search(text))), None)
        if hit is None:
            return UNANSWERABLE, evidence
        evidence.append(hit[0])
        current = hit[1]
    return current, evidence


def _solve_aggregate(question: str) -> Solver:
    good = re.search(r"barrels of (\w+) were|delivery of (\w+)\?|shipment of (\w+)\?", question)
    good = next(g for g in good.groups() if g)
    pattern = re.compile(rf"Ledger entry: ({ENTITY_PATTERN['person']}) delivered (\d+) barrels of {good} to [A-Z][a-z]+\.")
    passages = yield f"ledger entry delivered barrels of {good}"
    records = [(pid, m.group(1), int(m.group(2))) for pid, text in passages for m in pattern.finditer(text)]
    if not records:
        return UNANSWERABLE, []
    evidence = sorted({pid for pid, _, _ in records})
    if question.startswith("According"):
        return str(sum(n for _, _, n in records)), evidence
    if question.startswith("How many"):
        return str(len(records)), evidence
    return max(records, key=lambda r: r[2])[1], evidence


def _solve_ith(question: str) -> Solver:
    m = re.search(r"mention the (\w+) (\w+)\..* in the (\w+) of those memos", question)
    adj, obj, ordinal = m.groups()
    i = ORDINALS.index(ordinal) + 1
    pattern = re.compile(rf"Memo: the {adj} {obj} was stamped with code (\d+)\.")
    passages = yield f"memo {adj} {obj} stamped code"
    items = sorted((pid, hit.start(), hit.group(1)) for pid, text in passages for hit in pattern.finditer(text))
    if len(items) < i:
        return UNANSWERABLE, sorted({pid for pid, _, _ in items})
    return items[i - 1][2], sorted({pid for pid, _, _ in items[:i]})


SOLVERS = {"needle": _solve_needle, "multihop": _solve_multihop, "aggregate": _solve_aggregate, "ith": _solve_ith}


def solve_in_context(family: str, question: str, passages: Passages) -> tuple[str, list[str]]:
    """Run a family's solver with the whole haystack as the answer to every query."""
    solver = SOLVERS[family](question)
    try:
        next(solver)
        while True:
            solver.send(passages)
    except StopIteration as stop:
        return stop.value


_PASSAGE_LINE = re.compile(r"^\[(p\d{5})\] ", re.M)


def parse_context(prompt: str) -> tuple[str, Passages]:
    """Question and passages back from an in-context prompt."""
    doc = prompt.split("<document>\n", 1)[1].rsplit("\n</document>", 1)[0]
    question = prompt.rsplit("Question: ", 1)[1].split("\n", 1)[0]
    marks = list(_PASSAGE_LINE.finditer(doc))
    passages = [(m.group(1), doc[m.end() : (marks[i + 1].start() - 1 if i + 1 < len(marks) else len(doc))])
                for i, m in enumerate(marks)]
    return question, passages


def parse_results(observation: str) -> Passages:
    """Passage ids and texts back from a ``search`` observation."""
    heads = list(re.finditer(r"^\[\d+\] (\S+)(?: \(document [^\n]*\))?$", observation, re.M))
    return [(h.group(1), observation[h.end() + 1 : (heads[i + 1].start() if i + 1 < len(heads) else len(observation))].strip())
            for i, h in enumerate(heads)]


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
