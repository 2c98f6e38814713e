"""Parameter counts of a K3 config by component, without allocating the model (`k3rl params`).

One decoder layer of each distinct kind (KDA or MLA mixer × MoE or dense FFN) is built on the
meta device, counted, and multiplied by how many layers of that kind the config has; the
top-level modules are counted the same way. Active = everything except the routed experts, plus
top-k of E routed experts per MoE layer (embedding and lm_head are counted in full, as
DeepSeek-V3/Kimi-K2 report "activated parameters"). The routing bias is a buffer, not a
parameter, and is not counted.
"""

from __future__ import annotations

from collections import Counter


def _component(name: str) -> str:
    """Component of a parameter name of a decoder layer or of the top level."""
    for key, comp in (("block_sparse_moe.experts.", "moe.routed_experts"),
                      ("block_sparse_moe.shared_experts.", "moe.shared_experts"),
                      ("block_sparse_moe.gate.", "moe.router"),
                      ("block_sparse_moe.routed_expert_", "moe.latent_projections"),
                      ("mlp.", "dense_mlp"), ("embed_tokens.", "embedding"), ("lm_head.", "lm_head"),
                      ("patch_embed.", "image_patch_embed")):
        if key in name:
            return comp
    return "norms_and_attn_res"


def count_parameters(config) -> dict:
    """Total and active parameter counts of `config`, by component (meta device, nothing allocated)."""
    import torch
    from torch import nn

    from k3rl.model.attn_res import RMSNorm
    from k3rl.model.modeling import AttnResProj, K3DecoderLayer
    from k3rl.model.moe import is_moe_layer
    from k3rl.model.vision import PatchEmbed

    def kind(i: int) -> tuple[bool, bool]:
        return config.is_kda_layer(i), is_moe_layer(config, i)

    # (is_kda, is_moe) → number of layers of that kind
    kinds = Counter(kind(i) for i in range(config.num_hidden_layers))
    total, routed = Counter(), Counter()
    with torch.device("meta"):
        for (is_kda, is_moe), n_layers in kinds.items():
            layer = K3DecoderLayer(config, next(i for i in range(config.num_hidden_layers) if kind(i) == (is_kda, is_moe)))
            for name, p in layer.named_parameters():
                comp = ("attention.kda" if is_kda else "attention.mla") if name.startswith("self_attn.") else _component(name)
                total[comp] += n_layers * p.numel()
            if is_moe:
                routed["moe.routed_experts"] += n_layers * sum(p.numel() for p in layer.block_sparse_moe.experts.parameters())
        top = nn.ModuleDict({"embed_tokens": nn.Embedding(config.vocab_size, config.hidden_size),
                             "lm_head": nn.Linear(config.hidden_size, config.vocab_size, bias=False),
                             "norm": RMSNorm(config.hidden_size)})
        if config.attn_res_block_size is not None:
            top["output_attn_res_norm"] = RMSNorm(config.hidden_size)
            top["output_attn_res_proj"] = AttnResProj(config.hidden_size)
        if config.media_placeholder_token_id is not None:
            top["patch_embed"] = PatchEmbed(config)
        for name, p in top.named_parameters():
            total[_component(name)] += p.numel()
    active = Counter(total)
    if config.num_experts is not None:
        active["moe.routed_experts"] = routed["moe.routed_experts"] * config.num_experts_per_token // config.num_experts
    n_moe = sum(n for (_, moe), n in kinds.items() if moe)
    n_kda = sum(n for (kda, _), n in kinds.items() if kda)
    return {
        "total": sum(total.values()), "active": sum(active.values()),
        "num_experts": config.num_experts, "num_experts_per_token": config.num_experts_per_token,
        "layers": {"total": config.num_hidden_layers, "kda": n_kda, "mla": config.num_hidden_layers - n_kda,
                   "moe": n_moe, "dense": config.num_hidden_layers - n_moe},
        "components": {c: {"total": total[c], "active": active[c]} for c in sorted(total)},
    }
