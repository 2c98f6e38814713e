"""model/formats/weight_files.py: sharded safetensors + index, MXFP4 experts, and a synthesized released-format K3 directory.

The released directory is built here from names and shapes alone (a tiny K3: d = 32, 4 routed experts of
width 32, two layers), as `moonshotai/Kimi-K3` lays it out: `config.json` with `model_type kimi_k3`, the
text config under `text_config`, a top-level compressed-tensors `quantization_config` written the way
llm-compressor writes one (targets "Linear" plus an ignore list, not k3rl's own builder), the text weights
under `language_model.`, sharded over ≥ 3 files with an index, the routed experts as MXFP4.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3rl.model.formats import mxfp4
from k3rl.model.formats.weight_files import INDEX_NAME, PATCH_EMBED_FILE, read_extra, read_weights, write_extra, write_weights

D, E, I_MOE, VOCAB = 32, 4, 32, 97
P = "language_model."


def _experts(name: str) -> bool:
    return ".block_sparse_moe.experts." in name


def _mxfp4_exact(shape, gen) -> torch.Tensor:
    """Random bfloat16 weights [out, in] that MXFP4 holds exactly: E2M1 values times a power of two per
    group of 32, every group holding a ±6 (so quantization picks that same power)."""
    out, n = shape
    codes = torch.randint(0, 16, (out, n), generator=gen, dtype=torch.uint8)
    codes[:, ::32] = 7 | (torch.randint(0, 2, (out, n // 32), generator=gen, dtype=torch.uint8) << 3)
    scale = torch.randint(110, 130, (out, n // 32), generator=gen, dtype=torch.uint8)
    return mxfp4.dequantize(codes[:, 0::2] | (codes[:, 1::2] << 4), scale)


def released_tensors(exact: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """The text weights of a two-layer tiny K3 (layer 0 dense MLP + MLA, layer 1 KDA + MoE), released names."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)

    t = {f"{P}model.embed_tokens.weight": w(VOCAB, D), f"{P}model.norm.weight": torch.ones(D, dtype=torch.bfloat16),
         f"{P}lm_head.weight": w(VOCAB, D)}
    l0 = f"{P}model.layers.0."
    t |= {l0 + "input_layernorm.weight": w(D), l0 + "post_attention_layernorm.weight": w(D),
          l0 + "self_attn.q_a_proj.weight": w(16, D), l0 + "self_attn.kv_a_proj_with_mqa.weight": w(16, D),
          l0 + "self_attn.o_proj.weight": w(D, 16), l0 + "mlp.gate_proj.weight": w(48, D),
          l0 + "mlp.up_proj.weight": w(48, D), l0 + "mlp.down_proj.weight": w(D, 48)}
    l1 = f"{P}model.layers.1."
    t |= {l1 + "self_attn.q_proj.weight": w(16, D), l1 + "self_attn.A_log": w(1, 1, 2, 1),
          l1 + "block_sparse_moe.gate.weight": w(E, D),
          l1 + "block_sparse_moe.gate.e_score_correction_bias": torch.zeros(E, dtype=torch.float32),
          l1 + "block_sparse_moe.shared_experts.gate_proj.weight": w(I_MOE, D),
          l1 + "block_sparse_moe.shared_experts.down_proj.weight": w(D, I_MOE)}
    for e in range(E):
        for proj, shape in (("w1", (I_MOE, D)), ("w2", (D, I_MOE)), ("w3", (I_MOE, D))):
            t[f"{l1}block_sparse_moe.experts.{e}.{proj}.weight"] = _mxfp4_exact(shape, gen) if exact else w(*shape)
    return t


def released_quantization_config() -> dict:
    """A compressed-tensors MXFP4 config as llm-compressor writes one: every Linear targeted, the
    non-expert ones ignored."""
    cfg = mxfp4.quantization_config(targets=["Linear"], ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp.*",
                                                                "re:.*shared_experts.*", "re:.*gate$"])
    cfg |= {"version": "0.12.2", "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None}
    return cfg


def write_released_dir(path, tensors, quantization_config, max_shard_bytes=4096):
    """config.json in the kimi_k3 layout plus the weights (experts MXFP4), sharded; returns the written config."""
    write_weights(path, tensors, max_shard_bytes=max_shard_bytes, quantize=_experts)
    text = {"model_type": "kimi_linear", "vocab_size": VOCAB, "hidden_size": D, "num_hidden_layers": 2,
            "num_experts": E, "moe_intermediate_size": I_MOE, "first_k_dense_replace": 1,
            "linear_attn_config": {"kda_layers": [2], "full_attn_layers": [1]}, "dtype": "bfloat16"}
    config = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
              "vision_config": {"text_hidden_size": D}, "media_placeholder_token_id": 90,
              "quantization_config": quantization_config}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return config


def test_released_dir_dequantizes_to_the_source_values(tmp_path):
    src = released_tensors(exact=True)
    write_released_dir(tmp_path, src, released_quantization_config())
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 3 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    expert = f"{P}model.layers.1.block_sparse_moe.experts.2.w2"
    assert expert + ".weight_packed" in index["weight_map"] and expert + ".weight" not in index["weight_map"]
    with safe_open(str(tmp_path / index["weight_map"][expert + ".weight_packed"]), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor(expert + ".weight_packed").shape == (D, I_MOE // 2)
        assert f.get_tensor(expert + ".weight_scale").dtype == torch.uint8
    stored = sum(p.stat().st_size for p in tmp_path.glob("model-*.safetensors"))
    assert index["metadata"]["total_size"] <= stored < index["metadata"]["total_size"] + 2048 * n
    got = read_weights(tmp_path)
    assert got.keys() == src.keys()
    for name, t in src.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert all(v.dtype == torch.float32 for v in read_weights(tmp_path, dtype=torch.float32).values())


def test_released_dir_random_weights_within_the_mxfp4_bound(tmp_path):
    src = released_tensors(exact=False, seed=1)
    write_released_dir(tmp_path, src, released_quantization_config())
    got = read_weights(tmp_path, dtype=torch.float64)
    for name, t in src.items():
        x = t.double()
        if not _experts(name):
            assert torch.equal(got[name], x), name
            continue
        # Each element within a quarter of its group's amax (model/formats/mxfp4.py), and not everything exact.
        err = (got[name] - x).reshape(x.shape[0], -1, 32).abs()
        assert (err <= x.reshape(x.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 4).all(), name
        assert err.max() > 0, name


def test_text_config_quantization_config_is_read(tmp_path):
    src = released_tensors(exact=True)
    config = write_released_dir(tmp_path, src, released_quantization_config())
    config["text_config"]["quantization_config"] = config.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert torch.equal(read_weights(tmp_path)[f"{P}model.layers.1.block_sparse_moe.experts.3.w1.weight"],
                       src[f"{P}model.layers.1.block_sparse_moe.experts.3.w1.weight"])


def test_sharding_index_and_stale_files(tmp_path):
    t = {f"t{i}": torch.full((256,), float(i)) for i in range(5)}
    t |= {"ids": torch.arange(7), "h": torch.ones(3, dtype=torch.float16)}
    assert write_weights(tmp_path, t, max_shard_bytes=1500) is None  # one 1 KiB t{i} a shard, ids and h join t4
    shards = [f"model-0000{k}-of-00005.safetensors" for k in range(1, 6)]
    assert sorted(p.name for p in tmp_path.glob("model-*")) == shards
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 5 * 1024 + 7 * 8 + 3 * 2
    assert index["weight_map"]["t1"] == "model-00002-of-00005.safetensors"
    assert index["weight_map"]["h"] == "model-00005-of-00005.safetensors"
    got = read_weights(tmp_path)
    assert got.keys() == t.keys() and all(torch.equal(got[n], t[n]) and got[n].dtype == t[n].dtype for n in t)
    # Rewriting as one shard removes the five old shards and a stray single-file checkpoint.
    save_file({"old": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    write_weights(tmp_path, {"a": torch.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-00001-of-00001.safetensors", INDEX_NAME]
    assert json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"] == {"a": "model-00001-of-00001.safetensors"}


def test_no_index_reads_every_file_but_the_side_file(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "extra-weights.safetensors"))
    write_extra(tmp_path, PATCH_EMBED_FILE, {"model.patch_embed.proj.weight": torch.ones(4, 3)})
    assert sorted(read_weights(tmp_path)) == ["a", "b"]
    assert torch.equal(read_extra(tmp_path, PATCH_EMBED_FILE)["model.patch_embed.proj.weight"], torch.ones(4, 3))
    assert read_extra(tmp_path, "absent.safetensors") == {}
    with pytest.raises(ValueError, match="weight-shard name"):
        write_extra(tmp_path, "model-00001-of-00002.safetensors", {"x": torch.ones(1)})
    save_file({"a": torch.ones(1)}, str(tmp_path / "dup.safetensors"))
    with pytest.raises(ValueError, match="tensor a is stored twice"):
        read_weights(tmp_path)


def test_quantize_refuses_non_experts_and_bad_shapes(tmp_path):
    with pytest.raises(ValueError, match="lm_head.weight selected for MXFP4"):
        write_weights(tmp_path, {"lm_head.weight": torch.ones(4, 32)}, quantize=lambda n: True)
    name = "model.layers.1.block_sparse_moe.experts.0.w2.weight"
    with pytest.raises(ValueError, match=rf"{name} \(32, 16\) cannot be MXFP4"):
        write_weights(tmp_path, {name: torch.ones(32, 16)}, quantize=_experts)
    cfg = write_weights(tmp_path, {name: torch.ones(32, 64), "lm_head.weight": torch.ones(4, 32)}, quantize="mxfp4")
    assert cfg == mxfp4.quantization_config()
    assert json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"].keys() == {
        "lm_head.weight", name.replace(".weight", ".weight_packed"), name.replace(".weight", ".weight_scale")}
    with pytest.raises(ValueError, match="quantize must be 'mxfp4'"):
        write_weights(tmp_path, {name: torch.ones(32, 64)}, quantize="nvfp4")
    # Quantized tensors but no config.json to say so.
    with pytest.raises(ValueError, match=r"experts.0.w2.weight_packed is quantized but .*config.json has no quant"):
        read_weights(tmp_path)


def _released(tmp_path):
    write_released_dir(tmp_path, released_tensors(exact=True), released_quantization_config())
    return json.loads((tmp_path / INDEX_NAME).read_text())


def test_missing_shard_is_named(tmp_path):
    index = _released(tmp_path)
    (tmp_path / "model-00002-of-{:05d}.safetensors".format(len(set(index["weight_map"].values())))).unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-.* listed in .*safetensors.index.json but missing"):
        read_weights(tmp_path)


def test_tensor_missing_from_its_shard_is_named(tmp_path):
    index = _released(tmp_path)
    index["weight_map"][f"{P}model.layers.0.mlp.extra.weight"] = index["weight_map"][f"{P}lm_head.weight"]
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"tensor language_model.model.layers.0.mlp.extra.weight is mapped to model-"):
        read_weights(tmp_path)


def test_truncated_shard_is_named(tmp_path):
    index = _released(tmp_path)
    shard = tmp_path / index["weight_map"][f"{P}lm_head.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 10])
    with pytest.raises(ValueError, match=rf"{shard.name}: not a readable safetensors file"):
        read_weights(tmp_path)


def test_packed_without_scale_is_named(tmp_path):
    index = _released(tmp_path)
    del index["weight_map"][f"{P}model.layers.1.block_sparse_moe.experts.1.w3.weight_scale"]
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"experts.1.w3.weight_packed has no .*experts.1.w3.weight_scale"):
        read_weights(tmp_path)


def test_weight_and_packed_together_are_refused(tmp_path):
    index = _released(tmp_path)
    name = f"{P}model.layers.1.block_sparse_moe.experts.0.w1"
    write_extra(tmp_path, "more.safetensors", {name + ".weight": torch.ones(I_MOE, D)})
    index["weight_map"][name + ".weight"] = "more.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{name} is stored twice, as .weight and as .weight_packed"):
        read_weights(tmp_path)


@pytest.mark.parametrize("quant, named", [({"quant_method": "fp8", "weight_block_size": [128, 128]}, "'fp8'"),
                                          ({"quant_method": "mxfp4"}, "'mxfp4'"),
                                          ({**mxfp4.quantization_config(), "format": "nvfp4-pack-quantized"},
                                           "nvfp4-pack-quantized")])
def test_other_quantization_formats_are_refused(tmp_path, quant, named):
    _released(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"config.json: .*{named}.* not supported"):
        read_weights(tmp_path)
