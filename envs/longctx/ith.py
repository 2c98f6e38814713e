"""The ``ith`` family: the i-th of m near-identical memos (MRCR-style order tracking).

"Memo: the copper gate was stamped with code 4821." appears m times (3–8) with
different codes, interleaved with memos about other adjective/object pairs; the
question asks for the code of the i-th, counting from the start of the text (i > m when
unanswerable). The facts keep their order in the haystack (``Spec.ordered``). The
solver reads the memos with a regex compiled from ``MEMO`` and counts in reading order.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from k3rl.envs.longctx.names import Names
from k3rl.envs.longctx.task import UNANSWERABLE, Fact, Solver, Spec, template_pattern, template_regex

NAME = "ith"
SUMMARY = "Long-context order tracking: the i-th of m near-identical memos (MRCR-style)."
OPTIONS: dict[str, Any] = {}

MEMO_ADJ = ["copper", "velvet", "silent", "northern", "crooked", "hollow", "painted", "gilded", "sunken", "broken"]
MEMO_OBJ = ["gate", "barrel", "bridge", "tower", "carriage", "anchor", "well", "mill", "organ", "clock"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"]
MEMO = "Memo: the {adj} {obj} was stamped with code {code}."
QUESTION = ("Several memos mention the {adj} {obj}. Counting from the start of the text, "
            "what code was stamped in the {ordinal} of those memos?")


def generate(rng: random.Random, names: Names, opt: Mapping[str, Any]) -> Spec:
    adj, obj = rng.choice(MEMO_ADJ), rng.choice(MEMO_OBJ)
    m = rng.randint(3, 8)
    unanswerable = rng.random() < opt["unanswerable_rate"]
    i = rng.randint(m + 1, min(m + 2, len(ORDINALS))) if unanswerable else rng.randint(1, m)
    codes = rng.sample(range(1000, 9999), 2 * m + 4)
    items = [Fact(MEMO.format(adj=adj, obj=obj, code=codes[j]), j < i) for j in range(m)]
    decoys = []
    for j in range(m + rng.randint(1, 4)):
        other = (rng.choice([a for a in MEMO_ADJ if a != adj]), obj) if j % 2 else (adj, rng.choice([o for o in MEMO_OBJ if o != obj]))
        decoys.append(Fact(MEMO.format(adj=other[0], obj=other[1], code=codes[m + j])))
    # Interleave the decoys while keeping the items in order.
    facts = list(items)
    for d in decoys:
        facts.insert(rng.randint(0, len(facts)), d)
    question = QUESTION.format(adj=adj, obj=obj, ordinal=ORDINALS[i - 1])
    answers = [UNANSWERABLE] if unanswerable else [str(codes[i - 1])]
    return Spec(question, answers, facts, 1, unanswerable, ordered=True, meta={"m": m, "i": i})


_QUESTION = re.compile(template_regex(QUESTION, adj=r"(\w+)", obj=r"(\w+)", ordinal=r"(\w+)"))


def solve(question: str) -> Solver:
    adj, obj, ordinal = _QUESTION.fullmatch(question).groups()
    i = ORDINALS.index(ordinal) + 1
    pattern = template_pattern(MEMO, adj=re.escape(adj), obj=re.escape(obj), code=r"(\d+)")
    passages = yield f"memo {adj} {obj} stamped code"
    items = sorted((pid, hit.start(), hit.group(1)) for pid, text in passages for hit in pattern.finditer(text))
    if len(items) < i:
        return UNANSWERABLE, sorted({pid for pid, _, _ in items})
    return items[i - 1][2], sorted({pid for pid, _, _ in items[:i]})
