"""The ``needle`` family: find one record among near misses (RULER-style, NoLiMa paraphrases).

A record reads "The gardener keeps a red lantern, and its registry number is 4821734.";
the distractors are records that differ in one of the three key words. A share of the
questions (``paraphrase_rate``) names the key by synonyms only ("the scarlet lamp that
the groundskeeper looks after"), so literal overlap does not find it. ``ask="colour"``
asks for the colour instead ("What colour is the lantern kept by the gardener?"; near
misses then differ in the keeper or the object): an answer from a closed set of ten
words, the quickstart's task.

The solver maps the question's words back through the synonym tables and reads the
record with a regex compiled from ``RECORD``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from k3rl.envs.longctx.names import Names
from k3rl.envs.longctx.task import UNANSWERABLE, Fact, Solver, Spec, template_pattern, template_regex

NAME = "needle"
SUMMARY = "Long-context needle retrieval: literal vs paraphrased keys, near-miss distractors."
OPTIONS = {"paraphrase_rate": 0.5, "distractors": 4, "ask": "number"}

# canonical word: its synonyms (the first is the one paraphrased questions use)
ROLES = {
    "gardener": ["groundskeeper"], "blacksmith": ["ironworker"], "baker": ["bread maker"], "physician": ["doctor"],
    "sailor": ["mariner"], "carpenter": ["woodworker"], "shepherd": ["herdsman"], "librarian": ["keeper of books"],
    "innkeeper": ["tavern host"], "weaver": ["cloth maker"], "miller": ["grain grinder"], "fisherman": ["angler"],
}
OBJECTS = {
    "lantern": ["lamp"], "chest": ["coffer"], "cloak": ["mantle"], "flask": ["bottle"], "mirror": ["looking glass"],
    "ledger": ["account book"], "satchel": ["shoulder bag"], "goblet": ["chalice"], "shield": ["buckler"],
    "quill": ["feather pen"], "rug": ["carpet"], "bell": ["chime"],
}
COLOURS = {
    "red": ["scarlet"], "blue": ["azure"], "green": ["emerald"], "yellow": ["golden"], "white": ["ivory"],
    "black": ["ebony"], "grey": ["ashen"], "purple": ["violet"], "brown": ["russet"], "orange": ["tangerine"],
}
CANONICAL = {syn: canon for table in (ROLES, OBJECTS, COLOURS) for canon, syns in table.items() for syn in syns}
"""Synonym → canonical word, over the three tables."""

RECORD = "The {role} keeps a {colour} {obj}, and its registry number is {value}."
ASK_NUMBER = "What is the registry number of the {colour} {obj} kept by the {role}?"
ASK_NUMBER_PARAPHRASE = "Which figure is recorded for the {colour} {obj} that the {role} looks after?"
ASK_COLOUR = "What colour is the {obj} kept by the {role}?"
ASK_COLOUR_PARAPHRASE = "What colour is the {obj} that the {role} looks after?"


def _record(role: str, obj: str, colour: str, value: int) -> str:
    return RECORD.format(role=role, colour=colour, obj=obj, value=value)


def generate(rng: random.Random, names: Names, opt: Mapping[str, Any]) -> Spec:
    role, obj, colour = rng.choice(list(ROLES)), rng.choice(list(OBJECTS)), rng.choice(list(COLOURS))
    paraphrase = rng.random() < opt["paraphrase_rate"]
    unanswerable = rng.random() < opt["unanswerable_rate"]
    if opt["ask"] not in ("number", "colour"):
        raise ValueError(f"ask: 'number' or 'colour', got {opt['ask']!r}")
    colour_asked = opt["ask"] == "colour"
    values = rng.sample(range(1_000_000, 9_999_999), 1 + opt["distractors"])
    keys = {(role, obj, colour)}
    facts = [] if unanswerable else [Fact(_record(role, obj, colour, values[0]), True)]
    tables = {0: list(ROLES), 1: list(OBJECTS), 2: list(COLOURS)}
    # asked for the colour, a near miss differs in the keeper or the object: never only in the colour
    slots = 2 if colour_asked else 3
    if colour_asked and opt["distractors"] > len(ROLES) + len(OBJECTS) - 2:
        raise ValueError(f"distractors: at most {len(ROLES) + len(OBJECTS) - 2} when ask='colour'")
    while len(keys) < 1 + opt["distractors"]:
        key = [role, obj, rng.choice(list(COLOURS)) if colour_asked else colour]
        slot = rng.randrange(slots)
        key[slot] = rng.choice([v for v in tables[slot] if v != key[slot]])
        if tuple(key) not in keys and not (colour_asked and key[:2] == [role, obj]):
            keys.add(tuple(key))
            facts.append(Fact(_record(*key, values[len(keys) - 1])))
    meta = {"paraphrase": paraphrase}
    if colour_asked:
        question = (ASK_COLOUR_PARAPHRASE.format(obj=OBJECTS[obj][0], role=ROLES[role][0]) if paraphrase
                    else ASK_COLOUR.format(obj=obj, role=role))
        return Spec(question, [UNANSWERABLE] if unanswerable else [colour], facts, 1, unanswerable, meta=meta)
    if paraphrase:
        question = ASK_NUMBER_PARAPHRASE.format(colour=COLOURS[colour][0], obj=OBJECTS[obj][0], role=ROLES[role][0])
    else:
        question = ASK_NUMBER.format(colour=colour, obj=obj, role=role)
    return Spec(question, [UNANSWERABLE] if unanswerable else [str(values[0])], facts, 1, unanswerable, meta=meta)


def _parse(templates: tuple[str, ...], question: str, **fields: str) -> dict[str, str] | None:
    """The canonical key words of ``question`` if one of ``templates`` (with ``fields``) matches it."""
    for template in templates:
        m = re.fullmatch(template_regex(template, **fields), question)
        if m:
            return {k: CANONICAL.get(v, v) for k, v in m.groupdict().items()}
    return None


def solve(question: str) -> Solver:
    key = _parse((ASK_COLOUR, ASK_COLOUR_PARAPHRASE), question, obj=r"(?P<obj>.+?)", role=r"(?P<role>.+?)")
    if key is not None:
        role, obj = key["role"], key["obj"]
        pattern = template_pattern(RECORD, role=re.escape(role), colour=r"(\w+)", obj=re.escape(obj), value=r"\d+")
        return (yield from _first_match(f"{role} keeps {obj}", pattern))
    key = _parse((ASK_NUMBER, ASK_NUMBER_PARAPHRASE), question,
                 colour=r"(?P<colour>\w+)", obj=r"(?P<obj>.+?)", role=r"(?P<role>.+)")
    role, obj, colour = key["role"], key["obj"], key["colour"]
    pattern = template_pattern(RECORD, role=re.escape(role), colour=re.escape(colour), obj=re.escape(obj),
                               value=r"(\d+)")
    return (yield from _first_match(f"{role} {colour} {obj} registry number", pattern))


def _first_match(query: str, pattern: re.Pattern) -> Solver:
    """Ask for ``query``; the first passage ``pattern`` matches gives the answer (its group 1)."""
    passages = yield query
    for pid, text in passages:
        found = pattern.search(text)
        if found:
            return found.group(1), [pid]
    return UNANSWERABLE, []
