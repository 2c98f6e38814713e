"""An environment argument the environment refuses — an unknown name or a value it cannot use (`env.args.ask=size`
for the needle family, `snippet=x` for search) — is named when the environment is built (envs/registry.py
`EnvArgumentError`), and `k3rl train`, `k3rl sft` and `k3rl eval` build it before anything is written: exit 2, no
run directory, so the same run name works once the argument is fixed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import k3rl.envs as envs
from k3rl.envs.registry import EnvArgumentError

REPO = Path(__file__).parents[2]
BAD_ASK = "ask: 'number' or 'colour', got 'size'"


def test_make_names_refused_values():
    with pytest.raises(EnvArgumentError, match=BAD_ASK) as e:
        envs.make("needle", length=1024, ask="size")
    assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)
    with pytest.raises(EnvArgumentError, match="distractors"):
        envs.make("needle", length=1024, distractors="many")
    with pytest.raises(EnvArgumentError, match="snippet: 'x' is not one of head, match"):
        envs.make("search", corpus=None, snippet="x")
    with pytest.raises(EnvArgumentError, match="got unexpected argument"):
        envs.make("multihop", serve="search", lenght=1024)
    assert envs.make("needle", length=1024, ask="colour").options == {"ask": "colour"}


def test_k3rl_train_refuses_before_the_run_directory(tiny_qwen3_dir, tmp_path):
    from k3rl.rl.config import ConfigError, JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    items = [f"run.output_dir={tmp_path / 'runs'}", "run.name=ask", f"rl.model_path={tiny_qwen3_dir}",
             "env.name=needle", "env.args={length: 1024, ask: size}"]
    with pytest.raises(ConfigError, match=rf"env.args: environment 'needle' does not take these arguments .*{BAD_ASK}"):
        Trainer(load_config(None, items, schema=JobConfig))
    assert not (tmp_path / "runs").exists()


def test_k3rl_sft_refuses_before_the_run_directory(tmp_path, capsys):
    from k3rl.rl.commands.cli import main

    job = {"base": [str(REPO / "configs/model/tiny.yaml")], "run": {"output_dir": str(tmp_path / "runs"), "name": "ask"},
           "env": {"name": "needle", "args": {"length": 1024, "ask": "size"}}}
    (tmp_path / "sft.yaml").write_text(json.dumps(job))
    assert main(["sft", str(tmp_path / "sft.yaml")]) == 2
    err = capsys.readouterr().err
    assert "k3rl sft: env.args: environment 'needle' does not take these arguments" in err and BAD_ASK in err, err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


def test_k3rl_eval_names_the_argument(k3_dir, tmp_path, capsys):
    from k3rl.rl.commands.cli import main

    argv = ["eval", str(REPO / "configs/eval/longctx.yaml"), f"run.output_dir={tmp_path / 'runs'}", "run.name=ask",
            f"eval.model_path={k3_dir}", "eval.families=[needle]", "env.name=needle", "env.args.ask=size"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "k3rl eval: env.args: environment 'needle' does not take these arguments" in err and BAD_ASK in err, err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()
