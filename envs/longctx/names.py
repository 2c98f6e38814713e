"""Invented names of people, towns and rivers (multihop.py, aggregate.py).

Names are built from syllables and checked absent from the haystack, so an answer can
be found in the text but never recalled from pretraining. ``ENTITY_PATTERN`` is the
shape of each kind, which solvers use to read a name back out of a fact.
"""

from __future__ import annotations

import random
from collections.abc import Callable

_FIRST = (["Va", "Re", "Ko", "Li", "Sa", "To", "Mi", "Ela", "Bra", "Qui", "Ze", "Ul", "Ori", "Fe", "Da", "Ca", "Ny", "Ile"],
          ["rek", "na", "vin", "los", "dra", "mir", "tel", "wen", "rik", "sa", "dor", "lis", "vo", "ther"])
_LAST = (["Ost", "Hal", "Brin", "Mor", "Kel", "Thal", "Ves", "Cor", "Dun", "Ash", "Wyn", "Grel", "Pell", "Orm"],
         ["rum", "wick", "dane", "more", "holt", "ley", "ford", "by", "gard", "mere", "ton", "sley", "vane", "crest"])
_TOWN = (["Hal", "Ost", "Bel", "Cor", "Dray", "Elm", "Fal", "Grim", "Ket", "Lor", "Mar", "Norr", "Pem", "Sul"],
         ["brook", "mere", "stead", "wick", "ford", "hollow", "gate", "crest", "moor", "fold"])
_RIVER = (["Ash", "Sil", "Brae", "Cold", "Fen", "Lum", "Mire", "Tal", "Ver", "Wend"],
          ["water", "run", "flow", "beck", "wash", "rill", "spring", "burn"])

ENTITY_PATTERN = {"person": r"[A-Z][a-z]+ [A-Z][a-z]+", "town": r"[A-Z][a-z]+", "river": r"[A-Z][a-z]+"}
"""The regex every invented name of a kind matches (a capitalised word per syllable pair)."""


class Names:
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
