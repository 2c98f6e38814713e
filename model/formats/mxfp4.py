"""MXFP4 (OCP Microscaling FP4) as compressed-tensors stores it: the codec of the released K3's routed experts.

The released Kimi-K3 ships its routed experts in compressed-tensors' `mxfp4-pack-quantized` format
(docs/model_spec.md §4.7). A weight W [out, in] is cut into groups of 32 consecutive input columns;
each group keeps one power-of-two scale and 32 E2M1 values:

- `weight_packed` [out, in/2] uint8: two E2M1 codes a byte, the EVEN column in the LOW nibble
  (`byte = code[2j] | code[2j+1] << 4`; compressed-tensors `pack_fp4_to_uint8`, vLLM `downcast_to_mxfp`);
- an E2M1 code is sign (bit 3) and a magnitude index (bits 0-2) into 0, 0.5, 1, 1.5, 2, 3, 4, 6;
- `weight_scale` [out, in/32] uint8, E8M0: the scale is 2^(s − 127); s = 255 is NaN (OCP MX v1.0
  §5.4), so a group whose scale byte is 255 decodes to NaN throughout.

Quantization follows the reference that vLLM and compressed-tensors share (vLLM `mxfp4_utils.
_compute_quant_and_scale`, compressed-tensors `generate_mx_scales` + `cast_to_fp4`):

- the group's amax is rounded to a power of two, upward when its significand is ≥ 1.75 (the "even"
  scale mode; the OCP spec's plain floor would send 1.75…2 × 2^k to 7…8 and saturate); the scale is
  that power over 4 (E2M1's largest power of two), clamped to 2^−127 … 2^127; an all-zero group takes 2^−127;
- each value divided by the scale is rounded to the nearest E2M1 value, ties to the even code
  (0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4), and saturates at ±6;
- the sign bit is copied from the input, so −0 and tiny negatives that round to zero keep code 8 (as
  vLLM's kernel does; compressed-tensors writes code 0 for an input −0 and code 8 for tiny negatives).

Error bound of a round trip: with scale 2^e every value decodes within 2^e of its input (half the widest
grid step, 2, or the saturation 6…7), and 2^e ≤ amax/4; when the amax was rounded up the values stay
below 4·2^e, the step is at most 2^e, and the error at most 2^(e−1) < amax/7. So each element is off by
at most a quarter of its group's largest magnitude, and decodes to the representable value nearest to it
unless it saturated.

Departures, where the format leaves a choice: a group holding NaN or ±Inf is stored with scale byte 255
(NaN; E2M1 has neither), which compressed-tensors does for Inf while vLLM's kernel saturates it; and
decoding to float32/bfloat16 overflows to ±Inf for scales near 2^127 (6 × 2^127 exceeds both; values that
large come only from inputs within a factor 2 of float32's maximum). Every decoded value has at most two
significant bits and lies in 2^−128 … 6 × 2^127, so bfloat16 holds it exactly (the default `dtype`).

What the format cannot keep (`unrepresentable`, which the write path checks first: model/formats/weight_files.py refuses
non-finite weights by name and warns about saturation):

- NaN and ±Inf: the codec above stores the whole group as NaN, so one NaN costs 32 values;
- a finite value saturates when |x| ≥ 1.75·2^127 (`SATURATION`, ≈ 2.98e38): its group's scale is then 2^126 or
  more and the value rounds to 4·2^126 = 2^128 or above, which neither float32 nor bfloat16 holds, so it decodes
  to ±Inf (3e38 → inf). Below that bound every value decodes finite (≤ 1.5·2^127). For float32 and bfloat16
  inputs the E8M0 scale itself never leaves its range (the largest needed is 2^126); float64 inputs of 2^130 and
  more also clamp at the largest scale 2^127 and at 6 — still ≥ SATURATION, so the same count covers them.
  The ordinary clamp of 6…7 × scale to 6 within a group is the format's rounding, not saturation.

The codec is plain torch (compressed-tensors needs ~20 s to import and compiles its rounding with
torch.compile); tests/model/test_mxfp4.py checks it against compressed-tensors' own compressor.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

GROUP_SIZE = 32
FORMAT = "mxfp4-pack-quantized"
QUANT_METHOD = "compressed-tensors"
# The routed experts of a K3/Kimi-Linear checkpoint, with or without `language_model.` in front: the
# only modules vLLM's K3 path reads as MXFP4 (it turns this config into its Mxfp4Config, which quantizes
# every RoutedExperts layer and no Linear; see `quantization_config`).
EXPERT_TARGET = r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"

# Magnitudes of the E2M1 codes 0…7; codes 8…15 are their negatives.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Every code's value, index = code: [16]
E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES))
_E8M0_BIAS = 127
_E8M0_NAN = 255
# log2 of E2M1's largest power of two (4): a scale of amax / 4 puts the group's amax at 4…7.
_E2M1_EMAX = 2
SATURATION = 1.75 * 2.0**127
"""|x| from which a finite value decodes to ±Inf in float32 and bfloat16 (module docstring)."""


def unrepresentable(w: torch.Tensor) -> tuple[int, int]:
    """(count of NaN/±Inf values, count of finite values that saturate, |x| ≥ `SATURATION`) of `w`."""
    with torch.no_grad():
        finite = torch.isfinite(w)
        nonfinite = int(w.numel() - finite.sum())
        saturated = int((finite & (w.abs() >= SATURATION)).sum())
    return nonfinite, saturated


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 inputs keep float64; anything else computes in float32 (bf16/fp16 are exact in it)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., in] (float, in a multiple of 32) → (packed [..., in/2] uint8, scale [..., in/32] uint8 E8M0).

    Groups run along the last dim; leading dims are kept (a stacked [E, out, in] gives [E, out, in/2])."""
    if not w.is_floating_point():
        raise TypeError(f"mxfp4.quantize: expected a floating-point tensor, got {w.dtype}")
    if w.ndim == 0 or w.shape[-1] % GROUP_SIZE != 0:
        raise ValueError(f"mxfp4.quantize: last dim must be a multiple of {GROUP_SIZE}, got shape {tuple(w.shape)}")
    lead, n = tuple(w.shape[:-1]), w.shape[-1]
    x = w.detach().to(_compute_dtype(w.dtype)).reshape(*lead, n // GROUP_SIZE, GROUP_SIZE)  # [..., G, 32]
    finite = torch.isfinite(x).all(dim=-1)  # [..., G]
    amax = torch.where(finite, x.abs().amax(dim=-1), 0.0)  # [..., G]
    # amax = m · 2^k with m in [0.5, 1); floor(log2 amax) = k − 1, plus one when the significand 2m ≥ 1.75.
    m, k = torch.frexp(amax)
    exp = k - 1 + (m >= 0.875).to(k.dtype) - _E2M1_EMAX
    exp = torch.where(amax == 0, -_E8M0_BIAS, exp).clamp(-_E8M0_BIAS, _E8M0_BIAS)  # [..., G]
    # Dividing by a power of two is exact; only results that end up rounding to zero can lose bits.
    q = torch.ldexp(x, -exp.unsqueeze(-1).to(x.dtype))  # [..., G, 32]
    code = _round_to_e2m1(q.abs()) | (torch.signbit(q).to(torch.uint8) << 3)
    code = torch.where(finite.unsqueeze(-1), code, 0)
    scale = torch.where(finite, exp + _E8M0_BIAS, _E8M0_NAN).to(torch.uint8)  # [..., G]
    code = code.reshape(*lead, n // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)  # [..., in/2]
    return packed.contiguous(), scale.contiguous()


def _round_to_e2m1(a: torch.Tensor) -> torch.Tensor:
    """|values| (finite, ≥ 0) → magnitude codes 0…7 (uint8), nearest with ties to the even code, ≥ 6 → 7."""
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=a.dtype, device=a.device)
    mids = (grid[1:] + grid[:-1]) / 2  # [7]: 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
    below = torch.bucketize(a, mids, right=False)  # midpoints strictly below a
    at_or_below = torch.bucketize(a, mids, right=True)
    # On a midpoint the two counts differ; the code below it is odd exactly when the even code is above.
    tie_up = (below != at_or_below) & (below % 2 == 1)
    return (below + tie_up.to(below.dtype)).to(torch.uint8)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(packed [..., in/2] uint8, scale [..., in/32] uint8 E8M0) → weights [..., in] in `dtype`."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"mxfp4.dequantize: packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    groups_match = packed.ndim > 0 and packed.shape[-1] * 2 == scale.shape[-1] * GROUP_SIZE
    if not groups_match or packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(
            f"mxfp4.dequantize: packed {tuple(packed.shape)} and scale {tuple(scale.shape)} do not match "
            f"(expected scale [..., packed.shape[-1] * 2 / {GROUP_SIZE}])"
        )
    lead, n = tuple(packed.shape[:-1]), packed.shape[-1] * 2
    cdt = _compute_dtype(dtype)
    code = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*lead, n // GROUP_SIZE, GROUP_SIZE)  # [..., G, 32]
    values = E2M1_VALUES.to(device=packed.device, dtype=cdt)[code.long()]  # [..., G, 32]
    exp = scale.to(torch.int32) - _E8M0_BIAS  # [..., G]
    out = torch.ldexp(values, exp.unsqueeze(-1).to(cdt))
    out = torch.where((scale == _E8M0_NAN).unsqueeze(-1), torch.nan, out)
    return out.reshape(*lead, n).to(dtype)


def quantization_config(targets: Iterable[str] = (EXPERT_TARGET,),
                        ignore: Iterable[str] = ("lm_head",)) -> dict[str, Any]:
    """The `quantization_config` entry of config.json for weights written by `quantize`.

    The compressed-tensors schema (what its `QuantizationConfig` serialises for the MXFP4A16 preset):
    one config group whose `targets` are module-name regexes ("re:…") or class names, weights FP4
    (num_bits 4, type float, symmetric, strategy group, group_size 32, E8M0 scales as uint8), no
    activation quantization, `format` mxfp4-pack-quantized, `quantization_status` compressed.

    How the readers decide what is quantized: compressed-tensors (and vLLM's CompressedTensorsConfig)
    quantize the modules that a group's `targets` match and the `ignore` list does not; vLLM's K3 path
    (`KimiK3ForConditionalGenerationConfig` in model_executor/models/config.py) rewrites this config to its
    own `Mxfp4Config`, which reads neither list: every routed-expert layer is MXFP4, every Linear is
    unquantized. So only the routed experts may be quantized, and the default targets say exactly that."""
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": list(targets),
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "symmetric": True,
                    "group_size": GROUP_SIZE,
                    "strategy": "group",
                    "dynamic": False,
                    "scale_dtype": "torch.uint8",
                    "observer": "memoryless_minmax",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


def check_quantization_config(config: Mapping[str, Any]) -> None:
    """Raise ValueError unless `config` describes compressed-tensors MXFP4 weights this module decodes:
    quant_method compressed-tensors, format mxfp4-pack-quantized (top level or per group), every group's
    weights FP4 in groups of 32. Any other method or format is named in the message."""
    method = config.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(f"quantization_config: quant_method {method!r} is not supported "
                         f"(only {QUANT_METHOD!r} with format {FORMAT!r})")
    groups = config.get("config_groups") or {}
    formats = {config.get("format")} | {g.get("format") for g in groups.values() if g.get("format")}
    if formats != {FORMAT}:
        raise ValueError(f"quantization_config: format {sorted(map(str, formats))} is not supported (only {FORMAT!r})")
    for name, group in groups.items():
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", GROUP_SIZE):
            raise ValueError(
                f"quantization_config.config_groups.{name}.weights: expected num_bits 4, type float, group_size "
                f"{GROUP_SIZE} for {FORMAT}, got {w.get('num_bits')}, {w.get('type')!r}, {w.get('group_size')}"
            )


def matches_target(name: str, targets: Iterable[str] = (EXPERT_TARGET,)) -> bool:
    """Whether module `name` (a weight name without `.weight`) matches a compressed-tensors `re:` target."""
    return any(t.startswith("re:") and re.match(t[3:], name) is not None for t in targets)
