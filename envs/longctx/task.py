"""What every long-context family shares: the task types and the template-to-regex rule.

A family module (needle.py, multihop.py, aggregate.py, ith.py) writes its facts and
questions from format templates and turns a question into a ``Spec``; haystack.py
places the facts in real text and makes the ``Instance``. The family's solver reads the
text back with regexes compiled from the same templates (``template_regex``), so a
template edit changes generator and solver together.
"""

from __future__ import annotations

import re
import string
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

UNANSWERABLE = "unanswerable"
"""The gold answer of an instance whose text does not hold the answer."""

Passages = list[tuple[str, str]]
"""A haystack, or what a query returned: ``(passage id, text)`` in reading order."""

Solver = Generator[str, Passages, tuple[str, list[str]]]
"""A family's solver: yields queries, is sent the passages each returns, returns ``(answer, evidence ids)``."""


@dataclass
class Fact:
    """A sentence to insert; ``evidence`` marks the ones the answer rests on."""

    text: str
    evidence: bool = False


@dataclass
class Spec:
    """What a family's generator makes: the question, its answers and the facts to hide."""

    question: str
    answers: list[str]
    facts: list[Fact]
    hops: int
    unanswerable: bool
    ordered: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Instance:
    """One generated task, with its haystack in reading order."""

    family: str
    seed: int
    question: str
    answers: list[str]
    passages: Passages
    evidence: list[str]
    hops: int
    unanswerable: bool
    meta: dict[str, Any] = field(default_factory=dict)

    def evidence_depths(self) -> list[float]:
        """Where each evidence passage sits in the haystack, in reading order: its index over the last index, in
        [0, 1] (0 = the first passage). One per evidence passage (a multihop chain: one per hop it found room
        for); empty when the instance has none (an unanswerable needle)."""
        index = {pid: i for i, (pid, _) in enumerate(self.passages)}
        last = max(1, len(self.passages) - 1)
        return sorted(index[e] / last for e in self.evidence if e in index)

    def search_task(self) -> dict[str, Any]:
        """The instance as a ``SearchEnv`` task (the haystack becomes the corpus)."""
        return {
            "question": self.question, "answers": self.answers, "evidence": self.evidence, "hops": self.hops,
            "passages": [{"id": pid, "text": text} for pid, text in self.passages],
        }


def template_regex(template: str, **fields: str) -> str:
    """``template`` (a ``str.format`` template) as a regular expression: its literal text
    escaped, each ``{name}`` replaced by the regex ``fields[name]``."""
    parts = []
    for literal, name, _, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if name is not None:
            parts.append(fields[name])
    return "".join(parts)


def template_pattern(template: str, **fields: str) -> re.Pattern:
    """``template_regex`` compiled."""
    return re.compile(template_regex(template, **fields))
