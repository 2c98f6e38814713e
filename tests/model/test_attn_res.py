"""Block AttnRes (spec §7) against a naive per-layer implementation of its closed form with the bank
B, the partial sum P and the pending FFN output Δ kept explicitly (float64), for several depths and
block sizes, including depths that are not multiples of S; and the plain pre-norm residual.

One deliberate difference from the spec's text, documented in model/attn_res.py: at a
block-closing layer ℓ > 0 the mixer also mixes the just-closed block (P, now B[ℓ/S]), as every
released implementation does (`_apply_attn_res(prefix_sum, block_residual[:ceil(ℓ/S)])`).
"""

from __future__ import annotations

import math

import pytest
import torch
from k3_factory import make_model

from k3rl.model.attn_res import RMSNorm, attn_res_mix
from k3rl.model.cache import make_step


def mix(sources, proj, norm):
    """Mix(v_0..v_m; w, γ): logit_i = w·RMSNorm_γ(v_i), softmax over sources, raw values."""
    logits = torch.stack([(proj.weight[0] * norm.weight * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps)).sum(-1)
                          for v in sources])  # [N, B, T]
    alpha = logits.softmax(0)
    return sum(alpha[i, ..., None] * v for i, v in enumerate(sources))


def naive_h_final(model, ids, counts: list):
    cfg, layers = model.config, model.model.layers
    S, L = cfg.attn_res_block_size, cfg.num_hidden_layers
    step = make_step(tuple(ids.shape), "cpu", None, None, 10**6)
    e = model.model.embed_tokens(ids)
    bank, P, delta = {0: e}, None, None
    for l, layer in enumerate(layers):
        if l == 0:
            srcs = [e]
        else:
            P = P + delta
            if l % S == 0:
                bank[l // S] = P
                srcs = [bank[j] for j in range(l // S)] + [P]  # the spec's B[0..ℓ/S−1], plus P (see module docstring)
            else:
                srcs = [bank[j] for j in range(math.ceil(l / S))] + [P]
        x = layer.input_layernorm(mix(srcs, layer.self_attention_res_proj, layer.self_attention_res_norm))
        a = layer.self_attn(x, step)
        P = a if l % S == 0 else P + a
        srcs_ffn = [bank[j] for j in range(math.ceil(l / S) - 1 + (l % S == 0) + 1)] + [P]
        counts.append((len(srcs), len(srcs_ffn)))
        x = layer.post_attention_layernorm(mix(srcs_ffn, layer.mlp_res_proj, layer.mlp_res_norm))
        delta = layer.block_sparse_moe(x) if layer.is_moe else layer.mlp(x)
    P = P + delta
    NB = math.ceil(L / S)
    return mix([bank[j] for j in range(NB)] + [P], model.model.output_attn_res_proj, model.model.output_attn_res_norm)


@pytest.mark.parametrize("L,S", [(4, 2), (5, 2), (6, 4), (3, 1), (7, 3), (2, 5)])
def test_attn_res_matches_naive_closed_form(L, S):
    kda = [i for i in range(1, L + 1) if i % 3]
    model = make_model(num_hidden_layers=L, kda_layers=kda, attn_res_block_size=S)
    ids = torch.randint(0, 97, (2, 19))
    counts = []
    with torch.no_grad():
        ref = naive_h_final(model, ids, counts)
        ours = model(ids, return_hidden_states=True).hidden_states
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=1e-10)
    for l, (n_mixer, n_ffn) in enumerate(counts):
        assert n_mixer == (1 if l == 0 else math.ceil(l / S) + 1)
        assert n_ffn == math.ceil(l / S) + (l % S == 0) + 1  # spec §7 source count of the FFN


def test_plain_residual_without_attn_res():
    model = make_model(attn_res_block_size=None, attn_res_random=False)
    assert not any("res_" in n for n, _ in model.named_parameters())
    ids = torch.randint(0, 97, (2, 9))
    step = make_step((2, 9), "cpu", None, None, 10**6)
    with torch.no_grad():
        h = model.model.embed_tokens(ids)
        for layer in model.model.layers:
            h = h + layer.self_attn(layer.input_layernorm(h), step)
            x = layer.post_attention_layernorm(h)
            h = h + (layer.block_sparse_moe(x) if layer.is_moe else layer.mlp(x))
        torch.testing.assert_close(model(ids, return_hidden_states=True).hidden_states, h, atol=1e-12, rtol=1e-10)


def test_mix_uses_raw_values_and_only_the_product_of_norm_and_query():
    torch.manual_seed(0)
    d = 16
    proj, norm = torch.nn.Linear(d, 1, bias=False).double(), RMSNorm(d).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
    srcs = [torch.randn(3, 5, d, dtype=torch.float64) * s for s in (1.0, 10.0, 0.1)]
    assert attn_res_mix(srcs[:1], proj, norm) is srcs[0]
    out = attn_res_mix(srcs, proj, norm)
    torch.testing.assert_close(out, mix(srcs, proj, norm))
    with torch.no_grad():
        proj.weight.mul_(2.0)
        norm.weight.div_(2.0)
    torch.testing.assert_close(attn_res_mix(srcs, proj, norm), out)
    with torch.no_grad():
        proj.weight.zero_()
    torch.testing.assert_close(attn_res_mix(srcs, proj, norm), sum(srcs) / 3)
