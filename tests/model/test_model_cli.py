"""`k3rl params` (meta-device counts: the published layout is ~2.78T total / ~105B active with 896
routed experts; counts equal a real model's), `k3rl init` (an HF directory that loads, with a
tokenizer whose ids fit the config) and `k3rl export` (any layout in, the chosen one out; MXFP4 said lossy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from k3_factory import make_config

from k3rl.rl.commands.model_tools import count_parameters, export_main, init_main, params_main

ROOT = Path(__file__).resolve().parents[2]


def test_published_layout_counts_2_78t_total_105b_active(capsys):
    assert params_main([str(ROOT / "configs/model/k3.yaml"), "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert abs(counts["total"] / 2.78e12 - 1) <= 0.01, counts["total"]  # docs/model_spec.md "Published K3"
    assert abs(counts["active"] / 105e9 - 1) <= 0.01, counts["active"]
    assert counts["layers"] | {"total": 0} == {"total": 0, "kda": 69, "mla": 24, "moe": 92, "dense": 1}
    assert counts["layers"]["total"] == 93
    assert counts["num_experts"] == 896 and counts["num_experts_per_token"] == 16
    comps = counts["components"]
    assert sum(c["total"] for c in comps.values()) == counts["total"]
    assert comps["moe.routed_experts"]["active"] * 56 == comps["moe.routed_experts"]["total"]  # 896 / 16


@pytest.mark.parametrize("kw", [dict(), dict(routed_expert_hidden_size=16, latent_moe_use_norm=True, moe_layer_freq=2,
                                              media_placeholder_token_id=3, attn_res_block_size=None)])
def test_meta_count_equals_a_real_model(kw):
    from k3rl.model.modeling import K3ForCausalLM

    cfg = make_config(num_hidden_layers=5, kda_layers=(1, 2, 4), **kw)
    counts = count_parameters(cfg)
    model = K3ForCausalLM(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counts["active"] == counts["total"] - routed + routed * cfg.num_experts_per_token // cfg.num_experts


def test_params_table(capsys):
    assert params_main([str(ROOT / "configs/model/tiny.yaml")]) == 0
    out = capsys.readouterr().out
    assert "moe.routed_experts" in out and "layers: 8 (6 KDA, 2 MLA; 7 MoE, 1 dense)" in out


def test_init_writes_a_loadable_model_and_tokenizer(tmp_path, capsys):
    from k3rl.model.formats.load import load_model
    from k3rl.model.tokenizer import load_tokenizer

    out = tmp_path / "tiny"
    assert init_main([str(ROOT / "configs/model/tiny.yaml"), str(out), "model.num_hidden_layers=4",
                      "model.linear_attn_config.kda_layers=[1,2,3]", "model.linear_attn_config.full_attn_layers=[4]"]) == 0
    assert "wrote" in capsys.readouterr().out
    model = load_model(out)
    tok = load_tokenizer(str(out))
    assert len(tok) <= model.config.vocab_size
    assert tok.convert_tokens_to_ids("<|media_pad|>") == model.config.media_placeholder_token_id
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                                return_dict=True)["input_ids"]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    assert init_main([str(ROOT / "configs/model/tiny.yaml"), str(out)]) == 2  # refuses a non-empty directory
    assert init_main([str(ROOT / "configs/model/k3.yaml"), str(tmp_path / "big")]) == 2  # does not fit


def test_params_and_init_read_any_recipe(tmp_path, capsys):
    """A job recipe (with `base:` and a `model:` section of its own) works as well as a model file."""
    assert params_main([str(ROOT / "configs/rl/quickstart.yaml")]) == 0
    assert "layers: 4 (3 KDA, 1 MLA; 3 MoE, 1 dense)" in capsys.readouterr().out
    assert params_main([str(ROOT / "configs/rl/sft.yaml"), "model.num_hidden_layers=8",
                        "model.linear_attn_config.kda_layers=[1,2,3,5,6,7]",
                        "model.linear_attn_config.full_attn_layers=[4,8]"]) == 0
    assert "layers: 8 (6 KDA, 2 MLA; 7 MoE, 1 dense)" in capsys.readouterr().out
    assert params_main([str(ROOT / "configs/model/tiny.yaml"), "model.no_such_key=1"]) == 2
    assert "unknown config key 'model.no_such_key'" in capsys.readouterr().err
    assert params_main([str(ROOT / "configs/model/tiny.yaml"), "model.num_hidden_layers=5"]) == 2
    assert "model.linear_attn_config" in capsys.readouterr().err


def test_export_rewrites_the_old_layout_and_quantizes_on_request(tmp_path, capsys):
    from k3_factory import make_model

    from k3rl.model.formats import mxfp4
    from k3rl.model.formats.load import load_model
    from k3rl.model.formats.save import save_model

    old = ROOT / "tests/fixtures/k3_per_expert"
    with pytest.warns(UserWarning, match="k3rl_k3"):
        source = load_model(old)
        assert export_main([str(old), str(tmp_path / "k3"), "--layout", "kimi_k3"]) == 0
    assert "layout kimi_k3, float32" in capsys.readouterr().out
    assert json.loads((tmp_path / "k3" / "config.json").read_text())["model_type"] == "kimi_k3"
    ids = torch.tensor([[5, 9, 14, 2, 7, 7, 30]])
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "k3")(ids).logits, source(ids).logits, atol=0, rtol=0)

    model = make_model(moe_intermediate_size=32, dtype=torch.float32)  # MXFP4 groups of 32 along every input
    save_model(model, tmp_path / "src")
    assert export_main([str(tmp_path / "src"), str(tmp_path / "q"), "--quantize", "mxfp4"]) == 0
    assert "routed experts in MXFP4 (lossy)" in capsys.readouterr().out
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "compressed-tensors"
    back = load_model(tmp_path / "q")
    w = model.model.layers[1].block_sparse_moe.experts.w2.detach()
    assert torch.equal(back.model.layers[1].block_sparse_moe.experts.w2, mxfp4.dequantize(*mxfp4.quantize(w), torch.float32))
    assert not torch.equal(back.model.layers[1].block_sparse_moe.experts.w2, w)
    assert torch.equal(back.lm_head.weight, model.lm_head.weight)  # only the routed experts are quantized
    assert export_main([str(tmp_path / "src"), str(tmp_path / "q")]) == 2  # refuses a non-empty directory
