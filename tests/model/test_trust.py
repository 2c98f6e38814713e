"""A model directory is untrusted (model/formats/trust.py): its own Python code runs in no loader, command or Ray worker
unless `run.trust_remote_code` / `k3rl export --trust-remote-code` allows it, and every file its index names
resolves inside it.

The evil directories are the tiny Qwen3 with an `auto_map` to a `tokenization_x.py` (tokenizer_config.json) and
to `configuration_x.py` / `modeling_x.py` (config.json); importing any of them writes a marker file, so "nothing
ran" is checked by the marker's absence. k3rl's own K3 directories (whose config.json `auto_map` names k3rl's
model/formats/remote/ copies) load without the opt-in."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from k3_factory import make_model

from k3rl.model.formats.layouts import INDEX_FILE, PATCH_FILE, REMOTE_DIR
from k3rl.model.formats.load import load_model
from k3rl.model.formats.save import copy_tokenizer, save_model
from k3rl.model.formats.trust import PathEscapeError, RemoteCodeError, remote_code_requests
from k3rl.rl.commands.model_tools import export_main

ROOT = Path(__file__).resolve().parents[2]

TOKENIZER_CODE = """import pathlib
pathlib.Path({marker!r}).write_text("tokenization_x imported")
from transformers import PreTrainedTokenizerFast


class XTokenizer(PreTrainedTokenizerFast):
    pass
"""
CONFIG_CODE = """import pathlib
pathlib.Path({marker!r}).write_text("configuration_x imported")
from transformers import Qwen3Config


class XConfig(Qwen3Config):
    pass
"""
MODELING_CODE = """import pathlib
pathlib.Path({marker!r}).write_text("modeling_x imported")
from transformers import Qwen3ForCausalLM

from .configuration_x import XConfig


class XForCausalLM(Qwen3ForCausalLM):
    config_class = XConfig
"""


def _edit_json(path: Path, **values) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}, indent=1))


def make_evil(base: Path, out: Path, *, tokenizer: bool = True, model: bool = True) -> tuple[Path, Path]:
    """A copy of the HF directory `base` asking for its own code; returns (directory, marker folder)."""
    shutil.copytree(base, out)
    markers = out.parent / f"{out.name}-markers"
    markers.mkdir()
    if tokenizer:
        _edit_json(out / "tokenizer_config.json",
                   auto_map={"AutoTokenizer": ["tokenization_x.XTokenizer", "tokenization_x.XTokenizer"]})
        (out / "tokenization_x.py").write_text(TOKENIZER_CODE.format(marker=str(markers / "tokenization_x")))
    if model:
        _edit_json(out / "config.json", auto_map={"AutoConfig": "configuration_x.XConfig",
                                                  "AutoModelForCausalLM": "modeling_x.XForCausalLM"})
        (out / "configuration_x.py").write_text(CONFIG_CODE.format(marker=str(markers / "configuration_x")))
        (out / "modeling_x.py").write_text(MODELING_CODE.format(marker=str(markers / "modeling_x")))
    return out, markers


def ran(markers: Path) -> list[str]:
    return sorted(p.name for p in markers.iterdir())


@pytest.fixture
def evil(tiny_qwen3_dir, tmp_path):
    # a name of its own: transformers caches a directory's modules by the directory's name
    return make_evil(tiny_qwen3_dir, tmp_path / f"evil_{tmp_path.name}")


@pytest.fixture
def k3_src(tiny_qwen3_dir, tmp_path):
    """A K3 directory in the released layout whose tokenizer (the tiny Qwen3's) asks for `tokenization_x.py`."""
    src = tmp_path / "k3"
    save_model(make_model(dtype=torch.float32), src, tokenizer_from=tiny_qwen3_dir)
    markers = tmp_path / "k3-markers"
    markers.mkdir()
    _edit_json(src / "tokenizer_config.json",
               auto_map={"AutoTokenizer": ["tokenization_x.XTokenizer", "tokenization_x.XTokenizer"]})
    (src / "tokenization_x.py").write_text(TOKENIZER_CODE.format(marker=str(markers / "tokenization_x")))
    return src, markers


# ---- remote code: refused everywhere without the opt-in

def test_loaders_run_nothing_and_name_the_file_and_the_opt_in(evil):
    from k3rl.model.policy import load_policy
    from k3rl.model.tokenizer import load_tokenizer
    from k3rl.rollout.vllm_cpu import make_cpu_llm
    from k3rl.rollout.vllm_engine import VLLMEngine
    from k3rl.rollout.worker import WorkerSpec, build_engine

    d, markers = evil
    with pytest.raises(RemoteCodeError, match=r"tokenizer_config.json: auto_map AutoTokenizer → "
                                              r"tokenization_x.XTokenizer.*tokenization_x.py.*"
                                              r"run.trust_remote_code=true.*--trust-remote-code"):
        load_tokenizer(d)
    with pytest.raises(RemoteCodeError, match="configuration_x.py"):
        load_policy(d)
    for engine in ("torch", "vllm"):
        with pytest.raises(RemoteCodeError, match="tokenization_x.py"):
            build_engine(WorkerSpec(model_dir=str(d), env="search", engine=engine))
    with pytest.raises(RemoteCodeError):
        VLLMEngine(d)
    with pytest.raises(RemoteCodeError):
        make_cpu_llm(str(d))
    assert ran(markers) == []


def test_the_learner_runs_nothing(tiny_qwen3_dir, tmp_path):
    from k3rl.rl.train.learner import Learner, LearnerConfig

    d, markers = make_evil(tiny_qwen3_dir, tmp_path / "evil", tokenizer=False)
    with pytest.raises(RemoteCodeError, match=r"config.json: auto_map AutoConfig → configuration_x.XConfig"):
        Learner(LearnerConfig(model_path=str(d)))
    assert ran(markers) == []


def test_every_command_refuses_by_key_before_writing_anything(evil, tmp_path):
    from k3rl.rl.config import ConfigError, JobConfig, load_config
    from k3rl.rl.eval.evaluated import check_evaluated
    from k3rl.rl.eval.runners import LocalModel
    from k3rl.rl.orchestrator import sft
    from k3rl.rl.orchestrator.trainer import Trainer
    from k3rl.rl.pretrain import climb

    d, markers = evil
    runs = tmp_path / "runs"

    def job(*overrides):
        return load_config(None, [f"run.output_dir={runs}", *overrides], JobConfig)

    with pytest.raises(ConfigError, match=r"^rl.model_path: .*tokenization_x.py.*run.trust_remote_code=true"):
        Trainer(job(f"rl.model_path={d}"))
    with pytest.raises(ConfigError, match=r"^sft.model_dir: .*tokenization_x.py"):
        sft.run_sft(job(f"sft.model_dir={d}"))
    with pytest.raises(ConfigError, match=r"^pretrain.model_dir: .*tokenization_x.py"):
        climb.check(job(f"pretrain.model_dir={d}"))
    with pytest.raises(ConfigError, match=r"^eval.model_path: .*tokenization_x.py"):
        LocalModel(job(f"eval.model_path={d}"), str(d))
    with pytest.raises(ConfigError, match=r"^eval.model_path: .*tokenization_x.py"):
        check_evaluated(job("eval.endpoint=http://127.0.0.1:9/v1", f"eval.model_path={d}"))
    assert ran(markers) == [] and not runs.exists()


def test_the_opt_in_runs_the_code(evil):
    from k3rl.model.policy import load_policy
    from k3rl.model.tokenizer import load_tokenizer

    d, markers = evil
    assert type(load_tokenizer(d, trust_remote_code=True)).__name__ == "XTokenizer"
    assert "tokenization_x" in ran(markers)
    assert type(load_policy(d, trust_remote_code=True).model).__name__ == "XForCausalLM"
    assert ran(markers) == ["configuration_x", "modeling_x", "tokenization_x"]


@pytest.mark.ray
def test_a_ray_rollout_worker_gets_the_setting_from_its_spec(ray_cluster, evil):
    ray = ray_cluster
    from k3rl.rollout.worker import RolloutWorker, WorkerSpec

    d, markers = evil
    spec = WorkerSpec(model_dir=str(d), env="search", engine="torch")
    actor = ray.remote(RolloutWorker).options(num_cpus=1, max_restarts=0)
    refused = actor.remote(spec)
    with pytest.raises(ray.exceptions.RayActorError, match="(?s)RemoteCodeError.*tokenization_x.py"):
        ray.get(refused.health.remote())
    assert ran(markers) == []
    spec.trust_remote_code = True
    allowed = actor.remote(spec)
    try:
        assert ray.get(allowed.health.remote())["ok"]
    finally:
        ray.kill(allowed)
    assert ran(markers) == ["configuration_x", "modeling_x", "tokenization_x"]


def test_k3rl_own_directories_need_no_opt_in(tmp_path):
    from k3rl.envs.registry import tokenizer_texts
    from k3rl.model.config import K3Config
    from k3rl.model.init import init_model
    from k3rl.model.policy import load_policy
    from k3rl.model.tokenizer import load_tokenizer
    from k3rl.rl.config import JobConfig, load_config

    cfg = load_config(ROOT / "configs/model/tiny.yaml", ["model.num_hidden_layers=2",
                                                         "model.linear_attn_config.kda_layers=[1]",
                                                         "model.linear_attn_config.full_attn_layers=[2]"], JobConfig)
    out = tmp_path / "own"
    init_model(K3Config.from_model_config(cfg.model), out, seed=0, tokenizer_texts=tokenizer_texts())
    assert json.loads((out / "config.json").read_text())["auto_map"]  # k3rl's model/formats/remote/ copies
    assert remote_code_requests(out) == []
    assert load_tokenizer(out).eos_token == "<|im_end|>"
    assert load_policy(out).is_k3


def test_export_copies_foreign_code_only_on_request(k3_src, tmp_path, capsys):
    src, markers = k3_src
    assert export_main([str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tokenization_x.py" in err and "--trust-remote-code" in err and not (tmp_path / "out").exists()
    assert export_main([str(src), str(tmp_path / "out"), "--trust-remote-code"]) == 0
    assert (tmp_path / "out" / "tokenization_x.py").read_text() == (src / "tokenization_x.py").read_text()
    assert ran(markers) == []  # exporting copies the code; it never imports it


def test_checkpoints_copy_a_tokenizer_without_its_code(k3_src, tmp_path):
    src, _ = k3_src
    (src / "stray_helper.py").write_text("raise SystemExit")
    with pytest.raises(RemoteCodeError, match="tokenization_x.py"):
        save_model(make_model(dtype=torch.float32), tmp_path / "ckpt", tokenizer_from=src)
    assert not (tmp_path / "ckpt").exists()  # refused before anything is written
    _edit_json(src / "tokenizer_config.json", auto_map=None)
    save_model(make_model(dtype=torch.float32), tmp_path / "ckpt", tokenizer_from=src)
    own = {p.name for p in REMOTE_DIR.glob("*.py")}
    assert {p.name for p in (tmp_path / "ckpt").glob("*.py")} == own  # tokenization_x.py left behind


# ---- paths: everything a directory names stays inside it

@pytest.fixture
def k3_plain(tmp_path):
    src = tmp_path / "src"
    save_model(make_model(dtype=torch.float32), src)
    return src


def _index(src: Path) -> dict:
    return json.loads((src / INDEX_FILE).read_text())


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_index_entries_outside_the_directory_are_refused(k3_plain, tmp_path, capsys, where):
    from k3rl.model.formats.weight_files import read_weights

    index = _index(k3_plain)
    name = "lm_head.weight"
    shard = k3_plain / index["weight_map"][name]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copyfile(shard, outside / "stolen.safetensors")
    if where == "symlink":
        target = "inside-looking.safetensors"
        os.symlink(outside / "stolen.safetensors", k3_plain / target)
    else:
        target = "../elsewhere/stolen.safetensors" if where == "parent" else str(outside / "stolen.safetensors")
    index["weight_map"][name] = target
    (k3_plain / INDEX_FILE).write_text(json.dumps(index))
    message = rf"{INDEX_FILE}: tensor {name}: path '.*(stolen|inside-looking).*' resolves outside"
    with pytest.raises(PathEscapeError, match=message):
        read_weights(k3_plain)
    with pytest.raises(PathEscapeError, match=message):
        load_model(k3_plain)
    assert export_main([str(k3_plain), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert INDEX_FILE in err and name in err and "resolves outside" in err and "Traceback" not in err


def test_a_hub_cache_snapshot_loads_through_its_blob_symlinks(k3_plain, tmp_path):
    """The Hugging Face cache keeps `snapshots/REV/FILE` as symlinks to `../../blobs/HASH`: not an escape."""
    from k3rl.model.formats.weight_files import read_weights

    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(k3_plain.iterdir())):
        shutil.copyfile(f, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / f.name)
    assert torch.equal(read_weights(snapshot)["lm_head.weight"], read_weights(k3_plain)["lm_head.weight"])
    load_model(snapshot)
    outside = tmp_path / "stolen.safetensors"
    shutil.copyfile(repo / "blobs" / "blob0", outside)
    shard = next(snapshot.glob("model-*.safetensors"))
    shard.unlink()
    os.symlink(outside, shard)
    with pytest.raises(PathEscapeError, match="resolves outside"):
        read_weights(snapshot)


def test_a_side_file_leading_out_is_refused(k3_plain, tmp_path):
    from k3rl.model.formats.weight_files import read_extra

    (tmp_path / "patch.safetensors").write_bytes((k3_plain / _index(k3_plain)["weight_map"]["lm_head.weight"])
                                                  .read_bytes())
    os.symlink(tmp_path / "patch.safetensors", k3_plain / PATCH_FILE)
    with pytest.raises(PathEscapeError, match=rf"side file: path '{PATCH_FILE}' resolves outside"):
        read_extra(k3_plain, PATCH_FILE)


def test_a_tokenizer_file_leading_out_is_not_copied(tmp_path, tiny_qwen3_dir):
    tok = tmp_path / "tok"
    shutil.copytree(tiny_qwen3_dir, tok)
    (tmp_path / "secret.txt").write_text("not for export")
    os.symlink(tmp_path / "secret.txt", tok / "vocab.txt")
    (tmp_path / "dst").mkdir()
    with pytest.raises(PathEscapeError, match="tokenizer file: path 'vocab.txt' resolves outside"):
        copy_tokenizer(tok, tmp_path / "dst")
    assert list((tmp_path / "dst").iterdir()) == []


@pytest.mark.parametrize("index, why", [
    ("{not json", "not a safetensors index"),
    ("[1, 2]", "a JSON list, not an object"),
    ('{"metadata": {}}', "no weight_map"),
    ('{"weight_map": ["lm_head.weight"]}', "weight_map must be an object"),
    ('{"weight_map": {"lm_head.weight": 3}}', "weight_map['lm_head.weight'] must be a file name, got 3"),
    ('{"weight_map": {"lm_head.weight": null}}', "must be a file name, got None"),
    (b"\xff\xfe{", "not a safetensors index"),
    ('{"weight_map": {"lm_head.weight": ' + "1" * 5000 + "}}", "not a safetensors index"),
    ("[" * 100_000 + "]" * 100_000, "not a safetensors index"),
])
def test_export_names_a_malformed_index(k3_plain, tmp_path, capsys, index, why):
    path = k3_plain / INDEX_FILE
    path.write_bytes(index if isinstance(index, bytes) else index.encode())
    assert export_main([str(k3_plain), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and why in err and "Traceback" not in err, err


def test_export_names_a_tensor_its_shard_lacks(k3_plain, tmp_path, capsys):
    index = _index(k3_plain)
    index["weight_map"]["model.layers.0.extra.weight"] = index["weight_map"]["lm_head.weight"]
    (k3_plain / INDEX_FILE).write_text(json.dumps(index))
    assert export_main([str(k3_plain), str(tmp_path / "out")]) == 2
    assert "tensor model.layers.0.extra.weight is mapped to" in capsys.readouterr().err
