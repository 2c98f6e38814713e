"""Tests of the search environment: tools, safe ids, paging, rewards, tasks and the oracle."""

from __future__ import annotations

import pytest

from k3rl.envs import Budget, Episode, format_call, run_episode
from k3rl.envs.corpus import Corpus, Document
from k3rl.envs.search import SearchEnv, wiki_tasks


@pytest.fixture()
def small_env():
    long_text = " ".join(f"Sentence number {i} of the long chronicle." for i in range(200))
    docs = [
        Document("owl", "Owl", "Owls are nocturnal birds of prey with large eyes and silent flight."),
        Document("oak", "Oak", "The oak is a tree that produces acorns; its wood is hard and durable."),
        Document("chronicle", "Chronicle", long_text),
    ]
    return SearchEnv(corpus=Corpus.from_documents(docs, chunk_words=60), page_chars=500)


TASK = {"question": "Which bird hunts at night?", "answers": ["owl", "owls"], "evidence": ["owl#0"]}


def test_search_open_answer_flow(small_env):
    ep = Episode(small_env, TASK)
    assert ep.messages[1]["content"] == "Question: Which bird hunts at night?"
    obs = ep.step(format_call("search", {"query": "nocturnal bird", "k": 2})).observation
    assert obs.startswith('Results for "nocturnal bird":') and "[1] owl#0 (document owl: \"Owl\")" in obs
    obs = ep.step(format_call("open", {"doc_id": "owl"})).observation
    assert obs.startswith("Document owl: Owl (characters 0-") and "[end of document]" in obs
    step = ep.step(format_call("answer", {"text": "Owls"}))
    assert step.done and ep.finish_reason == "answered"
    info = ep.info
    assert info["em"] == 1.0 and info["f1"] == 1.0 and info["evidence_recall"] == 1.0
    assert info["search_calls"] == 1 and info["open_calls"] == 1 and info["calls_by_name"] == {"search": 1, "open": 1, "answer": 1}
    assert ep.reward == pytest.approx(1.0)


def test_open_pages_through_a_long_document(small_env):
    ep = Episode(small_env, TASK, Budget(max_turns=None, max_tool_calls=None))
    obs = ep.step(format_call("open", {"doc_id": "chronicle"})).observation
    pages, offset = [obs], None
    while "[continues:" in pages[-1]:
        offset = int(pages[-1].rsplit("offset=", 1)[1].rstrip(")]"))
        pages.append(ep.step(format_call("open", {"doc_id": "chronicle", "offset": offset})).observation)
    assert len(pages) > 5 and pages[-1].endswith("[end of document]")
    body = " ".join(p.split("\n", 1)[1].rsplit("\n", 1)[0] for p in pages)
    assert body.split() == small_env.corpus.document("chronicle").text.split()
    # a passage id opens its document at that passage
    second = small_env.corpus.passages_of("chronicle")[1]
    obs = ep.step(format_call("open", {"doc_id": second.id})).observation
    assert f"(characters {second.start}-" in obs


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/etc/passwd", "owl/../oak", "", "owl#99", "OWL"])
def test_open_rejects_unknown_ids_without_touching_files(small_env, bad):
    ep = Episode(small_env, TASK)
    step = ep.step(format_call("open", {"doc_id": bad}))
    assert not step.ok and not step.done
    assert step.observation.startswith("Error: unknown document id") and "search results" in step.observation
    assert "root:" not in step.observation


def test_search_argument_errors(small_env):
    ep = Episode(small_env, TASK)
    assert "k must be between 1 and 10, got 50" in ep.step(format_call("search", {"query": "oak", "k": 50})).observation
    assert "the query is empty" in ep.step(format_call("search", {"query": "  "})).observation
    assert ep.step(format_call("search", {"query": "xylophone zebra"})).observation == 'No results for "xylophone zebra".'
    assert "offset must be between" in ep.step(format_call("open", {"doc_id": "owl", "offset": 9999})).observation


def test_rewards_and_counts_hand_checked(small_env):
    queries = ["tree acorns", "Acorns tree", "owl"]
    turns = [format_call("search", {"query": q}) for q in queries] + [format_call("answer", {"text": "the oak"})]
    result = run_episode(small_env, TASK, lambda m: turns[sum(x["role"] == "assistant" for x in m)])
    info = result.info
    assert info["repeated_queries"] == 1 and info["search_calls"] == 3
    assert info["em"] == 0.0 and info["f1"] == 0.0 and info["evidence_recall"] == 1.0
    # no answer credit, only the evidence share of the reward
    assert result.reward == pytest.approx(0.1)
    partial = run_episode(small_env, {**TASK, "answers": ["barn owl"]}, lambda m: format_call("answer", {"text": "owl"}))
    assert partial.info["f1"] == pytest.approx(2 / 3) and partial.info["evidence_recall"] == 0.0
    assert partial.reward == pytest.approx(0.9 * 2 / 3)


def test_do_nothing_scores_zero(small_env):
    for policy in (lambda m: "I don't know.", lambda m: format_call("search", {"query": "owl"})):
        result = run_episode(small_env, TASK, policy)
        assert result.reward == 0.0


def test_per_task_corpus(small_env):
    task = {**TASK, "passages": [{"id": "a1", "text": "the heron fishes at dawn"}, {"id": "a2", "text": "owls hunt at night"}],
            "evidence": ["a2"]}
    ep = Episode(small_env, task)
    obs = ep.step(format_call("search", {"query": "hunt night"})).observation
    assert "[1] a2\nowls hunt at night" in obs and "owl#0" not in obs
    assert "Error: unknown document id" in ep.step(format_call("open", {"doc_id": "owl"})).observation


def test_wiki_tasks_deterministic_and_oracle_solves(wiki_corpus):
    env = SearchEnv(corpus=wiki_corpus)
    a, b, c = wiki_tasks(wiki_corpus, 200, 0), wiki_tasks(wiki_corpus, 200, 0), wiki_tasks(wiki_corpus, 200, 1)
    assert a == b and a != c
    for task in a[:20]:
        title = task["answers"][0].lower()
        assert not set(title.split()) & set(task["question"].lower().split('"')[1].split())
    results = [run_episode(env, t, env.oracle(t)) for t in a]
    solved = sum(r.info["em"] == 1.0 for r in results)
    assert solved / len(results) >= 0.99
    assert sum(r.info["evidence_recall"] for r in results) / len(results) >= 0.99
    # the question's words alone retrieve the article most of the time (paraphrase recall)
    assert sum(r.info["search_calls"] == 1 for r in results) / len(results) > 0.6
    nothing = [run_episode(env, t, lambda m: "no idea").reward for t in a[:50]]
    assert sum(nothing) == 0.0


# ---- quote questions (the quickstart's task) and the compact tool list


def test_quote_tasks_are_solvable_in_one_search_and_hide_the_title(wiki_corpus):
    from k3rl.envs import scoring
    from k3rl.envs.search import quote_tasks

    env = SearchEnv(corpus=wiki_corpus, questions="quote", oracle_k=3, snippet_chars=100)
    tasks = quote_tasks(wiki_corpus, 40, seed=3)
    assert len({t["answers"][0] for t in tasks}) == 40  # one article per task without `articles`
    for task in tasks:
        quote = task["question"].split('"')[1]
        assert len(quote.split()) == 5
        assert not set(scoring.normalize_answer(task["answers"][0]).split()) & set(quote.lower().split())
        result = run_episode(env, task, env.oracle(task))
        calls = [m["content"] for m in result.messages if m["role"] == "assistant"]
        # search, then answer straight from the result list (its title is shown JSON-quoted)
        assert len(calls) == 2 and '"k": 3' in calls[0] and '"name": "answer"' in calls[1], calls
        assert result.reward == pytest.approx(1.0) and result.info["em"] == 1.0


def test_quote_articles_is_a_closed_world_shared_by_every_seed(wiki_corpus):
    from k3rl.envs.search import quote_tasks

    a = quote_tasks(wiki_corpus, 60, seed=0, articles=8)
    b = quote_tasks(wiki_corpus, 60, seed=1, articles=8)
    titles = {t["answers"][0] for t in a}
    assert len(titles) == 8 and {t["answers"][0] for t in b} == titles
    assert len({t["question"] for t in a}) == 60  # no repeated question within a seed
    assert {t["question"] for t in a} != {t["question"] for t in b}
    assert quote_tasks(wiki_corpus, 20, seed=0, articles=8) == a[:20]  # a prefix: SFT ⊆ RL tasks
    with pytest.raises(ValueError, match="only .* quote questions"):
        quote_tasks(wiki_corpus, 5000, seed=0, articles=2)


def test_search_env_names_bad_arguments():
    with pytest.raises(ValueError, match="questions: 'riddles'"):
        SearchEnv(corpus=None, questions="riddles")
    with pytest.raises(ValueError, match="oracle_k must be between 1 and max_k=10, got 11"):
        SearchEnv(corpus=None, oracle_k=11)
    with pytest.raises(ValueError, match="tool_prompt: 'yaml'"):
        SearchEnv(corpus=None, tool_prompt="yaml")


def test_compact_tool_prompt_lists_every_tool_in_one_line():
    full = SearchEnv(corpus=None).system_message()
    compact = SearchEnv(corpus=None, tool_prompt="compact").system_message()
    assert "- search(query: string, k: integer = 5): Search the collection" in compact
    assert "- open(doc_id: string, offset: integer = 0): Read a document page by page." in compact
    assert "- answer(text: string): Give the final answer and end the episode." in compact
    assert '"additionalProperties"' in full and '"additionalProperties"' not in compact
    assert len(compact) < len(full) / 2
    assert compact.split("<tools>")[0] == full.split("<tools>")[0]  # the same call syntax


def test_protocol_texts_cover_every_builtin_environment():
    from k3rl.envs.registry import protocol_texts

    texts = protocol_texts()
    assert any("- search(query: string" in t for t in texts) and any('"name": "search"' in t for t in texts)
    assert any('{"name": "answer", "arguments": {"text": ""}}' in t for t in texts)


def test_match_snippet_shows_the_sentence_that_matches_the_query():
    from k3rl.envs.search import match_snippet

    text = "Owls hunt at night. The gardener keeps a red lantern, and its number is 7. Oaks grow slowly."
    assert match_snippet(text, "gardener keeps lantern") == "… The gardener keeps a red lantern, and its number is 7. …"
    assert match_snippet(text, "owls night") == "Owls hunt at night. …"
    assert match_snippet(text, "zebra") == text  # nothing in common: the passage as it is
    docs = [Document("owl", "Owl", text)]
    env = SearchEnv(corpus=Corpus.from_documents(docs), snippet="match", snippet_chars=60)
    ep = Episode(env, {"question": "q", "answers": ["red"], "evidence": ["owl#0"]})
    obs = ep.step(format_call("search", {"query": "gardener lantern", "k": 1})).observation
    assert "… The gardener keeps a red lantern, and its number is 7. …"[:60] in obs
    with pytest.raises(ValueError, match="snippet: 'tail'"):
        SearchEnv(corpus=None, snippet="tail")


def test_an_exhausted_closed_world_fails_fast(wiki_corpus, monkeypatch):
    """Asking 2 fixed articles for more quotes than they hold fails once QUOTE_DROUGHT draws in a row add nothing,
    not after 200·n searches (5,000 questions took over ten minutes to refuse): the draws are counted."""
    import k3rl.envs.search as search

    draws = []
    pick = search._pick_quote
    monkeypatch.setattr(search, "_pick_quote", lambda *a, **k: draws.append(1) or pick(*a, **k))
    with pytest.raises(ValueError, match="only (\\d+) quote questions") as err:
        search.quote_tasks(wiki_corpus, 10**6, seed=3, articles=2)
    found = int(err.value.args[0].split()[1])
    assert 0 < found < len(draws) <= found * search.QUOTE_DROUGHT + search.QUOTE_DROUGHT
