"""K3Config: built from the ModelConfig dataclass, loads the recipes, round-trips through
config.json and the Auto classes, and rejects invalid values with a ValueError naming the field;
importing model.config stays cheap (no torch)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from k3_factory import K3Config

from k3rl.model.config import ModelConfig
from k3rl.rl.config import load_model_config

ROOT = Path(__file__).resolve().parents[2]


def test_fields_and_defaults_come_from_the_dataclass():
    cfg = K3Config()
    for f in dataclasses.fields(ModelConfig):
        assert hasattr(cfg, f.name), f.name
    assert cfg.model_config_dict() == dataclasses.asdict(ModelConfig()) | {
        "linear_attn_config": cfg.linear_attn_config}
    assert cfg.linear_attn_config["full_attn_layers"] == [1, 2, 3, 4]  # empty lists are completed
    partial = K3Config(linear_attn_config={"kda_layers": [1, 3]})
    assert partial.linear_attn_config["full_attn_layers"] == [2, 4]
    assert partial.linear_attn_config["head_dim"] == ModelConfig().linear_attn_config.head_dim
    assert partial.is_kda_layer(0) and not partial.is_kda_layer(1)


@pytest.mark.parametrize("name", ["tiny", "small", "k3"])
def test_recipes_load(name):
    cfg = load_model_config(str(ROOT / "configs/model" / f"{name}.yaml"))
    lac = cfg.linear_attn_config
    if name == "k3":  # the published layout: MLA every fourth layer and the last (docs/model_spec.md)
        assert lac["full_attn_layers"] == [*range(4, 93, 4), 93] and len(lac["kda_layers"]) == 69
        assert (cfg.num_experts, cfg.num_experts_per_token, cfg.num_shared_experts) == (896, 16, 2)
        assert lac["gate_lower_bound"] == -5.0 and cfg.max_position_embeddings == 2**20
    else:
        assert len(lac["kda_layers"]) == 3 * len(lac["full_attn_layers"])
    assert cfg.attn_res_block_size is not None and cfg.hidden_act == "situ" and lac["gate_lower_bound"] is not None
    assert cfg.num_experts >= 8 and cfg.num_shared_experts >= 1


def test_overrides_and_round_trip(tmp_path):
    from transformers import AutoConfig

    cfg = load_model_config(str(ROOT / "configs/model/tiny.yaml"), ["model.hidden_size=64", "rope_theta=5e5"])
    assert cfg.hidden_size == 64 and cfg.rope_theta == 5e5
    cfg.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)
    assert type(back).__name__ == "K3Config" and back.model_config_dict() == cfg.model_config_dict()
    assert K3Config.from_model_config(ModelConfig(hidden_size=48)).hidden_size == 48


BAD = [
    ({"linear_attn_config": {"gate_lower_bound": 0.0}}, "linear_attn_config.gate_lower_bound"),
    ({"linear_attn_config": {"gate_lower_bound": -5.5}}, "linear_attn_config.gate_lower_bound"),
    ({"linear_attn_config": {"kda_layers": [0, 1]}}, "linear_attn_config.kda_layers"),
    ({"linear_attn_config": {"kda_layers": [5]}}, "linear_attn_config.kda_layers"),
    ({"linear_attn_config": {"kda_layers": [1, 1]}}, "linear_attn_config.kda_layers"),
    ({"linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2, 3]}}, "linear_attn_config.full_attn_layers"),
    ({"linear_attn_config": {"num_heads": 0}}, "linear_attn_config.num_heads"),
    ({"linear_attn_config": {"bogus": 1}}, "linear_attn_config.bogus"),
    ({"num_experts": 6, "num_expert_group": 4}, "num_expert_group"),
    ({"num_experts_per_token": 9}, "num_experts_per_token"),
    ({"topk_group": 2}, "topk_group"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mla_use_nope": False, "qk_rope_head_dim": 5}, "qk_rope_head_dim"),
    ({"q_lora_rank": 0}, "q_lora_rank"),
    ({"attn_res_block_size": 0}, "attn_res_block_size"),
    ({"first_k_dense_replace": 9}, "first_k_dense_replace"),
    ({"moe_router_activation_func": "relu"}, "moe_router_activation_func"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"media_placeholder_token_id": 5000}, "media_placeholder_token_id"),
    ({"hidden_size": -1}, "hidden_size"),
    ({"router_balance": {"method": "aux"}}, "router_balance.method"),
]


@pytest.mark.parametrize("kwargs,field", BAD)
def test_invalid_values_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        K3Config(**kwargs)


def test_importing_model_config_does_not_import_torch():
    code = "import sys, model.config, model; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
