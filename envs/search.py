"""The search/retrieval environment: ``search``, ``open``, ``answer`` over a passage corpus.

Tasks are dicts: ``question``, ``answers`` (gold aliases), ``evidence`` (gold passage
ids), optional ``hops``, and optionally ``passages`` (``[{"id", "text", "title"?}]``)
to search a per-task corpus instead of the shared one (the long-context families
served behind search do this).

- ``search(query, k)``: the k best passages, each with its passage id and document id.
- ``open(doc_id, offset)``: paged reading of a whole document; ids are looked up in the
  corpus, never used as paths, so ``../../etc/passwd`` is just an unknown id. A
  passage id (``doc#3``) opens its document at that passage.
- ``answer(text)``: ends the episode.

Reward: ``(1 - w) * F1 + w * evidence_recall`` of the answered episode (``w`` =
``evidence_weight``, 0.1 by default; 0 without an answer). Evidence recall counts a
gold passage as found once a search returned it or an opened page covered it. Info
carries EM, F1, recall, search/open counts and repeated queries.

``SearchEnv.tasks`` makes questions over the Wikipedia summaries whose answer is an
article's title, in one of two kinds (``questions=``):

- ``description`` (default): the article's short description is the question, its lead
  passage the evidence. A paraphrase task: descriptions share few words with the
  summaries (docs/environment.md), so the right article is rarely the first hit.
- ``quote``: a few consecutive words quoted from a passage (none of them a title word)
  are the question, that passage the evidence. Searching the quote finds the passage
  first (tasks where it does not are skipped), so the skills are the protocol itself:
  copy the quote into a query, copy the title from the results.

Search results show each title JSON-quoted (``"Owl"``), as an ``answer`` call writes it,
so a title is copied token for token from a result into the answer.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from k3rl.envs import scoring
from k3rl.envs.base import Env, TextPolicy
from k3rl.envs.corpus import Corpus, CorpusConfig, Document, Passage, load_corpus
from k3rl.envs.judge import evidence_texts, judge_for, judged_metrics
from k3rl.envs.registry import register
from k3rl.envs.search_oracle import SearchOracle
from k3rl.envs.tools import TOOL_PROMPT_STYLES, ToolError, tool

_CORPORA: dict[str, Corpus] = {}


@functools.lru_cache(maxsize=1 << 16)
def _quoted(title: str) -> str:
    """A document title as a JSON string, as search results show it: cached, since the same titles come back in
    every result list."""
    return json.dumps(title, ensure_ascii=False)


def get_corpus(spec: Corpus | CorpusConfig | str) -> Corpus:
    """A corpus from a ``Corpus``, a ``CorpusConfig``, a built-in name or a YAML path; loaded once per process."""
    if isinstance(spec, Corpus):
        return spec
    if isinstance(spec, str) and spec.endswith((".yaml", ".yml")):
        from k3rl.envs.corpus_config import read_config

        spec = read_config(spec, [])
    key = json.dumps(asdict(spec), sort_keys=True) if isinstance(spec, CorpusConfig) else spec
    if key not in _CORPORA:
        _CORPORA[key] = load_corpus(spec)
    return _CORPORA[key]


def task_corpus(passages: Sequence[Mapping[str, Any]]) -> Corpus:
    """A BM25 corpus over a task's own passages; each passage is its own document."""
    docs, items = [], []
    for p in passages:
        text, title = str(p["text"]), str(p.get("title", ""))
        docs.append(Document(str(p["id"]), title, text))
        items.append(Passage(str(p["id"]), str(p["id"]), title, text, 0, len(text)))
    return Corpus.from_passages(docs, items, name="task")


@register("search")
class SearchEnv(Env):
    """Agentic search over a corpus (default: Wikipedia summaries, BM25): search, open, answer; F1 + evidence recall."""

    success_metric = "em"
    system_prompt = (
        "You answer questions by searching a document collection. Search with short keyword queries, "
        "open documents to read more, and call `answer` with a short final answer (a name, number or phrase)."
    )

    def __init__(
        self,
        corpus: Corpus | CorpusConfig | str | None = "wiki",
        method: str = "bm25",
        max_k: int = 10,
        page_chars: int = 2000,
        snippet_chars: int = 1000,
        evidence_weight: float = 0.1,
        questions: str = "description",
        oracle_k: int = 10,
        tool_prompt: str = "json",
        quote_articles: int | None = None,
        snippet: str = "head",
        judge: Mapping[str, Any] | None = None,
    ):
        """
        Args:
            corpus: a ``Corpus``, a ``CorpusConfig``, a built-in source name, a corpus YAML
                path, or None when every task carries its own ``passages``.
            method: bm25, dense or hybrid (the corpus must have the indexes).
            max_k: the largest ``k`` a search may ask for.
            page_chars: characters per ``open`` page.
            snippet_chars: longest passage text shown in search results.
            evidence_weight: share of the reward given to evidence recall.
            questions: the kind of question ``tasks`` makes: ``description`` or ``quote``.
            oracle_k: the ``k`` of the oracle's searches (its demonstrations teach it).
            tool_prompt: how the system message lists the tools, ``json``, ``compact`` or ``minimal``
                (envs/tools.py `render_tools_prompt`).
            quote_articles: ``quote`` questions about this many fixed articles only (None: all).
            snippet: what a result shows of its passage: ``head`` (its beginning) or ``match``
                (the sentence sharing most words with the query, as search engines highlight).
            judge: a judge model's settings (envs/judge.py `judge_for`: ``base_url``, ``model``, …): its grade
                replaces F1 as the answer's part of the reward. None: F1.
        """
        if snippet not in SNIPPETS:
            raise ValueError(f"snippet: {snippet!r} is not one of {', '.join(SNIPPETS)}")
        self.snippet = snippet
        self.quote_articles = quote_articles
        if tool_prompt not in TOOL_PROMPT_STYLES:
            raise ValueError(f"tool_prompt: {tool_prompt!r} is not one of {', '.join(TOOL_PROMPT_STYLES)}")
        self.tool_prompt = tool_prompt
        if questions not in QUESTION_KINDS:
            raise ValueError(f"questions: {questions!r} is not one of {', '.join(QUESTION_KINDS)}")
        if not 1 <= oracle_k <= max_k:
            raise ValueError(f"oracle_k must be between 1 and max_k={max_k}, got {oracle_k}")
        self.questions = questions
        self.oracle_k = oracle_k
        self._corpus_spec = corpus
        self._shared: Corpus | None = None
        self.method = method
        self.max_k = max_k
        self.page_chars = page_chars
        self.snippet_chars = snippet_chars
        self.evidence_weight = evidence_weight
        self.judge = None if judge is None else judge_for(judge)
        self.corpus: Corpus | None = None

    @property
    def shared_corpus(self) -> Corpus:
        """The corpus searched by tasks that bring no passages of their own (loaded on first use)."""
        if self._shared is None:
            if self._corpus_spec is None:
                raise ValueError("this SearchEnv has no shared corpus (corpus=None): every task must carry 'passages'")
            self._shared = get_corpus(self._corpus_spec)
        return self._shared

    def reset(self, task: Mapping[str, Any]) -> str:
        self.task = task
        self.corpus = self.task_corpus(task) if task.get("passages") else self.shared_corpus
        if self.method not in self.corpus.methods:
            raise ValueError(f"search method {self.method!r} is not built for this corpus ({', '.join(self.corpus.methods)})")
        self.answers = [str(a) for a in task.get("answers", [])]
        self.evidence = [str(e) for e in task.get("evidence", [])]
        self.queries: list[str] = []
        self.rankings: list[list[str]] = []
        self.seen: set[str] = set()
        self.opened: list[str] = []
        self.final: str | None = None
        self._grade = None
        return self.prompt(task)

    def task_corpus(self, task: Mapping[str, Any]) -> Corpus:
        """The index of a task that brings its own `passages` (built per reset; subclasses may reuse one)."""
        return task_corpus(task["passages"])

    def prompt(self, task: Mapping[str, Any]) -> str:
        return f"Question: {task['question']}"

    @tool(inline=True)  # an index lookup: the time-limit thread's hand-off would cost more than the search
    def search(self, query: str, k: int = 5) -> str:
        """Search the collection and return the best-matching passages with their ids.

        Args:
            query: keywords describing what to find.
            k: number of passages to return (1 to 10).
        """
        if not query.strip():
            raise ToolError("the query is empty")
        if not 1 <= k <= self.max_k:
            raise ToolError(f"k must be between 1 and {self.max_k}, got {k}")
        hits = self.corpus.search(query, k, self.method)
        self.queries.append(query)
        self.rankings.append([h.passage.id for h in hits])
        self.seen.update(h.passage.id for h in hits)
        if not hits:
            return f"No results for {json.dumps(query)}."
        lines = [f"Results for {json.dumps(query)}:"]
        for h in hits:
            p = h.passage
            doc = f" (document {p.doc_id}: {_quoted(p.title)})" if p.doc_id != p.id else ""
            text = match_snippet(p.text, query) if self.snippet == "match" else p.text
            text = text if len(text) <= self.snippet_chars else text[: self.snippet_chars] + " …"
            lines.append(f"[{h.rank}] {p.id}{doc}\n{text}")
        return "\n\n".join(lines)

    @tool(inline=True)
    def open(self, doc_id: str, offset: int = 0) -> str:
        """Read a document page by page.

        Args:
            doc_id: a document id, or a passage id (doc#n) from the search results.
            offset: character position to start reading at (0 is the beginning).
        """
        doc = self.corpus.document(doc_id)
        if doc is None:
            passage = self.corpus.passage(doc_id)
            if passage is None:
                raise ToolError(f"unknown document id {json.dumps(doc_id)}; use an id from the search results")
            doc = self.corpus.document(passage.doc_id)
            offset = offset or passage.start
        if not 0 <= offset < max(1, len(doc.text)):
            raise ToolError(f"offset must be between 0 and {len(doc.text) - 1} for document {doc.id}, got {offset}")
        end = min(len(doc.text), offset + self.page_chars)
        if end < len(doc.text):
            space = doc.text.rfind(" ", offset + self.page_chars * 4 // 5, end)
            end = space if space > 0 else end
        self.opened.append(doc.id)
        for p in self.corpus.passages_of(doc.id):
            if p.start < end and p.end > offset:
                self.seen.add(p.id)
        head = f"Document {doc.id}" + (f": {doc.title}" if doc.title else "") + f" (characters {offset}-{end} of {len(doc.text)})"
        more = f'\n[continues: open(doc_id="{doc.id}", offset={end})]' if end < len(doc.text) else "\n[end of document]"
        return f"{head}\n{doc.text[offset:end].strip()}{more}"

    @tool(terminal=True, inline=True)
    def answer(self, text: str) -> str:
        """Give the final answer and end the episode.

        Args:
            text: the answer, as short as possible (a name, number or phrase).
        """
        self.final = text
        return "Answer recorded."

    def graded(self):
        """The judge's grade of this episode's answer (asked once), or None without a judge."""
        if self.judge is None:
            return None
        if self._grade is None:
            texts = {i: p.text for i in self.evidence if (p := self.corpus.passage(i)) is not None}
            self._grade = self.judge.grade(str(self.task.get("question", "")), self.final, self.answers,
                                           evidence_texts(texts, self.evidence))
        return self._grade

    def metrics(self) -> dict[str, Any]:
        em = scoring.exact_match(self.final, self.answers)
        grade = self.graded()
        return {
            **({} if grade is None else judged_metrics(grade)),
            "answered": self.final is not None,
            "em": em,
            "f1": scoring.f1(self.final, self.answers),
            "evidence_recall": scoring.evidence_recall(self.seen, self.evidence),
            "evidence_recall_at_5": scoring.recall_at_k(self.rankings, self.evidence, 5),
            "search_calls": len(self.queries),
            "open_calls": len(self.opened),
            "repeated_queries": scoring.repeated_queries(self.queries),
            "calls_per_hop": (len(self.queries) + len(self.opened)) / max(1, int(self.task.get("hops", 1))),
        }

    def reward(self) -> float:
        if self.final is None:
            return 0.0
        w, grade = self.evidence_weight, self.graded()
        answer = scoring.f1(self.final, self.answers) if grade is None else grade.score
        return (1 - w) * answer + w * scoring.evidence_recall(self.seen, self.evidence)

    def tasks(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """Questions over the Wikipedia summaries of the kind ``questions`` (needs a ``wiki`` corpus)."""
        if self.questions == "quote":
            return quote_tasks(self.shared_corpus, n, seed, self.method, articles=self.quote_articles)
        return wiki_tasks(self.shared_corpus, n, seed)

    def oracle(self, task: Mapping[str, Any]) -> TextPolicy:
        return SearchOracle(task, k=self.oracle_k)


QUESTION_KINDS = ("description", "quote")
SNIPPETS = ("head", "match")
_SENTENCE = re.compile(r"[^.!?]+(?:[.!?]+|$)")
_TERM = re.compile(r"\w+")


def match_snippet(text: str, query: str) -> str:
    """The sentence of ``text`` sharing most distinct words with ``query`` (the first on ties),
    with "… " / " …" where text was left out."""
    terms = {w.lower() for w in _TERM.findall(query)}
    best, best_score = None, 0
    for m in _SENTENCE.finditer(text):
        score = len(terms & {w.lower() for w in _TERM.findall(m.group())})
        if score > best_score:
            best, best_score = m, score
    if best is None:
        return text
    start, end = best.start() + len(best.group()) - len(best.group().lstrip()), best.end()
    return ("… " if start > 0 else "") + text[start:end].strip() + (" …" if text[end:].strip() else "")


def wiki_tasks(corpus: Corpus, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` questions "which article is described as …?" whose answer is a title in ``corpus``.

    Kept: descriptions of at least three words, unique in the collection, sharing no
    word with the title (so the title cannot be read off the question).
    """
    from k3rl.envs.sources import wiki_records

    records = [r for r in wiki_records() if corpus.passage(f"{r['id']}#0") is not None]
    counts: dict[str, int] = {}
    for r in records:
        key = scoring.normalize_answer(r.get("description") or "")
        counts[key] = counts.get(key, 0) + 1
    usable = []
    for r in records:
        desc = (r.get("description") or "").strip()
        key = scoring.normalize_answer(desc)
        title_words = set(scoring.normalize_answer(r["title"]).split())
        if len(key.split()) >= 3 and counts[key] == 1 and not title_words & set(key.split()):
            usable.append(r)
    if n > len(usable):
        raise ValueError(f"only {len(usable)} usable wiki questions in corpus {corpus.name!r}, asked for {n}")
    rng = random.Random(f"wiki-tasks:{seed}")
    picked = rng.sample(usable, n)
    return [
        {
            "id": f"wiki-{seed}-{i}",
            "question": (f'Which Wikipedia article is described as "{r["description"]}" '
                         f'(topic: {r.get("topic", "")})? Answer with its title.'),
            "answers": [r["title"]],
            "evidence": [f"{r['id']}#0"],
            "hops": 1,
        }
        for i, r in enumerate(picked)
    ]


_WORD = re.compile(r"[A-Za-z]+")
_EDGE = "\"'()[],.;:!?"


# Draws in a row that yield no new quote after which a closed world of `articles` is taken as exhausted.
QUOTE_DROUGHT = 500


def quote_tasks(corpus: Corpus, n: int, seed: int = 0, method: str = "bm25", words: int = 5,
                articles: int | None = None) -> list[dict[str, Any]]:
    """``n`` questions "which article contains the words "…"?" whose answer is a title in ``corpus``.

    The quote is ``words`` consecutive alphabetic words of an article's first passage,
    none of them a word of the title (the title cannot be read off the question); a
    quote is kept only when searching it ranks that passage first, so every task is
    solvable in one search. With ``articles=None`` every task is about a different
    article. With ``articles=N`` the tasks quote N fixed articles (the same N for every
    seed), so the answers come from a closed set of N titles and tasks of different
    seeds differ in the quote only (a small world for models trained from scratch).
    """
    docs = sorted(corpus.documents)
    if articles is not None:
        if articles < 1:
            raise ValueError(f"articles must be ≥ 1, got {articles}")
        random.Random("quote-articles").shuffle(docs)
        docs = [d for d in docs if _quotable(corpus, d)][:articles]
        if len(docs) < articles:
            raise ValueError(f"only {len(docs)} articles of corpus {corpus.name!r} can be quoted, asked for {articles}")
    rng = random.Random(f"quote-tasks:{seed}")
    if articles is None:
        rng.shuffle(docs)
        order = iter(docs)
    else:
        order = (rng.choice(docs) for _ in range(200 * n))
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    misses = 0
    for doc_id in order:
        if len(out) == n:
            break
        quote = _pick_quote(corpus, doc_id, rng, words, method)
        if quote is None or quote in seen:
            misses += 1
            # a closed world of N articles holds a bounded number of quotes: once QUOTE_DROUGHT draws in a row
            # add nothing it is exhausted (asking for too many used to search 200·n times before failing)
            if articles is not None and misses >= QUOTE_DROUGHT:
                break
            continue
        misses = 0
        seen.add(quote)
        passage = corpus.passage(f"{doc_id}#0")
        out.append({
            "id": f"quote-{seed}-{len(out)}",
            "question": f'Which Wikipedia article contains the words "{quote}"? Answer with its title.',
            "answers": [passage.title],
            "evidence": [passage.id],
            "hops": 1,
        })
    if len(out) < n:
        raise ValueError(f"only {len(out)} quote questions could be made from corpus {corpus.name!r}, asked for {n}")
    return out


def _quotable(corpus: Corpus, doc_id: str) -> bool:
    passage = corpus.passage(f"{doc_id}#0")
    return passage is not None and bool(passage.title) and len(passage.text.split()) >= 40


def _pick_quote(corpus: Corpus, doc_id: str, rng: random.Random, words: int, method: str) -> str | None:
    """A quote of ``words`` words from the first passage of ``doc_id`` that ranks it first, or None."""
    passage = corpus.passage(f"{doc_id}#0")
    if passage is None or not passage.title:
        return None
    title_words = set(scoring.normalize_answer(passage.title).split())
    # words without the punctuation around them; a quote never spans a sentence end
    tokens = [(w.strip(_EDGE), w.endswith((".", "!", "?", ";", ":"))) for w in passage.text.split()]
    starts = list(range(max(0, len(tokens) - words + 1)))
    rng.shuffle(starts)
    for i in starts[:8]:
        span = [w for w, _ in tokens[i:i + words]]
        if any(end for _, end in tokens[i:i + words - 1]):
            continue
        if not all(_WORD.fullmatch(w) for w in span) or title_words & {w.lower() for w in span}:
            continue
        quote = " ".join(span)
        hits = corpus.search(quote, 1, method)
        if hits and hits[0].passage.id == passage.id:
            return quote
    return None
