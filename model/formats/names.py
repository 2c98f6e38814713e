"""Checkpoint names of the routed experts: stacked in the model, per expert on disk.

The model holds each MoE layer's routed experts as three stacked parameters (model/moe.py `Experts`:
`….experts.w1` [E, I, d] and so on); the released K3 checkpoints, vLLM's `kimi_k3` loader and every
Hugging Face tool name them one tensor per expert, `….experts.{e}.w{1,2,3}.weight`
(docs/model_spec.md §4.6). The conversion is done at the edges:

- `save_pretrained` / `from_pretrained`: transformers' own weight-conversion mechanism (a
  `WeightConverter` merging the per-expert tensors along a new dim 0, reverted on save), registered
  for K3's model type by `register_expert_conversion` when model/modeling.py is imported — so
  checkpoints written before the experts were stacked load unchanged, and new ones are per expert;
- raw state dicts (the learner reading its own safetensors, weights sent to an engine that expects
  Hugging Face names): `stack_experts` and `split_experts`.

The released layouts' names on top of that (model/formats/layouts.py): `to_released_names` (the `language_model.`
prefix of kimi_k3; k3rl's patch weights, `native_weights`, left to their own file) and `from_released_names`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from k3rl.model.formats.layouts import LAYOUTS, NATIVE_PREFIX, TEXT_PREFIX, CheckpointError

PROJECTIONS = ("w1", "w2", "w3")
_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")
_STACKED = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<w>w[123])$")


def split_experts(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Stacked expert tensors `….experts.w1` [E, …] → `….experts.{e}.w1.weight` [… ] (views); other
    names pass unchanged. Order: each stacked tensor's experts in place of it."""
    out = []
    for name, t in named:
        m = _STACKED.match(name)
        if m is None:
            out.append((name, t))
        else:
            out += [(f"{m['prefix']}.{e}.{m['w']}.weight", t[e]) for e in range(t.shape[0])]
    return out


def stack_experts(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors `….experts.{e}.w1.weight` → stacked `….experts.w1` [E, …]; other names pass
    unchanged. A layer whose experts are not numbered 0…E−1 without gaps is refused, naming it."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in weights.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(f"{m['prefix']}.{m['w']}", {})[int(m["e"])] = t
    for name, experts in groups.items():
        missing = sorted(set(range(max(experts) + 1)) - set(experts))
        if missing:
            raise ValueError(f"{name}: experts {missing[:5]} missing (have {len(experts)} of {max(experts) + 1})")
        shapes = {tuple(t.shape) for t in experts.values()}
        if len(shapes) > 1:
            raise ValueError(f"{name}: experts of different shapes {sorted(shapes)}")
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def register_expert_conversion(model_type: str) -> None:
    """Teach transformers' loader and `save_pretrained` the per-expert names of `model_type` (idempotent)."""
    from transformers import conversion_mapping as cm
    from transformers.core_model_loading import MergeModulelist, WeightConverter

    if model_type in cm.USER_REGISTERED_MAPPINGS:
        return
    cm.register_checkpoint_conversion_mapping(model_type, [
        WeightConverter(source_patterns=[f".experts.*.{w}.weight"], target_patterns=f".experts.{w}",
                        operations=[MergeModulelist(dim=0)])
        for w in PROJECTIONS
    ], overwrite=True)


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


__all__ = ["PROJECTIONS", "from_released_names", "native_weights", "register_expert_conversion", "split_experts",
           "stack_experts", "to_released_names"]
