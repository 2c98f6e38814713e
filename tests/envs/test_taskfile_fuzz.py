"""Task files fuzzed from one valid row (tests/jsonl_fuzz.py): `read_task_file` loads each or raises
`TaskFileError` as `path:line: what` — never another exception (non-UTF-8 and UTF-16 files, integers past
Python's 4,300-digit limit, deep nesting, lone surrogates, NaN, wrong types …); a handful of them through
`k3rl eval` exit 2 with the message and no traceback, before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3rl.envs.longctx.taskfile import TaskFileError, read_task_file
from tests.jsonl_fuzz import run_fuzz, variants

REPO = Path(__file__).parents[2]
ROW = {"id": "q1", "question": "Who lit the lantern?", "answers": ["Ann"],
       "passages": [{"id": "d1", "title": "Lantern", "text": "Ann lit the lantern at dusk."},
                    {"id": "d2", "title": "Boat", "text": "Bob rowed the boat home."}],
       "evidence": ["d1"], "hops": 1, "meta": {"source": "fuzz"}}


def test_fuzzed_task_files_load_or_name_file_and_line(tmp_path):
    cases = variants(ROW, seed=28)
    assert len(cases) >= 200
    outcome, failures = run_fuzz(cases, tmp_path, lambda path: read_task_file(path) and None, TaskFileError)
    assert not failures, f"{len(failures)} of {len(cases)} ({dict(outcome)}):\n" + "\n".join(failures[:20])
    # the valid variants load and the clearly broken ones do not
    assert outcome["loaded"] >= 20 and outcome["named"] >= 150, dict(outcome)


def test_what_each_kind_of_bad_file_is_called(tmp_path):
    cases = dict(variants(ROW, seed=28))
    expect = {"utf-16": ":1: the file is UTF-16", "utf-8-bom": ":1: the file is UTF-8 with a byte-order mark",
              "latin-1": ":1: not UTF-8 text", "invalid-byte-line-2": ":2: not UTF-8 text",
              "int-4301-in-hops": ":1: Exceeds the limit (4300 digits)", "nest-row-100000": ":1: nested too deeply",
              "nest-meta-99": ":1: nested 101 levels deep (at most 100)",
              "escape-lone-high": ":1: a string holds a lone surrogate", "number-NaN-in-hops": ":1: NaN is not a JSON",
              "number-1e400-in-question": ":1: the number 1e400 overflows", "empty": ":1: no tasks",
              "binary": ":1: not UTF-8 text", "swap:hops=float": ":1: task 'q1': hops must be a positive integer",
              "swap:passages.0.text=list-of-null": ":1: task 'q1': passages[0] ('d1'): no text"}
    for name, message in expect.items():
        path = tmp_path / f"{len(message)}-{name}.jsonl"
        path.write_bytes(cases[name])
        try:
            read_task_file(path)
        except TaskFileError as e:
            assert str(e).startswith(f"{path}{message}"), (name, str(e))
        else:
            raise AssertionError(f"{name}: loaded")
    for name in ("raw-u2028", "raw-u0085", "escape-pair", "int-4299-in-hops", "nest-meta-98", "crlf"):
        path = tmp_path / f"ok-{name}.jsonl"
        path.write_bytes(cases[name])
        assert read_task_file(path).tasks[0].id == "q1", name


def test_bad_task_files_exit_2_through_k3rl_eval(tmp_path, capsys):
    from k3rl.rl.commands.cli import main

    cases = dict(variants(ROW, seed=28))
    names = ["utf-16", "latin-1", "int-10000-in-id", "nest-row-100000", "escape-lone-low", "number-Infinity-in-hops",
             "binary", "empty"]
    for name in names:
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(cases[name])
        out = tmp_path / "runs"
        argv = ["eval", str(REPO / "configs/eval/longctx.yaml"), f"run.output_dir={out}", "run.name=e",
                f"eval.model_path={tmp_path / 'no-model'}", "eval.families=[file]", f"eval.tasks_path={path}"]
        assert main(argv) == 2, name
        captured = capsys.readouterr()
        assert f"k3rl eval: eval.tasks_path: {path}:1: " in captured.err, (name, captured.err)
        assert "Traceback" not in captured.err + captured.out, name
        assert not out.exists(), name


@pytest.mark.parametrize("text", ["name: [unclosed\n  x: : :\n", "- a\n- b\n", "foo: 1\n", "\xff\xfe"])
def test_a_bad_corpus_yaml_is_named_by_the_task_line(tmp_path, text):
    (tmp_path / "corpus.yaml").write_bytes(text.encode("latin-1"))
    path = tmp_path / "tasks.jsonl"
    row = {"id": "c", "question": "Q?", "answers": ["x"], "corpus": "corpus.yaml", "evidence": ["a"]}
    path.write_text(json.dumps(ROW) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(TaskFileError, match=rf"^{path}:2: task 'c': corpus 'corpus.yaml': "):
        read_task_file(path)
