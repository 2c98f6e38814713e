"""Small K3 configs and models shared by the tests of model/ (float64 by default, seeded)."""

from __future__ import annotations

import torch

from k3rl.model.config import K3Config


def make_config(num_hidden_layers: int = 4, kda_layers=(1, 2, 3), **kw) -> K3Config:
    """A few-thousand-parameter K3: d=32, KDA 2×8 (conv 4), MLA 2 heads, 4 experts top-2 + 1 shared."""
    lac = dict(kda_layers=list(kda_layers), full_attn_layers=[], num_heads=2, head_dim=8,
               short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True)
    lac.update(kw.pop("linear_attn_config", {}))
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=num_hidden_layers,
                num_attention_heads=2, attn_res_block_size=2, q_lora_rank=16, kv_lora_rank=12,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_token=2,
                num_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1,
                max_position_embeddings=4096, linear_attn_config=lac)
    base.update(kw)
    return K3Config(**base)


def make_model(config=None, dtype=torch.float64, seed: int = 0, attn_res_random: bool = True, **kw):
    """A K3ForCausalLM in eval mode; AttnRes queries randomised (they start at zero) so mixes are non-uniform."""
    from k3rl.model.modeling import AttnResProj, K3ForCausalLM

    torch.manual_seed(seed)
    model = K3ForCausalLM(config or make_config(**kw)).to(dtype).eval()
    if attn_res_random:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, AttnResProj):
                    m.weight.normal_(0.0, 0.5)
    return model
