"""Tests of model/formats/names.py and the expert conversion at save/load: checkpoints are written with per-expert
Hugging Face names; k3rl's old layout (model_type k3rl_k3) still reads, with a message: a checkpoint written
before the experts were stacked (tests/fixtures/k3_per_expert, saved by commit abce9f0) loads and computes what
it computed then, one with images keeps its patch weight; malformed expert sets are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from k3_factory import make_model
from safetensors import safe_open

from k3rl.model.formats.names import split_experts, stack_experts

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "k3_per_expert"


def test_split_and_stack_round_trip():
    model = make_model(seed=1)
    state = model.state_dict()
    split = dict(split_experts(state.items()))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in split
    assert not any(k.endswith("experts.w1") for k in split)
    back = stack_experts(split)
    assert back.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(back[k], v), k


def test_stack_names_missing_expert_and_mismatched_shapes():
    w = {f"m.experts.{e}.w1.weight": torch.zeros(4, 3) for e in (0, 1, 3)}
    with pytest.raises(ValueError, match=r"m\.experts\.w1: experts \[2\] missing"):
        stack_experts(w)
    w = {"m.experts.0.w1.weight": torch.zeros(4, 3), "m.experts.1.w1.weight": torch.zeros(4, 2)}
    with pytest.raises(ValueError, match="different shapes"):
        stack_experts(w)


def test_saved_checkpoints_hold_per_expert_names(tmp_path):
    from k3rl.model.formats.layouts import INDEX_FILE
    from k3rl.model.formats.save import save_model

    model = make_model(seed=2, dtype=torch.float32)
    save_model(model, tmp_path)
    (shard,) = set(json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"].values())
    with safe_open(str(tmp_path / shard), "pt") as f:
        keys = set(f.keys())
        assert {f"model.layers.1.block_sparse_moe.experts.{e}.w{i}.weight" for e in range(4) for i in (1, 2, 3)} <= keys
        assert not any(k.endswith(("experts.w1", "experts.w2", "experts.w3")) for k in keys)
        torch.testing.assert_close(f.get_tensor("model.layers.2.block_sparse_moe.experts.1.w3.weight"),
                                   model.model.layers[2].block_sparse_moe.experts.w3[1])


def test_old_layout_with_images_reads_with_a_message(tmp_path):
    """k3rl's old layout (transformers' save_pretrained, model_type k3rl_k3, the patch weight among the others)."""
    from k3rl.model.formats.load import load_model

    model = make_model(seed=4, media_placeholder_token_id=3, image_patch_size=2)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "k3rl_k3"
    with pytest.warns(UserWarning, match=r"old checkpoint layout \(model_type k3rl_k3\) was converted.*k3rl export"):
        loaded = load_model(tmp_path, dtype=torch.float64)
    ids = torch.randint(4, 97, (1, 12))
    ids[0, 2] = 3
    pix = torch.randn(3, 2, 2, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, pixel_values=[pix]).logits, model(ids, pixel_values=[pix]).logits,
                                   atol=0, rtol=0)


def test_checkpoint_saved_before_stacking_loads_unchanged():
    from k3rl.model.policy import load_policy

    expected = json.loads((FIXTURE / "expected.json").read_text())
    with pytest.warns(UserWarning, match="k3rl_k3"):
        policy = load_policy(FIXTURE)
    ids = torch.tensor(expected["input_ids"])
    with torch.no_grad():
        out = policy.model(ids)
    assert policy.model.last_routed_expert_ids().tolist() == expected["routing"]
    torch.testing.assert_close(out.logits[0, :, :5], torch.tensor(expected["logits_first"]), rtol=1e-5, atol=1e-5)
    assert abs(out.logits.double().sum().item() - expected["logits_sum"]) < 1e-3 * max(1.0, abs(expected["logits_sum"]))
