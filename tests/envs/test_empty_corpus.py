"""Corpus inputs are named errors: an empty or blank input file (which `datasets` reports as a bare
`StopIteration`), passages with no word to index (which the BM25 library reports as `max()` of an empty
sequence), and JSONL read strictly (deep nesting crashed `datasets`' reader) — each names the file and line or
the corpus."""

from __future__ import annotations

import pytest

from k3rl.envs.corpus import Corpus, CorpusConfig, Document, Passage, load_corpus
from k3rl.envs.search import SearchEnv
from k3rl.envs.sources import CorruptCorpusError


def corpus_of(tmp_path, name: str, data: bytes, suffix: str = ".jsonl"):
    path = tmp_path / f"{name}{suffix}"
    path.write_bytes(data)
    return load_corpus(CorpusConfig(name=name, source=None, files=[str(path)], cache_dir=str(tmp_path / "cache")))


@pytest.mark.parametrize("data", [b"", b"\n\n  \n"])
def test_an_empty_file_is_named(tmp_path, data):
    with pytest.raises(CorruptCorpusError, match=r"empty\.jsonl:1: the file is empty"):
        corpus_of(tmp_path, "empty", data)


def test_passages_without_a_word_to_index_are_named(tmp_path):
    with pytest.raises(CorruptCorpusError, match="corpus 'stop': none of its 1 passages has a word to index"):
        corpus_of(tmp_path, "stop", b"a", ".txt")
    with pytest.raises(CorruptCorpusError, match="corpus 'task': none of its 2 passages"):
        Corpus.from_passages([Document("d", "", "the")], [Passage("d#0", "d", "", "the", 0, 3),
                                                          Passage("d#1", "d", "", "a ?", 0, 3)], name="task")
    # a task whose passages hold nothing searchable is refused when its episode starts, by name
    with pytest.raises(CorruptCorpusError, match="none of its 1 passages"):
        SearchEnv(corpus=None).reset({"question": "Q?", "answers": ["x"],
                                      "passages": [{"id": "p", "title": "", "text": "of the"}]})


@pytest.mark.parametrize("data, message", [
    (b'{"text": "x", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", r"deep\.jsonl:1: nested too deeply"),
    (b'{"text": "fine"}\n{"text": "x", "score": NaN}\n', r"deep\.jsonl:2: NaN is not a JSON number"),
    (b'{"text": "fine"}\n\n{"text": 7}\n', r"deep\.jsonl:3: 'text' is int, not text"),
    (b'[{"text": "fine"},\n {"body": "x"}]\n', r"deep\.jsonl:1: record 1: no 'text' field \(fields: body\)"),
])
def test_a_corpus_jsonl_is_read_strictly(tmp_path, data, message):
    """Corpus JSONL is read by envs/jsonl.py: deep nesting (which crashed `datasets`' reader with a segmentation
    fault), NaN and wrong types are named by line."""
    with pytest.raises(CorruptCorpusError, match=message):
        corpus_of(tmp_path, "deep", data)
