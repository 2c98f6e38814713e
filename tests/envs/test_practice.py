"""envs/longctx/practice.py: plain-text instances and retrieval-rich practice documents."""

from __future__ import annotations

import json
import re

import pytest

from k3rl.envs.longctx.haystack import generate
from k3rl.envs.longctx.needle import RECORD
from k3rl.envs.longctx.practice import (
    PLAIN_QA,
    PRACTICE_SEED_BASE,
    plain_answer,
    plain_prompt,
    practice_document,
    practice_episodes,
    practice_tasks,
    write_practice_corpus,
    write_practice_episodes,
)

COLOUR = {"ask": "colour", "paraphrase_rate": 0.0}
QA = re.compile(r"\nQuestion: (.*)\nAnswer: (.*)\n")
ASKED = re.compile(r"What colour is the (.+) kept by the (.+)\?")


def _document_and_qa(doc: str) -> tuple[str, list[tuple[str, str]]]:
    document, _, tail = doc.partition("</document>\n")
    return document, QA.findall(tail)


def test_plain_prompt_is_the_haystack_then_the_question():
    inst = generate("needle", 3, 600, "wiki", distractors=0, **COLOUR)
    prompt = plain_prompt(inst)
    assert prompt.startswith("<document>\n[p00000] ") and prompt.endswith(PLAIN_QA.format(question=inst.question))
    assert all(f"[{pid}] {text}" in prompt for pid, text in inst.passages)
    without = plain_prompt(inst, [(p, t) for p, t in inst.passages if p not in inst.evidence])
    assert "keeps a" in prompt and "keeps a" not in without  # the one record sits in the evidence passage
    assert plain_answer("red") == " red\n"


def test_practice_documents_are_deterministic_and_seeded():
    a = practice_document("needle", 7, 400, questions=4, **COLOUR)
    assert a == practice_document("needle", 7, 400, questions=4, **COLOUR)
    assert a != practice_document("needle", 8, 400, questions=4, **COLOUR)


@pytest.mark.parametrize("distractors", [0, 2])
def test_every_record_a_question_finds_gives_its_answer(distractors):
    """Near misses and other instances' records share keepers and objects: every record a kept question's key
    finds gives the stated answer; the ambiguous questions are dropped, never mislabelled."""
    kept = dropped = 0
    for seed in range(12):
        doc = practice_document("needle", seed, 700, questions=10, distractors=distractors, **COLOUR)
        document, qa = _document_and_qa(doc)
        records = re.findall(RECORD.format(role="(\\w+)", colour="(\\w+)", obj="(\\w+)", value="\\d+")
                             .replace(".", r"\."), document)
        for question, answer in qa:
            obj, role = ASKED.fullmatch(question).groups()
            colours = [c for r, c, o in records if (r, o) == (role, obj)]
            assert colours and set(colours) == {answer}, (question, colours)
        kept += len(qa)
        dropped += 10 - len(qa)
    assert kept > 0
    if distractors:  # with near misses some keys repeat: those questions are left out
        assert dropped > 0


def test_filler_scales_the_real_text():
    dense = practice_document("needle", 1, 800, questions=4, filler=0.2, **COLOUR)
    sparse = practice_document("needle", 1, 800, questions=4, filler=1.0, **COLOUR)
    assert dense.count("\n[p") < sparse.count("\n[p")
    assert len(_document_and_qa(dense)[1]) == len(_document_and_qa(sparse)[1]) == 4


def test_multihop_practice_answers_follow_the_chain():
    from k3rl.envs.longctx.families import SOLVERS
    from k3rl.envs.longctx.practice import _solve

    doc = practice_document("multihop", 2, 700, questions=4)
    document, qa = _document_and_qa(doc)
    passages = re.findall(r"\[(p\d{5})\] (.*)", document)
    assert qa and "multihop" in SOLVERS
    for question, answer in qa:
        assert _solve("multihop", question, passages) == answer


def test_write_practice_corpus_is_jsonl_of_interleaved_families(tmp_path):
    path = write_practice_corpus(tmp_path / "p.jsonl", {"needle": 3, "multihop": 2}, 300, seed=1, questions=2)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5 and all(r["text"].startswith("<document>\n") for r in rows)
    assert "colour" in rows[0]["text"] or "registry" in rows[0]["text"]  # needle first, then multihop
    assert not list(tmp_path.glob(".*"))  # written atomically: no temporary file left


@pytest.mark.parametrize("bad", [{"family": "needel"}, {"questions": 0}, {"filler": 1.5}, {"lenght": 300}])
def test_bad_arguments_are_named(bad):
    kwargs = {"family": "needle", "seed": 0, "length": 300, **bad}
    with pytest.raises(ValueError, match=next(iter(bad)).rstrip("l") if "family" not in bad else "needel"):
        practice_document(**kwargs)


def test_practice_tasks_are_never_environment_tasks():
    import k3rl.envs as envs

    env = envs.make("needle", serve="context", length=1024, source="wiki")
    practice = practice_tasks("needle", 2000, seed=0)
    assert all(PRACTICE_SEED_BASE <= t["seed"] < 2 * PRACTICE_SEED_BASE for t in practice)
    assert all(0 <= t["seed"] < PRACTICE_SEED_BASE for s in range(3) for t in env.tasks(2000, s))
    assert practice == practice_tasks("needle", 2000, seed=0) != practice_tasks("needle", 2000, seed=1)


@pytest.mark.parametrize("serve", ["context", "search"])
def test_practice_episodes_are_the_environments_oracle_episodes(serve):
    import k3rl.envs as envs

    options = {"distractors": 0, "unanswerable_rate": 0.0, **COLOUR}
    episodes = list(practice_episodes("needle", 3, 600, seed=2, serve=serve, **options))
    env = envs.make("needle", serve=serve, length=600, source="wiki", **options)
    assert len(episodes) == 3
    for messages, task in zip(episodes, practice_tasks("needle", 3, seed=2)):
        inst = env.instance(task)
        assert [m["role"] for m in messages][:2] == ["system", "user"] and messages[-1]["role"] == "assistant"
        assert inst.question in messages[1]["content"]
        assert f'"text": "{inst.answers[0]}"' in messages[-1]["content"]  # the oracle's answer call, gold
        if serve == "search":
            assert [m["role"] for m in messages].count("tool") >= 1  # it searched before answering
        else:
            assert all(f"[{pid}] {text}" in messages[1]["content"] for pid, text in inst.passages)


def test_write_practice_episodes(tmp_path):
    path = write_practice_episodes(tmp_path / "ep.jsonl", {"needle": 3, "multihop": 2}, 700, seed=1, source="wiki")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5 and all(set(r) == {"messages"} for r in rows)
    from k3rl.envs.registry import UnknownEnvironment

    firsts = [practice_tasks(f, 1, seed=1)[0] for f in ("needle", "multihop")]
    assert [r["messages"][-1]["content"] for r in rows[:2]] == [
        next(practice_episodes(t["family"], 1, 700, seed=1))[-1]["content"] for t in firsts]  # interleaved
    with pytest.raises(UnknownEnvironment, match="unknown environment 'needles'"):
        write_practice_episodes(tmp_path / "x.jsonl", {"needles": 1}, 700)
