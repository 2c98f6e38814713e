"""Instances: a family's facts hidden in real text, sized to a token budget, and the in-context prompt.

The haystack is real text (Shakespeare or the Wikipedia summaries) cut into passages
``p00000, p00001, …`` in reading order; facts are inserted at sentence breaks inside
them. ``generate`` sizes the in-context prompt (``render_context``) to at most
``length`` tokens with the tokenizer given (an object with ``encode`` or a counting
callable; the byte estimate if none). The question does not depend on ``length``, so one
seed measured at 4K … 1M gives an effective-length curve. ``parse_context`` reads the
prompt back (what the in-context oracle sees), from the same template.
"""

from __future__ import annotations

import random
import re
from functools import lru_cache
from typing import Any

from k3rl.envs.base import as_token_counter
from k3rl.envs.corpus import chunk_document
from k3rl.envs.longctx.families import DEFAULTS, GENERATORS
from k3rl.envs.longctx.names import Names
from k3rl.envs.longctx.task import Fact, Instance, Passages, template_regex
from k3rl.envs.sources import builtin_documents

PROMPT_CONTEXT = (
    "Below is a long text split into passages with ids, then a question.\n\n<document>\n{document}\n</document>\n\n"
    "Question: {question}\n\nAnswer from the text above. Call `answer` with the answer alone (a name or a number) "
    'and, in `evidence`, the ids of the passages it rests on. If the text does not contain the answer, answer "unanswerable".'
)
LINE = "[{pid}] {text}"
"""One passage of the in-context document."""


@lru_cache(maxsize=4)
def haystack_pool(source: str) -> tuple[str, ...]:
    """Real passages to build haystacks from: ``shakespeare``, ``wiki`` or ``mixed``."""
    if source == "mixed":
        return haystack_pool("shakespeare") + haystack_pool("wiki")
    return tuple(p.text for d in builtin_documents(source) for p in chunk_document(d, 100))


@lru_cache(maxsize=4)
def pool_words(source: str) -> frozenset[str]:
    """The lowercased words of the haystack pool (invented names avoid them)."""
    return frozenset(w for text in haystack_pool(source) for w in re.findall(r"[a-z]+", text.lower()))


def _line(pid: str, text: str) -> str:
    return LINE.format(pid=pid, text=text)


def render_context(instance: Instance) -> str:
    """The in-context prompt: every passage with its id, then the question."""
    document = "\n".join(_line(pid, text) for pid, text in instance.passages)
    return PROMPT_CONTEXT.format(document=document, question=instance.question)


_HEAD, _TAIL = PROMPT_CONTEXT.split("{document}")
_DOC_END, _AFTER = _TAIL.split("{question}")
_PASSAGE_LINE = re.compile("^" + template_regex(LINE, pid=r"(p\d{5})", text=""), re.M)


def parse_context(prompt: str) -> tuple[str, Passages]:
    """Question and passages back from an in-context prompt (``render_context``'s inverse)."""
    doc, _, rest = prompt.partition(_HEAD)[2].rpartition(_DOC_END)
    question = rest.removesuffix(_AFTER)
    marks = list(_PASSAGE_LINE.finditer(doc))
    passages = [(m.group(1), doc[m.end() : (marks[i + 1].start() - 1 if i + 1 < len(marks) else len(doc))])
                for i, m in enumerate(marks)]
    return question, passages


def generate(
    family: str,
    seed: int,
    length: int = 8192,
    source: str = "shakespeare",
    tokenizer: Any = None,
    **options: Any,
) -> Instance:
    """Generate instance ``seed`` of ``family`` whose in-context prompt has at most ``length`` tokens."""
    if family not in GENERATORS:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(GENERATORS)}")
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    opt = {**DEFAULTS, **options}
    count = as_token_counter(tokenizer)
    slack = 0
    for _ in range(4):  # per-passage counts are estimates; a haystack they overfill is rebuilt with less filler
        try:
            return _build(family, seed, length, source, count, opt, slack)
        except _Overflow as e:
            slack += e.excess + 8
    raise ValueError(f"length {length} is too small for this {family} task")


class _Overflow(ValueError):
    def __init__(self, excess: int):
        self.excess = excess


def _build(family: str, seed: int, length: int, source: str, count, opt: dict[str, Any], slack: int) -> Instance:
    """Instance ``seed`` with ``slack`` tokens fewer of filler than the estimates allow; `_Overflow` when the
    rendered prompt is over ``length`` and every passage left holds a fact."""
    rng = random.Random(f"{family}:{seed}")
    spec = GENERATORS[family](rng, Names(rng, pool_words(source)), opt)
    pool = haystack_pool(source)

    fixed = count(PROMPT_CONTEXT.format(document="", question=spec.question))
    fact_tokens = sum(count(" " + f.text) for f in spec.facts)
    budget = length - fixed - fact_tokens - slack
    start = rng.randrange(len(pool))
    chosen: list[str] = []
    costs: list[int] = []
    total = 0
    for k in range(len(pool)):
        text = pool[(start + k) % len(pool)]
        c = count(_line("p00000", text)) + 1
        if total + c > budget:
            if chosen:
                break
            continue  # the starting passage alone overflows a short cell: the haystack starts at the next that fits
        chosen.append(text)
        costs.append(c)
        total += c
    else:
        if chosen:
            raise ValueError(f"source {source!r} has fewer than {length} tokens of text; use a smaller length or "
                             f"source='mixed'")
    if not chosen:
        raise ValueError(f"length {length} is too small for a {family} task with {len(spec.facts)} facts")

    # Facts go into passages at seeded depths (distinct passages when there are enough);
    # facts sharing a passage are inserted together, so the order of the list is kept.
    n_facts = len(spec.facts)
    if n_facts <= len(chosen):
        slots = sorted(rng.sample(range(len(chosen)), n_facts))
    else:
        slots = sorted(rng.choices(range(len(chosen)), k=n_facts))
    facts = spec.facts if spec.ordered else rng.sample(spec.facts, n_facts)
    groups: dict[int, list[Fact]] = {}
    for slot, fact in zip(slots, facts):
        groups.setdefault(slot, []).append(fact)
    for slot, group in groups.items():
        chosen[slot] = _insert(rng, chosen[slot], " ".join(f.text for f in group))
    evidence_slots = sorted({slot for slot, fact in zip(slots, facts) if fact.evidence})
    passages = [(f"p{i:05d}", text) for i, text in enumerate(chosen)]
    instance = Instance(family, seed, spec.question, spec.answers, passages,
                        [passages[s][0] for s in sorted(evidence_slots)], spec.hops, spec.unanswerable, dict(spec.meta))
    # The per-passage counts are estimates (tokens can merge across joins): trim until it fits.
    used = set(slots)
    while (n := count(render_context(instance))) > length:
        excess, removed = n - length, set()
        for i in range(len(chosen) - 1, -1, -1):
            if excess <= 0:
                break
            if i not in used:
                removed.add(i)
                excess -= costs[i]
        if not removed:
            raise _Overflow(n - length)
        keep = [i for i in range(len(chosen)) if i not in removed]
        remap = {old: new for new, old in enumerate(keep)}
        chosen, costs = [chosen[i] for i in keep], [costs[i] for i in keep]
        used = {remap[s] for s in used}
        evidence_slots = [remap[s] for s in evidence_slots]
        instance.passages = [(f"p{i:05d}", text) for i, text in enumerate(chosen)]
        instance.evidence = [instance.passages[s][0] for s in sorted(evidence_slots)]
    instance.meta.update({"tokens": n, "length": length, "source": source})
    return instance


def _insert(rng: random.Random, text: str, fact: str) -> str:
    """Insert ``fact`` at a sentence or line break of ``text`` (or at its end)."""
    breaks = [m.end() for m in re.finditer(r"[.!?;:]\s+|\n", text)]
    if not breaks:
        return f"{text} {fact}"
    at = rng.choice(breaks)
    before, after = text[:at].rstrip(), text[at:].lstrip()
    sep = "\n" if "\n" in text[max(0, at - 2) : at + 1] else " "
    return f"{before}{sep}{fact}{sep}{after}" if after else f"{before}{sep}{fact}"
