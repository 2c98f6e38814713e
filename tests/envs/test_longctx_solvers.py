"""Each long-context family's solver reads back what its generator wrote: both are built from the
family's templates (envs/longctx/<family>.py), so an edit of a template that the solver can no
longer follow fails here, and an edit made in the template alone keeps the two in step."""

from __future__ import annotations

import random
import re

import pytest

from k3rl.envs import longctx as L
from k3rl.envs.longctx import aggregate, ith, multihop, needle
from k3rl.envs.longctx.families import SOLVERS
from k3rl.envs.longctx.names import ENTITY_PATTERN, Names

OPTIONS = {
    "needle": [{}, {"paraphrase_rate": 1.0}, {"paraphrase_rate": 0.0}, {"ask": "colour", "distractors": 3},
               {"ask": "colour", "paraphrase_rate": 1.0, "distractors": 0}],
    "multihop": [{}, {"hops": 4}, {"max_hops": 2}],
    "aggregate": [{}],
    "ith": [{}],
}


def test_every_family_is_covered():
    assert set(OPTIONS) == set(L.FAMILIES) == set(SOLVERS)


def _solved(family: str, options: dict, seeds, source: str = "wiki"):
    for seed in seeds:
        inst = L.generate(family, seed, length=2000, source=source, unanswerable_rate=0.2, **options)
        answer, evidence = L.solve_in_context(family, inst.question, inst.passages)
        yield inst, answer, evidence


@pytest.mark.parametrize("family,options", [(f, o) for f, os in OPTIONS.items() for o in os])
def test_solver_gets_the_exact_answer_of_every_instance(family, options):
    """Every answerable instance is solved exactly, citing exactly the evidence passages; every
    unanswerable one is recognised (the answer "unanswerable", the evidence found before the gap)."""
    answerable = 0
    for inst, answer, evidence in _solved(family, options, range(40)):
        assert [answer] == inst.answers, (inst.seed, inst.question)
        assert sorted(evidence) == inst.evidence, (inst.seed, inst.question)
        answerable += not inst.unanswerable
    assert answerable >= 20


@pytest.mark.parametrize("family", list(OPTIONS))
def test_solver_on_the_shakespeare_haystack(family):
    for inst, answer, _ in _solved(family, {}, range(100, 110), source="shakespeare"):
        assert [answer] == inst.answers, (inst.seed, inst.question)


@pytest.mark.parametrize("module,name,template", [
    (needle, "RECORD", "In the register, the {role} owns a {colour} {obj} under number {value}."),
    (needle, "ASK_NUMBER", "Which number belongs to the {colour} {obj} of the {role}?"),
    (needle, "ASK_COLOUR", "Of which colour is the {obj} belonging to the {role}?"),
    (aggregate, "ENTRY", "Ledger: {n} barrels of {good} were {verb} by {merchant} at {town}."),
    (ith, "MEMO", "Memo on the {adj} {obj}: code {code} stamped."),
])
def test_a_template_edit_reaches_the_solver(monkeypatch, module, name, template):
    """The solver's regexes are compiled from the generator's templates when it runs: a reworded
    template is still solved, with no change to the solver."""
    monkeypatch.setattr(module, name, template)
    options = {"ask": "colour"} if name == "ASK_COLOUR" else {"paraphrase_rate": 0.0} if module is needle else {}
    for inst, answer, _ in _solved(module.NAME, options, range(20)):
        assert [answer] == inst.answers, (inst.seed, inst.question)


def test_a_new_relation_reaches_the_multihop_solver(monkeypatch):
    relations = dict(multihop.RELATIONS)
    relations["mayor"] = ("town", "person", "{b} holds the mayoralty of {a}.", "the mayor of {x}", "mayoralty")
    monkeypatch.setattr(multihop, "RELATIONS", relations)
    for inst, answer, _ in _solved("multihop", {"hops": 3}, range(20)):
        assert [answer] == inst.answers, (inst.seed, inst.question)


@pytest.mark.parametrize("kind", list(ENTITY_PATTERN))
def test_invented_names_have_the_shape_solvers_read(kind):
    for seed in range(300):
        name = Names(random.Random(f"{kind}:{seed}"), frozenset()).of(kind)
        assert re.fullmatch(ENTITY_PATTERN[kind], name), name
