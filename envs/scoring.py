"""Scorers shared by the search and long-context environments.

- ``exact_match`` / ``f1``: SQuAD-style normalisation (lowercase, drop punctuation
  and articles, squeeze spaces), best over the gold aliases; F1 over tokens.
- ``evidence_recall``: fraction of gold evidence passages that the agent saw
  (retrieved by a search, opened, or cited).
- ``recall_at_k``: the same, counting only results ranked ≤ k in each search.
- ``tool_efficiency``: calls per hop, repeated queries, solved within budget.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation + "‘’“”–—")


def normalize_answer(text: str) -> str:
    """Lowercase, strip punctuation and English articles, collapse whitespace."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str | None, golds: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals a normalised gold answer."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def f1(prediction: str | None, golds: Sequence[str]) -> float:
    """Best token-level F1 between the prediction and any gold answer."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        ref = normalize_answer(gold).split()
        if not pred or not ref:
            best = max(best, float(pred == ref))
            continue
        common = sum((Counter(pred) & Counter(ref)).values())
        if common:
            p, r = common / len(pred), common / len(ref)
            best = max(best, 2 * p * r / (p + r))
    return best


def evidence_recall(seen: Iterable[str], evidence: Sequence[str]) -> float:
    """Fraction of gold evidence ids in ``seen``; 1.0 when there is no evidence to find."""
    gold = set(evidence)
    if not gold:
        return 1.0
    return len(gold & set(seen)) / len(gold)


def recall_at_k(rankings: Sequence[Sequence[str]], evidence: Sequence[str], k: int) -> float:
    """Evidence recall counting only the top ``k`` of each search's ranked ids."""
    return evidence_recall((pid for ranking in rankings for pid in ranking[:k]), evidence)


def normalize_query(query: str) -> str:
    return " ".join(sorted(set(normalize_answer(query).split())))


def repeated_queries(queries: Sequence[str]) -> int:
    """How many searches repeated an earlier query (same words, any order or case)."""
    seen: set[str] = set()
    repeats = 0
    for q in queries:
        key = normalize_query(q)
        repeats += key in seen
        seen.add(key)
    return repeats


def tool_efficiency(info: Mapping[str, Any], hops: int = 1) -> dict[str, float]:
    """Efficiency of a finished episode from its info: calls per hop, repeats, solved in budget."""
    calls = int(info.get("tool_calls", 0))
    solved = float(info.get("em", 0.0)) >= 1.0 and not info.get("truncated", False)
    return {
        "calls_per_hop": calls / max(1, hops),
        "repeated_queries": float(info.get("repeated_queries", 0)),
        "solved_within_budget": float(solved),
    }
