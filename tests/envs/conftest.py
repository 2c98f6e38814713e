"""Shared fixtures for the environment tests: corpora cached once per session under a tmp dir."""

from __future__ import annotations

import json

import pytest

from k3rl.envs.corpus import CorpusConfig, load_corpus


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("corpora")


@pytest.fixture(scope="session")
def wiki_corpus(cache_dir):
    """The full Wikipedia-summaries corpus with BM25 (built once, ~5 s)."""
    return load_corpus(CorpusConfig(name="wiki", source="wiki", cache_dir=str(cache_dir)))


@pytest.fixture()
def jsonl_file(tmp_path):
    """A small JSONL corpus of four documents."""
    rows = [
        {"id": "owl", "title": "Owl", "text": "Owls are nocturnal birds of prey with large eyes and silent flight."},
        {"id": "oak", "title": "Oak", "text": "The oak is a tree that produces acorns; its wood is hard and durable."},
        {"id": "tide", "title": "Tide", "text": "Tides are the rise and fall of sea levels caused by the Moon's gravity."},
        {"id": "rust", "title": "Rust", "text": "Rust is iron oxide formed when iron reacts with oxygen and water."},
    ]
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
