"""`k3rl eval` on real tasks: the `file` family (envs/longctx/taskfile.py) from a JSONL file this test writes —
HotpotQA-style comparison and bridge questions, an unanswerable one, one whose evidence is in a corpus, one
long document — in context and behind search at two lengths, with a random tiny K3 and the baselines.

Checks: the oracle solves every task and finds every evidence passage (behind search by searching); the
closed-book floor stays low; the gold passages are in each haystack at the recorded depth among other tasks'
passages and filler, within the length; the same seed rebuilds the same haystacks, another seed others; a
file with fewer tasks than `eval.num_tasks` runs all of them and says so; each bad input is a named error
before anything is written."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from k3rl.rl.commands.eval import main
from k3rl.rl.eval.rows import read_rows

REPO = Path(__file__).parents[2]
LENGTHS = [512, 1024]

CORPUS_DOCS = [
    {"id": "owl", "title": "Owl", "text": "Owls are nocturnal birds of prey with large eyes and silent flight."},
    {"id": "oak", "title": "Oak", "text": "The oak is a tree that produces acorns; its wood is hard and durable."},
]
TASKS = [
    {"id": "hp-1", "question": "Which magazine was started first, Arthur's Magazine or First for Women?",
     "answers": ["Arthur's Magazine"],
     "passages": [{"id": "Arthur's Magazine", "title": "Arthur's Magazine",
                   "text": "Arthur's Magazine (1844–1846) was an American literary periodical published in Philadelphia."},
                  {"id": "First for Women", "title": "First for Women",
                   "text": "First for Women is a woman's magazine published by Bauer Media Group in the USA, started in 1989."},
                  {"id": "Radio City", "title": "Radio City", "text": "Radio City is India's first private FM radio station."}],
     "evidence": ["Arthur's Magazine", "First for Women"]},
    {"id": "hp-2", "question": "In which city was the painter of Blue Horses born?", "answers": ["Munich", "München"],
     "passages": [{"id": "a", "title": "Blue Horses", "text": "Blue Horses is a painting by Franz Marc from 1911."},
                  {"id": "b", "title": "Franz Marc", "text": "Franz Marc was a German painter, born in Munich in 1880."}]},
    {"id": "none-1", "question": "What is the capital of the island of Zorbia?", "answers": ["unanswerable"],
     "passages": [{"id": "z", "title": "Zorbia", "text": "Zorbia is an island of rivers and hills in an old novel."}],
     "evidence": []},
    {"id": "wiki-1", "question": "Which birds of prey hunt at night with silent flight?", "answers": ["owls"],
     "corpus": "corpus.yaml", "evidence": ["owl#0", "oak"]},
    {"id": "doc-1", "question": "How many lighthouses did the keeper Ansel Brandt tend?", "answers": ["three"],
     "passages": [{"id": "memoir", "title": "The Keeper's Memoir",
                   "text": "Ansel Brandt kept the lamps on the northern coast for forty years. " * 3
                   + "In all that time Ansel Brandt tended three lighthouses, each taller than the last."}],
     "meta": {"source": "a long-document QA set"}},
]


def write_tasks(folder: Path, tasks=TASKS) -> Path:
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in CORPUS_DOCS))
    (folder / "corpus.yaml").write_text(json.dumps({"name": "file-test", "files": [str(folder / "docs.jsonl")],
                                                    "cache_dir": str(folder / "cache")}))
    path = folder / "tasks.jsonl"
    path.write_text("".join((t if isinstance(t, str) else json.dumps(t)) + "\n" for t in tasks))
    return path


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("file-tasks"))


def args(out: Path, model: Path, tasks: Path, *extra: str) -> list[str]:
    return [str(REPO / "configs/eval/longctx.yaml"), f"run.output_dir={out}", "run.name=e", f"eval.model_path={model}",
            "eval.families=[file]", f"eval.tasks_path={tasks}", "eval.serve=[context,search]",
            f"eval.context_lengths=[{','.join(map(str, LENGTHS))}]", "eval.num_tasks=8", "eval.batch_size=8",
            "rollout.max_new_tokens=8", "rollout.max_turns=4", "rollout.max_context_tokens=2048", *extra]


def test_real_tasks_round_trip_with_the_oracle_at_the_ceiling_and_closed_book_at_the_floor(
        k3_dir, tasks_file, tmp_path, capsys):
    assert main(args(tmp_path, k3_dir, tasks_file)) == 0
    assert "file has 5 tasks (eval.tasks_path), fewer than eval.num_tasks=8" in capsys.readouterr().out
    rows = read_rows(tmp_path / "e" / "tasks.jsonl")
    assert Counter(r["runner"] for r in rows) == {"model": 20, "oracle": 20, "closed_book": 20}
    assert not [r for r in rows if r["error"]]
    assert all(r["prompt_tokens"] <= r["length"] for r in rows)
    cells = json.loads((tmp_path / "e" / "results.json").read_text())["cells"]
    assert len(cells) == 3 * 2 * len(LENGTHS)
    for c in cells:
        assert c["tasks"] == 5, c
        if c["runner"] == "oracle":
            assert c["success"] >= 0.99, c
        if c["runner"] == "closed_book":
            assert c["success"] <= 0.2, c
    oracle = [r for r in rows if r["runner"] == "oracle"]
    assert all(r["rewards"]["evidence_recall"] == 1.0 and r["rewards"]["em"] == 1.0 for r in oracle)
    behind_search = [r for r in oracle if r["serve"] == "search"]
    assert all(r["rewards"]["search_calls"] >= 1 and "did not find" not in r["transcript"] for r in behind_search)
    depths = [r["depth"] for r in oracle if r["task"]["id"] != "none-1"]
    assert all(0 <= d <= 1 for d in depths) and len(set(depths)) > 1


def test_gold_passages_sit_at_the_recorded_depth_and_the_seed_fixes_the_haystacks(k3_dir, tasks_file, tmp_path):
    from transformers import AutoTokenizer

    import k3rl.envs as envs
    from k3rl.envs.longctx.taskfile import read_task_file
    from k3rl.rl.config import JobConfig, load_config
    from k3rl.rl.eval.cells import build_grid, env_kwargs

    tok = AutoTokenizer.from_pretrained(k3_dir)
    cfg = load_config(args(tmp_path, k3_dir, tasks_file)[0], args(tmp_path, k3_dir, tasks_file)[1:], JobConfig)
    grid = build_grid(cfg, tok)
    assert len(grid) == 5 * 2 * len(LENGTHS)
    file = read_task_file(tasks_file)
    task_docs = {p.body for t in file.tasks for p in t.passages}
    haystacks, fillers = [], 0
    for gt in grid:
        inst = envs.make("file", **env_kwargs(cfg, gt.cell, tok)).instance(gt.task)
        task = file.task(gt.task["id"])
        texts, ids = dict(inst.passages), [pid for pid, _ in inst.passages]
        gold = {p.body for p in task.passages if p.id in task.evidence}
        assert {texts[e] for e in inst.evidence} == gold  # every gold passage, cited by its haystack id
        assert inst.meta["tokens"] < gt.prompt_tokens <= gt.cell.length  # + chat template and system message
        if gold:
            assert gt.depth == min(ids.index(e) for e in inst.evidence) / (len(ids) - 1)
        others = {t for t in texts.values() if t in task_docs} - {p.body for p in task.passages}
        filler = [t for t in texts.values() if t not in task_docs]
        assert others, gt.task_id  # other tasks' documents first, then (once they are all in) real filler text
        assert gt.prompt_tokens > 0.6 * gt.cell.length, gt.task_id  # filled up to a filler passage's size
        fillers += bool(filler) and gt.cell.length == LENGTHS[-1]
        haystacks.append(inst.passages)
    assert fillers >= 1
    # longer: every other task's document, then real filler text up to the length
    big = dict(file.instance("hp-2", cfg.eval.seed, 2048, "shakespeare", tok).passages)
    assert task_docs <= set(big.values()) and len(big) > len(task_docs) + 3
    again = [envs.make("file", **env_kwargs(cfg, gt.cell, tok)).instance(gt.task).passages for gt in build_grid(cfg, tok)]
    assert again == haystacks
    cfg.eval.seed += 1
    other = [envs.make("file", **env_kwargs(cfg, gt.cell, tok)).instance(gt.task).passages for gt in build_grid(cfg, tok)]
    assert sum(a != b for a, b in zip(other, haystacks)) >= len(haystacks) - 2


GOOD = {"id": "a", "question": "Who?", "answers": ["Ann"], "passages": [{"id": "d1", "text": "Ann did it."},
                                                                           {"id": "d2", "text": "Bob watched."}]}


@pytest.mark.parametrize("lines, extra, message", [
    (None, ["eval.tasks_path=/nonexistent/tasks.jsonl"], "eval.tasks_path: /nonexistent/tasks.jsonl: no such task file"),
    (None, ["eval.tasks_path=null"], "eval.tasks_path: the 'file' family needs a JSONL task file"),
    ([GOOD, '{"id": "b", "question": '], [], "tasks.jsonl:2: not valid JSON"),
    (["[1, 2]"], [], "tasks.jsonl:1: a task is a JSON object, got list"),
    ([{**GOOD, "question": ""}], [], "tasks.jsonl:1: task 'a': no question"),
    ([{k: v for k, v in GOOD.items() if k != "answers"}], [], "tasks.jsonl:1: task 'a': no answers"),
    ([{**GOOD, "evidence": ["d1", "d9"]}], [], "task 'a': evidence ['d9'] match(es) no passage of the task "
                                                "(its passages: d1, d2)"),
    ([{**GOOD, "evidence": []}], [], "task 'a': evidence is empty"),
    ([{**GOOD, "evidences": ["d1"]}], [], "task 'a': unknown field(s) evidences"),
    ([GOOD, {**GOOD, "question": "Who else?"}], [], "tasks.jsonl:2: duplicate task id 'a' (first on line 1)"),
    ([{**GOOD, "corpus": "corpus.yaml"}], [], "task 'a': give passages (the task's documents) or corpus"),
    ([{"id": "c", "question": "Q?", "answers": ["x"], "corpus": "corpus.yaml", "evidence": ["owl#0", "elk"]}], [],
     "task 'c': evidence ['elk'] match(es) no passage or document of corpus 'corpus.yaml'"),
    ([GOOD, {**GOOD, "id": "long", "passages": [{"id": "d", "text": "word " * 400}]}], ["eval.context_lengths=[512]"],
     "eval.context_lengths: cannot build file/context/512 task 1: task 'long' needs"),
])
def test_bad_input_is_a_named_error_before_anything_is_written(k3_dir, tmp_path, capsys, lines, extra, message):
    path = write_tasks(tmp_path, lines) if lines else tmp_path / "unused.jsonl"
    assert main(args(tmp_path, k3_dir, path, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "e").exists()
