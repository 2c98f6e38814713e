"""Weights of a checkpoint directory on disk: sharded safetensors with an index, optionally MXFP4.

What `write_weights` leaves, in the layout vLLM and transformers read (see the layout contract of
issue 18 and docs/model_spec.md §4.7):

- `model-0000k-of-0000n.safetensors` shards (greedy in the given order, each at most `max_shard_bytes`
  unless one tensor alone is larger), every shard with the `{"format": "pt"}` metadata transformers
  insists on;
- `model.safetensors.index.json` — `metadata.total_size` (bytes of all tensors) and `weight_map`
  (tensor → shard) — ALWAYS, even for one shard: vLLM and transformers then read only the listed files,
  so a side file such as k3rl's `k3rl_patch_embed.safetensors` (`write_extra`) stays invisible to them;
- the tensors that the `quantize` predicate selects as `<module>.weight_packed` + `<module>.weight_scale`
  (model/formats/mxfp4.py), and the returned `quantization_config` for config.json; lossy.

`read_weights` reads any such directory (and directories written by other tools): through the index
when there is one, otherwise every `*.safetensors` but the side file; MXFP4 tensors are dequantized
back to `<module>.weight` when config.json (top level, or `text_config`) declares compressed-tensors
`mxfp4-pack-quantized`. Every failure names the file or tensor: a malformed index (`read_index`), a file it
names outside the directory (model/formats/trust.py), a shard the index lists but the directory lacks, a tensor the
index maps to a shard that lacks it, a truncated or corrupt file, packed weights
without their scales, any other quantization method or format.

`scan_weight_files` reads every tensor once, one at a time, for a driver's check before any load (shapes, dtypes
and the count of non-finite values, model/formats/integrity.py), without holding the model.

Writing deletes shards of an earlier write (`model-*-of-*.safetensors` not written now) and a
`model.safetensors`: transformers prefers that single file to an index, so a stale one would be loaded
instead of the new weights.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from k3rl.model.formats import mxfp4
from k3rl.model.formats.integrity import NonFiniteWeightsError, count_nonfinite
from k3rl.model.formats.trust import inside, read_json

INDEX_NAME = "model.safetensors.index.json"
PATCH_EMBED_FILE = "k3rl_patch_embed.safetensors"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_PACKED, _SCALE, _WEIGHT = ".weight_packed", ".weight_scale", ".weight"

PathLike = Union[str, os.PathLike]


def write_weights(
    directory: PathLike,
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int = 5 * 2**30,
    quantize: Union[None, str, Callable[[str], bool]] = None,
    allow_nonfinite: bool = False,
) -> Optional[dict]:
    """Write `tensors` as safetensors shards plus `model.safetensors.index.json` into `directory`.

    `quantize(name) -> bool` picks the `….weight` tensors to store as MXFP4 (`quantize="mxfp4"`: every
    routed-expert weight); they must be routed-expert weights (`mxfp4.EXPERT_TARGET`: vLLM's K3 loader reads
    no other module as MXFP4) with an input dim divisible by 32. Returns the `quantization_config` to put
    into config.json, or None when nothing was quantized.

    What MXFP4 cannot keep (model/formats/mxfp4.py `unrepresentable`): a tensor to quantize holding NaN/±inf is a
    `NonFiniteWeightsError` naming it and the count (each would turn its group of 32 into NaN; with
    `allow_nonfinite` a warning, and the groups are stored as NaN); finite values that saturate (|x| ≥ 2.98e38,
    decoded as ±inf) are a warning naming the tensor and the count. Tensors stored as they are are not checked
    here (their loaders check them)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"write_weights: max_shard_bytes must be positive, got {max_shard_bytes}")
    if isinstance(quantize, str):
        if quantize != "mxfp4":
            raise ValueError(f"write_weights: quantize must be 'mxfp4', a predicate on names, or None; "
                             f"got {quantize!r}")
        quantize = _is_routed_expert
    out: dict[str, torch.Tensor] = {}
    quantized = False
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"write_weights: {name} is a {type(t).__name__}, not a tensor")
        t = t.detach().to("cpu").contiguous()
        if quantize is None or not quantize(name):
            out[name] = t
            continue
        module = name[: -len(_WEIGHT)] if name.endswith(_WEIGHT) else None
        if module is None or not mxfp4.matches_target(module):
            raise ValueError(
                f"write_weights: {name} selected for MXFP4, but only routed-expert weights "
                f"(….block_sparse_moe.experts.{{e}}.w{{1,2,3}}.weight) can be stored so (vLLM's K3 loader)"
            )
        if t.ndim != 2 or t.shape[1] % mxfp4.GROUP_SIZE != 0:
            raise ValueError(
                f"write_weights: {name} {tuple(t.shape)} cannot be MXFP4: needs [out, in] with in divisible by "
                f"{mxfp4.GROUP_SIZE}"
            )
        nonfinite, saturated = mxfp4.unrepresentable(t)
        if nonfinite:
            what = (f"write_weights: {name} holds {nonfinite} NaN/±inf value(s); MXFP4 stores the whole group of "
                    f"{mxfp4.GROUP_SIZE} of each as NaN")
            if not allow_nonfinite:
                raise NonFiniteWeightsError(what + " (refused)")
            warnings.warn(what, UserWarning, stacklevel=2)
        if saturated:
            warnings.warn(f"write_weights: {name}: {saturated} finite value(s) with |x| ≥ {mxfp4.SATURATION:.3g} "
                          f"saturate in MXFP4 and decode to ±inf", UserWarning, stacklevel=2)
        out[module + _PACKED], out[module + _SCALE] = mxfp4.quantize(t)
        quantized = True

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, t in out.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = t
        shard_bytes += nbytes

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    files = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for stale in directory.iterdir():
        if (_SHARD.match(stale.name) and stale.name not in files) or stale.name == "model.safetensors":
            stale.unlink()
    weight_map: dict[str, str] = {}
    for fname, shard in zip(files, shards):
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in out.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return mxfp4.quantization_config() if quantized else None


def _is_routed_expert(name: str) -> bool:
    return name.endswith(_WEIGHT) and mxfp4.matches_target(name[: -len(_WEIGHT)])


def read_weights(directory: PathLike, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """All weights of a checkpoint directory by name; MXFP4 pairs come back dequantized as `….weight`.

    `dtype` casts every floating-point tensor (dequantized ones included); None keeps the stored dtypes,
    and dequantized weights come as bfloat16, which holds every MXFP4 value exactly."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"read_weights: {directory} is not a directory")
    quant = _quantization_config(directory)
    index_path = directory / INDEX_NAME
    weight_map = read_index(directory)
    if weight_map is not None:
        by_file: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(fname, []).append(name)
        for fname in by_file:
            if not (directory / fname).is_file():
                raise FileNotFoundError(f"read_weights: {fname} is listed in {index_path} but missing from {directory}")
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors") if p.name != PATCH_EMBED_FILE)
        if not files:
            raise FileNotFoundError(f"read_weights: no {INDEX_NAME} and no *.safetensors in {directory}")
        by_file = {inside(directory, fname, f"{directory}: weight file").name: None for fname in files}

    raw: dict[str, torch.Tensor] = {}
    for fname, names in by_file.items():
        for name, t in _read_file(directory / fname, names).items():
            if name in raw:
                raise ValueError(f"read_weights: tensor {name} is stored twice (second copy in {fname})")
            raw[name] = t

    packed = {n[: -len(_PACKED)] for n in raw if n.endswith(_PACKED)}
    if packed and quant is None:
        name = min(packed) + _PACKED
        raise ValueError(f"read_weights: {name} is quantized but {directory / 'config.json'} "
                         f"has no quantization_config")
    weights: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        suffix = _SCALE if name.endswith(_SCALE) else _PACKED if name.endswith(_PACKED) else None
        module = name[: -len(suffix)] if suffix else None
        if module is None or module not in packed:
            if name.endswith(_SCALE) and quant is not None:
                raise ValueError(f"read_weights: {name} has no {module + _PACKED}")
            weights[name] = t
        elif name.endswith(_PACKED):
            if module + _SCALE not in raw:
                raise ValueError(f"read_weights: {name} has no {module + _SCALE}")
            if module + _WEIGHT in raw:
                raise ValueError(f"read_weights: {module} is stored twice, as {_WEIGHT} and as {_PACKED}")
            try:
                weights[module + _WEIGHT] = mxfp4.dequantize(t, raw[module + _SCALE])
            except (TypeError, ValueError) as e:
                raise ValueError(f"read_weights: {module}: {e}") from e
    if dtype is not None:
        weights = {n: t.to(dtype) if t.is_floating_point() else t for n, t in weights.items()}
    return weights


def read_index(directory: PathLike) -> Optional[dict[str, str]]:
    """The `weight_map` (tensor → file) of the directory's `model.safetensors.index.json`, None without one.

    The index is untrusted: anything but a JSON object whose `weight_map` maps tensor names to file names is a
    ValueError naming the index, and a file that resolves outside the directory (absolute, `..`, a symlink out)
    is a `PathEscapeError` naming the index, the tensor and the path (model/formats/trust.py)."""
    directory = Path(directory)
    path = directory / INDEX_NAME
    if not path.exists():
        return None
    index = read_json(path, "not a safetensors index")
    if not isinstance(index, dict):
        raise ValueError(f"{path}: not a safetensors index (a JSON {type(index).__name__}, not an object)")
    if "weight_map" not in index:
        raise ValueError(f"{path}: not a safetensors index (no weight_map)")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path}: weight_map must be an object of tensor name → file name, "
                         f"got a {type(weight_map).__name__}")
    for name, fname in weight_map.items():
        if not isinstance(fname, str):
            raise ValueError(f"{path}: weight_map[{name!r}] must be a file name, got {fname!r}")
        inside(directory, fname, f"{path}: tensor {name}")
    return dict(weight_map)


def write_extra(directory: PathLike, filename: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write a side file (e.g. `PATCH_EMBED_FILE`) that the index does not list, so other tools skip it."""
    if filename == "model.safetensors" or _SHARD.match(filename):
        raise ValueError(f"write_extra: {filename} is a weight-shard name; side files need another name")
    Path(directory).mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(Path(directory) / filename),
              metadata={"format": "pt"})


def read_extra(directory: PathLike, filename: str) -> dict[str, torch.Tensor]:
    """The tensors of side file `filename` in `directory`; an empty dict when the file does not exist. A side
    file that resolves outside the directory (a symlink out) is a `PathEscapeError`."""
    path = inside(directory, filename, f"{directory}: side file")
    return _read_file(path, None) if path.exists() else {}


def _read_file(path: Path, names: Optional[list[str]]) -> dict[str, torch.Tensor]:
    """`names` (None: all) from one safetensors file, read lazily; errors name the file and tensor."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = set(f.keys())
            for name in names or []:
                if name not in keys:
                    raise ValueError(f"read_weights: tensor {name} is mapped to {path.name} but that file lacks it")
            return {name: f.get_tensor(name) for name in (names if names is not None else sorted(keys))}
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e


def _quantization_config(directory: Path) -> Optional[dict]:
    """config.json's quantization_config (top level, else text_config's), checked to be MXFP4; None if absent."""
    path = directory / "config.json"
    if not path.exists():
        return None
    config = read_json(path)
    text = config.get("text_config") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(text or {}, dict):
        raise ValueError(f"{path}: expected a JSON object (with an object text_config, if any)")
    quant = config.get("quantization_config") or (text or {}).get("quantization_config")
    if quant is None:
        return None
    try:
        mxfp4.check_quantization_config(quant)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return quant


def scan_weight_files(directory: str | Path) -> tuple[dict[str, torch.Tensor], list[tuple[str, int]]]:
    """(every tensor of the directory's weight files as a meta tensor — shape and dtype, an MXFP4 pair as the
    bfloat16 `….weight` it decodes to —, (name in file, count) of each tensor holding NaN/±inf), reading one tensor
    at a time: a driver checks a directory this way before handing it to workers, without holding the model.

    The files are the index's shards (inside the directory, model/formats/trust.py) plus k3rl's patch file, or every
    `*.safetensors` without an index; an unreadable or truncated file, or a tensor the index maps to a file that
    lacks it, is a ValueError naming the file. An MXFP4 scale byte 255 (E8M0 NaN) counts its 32 values."""
    directory = Path(directory)
    weight_map = read_index(directory)
    if weight_map is None:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    else:
        files = sorted(set(weight_map.values())) + [PATCH_EMBED_FILE] * (directory / PATCH_EMBED_FILE).is_file()
    meta: dict[str, torch.Tensor] = {}
    bad: list[tuple[str, int]] = []
    if not files:
        _scan_pickled_weights(directory, meta, bad)
    for fname in files:
        path = inside(directory, fname, f"{directory}: weight file")
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: {fname} is listed in {INDEX_NAME} but missing")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                keys = set(f.keys())
                lacking = sorted(n for n, file in (weight_map or {}).items() if file == fname and n not in keys)
                if lacking:
                    raise ValueError(f"{directory}: tensor {lacking[0]} is mapped to {fname} by {INDEX_NAME} but "
                                     f"that file lacks it")
                for name in sorted(keys):
                    t = f.get_tensor(name)
                    n = count_nonfinite(t)
                    if name.endswith(".weight_scale") and t.dtype == torch.uint8:
                        n = 32 * int((t == 255).sum())
                    if n:
                        bad.append((f"{name} in {fname}", n))
                    meta[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
                    del t
        except SafetensorError as e:
            raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e
    for name in [n for n in meta if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        packed = meta.pop(name)
        meta.pop(module + ".weight_scale", None)
        meta[module + ".weight"] = torch.empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=torch.bfloat16,
                                               device="meta")
    return meta, bad


def _scan_pickled_weights(directory: Path, meta: dict[str, torch.Tensor], bad: list[tuple[str, int]]) -> None:
    """`scan_weight_files` for an HF directory with PyTorch pickles only (`pytorch_model*.bin`, older
    checkpoints): read as transformers reads them, tensors only (`weights_only`: no pickled code runs),
    memory-mapped where the file allows."""
    for path in sorted(directory.glob("pytorch_model*.bin")):
        inside(directory, path.name, f"{directory}: weight file")
        try:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:
                # the legacy (pre-zip) format cannot be memory-mapped
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # any unreadable pickle: name the file
            raise ValueError(f"{path}: not a readable PyTorch weight file ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise ValueError(f"{path}: not a state dict of tensors")
        for name, t in sorted(state.items()):
            if n := count_nonfinite(t):
                bad.append((f"{name} in {path.name}", n))
            meta[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        del state
