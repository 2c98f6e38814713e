"""Checkpoint format: every tensor name and shape of the spec's tables (§4.2–4.7) for K3 and
Kimi-Linear layouts, and nothing else; save_pretrained / from_pretrained (Auto classes) gives
identical logits; bf16 loading keeps the fp32 tensors fp32."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from k3_factory import make_config, make_model
from model.hf_names import split_experts


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
    """Names and shapes as checkpoints hold them (routed experts per expert: model/hf_names.py)."""
    return {k: tuple(v.shape) for k, v in split_experts(model.state_dict().items())}


def test_k3_layout_names_and_shapes():
    cfg = make_config(num_hidden_layers=5, kda_layers=(1, 2, 4), routed_expert_hidden_size=16, latent_moe_use_norm=True,
                      moe_layer_freq=2, first_k_dense_replace=1)
    assert state_shapes(make_model(cfg)) == expected_tensors(cfg)


def test_kimi_linear_layout_names_and_shapes():
    cfg = make_config(linear_attn_config={"use_full_rank_gate": False}, q_lora_rank=None, attn_res_block_size=None,
                      mla_use_output_gate=False, first_k_dense_replace=2)
    assert state_shapes(make_model(cfg)) == expected_tensors(cfg)


def test_save_load_round_trip_identical_logits(tmp_path):
    model = make_model(mla_use_nope=False, media_placeholder_token_id=3, image_patch_size=2)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_()  # a trained bias must survive the round trip
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "k3rl_k3"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert type(loaded).__name__ == "K3ForCausalLM"
    ids = torch.randint(4, 97, (2, 21))
    ids[0, 5:7] = 3
    pix = torch.randn(1, 3, 2, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, pixel_values=pix).logits, model(ids, pixel_values=pix).logits, atol=0, rtol=0)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    dtypes = {n: t.dtype for n, t in bf16.state_dict().items()}
    for name, dt in dtypes.items():
        fp32 = name.endswith(("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias"))
        assert dt == (torch.float32 if fp32 else torch.bfloat16), name
