"""Long-context evidence-retrieval tasks: seeded generators, two ways of serving, oracles.

Families (each instance is a pure function of ``(family, seed, options)``):

- ``needle``: RULER-style records "The gardener keeps a red lantern, and its registry
  number is 4821734." among near-miss distractors that differ in one of the three key
  words. Half the questions (``paraphrase_rate``) name the key with synonyms only
  ("the scarlet lamp that the groundskeeper looks after"), NoLiMa-style, so literal
  overlap does not find it. ``ask="colour"`` asks for the colour instead ("What colour is
  the lantern kept by the gardener?"; near misses then differ in the keeper or the object):
  an answer from a closed set of ten words, the quickstart's task.
- ``multihop``: MuSiQue-style chains of 1–4 hops over invented people, towns and rivers
  ("Who is the mayor of the hometown of the mentor of Varek Ostrum?"); each hop needs the
  previous answer; branches, a parallel decoy chain and a near-namesake are distractors.
  Names are generated from syllables and checked absent from the haystack, so answers
  cannot be memorised.
- ``aggregate``: ledger entries scattered through the text; sum, count or arg-max over
  the deliveries of one good, with "ordered" entries as near-misses.
- ``ith``: m near-identical memos about the same object; "what code was stamped in the
  i-th of them?" (MRCR-style order tracking).

A share of every family (``unanswerable_rate``) has no answer in the text (a missing
link, an absent key, i > m); the gold answer is then "unanswerable".

The haystack is real text (Shakespeare or the Wikipedia summaries) cut into passages
``p00000, p00001, …`` in reading order; facts are inserted at sentence breaks inside
them. Serving: **in context** (``serve="context"``) puts the whole haystack in the prompt,
sized to ``length`` tokens with the tokenizer given (an object with ``encode`` or a
counting callable; the byte estimate if none); **behind search** (``serve="search"``)
makes the same passages the corpus of a ``SearchEnv``. The question is independent of
``length``, so one seed measured at 4K … 1M gives an effective-length curve.

The oracles that solve these tasks through the tool protocol are in ``envs/oracles.py``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Mapping

from envs import scoring
from envs.base import Env, Policy, as_token_counter
from envs.corpus import chunk_document
from envs.registry import register
from envs.search import SearchEnv
from envs.sources import builtin_documents
from envs.tools import tool

UNANSWERABLE = "unanswerable"
FAMILIES = {
    "needle": "Long-context needle retrieval: literal vs paraphrased keys, near-miss distractors.",
    "multihop": "Long-context multi-hop chains (1-4 hops) over renamed entities, MuSiQue-style.",
    "aggregate": "Long-context aggregation: sum / count / arg-max over scattered ledger entries.",
    "ith": "Long-context order tracking: the i-th of m near-identical memos (MRCR-style).",
}
Passages = list[tuple[str, str]]


@dataclass
class Fact:
    """A sentence to insert; ``evidence`` marks the ones the answer rests on."""

    text: str
    evidence: bool = False


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

    def search_task(self) -> dict[str, Any]:
        """The instance as a ``SearchEnv`` task (the haystack becomes the corpus)."""
        return {
            "question": self.question, "answers": self.answers, "evidence": self.evidence, "hops": self.hops,
            "passages": [{"id": pid, "text": text} for pid, text in self.passages],
        }


_FIRST = (["Va", "Re", "Ko", "Li", "Sa", "To", "Mi", "Ela", "Bra", "Qui", "Ze", "Ul", "Ori", "Fe", "Da", "Ca", "Ny", "Ile"],
          ["rek", "na", "vin", "los", "dra", "mir", "tel", "wen", "rik", "sa", "dor", "lis", "vo", "ther"])
_LAST = (["Ost", "Hal", "Brin", "Mor", "Kel", "Thal", "Ves", "Cor", "Dun", "Ash", "Wyn", "Grel", "Pell", "Orm"],
         ["rum", "wick", "dane", "more", "holt", "ley", "ford", "by", "gard", "mere", "ton", "sley", "vane", "crest"])
_TOWN = (["Hal", "Ost", "Bel", "Cor", "Dray", "Elm", "Fal", "Grim", "Ket", "Lor", "Mar", "Norr", "Pem", "Sul"],
         ["brook", "mere", "stead", "wick", "ford", "hollow", "gate", "crest", "moor", "fold"])
_RIVER = (["Ash", "Sil", "Brae", "Cold", "Fen", "Lum", "Mire", "Tal", "Ver", "Wend"],
          ["water", "run", "flow", "beck", "wash", "rill", "spring", "burn"])

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
GOODS = ["saffron", "indigo", "cinnamon", "cloves", "nutmeg", "copper", "tin", "amber", "wool", "silk", "salt", "pepper"]
MEMO_ADJ = ["copper", "velvet", "silent", "northern", "crooked", "hollow", "painted", "gilded", "sunken", "broken"]
MEMO_OBJ = ["gate", "barrel", "bridge", "tower", "carriage", "anchor", "well", "mill", "organ", "clock"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"]

# relation: (subject type, object type, fact template, question phrase, search keywords)
RELATIONS = {
    "mentor": ("person", "person", "{a} learned the trade as an apprentice of {b}.", "the mentor of {x}", "apprentice"),
    "hometown": ("person", "town", "{a} was born in the town of {b}.", "the hometown of {x}", "born town"),
    "mayor": ("town", "person", "The mayor of {a} is {b}.", "the mayor of {x}", "mayor"),
    "river": ("town", "river", "The town of {a} lies on the banks of the {b} river.", "the river that flows past {x}", "banks river"),
    "ferry": ("river", "person", "The ferry across the {a} river is run by {b}.", "the ferry keeper of {x}", "ferry river"),
}
ENTITY_PATTERN = {"person": r"[A-Z][a-z]+ [A-Z][a-z]+", "town": r"[A-Z][a-z]+", "river": r"[A-Z][a-z]+"}
_ASK = {"person": "Who is", "town": "Which town is", "river": "Which river is"}


class _Names:
    """Fresh invented names, never reused within an instance, never words of the haystack."""

    def __init__(self, rng: random.Random, banned: frozenset[str]):
        self.rng, self.banned, self.used = rng, banned, set()

    def _fresh(self, make: Callable[[], str]) -> str:
        for _ in range(1000):
            name = make()
            if name not in self.used and not any(w.lower() in self.banned for w in name.split()):
                self.used.add(name)
                return name
        raise RuntimeError("ran out of invented names")

    def _word(self, parts: tuple[list[str], list[str]]) -> str:
        return self.rng.choice(parts[0]) + self.rng.choice(parts[1])

    def person(self, first: str | None = None) -> str:
        return self._fresh(lambda: f"{first or self._word(_FIRST)} {self._word(_LAST)}")

    def of(self, kind: str) -> str:
        if kind == "person":
            return self.person()
        return self._fresh(lambda: self._word(_TOWN if kind == "town" else _RIVER))


@dataclass
class _Spec:
    question: str
    answers: list[str]
    facts: list[Fact]
    hops: int
    unanswerable: bool
    ordered: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


def _needle(rng: random.Random, names: _Names, opt: Mapping[str, Any]) -> _Spec:
    role, obj, colour = rng.choice(list(ROLES)), rng.choice(list(OBJECTS)), rng.choice(list(COLOURS))
    paraphrase = rng.random() < opt["paraphrase_rate"]
    unanswerable = rng.random() < opt["unanswerable_rate"]
    if opt["ask"] not in ("number", "colour"):
        raise ValueError(f"ask: 'number' or 'colour', got {opt['ask']!r}")
    colour_asked = opt["ask"] == "colour"
    values = rng.sample(range(1_000_000, 9_999_999), 1 + opt["distractors"])
    keys = {(role, obj, colour)}
    facts = [] if unanswerable else [Fact(_needle_text(role, obj, colour, values[0]), True)]
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
            facts.append(Fact(_needle_text(*key, values[len(keys) - 1])))
    if colour_asked:
        question = (f"What colour is the {OBJECTS[obj][0]} that the {ROLES[role][0]} looks after?" if paraphrase
                    else f"What colour is the {obj} kept by the {role}?")
        answers = [UNANSWERABLE] if unanswerable else [colour]
        return _Spec(question, answers, facts, 1, unanswerable, meta={"paraphrase": paraphrase})
    if paraphrase:
        question = (f"Which figure is recorded for the {COLOURS[colour][0]} {OBJECTS[obj][0]} "
                    f"that the {ROLES[role][0]} looks after?")
    else:
        question = f"What is the registry number of the {colour} {obj} kept by the {role}?"
    answers = [UNANSWERABLE] if unanswerable else [str(values[0])]
    return _Spec(question, answers, facts, 1, unanswerable, meta={"paraphrase": paraphrase})


def _needle_text(role: str, obj: str, colour: str, value: int) -> str:
    return f"The {role} keeps a {colour} {obj}, and its registry number is {value}."


def _multihop(rng: random.Random, names: _Names, opt: Mapping[str, Any]) -> _Spec:
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
    question = f"{_ASK[RELATIONS[rels[-1]][1]]} {phrase}?"
    answers = [UNANSWERABLE] if unanswerable else [chain[-1]]
    return _Spec(question, answers, facts, hops, unanswerable, meta={"relations": rels})


def _aggregate(rng: random.Random, names: _Names, opt: Mapping[str, Any]) -> _Spec:
    goods = rng.sample(GOODS, 4)
    good = goods[0]
    unanswerable = rng.random() < opt["unanswerable_rate"]
    kind = rng.choice(["sum", "count", "max"])
    towns = [names.of("town") for _ in range(4)]

    def record(verb: str, g: str, n: int, evidence: bool = False) -> tuple[Fact, str]:
        merchant = names.person()
        return Fact(f"Ledger entry: {merchant} {verb} {n} barrels of {g} to {rng.choice(towns)}.", evidence), merchant

    r = 0 if unanswerable else rng.randint(3, 8)
    amounts = rng.sample(range(2, 100), max(r, 1))[:r]
    facts, merchants = [], []
    for n in amounts:
        fact, merchant = record("delivered", good, n, True)
        facts.append(fact)
        merchants.append(merchant)
    facts += [record("ordered", good, rng.randint(2, 99))[0] for _ in range(rng.randint(1, 2))]
    for g in goods[1:]:
        facts += [record("delivered", g, rng.randint(2, 99))[0] for _ in range(rng.randint(2, 5))]
    if kind == "sum":
        question, answer = f"According to the ledger entries, how many barrels of {good} were delivered in total?", str(sum(amounts))
    elif kind == "count":
        question, answer = f"How many ledger entries record a delivery of {good}?", str(r)
    else:
        question = f"Which merchant delivered the largest single shipment of {good}?"
        answer = merchants[amounts.index(max(amounts))] if amounts else ""
    answers = [UNANSWERABLE] if unanswerable else [answer]
    return _Spec(question, answers, facts, 1, unanswerable, meta={"kind": kind, "records": r})


def _ith(rng: random.Random, names: _Names, opt: Mapping[str, Any]) -> _Spec:
    adj, obj = rng.choice(MEMO_ADJ), rng.choice(MEMO_OBJ)
    m = rng.randint(3, 8)
    unanswerable = rng.random() < opt["unanswerable_rate"]
    i = rng.randint(m + 1, min(m + 2, len(ORDINALS))) if unanswerable else rng.randint(1, m)
    codes = rng.sample(range(1000, 9999), 2 * m + 4)
    items = [Fact(f"Memo: the {adj} {obj} was stamped with code {codes[j]}.", j < i) for j in range(m)]
    decoys = []
    for j in range(m + rng.randint(1, 4)):
        other = (rng.choice([a for a in MEMO_ADJ if a != adj]), obj) if j % 2 else (adj, rng.choice([o for o in MEMO_OBJ if o != obj]))
        decoys.append(Fact(f"Memo: the {other[0]} {other[1]} was stamped with code {codes[m + j]}."))
    # Interleave the decoys while keeping the items in order.
    facts = list(items)
    for d in decoys:
        facts.insert(rng.randint(0, len(facts)), d)
    question = (f"Several memos mention the {adj} {obj}. Counting from the start of the text, "
                f"what code was stamped in the {ORDINALS[i - 1]} of those memos?")
    answers = [UNANSWERABLE] if unanswerable else [str(codes[i - 1])]
    return _Spec(question, answers, facts, 1, unanswerable, ordered=True, meta={"m": m, "i": i})


GENERATORS = {"needle": _needle, "multihop": _multihop, "aggregate": _aggregate, "ith": _ith}
DEFAULTS = {"paraphrase_rate": 0.5, "unanswerable_rate": 0.1, "distractors": 4, "hops": None, "max_hops": 4,
            "ask": "number"}


@lru_cache(maxsize=4)
def haystack_pool(source: str) -> tuple[str, ...]:
    """Real passages to build haystacks from: ``shakespeare``, ``wiki`` or ``mixed``."""
    if source == "mixed":
        return haystack_pool("shakespeare") + haystack_pool("wiki")
    return tuple(p.text for d in builtin_documents(source) for p in chunk_document(d, 100))


@lru_cache(maxsize=4)
def _pool_words(source: str) -> frozenset[str]:
    return frozenset(w for text in haystack_pool(source) for w in re.findall(r"[a-z]+", text.lower()))


PROMPT_CONTEXT = (
    "Below is a long text split into passages with ids, then a question.\n\n<document>\n{document}\n</document>\n\n"
    "Question: {question}\n\nAnswer from the text above. Call `answer` with the answer alone (a name or a number) "
    'and, in `evidence`, the ids of the passages it rests on. If the text does not contain the answer, answer "unanswerable".'
)
PROMPT_SEARCH = (
    "The collection is one long text split into passages whose ids (p00000, p00001, ...) "
    "follow the order of the text. Search it to answer, then call `answer` with the answer alone (a name or a number). "
    'If the collection does not contain the answer, answer "unanswerable".\n\nQuestion: {question}'
)

PROMPT_SEARCH_MINIMAL = 'Search the passages, then answer with the answer alone (or "unanswerable").\n\nQuestion: {question}'
"""The search prompt of `tool_prompt="minimal"`: the task without the prose."""


def _line(pid: str, text: str) -> str:
    return f"[{pid}] {text}"


def render_context(instance: Instance) -> str:
    """The in-context prompt: every passage with its id, then the question."""
    document = "\n".join(_line(pid, text) for pid, text in instance.passages)
    return PROMPT_CONTEXT.format(document=document, question=instance.question)


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
    rng = random.Random(f"{family}:{seed}")
    spec = GENERATORS[family](rng, _Names(rng, _pool_words(source)), opt)
    pool = haystack_pool(source)

    fixed = count(PROMPT_CONTEXT.format(document="", question=spec.question))
    fact_tokens = sum(count(" " + f.text) for f in spec.facts)
    budget = length - fixed - fact_tokens
    start = rng.randrange(len(pool))
    chosen: list[str] = []
    costs: list[int] = []
    total = 0
    for k in range(len(pool)):
        text = pool[(start + k) % len(pool)]
        c = count(_line("p00000", text)) + 1
        if total + c > budget:
            break
        chosen.append(text)
        costs.append(c)
        total += c
    else:
        raise ValueError(f"source {source!r} has fewer than {length} tokens of text; use a smaller length or source='mixed'")
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
            raise ValueError(f"length {length} is too small for this {family} task")
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


class _FamilyTasks:
    """Task sampling shared by both servings: a task is ``{"family", "seed"}`` plus overrides."""

    family: str

    def tasks(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        rng = random.Random(f"tasks:{self.family}:{seed}")
        return [{"family": self.family, "seed": rng.randrange(2**31)} for _ in range(n)]

    def instance(self, task: Mapping[str, Any]) -> Instance:
        options = {**self.options, **{k: v for k, v in task.items() if k in DEFAULTS}}
        return generate(task.get("family", self.family), int(task["seed"]), int(task.get("length", self.length)),
                        task.get("source", self.source), self.tokenizer, **options)


class LongContextEnv(_FamilyTasks, Env):
    """A long-context family served in context: the haystack is in the prompt; one tool, ``answer``."""

    success_metric = "em"

    system_prompt = "You answer questions about a long text given in the user message."

    def __init__(self, family: str = "needle", length: int = 8192, source: str = "shakespeare",
                 tokenizer: Any = None, evidence_weight: float = 0.0, **options: Any):
        self.family, self.length, self.source, self.tokenizer = family, length, source, tokenizer
        self.evidence_weight, self.options = evidence_weight, options

    def reset(self, task: Mapping[str, Any]) -> str:
        self.current = self.instance(task)
        self.final: str | None = None
        self.cited: list[str] = []
        return render_context(self.current)

    @tool(terminal=True)
    def answer(self, text: str, evidence: list[str] | None = None) -> str:
        """Give the final answer and end the episode.

        Args:
            text: the answer alone (a name or a number), or "unanswerable".
            evidence: ids of the passages the answer rests on, e.g. ["p00042"].
        """
        self.final, self.cited = text, list(evidence or [])
        return "Answer recorded."

    def metrics(self) -> dict[str, Any]:
        inst = self.current
        return {
            "family": inst.family, "hops": inst.hops, "unanswerable": inst.unanswerable, "tokens": inst.meta["tokens"],
            "answered": self.final is not None,
            "em": scoring.exact_match(self.final, inst.answers), "f1": scoring.f1(self.final, inst.answers),
            "evidence_recall": scoring.evidence_recall(self.cited, inst.evidence),
        }

    def reward(self) -> float:
        if self.final is None:
            return 0.0
        w = self.evidence_weight
        return (1 - w) * scoring.f1(self.final, self.current.answers) + w * scoring.evidence_recall(self.cited, self.current.evidence)

    def oracle(self, task: Mapping[str, Any]) -> Policy:
        from envs.oracles import ContextOracle

        return ContextOracle(task.get("family", self.family))


class LongContextSearchEnv(_FamilyTasks, SearchEnv):
    """A long-context family served behind search: the haystack is the corpus of ``search``/``open``."""

    def __init__(self, family: str = "needle", length: int = 8192, source: str = "shakespeare",
                 tokenizer: Any = None, max_k: int = 20, evidence_weight: float = 0.1, oracle_k: int | None = None,
                 snippet_chars: int = 4000, tool_prompt: str = "json", snippet: str = "head", **options: Any):
        """``oracle_k``: the k of the oracle's searches (default ``max_k``); the rest as ``SearchEnv``."""
        super().__init__(corpus=None, max_k=max_k, snippet_chars=snippet_chars, evidence_weight=evidence_weight,
                         oracle_k=max_k if oracle_k is None else oracle_k, tool_prompt=tool_prompt, snippet=snippet)
        self.family, self.length, self.source, self.tokenizer, self.options = family, length, source, tokenizer, options

    def reset(self, task: Mapping[str, Any]) -> str:
        self.current = self.instance(task)
        return super().reset(self.current.search_task())

    def prompt(self, task: Mapping[str, Any]) -> str:
        template = PROMPT_SEARCH_MINIMAL if self.tool_prompt == "minimal" else PROMPT_SEARCH
        return template.format(question=task["question"])

    def metrics(self) -> dict[str, Any]:
        inst = self.current
        return {"family": inst.family, "hops": inst.hops, "unanswerable": inst.unanswerable, **super().metrics()}

    def oracle(self, task: Mapping[str, Any]) -> Policy:
        from envs.oracles import FamilySearchOracle

        return FamilySearchOracle(task.get("family", self.family), self.oracle_k)


def _family_factory(family: str) -> Callable[..., Env]:
    def make(serve: str = "context", **kwargs: Any) -> Env:
        if serve == "context":
            return LongContextEnv(family, **kwargs)
        if serve == "search":
            return LongContextSearchEnv(family, **kwargs)
        raise ValueError(f"serve must be 'context' or 'search', got {serve!r}")

    make.__name__ = family
    make.__doc__ = FAMILIES[family]
    return make


for _name, _summary in FAMILIES.items():
    register(_name, summary=_summary + " serve=context|search")(_family_factory(_name))
