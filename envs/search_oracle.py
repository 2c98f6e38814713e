"""The search environment's oracle and the parsers of ``search`` observations.

``SearchOracle`` plays a ``SearchEnv`` task through the same text protocol a model uses
(its turns are SFT demonstrations; running it over generated tasks shows they are
solvable). ``parse_results`` reads a ``search`` observation back into passages, for any
policy that reads results (the long-context search oracle in envs/longctx/oracles.py).

Imports only the protocol (envs/base.py, envs/tools.py), so envs/search.py and
envs/longctx/ can both depend on it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from k3rl.envs.base import last_observation
from k3rl.envs.tools import format_call


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


def parse_results(observation: str) -> list[tuple[str, str]]:
    """``(passage id, text)`` of each result of a ``search`` observation, in rank order."""
    heads = list(re.finditer(r"^\[\d+\] (\S+)(?: \(document [^\n]*\))?$", observation, re.M))
    return [(h.group(1), observation[h.end() + 1 : (heads[i + 1].start() if i + 1 < len(heads) else len(observation))].strip())
            for i, h in enumerate(heads)]
