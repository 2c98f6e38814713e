"""Retrieval-rich plain text: the long-context families as documents a base model reads and answers, with no chat.

A model learns to retrieve in context from many questions answered against one haystack, long before it can call
a tool. Two uses share the format here:

* ``plain_prompt`` / ``plain_answer``: one instance as "document, question, ``Answer:``" and its gold continuation —
  what the likelihood score of a pretrained model (rl/pretrain/retrieval_score.py) measures;
* ``practice_document``: ``questions`` instances of a family merged into one haystack (their facts inserted into the
  same real passages), followed by every question with its answer — pretraining text
  (``write_practice_corpus``: a JSONL source for ``k3rl pretrain``) whose loss on each answer is a retrieval;
* ``practice_episodes``: the environment's own episodes (system prompt, haystack and question, the oracle's tool
  calls) on practice tasks — conversations (``write_practice_episodes``: a ``format: chat`` source for
  ``k3rl pretrain``, rendered as rollouts render them) that carry the lookup into the format RL samples.

A question the merged facts make ambiguous (the family's own solver, reading the facts first to last and last to
first, finds different answers, or not the gold one) is left out. Documents are deterministic in (family, seed, length,
source, options); ``seed`` streams are disjoint from the task seeds of the environments (``tasks(n, seed)`` draws
from ``random.Random("tasks:…")``, this module from ``random.Random("practice:…")``), and a practice episode's
instance seed is ≥ ``PRACTICE_SEED_BASE`` while every environment task's is below it: no practice episode is ever a
training or held-out task.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from itertools import zip_longest
from pathlib import Path
from typing import Any

from k3rl.envs.base import approx_token_count
from k3rl.envs.longctx.families import DEFAULTS, GENERATORS
from k3rl.envs.longctx.haystack import _insert, haystack_pool, pool_words
from k3rl.envs.longctx.names import Names
from k3rl.envs.longctx.oracles import solve_in_context
from k3rl.envs.longctx.task import Instance

PRACTICE_SEED_BASE = 2**31
"""Practice episodes' instance seeds are ≥ this; environments draw task seeds below it (serving.py ``tasks``)."""
PLAIN_DOCUMENT = "<document>\n{document}\n</document>\n"
PLAIN_QA = "\nQuestion: {question}\nAnswer:"


def plain_document(passages: list[tuple[str, str]]) -> str:
    return PLAIN_DOCUMENT.format(document="\n".join(f"[{pid}] {text}" for pid, text in passages))


def plain_prompt(instance: Instance, passages: list[tuple[str, str]] | None = None) -> str:
    """The instance as a base model reads it (its haystack, or ``passages`` instead), ending in ``Answer:``."""
    return plain_document(instance.passages if passages is None else passages) + PLAIN_QA.format(question=instance.question)


def plain_answer(answer: str) -> str:
    """The gold continuation of ``plain_prompt``."""
    return f" {answer}\n"


def _solve(family: str, question: str, passages: list[tuple[str, str]]) -> str:
    """The family solver's answer when every search returns all ``passages``."""
    return solve_in_context(family, question, passages)[0]


def practice_document(family: str, seed: int, length: int, questions: int = 8, source: str = "wiki",
                      filler: float = 1.0, **options: Any) -> str:
    """About ``length`` tokens (byte estimate) of real passages holding the facts of ``questions`` instances of
    ``family``, then their questions and answers (ambiguous ones dropped). ``filler`` scales the real text around
    the facts (1: all the room the facts and questions leave; 0: one passage) — dense documents teach the lookup
    fast, sparse ones look like the haystacks of the environments."""
    if family not in GENERATORS:
        raise ValueError(f"practice family {family!r}: choose from {', '.join(GENERATORS)}")
    if questions < 1 or length < 1 or not 0 <= filler <= 1:
        raise ValueError(f"practice documents need questions ≥ 1, length ≥ 1 and 0 ≤ filler ≤ 1; got questions="
                         f"{questions}, length={length}, filler={filler}")
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"practice options {unknown}: not options of any family (valid: {', '.join(sorted(DEFAULTS))})")
    rng = random.Random(f"practice:{family}:{seed}:{length}")
    opt = {**DEFAULTS, **options, "unanswerable_rate": 0.0}
    specs = [GENERATORS[family](rng, Names(rng, pool_words(source)), opt) for _ in range(questions)]
    pool = haystack_pool(source)
    start, passages, total = rng.randrange(len(pool)), [], 0
    room = length - sum(approx_token_count(f.text) for s in specs for f in s.facts) - 24 * questions
    while total < filler * room:
        text = pool[(start + len(passages)) % len(pool)]
        left = filler * room - total
        if approx_token_count(text) > left:  # the last passage is cut at a word: short documents stay short
            text = " ".join(text.split()[: max(4, int(left * 0.75))])
        passages.append(text)
        total += approx_token_count(text) + 3
    passages = passages or [" ".join(pool[start].split()[:4])]
    for spec in specs:
        for fact in spec.facts:
            slot = rng.randrange(len(passages))
            passages[slot] = _insert(rng, passages[slot], fact.text)
    merged = [(f"p{i:05d}", text) for i, text in enumerate(passages)]
    # one fact per passage, forwards and backwards: a question two facts answer differently is ambiguous
    alone = [(f"f{i}", f.text) for i, f in enumerate(f for s in specs for f in s.facts)]
    qa = [(s.question, s.answers[0]) for s in specs
          if _solve(family, s.question, alone) == _solve(family, s.question, alone[::-1]) == s.answers[0]]
    return plain_document(merged) + "".join(PLAIN_QA.format(question=q) + plain_answer(a) for q, a in qa)


def practice_documents(family: str, n: int, length: int, seed: int = 0, **kwargs: Any) -> Iterator[str]:
    """``n`` practice documents of stream ``seed`` (document i of stream s is seed s·1000003 + i)."""
    for i in range(n):
        yield practice_document(family, seed * 1_000_003 + i, length, **kwargs)


def write_practice_corpus(path: str | Path, families: dict[str, int], length: int, seed: int = 0,
                          **kwargs: Any) -> Path:
    """A JSONL pretraining source (``{"text": …}`` per line): ``families[name]`` documents of each family,
    interleaved; written atomically (a reader never sees half a file)."""
    from k3rl.util.atomic import write_text_atomic

    streams = [practice_documents(f, n, length, seed, **kwargs) for f, n in families.items()]
    lines = [json.dumps({"text": doc}) for group in zip_longest(*streams) for doc in group if doc is not None]
    path = Path(path)
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def practice_tasks(family: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` tasks of ``family`` for practice episodes: instance seeds in [2³¹, 2³²), which no environment task has."""
    rng = random.Random(f"practice-tasks:{family}:{seed}")
    return [{"family": family, "seed": PRACTICE_SEED_BASE + rng.randrange(2**31)} for _ in range(n)]


def practice_episodes(family: str, n: int, length: int, seed: int = 0, serve: str = "context", source: str = "wiki",
                      tokenizer: Any = None, **options: Any) -> Iterator[list[dict[str, str]]]:
    """The environment's oracle episodes (``serve``: in context or behind search) on ``n`` practice tasks of stream
    ``seed`` at ``length`` tokens (the environment's prompt budget; byte estimate without ``tokenizer``): each a
    list of messages up to the last assistant turn — what the agent loop renders, the terminal result left out.
    Tasks the oracle cannot solve are skipped."""
    import k3rl.envs as envs

    env = envs.make(family, serve=serve, length=length, source=source, tokenizer=tokenizer, **options)
    for task in practice_tasks(family, n, seed):
        result = envs.run_episode(env, task, env.oracle(task), env.budget)
        if result.reward < 1.0:
            continue
        last = max(i for i, m in enumerate(result.messages) if m["role"] == "assistant")
        yield [{"role": m["role"], "content": m["content"]} for m in result.messages[: last + 1]]


def write_practice_episodes(path: str | Path, families: dict[str, int], length: int, seed: int = 0,
                            **kwargs: Any) -> Path:
    """A ``format: chat`` pretraining source (``{"messages": […]}`` per line): ``families[name]`` practice episodes
    of each family (``practice_episodes``), interleaved; written atomically."""
    from k3rl.util.atomic import write_text_atomic

    streams = [practice_episodes(f, n, length, seed, **kwargs) for f, n in families.items()]
    lines = [json.dumps({"messages": ep}) for group in zip_longest(*streams) for ep in group if ep is not None]
    if not lines:
        raise ValueError(f"no practice episode of {sorted(families)} was solved by its oracle at length {length}")
    path = Path(path)
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path
