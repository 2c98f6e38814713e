"""MLA layer against a plain per-head reference (float64): NoPE and RoPE (interleaved pairs,
configurable base), the expanded and the absorbed (decode) forms, and the latent-only cache."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from k3_factory import make_config

from k3rl.model.cache import K3Cache, make_step
from k3rl.model.mla import MultiheadLatentAttention


def rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_complex(x, pos, theta):
    """Reference RoPE: pairs (x[2m], x[2m+1]) as complex numbers times e^{i·pos·θ^(-2m/D)}."""
    D = x.shape[-1]
    freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], D // 2, 2).contiguous())
    rot = torch.polar(torch.ones_like(freq), pos[..., None].double() * freq)  # [T, D/2]
    while rot.ndim < z.ndim:
        rot = rot.unsqueeze(-2)
    return torch.view_as_real(z * rot).flatten(-2)


def reference_mla(layer: MultiheadLatentAttention, cfg, x, positions):
    """Spec §6 written per head with an explicit causal softmax; x [T, d] (one sequence)."""
    H, dn, dr, dv, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        q = x @ layer.q_proj.weight.T
    else:
        c_q = rms(x @ layer.q_a_proj.weight.T, layer.q_a_layernorm.weight, cfg.rms_norm_eps)
        q = c_q @ layer.q_b_proj.weight.T
    kv = x @ layer.kv_a_proj_with_mqa.weight.T
    kv_c, k_pe = rms(kv[:, :L], layer.kv_a_layernorm.weight, cfg.rms_norm_eps), kv[:, L:]
    if not cfg.mla_use_nope:
        k_pe = rope_complex(k_pe, positions, cfg.rope_theta)
    kvb = (kv_c @ layer.kv_b_proj.weight.T).view(-1, H, dn + dv)
    T = x.shape[0]
    heads = []
    for h in range(H):
        q_h = q.view(T, H, dn + dr)[:, h]
        q_nope, q_pe = q_h[:, :dn], q_h[:, dn:]
        if not cfg.mla_use_nope:
            q_pe = rope_complex(q_pe, positions, cfg.rope_theta)
        scores = (q_nope @ kvb[:, h, :dn].T + q_pe @ k_pe.T) / math.sqrt(dn + dr)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(scores.softmax(-1) @ kvb[:, h, dn:])
    a = torch.cat(heads, dim=-1)
    if cfg.mla_use_output_gate:
        a = a * torch.sigmoid(x @ layer.g_proj.weight.T)
    return a @ layer.o_proj.weight.T


@pytest.mark.parametrize("kw", [
    dict(mla_use_nope=True),
    dict(mla_use_nope=False, rope_theta=10000.0),
    dict(mla_use_nope=False, rope_theta=123.0, q_lora_rank=None, mla_use_output_gate=False),
])
@pytest.mark.parametrize("T", [1, 29, 66])
def test_mla_matches_reference_expanded_and_absorbed(kw, T):
    cfg = make_config(kda_layers=(), **kw)
    torch.manual_seed(T)
    layer = MultiheadLatentAttention(cfg, 0).double()
    x = torch.randn(2, T, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        out = layer(x, make_step((2, T), "cpu", None, None, 10**6))
        for b in range(2):
            ref = reference_mla(layer, cfg, x[b], torch.arange(T))
            torch.testing.assert_close(out[b], ref, atol=1e-12, rtol=1e-10)
        cache = K3Cache.create(cfg, 2, capacity=T, dtype=torch.float64)
        steps = []
        for t in range(T):  # T = 1 steps take the absorbed path
            step = make_step((2, 1), "cpu", cache, None, 10**6)
            steps.append(layer(x[:, t:t + 1], step))
            cache.commit(1)
        torch.testing.assert_close(torch.cat(steps, 1), out, atol=1e-12, rtol=1e-10)
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        assert cache.latent[0].shape == (2, T, width)
        assert cache.nbytes() == cfg.num_hidden_layers * 2 * T * width * 8  # latents only, no KDA layers


def test_rope_depends_on_relative_position_only_and_nope_on_none():
    torch.manual_seed(0)
    for nope in (True, False):
        cfg = make_config(kda_layers=(), mla_use_nope=nope, rope_theta=50.0)
        layer = MultiheadLatentAttention(cfg, 0).double()
        x = torch.randn(1, 12, cfg.hidden_size, dtype=torch.float64)
        step = make_step((1, 12), "cpu", None, None, 10**6)
        shifted = make_step((1, 12), "cpu", None, None, 10**6)
        shifted.positions = step.positions + 1000
        with torch.no_grad():
            torch.testing.assert_close(layer(x, shifted), layer(x, step), atol=1e-9, rtol=1e-9)
            cfg.rope_theta = 5000.0  # read at call time: a staged recipe may raise it
            changed = not torch.allclose(layer(x, step), reference_mla(layer, make_config(
                kda_layers=(), mla_use_nope=nope, rope_theta=50.0), x[0], torch.arange(12))[None])
        assert changed is (not nope)


def test_rope_matches_complex_rotation():
    from k3rl.model.mla import apply_rope

    x = torch.randn(3, 5, 2, 8, dtype=torch.float64)
    pos = torch.randint(0, 10**5, (3, 5))
    ref = torch.stack([rope_complex(x[b], pos[b], 777.0) for b in range(3)])
    torch.testing.assert_close(apply_rope(x, pos, 777.0), ref, atol=1e-9, rtol=1e-9)
    assert F.cosine_similarity(apply_rope(x, pos, 777.0).flatten(), x.flatten(), dim=0) < 0.9


@pytest.mark.parametrize("nope", [True, False])
def test_decode_over_left_padded_cache_is_each_sequence_alone(nope):
    """The one-token decode step in matmul form over a batch whose rows carry different left padding: every row's
    outputs equal its own sequence run alone (float64), the padding keys never attended."""
    cfg = make_config(kda_layers=(), mla_use_nope=nope, rope_theta=500.0)
    torch.manual_seed(3)
    layer = MultiheadLatentAttention(cfg, 0).double()
    lengths, T, steps = (9, 4), 9, 6
    x = torch.randn(2, T + steps, cfg.hidden_size, dtype=torch.float64)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, : T - lengths[1]] = 0  # row 1: 5 columns of padding
    with torch.no_grad():
        cache = K3Cache.create(cfg, 2, capacity=T + steps, dtype=torch.float64)
        layer(x[:, :T], make_step((2, T), "cpu", cache, mask, 10**6))
        cache.commit(T)
        outs = []
        for t in range(steps):
            outs.append(layer(x[:, T + t:T + t + 1], make_step((2, 1), "cpu", cache, None, 10**6)))
            cache.commit(1)
        out = torch.cat(outs, 1)  # [2, steps, d]
        for b, n in enumerate(lengths):
            alone = torch.cat([x[b, T - n:T], x[b, T:]])  # the row's real tokens, then its decoded ones
            ref = reference_mla(layer, cfg, alone, torch.arange(n + steps))[n:]
            torch.testing.assert_close(out[b], ref, atol=1e-12, rtol=1e-10)
