"""Hugging Face configs of a k3rl checkpoint, for `trust_remote_code` loading without k3rl installed.

This file is copied into every checkpoint directory k3rl writes (model/formats/save.py `save_model`), next to
modeling_kimi_k3.py, and named by the `auto_map` of its config.json. It imports only the standard library
and transformers, so transformers can copy it into its module cache and run it in any process.

* `KimiLinearConfig` (`model_type = "kimi_linear"`): the text model, keys and meanings of docs/model_spec.md
  §2.1 and `linear_attn_config` of §2.2 (1-based `kda_layers`). Defaults are the released class defaults,
  which are not K3's sizes; a k3rl checkpoint writes every key. k3rl's own keys (`router_balance`,
  `image_patch_size`, `checkpoint_layout`, …) and any other unknown key are kept as attributes and written
  back on save; the model ignores them.
* `KimiK3Config` (`model_type = "kimi_k3"`): `text_config` (a `KimiLinearConfig`), `vision_config` (kept as
  the plain dict of §2.4: this remote code builds no vision tower), the media placeholder, and
  `hidden_size` / `vocab_size` read through from the text config.

Departures from the released (vLLM) config classes: k3rl's extra text keys are understood —
`logit_scale`, `rope_theta` (RoPE on the MLA rope part when `mla_use_nope` is false; the released model has
no RoPE), `linear_attn_config.gate_lower_bound` and `use_full_rank_gate`. Values the model cannot run
(an unknown activation or router function, a KDA layer list that is not a subset of 1..L, a lower bound
outside [-5, 0)) raise ValueError naming the key.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

class KimiLinearConfig(PretrainedConfig):
    """The K3 / Kimi-Linear text config (spec §2.1); unknown keys are kept as attributes."""

    model_type = "kimi_linear"
    base_config_key = "text_config"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 4096,
        head_dim: int | None = None,
        intermediate_size: int = 11008,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        hidden_act: str = "silu",
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int | None = 0,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        tie_word_embeddings: bool = False,
        max_position_embeddings: int = 4096,
        rope_theta: float | None = None,
        moe_intermediate_size: int | None = None,
        moe_renormalize: bool = True,
        moe_router_activation_func: str = "sigmoid",
        num_experts: int | None = None,
        num_experts_per_token: int | None = None,
        num_shared_experts: int = 0,
        routed_scaling_factor: float = 1.0,
        first_k_dense_replace: int = 0,
        moe_layer_freq: int = 1,
        use_grouped_topk: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        topk_method: str = "noaux_tc",
        q_lora_rank: int | None = None,
        kv_lora_rank: int | None = None,
        qk_nope_head_dim: int | None = None,
        qk_rope_head_dim: int | None = None,
        v_head_dim: int | None = None,
        mla_use_nope: bool = False,
        mla_use_output_gate: bool = False,
        num_nextn_predict_layers: int = 0,
        linear_attn_config: dict | None = None,
        attn_res_block_size: int | None = None,
        latent_moe_use_norm: bool = False,
        activation_situ_beta: float | None = None,
        activation_situ_linear_beta: float | None = None,
        routed_expert_hidden_size: int | None = None,
        logit_scale: float = 1.0,
        **kwargs: Any,
    ) -> None:
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.intermediate_size, self.num_hidden_layers = intermediate_size, num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        self.hidden_act, self.initializer_range, self.rms_norm_eps = hidden_act, initializer_range, rms_norm_eps
        self.use_cache, self.max_position_embeddings = use_cache, max_position_embeddings
        # The released configs carry RoPE as rope_parameters/rope_scaling (unused there: NoPE); k3rl writes
        # rope_theta. Either gives the base used when mla_use_nope is false.
        rope = kwargs.get("rope_parameters") or kwargs.get("rope_scaling") or {}
        self.rope_theta = float(rope_theta if rope_theta is not None else rope.get("rope_theta", 10000.0))
        self.moe_intermediate_size, self.moe_renormalize = moe_intermediate_size, moe_renormalize
        self.moe_router_activation_func = moe_router_activation_func
        self.num_experts, self.num_experts_per_token = num_experts, num_experts_per_token
        self.num_shared_experts, self.routed_scaling_factor = num_shared_experts, routed_scaling_factor
        self.first_k_dense_replace, self.moe_layer_freq = first_k_dense_replace, moe_layer_freq
        self.use_grouped_topk, self.num_expert_group, self.topk_group = use_grouped_topk, num_expert_group, topk_group
        self.topk_method = topk_method
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.mla_use_nope, self.mla_use_output_gate = mla_use_nope, mla_use_output_gate
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.linear_attn_config = dict(linear_attn_config) if linear_attn_config is not None else None
        self.attn_res_block_size, self.latent_moe_use_norm = attn_res_block_size, latent_moe_use_norm
        self.activation_situ_beta, self.activation_situ_linear_beta = activation_situ_beta, activation_situ_linear_beta
        self.routed_expert_hidden_size, self.logit_scale = routed_expert_hidden_size, logit_scale
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
        self._validate()

    def _validate(self) -> None:
        if self.hidden_act not in ("silu", "situ"):
            raise ValueError(f"hidden_act: must be 'silu' or 'situ', got {self.hidden_act!r}")
        if self.hidden_act == "situ" and self.activation_situ_beta is None:
            raise ValueError("activation_situ_beta: hidden_act='situ' needs a β")
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ValueError(f"moe_router_activation_func: must be 'sigmoid' or 'softmax', "
                             f"got {self.moe_router_activation_func!r}")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings: K3 keeps a separate lm_head; must be false")
        lac = self.linear_attn_config
        if lac is None:
            return
        for key in ("kda_layers", "full_attn_layers"):
            if lac.get(key) is None:
                raise ValueError(f"linear_attn_config.{key}: must be set (a list of 1-based layer indices)")
        last = self.num_hidden_layers + self.num_nextn_predict_layers
        bad = [i for i in lac["kda_layers"] if not 1 <= i <= last]
        if bad:
            raise ValueError(f"linear_attn_config.kda_layers: 1-based indices must lie in [1, {last}], got {bad}")
        if lac["kda_layers"]:
            for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
                if not isinstance(lac.get(key), int) or lac[key] <= 0:
                    raise ValueError(f"linear_attn_config.{key}: must be a positive integer, got {lac.get(key)!r}")
        lb = lac.get("gate_lower_bound")
        if lb is not None and not -5.0 <= lb < 0.0:
            raise ValueError(f"linear_attn_config.gate_lower_bound: must lie in [-5, 0) or be null, got {lb!r}")

    def is_kda_layer(self, layer_idx: int) -> bool:
        """Spec §3: 0-based layer `layer_idx` is KDA iff `layer_idx + 1` is listed in `kda_layers`."""
        return self.linear_attn_config is not None and (layer_idx + 1) in self.linear_attn_config["kda_layers"]

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Spec §3: MoE iff experts exist, `layer_idx ≥ first_k_dense_replace` and `layer_idx % freq == 0`."""
        return (self.num_experts is not None and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None


class KimiK3Config(PretrainedConfig):
    """The K3 config (spec §2.3): `text_config` (a `KimiLinearConfig`) and `vision_config` (a plain dict)."""

    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiLinearConfig}

    def __init__(
        self,
        text_config: dict | KimiLinearConfig | None = None,
        vision_config: dict | None = None,
        ignore_index: int = -100,
        media_placeholder_token_id: int = 163605,
        pad_token_id: int | None = 0,
        image_placeholder: str = "<|kimi_image_placeholder|>",
        **kwargs: Any,
    ) -> None:
        if text_config is None:
            text_config = KimiLinearConfig()
        elif isinstance(text_config, dict):
            text_config = KimiLinearConfig(**text_config)
        elif not isinstance(text_config, KimiLinearConfig):
            raise ValueError(f"text_config: expected a dict or KimiLinearConfig, got {type(text_config).__name__}")
        self.text_config = text_config
        if vision_config is not None and not isinstance(vision_config, dict):
            vision_config = vision_config.to_dict()
        self.vision_config = dict(vision_config or {})
        # The projector's output width is the text width, whatever the stored value says (as vLLM does).
        self.vision_config["text_hidden_size"] = text_config.hidden_size
        self.ignore_index = ignore_index
        self.media_placeholder_token_id = media_placeholder_token_id
        self.image_placeholder = image_placeholder
        super().__init__(pad_token_id=pad_token_id, **kwargs)

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> KimiLinearConfig:
        """The text model's config (K3 has no separate encoder/decoder text configs)."""
        return self.text_config


__all__ = ["KimiLinearConfig", "KimiK3Config"]
