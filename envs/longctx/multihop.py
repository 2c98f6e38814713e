"""The ``multihop`` family: MuSiQue-style chains of 1–4 hops over invented entities.

"Who is the mayor of the hometown of the mentor of Varek Ostrum?": each hop needs the
previous answer. Branches (another relation of a chain entity), a parallel decoy chain
and a near-namesake sharing the first name are the distractors; an unanswerable chain
misses one link. The solver peels the question's relation phrases off from the left,
then follows the chain from the start entity with regexes compiled from the relations'
fact templates, one query per hop.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from k3rl.envs.longctx.names import ENTITY_PATTERN, Names
from k3rl.envs.longctx.task import UNANSWERABLE, Fact, Solver, Spec, template_pattern, template_regex

NAME = "multihop"
SUMMARY = "Long-context multi-hop chains (1-4 hops) over renamed entities, MuSiQue-style."
OPTIONS = {"hops": None, "max_hops": 4}

# relation: (subject type, object type, fact template, question phrase, search keywords)
RELATIONS = {
    "mentor": ("person", "person", "{a} learned the trade as an apprentice of {b}.", "the mentor of {x}", "apprentice"),
    "hometown": ("person", "town", "{a} was born in the town of {b}.", "the hometown of {x}", "born town"),
    "mayor": ("town", "person", "The mayor of {a} is {b}.", "the mayor of {x}", "mayor"),
    "river": ("town", "river", "The town of {a} lies on the banks of the {b} river.", "the river that flows past {x}", "banks river"),
    "ferry": ("river", "person", "The ferry across the {a} river is run by {b}.", "the ferry keeper of {x}", "ferry river"),
}
_ASK = {"person": "Who is", "town": "Which town is", "river": "Which river is"}
"""How a question opens, by the kind of its answer."""
QUESTION = "{ask} {phrase}?"


def generate(rng: random.Random, names: Names, opt: Mapping[str, Any]) -> Spec:
    hops = opt["hops"] or rng.randint(1, opt["max_hops"])
    unanswerable = rng.random() < opt["unanswerable_rate"]
    start_kind = "person" if rng.random() < 0.7 else "town"

    def walk(kind: str, n: int) -> list[str]:
        rels = []
        for _ in range(n):
            rel = rng.choice([r for r, v in RELATIONS.items() if v[0] == kind])
            rels.append(rel)
            kind = RELATIONS[rel][1]
        return rels

    rels = walk(start_kind, hops)
    chain = [names.of(start_kind)]
    for rel in rels:
        chain.append(names.of(RELATIONS[rel][1]))
    chain_facts = [Fact(RELATIONS[r][2].format(a=chain[i], b=chain[i + 1]), True) for i, r in enumerate(rels)]
    if unanswerable:
        # Break the chain at one hop; the hops before the gap are what an agent must
        # find to conclude that there is no answer, the ones after it are unreachable.
        gap = rng.randrange(hops)
        chain_facts = chain_facts[:gap] + [Fact(f.text) for f in chain_facts[gap + 1 :]]
    facts = list(chain_facts)
    # Branches: another relation of a chain entity, leading elsewhere.
    for i, rel in enumerate(rels):
        kind = RELATIONS[rel][0]
        others = [r for r, v in RELATIONS.items() if v[0] == kind and r != rel]
        if others:
            other = rng.choice(others)
            facts.append(Fact(RELATIONS[other][2].format(a=chain[i], b=names.of(RELATIONS[other][1]))))
    # A parallel chain with the same relations, and a namesake sharing the first name.
    decoy = [names.person(chain[0].split()[0]) if start_kind == "person" else names.of(start_kind)]
    for rel in rels:
        decoy.append(names.of(RELATIONS[rel][1]))
    facts += [Fact(RELATIONS[r][2].format(a=decoy[i], b=decoy[i + 1])) for i, r in enumerate(rels)]
    phrase = chain[0]
    for rel in rels:
        phrase = RELATIONS[rel][3].format(x=phrase)
    question = QUESTION.format(ask=_ASK[RELATIONS[rels[-1]][1]], phrase=phrase)
    answers = [UNANSWERABLE] if unanswerable else [chain[-1]]
    return Spec(question, answers, facts, hops, unanswerable, meta={"relations": rels})


_QUESTION = re.compile(template_regex(QUESTION, ask="(?:" + "|".join(map(re.escape, _ASK.values())) + ")",
                                    phrase="(.*)"), re.S)


def solve(question: str) -> Solver:
    body = _QUESTION.fullmatch(question).group(1)
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
        pattern = template_pattern(template, a=re.escape(current), b=f"({ENTITY_PATTERN[kind]})")
        passages = yield f"{current} {words}"
        hit = next(((pid, m.group(1)) for pid, text in passages if (m := pattern.search(text))), None)
        if hit is None:
            return UNANSWERABLE, evidence
        evidence.append(hit[0])
        current = hit[1]
    return current, evidence
