"""Reading a K3 directory in any layout k3rl knows, checked before anything is built from it.

`load_model` returns the model; `check_model_dir` checks the same without holding it (for a driver, before it
hands the directory to workers). What k3rl does not build is skipped when reading a released directory: the ViT
and projector (`vision_tower.*`, `mm_projector.*`; images are then off unless `k3rl_patch_embed.safetensors` is
there), MTP layers (`num_nextn_predict_layers`) and `rotary_emb` buffers. Anything else unknown, missing or of the
wrong shape is an error naming the tensor and its file. `load_model` also verifies the directory's `COMPLETE`
manifest, the index's shard set, each tensor's dtype and that every value is finite (model/formats/integrity.py).
k3rl's old layout (`model_type: k3rl_k3`, one `model.safetensors` or transformers shards, the patch weight among
the others) is read with a one-line warning.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from k3rl.model.formats import integrity
from k3rl.model.formats.config_json import config_from_dict, declared_dtype, is_k3_dir, raw_config, warn_old
from k3rl.model.formats.layouts import (
    CONFIG_FILE,
    INDEX_FILE,
    NATIVE_PREFIX,
    OLD_MODEL_TYPE,
    PATCH_FILE,
    RELEASED_VISION_PREFIXES,
    TEXT_PREFIX,
    CheckpointError,
    dtype_name,
)
from k3rl.model.formats.names import from_released_names, native_weights, to_released_names
from k3rl.model.formats.weight_files import read_extra, read_index, read_weights, scan_weight_files

_IGNORED = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
_LAYER = re.compile(r"^(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")


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
    return {**read_weights(directory), **read_extra(directory, PATCH_FILE)}


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
            raise CheckpointError(f"{where} has dtype {dtype_name(t.dtype)}, this model needs a "
                                  f"{'floating-point' if name in floating else 'non-floating'} tensor")
        packed = (weight_map or {}).get(name.removesuffix(".weight") + ".weight_packed") is not None
        allowed = {declared, torch.float32} | ({torch.bfloat16} if packed else set())
        if declared is not None and t.is_floating_point() and t.dtype not in allowed:
            raise CheckpointError(f"{where} has dtype {dtype_name(t.dtype)}, config.json says "
                                  f"{dtype_name(declared)}")


def _keep_fp32(name: str) -> bool:
    from k3rl.model.modeling import K3PreTrainedModel

    return bool(set(name.split(".")) & set(K3PreTrainedModel._keep_in_fp32_modules_strict))


def _meta_model(directory: Path) -> tuple[Any, Mapping[str, Any]]:
    """(the K3ForCausalLM of the directory's config.json on the meta device, the raw config)."""
    from k3rl.model.modeling import K3ForCausalLM

    raw = raw_config(directory)
    config = config_from_dict(raw, images_file=(directory / PATCH_FILE).is_file(), source=directory / CONFIG_FILE)
    if raw.get("model_type") == OLD_MODEL_TYPE:
        warn_old(directory)
    with torch.device("meta"):
        return K3ForCausalLM(config), raw


def _checked(directory: Path, model: Any, raw: Mapping[str, Any], tensors: dict[str, torch.Tensor]
             ) -> tuple[dict[str, torch.Tensor], Optional[dict[str, str]]]:
    """(the tensors of `model` found on disk, under released names, the index's map): what k3rl does not build
    dropped, the index's shard set, every tensor's name, shape and dtype checked against the model."""
    internal = model.state_dict()
    on_disk = "kimi_linear" if raw.get("model_type") == OLD_MODEL_TYPE else raw.get("model_type")
    wanted = {**to_released_names(internal, on_disk), **native_weights(internal)}
    weight_map = read_index(directory)
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
                  declared_dtype(raw))
    return tensors, weight_map


def check_model_dir(directory: str | Path, allow_nonfinite: bool = False, hint: str = integrity.OVERRIDE) -> None:
    """Everything `load_model` checks (a non-K3 directory: manifest, shard set, finite values), reading one tensor
    at a time: for a driver before it hands the directory to workers or writes anything. Named errors:
    `CorruptCheckpointError`, `CheckpointError` / ValueError / FileNotFoundError (the file or tensor),
    `NonFiniteWeightsError` (`hint`: what the user can do about them, `integrity.TRAINING` for training)."""
    directory = Path(directory)
    integrity.verify_model_dir(directory)
    meta, bad = scan_weight_files(directory)
    if is_k3_dir(directory):
        with warnings.catch_warnings():
            # the load that follows says it once
            warnings.simplefilter("ignore")
            model, raw = _meta_model(directory)
            _checked(directory, model, raw, meta)
    else:
        integrity.check_shard_set(directory, read_index(directory), side_files=(PATCH_FILE,))
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
        integrity.refuse_nonfinite(overflow, f"{directory} cast to {dtype_name(dtype)} (finite values beyond its "
                                   f"range)")
    model.load_state_dict(state, assign=True, strict=True)
    return model.to(device).eval()


__all__ = ["check_model_dir", "load_model", "read_released", "read_state_dict"]
