"""Where every tensor and config key of a K3 model goes on disk: the released checkpoint layouts.

Two layouts are written (docs/model_spec.md §2, §4), chosen by `ModelConfig.checkpoint_layout` (`layout_for`):

- `kimi_linear`: the text-only Kimi-Linear family (vLLM `KimiLinearForCausalLM`): config.json is a flat
  `KimiLinearConfig`, weights `model.*` and `lm_head.weight`;
- `kimi_k3`: K3 (vLLM `KimiK3ForConditionalGeneration`): config.json holds `text_config` (the flat dict above)
  and `vision_config` (the spec's §2.4 defaults), weights under `language_model.` (`language_model.model.*`,
  `language_model.lm_head.weight`).

Both: routed experts per expert (`….experts.{e}.w{1,2,3}.weight`; the model stacks them, model/formats/names.py),
sharded safetensors with an index that lists them (model/formats/weight_files.py; optionally MXFP4-quantized experts,
lossy), the remote code of model/formats/remote/ copied in with `auto_map`, and k3rl's own image-patch projection
(`model.patch_embed.*`, no counterpart in the released model, whose images go through a ViT) in
`k3rl_patch_embed.safetensors`, a file the index does not list, so vLLM and transformers never see it.

Config keys: every `ModelConfig` field under its own name (they are the released names), plus the released keys
k3rl does not use (`head_dim`, `num_key_value_heads`, `use_grouped_topk`, `topk_method`,
`num_nextn_predict_layers`). On reading a released config, a `ModelConfig` field it lacks takes the released
default (`KimiLinearConfig`'s, `RELEASED_DEFAULTS`), not k3rl's; k3rl-only keys (`router_balance`, `image_*`,
`checkpoint_layout`) take k3rl's. Unknown keys are ignored.

Reading (`read_config`, `load_model`) also accepts k3rl's old layout (`model_type: k3rl_k3`, one
`model.safetensors` or transformers shards, the patch weight among the others), with a one-line warning.
What k3rl does not build is skipped when reading a released directory: the ViT and projector (`vision_tower.*`,
`mm_projector.*`; images are then off unless `k3rl_patch_embed.safetensors` is there), MTP layers
(`num_nextn_predict_layers`) and `rotary_emb` buffers. Anything else unknown, missing or of the wrong shape
is an error naming the tensor and its file. `load_model` also verifies the directory's `COMPLETE` manifest, the
index's shard set, each tensor's dtype and that every value is finite (model/formats/integrity.py).

In memory, `K3Config` keeps its own model type (`k3rl_k3`: transformers 5 owns `kimi_linear` with another
module layout); this module is the only way k3rl reads or writes a K3 directory.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from k3rl.model.formats import integrity
from k3rl.model.formats.names import split_experts, stack_experts
from k3rl.model.formats.trust import check_remote_code, inside
from k3rl.model.formats.weight_files import read_extra, read_index, read_json, read_weights, write_extra, write_weights

LAYOUTS = ("kimi_linear", "kimi_k3")
OLD_MODEL_TYPE = "k3rl_k3"
MODEL_TYPES = (*LAYOUTS, OLD_MODEL_TYPE)
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
PATCH_FILE = "k3rl_patch_embed.safetensors"
TEXT_PREFIX = "language_model."
NATIVE_PREFIX = "model.patch_embed."
RELEASED_VISION_PREFIXES = ("vision_tower.", "mm_projector.")
REMOTE_DIR = Path(__file__).resolve().parent / "remote"

ARCHITECTURES = {"kimi_linear": "KimiLinearForCausalLM", "kimi_k3": "KimiK3ForConditionalGeneration"}
AUTO_MAP = {
    "kimi_linear": {"AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
                    "AutoModelForCausalLM": "modeling_kimi_k3.KimiLinearForCausalLM"},
    "kimi_k3": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
}

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

PREPROCESSOR_FILE = "preprocessor_config.json"
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
_IGNORED = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
_LAYER = re.compile(r"^(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A K3 directory that cannot be read: the message names the file, tensor or key."""


# ---- which layout, which config.json

def layout_for(config: Any) -> str:
    """The layout a model of `config` is saved in: `checkpoint_layout`, or by default `kimi_k3` when images are
    on (`media_placeholder_token_id` set), else `kimi_linear`."""
    explicit = getattr(config, "checkpoint_layout", None)
    if explicit is not None:
        if explicit not in LAYOUTS:
            raise ValueError(f"checkpoint_layout: must be null, kimi_linear or kimi_k3, got {explicit!r}")
        return explicit
    return "kimi_k3" if getattr(config, "media_placeholder_token_id", None) is not None else "kimi_linear"


def _dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def text_config_dict(config: Any, layout: Optional[str] = None) -> dict[str, Any]:
    """The flat `KimiLinearConfig` dict of `config` (the kimi_linear config.json without architectures/auto_map,
    and the `text_config` of kimi_k3): every ModelConfig field, the released keys k3rl does not use.

    `checkpoint_layout` records `layout` only where it differs from the default rule, so a config read back
    equals the one saved."""
    values = config.model_config_dict()
    layout = layout or layout_for(config)
    if values["checkpoint_layout"] != layout:
        values["checkpoint_layout"] = None if layout == _default_layout(values) else layout
    return {"model_type": "kimi_linear", **values,
            "head_dim": values["hidden_size"] // values["num_attention_heads"],
            "num_key_value_heads": values["num_attention_heads"],
            "use_grouped_topk": True, "topk_method": "noaux_tc", "num_nextn_predict_layers": 0}


def _default_layout(values: Mapping[str, Any]) -> str:
    return "kimi_k3" if values.get("media_placeholder_token_id") is not None else "kimi_linear"


def released_config(config: Any, layout: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> dict[str, Any]:
    """config.json of `config` in `layout` (default `layout_for(config)`); `dtype`: of the saved weights."""
    layout = layout or layout_for(config)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: must be kimi_linear or kimi_k3, got {layout!r}")
    text = text_config_dict(config, layout)
    types = {"dtype": _dtype_name(dtype), "torch_dtype": _dtype_name(dtype)} if dtype is not None else {}
    head = {"architectures": [ARCHITECTURES[layout]], "auto_map": dict(AUTO_MAP[layout])}
    if layout == "kimi_linear":
        return {**text, **head, **types}
    vision = {**VISION_DEFAULTS, "text_hidden_size": text["hidden_size"]}
    return {"model_type": "kimi_k3", **head, "text_config": {**text, **types}, "vision_config": vision,
            "media_placeholder_token_id": text["media_placeholder_token_id"], "pad_token_id": text["pad_token_id"],
            **K3_EXTRAS, "tie_word_embeddings": False, **types}


# ---- reading config.json

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
        _warn_old(directory)
    return config_from_dict(raw, images_file=(directory / PATCH_FILE).is_file(), source=directory / CONFIG_FILE)


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


def _warn_old(directory: Path) -> None:
    warnings.warn(f"{directory}: k3rl's old checkpoint layout (model_type {OLD_MODEL_TYPE}) was converted on "
                  f"reading; `k3rl export {directory} NEW_DIR` rewrites it in the released layout",
                  UserWarning, stacklevel=3)


# ---- tensor names

def _released_name(name: str, layout: str) -> str:
    if not name.startswith(("model.", "lm_head.")):
        raise ValueError(f"{name}: not a K3ForCausalLM state-dict name")
    return TEXT_PREFIX + name if layout == "kimi_k3" else name


def to_released_names(state_dict: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Internal state dict → the tensors of the released layout: routed experts per expert (views), the
    `language_model.` prefix for kimi_k3. k3rl's own patch weights (`model.patch_embed.*`, `native_weights`)
    are left out: they are written to `PATCH_FILE`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: must be kimi_linear or kimi_k3, got {layout!r}")
    return {_released_name(n, layout): t for n, t in split_experts(state_dict.items())
            if not n.startswith(NATIVE_PREFIX)}


def native_weights(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """k3rl's own image-patch weights (no released counterpart), under their internal names."""
    return {n: t for n, t in state_dict.items() if n.startswith(NATIVE_PREFIX)}


def from_released_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Released tensors (kimi_linear, or kimi_k3 with `language_model.model.layers.` or `language_model.layers.`)
    → the internal state dict (experts stacked). `model.patch_embed.*` passes unchanged. A mix of the two
    layouts' names, a name that is not a text tensor, or a tensor given twice is refused, naming it."""
    prefixed = next((n for n in tensors if n.startswith(TEXT_PREFIX)), None)
    plain = next((n for n in tensors if not n.startswith((TEXT_PREFIX, NATIVE_PREFIX))), None)
    if prefixed is not None and plain is not None:
        raise CheckpointError(f"tensor names mix the kimi_k3 layout ({prefixed}) and the kimi_linear one ({plain})")
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for name, t in tensors.items():
        rest = name.removeprefix(TEXT_PREFIX) if prefixed is not None else name
        if rest.startswith("layers."):
            rest = "model." + rest
        if not rest.startswith(("model.", "lm_head.")):
            raise CheckpointError(f"{name}: not a tensor of the K3 text model")
        if rest in out:
            raise CheckpointError(f"{name}: the same tensor as {origin[rest]} (both spellings given)")
        out[rest], origin[rest] = t, name
    return stack_experts(out)


# ---- weight files (storage itself: model/formats/weight_files.py)

def _index_map(directory: Path) -> Optional[dict[str, str]]:
    """The index's tensor → file map (None without an index); a malformed index, or one naming a file outside
    the directory, is an error naming it (model/formats/weight_files.py `read_index`)."""
    return read_index(directory)


def _patch_weights(directory: Path) -> dict[str, torch.Tensor]:
    return read_extra(directory, PATCH_FILE)


def _file_of(directory: Path, weight_map: Optional[dict[str, str]], name: str) -> str:
    if name.startswith(NATIVE_PREFIX):
        return PATCH_FILE
    weight_map = weight_map or {}
    packed = name.removesuffix(".weight") + ".weight_packed"  # an MXFP4 tensor is listed by its packed half
    return weight_map.get(name) or weight_map.get(packed) or "model.safetensors"


def read_released(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a K3 directory under its on-disk name (dequantized; `PATCH_FILE`'s included), before any
    check against a config: for tools that look at a checkpoint."""
    directory = Path(directory)
    raw_config(directory)  # a named error for a missing or unreadable config.json
    return {**read_weights(directory), **_patch_weights(directory)}


def read_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """The internal state dict (experts stacked, patch weights included) of a K3 directory in any layout, not
    checked against a config: for a caller that checks it against its own model (the learner's `load`)."""
    tensors = read_released(directory)
    native = {n: tensors.pop(n) for n in list(tensors) if n.startswith(NATIVE_PREFIX)}
    return {**from_released_names(tensors), **native}


def _skip_unbuilt(tensors: dict[str, torch.Tensor], raw: Mapping[str, Any], config: Any,
                  directory: Path) -> dict[str, torch.Tensor]:
    """Drop what k3rl does not build (released ViT and projector, MTP layers, rotary caches), saying so."""
    text = raw.get("text_config", raw)
    mtp = text.get("num_nextn_predict_layers") if isinstance(text, Mapping) else 0
    if mtp is not None and (not isinstance(mtp, int) or isinstance(mtp, bool) or not 0 <= mtp <= 2**20):
        raise CheckpointError(f"{directory / CONFIG_FILE}: num_nextn_predict_layers must be a non-negative "
                              f"integer, got {mtp!r}")
    mtp = mtp or 0
    L = config.num_hidden_layers
    skipped = {"vision tower / projector": 0, "MTP layer": 0}
    kept = {}
    for name, t in tensors.items():
        layer = _LAYER.match(name)
        if name.startswith(RELEASED_VISION_PREFIXES):
            skipped["vision tower / projector"] += 1
        elif mtp and layer is not None and L <= int(layer[1]) < L + mtp:
            skipped["MTP layer"] += 1
        elif not _IGNORED.search(name):
            kept[name] = t
    said = [f"{n} {what} tensors" for what, n in skipped.items() if n]
    if said:
        warnings.warn(f"{directory}: k3rl does not build the released {' or '.join(k for k, n in skipped.items() if n)}"
                      f" weights; skipped {', '.join(said)}", UserWarning, stacklevel=3)
    return kept


def _check_tensors(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, torch.Tensor], directory: Path,
                   weight_map: Optional[dict[str, str]]) -> None:
    """Every expected tensor there with its shape, nothing else; errors name the tensor and its file."""
    missing = sorted(set(expected) - set(found))
    if missing:
        where = INDEX_FILE if weight_map is not None else "the weight files"
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{directory}: tensor {missing[0]}{more} missing (not in {where}"
                              f"{' or ' + PATCH_FILE if missing[0].startswith(NATIVE_PREFIX) else ''})")
    unknown = sorted(set(found) - set(expected))
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise CheckpointError(f"{directory}: unknown tensor {unknown[0]}{more} in "
                              f"{_file_of(directory, weight_map, unknown[0])} (not a tensor of this config)")
    for name, shape in expected.items():
        got = tuple(found[name].shape)
        if got != tuple(shape):
            raise CheckpointError(f"{directory}: tensor {name} in {_file_of(directory, weight_map, name)} has shape "
                                  f"{list(got)}, this config needs {list(shape)}")


def _check_dtypes(floating: set[str], found: Mapping[str, torch.Tensor], directory: Path,
                  weight_map: Optional[dict[str, str]], declared: Optional[torch.dtype]) -> None:
    """Every tensor of the dtype kind the model needs (floating or not), and a floating one in config.json's dtype,
    float32 (routers, gates and convolutions are kept in float32) or, for MXFP4 experts, their bfloat16 decoding:
    a header whose dtype was changed (bfloat16 read as float16, floats read as integers) is refused by name."""
    for name, t in found.items():
        where = f"{directory}: tensor {name} in {_file_of(directory, weight_map, name)}"
        if t.is_floating_point() != (name in floating):
            raise CheckpointError(f"{where} has dtype {_dtype_name(t.dtype)}, this model needs a "
                                  f"{'floating-point' if name in floating else 'non-floating'} tensor")
        packed = (weight_map or {}).get(name.removesuffix(".weight") + ".weight_packed") is not None
        allowed = {declared, torch.float32} | ({torch.bfloat16} if packed else set())
        if declared is not None and t.is_floating_point() and t.dtype not in allowed:
            raise CheckpointError(f"{where} has dtype {_dtype_name(t.dtype)}, config.json says "
                                  f"{_dtype_name(declared)}")


def _declared_dtype(raw: Mapping[str, Any]) -> Optional[torch.dtype]:
    """config.json's `dtype` / `torch_dtype` (kimi_k3: also in text_config) when it names a floating type."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else {}
    for where in (text, raw):
        for key in ("dtype", "torch_dtype"):
            value = getattr(torch, str(where.get(key)), None) if where.get(key) else None
            if isinstance(value, torch.dtype) and value.is_floating_point:
                return value
    return None


def _keep_fp32(name: str) -> bool:
    from k3rl.model.modeling import K3PreTrainedModel

    return bool(set(name.split(".")) & set(K3PreTrainedModel._keep_in_fp32_modules_strict))


def _meta_model(directory: Path) -> tuple[Any, Mapping[str, Any]]:
    """(the K3ForCausalLM of the directory's config.json on the meta device, the raw config)."""
    from k3rl.model.modeling import K3ForCausalLM

    raw = raw_config(directory)
    config = config_from_dict(raw, images_file=(directory / PATCH_FILE).is_file(), source=directory / CONFIG_FILE)
    if raw.get("model_type") == OLD_MODEL_TYPE:
        _warn_old(directory)
    with torch.device("meta"):
        return K3ForCausalLM(config), raw


def _checked(directory: Path, model: Any, raw: Mapping[str, Any], tensors: dict[str, torch.Tensor]
             ) -> tuple[dict[str, torch.Tensor], Optional[dict[str, str]]]:
    """(the tensors of `model` found on disk, under released names, the index's map): what k3rl does not build
    dropped, the index's shard set, every tensor's name, shape and dtype checked against the model."""
    internal = model.state_dict()
    on_disk = "kimi_linear" if raw.get("model_type") == OLD_MODEL_TYPE else raw.get("model_type")
    wanted = {**to_released_names(internal, on_disk), **native_weights(internal)}
    weight_map = _index_map(directory)
    integrity.check_shard_set(directory, weight_map, side_files=(PATCH_FILE,))
    tensors = _skip_unbuilt(tensors, raw, model.config, directory)
    if on_disk == "kimi_k3":  # the other spelling vLLM maps: language_model.layers.{i}.
        tensors = {TEXT_PREFIX + "model." + n.removeprefix(TEXT_PREFIX) if n.startswith(TEXT_PREFIX + "layers.")
                   else n: t for n, t in tensors.items()}
        if weight_map is not None:
            weight_map |= {TEXT_PREFIX + "model." + n.removeprefix(TEXT_PREFIX): f for n, f in weight_map.items()
                           if n.startswith(TEXT_PREFIX + "layers.")}
    _check_tensors({n: tuple(t.shape) for n, t in wanted.items()}, tensors, directory, weight_map)
    _check_dtypes({n for n, t in wanted.items() if t.is_floating_point()}, tensors, directory, weight_map,
                  _declared_dtype(raw))
    return tensors, weight_map


def check_model_dir(directory: str | Path, allow_nonfinite: bool = False, hint: str = integrity.OVERRIDE) -> None:
    """Everything `load_model` checks (a non-K3 directory: manifest, shard set, finite values), reading one tensor
    at a time: for a driver before it hands the directory to workers or writes anything. Named errors:
    `CorruptCheckpointError`, `CheckpointError` / ValueError / FileNotFoundError (the file or tensor),
    `NonFiniteWeightsError` (`hint`: what the user can do about them, `integrity.TRAINING` for training)."""
    directory = Path(directory)
    integrity.verify_model_dir(directory)
    meta, bad = integrity.scan_weight_files(directory)
    if is_k3_dir(directory):
        with warnings.catch_warnings():
            # the load that follows says it once
            warnings.simplefilter("ignore")
            model, raw = _meta_model(directory)
            _checked(directory, model, raw, meta)
    else:
        integrity.check_shard_set(directory, _index_map(directory), side_files=(PATCH_FILE,))
    integrity.refuse_nonfinite(bad, directory, allow_nonfinite, hint)


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               allow_nonfinite: bool = False):
    """The `K3ForCausalLM` of a K3 directory in any layout, in `dtype` (in 16-bit dtypes the router bias, KDA gate
    parameters and convolutions stay float32, as with transformers' loader) on `device`, in eval mode.

    Checked first (model/formats/integrity.py): the directory's `COMPLETE` manifest when it has one (content hashes), the
    index's shard set, every tensor's name, shape and dtype against config.json, and every value finite — a NaN or
    ±inf (also one made by the cast to `dtype`) is a `NonFiniteWeightsError` naming the tensors, a warning with
    `allow_nonfinite`."""
    directory = Path(directory)
    integrity.verify_model_dir(directory)
    model, raw = _meta_model(directory)
    tensors, weight_map = _checked(directory, model, raw, read_released(directory))
    bad = [(f"{name} in {_file_of(directory, weight_map, name)}", n)
           for name, n in integrity.nonfinite_tensors(tensors.items())]
    integrity.refuse_nonfinite(bad, directory, allow_nonfinite)
    state = from_released_names(tensors)
    low = dtype in (torch.float16, torch.bfloat16)
    narrowed = []
    with torch.no_grad():
        # fresh copies, one tensor at a time: views into a file's buffer may be less aligned than allocations,
        # and BLAS then rounds differently (1e-16 in float64)
        for name in list(state):
            t = state.pop(name)
            kind = (torch.float32 if low and _keep_fp32(name) else dtype) if t.is_floating_point() else t.dtype
            state[name] = t.to(kind, copy=True)
            if t.is_floating_point() and state[name].element_size() < t.element_size():
                narrowed.append(name)
            del t
    if not allow_nonfinite:
        overflow = integrity.nonfinite_tensors((name, state[name]) for name in narrowed)
        integrity.refuse_nonfinite(overflow, f"{directory} cast to {_dtype_name(dtype)} (finite values beyond its "
                                   f"range)")
    model.load_state_dict(state, assign=True, strict=True)
    return model.to(device).eval()


# ---- writing

_OWN_FILES = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                        + re.escape(PATCH_FILE) + "|" + re.escape(PREPROCESSOR_FILE) + r")$")
TOKENIZER_FILES = re.compile(r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|chat_template\..*|"
                              r"vocab\..*|merges\.txt|.*\.tiktoken|tokenization_.*\.py|spiece\.model)$")


def copy_tokenizer(source: Any, directory: str | Path, trust_remote_code: bool = False) -> None:
    """The tokenizer of `source` into `directory`: a tokenizer object (`save_pretrained`), or a directory whose
    tokenizer files (tokenizer.json, tokenizer_config.json, chat template, vocabularies) are copied as they are.
    Its code (`tokenization_*.py`) is copied only with `trust_remote_code`; a tokenizer that asks for its code
    without it is a `RemoteCodeError`, and a file that resolves outside `source` a `PathEscapeError`
    (model/formats/trust.py)."""
    directory = Path(directory)
    if hasattr(source, "save_pretrained"):
        source.save_pretrained(directory)
        return
    source = Path(source)
    files = [p for p in sorted(source.iterdir()) if p.is_file() and TOKENIZER_FILES.match(p.name)] \
        if source.is_dir() else []
    if not files:
        raise FileNotFoundError(f"tokenizer_from: {source} holds no tokenizer files (tokenizer.json, "
                                f"tokenizer_config.json, …)")
    trusted = check_remote_code(source, trust_remote_code, model=False)
    for p in files:
        inside(source, p.name, f"{source}: tokenizer file")
    for p in files:
        if p.suffix == ".py" and not trusted:
            continue
        if p.resolve() != (directory / p.name).resolve():
            shutil.copyfile(p, directory / p.name)


def save_model(model: Any, directory: str | Path, *, layout: Optional[str] = None, tokenizer_from: Any = None,
               quantize: Optional[str] = None, max_shard_bytes: Optional[int] = None,
               trust_remote_code: bool = False, allow_nonfinite: bool = False) -> Path:
    """Write `model` (a K3ForCausalLM) to `directory` in `layout` (default `layout_for(model.config)`): config.json,
    sharded safetensors + index under the released names, `PATCH_FILE` when images are on, the remote code of
    model/formats/remote/ (with `auto_map`), and the tokenizer of `tokenizer_from` when given (`copy_tokenizer`: its code
    only with `trust_remote_code`).
    `quantize="mxfp4"` stores the routed experts in MXFP4 (lossy). Weight files of an earlier save there are
    replaced; the caller makes the directory atomic (`rl.checkpoint.atomic_dir`, a temporary sibling)."""
    return save_state_dict(model.config, model.state_dict(), directory, layout=layout, tokenizer_from=tokenizer_from,
                           quantize=quantize, max_shard_bytes=max_shard_bytes, trust_remote_code=trust_remote_code,
                           allow_nonfinite=allow_nonfinite)


def save_state_dict(config: Any, state: Mapping[str, torch.Tensor], directory: str | Path, *,
                    layout: Optional[str] = None, tokenizer_from: Any = None, quantize: Optional[str] = None,
                    max_shard_bytes: Optional[int] = None, trust_remote_code: bool = False,
                    allow_nonfinite: bool = False) -> Path:
    """`save_model` from a K3Config and a full state dict in internal names (e.g. gathered from expert-parallel and
    FSDP-sharded ranks by rl/train/parallel.py `full_state_dict`)."""
    directory = Path(directory)
    layout = layout or layout_for(config)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: must be kimi_linear or kimi_k3, got {layout!r}")
    if "lm_head.weight" not in state:
        raise CheckpointError("save_state_dict: the state dict has no lm_head.weight (not a full K3 state dict)")
    if tokenizer_from is not None and not hasattr(tokenizer_from, "save_pretrained"):
        # refused before anything is written, not after the weights
        check_remote_code(tokenizer_from, trust_remote_code, model=False)
    directory.mkdir(parents=True, exist_ok=True)
    for p in directory.iterdir():
        if p.is_file() and _OWN_FILES.match(p.name):
            p.unlink()
    dtype = state["lm_head.weight"].dtype
    shard = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    quantization = write_weights(directory, to_released_names(state, layout), quantize=quantize,
                                 allow_nonfinite=allow_nonfinite, **shard)
    native = native_weights(state)
    if native:
        write_extra(directory, PATCH_FILE, native)
    released = released_config(config, layout, dtype)
    if quantization is not None:
        released["quantization_config"] = quantization
    (directory / CONFIG_FILE).write_text(json.dumps(released, indent=2, sort_keys=False) + "\n")
    if layout == "kimi_k3":
        media = {"patch_size": int(config.image_patch_size), **MEDIA_PROC_DEFAULTS}
        (directory / PREPROCESSOR_FILE).write_text(json.dumps({"media_proc_cfg": media}, indent=2) + "\n")
    if REMOTE_DIR.is_dir():
        for p in sorted(REMOTE_DIR.glob("*.py")):
            shutil.copyfile(p, directory / p.name)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, directory, trust_remote_code=trust_remote_code)
    return directory


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


__all__ = ["CONFIG_FILE", "CheckpointError", "INDEX_FILE", "LAYOUTS", "MODEL_TYPES", "OLD_MODEL_TYPE", "PATCH_FILE",
           "TOKENIZER_FILES", "check_model_dir", "config_from_dict", "copy_tokenizer", "from_released_names",
           "is_k3_dir", "kimi_k3_config_registered", "layout_for", "load_model", "model_type_of", "native_weights",
           "raw_config", "read_config", "read_released", "read_state_dict", "released_config", "save_model",
           "save_state_dict", "text_config_dict", "to_released_names"]
