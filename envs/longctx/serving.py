"""The two ways of serving a long-context family, as registered environments.

**In context** (``serve="context"``, ``LongContextEnv``): the whole haystack is in the
prompt; one tool, ``answer(text, evidence)``. **Behind search** (``serve="search"``,
``LongContextSearchEnv``): the same passages are the per-task corpus of a ``SearchEnv``.
A task is ``{"family", "seed"}`` plus optional overrides (``length``, ``source``, any
generator option); the instance is regenerated from it. Importing this module registers
one environment per family (``make("needle", serve="search", …)``).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from k3rl.envs import scoring
from k3rl.envs.base import Env, TextPolicy
from k3rl.envs.judge import evidence_texts, judge_for, judged_metrics
from k3rl.envs.longctx.families import DEFAULTS, FAMILIES, GENERATORS
from k3rl.envs.longctx.haystack import generate, pool_words, render_context
from k3rl.envs.longctx.names import Names
from k3rl.envs.longctx.oracles import ContextOracle, FamilySearchOracle
from k3rl.envs.longctx.task import Instance
from k3rl.envs.registry import register
from k3rl.envs.search import SearchEnv, task_corpus
from k3rl.envs.tools import tool

PROMPT_SEARCH = (
    "The collection is one long text split into passages whose ids (p00000, p00001, ...) "
    "follow the order of the text. Search it to answer, then call `answer` with the answer alone (a name or a number). "
    'If the collection does not contain the answer, answer "unanswerable".\n\nQuestion: {question}'
)

PROMPT_SEARCH_MINIMAL = 'Search the passages, then answer with the answer alone (or "unanswerable").\n\nQuestion: {question}'
"""The search prompt of `tool_prompt="minimal"`: the task without the prose."""


class _Recent(OrderedDict):
    """A small least-recently-used memo: `get(key, make)` builds a value once while it stays among the last
    `size` used."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        while len(self) > self.size:
            self.popitem(last=False)
        return value


_INSTANCES = _Recent(32)
"""Generated instances by (family, seed, length, source, tokenizer, options): an evaluation plays each task
several times (model, oracle, closed-book) and at 64K+ tokens generating the haystack costs seconds."""
_CORPORA = _Recent(8)
"""The BM25 index of an instance's haystack (the search serving), by the same key."""


class _FamilyTasks:
    """Task sampling shared by both servings: a task is ``{"family", "seed"}`` plus overrides."""

    family: str

    def tasks(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        rng = random.Random(f"tasks:{self.family}:{seed}")
        return [{"family": self.family, "seed": rng.randrange(2**31)} for _ in range(n)]

    def _instance_key(self, task: Mapping[str, Any]) -> tuple:
        options = {**self.options, **{k: v for k, v in task.items() if k in DEFAULTS}}
        return (task.get("family", self.family), int(task["seed"]), int(task.get("length", self.length)),
                task.get("source", self.source), self.tokenizer, tuple(sorted(options.items())))

    def instance(self, task: Mapping[str, Any]) -> Instance:
        """The task's instance (generated once per key and reused: treat it as read-only)."""
        key = self._instance_key(task)
        family, seed, length, source, tokenizer, options = key
        return _INSTANCES.get(key, lambda: generate(family, seed, length, source, tokenizer, **dict(options)))


class LongContextEnv(_FamilyTasks, Env):
    """A long-context family served in context: the haystack is in the prompt; one tool, ``answer``."""

    success_metric = "em"

    system_prompt = "You answer questions about a long text given in the user message."

    def __init__(self, family: str = "needle", length: int = 8192, source: str = "shakespeare",
                 tokenizer: Any = None, evidence_weight: float = 0.0, judge: Mapping[str, Any] | None = None,
                 **options: Any):
        """``judge``: a judge model's settings (envs/judge.py): its grade replaces F1 in the reward."""
        self.family, self.length, self.source, self.tokenizer = family, length, source, tokenizer
        self.evidence_weight, self.options = evidence_weight, _checked_options(type(self), family, source, options)
        self.judge = None if judge is None else judge_for(judge)

    def reset(self, task: Mapping[str, Any]) -> str:
        self.current = self.instance(task)
        self.final: str | None = None
        self.cited: list[str] = []
        self._grade = None
        return render_context(self.current)

    @tool(terminal=True, inline=True)
    def answer(self, text: str, evidence: list[str] | None = None) -> str:
        """Give the final answer and end the episode.

        Args:
            text: the answer alone (a name or a number), or "unanswerable".
            evidence: ids of the passages the answer rests on, e.g. ["p00042"].
        """
        self.final, self.cited = text, list(evidence or [])
        return "Answer recorded."

    def graded(self):
        """The judge's grade of this episode's answer (asked once), or None without a judge."""
        if self.judge is not None and self._grade is None:
            inst = self.current
            self._grade = self.judge.grade(inst.question, self.final, inst.answers,
                                           evidence_texts(dict(inst.passages), inst.evidence))
        return self._grade

    def metrics(self) -> dict[str, Any]:
        inst, grade = self.current, self.graded()
        return {
            **({} if grade is None else judged_metrics(grade)),
            "family": inst.family, "hops": inst.hops, "unanswerable": inst.unanswerable, "tokens": inst.meta["tokens"],
            "answered": self.final is not None,
            "em": scoring.exact_match(self.final, inst.answers), "f1": scoring.f1(self.final, inst.answers),
            "evidence_recall": scoring.evidence_recall(self.cited, inst.evidence),
        }

    def reward(self) -> float:
        if self.final is None:
            return 0.0
        w, grade = self.evidence_weight, self.graded()
        answer = scoring.f1(self.final, self.current.answers) if grade is None else grade.score
        return (1 - w) * answer + w * scoring.evidence_recall(self.cited, self.current.evidence)

    def oracle(self, task: Mapping[str, Any]) -> TextPolicy:
        return ContextOracle(task.get("family", self.family))


class LongContextSearchEnv(_FamilyTasks, SearchEnv):
    """A long-context family served behind search: the haystack is the corpus of ``search``/``open``."""

    def __init__(self, family: str = "needle", length: int = 8192, source: str = "shakespeare",
                 tokenizer: Any = None, max_k: int = 20, evidence_weight: float = 0.1, oracle_k: int | None = None,
                 snippet_chars: int = 4000, tool_prompt: str = "json", snippet: str = "head",
                 judge: Mapping[str, Any] | None = None, **options: Any):
        """``oracle_k``: the k of the oracle's searches (default ``max_k``); the rest as ``SearchEnv``."""
        super().__init__(corpus=None, max_k=max_k, snippet_chars=snippet_chars, evidence_weight=evidence_weight,
                         oracle_k=max_k if oracle_k is None else oracle_k, tool_prompt=tool_prompt, snippet=snippet,
                         judge=judge)
        self.family, self.length, self.source, self.tokenizer = family, length, source, tokenizer
        self.options = _checked_options(type(self), family, source, options)

    def reset(self, task: Mapping[str, Any]) -> str:
        self.current = self.instance(task)
        self._key = self._instance_key(task)
        return super().reset(self.current.search_task())

    def task_corpus(self, task: Mapping[str, Any]):
        """The haystack's index, built once per instance (not per episode)."""
        return _CORPORA.get(self._key, lambda: task_corpus(task["passages"]))

    def prompt(self, task: Mapping[str, Any]) -> str:
        template = PROMPT_SEARCH_MINIMAL if self.tool_prompt == "minimal" else PROMPT_SEARCH
        return template.format(question=task["question"])

    def metrics(self) -> dict[str, Any]:
        inst = self.current
        return {"family": inst.family, "hops": inst.hops, "unanswerable": inst.unanswerable, **super().metrics()}

    def oracle(self, task: Mapping[str, Any]) -> TextPolicy:
        return FamilySearchOracle(task.get("family", self.family), self.oracle_k)


def _checked_options(cls: type, family: str, source: str, options: dict[str, Any]) -> dict[str, Any]:
    """The task-generation options given to an environment, refusing unknown names (a typo such as
    `lenght` would otherwise be ignored) with a TypeError that lists the valid ones, and values the family's
    generator cannot use (`ask=size`) with a ValueError: one task's facts are drawn now (no haystack), so a bad
    value is named when the environment is built, not later inside a rollout worker."""
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        import inspect

        own = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "options")]
        raise TypeError(f"{cls.__name__} got unexpected argument(s) {', '.join(unknown)}; it takes "
                        f"{', '.join(own + sorted(DEFAULTS))}, and serve=context|search")
    if family in GENERATORS:  # the `file` family has no generator: its task file is checked instead
        rng = random.Random(f"{family}:check")
        try:
            GENERATORS[family](rng, Names(rng, pool_words(source)), {**DEFAULTS, **options})
        except (TypeError, ValueError, KeyError, IndexError) as e:
            raise ValueError(f"{family} options {options}: {e}") from None
    return options


def _family_factory(family: str) -> Callable[..., Env]:
    def make(serve: str = "context", tokenizer: Any = None, **kwargs: Any) -> Env:
        if serve == "context":
            return LongContextEnv(family, tokenizer=tokenizer, **kwargs)
        if serve == "search":
            return LongContextSearchEnv(family, tokenizer=tokenizer, **kwargs)
        raise ValueError(f"serve must be 'context' or 'search', got {serve!r}")

    make.__name__ = family
    make.__doc__ = FAMILIES[family]
    return make


for _name, _summary in FAMILIES.items():
    register(_name, summary=_summary + " serve=context|search")(_family_factory(_name))
