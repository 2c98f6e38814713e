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

This module holds the names the layouts share (file names, prefixes, model types, architectures); the rest of
the format is one module per concern: config.json (model/formats/config_json.py: written keys, released defaults,
k3rl's old layout), tensor names (model/formats/names.py), reading and checking a directory
(model/formats/load.py `load_model`, `check_model_dir`) and writing one (model/formats/save.py `save_model`).
In memory, `K3Config` keeps its own model type (`k3rl_k3`: transformers 5 owns `kimi_linear` with another
module layout); these modules are the only way k3rl reads or writes a K3 directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

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
PREPROCESSOR_FILE = "preprocessor_config.json"


class CheckpointError(ValueError):
    """A K3 directory that cannot be read: the message names the file, tensor or key."""


def layout_for(config: Any) -> str:
    """The layout a model of `config` is saved in: `checkpoint_layout`, or by default `kimi_k3` when images are
    on (`media_placeholder_token_id` set), else `kimi_linear`."""
    explicit = getattr(config, "checkpoint_layout", None)
    if explicit is not None:
        if explicit not in LAYOUTS:
            raise ValueError(f"checkpoint_layout: must be null, kimi_linear or kimi_k3, got {explicit!r}")
        return explicit
    return "kimi_k3" if getattr(config, "media_placeholder_token_id", None) is not None else "kimi_linear"


def default_layout(values: Any) -> str:
    """The layout `layout_for` picks for a `ModelConfig` dict without `checkpoint_layout`."""
    return "kimi_k3" if values.get("media_placeholder_token_id") is not None else "kimi_linear"


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    """`torch.bfloat16` → "bfloat16" (None stays None), as config.json spells dtypes."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


__all__ = ["ARCHITECTURES", "AUTO_MAP", "CONFIG_FILE", "CheckpointError", "INDEX_FILE", "LAYOUTS", "MODEL_TYPES",
           "NATIVE_PREFIX", "OLD_MODEL_TYPE", "PATCH_FILE", "PREPROCESSOR_FILE", "RELEASED_VISION_PREFIXES",
           "REMOTE_DIR", "TEXT_PREFIX", "default_layout", "dtype_name", "layout_for"]
