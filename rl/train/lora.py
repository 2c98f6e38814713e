"""LoRA through PEFT (`learner.lora`): low-rank adapters on a policy's linear layers and, for K3, on its stacked
routed experts; only the adapters train.

`apply_lora(policy, settings)` wraps the policy's model with PEFT's `get_peft_model` in place: the model object the
learner already holds now runs base + adapters, every base parameter is frozen (the routers, norms, embeddings
and head included) and only `lora_A`/`lora_B` tensors have gradients — so the optimizer holds adapter states
only. Targets (`learner.lora.targets`, null: the defaults below) are PEFT's `target_modules` (leaf names of
`nn.Linear` modules) and, for K3's routed experts, `target_parameters` (`w1`, `w2`, `w3`: the [experts, out, in]
tensors, one rank-r adapter per expert, PEFT's `ParamWrapper`).

- K3 default: the KDA projections (`q_proj`, `k_proj`, `v_proj`, `o_proj`, gates `f_a_proj`/`f_b_proj`/`g_proj`,
  `b_proj`), MLA's (`q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`), the dense and shared
  experts' MLPs (`gate_proj`, `up_proj`, `down_proj`) and the routed experts; not the routers (`gate`), the
  AttnRes queries nor the LM head.
- Other (HF) models: PEFT's `all-linear` (every linear layer but the output head).

`merged_state_dict(model)` is the state dict under the base model's own names with every adapter added to its
weight (W + ΔW, PEFT's `get_delta_weight`): what the rollout engines load and what a checkpoint saves as the
model, so every tool reads a LoRA checkpoint as a plain one. `adapter_state_dict` / `save_adapter` /
`load_adapter` are the adapters alone in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`,
`PeftModel.from_pretrained` reads it for HF models).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ADAPTER_DIR = "adapter"
"""A LoRA learner's checkpoint keeps its adapters here (PEFT's format) beside the merged model."""
BUFFERS_FILE = "k3rl_buffers.safetensors"
"""Beside the adapters: the model's buffers (K3's router balancing biases, which the learner moves outside the
optimizer), so base + adapter directory is the whole trained state (`merge_saved_adapter`)."""

K3_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "f_a_proj", "f_b_proj", "g_proj", "b_proj",
                     "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj")
K3_TARGET_PARAMETERS = ("w1", "w2", "w3")
"""The stacked routed experts (model/moe.py `Experts`)."""


def lora_config(policy: Any, settings: Any):
    """PEFT's `LoraConfig` of `learner.lora` settings (rank, alpha, dropout, targets) for `policy`."""
    from peft import LoraConfig

    targets = list(settings.targets) if settings.targets is not None else None
    if policy.is_k3:
        if targets is None:
            modules, parameters = list(K3_TARGET_MODULES), list(K3_TARGET_PARAMETERS)
        else:
            modules = [t for t in targets if t not in K3_TARGET_PARAMETERS]
            parameters = [t for t in targets if t in K3_TARGET_PARAMETERS]
        # no task type: PEFT's causal-LM wrapper needs transformers' generation API, which K3 does not have (the
        # learner runs the wrapped model itself, never the wrapper)
        return LoraConfig(r=int(settings.rank), lora_alpha=float(settings.alpha), lora_dropout=float(settings.dropout),
                          target_modules=modules or None, target_parameters=parameters or None, bias="none")
    return LoraConfig(r=int(settings.rank), lora_alpha=float(settings.alpha), lora_dropout=float(settings.dropout),
                      target_modules=targets if targets is not None else "all-linear", bias="none",
                      task_type="CAUSAL_LM")


def apply_lora(policy: Any, settings: Any):
    """Wrap `policy.model` with adapters in place (module docstring); returns the `PeftModel`. A target that
    matches nothing is PEFT's ValueError, named as `learner.lora.targets`."""
    from peft import get_peft_model

    model = policy.model
    try:
        peft_model = get_peft_model(model, lora_config(policy, settings))
    except ValueError as e:
        raise ValueError(f"learner.lora.targets: {e}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return peft_model


def adapted_tensors(model: torch.nn.Module):
    """(base tensor name, its LoRA layer) of every adapted tensor, under the base model's own names."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        owner = name.replace(".base_layer", "")
        if isinstance(module, ParamWrapper):
            yield f"{owner}.{module.parameter_name}", module
        else:
            yield f"{owner}.weight", module


def base_name(name: str) -> str:
    """A PEFT-wrapped model's state-dict key under the base model's name (`.base_layer` hops and the
    parametrization's `original` dropped)."""
    return name.replace(".base_layer", "")


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged into its weight (module docstring), detached."""
    deltas = {}
    with torch.no_grad():
        for name, layer in adapted_tensors(model):
            deltas[name] = sum(layer.get_delta_weight(a) for a in layer.active_adapters)
        out = {}
        for key, t in model.state_dict().items():
            if ".lora_" in key:
                continue
            name = base_name(key)
            out[name] = t + deltas[name].to(t.dtype) if name in deltas else t.detach()
    missing = set(deltas) - set(out)
    if missing:
        raise RuntimeError(f"LoRA layers whose base tensor is not in the state dict: {sorted(missing)[:3]}")
    return out


def push_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a LoRA learner pushes to native engines (`learner.lora.push: adapters`): per adapted tensor `name` its
    factors `name@lora_P` ([rows, r], or [experts, rows, r]; the scale folded in) and `name@lora_Q` ([r, cols] or
    [experts, r, cols]) with ΔW = P @ Q, plus the model's buffers (the routers' biases) under their own names —
    r·(rows + cols) values per adapted matrix instead of rows·cols. rollout/weight_transfer.py `merge_adapters`
    adds them to the engine's own copy of the base (PEFT's `get_delta_factors`; tested equal to `merged_state_dict`)."""
    from peft.tuners.lora import ParamWrapper

    out = []
    with torch.no_grad():
        for name, layer in adapted_tensors(model):
            (adapter,) = layer.active_adapters
            if isinstance(layer, ParamWrapper) and layer.num_experts > 1:
                lhs, rhs, scale = layer.get_delta_factors(adapter)
            else:
                lhs, rhs = layer.lora_B[adapter].weight, layer.lora_A[adapter].weight
                scale = layer.scaling[adapter]
            out += [(f"{name}@lora_P", (lhs * scale).detach()), (f"{name}@lora_Q", rhs.detach())]
    out += list(_buffers(model).items())
    return out


def adapter_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapters alone, under PEFT's saved names."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}


def save_adapter(peft_model: Any, directory: Path, base_model_path: str) -> None:
    """PEFT's format in `directory`: adapter_config.json (its `base_model_name_or_path`: the base directory) and
    adapter_model.safetensors."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = str(base_model_path)
    config.save_pretrained(str(directory))
    save_file(adapter_state_dict(peft_model), str(directory / "adapter_model.safetensors"))
    save_file(_buffers(peft_model), str(directory / BUFFERS_FILE))


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of a (wrapped) model under the base model's names."""
    params = {n for n, _ in model.named_parameters()}
    return {base_name(k.removeprefix("base_model.model.")): t.detach().cpu().contiguous()
            for k, t in model.state_dict().items() if k not in params and ".lora_" not in k}


def load_adapter(peft_model: Any, directory: Path, base_model_path: str | None) -> None:
    """Put the adapters `save_adapter` wrote into `peft_model`; refuses adapters of another base (unless
    `base_model_path` is None) or another shape."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    config = json.loads((directory / "adapter_config.json").read_text())
    if base_model_path is not None and str(config.get("base_model_name_or_path")) != str(base_model_path):
        raise ValueError(f"{directory}: adapters of base {config.get('base_model_name_or_path')!r}, this learner's "
                         f"base is {str(base_model_path)!r}")
    saved = load_file(str(directory / "adapter_model.safetensors"))
    mine = adapter_state_dict(peft_model)
    bad = sorted(k for k in set(saved) | set(mine) if k not in saved or k not in mine
                 or saved[k].shape != mine[k].shape)
    if bad:
        raise ValueError(f"{directory}: adapters do not match this learner's (learner.lora rank/targets): {bad[:3]}")
    result = set_peft_model_state_dict(peft_model, saved)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{directory}: unexpected adapter tensors {result.unexpected_keys[:3]}")
    if (directory / BUFFERS_FILE).is_file():
        buffers = load_file(str(directory / BUFFERS_FILE))
        mine = {base_name(k.removeprefix("base_model.model.")): t for k, t in peft_model.state_dict().items()}
        unknown = sorted(set(buffers) - set(mine))
        if unknown:
            raise ValueError(f"{directory / BUFFERS_FILE}: tensors this model does not have: {unknown[:3]}")
        with torch.no_grad():
            for name, t in buffers.items():
                mine[name].copy_(t)


def merge_saved_adapter(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The state dict of `model` (a plain base model, wrapped in place here) with the adapters of `directory`
    (PEFT's format: its config and weights) merged in: `k3rl export --merge-lora`."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig.from_pretrained(str(directory)))
    load_adapter(peft_model, Path(directory), None)
    return merged_state_dict(model)


__all__ = ["ADAPTER_DIR", "adapted_tensors", "adapter_state_dict", "apply_lora", "base_name", "load_adapter",
           "lora_config", "merge_saved_adapter", "merged_state_dict", "push_tensors", "save_adapter"]
