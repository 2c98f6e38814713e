"""Parameter counts of a K3 config and the bytes of its weights, gradients and optimizer states on one rank.

Counted on the meta device (`model.params.count_parameters`, one layer of each kind), as our learner keeps them
(rl/train/learner.py, rl/train/optim.py): the parameters in the learner's dtype (the fp32-kept KDA gate/conv
parameters in fp32), no fp32 master copy (the optimizers update the parameters in that dtype), gradients in the
parameters' dtype, AdamW's two moments (+ a fp32 step scalar per tensor) or, under `optimizer: muon`, one momentum
for the hidden matrices (2-D and stacked experts) and AdamW for the rest (embeddings, LM head, norms, vectors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ParamSummary:
    """Parameter counts of a K3 config (meta device) and how the learner's optimizers hold them."""

    total: int
    active: int
    embedding: int
    """Input-side parameters a text token's forward does not multiply (the embedding table, the image patch
    projection): left out of the FLOPs."""
    counts: dict[str, Any]
    """`model.params.count_parameters`' result."""
    adamw: int = 0
    """Parameters under AdamW (two moments each)."""
    muon: int = 0
    """Parameters under Muon (one momentum each; `optimizer: muon` only)."""
    fp32_kept: int = 0
    """Parameters kept in fp32 whatever the model dtype (KDA's A_log, dt_bias, conv weights; all under AdamW)."""
    adamw_tensors: int = 0
    """Parameter tensors under AdamW (each has a fp32 `step` scalar)."""
    untrained: int = 0
    """Parameters text training never reaches, so without gradient or optimizer state (the image patch projection;
    layer 0's mixer AttnRes query and norm, whose mix has one source). Not in `adamw` / `muon`."""

    def memory(self, dtype_bytes: int) -> tuple[int, int, int]:
        """(weights, gradients, optimizer states) in bytes for parameters of `dtype_bytes` (the learner's dtype):
        gradients and moments in each parameter's own dtype (torch.optim's `zeros_like(p)`), no master copy."""
        kept_bytes = max(4, dtype_bytes)
        weights = (self.total - self.fp32_kept) * dtype_bytes + self.fp32_kept * kept_bytes
        grads = (self.adamw + self.muon - self.fp32_kept) * dtype_bytes + self.fp32_kept * kept_bytes
        states = (2 * (self.adamw - self.fp32_kept) * dtype_bytes + 2 * self.fp32_kept * kept_bytes
                  + self.muon * dtype_bytes + 4 * self.adamw_tensors)
        return weights, grads, states



def dtype_bytes(dtype: Any) -> int:
    """Bytes per value of a learner dtype name (`float32`, `bfloat16`, …)."""
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}[str(dtype).replace("torch.", "")]


def layer_kinds(config: Any) -> list[list[int]]:
    """The decoder layers grouped by kind (KDA or MLA mixer, MoE or dense FFN): one layer of each kind is built
    and counted for all of its kind."""
    from k3rl.model.moe import is_moe_layer

    kinds: dict[tuple[bool, bool], list[int]] = {}
    for i in range(config.num_hidden_layers):
        kinds.setdefault((config.is_kda_layer(i), is_moe_layer(config, i)), []).append(i)
    return list(kinds.values())


def parameter_summary(config: Any, optimizer: str = "adamw") -> ParamSummary:
    """Counts of `config` on the meta device: total/active (model/params.py) and the learner's optimizer groups
    (rl/train/optim.py `build_optimizers`: Muon for the 2-D and stacked hidden matrices, not the embedding or LM head;
    AdamW for the rest)."""
    import torch
    from torch import nn

    from k3rl.model.attn_res import RMSNorm
    from k3rl.model.modeling import AttnResProj, K3DecoderLayer, K3PreTrainedModel
    from k3rl.model.params import count_parameters
    from k3rl.model.vision import PatchEmbed

    counts = count_parameters(config)
    comps = counts["components"]
    summary = ParamSummary(total=counts["total"], active=counts["active"], counts=counts,
                           embedding=sum(comps.get(c, {}).get("active", 0) for c in ("embedding", "image_patch_embed")))
    keep_fp32 = tuple(K3PreTrainedModel._keep_in_fp32_modules_strict)

    def add(name: str, p: torch.Tensor, times: int = 1, head: bool = False, first: bool = False) -> None:
        if name.startswith("patch_embed.") or (first and name.startswith("self_attention_res_")):
            summary.untrained += p.numel()
            times -= 1
        hidden_matrix = p.ndim in (2, 3) and min(p.shape[-2:]) > 1 and not head
        if optimizer == "muon" and hidden_matrix:
            summary.muon += times * p.numel()
            return
        summary.adamw += times * p.numel()
        summary.adamw_tensors += times
        if any(k in name for k in keep_fp32):
            summary.fp32_kept += times * p.numel()

    with torch.device("meta"):
        for layers in layer_kinds(config):
            for name, p in K3DecoderLayer(config, layers[0]).named_parameters():
                add(name, p, len(layers), first=layers[0] == 0)
        d = config.hidden_size
        top = {"embed_tokens": nn.Embedding(config.vocab_size, d),
               "lm_head": nn.Linear(d, config.vocab_size, bias=False), "norm": RMSNorm(d)}
        if config.attn_res_block_size is not None:
            top.update(output_attn_res_norm=RMSNorm(d), output_attn_res_proj=AttnResProj(d))
        if config.media_placeholder_token_id is not None:
            top["patch_embed"] = PatchEmbed(config)
        for module_name, module in top.items():
            for name, p in module.named_parameters():
                add(f"{module_name}.{name}", p, head=module_name in ("embed_tokens", "lm_head"))
    if summary.adamw + summary.muon + summary.untrained != summary.total:  # model/params.py must see the same model
        raise RuntimeError(f"parameter_summary: {summary.adamw + summary.muon + summary.untrained} parameters in "
                           f"the optimizer groups, "
                           f"{summary.total} counted by model/params.py")
    return summary


def lora_parameters(config: Any, rank: int, targets: Any = None) -> dict[str, int]:
    """Adapter parameters of `learner.lora` at `rank` on a K3 config, by target name (meta device, one layer of
    each kind): r·(in + out) per adapted linear layer, r·E·(in + out) per stacked routed-expert tensor (PEFT's
    per-expert factors); `targets` as rl/train/lora.py (None: its K3 defaults)."""
    import torch
    from torch import nn

    from k3rl.model.modeling import K3DecoderLayer
    from k3rl.model.moe import Experts
    from k3rl.rl.train.lora import K3_TARGET_MODULES, K3_TARGET_PARAMETERS

    names = set(targets) if targets is not None else set(K3_TARGET_MODULES) | set(K3_TARGET_PARAMETERS)
    out: dict[str, int] = {}
    with torch.device("meta"):
        for layers in layer_kinds(config):
            for name, module in K3DecoderLayer(config, layers[0]).named_modules():
                leaf = name.rsplit(".", 1)[-1]
                if isinstance(module, nn.Linear) and leaf in names:
                    n = rank * (module.in_features + module.out_features) * len(layers)
                    out[leaf] = out.get(leaf, 0) + n
                elif isinstance(module, Experts):
                    for pname in sorted(names & set(K3_TARGET_PARAMETERS)):
                        e, o, i = getattr(module, pname).shape
                        out[pname] = out.get(pname, 0) + rank * e * (i + o) * len(layers)
    return out


__all__ = ["ParamSummary", "dtype_bytes", "lora_parameters", "parameter_summary"]
