"""Tests of the long-context task families: determinism, sizing, serving both ways, oracles, scorers."""

from __future__ import annotations

import re

import pytest

from k3rl.envs import longctx as L
from k3rl.envs import make, run_episode, scoring
from k3rl.envs.base import as_token_counter
from k3rl.envs.index import dense_model_dir
from k3rl.envs.longctx import needle
from k3rl.envs.search_oracle import parse_results

FAMILIES = list(L.FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_generators_are_deterministic_and_seed_dependent(family):
    a = L.generate(family, 11, length=4096, source="wiki")
    b = L.generate(family, 11, length=4096, source="wiki")
    assert a == b
    others = [L.generate(family, s, length=4096, source="wiki") for s in (12, 13, 14)]
    assert all(o.passages != a.passages for o in others)
    assert len({o.question for o in others} | {a.question}) > 1
    # the question does not depend on the length: one seed gives an effective-length curve
    longer = L.generate(family, 11, length=12000, source="wiki")
    assert longer.question == a.question and longer.answers == a.answers and len(longer.passages) > len(a.passages)


@pytest.mark.parametrize("family", FAMILIES)
def test_sized_to_the_target_and_evidence_holds_the_facts(family):
    for seed in range(20):
        inst = L.generate(family, seed, length=6000, source="wiki")
        n = scoring_tokens(inst)
        assert 0.9 * 6000 <= n <= 6000 and inst.meta["tokens"] == n
        ids = [pid for pid, _ in inst.passages]
        assert ids == [f"p{i:05d}" for i in range(len(ids))]
        assert set(inst.evidence) <= set(ids) and inst.evidence == sorted(inst.evidence)
        if not inst.unanswerable:
            assert inst.evidence
        texts = dict(inst.passages)
        marks = r"registry number|apprentice|born in|mayor|banks of|ferry|Ledger entry|Memo:"
        assert all(re.search(marks, texts[e]) for e in inst.evidence)


def scoring_tokens(inst):
    return as_token_counter(None)(L.render_context(inst))


def test_sizing_with_a_real_tokenizer():
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(dense_model_dir() / "tokenizer.json"))
    count = as_token_counter(tok)
    for length in (4096, 16384):
        inst = L.generate("multihop", 5, length=length, source="wiki", tokenizer=tok)
        n = count(L.render_context(inst))
        assert 0.95 * length <= n <= length and inst.meta["tokens"] == n


def test_needle_paraphrase_has_no_literal_overlap():
    seen = {True: 0, False: 0}
    for seed in range(40):
        inst = L.generate("needle", seed, length=3000, source="wiki", unanswerable_rate=0.0)
        seen[inst.meta["paraphrase"]] += 1
        needle = next(t for pid, t in inst.passages if pid == inst.evidence[0])
        key = re.search(r"The (\w+) keeps a (\w+) (\w+), and its registry number", needle).groups()
        key_words = set(" ".join(key).split())
        q_words = set(re.findall(r"\w+", inst.question.lower()))
        if inst.meta["paraphrase"]:
            assert not key_words & q_words
        else:
            assert key_words <= q_words
        # near-miss distractors share two of the three key words
        misses = [m.groups() for _, t in inst.passages for m in re.finditer(r"The (\w+) keeps a (\w+) (\w+), and its registry number", t)]
        assert len(misses) == 5 and sum(sum(x == y for x, y in zip(m, key)) == 2 for m in misses) == 4
    assert seen[True] > 5 and seen[False] > 5


def test_multihop_chains_and_invented_names():
    hops = set()
    for seed in range(40):
        inst = L.generate("multihop", seed, length=4000, source="wiki")
        hops.add(inst.hops)
        assert 1 <= inst.hops <= 4
        if not inst.unanswerable:
            assert len(inst.evidence) == inst.hops
            words = L.pool_words("wiki")
            assert not any(w.lower() in words for w in inst.answers[0].split())
    assert hops == {1, 2, 3, 4}


def test_a_multihop_instance_has_a_depth_per_evidence_passage():
    """`Instance.evidence_depths`: every hop's passage, in reading order, at its index over the last index."""
    inst = next(i for s in range(40) if not (i := L.generate("multihop", s, length=4000, source="wiki",
                                                              hops=3)).unanswerable)
    ids = [pid for pid, _ in inst.passages]
    depths = inst.evidence_depths()
    assert len(depths) == len(inst.evidence) == 3
    assert depths == sorted(ids.index(e) / (len(ids) - 1) for e in inst.evidence)
    assert len(set(depths)) == 3 and all(0 <= d <= 1 for d in depths)
    none = next(i for s in range(200) if (i := L.generate("needle", s, length=2500, source="wiki")).unanswerable)
    assert none.evidence_depths() == []


@pytest.mark.parametrize("family", FAMILIES)
def test_unanswerable_share(family):
    insts = [L.generate(family, s, length=2500, source="wiki") for s in range(150)]
    share = sum(i.unanswerable for i in insts) / len(insts)
    assert 0.03 <= share <= 0.2
    assert all(i.answers == ["unanswerable"] for i in insts if i.unanswerable)


@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_solves_in_context(family):
    env = make(family, serve="context", length=3000, source="wiki")
    tasks = env.tasks(150, seed=3)
    assert tasks == env.tasks(150, seed=3) and tasks != env.tasks(150, seed=4)
    results = [run_episode(env, t, env.oracle(t)) for t in tasks]
    assert sum(r.info["em"] for r in results) / len(results) >= 0.99
    assert sum(r.info["evidence_recall"] for r in results) / len(results) >= 0.99
    assert all(r.info["tool_calls"] == 0 and r.info["finish_reason"] == "answered" for r in results)
    nothing = [run_episode(env, t, lambda m: "I cannot tell.").reward for t in tasks[:30]]
    assert sum(nothing) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_solves_behind_search(family):
    env = make(family, serve="search", length=3000, source="wiki")
    tasks = env.tasks(60, seed=5)
    results = [run_episode(env, t, env.oracle(t)) for t in tasks]
    assert sum(r.info["em"] for r in results) / len(results) >= 0.99
    assert all(r.info["search_calls"] >= 1 for r in results)
    # the same instance is served both ways: the search corpus is the in-context haystack
    inst = env.instance(tasks[0])
    assert [p["id"] for p in inst.search_task()["passages"]] == [pid for pid, _ in inst.passages]
    nothing = [run_episode(env, t, lambda m: "I cannot tell.").reward for t in tasks[:20]]
    assert sum(nothing) == 0.0


def test_multihop_search_efficiency():
    env = make("multihop", serve="search", length=3000, source="wiki", unanswerable_rate=0.0)
    for task in env.tasks(20, seed=9):
        r = run_episode(env, task, env.oracle(task))
        eff = scoring.tool_efficiency(r.info, r.info["hops"])
        assert eff["calls_per_hop"] == 1.0 and eff["repeated_queries"] == 0 and eff["solved_within_budget"] == 1.0


def test_shakespeare_haystack():
    inst = L.generate("ith", 1, length=8000, source="shakespeare")
    text = L.render_context(inst)
    assert "ACT" in text or "Enter" in text or "SCENE" in text.upper()
    answer, evidence = L.solve_in_context("ith", inst.question, inst.passages)
    assert [answer] == inst.answers and evidence == inst.evidence


def test_too_small_length_is_a_clear_error():
    with pytest.raises(ValueError, match="too small"):
        L.generate("aggregate", 1, length=300, source="wiki")
    with pytest.raises(TypeError, match="unknown option"):
        L.generate("needle", 1, length=3000, source="wiki", colour="red")
    with pytest.raises(ValueError, match="serve must be"):
        make("needle", serve="radio")


def test_short_cells_build_whenever_the_facts_fit():
    """A cell a little longer than the facts builds for every seed (the haystack skips a first passage that alone
    overflows it, and a prompt the estimates overfill is rebuilt with less filler), within its length; a length the
    facts cannot fit is the named error."""
    count = as_token_counter(None)
    built = {}
    for family, length in [("aggregate", 600), ("ith", 500), ("multihop", 400)]:
        for seed in range(60):
            try:
                inst = L.generate(family, seed, length, "wiki")
            except ValueError as e:
                assert re.fullmatch(rf"length {length} is too small for a {family} task with \d+ facts", str(e)), e
                continue
            assert count(L.render_context(inst)) <= length and inst.passages
            built[family] = built.get(family, 0) + 1
    assert built["aggregate"] >= 20 and built["ith"] >= 50 and built["multihop"] >= 50, built
    # seed 1 of aggregate at 600 tokens: its first passage alone overflowed the cell, which used to be an error
    assert L.generate("aggregate", 1, 600, "wiki").meta["tokens"] <= 600


def test_scorers_hand_checked():
    assert scoring.normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert scoring.exact_match("the Owl.", ["owl"]) == 1.0 and scoring.exact_match(None, ["owl"]) == 0.0
    assert scoring.exact_match("owls", ["owl"]) == 0.0
    assert scoring.f1("barn owl", ["owl"]) == pytest.approx(2 / 3)
    assert scoring.f1("a red fox", ["red fox", "fox"]) == 1.0
    assert scoring.f1("cat", ["dog"]) == 0.0 and scoring.f1("", [""]) == 1.0
    assert scoring.evidence_recall(["a", "b", "z"], ["a", "b", "c", "d"]) == 0.5
    assert scoring.evidence_recall([], []) == 1.0
    assert scoring.recall_at_k([["x", "a"], ["b", "y", "c"]], ["a", "b", "c"], 1) == pytest.approx(1 / 3)
    assert scoring.recall_at_k([["x", "a"], ["b", "y", "c"]], ["a", "b", "c"], 3) == 1.0
    assert scoring.repeated_queries(["Red fox", "fox red", "the red fox", "wolf"]) == 2
    eff = scoring.tool_efficiency({"tool_calls": 6, "repeated_queries": 1, "em": 1.0, "truncated": False}, hops=3)
    assert eff == {"calls_per_hop": 2.0, "repeated_queries": 1.0, "solved_within_budget": 1.0}
    assert scoring.tool_efficiency({"tool_calls": 2, "em": 1.0, "truncated": True})["solved_within_budget"] == 0.0


def test_parse_helpers_round_trip():
    inst = L.generate("needle", 2, length=2000, source="wiki")
    question, passages = L.parse_context(L.render_context(inst))
    assert question == inst.question and passages == inst.passages
    obs = "Results for \"x\":\n\n[1] p00003\nline one\n\nline two\n\n[2] p00007\nthird"
    assert parse_results(obs) == [("p00003", "line one\n\nline two"), ("p00007", "third")]


def test_one_million_token_haystack():
    inst = L.generate("multihop", 4, length=1_000_000, source="mixed")
    n = inst.meta["tokens"]
    assert 0.98 * 1_000_000 <= n <= 1_000_000 and len(inst.passages) > 5000
    answer, _ = L.solve_in_context("multihop", inst.question, inst.passages)
    assert [answer] == inst.answers


def test_needle_colour_question_has_one_right_record():
    """ask='colour': the answer is the target's colour; every near miss differs in the keeper or the
    object (never only in the colour), so the question has exactly one matching record."""
    for seed in range(60):
        inst = L.generate("needle", seed, length=1200, source="wiki", ask="colour", distractors=3,
                          paraphrase_rate=0.5, unanswerable_rate=0.0)
        m = re.match(r"What colour is the (.+?) (?:kept by|that) the (.+?)(?: looks after)?\?$", inst.question)
        assert m, inst.question
        obj, role = (needle.CANONICAL.get(g, g) for g in m.groups())
        text = " ".join(t for _, t in inst.passages)
        records = re.findall(r"The (\w+) keeps an? (\w+) (\w+), and its registry number is \d+\.", text)
        assert len(records) == 4
        matching = [c for r, c, o in records if (r, o) == (role, obj)]
        assert matching == inst.answers and inst.answers[0] in L.COLOURS
    with pytest.raises(ValueError, match="ask: 'number' or 'colour'"):
        L.generate("needle", 0, length=1200, source="wiki", ask="size")


def test_needle_colour_behind_search_is_solved_in_one_search():
    env = make("needle", serve="search", source="wiki", length=1200, ask="colour", distractors=1,
               paraphrase_rate=0.0, unanswerable_rate=0.0, max_k=5, oracle_k=1, tool_prompt="compact")
    solved = 0
    for task in env.tasks(100, seed=5):
        result = run_episode(env, task, env.oracle(task))
        calls = [m["content"] for m in result.messages if m["role"] == "assistant"]
        assert '"k": 1' in calls[0] and len(calls) == 2
        solved += result.info["em"] == 1.0
    assert solved >= 95



def test_minimal_prompt_for_models_trained_from_scratch():
    """`tool_prompt="minimal"`: the call syntax and bare signatures, a one-line task, less than half
    the characters of `compact`; the oracle still solves the episodes through it."""
    kw = dict(serve="search", source="wiki", length=1200, ask="colour", distractors=0, paraphrase_rate=0.0,
              unanswerable_rate=0.0, max_k=5, oracle_k=1)
    compact, minimal = make("needle", tool_prompt="compact", **kw), make("needle", tool_prompt="minimal", **kw)
    task = compact.tasks(1, seed=3)[0]
    (c_sys, c_user), (m_sys, m_user) = (run_episode(e, task, e.oracle(task)).messages[:2] for e in (compact, minimal))
    assert m_sys["content"].splitlines()[1:] == ["- search(query: string, k: integer = 5)",
                                                 "- open(doc_id: string, offset: integer = 0)", "- answer(text: string)"]
    assert "<tool_call>" in m_sys["content"] and "`answer` ends the conversation" in m_sys["content"]
    assert m_user["content"].endswith(c_user["content"].split("\n\n")[-1])  # the same question
    assert len(m_sys["content"]) + len(m_user["content"]) < (len(c_sys["content"]) + len(c_user["content"])) / 2
    solved = sum(run_episode(minimal, t, minimal.oracle(t)).info["em"] == 1.0 for t in minimal.tasks(40, seed=5))
    assert solved >= 38


@pytest.mark.parametrize("serve", ["context", "search"])
def test_unknown_options_are_refused_with_the_valid_ones(serve):
    """A typo (`lenght`) is a TypeError naming it and the valid arguments, not silently ignored."""
    import k3rl.envs as envs

    with pytest.raises(TypeError, match=r"got unexpected argument\(s\) lenght; it takes .*length.*paraphrase_rate"):
        envs.make("needle", serve=serve, lenght=1000)
    assert envs.make("needle", serve=serve, length=600, distractors=1).options == {"distractors": 1}
