"""`digits`: a registry whose answer only an image holds — the first environment whose observations show pictures.

A task: "Which digit is stamped on the lantern kept by the gardener?" The registry holds `records` records like the
needle task's ("The gardener keeps a lantern. Its stamp:"), each stamped with a real handwritten digit — one of the
1,797 8×8 scans scikit-learn ships (`sklearn.datasets.load_digits`, UCI's optical recognition of handwritten digits,
offline), scaled to `size`×`size` pixels. The text never says the digit: a text-only policy reads the same words
whatever the stamp, so it is at chance (1 in 10; tests/envs/test_visual.py shows it).

Serving: `search` (default): `search(query)` shows the best-matching record (word overlap with the record's text)
as text and its stamp; `context`: every record and its stamp in the prompt. `answer(text)` ends the episode:
exact match on the digit (`em`, the success metric), which is also the reward.

Held-out stamps: `split: train` draws scans 0–1,399, `split: test` scans 1,400–1,796, `all` any; `by_seed` (the
default) draws test scans for task seeds from 1,000,000 on (the trainer's and `k3rl sft`'s held-out seed,
`eval.seed`, is 1,000,003) and train scans below, so held-out tasks show handwriting no training task showed.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

import numpy as np

from k3rl.envs.base import Env, TextPolicy
from k3rl.envs.longctx.needle import OBJECTS, ROLES
from k3rl.envs.registry import register
from k3rl.envs.tools import tool

SPLITS = {"train": (0, 1400), "test": (1400, 1797), "all": (0, 1797), "by_seed": None}
HELD_OUT_SEEDS = 1_000_000
"""`split: by_seed` draws test scans for task seeds from here on."""


@lru_cache(maxsize=1)
def _scans() -> tuple[np.ndarray, np.ndarray]:
    """(images [1797, 8, 8] uint8 0..255, labels [1797]) of scikit-learn's digits (bundled, no download)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8), digits.target.astype(np.int64))


def stamp(index: int, size: int) -> np.ndarray:
    """Scan `index` as an RGB uint8 [size, size, 3] image: dark ink on white, resized (bilinear)."""
    from PIL import Image

    ink = 255 - _scans()[0][index]
    gray = np.asarray(Image.fromarray(ink, "L").resize((size, size), Image.Resampling.BILINEAR))
    return np.repeat(gray[:, :, None], 3, axis=2)


RECORD = "The {role} keeps a {obj}. Its stamp:"
QUESTION = "Which digit is stamped on the {obj} kept by the {role}?"


@register("digits", summary="Find a record and read the handwritten digit stamped on it (only the image says it).")
class Digits(Env):
    """Read a handwritten digit off the record the question names (module docstring)."""

    system_prompt = "You answer questions about the registry with tools. Answer with the digit alone."
    success_metric = "em"

    def __init__(self, records: int = 6, serve: str = "search", size: int = 28, split: str = "by_seed",
                 tool_prompt: str = "compact"):
        if serve not in ("search", "context"):
            raise ValueError(f"serve: {serve!r} is not one of search, context")
        if split not in SPLITS:
            raise ValueError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
        if not 1 <= records <= len(ROLES) * len(OBJECTS):
            raise ValueError(f"records: must be in 1..{len(ROLES) * len(OBJECTS)}, got {records}")
        if size < 8:
            raise ValueError(f"size: a stamp needs at least 8 pixels a side, got {size}")
        self.records, self.serve, self.size, self.split = records, serve, size, split
        self.tool_prompt = tool_prompt
        self.task: dict[str, Any] | None = None
        self.answered: str | None = None

    def tasks(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """`n` tasks: `records` distinct (role, object) pairs, each with a scan of the split; one is asked."""
        rng = random.Random(f"digits:{seed}")
        split = self.split if self.split != "by_seed" else "test" if seed >= HELD_OUT_SEEDS else "train"
        lo, hi = SPLITS[split]
        labels = _scans()[1]
        pairs = [(r, o) for r in ROLES for o in OBJECTS]
        out = []
        for i in range(n):
            chosen = rng.sample(pairs, self.records)
            scans = [rng.randrange(lo, hi) for _ in chosen]
            asked = rng.randrange(self.records)
            out.append({"id": f"digits-{seed}-{i}", "records": [[r, o, s] for (r, o), s in zip(chosen, scans)],
                        "asked": asked, "answer": str(int(labels[scans[asked]]))})
        return out

    def reset(self, task: dict[str, Any]):
        self.task, self.answered = task, None
        role, obj, _ = task["records"][task["asked"]]
        question = QUESTION.format(role=role, obj=obj)
        if self.serve == "search":
            return question + " Search the registry."
        parts: list[Any] = [question + "\n"]
        for k, (r, o, s) in enumerate(task["records"]):
            parts += [f"\nRecord {k}: " + RECORD.format(role=r, obj=o) + " ", stamp(s, self.size)]
        return parts

    @tool
    def search(self, query: str):
        """Show the registry record that best matches the query, with its stamp.

        Args:
            query: words of the record to find
        """
        if self.serve != "search":
            return "Error: every record is above; there is nothing to search."
        words = set(query.lower().replace("?", " ").replace(".", " ").split())
        scores = [len(words & set(RECORD.format(role=r, obj=o).lower().rstrip(":").replace(".", "").split()))
                  for r, o, _ in self.task["records"]]
        k = int(np.argmax(scores))
        r, o, s = self.task["records"][k]
        return [RECORD.format(role=r, obj=o) + " ", stamp(s, self.size)]

    @tool(terminal=True)
    def answer(self, text: str) -> float:
        """Give the digit.

        Args:
            text: the digit
        """
        self.answered = text.strip()
        return self.reward()

    def reward(self) -> float:
        return float(self.answered is not None and self.answered == self.task["answer"])

    def metrics(self) -> dict[str, Any]:
        return {"em": self.reward()}

    def oracle(self, task: dict[str, Any]) -> TextPolicy:
        """Searches for the asked record (search serving), then answers the gold digit."""
        role, obj, _ = task["records"][task["asked"]]

        def policy(messages: list[dict]) -> str:
            searched = any(m["role"] == "tool" for m in messages)
            if self.serve == "search" and not searched:
                return _call("search", {"query": f"{role} {obj}"})
            return _call("answer", {"text": task["answer"]})

        return policy


def _call(name: str, arguments: dict[str, Any]) -> str:
    import json

    from k3rl.envs.tools import TOOL_CALL_END, TOOL_CALL_START

    return f"{TOOL_CALL_START}{json.dumps({'name': name, 'arguments': arguments})}{TOOL_CALL_END}"


__all__ = ["Digits", "SPLITS", "stamp"]
