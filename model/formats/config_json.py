"""config.json of a K3 directory: what k3rl writes, how a released one is read, k3rl's old layout.

Config keys (model/formats/layouts.py for the layouts): every `ModelConfig` field under its own name (they are the
released names), plus the released keys k3rl does not use (`head_dim`, `num_key_value_heads`, `use_grouped_topk`,
`topk_method`, `num_nextn_predict_layers`). On reading a released config, a `ModelConfig` field it lacks takes the
released default (`KimiLinearConfig`'s, `RELEASED_DEFAULTS`), not k3rl's; k3rl-only keys (`router_balance`,
`image_*`, `checkpoint_layout`) take k3rl's. Unknown keys are ignored. k3rl's old layout (`model_type: k3rl_k3`)
is read too, with a one-line warning (`warn_old`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from k3rl.model.formats.layouts import (
    ARCHITECTURES,
    AUTO_MAP,
    CONFIG_FILE,
    LAYOUTS,
    MODEL_TYPES,
    OLD_MODEL_TYPE,
    PATCH_FILE,
    CheckpointError,
    default_layout,
    dtype_name,
    layout_for,
)
from k3rl.model.formats.trust import read_json

RELEASED_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "logit_scale": 1.0, "rope_theta": 10000.0,
    "moe_intermediate_size": None, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "num_experts": None, "num_experts_per_token": None, "num_shared_experts": 0, "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 0, "moe_layer_freq": 1, "num_expert_group": 1, "topk_group": 1,
    "q_lora_rank": None, "kv_lora_rank": None, "qk_nope_head_dim": None, "qk_rope_head_dim": None,
    "v_head_dim": None, "mla_use_nope": False, "mla_use_output_gate": False, "attn_res_block_size": None,
    "latent_moe_use_norm": False, "activation_situ_beta": None, "activation_situ_linear_beta": None,
    "routed_expert_hidden_size": None,
}
"""`KimiLinearConfig`'s constructor defaults (spec §2.1) of the `ModelConfig` fields: what a released config
means by leaving a key out. The fields not listed are k3rl's own and keep k3rl's defaults."""

RELEASED_LINEAR_ATTN_DEFAULTS = {"gate_lower_bound": None, "use_full_rank_gate": False}
"""The optional `linear_attn_config` keys of spec §2.2 (absent: unbounded gate, Kimi-Linear's low-rank gate)."""

VISION_DEFAULTS: dict[str, Any] = {
    "model_type": "kimi_k3_vision", "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64,
    "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
    "vt_hidden_size": 1024, "vt_num_hidden_layers": 27, "vt_num_attention_heads": 12, "vt_intermediate_size": 4096,
    "qkv_hidden_size": 1536, "norm_type": "rmsnorm", "attn_bias": False, "linear_bias": False,
    "patch_embed_proj_bias": False, "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh",
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal",
    "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
}
"""`KimiK3VisionConfig` defaults (spec §2.4); `text_hidden_size` is added per model."""

K3_EXTRAS = {"ignore_index": -100, "image_placeholder": "<|kimi_image_placeholder|>"}

MEDIA_PROC_DEFAULTS: dict[str, Any] = {
    "merge_kernel_size": 2, "temporal_merge_kernel_size": 4, "in_patch_limit": 16384, "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None, "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
"""`media_proc_cfg` of a kimi_k3 directory's preprocessor_config.json: vLLM's K3 processing info reads it even when
it serves the model text-only (`language_model_only`). k3rl's own values (the released ones are not in the files
here): patch size from the model config, the 2×2 merge and 4-frame temporal merge of the vision defaults, and
patch limits large enough for the images k3rl's environments send. k3rl's native patch path itself takes pixel
values as given (model/vision.py), so the mean/std here only describe what vLLM's processor would do."""


def text_config_dict(config: Any, layout: Optional[str] = None) -> dict[str, Any]:
    """The flat `KimiLinearConfig` dict of `config` (the kimi_linear config.json without architectures/auto_map,
    and the `text_config` of kimi_k3): every ModelConfig field, the released keys k3rl does not use.

    `checkpoint_layout` records `layout` only where it differs from the default rule, so a config read back
    equals the one saved."""
    values = config.model_config_dict()
    layout = layout or layout_for(config)
    if values["checkpoint_layout"] != layout:
        values["checkpoint_layout"] = None if layout == default_layout(values) else layout
    return {"model_type": "kimi_linear", **values,
            "head_dim": values["hidden_size"] // values["num_attention_heads"],
            "num_key_value_heads": values["num_attention_heads"],
            "use_grouped_topk": True, "topk_method": "noaux_tc", "num_nextn_predict_layers": 0}


def released_config(config: Any, layout: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> dict[str, Any]:
    """config.json of `config` in `layout` (default `layout_for(config)`); `dtype`: of the saved weights."""
    layout = layout or layout_for(config)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: must be kimi_linear or kimi_k3, got {layout!r}")
    text = text_config_dict(config, layout)
    types = {"dtype": dtype_name(dtype), "torch_dtype": dtype_name(dtype)} if dtype is not None else {}
    head = {"architectures": [ARCHITECTURES[layout]], "auto_map": dict(AUTO_MAP[layout])}
    if layout == "kimi_linear":
        return {**text, **head, **types}
    vision = {**VISION_DEFAULTS, "text_hidden_size": text["hidden_size"]}
    return {"model_type": "kimi_k3", **head, "text_config": {**text, **types}, "vision_config": vision,
            "media_placeholder_token_id": text["media_placeholder_token_id"], "pad_token_id": text["pad_token_id"],
            **K3_EXTRAS, "tie_word_embeddings": False, **types}


def raw_config(directory: str | Path) -> dict[str, Any]:
    """config.json of `directory` as a dict; a missing or unreadable file is an error naming it."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no Hugging Face model at {directory} ({CONFIG_FILE} missing)")
    try:
        raw = read_json(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def model_type_of(directory: str | Path) -> Optional[str]:
    """config.json's `model_type` (None when the directory has no config.json)."""
    if not (Path(directory) / CONFIG_FILE).is_file():
        return None
    return raw_config(directory).get("model_type")


def is_k3_dir(directory: str | Path) -> bool:
    """Whether `directory` holds a K3 model in any layout k3rl reads (`MODEL_TYPES`)."""
    return model_type_of(directory) in MODEL_TYPES


def read_config(directory: str | Path) -> Any:
    """The `K3Config` of a K3 directory in any layout (old k3rl layout: with a one-line warning)."""
    directory = Path(directory)
    raw = raw_config(directory)
    if raw.get("model_type") == OLD_MODEL_TYPE:
        warn_old(directory)
    return config_from_dict(raw, images_file=(directory / PATCH_FILE).is_file(), source=directory / CONFIG_FILE)


def image_patch_of(directory: str | Path) -> Optional[int]:
    """The patch size of a K3 directory whose model reads images (envs/media.py), else None (any other model)."""
    if not is_k3_dir(directory):
        return None
    config = read_config(directory)
    return None if getattr(config, "media_placeholder_token_id", None) is None else int(config.image_patch_size)


def config_from_dict(raw: Mapping[str, Any], images_file: bool = False, source: Any = CONFIG_FILE) -> Any:
    """`K3Config` of a config.json dict. `images_file`: the directory has k3rl's patch weights; a released
    kimi_k3 config without them is read as the text model (images off: its ViT is not built here)."""
    from k3rl.model.config import K3Config, model_config_defaults

    model_type = raw.get("model_type")
    fields = model_config_defaults()
    if model_type == OLD_MODEL_TYPE:
        values = {k: raw[k] for k in fields if k in raw}
    elif model_type == "kimi_linear":
        values = _released_values(raw, source)
    elif model_type == "kimi_k3":
        text = raw.get("text_config")
        if not isinstance(text, Mapping):
            raise CheckpointError(f"{source}: model_type kimi_k3 needs a `text_config` object, got {text!r}")
        values = _released_values(text, f"{source}: text_config")
        k3rl_written = "checkpoint_layout" in text
        media = raw.get("media_placeholder_token_id")
        values["media_placeholder_token_id"] = media if (images_file or k3rl_written) else None
        values.setdefault("checkpoint_layout", "kimi_k3")
    else:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not a K3 layout k3rl reads "
                              f"(kimi_linear, kimi_k3, or k3rl's old {OLD_MODEL_TYPE})")
    try:
        return K3Config(**values)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{source}: {e}") from e


def _released_values(text: Mapping[str, Any], source: Any) -> dict[str, Any]:
    """ModelConfig values of a flat KimiLinearConfig dict: its keys, the released defaults for the fields it
    leaves out (k3rl-only fields: k3rl's defaults); unknown keys ignored."""
    from k3rl.model.config import LinearAttnConfig, model_config_defaults

    fields = model_config_defaults()
    values = {k: text[k] if k in text else RELEASED_DEFAULTS[k] for k in fields
              if k in text or k in RELEASED_DEFAULTS}
    if "rope_theta" not in text:
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if isinstance(rope, Mapping) and "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
    lac = text.get("linear_attn_config")
    if lac is None:
        values["linear_attn_config"] = {"kda_layers": [], "full_attn_layers": [], **RELEASED_LINEAR_ATTN_DEFAULTS}
    elif not isinstance(lac, Mapping):
        raise CheckpointError(f"{source}: linear_attn_config must be an object, got {lac!r}")
    else:
        known = {f for f in LinearAttnConfig.__dataclass_fields__}
        sub = {**RELEASED_LINEAR_ATTN_DEFAULTS, **{k: v for k, v in lac.items() if k in known}}
        for key in ("kda_layers", "full_attn_layers"):
            if sub.get(key) is None:
                raise CheckpointError(f"{source}: linear_attn_config.{key} is missing")
        if sub["kda_layers"]:
            for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
                if key not in sub:
                    raise CheckpointError(f"{source}: linear_attn_config.{key} is missing (KDA layers "
                                          f"{sub['kda_layers']} need it)")
        values["linear_attn_config"] = sub
    return values


def warn_old(directory: Path) -> None:
    """The one-line warning for a directory in k3rl's old layout (read, converted, not rewritten)."""
    warnings.warn(f"{directory}: k3rl's old checkpoint layout (model_type {OLD_MODEL_TYPE}) was converted on "
                  f"reading; `k3rl export {directory} NEW_DIR` rewrites it in the released layout",
                  UserWarning, stacklevel=3)


def declared_dtype(raw: Mapping[str, Any]) -> Optional[torch.dtype]:
    """config.json's `dtype` / `torch_dtype` (kimi_k3: also in text_config) when it names a floating type."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else {}
    for where in (text, raw):
        for key in ("dtype", "torch_dtype"):
            value = getattr(torch, str(where.get(key)), None) if where.get(key) else None
            if isinstance(value, torch.dtype) and value.is_floating_point:
                return value
    return None


@functools.cache
def _directory_config_class() -> type:
    from transformers import PretrainedConfig

    class KimiK3DirectoryConfig(PretrainedConfig):
        """config.json of a kimi_k3 directory as plain attributes (k3rl itself reads it with `read_config`)."""

        model_type = "kimi_k3"

    return KimiK3DirectoryConfig


@contextlib.contextmanager
def kimi_k3_config_registered() -> Iterator[None]:
    """While inside, transformers' `AutoConfig` knows `kimi_k3` (which transformers does not ship) as a plain config.

    For `AutoTokenizer` (model/tokenizer.py `load_tokenizer`), which reads config.json first: without it, a kimi_k3
    directory's `auto_map` makes transformers ask on stdin whether to run the remote code (15 s on a terminal).
    Scoped, not global: after the block `AutoConfig.from_pretrained(dir, trust_remote_code=True)` gets the
    directory's own remote `KimiK3Config` again, in k3rl's process as in any other."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "kimi_k3" in CONFIG_MAPPING:  # registered by the user (or an enclosing block): leave it alone
        yield
        return
    CONFIG_MAPPING.register("kimi_k3", _directory_config_class())
    try:
        yield
    finally:
        CONFIG_MAPPING._extra_content.pop("kimi_k3", None)


__all__ = ["K3_EXTRAS", "MEDIA_PROC_DEFAULTS", "RELEASED_DEFAULTS", "RELEASED_LINEAR_ATTN_DEFAULTS", "VISION_DEFAULTS",
           "config_from_dict", "declared_dtype", "is_k3_dir", "kimi_k3_config_registered", "model_type_of",
           "raw_config", "read_config", "released_config", "text_config_dict", "warn_old"]
