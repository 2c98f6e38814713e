"""Writing a K3 directory in a released layout (model/formats/layouts.py): `save_model`, `save_state_dict`,
and the tokenizer copied beside it (`copy_tokenizer`: its code only on request, model/formats/trust.py).

Weight files of an earlier save in the directory are replaced; the directory is not atomic by itself (the caller
writes into a temporary sibling: util/atomic.py `atomic_dir`).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from k3rl.model.formats.config_json import MEDIA_PROC_DEFAULTS, released_config
from k3rl.model.formats.layouts import CONFIG_FILE, LAYOUTS, PATCH_FILE, PREPROCESSOR_FILE, REMOTE_DIR, CheckpointError, layout_for
from k3rl.model.formats.names import native_weights, to_released_names
from k3rl.model.formats.trust import check_remote_code, inside
from k3rl.model.formats.weight_files import write_extra, write_weights

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
    replaced; the caller makes the directory atomic (util/atomic.py `atomic_dir`, a temporary sibling;
    rl/checkpoint.py `atomic_dir` adds the `COMPLETE` manifest)."""
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


__all__ = ["TOKENIZER_FILES", "copy_tokenizer", "save_model", "save_state_dict"]
