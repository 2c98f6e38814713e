"""A model directory's config.json is untrusted input (issue 28): every malformed value is a named error.

Every field of a saved K3 config (both layouts) gets values of the wrong type, out of range or absurdly large;
reading the directory either succeeds or raises `CheckpointError` naming config.json and the field — never a
TypeError from `torch.empty`, an OverflowError, or a model built with a negative init std. A sample of the same
variants, and files that are not JSON objects at all, go through `k3rl export`: exit 2, no traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from k3_factory import make_model

from k3rl.model.formats.config_json import read_config
from k3rl.model.formats.layouts import CONFIG_FILE, CheckpointError
from k3rl.model.formats.save import save_model
from k3rl.rl.commands.model_tools import export_main

BAD_VALUES = ["big", -3, 0, 1e308, 10**30, None, [1], {"a": 1}, True, 2.5, ""]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("config-fuzz")
    dirs = {}
    for layout in ("kimi_linear", "kimi_k3"):
        dirs[layout] = root / layout
        save_model(make_model(dtype=torch.float32), dirs[layout], layout=layout)
    return dirs


def _variants(raw: dict) -> list[tuple[str, dict]]:
    text_key = "text_config" if "text_config" in raw else None
    fields = raw[text_key] if text_key else raw
    out = []
    for key in fields:
        for value in BAD_VALUES:
            changed = json.loads(json.dumps(raw))
            (changed[text_key] if text_key else changed)[key] = value
            out.append((f"{key}={value!r}", changed))
    for key in ("kda_layers", "num_heads", "gate_lower_bound"):
        for value in BAD_VALUES:
            changed = json.loads(json.dumps(raw))
            (changed[text_key] if text_key else changed)["linear_attn_config"][key] = value
            out.append((f"linear_attn_config.{key}={value!r}", changed))
    return out


@pytest.mark.parametrize("layout", ["kimi_linear", "kimi_k3"])
def test_every_bad_config_value_is_named(saved, tmp_path, layout):
    src = saved[layout]
    raw = json.loads((src / CONFIG_FILE).read_text())
    variants = _variants(raw)
    assert len(variants) > 400
    d = tmp_path / "d"
    shutil.copytree(src, d)
    named = loaded = 0
    for what, changed in variants:
        (d / CONFIG_FILE).write_text(json.dumps(changed))
        try:
            config = read_config(d)
        except CheckpointError as e:
            assert str(d / CONFIG_FILE) in str(e), (what, e)
            named += 1
            continue
        # what reads must build: sizes are real sizes
        assert config.hidden_size > 0 and config.initializer_range > 0, what
        loaded += 1
    assert named > 300 and loaded > 0, (named, loaded)


def _export(src: Path, dst: Path, capsys) -> tuple[int, str]:
    try:
        rc = export_main([str(src), str(dst)])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("content", [
    b"\xff\xfe{", b"[" * 100_000, b'{"a": ' + b"1" * 5000 + b"}", b"[1, 2]", b"",
    b'{"model_type": "kimi_k3", "text_config": [1, 2]}',
    b'{"model_type": "kimi_k3", "text_config": {"num_nextn_predict_layers": [1]}}',
], ids=["utf16", "deep", "huge-int", "list", "empty", "text-config-list", "mtp-list"])
def test_export_names_a_config_that_is_not_a_config(saved, tmp_path, capsys, content):
    src = tmp_path / "src"
    shutil.copytree(saved["kimi_k3"], src)
    if b"num_nextn" in content:
        raw = json.loads((src / CONFIG_FILE).read_text())
        raw["text_config"]["num_nextn_predict_layers"] = [1]
        content = json.dumps(raw).encode()
    (src / CONFIG_FILE).write_bytes(content)
    rc, err = _export(src, tmp_path / "dst", capsys)
    assert rc == 2 and "Traceback" not in err and "config.json" in err, err
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("key,value", [("hidden_size", "big"), ("initializer_range", -3), ("num_experts", 10**30),
                                       ("rms_norm_eps", None), ("vocab_size", [1]), ("rope_theta", 1e400)])
def test_export_names_a_bad_field(saved, tmp_path, capsys, key, value):
    src = tmp_path / "src"
    shutil.copytree(saved["kimi_k3"], src)
    raw = json.loads((src / CONFIG_FILE).read_text())
    raw["text_config"][key] = value
    (src / CONFIG_FILE).write_text(json.dumps(raw))
    rc, err = _export(src, tmp_path / "dst", capsys)
    assert rc == 2 and "Traceback" not in err and key in err, err
