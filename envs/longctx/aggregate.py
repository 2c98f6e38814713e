"""The ``aggregate`` family: sum, count or arg-max over scattered ledger entries.

"Ledger entry: Varek Ostrum delivered 42 barrels of saffron to Halbrook." Deliveries of
the asked good are the evidence; "ordered" entries of it and deliveries of other goods
are the near misses. An unanswerable instance has no delivery of the good. The solver
collects every delivery of the good with a regex compiled from ``ENTRY`` and
aggregates as the question (matched against ``QUESTIONS``) asks.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from k3rl.envs.longctx.names import ENTITY_PATTERN, Names
from k3rl.envs.longctx.task import UNANSWERABLE, Fact, Solver, Spec, template_pattern, template_regex

NAME = "aggregate"
SUMMARY = "Long-context aggregation: sum / count / arg-max over scattered ledger entries."
OPTIONS: dict[str, Any] = {}

GOODS = ["saffron", "indigo", "cinnamon", "cloves", "nutmeg", "copper", "tin", "amber", "wool", "silk", "salt", "pepper"]
ENTRY = "Ledger entry: {merchant} {verb} {n} barrels of {good} to {town}."
DELIVERED, ORDERED = "delivered", "ordered"
QUESTIONS = {
    "sum": "According to the ledger entries, how many barrels of {good} were delivered in total?",
    "count": "How many ledger entries record a delivery of {good}?",
    "max": "Which merchant delivered the largest single shipment of {good}?",
}


def generate(rng: random.Random, names: Names, opt: Mapping[str, Any]) -> Spec:
    goods = rng.sample(GOODS, 4)
    good = goods[0]
    unanswerable = rng.random() < opt["unanswerable_rate"]
    kind = rng.choice(list(QUESTIONS))
    towns = [names.of("town") for _ in range(4)]

    def record(verb: str, g: str, n: int, evidence: bool = False) -> tuple[Fact, str]:
        merchant = names.person()
        return Fact(ENTRY.format(merchant=merchant, verb=verb, n=n, good=g, town=rng.choice(towns)), evidence), merchant

    r = 0 if unanswerable else rng.randint(3, 8)
    amounts = rng.sample(range(2, 100), max(r, 1))[:r]
    facts, merchants = [], []
    for n in amounts:
        fact, merchant = record(DELIVERED, good, n, True)
        facts.append(fact)
        merchants.append(merchant)
    facts += [record(ORDERED, good, rng.randint(2, 99))[0] for _ in range(rng.randint(1, 2))]
    for g in goods[1:]:
        facts += [record(DELIVERED, g, rng.randint(2, 99))[0] for _ in range(rng.randint(2, 5))]
    if kind == "sum":
        answer = str(sum(amounts))
    elif kind == "count":
        answer = str(r)
    else:
        answer = merchants[amounts.index(max(amounts))] if amounts else ""
    answers = [UNANSWERABLE] if unanswerable else [answer]
    return Spec(QUESTIONS[kind].format(good=good), answers, facts, 1, unanswerable, meta={"kind": kind, "records": r})


def solve(question: str) -> Solver:
    kind, good = next((k, m.group(1)) for k, template in QUESTIONS.items()
                      if (m := re.fullmatch(template_regex(template, good=r"(\w+)"), question)))
    pattern = template_pattern(ENTRY, merchant=f"(?P<merchant>{ENTITY_PATTERN['person']})", verb=re.escape(DELIVERED),
                               n=r"(?P<n>\d+)", good=re.escape(good), town=ENTITY_PATTERN["town"])
    passages = yield f"ledger entry delivered barrels of {good}"
    records = [(pid, m["merchant"], int(m["n"])) for pid, text in passages for m in pattern.finditer(text)]
    if not records:
        return UNANSWERABLE, []
    evidence = sorted({pid for pid, _, _ in records})
    if kind == "sum":
        return str(sum(n for _, _, n in records)), evidence
    if kind == "count":
        return str(len(records)), evidence
    return max(records, key=lambda r: r[2])[1], evidence
