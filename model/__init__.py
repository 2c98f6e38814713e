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
    "ModelConfig": "k3rl.model.config",
    "LinearAttnConfig": "k3rl.model.config",
    "K3Config": "k3rl.model.config",
    "init_model": "k3rl.model.init",
    "K3Cache": "k3rl.model.cache",
    "K3ForCausalLM": "k3rl.model.modeling",
    "K3Model": "k3rl.model.modeling",
    "K3CausalLMOutput": "k3rl.model.modeling",
    "KimiDeltaAttention": "k3rl.model.kda",
    "MultiheadLatentAttention": "k3rl.model.mla",
    "PatchEmbed": "k3rl.model.vision",
    "train_tokenizer": "k3rl.model.tokenizer",
    "load_tokenizer": "k3rl.model.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
