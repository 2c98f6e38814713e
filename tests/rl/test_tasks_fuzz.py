"""Training task files fuzzed from one valid row (tests/jsonl_fuzz.py): `read_tasks` loads each or raises
`ConfigError` as `path:line: what` — under both `env.bad_task_rows` policies, never another exception; rows
are split on `\\n` only, so a row holding U+2028 or U+0085 in a string is a valid task; a few bad files through
`k3rl train` exit 2 with the message, before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3rl.envs.search import SearchEnv
from k3rl.rl.config import ConfigError
from k3rl.rl.orchestrator.tasks import read_tasks
from tests.jsonl_fuzz import run_fuzz, variants

REPO = Path(__file__).parents[2]

ROW = {"id": "t1", "question": "Who lit the lantern?", "answers": ["Ann"],
       "passages": [{"id": "d1", "title": "Lantern", "text": "Ann lit the lantern at dusk."},
                    {"id": "d2", "title": "Boat", "text": "Bob rowed the boat home."}],
       "evidence": ["d1"]}


@pytest.fixture(scope="module")
def env():
    return SearchEnv(corpus=None)


@pytest.mark.parametrize("bad_rows", ["refuse", "skip"])
def test_fuzzed_task_rows_load_or_name_file_and_line(env, tmp_path, bad_rows):
    cases = variants(ROW, seed=28)
    assert len(cases) >= 200

    def read(path):
        skipped: list[str] = []
        read_tasks(path, env, bad_rows, skipped)
        return skipped

    outcome, failures = run_fuzz(cases, tmp_path, read, ConfigError)
    assert not failures, f"{len(failures)} of {len(cases)} ({dict(outcome)}):\n" + "\n".join(failures[:20])
    assert outcome["loaded"] >= 20 and outcome["named"] >= (20 if bad_rows == "skip" else 150), dict(outcome)


@pytest.mark.parametrize("brk", ["\u2028", "\u2029", "\u0085"])
def test_a_row_holding_a_unicode_line_break_is_one_task(env, tmp_path, brk):
    rows = [{**ROW, "question": f"Who lit{brk}the lantern?"}, {**ROW, "id": "t2"}]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert read_tasks(path, env) == rows


def test_file_level_problems_are_refused_even_when_skipping(env, tmp_path):
    cases = dict(variants(ROW, seed=28))
    for name, message in [("utf-16", ":1: the file is UTF-16"), ("invalid-byte-line-2", ":2: not UTF-8 text"),
                          ("binary", ":1: not UTF-8 text")]:
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(cases[name])
        with pytest.raises(ConfigError) as e:
            read_tasks(path, env, "skip", [])
        assert str(e.value).startswith(f"{path}{message}"), str(e.value)
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(cases["valid"] + cases["escape-lone-high"] + cases["int-10000-in-id"] + cases["nest-row-100000"])
    skipped: list[str] = []
    assert read_tasks(path, env, "skip", skipped) == [ROW]
    assert [s.split(": ", 1)[0] for s in skipped] == [f"{path}:{n}" for n in (2, 3, 4)], skipped


@pytest.mark.parametrize("name", ["utf-16", "escape-lone-high", "int-10000-in-id", "nest-row-100000"])
def test_bad_task_files_exit_2_through_k3rl_train(tiny_qwen3_dir, tmp_path, capsys, name):
    from k3rl.rl.commands.cli import main

    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(dict(variants(ROW, seed=28))[name])
    argv = ["train", str(REPO / "configs/rl/quickstart.yaml"), f"run.output_dir={tmp_path / 'runs'}",
            f"rl.model_path={tiny_qwen3_dir}", "env.name=search", "~env.args", "env.args.corpus=null",
            f"env.tasks_path={path}"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert f"k3rl train: {path}:1: " in captured.err, captured.err
    assert "Traceback" not in captured.err + captured.out and not (tmp_path / "runs").exists()
