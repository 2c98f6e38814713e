"""Checkpoint layouts (model/formats/layouts.py): every tensor name and shape of the spec's tables (§4.2–4.7) for the
K3 and Kimi-Linear layers, written under each released layout's names (kimi_k3: `language_model.` prefix, patch
weights outside the index), and nothing else; config.json as the released configs spell it; save → load gives
identical logits with images on and off (bf16 keeps the fp32 tensors fp32); released spellings and the parts
k3rl does not build are read; a damaged directory is an error naming the tensor, file or key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from k3_factory import make_config, make_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3rl.model.formats.config_json import config_from_dict, kimi_k3_config_registered, read_config
from k3rl.model.formats.layouts import INDEX_FILE, PATCH_FILE, PREPROCESSOR_FILE, layout_for
from k3rl.model.formats.load import load_model
from k3rl.model.formats.names import split_experts
from k3rl.model.formats.save import save_model


def expected_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """The spec's checkpoint tables, written out for one config."""
    d, V = cfg.hidden_size, cfg.vocab_size
    lac = cfg.linear_attn_config
    H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    P = H * K
    Hm, dn, dr, dv, Lkv, Lq = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                               cfg.kv_lora_rank, cfg.q_lora_rank)
    Im, ns, E = cfg.moe_intermediate_size, cfg.num_shared_experts, cfg.num_experts
    d_m = cfg.routed_expert_hidden_size or d
    out = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,), "lm_head.weight": (V, d)}
    if cfg.attn_res_block_size:
        out |= {"model.output_attn_res_norm.weight": (d,), "model.output_attn_res_proj.weight": (1, d)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
        if cfg.attn_res_block_size:
            out |= {p + "self_attention_res_norm.weight": (d,), p + "self_attention_res_proj.weight": (1, d),
                    p + "mlp_res_norm.weight": (d,), p + "mlp_res_proj.weight": (1, d)}
        a = p + "self_attn."
        if (i + 1) in lac["kda_layers"]:  # §4.3 / §4.4
            out |= {a + n: (P, d) for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight")}
            if lac["use_full_rank_gate"]:
                out[a + "g_proj.weight"] = (P, d)
            else:
                out |= {a + "g_a_proj.weight": (K, d), a + "g_b_proj.weight": (P, K)}
            out |= {a + "f_a_proj.weight": (K, d), a + "f_b_proj.weight": (P, K), a + "b_proj.weight": (H, d),
                    a + "q_conv1d.weight": (P, 1, W), a + "k_conv1d.weight": (P, 1, W), a + "v_conv1d.weight": (P, 1, W),
                    a + "A_log": (H,), a + "dt_bias": (P,), a + "o_norm.weight": (K,), a + "o_proj.weight": (d, P)}
        else:  # §4.5
            if Lq is None:
                out[a + "q_proj.weight"] = (Hm * (dn + dr), d)
            else:
                out |= {a + "q_a_proj.weight": (Lq, d), a + "q_a_layernorm.weight": (Lq,),
                        a + "q_b_proj.weight": (Hm * (dn + dr), Lq)}
            out |= {a + "kv_a_proj_with_mqa.weight": (Lkv + dr, d), a + "kv_a_layernorm.weight": (Lkv,),
                    a + "kv_b_proj.weight": (Hm * (dn + dv), Lkv), a + "o_proj.weight": (d, Hm * dv)}
            if cfg.mla_use_output_gate:
                out[a + "g_proj.weight"] = (Hm * dv, d)
        if cfg.num_experts is not None and i >= cfg.first_k_dense_replace and i % cfg.moe_layer_freq == 0:  # §4.6
            m = p + "block_sparse_moe."
            out |= {m + "gate.weight": (E, d), m + "gate.e_score_correction_bias": (E,)}
            for e in range(E):
                out |= {m + f"experts.{e}.w1.weight": (Im, d_m), m + f"experts.{e}.w3.weight": (Im, d_m),
                        m + f"experts.{e}.w2.weight": (d_m, Im)}
            out |= {m + "shared_experts.gate_proj.weight": (Im * ns, d), m + "shared_experts.up_proj.weight": (Im * ns, d),
                    m + "shared_experts.down_proj.weight": (d, Im * ns)}
            if cfg.routed_expert_hidden_size:
                out |= {m + "routed_expert_down_proj.weight": (d_m, d), m + "routed_expert_up_proj.weight": (d, d_m)}
                if cfg.latent_moe_use_norm:
                    out[m + "routed_expert_norm.weight"] = (d_m,)
        else:
            I = cfg.intermediate_size
            out |= {p + "mlp.gate_proj.weight": (I, d), p + "mlp.up_proj.weight": (I, d), p + "mlp.down_proj.weight": (d, I)}
    return out


def state_shapes(model) -> dict[str, tuple[int, ...]]:
    """Names and shapes as checkpoints hold them (routed experts per expert: model/formats/names.py)."""
    return {k: tuple(v.shape) for k, v in split_experts(model.state_dict().items())}


def disk_shapes(directory) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors the index lists, read from the files it names."""
    index = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        with safe_open(str(directory / file), "pt") as f:
            for k in f.keys():
                assert index[k] == file, k
                out[k] = tuple(f.get_slice(k).get_shape())
    assert out.keys() == index.keys()
    return out


K3_CFG = dict(num_hidden_layers=5, kda_layers=(1, 2, 4), routed_expert_hidden_size=16, latent_moe_use_norm=True,
              moe_layer_freq=2, first_k_dense_replace=1, media_placeholder_token_id=3, image_patch_size=2)
KIMI_LINEAR_CFG = dict(linear_attn_config={"use_full_rank_gate": False}, q_lora_rank=None, attn_res_block_size=None,
                       mla_use_output_gate=False, first_k_dense_replace=2)


@pytest.mark.parametrize("layout,kw", [("kimi_k3", K3_CFG), ("kimi_linear", KIMI_LINEAR_CFG)])
def test_layout_names_shapes_and_config(tmp_path, layout, kw):
    cfg = make_config(**kw)
    model = make_model(cfg, dtype=torch.float32)
    expected = expected_tensors(cfg)
    assert state_shapes(model) == expected | ({"model.patch_embed.proj.weight": (32, 12)} if layout == "kimi_k3"
                                              else {})
    assert layout_for(cfg) == layout
    save_model(model, tmp_path, max_shard_bytes=40_000)
    prefix = "language_model." if layout == "kimi_k3" else ""
    assert disk_shapes(tmp_path) == {prefix + k: v for k, v in expected.items()}
    assert len(set(json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"].values())) > 1
    raw = json.loads((tmp_path / "config.json").read_text())
    arch = {"kimi_k3": "KimiK3ForConditionalGeneration", "kimi_linear": "KimiLinearForCausalLM"}[layout]
    assert raw["model_type"] == layout and raw["architectures"] == [arch]
    assert raw["auto_map"]["AutoModelForCausalLM"] == f"modeling_kimi_k3.{arch}"
    text = raw["text_config"] if layout == "kimi_k3" else raw
    assert text["model_type"] == "kimi_linear" and text["dtype"] == "float32"
    assert text["linear_attn_config"]["kda_layers"] == cfg.linear_attn_config["kda_layers"]
    assert (text["use_grouped_topk"], text["topk_method"], text["num_nextn_predict_layers"]) == (True, "noaux_tc", 0)
    assert all(text[k] == v for k, v in cfg.model_config_dict().items() if k != "checkpoint_layout")
    if layout == "kimi_k3":
        assert raw["media_placeholder_token_id"] == 3 and raw["vision_config"]["text_hidden_size"] == 32
        assert raw["ignore_index"] == -100 and "architectures" not in text
        assert load_file(tmp_path / PATCH_FILE).keys() == {"model.patch_embed.proj.weight"}
        assert json.loads((tmp_path / PREPROCESSOR_FILE).read_text())["media_proc_cfg"]["patch_size"] == cfg.image_patch_size
        from transformers import AutoConfig

        # inside `kimi_k3_config_registered` (what load_tokenizer uses: AutoTokenizer reads config.json first) a local
        # class answers, so transformers does not ask on stdin about the remote code; outside it, the directory's own
        # remote KimiK3Config does (k3rl does not change what transformers does in the user's process)
        with kimi_k3_config_registered():
            assert type(AutoConfig.from_pretrained(tmp_path)).__name__ == "KimiK3DirectoryConfig"
        assert type(AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)).__module__.startswith(
            "transformers_modules.")
    else:
        assert not (tmp_path / PATCH_FILE).exists()


@pytest.mark.parametrize("media", [None, 3], ids=["text", "images"])
def test_save_load_round_trip_identical_logits(tmp_path, media):
    model = make_model(mla_use_nope=False, media_placeholder_token_id=media, image_patch_size=2)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_()  # a trained bias must survive the round trip
    save_model(model, tmp_path)
    loaded = load_model(tmp_path, dtype=torch.float64)
    assert loaded.config.model_config_dict() == model.config.model_config_dict()
    ids = torch.randint(4, 97, (2, 21))
    ids[0, 5:7] = 3
    kw = {} if media is None else {"pixel_values": torch.randn(1, 3, 2, 4, dtype=torch.float64)}
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, **kw).logits, model(ids, **kw).logits, atol=0, rtol=0)
    bf16 = load_model(tmp_path, dtype=torch.bfloat16)
    for name, t in bf16.state_dict().items():
        fp32 = name.endswith(("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias"))
        assert t.dtype == (torch.float32 if fp32 else torch.bfloat16), name


def test_released_spellings_defaults_and_unbuilt_parts(tmp_path):
    """A directory as the released K3 writes it: `language_model.layers.` spelling, no k3rl keys (released
    defaults apply), its ViT and an MTP layer (skipped, with a message), the media token of the real vocabulary."""
    model = make_model(checkpoint_layout="kimi_k3", hidden_act="silu")
    src = tmp_path / "src"
    save_model(model, src)
    raw = json.loads((src / "config.json").read_text())
    text = raw["text_config"]
    for key in ("router_balance", "image_patch_size", "image_num_channels", "checkpoint_layout", "hidden_act",
                "media_placeholder_token_id"):
        del text[key]  # hidden_act: the released default is silu
    text["num_nextn_predict_layers"] = 1
    raw["media_placeholder_token_id"] = 163605
    (src / "config.json").write_text(json.dumps(raw))
    index = json.loads((src / INDEX_FILE).read_text())
    (file,) = set(index["weight_map"].values())
    tensors = {k.replace("language_model.model.layers.", "language_model.layers."): v
               for k, v in load_file(src / file).items()}
    extra = {"vision_tower.patch_embed.proj.weight": torch.zeros(4, 3),
             "language_model.model.layers.4.enorm.weight": torch.zeros(32)}
    save_file(tensors, src / file)
    save_file(extra, src / "model-extra.safetensors")
    index["weight_map"] = {**{k: file for k in tensors}, **{k: "model-extra.safetensors" for k in extra}}
    (src / INDEX_FILE).write_text(json.dumps(index))
    with pytest.warns(UserWarning, match="skipped 1 vision tower / projector tensors, 1 MTP layer tensors"):
        loaded = load_model(src, dtype=torch.float64)
    assert loaded.config.media_placeholder_token_id is None and loaded.config.checkpoint_layout == "kimi_k3"
    assert loaded.config.model_config_dict() == model.config.model_config_dict() | {"media_placeholder_token_id": None}
    ids = torch.randint(4, 97, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    bare = dict(text)
    for key in ("attn_res_block_size", "mla_use_nope", "activation_situ_beta"):
        del bare[key]
    defaults = config_from_dict(bare)
    assert (defaults.attn_res_block_size, defaults.mla_use_nope, defaults.activation_situ_beta) == (None, False, None)


def test_damaged_directories_are_named(tmp_path):
    src = tmp_path / "ok"
    save_model(make_model(seed=3, dtype=torch.float32), src, max_shard_bytes=40_000)
    weight_map = json.loads((src / INDEX_FILE).read_text())["weight_map"]

    def damaged(name):
        shutil.copytree(src, tmp_path / name)
        return tmp_path / name

    d = damaged("shard")
    gone = sorted(set(weight_map.values()))[1]
    (d / gone).unlink()
    with pytest.raises(FileNotFoundError, match=f"{gone} is listed in .*{INDEX_FILE} but missing"):
        load_model(d)
    d = damaged("type")
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    with pytest.raises(ValueError, match="config.json: model_type 'llama' is not a K3 layout"):
        load_model(d)
    d = damaged("shape")
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    file = weight_map[name]
    tensors = load_file(d / file)
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, d / file)
    with pytest.raises(ValueError, match=f"tensor {name} in {file} has shape \\[3, 3\\], this config needs \\[16, 32\\]"):
        load_model(d)
    del tensors[name]
    save_file(tensors, d / file)
    with pytest.raises(ValueError, match=f"tensor {name} is mapped to {file} but that file lacks it"):
        load_model(d)
    index = json.loads((d / INDEX_FILE).read_text())
    del index["weight_map"][name]
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"tensor {name} missing"):
        load_model(d)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "num_experts_per_token": 9}))
    with pytest.raises(ValueError, match="config.json: num_experts_per_token"):
        read_config(d)
