"""The commands' model checks (rl/checkpoint.py `check_model_path`): a learner checkpoint whose bytes changed, NaN
weights and broken model files are named errors (exit 2) in `k3rl eval`, `k3rl train` and `k3rl sft`, before Ray
starts or the run directory is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3rl.rl import checkpoint as ckpt
from k3rl.rl.config import ConfigError

REPO = Path(__file__).parents[2]
SHARD = "model-00001-of-00001.safetensors"
TENSOR = "language_model.lm_head.weight"  # the tiny recipe writes the kimi_k3 layout


@pytest.fixture(scope="module")
def broken(k3_dir, tmp_path_factory) -> dict[str, Path]:
    """Copies of the tiny K3 (with tokenizer): a learner checkpoint with one flipped byte, a NaN weight, a
    truncated shard, a tensor of the wrong shape, a missing shard."""
    root = tmp_path_factory.mktemp("broken")
    with ckpt.CheckpointManager(root / "checkpoints").begin(5) as tmp:
        shutil.copytree(k3_dir, tmp, dirs_exist_ok=True)
        torch.save({"version": 5}, tmp / "optimizer.pt")
    step = root / "checkpoints" / ckpt.step_dir_name(5)
    data = bytearray((step / SHARD).read_bytes())
    data[-5] ^= 0x01  # a finite value stays finite: only the manifest sees it
    (step / SHARD).write_bytes(bytes(data))
    out = {"flipped": step}
    for kind in ("nan", "truncated", "shape"):
        d = shutil.copytree(k3_dir, root / kind)
        tensors = load_file(d / SHARD)
        if kind == "nan":
            tensors[TENSOR] = tensors[TENSOR].clone()
            tensors[TENSOR][0, :3] = float("nan")
        elif kind == "shape":
            tensors[TENSOR] = tensors[TENSOR][:-1].clone()
        save_file(tensors, d / SHARD, metadata={"format": "pt"})
        if kind == "truncated":
            (d / SHARD).write_bytes((d / SHARD).read_bytes()[:-64])
        out[kind] = d
    out["missing"] = shutil.copytree(k3_dir, root / "missing")
    (out["missing"] / SHARD).unlink()
    return out


EXPECTED = {"flipped": f"{SHARD} does not match its content hash in the manifest",
            "nan": f"non-finite weights (NaN or ±inf) in 1 tensor: {TENSOR} in {SHARD} (3 values)",
            "truncated": f"{SHARD}: not a readable safetensors file",
            "shape": f"tensor {TENSOR} in {SHARD} has shape",
            "missing": f"{SHARD} is listed in model.safetensors.index.json but missing"}


def eval_args(out: Path, model: Path, *extra: str) -> list[str]:
    return [str(REPO / "configs/eval/longctx.yaml"), f"run.output_dir={out}", "run.name=e", f"eval.model_path={model}",
            "eval.families=[needle]", "eval.serve=[context]", "eval.context_lengths=[1024]", "eval.num_tasks=1",
            *extra]


@pytest.mark.parametrize("kind", ["flipped", "nan"])
def test_eval_refuses_by_name_before_writing(broken, tmp_path, capsys, kind):
    from k3rl.rl.commands.eval import main

    assert main(eval_args(tmp_path, broken[kind])) == 2
    err = capsys.readouterr().err
    assert f"k3rl eval: eval.model_path: {broken[kind]}" in err and EXPECTED[kind] in err
    assert not (tmp_path / "e").exists()
    if kind == "nan":
        assert "run.allow_nonfinite_weights=true" in err


def train_config(tmp_path: Path, model: Path) -> list[str]:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t0", "question": "q?", "answers": ["a"], "evidence": ["p0"],
                                 "passages": [{"id": "p0", "title": "P", "text": "a"}]}) + "\n")
    return [f"run.output_dir={tmp_path / 'runs'}", "run.name=r", f"rl.model_path={model}", f"env.tasks_path={tasks}",
            f"eval.tasks_path={tasks}", "env.args={corpus: null}", "rollout.num_workers=1"]


@pytest.mark.parametrize("kind", ["flipped", "nan", "truncated", "shape", "missing"])
def test_train_refuses_by_name_before_ray(broken, tmp_path, kind):
    import ray

    from k3rl.rl.config import JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    started = ray.is_initialized()
    with pytest.raises(ConfigError) as e:
        Trainer(load_config(None, train_config(tmp_path, broken[kind]), schema=JobConfig))
    assert str(e.value).startswith(f"rl.model_path: {broken[kind]}") and EXPECTED[kind] in str(e.value)
    if kind == "nan":
        assert "training cannot start from them" in str(e.value)
    assert ray.is_initialized() == started and not (tmp_path / "runs").exists()


def sft_job(tmp_path: Path, model: Path) -> Path:
    job = {"base": [str(REPO / "configs/model/tiny.yaml")], "run": {"output_dir": str(tmp_path / "runs"), "name": "s"},
           "env": {"name": "search"}, "sft": {"model_dir": str(model), "num_tasks": 2}}
    path = tmp_path / "sft.yaml"
    path.write_text(json.dumps(job))
    return path


@pytest.mark.parametrize("kind", ["flipped", "nan", "truncated", "shape", "missing"])
def test_sft_refuses_by_name_before_writing(broken, tmp_path, kind):
    from k3rl.rl.commands.sft import main

    with pytest.raises(ConfigError) as e:
        main([str(sft_job(tmp_path, broken[kind]))])
    assert str(e.value).startswith(f"sft.model_dir: {broken[kind]}") and EXPECTED[kind] in str(e.value)
    assert not (tmp_path / "runs").exists()


def test_sft_exits_2_with_the_named_error(broken, tmp_path, capsys):
    from k3rl.rl.commands.cli import main

    assert main(["sft", str(sft_job(tmp_path, broken["nan"]))]) == 2
    assert f"k3rl sft: sft.model_dir: {broken['nan']}: non-finite weights" in capsys.readouterr().err


def test_a_clean_directory_passes(k3_dir):
    ckpt.check_model_path("rl.model_path", k3_dir, trains=True)


@pytest.mark.parametrize("kind", ["flipped", "nan"])
def test_pretrain_refuses_its_start_model_by_name(broken, tmp_path, capsys, kind):
    from test_pretrain import climb_config

    from k3rl.rl.commands.cli import main

    config = climb_config(tmp_path, "m")
    assert main(["pretrain", str(config), f"pretrain.model_dir={broken[kind]}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"k3rl pretrain: pretrain.model_dir: {broken[kind]}") and EXPECTED[kind] in err
    assert not (tmp_path / "runs/m").exists()


def test_eval_loads_nan_weights_when_allowed(broken, tmp_path):
    from k3rl.rl.commands.eval import main

    with pytest.warns(UserWarning, match=f"{TENSOR} in {SHARD} \\(3 values\\); loaded anyway"):
        assert main(eval_args(tmp_path, broken["nan"], "run.allow_nonfinite_weights=true", "eval.baselines=[]",
                              "rollout.max_new_tokens=4", "rollout.max_turns=1")) == 0
    assert (tmp_path / "e" / "results.json").is_file()
