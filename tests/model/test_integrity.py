"""model/formats/integrity.py through its loaders: a checkpoint's COMPLETE manifest verified on every load (a flipped byte
is named), a directory without one checked for what can be checked (shard set, dtypes, finite values), non-finite
weights refused by tensor, and MXFP4's NaN and saturation at export; a clean directory still loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from k3_factory import make_model
from safetensors.torch import load_file, save_file

from k3rl.model.formats import integrity
from k3rl.model.formats.layouts import CheckpointError
from k3rl.model.formats.load import check_model_dir, load_model
from k3rl.model.formats.save import save_model
from k3rl.model.formats.weight_files import write_weights
from k3rl.rl import checkpoint as ckpt
from k3rl.rl.commands.model_tools import export_main
from tests.hostile import RunsCode

SHARD = "model-00001-of-00001.safetensors"
EXPERT = "model.layers.1.block_sparse_moe.experts.0.w1.weight"
"""A routed expert's [16, 32] weight: MXFP4 at export (input dim a multiple of 32)."""


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A tiny float32 K3 in the kimi_linear layout, no manifest."""
    out = tmp_path_factory.mktemp("released") / "model"
    save_model(make_model(dtype=torch.float32), out)
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def set_value(directory: Path, name: str, index: tuple, value: float, dtype=None) -> None:
    """Rewrite one element of a tensor (and optionally its dtype) in the single shard."""
    tensors = load_file(directory / SHARD)
    t = tensors[name].clone()
    t[index] = value
    tensors[name] = t if dtype is None else t.to(dtype)
    save_file(tensors, directory / SHARD, metadata={"format": "pt"})


def learner_checkpoint(source: Path, root: Path, step: int = 3) -> Path:
    """A `step-N/` directory as the trainer writes it: the model, learner files, the COMPLETE manifest."""
    with ckpt.CheckpointManager(root).begin(step) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        torch.save({"version": step}, tmp / "optimizer.pt")
    return root / ckpt.step_dir_name(step)


def flip_low_bit(path: Path) -> None:
    """XOR the lowest bit of a byte in the data region: the value stays finite, only the hash can tell."""
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


def test_clean_directories_load_without_a_false_positive(released, tmp_path):
    step = learner_checkpoint(released, tmp_path / "checkpoints")
    for directory in (released, step):
        model = load_model(directory)
        check_model_dir(directory)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert integrity.verify_model_dir(step) == step and integrity.verify_model_dir(released) is None
    assert export_main([str(step), str(tmp_path / "out")]) == 0


def test_flipped_byte_in_a_learner_checkpoint_is_named_on_load_and_export(released, tmp_path, capsys):
    step = learner_checkpoint(released, tmp_path / "checkpoints")
    load_model(step)  # verified once: a later change must still be seen (size and mtime key the cache)
    flip_low_bit(step / SHARD)
    with pytest.raises(integrity.CorruptCheckpointError, match=f"{SHARD} does not match its content hash"):
        load_model(step)
    with pytest.raises(integrity.CorruptCheckpointError, match=SHARD):
        check_model_dir(step)
    assert export_main([str(step), str(tmp_path / "out")]) == 2
    assert f"{step}: {SHARD} does not match its content hash" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # the same flip without a manifest is a finite value: loaded (only a manifest detects it, module docstring)
    bare = copy(released, tmp_path / "bare")
    flip_low_bit(bare / SHARD)
    load_model(bare)


def test_model_files_in_a_subdirectory_are_verified_by_the_parents_manifest(released, tmp_path):
    with ckpt.atomic_dir(tmp_path / "run") as tmp:
        shutil.copytree(released, tmp / "model")
    load_model(tmp_path / "run" / "model")
    flip_low_bit(tmp_path / "run" / "model" / SHARD)
    with pytest.raises(integrity.CorruptCheckpointError, match=f"model/{SHARD} does not match"):
        load_model(tmp_path / "run" / "model")


def test_a_file_added_after_the_save_is_refused(released, tmp_path):
    step = learner_checkpoint(released, tmp_path / "checkpoints")
    shutil.copyfile(step / SHARD, step / "model.safetensors")
    with pytest.raises(integrity.CorruptCheckpointError, match="model.safetensors is not in the COMPLETE manifest"):
        load_model(step)


def test_nan_weight_is_refused_by_tensor_unless_allowed(released, tmp_path, capsys):
    bad = copy(released, tmp_path / "nan")
    set_value(bad, EXPERT, (0, 3), float("nan"))
    set_value(bad, "lm_head.weight", (1, 1), float("inf"))
    with pytest.raises(integrity.NonFiniteWeightsError) as e:
        load_model(bad)
    assert f"{EXPERT} in {SHARD} (1 value)" in str(e.value) and "lm_head.weight" in str(e.value)
    assert "run.allow_nonfinite_weights=true" in str(e.value)
    with pytest.raises(integrity.NonFiniteWeightsError, match=EXPERT):
        check_model_dir(bad)
    with pytest.warns(UserWarning, match="loaded anyway"):
        model = load_model(bad, allow_nonfinite=True)
    assert not torch.isfinite(model.lm_head.weight).all()
    assert export_main([str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: non-finite weights (NaN or ±inf) in 2 tensors" in err and EXPERT in err
    assert not (tmp_path / "out").exists()
    with pytest.warns(UserWarning, match="loaded anyway"):
        assert export_main([str(bad), str(tmp_path / "out"), "--allow-nonfinite"]) == 0


def test_a_byte_flip_that_makes_a_nan_is_caught_without_a_manifest(released, tmp_path):
    bad = copy(released, tmp_path / "flip")
    data = bytearray((bad / SHARD).read_bytes())
    # the last float32 of the data, little-endian: its high byte 0x7f/0xff and next bit set is NaN/inf
    data[-1] = 0x7F
    data[-2] |= 0x80
    (bad / SHARD).write_bytes(bytes(data))
    with pytest.raises(integrity.NonFiniteWeightsError, match="1 value"):
        load_model(bad)


def test_shard_set_dtype_and_cast_overflow(released, tmp_path):
    stray = copy(released, tmp_path / "stray")
    shutil.copyfile(stray / SHARD, stray / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors not named by model.safetensors.index.json"):
        load_model(stray)
    gap = copy(released, tmp_path / "gap")
    index = json.loads((gap / "model.safetensors.index.json").read_text())
    (gap / SHARD).rename(gap / "model-00002-of-00002.safetensors")
    index["weight_map"] = {n: "model-00002-of-00002.safetensors" for n in index["weight_map"]}
    (gap / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names shards 2-of-2, not 1…n"):
        load_model(gap)
    half = copy(released, tmp_path / "half")
    set_value(half, "lm_head.weight", (0, 0), 0.5, dtype=torch.float16)
    with pytest.raises(CheckpointError, match="lm_head.weight in .* has dtype float16, config.json says "
                                                        "float32"):
        load_model(half)
    with pytest.raises(CheckpointError, match="has dtype float16"):
        check_model_dir(half)
    big = copy(released, tmp_path / "big")
    set_value(big, "lm_head.weight", (0, 0), 3.4e38)  # finite in float32, beyond bfloat16 (3.39e38)
    load_model(big)
    with pytest.raises(integrity.NonFiniteWeightsError, match="cast to bfloat16 .*lm_head.weight"):
        load_model(big, dtype=torch.bfloat16)


def test_streaming_check_names_model_file_errors(released, tmp_path):
    truncated = copy(released, tmp_path / "truncated")
    (truncated / SHARD).write_bytes((truncated / SHARD).read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{SHARD}: not a readable safetensors file"):
        check_model_dir(truncated)
    missing = copy(released, tmp_path / "missing")
    (missing / SHARD).unlink()
    with pytest.raises(FileNotFoundError, match=f"{SHARD} is listed in model.safetensors.index.json but missing"):
        check_model_dir(missing)
    shape = copy(released, tmp_path / "shape")
    tensors = load_file(shape / SHARD)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1].clone()
    save_file(tensors, shape / SHARD, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="tensor lm_head.weight in .* has shape"):
        check_model_dir(shape)


def test_hf_model_with_nan_is_refused_by_load_policy(tiny_qwen3_dir, tmp_path):
    from k3rl.model.policy import load_policy

    bad = copy(tiny_qwen3_dir, tmp_path / "qwen")
    name = next(iter(load_file(bad / "model.safetensors")))
    tensors = load_file(bad / "model.safetensors")
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(integrity.NonFiniteWeightsError, match=f"{name} \\(1 value\\)"):
        load_policy(bad)
    with pytest.raises(integrity.NonFiniteWeightsError, match=name):
        check_model_dir(bad)


def test_mxfp4_write_refuses_nan_and_warns_on_saturation(tmp_path):
    w = torch.randn(4, 64)
    w[2, 7] = float("nan")
    with pytest.raises(integrity.NonFiniteWeightsError, match=f"{EXPERT} holds 1 NaN"):
        write_weights(tmp_path / "a", {EXPERT: w}, quantize="mxfp4")
    with pytest.warns(UserWarning, match="group of 32 of each as NaN"):
        write_weights(tmp_path / "b", {EXPERT: w}, quantize="mxfp4", allow_nonfinite=True)
    w[2, 7] = 3e38
    w[3, 0] = -2.9e38  # below 1.75·2^127: decodes finite
    with pytest.warns(UserWarning, match=f"{EXPERT}: 1 finite value\\(s\\) with \\|x\\| ≥ 2.98e\\+38 saturate"):
        write_weights(tmp_path / "c", {EXPERT: w}, quantize="mxfp4")


def test_export_mxfp4_warns_on_saturation_and_refuses_nan(tmp_path, capsys):
    # experts of hidden size 32: every routed weight has an input dim MXFP4 takes
    released = tmp_path / "src"
    save_model(make_model(dtype=torch.float32, moe_intermediate_size=32), released)
    big = copy(released, tmp_path / "big")
    set_value(big, EXPERT, (0, 0), 3e38)
    with pytest.warns(UserWarning, match=f"{EXPERT}: 1 finite value"):
        assert export_main([str(big), str(tmp_path / "out"), "--quantize", "mxfp4"]) == 0
    nan = copy(released, tmp_path / "nan")
    set_value(nan, EXPERT, (0, 0), float("nan"))
    assert export_main([str(nan), str(tmp_path / "out2"), "--quantize", "mxfp4"]) == 2
    assert f"{EXPERT} in {SHARD} (1 value)" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists() and not (tmp_path / ".out2.tmp").exists()


def test_pickled_hf_weights_are_scanned_without_running_code(tiny_qwen3_dir, tmp_path):
    bad = copy(tiny_qwen3_dir, tmp_path / "qwen")
    tensors = load_file(bad / "model.safetensors")
    (bad / "model.safetensors").unlink()
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[:3] = float("inf")
    torch.save(tensors, bad / "pytorch_model.bin")
    with pytest.raises(integrity.NonFiniteWeightsError, match=f"{name} in pytorch_model.bin \\(3 values\\)"):
        check_model_dir(bad)
    marker = tmp_path / "ran"
    torch.save({**tensors, "x": RunsCode(marker)}, bad / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin: not a readable PyTorch weight file"):
        check_model_dir(bad)
    assert not marker.exists()
