"""Real long-context QA tasks from a JSONL file (the ``file`` family): the format, its checks, a task's haystack.
The family's two servings (``make("file", path=…, serve="context" | "search", length=…, tokenizer=…)``) are in
envs/longctx/file_serving.py.

One task per line (the shape of a ``SearchEnv`` task, plus an id)::

    {"id": "q7", "question": "Which magazine was started first, Arthur's Magazine or First for Women?",
     "answers": ["Arthur's Magazine"],
     "passages": [{"id": "d1", "title": "Arthur's Magazine", "text": "Arthur's Magazine (1844–1846) was …"},
                  {"id": "d2", "title": "First for Women", "text": "First for Women is a woman's magazine …"}],
     "evidence": ["d1", "d2"]}

- ``id``: a string (or integer), unique in the file. ``question``: a non-empty string.
- ``answers``: the gold answers, any one counts (EM/F1 take the best); ``["unanswerable"]`` when the
  passages do not hold the answer.
- ``passages``: the task's own documents, ``{"id", "text", "title"?}``; each is one passage of the
  haystack, never cut (its title is its first line).
- ``evidence``: ids of the passages the answer rests on (default: all of ``passages``; may be empty only
  for an unanswerable task).
- ``corpus`` instead of ``passages``: a corpus of the toolkit — a built-in source (``wiki``,
  ``shakespeare``) or a corpus YAML (``k3rl corpus build``'s, relative to the task file); ``evidence``
  then names its passage ids (``<doc id>#<n>``) or document ids, and those are the task's passages.
- Optional: ``hops`` (default: the number of evidence passages), ``meta`` (anything; kept in the
  instance's meta). Any other field is an error, so a misspelt ``evidence`` is not silently dropped.

``read_task_file`` checks the whole file before anything runs and raises ``TaskFileError`` naming the
file, the line and the task. ``TaskFile.instance`` builds a task's haystack at a length: its evidence
passages at seeded depths (drawn first, so a task keeps its depth at every length) among distractors —
the task's other passages, then other tasks' passages, then the real filler text of the synthetic
families (haystack.py) — up to ``length`` tokens of the in-context prompt; ids ``p00000, …`` in reading
order, as the synthetic families have, so every serving, oracle and report works unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

from k3rl.envs.base import as_token_counter
from k3rl.envs.jsonl import JsonlError, jsonl_lines, parse_line
from k3rl.envs.longctx.haystack import LINE, haystack_pool, render_context
from k3rl.envs.longctx.task import UNANSWERABLE, Instance
from k3rl.envs.scoring import normalize_answer
from k3rl.envs.sources import CorpusError

FILE_FAMILY = "file"
SUMMARY = "Long-context QA over real documents from a JSONL task file (path=…): multi-hop or long-document."
FIELDS = ("id", "question", "answers", "passages", "evidence", "corpus", "hops", "meta")
PASSAGE_FIELDS = ("id", "title", "text")
_MISFITS = 16
"""Distractors in a row that do not fit the room left before the haystack is taken as full."""


class TaskFileError(ValueError):
    """A task file that cannot be evaluated: missing, malformed (``path:line: …``) or inconsistent."""


class TaskPassage(NamedTuple):
    """A document of a task: its id in the file (or corpus), title and text."""

    id: str
    title: str
    text: str

    @property
    def body(self) -> str:
        """What the haystack shows: the title as the first line, then the text (as the indexes see a passage)."""
        return f"{self.title}\n{self.text}" if self.title else self.text


@dataclass(frozen=True)
class FileTask:
    """One checked line of a task file; ``passages`` are resolved from the corpus when the task names one."""

    id: str
    line: int
    question: str
    answers: list[str]
    passages: list[TaskPassage]
    evidence: list[str]
    hops: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def unanswerable(self) -> bool:
        return [normalize_answer(a) for a in self.answers] == [UNANSWERABLE]


class TaskFile:
    """The checked tasks of a file, in file order, and the haystacks built from them."""

    def __init__(self, path: str, tasks: list[FileTask]):
        self.path, self.tasks = path, tasks
        self._by_id = {t.id: t for t in tasks}
        # every task's passages in one fixed shuffled order: distractors are read from a seeded start
        pool = [(t.id, p.body) for t in tasks for p in t.passages]
        random.Random(f"file-pool:{len(pool)}").shuffle(pool)
        self._pool = pool

    def task(self, task_id: str) -> FileTask:
        if task_id not in self._by_id:
            raise KeyError(f"no task {task_id!r} in {self.path}")
        return self._by_id[task_id]

    def instance(self, task_id: str, seed: int, length: int, source: str = "shakespeare", tokenizer: Any = None) -> Instance:
        """Task ``task_id``'s haystack whose in-context prompt has at most ``length`` tokens, deterministic in ``seed``."""
        task = self.task(task_id)
        count = as_token_counter(tokenizer)
        rng = random.Random(f"{FILE_FAMILY}:{task.id}:{seed}")
        gold = [p for p in task.passages if p.id in task.evidence]
        depths = [rng.random() for _ in gold]  # first: the same relative depths at every length
        gold_only = Instance(FILE_FAMILY, seed, task.question, task.answers, [("p00000", p.body) for p in gold], [],
                             task.hops, task.unanswerable)
        need = count(render_context(gold_only))
        if need > length:
            raise ValueError(f"task {task.id!r} needs {need} tokens (its question and {len(gold)} evidence "
                             f"passage(s)), more than the length {length}")
        room = length - need
        cost = lambda text: count(LINE.format(pid="p00000", text=text)) + 1  # noqa: E731
        doc_texts, filler_texts = self._distractors(task, rng, source)
        docs, room, _ = _take(doc_texts, room, cost)
        fillers, room, full = _take(filler_texts, room, cost)
        if not full:
            raise ValueError(f"source {source!r} and the task file have fewer than {length} tokens of text; "
                             f"use a smaller length or source='mixed'")
        # filler keeps its reading order; documents go in at seeded places, the evidence at its depths
        items = [(text, c, False) for text, c in fillers]
        for text, c in docs:
            items.insert(rng.randrange(len(items) + 1), (text, c, False))
        slots = [min(len(items), int(d * (len(items) + 1))) for d in depths]
        for shift, (slot, p) in enumerate(sorted(zip(slots, gold), key=lambda s: s[0])):
            items.insert(slot + shift, (p.body, 0, True))
        instance = _instance(task, seed, items)
        # per-passage counts are estimates (tokens can merge across joins): trim distractors from the end
        while (n := count(render_context(instance))) > length:
            excess, keep = n - length, list(items)
            for i in range(len(items) - 1, -1, -1):
                if excess <= 0:
                    break
                if not items[i][2]:
                    excess -= items[i][1]
                    keep.pop(i)
            if len(keep) == len(items):
                raise ValueError(f"task {task.id!r} needs {n} tokens, more than the length {length}")
            items = keep
            instance = _instance(task, seed, items)
        instance.meta.update({"tokens": n, "length": length, "source": source})
        return instance

    def _distractors(self, task: FileTask, rng: random.Random, source: str) -> tuple[Iterator[str], Iterator[str]]:
        """The distractor texts: the task's other passages, then other tasks' passages (from a seeded start); and
        the real filler text (from a seeded start, in reading order). No text twice, none equal to an evidence
        passage."""
        pool, filler = self._pool, haystack_pool(source)
        doc_start, filler_start = rng.randrange(max(1, len(pool))), rng.randrange(len(filler))
        used = {p.body for p in task.passages if p.id in task.evidence}
        own = (p.body for p in task.passages if p.id not in task.evidence)
        others = (pool[(doc_start + k) % len(pool)] for k in range(len(pool)))
        docs = chain(own, (text for owner, text in others if owner != task.id))
        fillers = (filler[(filler_start + k) % len(filler)] for k in range(len(filler)))

        def unused(texts: Iterator[str]) -> Iterator[str]:
            for text in texts:
                if text not in used:
                    used.add(text)
                    yield text

        return unused(docs), unused(fillers)


def _take(texts: Iterator[str], room: int, cost: Callable[[str], int]) -> tuple[list[tuple[str, int]], int, bool]:
    """The texts (with their costs) that fit in ``room`` tokens, in order, skipping ones too long; the room left, and
    whether the room filled up (``_MISFITS`` texts in a row did not fit) before the texts ran out."""
    taken, misfits = [], 0
    for text in texts:
        c = cost(text)
        if c > room:
            misfits += 1
            if misfits >= _MISFITS:
                return taken, room, True
            continue
        misfits = 0
        taken.append((text, c))
        room -= c
    return taken, room, False


def _instance(task: FileTask, seed: int, items: list[tuple[str, int, bool]]) -> Instance:
    """The instance of a task whose haystack is ``items`` (text, estimated cost, is evidence) in reading order."""
    passages = [(f"p{i:05d}", text) for i, (text, _, _) in enumerate(items)]
    gold = {p.body: p for p in task.passages if p.id in task.evidence}
    evidence = [(pid, gold[text]) for (pid, text), (_, _, is_gold) in zip(passages, items) if is_gold]
    meta = {"task_id": task.id, "evidence_ids": {pid: p.id for pid, p in evidence},
            "titles": {pid: p.title for pid, p in evidence}, "task_meta": task.meta}
    return Instance(FILE_FAMILY, seed, task.question, list(task.answers), passages, [pid for pid, _ in evidence],
                    task.hops, task.unanswerable, meta)


def read_task_file(path: str | Path) -> TaskFile:
    """The checked tasks of a JSONL task file (cached while the file is unchanged); ``TaskFileError`` if it cannot run."""
    p = Path(path)
    if not p.is_file():
        raise TaskFileError(f"{path}: no such task file")
    stat = p.stat()
    return _read(str(p), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int, size: int) -> TaskFile:
    corpora: dict[str, Any] = {}
    tasks: list[FileTask] = []
    lines: dict[str, int] = {}
    try:
        for n, line in jsonl_lines(path):
            task = _parse(path, n, line, lambda name: _corpus(path, name, corpora))
            if task.id in lines:
                raise TaskFileError(f"{path}:{n}: duplicate task id {task.id!r} (first on line {lines[task.id]})")
            lines[task.id] = n
            tasks.append(task)
    except JsonlError as e:
        raise TaskFileError(str(e)) from None
    if not tasks:
        raise TaskFileError(f"{path}:1: no tasks (the file is empty or blank; one JSON object per line)")
    return TaskFile(path, tasks)


def _is_id(value: Any) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool) and str(value) != ""


def _parse(path: str, n: int, line: str, corpus: Callable[[str], Any]) -> FileTask:
    where = f"{path}:{n}"
    row = parse_line(where, line)
    if not isinstance(row, dict):
        raise TaskFileError(f"{where}: a task is a JSON object, got {type(row).__name__}")
    if not _is_id(row.get("id")):
        raise TaskFileError(f"{where}: no id (a non-empty string or an integer), got {row.get('id')!r}")
    where = f"{where}: task {str(row['id'])!r}"
    unknown = sorted(set(row) - set(FIELDS))
    if unknown:
        raise TaskFileError(f"{where}: unknown field(s) {', '.join(unknown)}; a task has {', '.join(FIELDS)} "
                            f"(anything else goes in meta)")
    question, answers = row.get("question"), row.get("answers")
    if not isinstance(question, str) or not question.strip():
        raise TaskFileError(f"{where}: no question (a non-empty string), got {question!r}")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise TaskFileError(f"{where}: no answers (a non-empty list of non-empty strings; [\"{UNANSWERABLE}\"] "
                            f"when the passages do not hold the answer), got {answers!r}")
    if ("passages" in row) == ("corpus" in row):
        raise TaskFileError(f"{where}: give passages (the task's documents) or corpus (a corpus its evidence ids "
                            f"name), not {'both' if 'passages' in row else 'neither'}")
    evidence = row.get("evidence")
    if evidence is not None and (not isinstance(evidence, list) or not all(_is_id(e) for e in evidence)):
        raise TaskFileError(f"{where}: evidence must be a list of passage ids, got {evidence!r}")
    evidence = None if evidence is None else list(dict.fromkeys(str(e) for e in evidence))
    if "passages" in row:
        passages = _passages(where, row["passages"])
        ids = [p.id for p in passages]
        evidence = ids if evidence is None else evidence
        missing = [e for e in evidence if e not in set(ids)]
        if missing:
            raise TaskFileError(f"{where}: evidence {missing} match(es) no passage of the task "
                                f"(its passages: {', '.join(ids)})")
    else:
        if not isinstance(row["corpus"], str) or not row["corpus"]:
            raise TaskFileError(f"{where}: corpus must be a built-in source name or a corpus YAML path, "
                                f"got {row['corpus']!r}")
        if evidence is None:
            raise TaskFileError(f"{where}: evidence is required with corpus (the passage or document ids of "
                                f"{row['corpus']!r} the answer rests on)")
        try:
            found = corpus(row["corpus"])
        except (OSError, ValueError, RuntimeError, LookupError, TypeError, CorpusError) as e:
            raise TaskFileError(f"{where}: corpus {row['corpus']!r}: {e}") from None
        passages, missing = [], []
        for e in evidence:
            if (p := found.passage(e)) is not None:
                passages.append(TaskPassage(e, p.title, p.text))
            elif (d := found.document(e)) is not None:
                passages.append(TaskPassage(e, d.title, d.text))
            else:
                missing.append(e)
        if missing:
            raise TaskFileError(f"{where}: evidence {missing} match(es) no passage or document of corpus "
                                f"{row['corpus']!r}")
    task = FileTask(str(row["id"]), n, question, list(answers), passages, evidence, 0, {})
    if not evidence and not task.unanswerable:
        raise TaskFileError(f"{where}: evidence is empty; name the passages the answer rests on (or leave the "
                            f"field out: all the task's passages)")
    hops, meta = row.get("hops", max(1, len(evidence))), row.get("meta", {})
    if isinstance(hops, bool) or not isinstance(hops, int) or hops < 1:
        raise TaskFileError(f"{where}: hops must be a positive integer, got {hops!r}")
    if not isinstance(meta, dict):
        raise TaskFileError(f"{where}: meta must be a JSON object, got {type(meta).__name__}")
    return FileTask(task.id, n, question, list(answers), passages, evidence, hops, meta)


def _passages(where: str, rows: Any) -> list[TaskPassage]:
    if not isinstance(rows, list) or not rows:
        raise TaskFileError(f"{where}: passages must be a non-empty list of {{\"id\", \"title\"?, \"text\"}}")
    out, seen = [], set()
    for i, p in enumerate(rows):
        at = f"{where}: passages[{i}]"
        if not isinstance(p, dict):
            raise TaskFileError(f"{at}: a passage is a JSON object, got {type(p).__name__}")
        unknown = sorted(set(p) - set(PASSAGE_FIELDS))
        if unknown:
            raise TaskFileError(f"{at}: unknown field(s) {', '.join(unknown)}; a passage has {', '.join(PASSAGE_FIELDS)}")
        if not _is_id(p.get("id")):
            raise TaskFileError(f"{at}: no id (a non-empty string or an integer), got {p.get('id')!r}")
        pid, title, text = str(p["id"]), p.get("title", ""), p.get("text")
        if not isinstance(text, str) or not text.strip():
            raise TaskFileError(f"{at} ({pid!r}): no text (a non-empty string), got {text!r}")
        if not isinstance(title, str):
            raise TaskFileError(f"{at} ({pid!r}): title must be a string, got {title!r}")
        if pid in seen:
            raise TaskFileError(f"{at}: duplicate passage id {pid!r}")
        seen.add(pid)
        out.append(TaskPassage(pid, title.strip(), text.strip()))
    return out


def _corpus(path: str, name: str, corpora: dict[str, Any]) -> Any:
    """The corpus a task names: a built-in source, or a corpus YAML relative to the task file."""
    from k3rl.envs.search import get_corpus
    from k3rl.envs.sources import BUILTIN_SOURCES

    if name not in corpora:
        spec = name
        if name not in BUILTIN_SOURCES:
            yaml = Path(name) if Path(name).is_absolute() else Path(path).parent / name
            if not yaml.is_file() or yaml.suffix not in (".yaml", ".yml"):
                raise ValueError(f"neither a built-in source ({', '.join(BUILTIN_SOURCES)}) nor a corpus YAML "
                                 f"file (looked for {yaml})")
            spec = str(yaml)
        corpora[name] = get_corpus(spec)
    return corpora[name]
