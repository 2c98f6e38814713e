"""The K3 model package: config, layers, cache, HF model classes and the tokenizer.

Public names are resolved lazily (PEP 562) so that `from model.config import ModelConfig`,
which every job config does before parsing its command line, does not import torch or
transformers. Touching any model class (or importing `model.modeling`) registers the
"k3rl_k3" model type with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "model.config",
    "LinearAttnConfig": "model.config",
    "K3Config": "model.config",
    "init_model": "model.init",
    "K3Cache": "model.cache",
    "K3ForCausalLM": "model.modeling",
    "K3Model": "model.modeling",
    "K3CausalLMOutput": "model.modeling",
    "KimiDeltaAttention": "model.kda",
    "MultiheadLatentAttention": "model.mla",
    "PatchEmbed": "model.vision",
    "train_tokenizer": "model.tokenizer",
    "load_tokenizer": "model.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
