"""KDA layer against the spec written out token by token (float64): projections, causal conv with
SiLU, both decay forms, β, L2-normalised q/k, the §5.3 recurrence, gated RMSNorm; the chunked
(prefill) and recurrent (decode) paths agree and carry conv and recurrent state across calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3_factory import make_config

from k3rl.model.cache import K3Cache, make_step
from k3rl.model.kda import KimiDeltaAttention


def reference_kda(layer: KimiDeltaAttention, x: torch.Tensor, lb) -> torch.Tensor:
    """Spec §5.1–5.4 for one sequence x [T, d], written directly from the weights."""
    T = x.shape[0]
    H, K, W = layer.num_heads, layer.head_dim, layer.conv_width

    def conv(z, w):  # z [T, P], w [P, 1, W]: y[t] = Σ_i w[i]·z[t-(W-1)+i]
        return F.silu(F.conv1d(z.T[None], w.double(), padding=W - 1, groups=z.shape[1])[0, :, :T].T)

    q = conv(x @ layer.q_proj.weight.T, layer.q_conv1d.weight).view(T, H, K)
    k = conv(x @ layer.k_proj.weight.T, layer.k_conv1d.weight).view(T, H, K)
    v = conv(x @ layer.v_proj.weight.T, layer.v_conv1d.weight).view(T, H, K)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    z = (x @ layer.f_a_proj.weight.T @ layer.f_b_proj.weight.T).view(T, H, K) + layer.dt_bias.double().view(H, K)
    a = layer.A_log.double().exp()[:, None]
    g = -a * F.softplus(z) if lb is None else lb * torch.sigmoid(a * z)
    beta = torch.sigmoid(x @ layer.b_proj.weight.T)  # [T, H]
    S = torch.zeros(H, K, K, dtype=torch.float64)  # [H, V, K]
    out = []
    for t in range(T):
        S = S * g[t].exp()[:, None, :]
        u = beta[t, :, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
        S = S + u[:, :, None] * k[t][:, None, :]
        out.append(torch.einsum("hvk,hk->hv", S, q[t]))
    o = torch.stack(out)  # [T, H, V]
    gate = x @ layer.g_proj.weight.T if hasattr(layer, "g_proj") else x @ layer.g_a_proj.weight.T @ layer.g_b_proj.weight.T
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.o_norm.weight * torch.sigmoid(gate.view(T, H, K))
    return o.reshape(T, H * K) @ layer.o_proj.weight.T


def kda_layer(seed=0, **lac):
    cfg = make_config(num_hidden_layers=2, kda_layers=(1, 2), linear_attn_config=lac)
    torch.manual_seed(seed)
    return cfg, KimiDeltaAttention(cfg, 0).double()


@pytest.mark.parametrize("lac", [dict(gate_lower_bound=-5.0), dict(gate_lower_bound=-0.7),
                                 dict(gate_lower_bound=None), dict(use_full_rank_gate=False, short_conv_kernel_size=2)])
@pytest.mark.parametrize("T", [1, 45, 131])
def test_layer_matches_spec_reference(lac, T):
    cfg, layer = kda_layer(T, **lac)
    x = torch.randn(2, T, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        out = layer(x, make_step((2, T), "cpu", None, None, 10**6))
    for b in range(2):
        # 1e-7: the layer's gate goes through kernels.kda.kda_gate, which computes in fp32.
        torch.testing.assert_close(out[b], reference_kda(layer, x[b], cfg.linear_attn_config["gate_lower_bound"]),
                                   atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("lb", [-5.0, None])
def test_chunked_prefill_then_recurrent_decode_carries_state(lb):
    cfg, layer = kda_layer(1, gate_lower_bound=lb)
    T, split = 77, 65
    x = torch.randn(3, T, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x, make_step((3, T), "cpu", None, None, 10**6))
        cache = K3Cache.create(cfg, 3, capacity=0, dtype=torch.float64)
        parts = []
        for lo, hi in [(0, split), *[(t, t + 1) for t in range(split, T - 3)], (T - 3, T)]:
            parts.append(layer(x[:, lo:hi], make_step((3, hi - lo), "cpu", cache, None, 10**6)))
            cache.commit(hi - lo)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-7, rtol=1e-6)
    raw = torch.cat([x[:, -3:] @ w.T for w in (layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight)], -1)
    torch.testing.assert_close(cache.conv[0], raw.transpose(1, 2))  # the last W-1 = 3 raw inputs
    assert cache.recurrent[0].shape == (3, 2, 8, 8) and cache.latent == {}


def test_fp32_parameters_survive_half_casts_and_checkpoint_names():
    cfg, layer = kda_layer()
    layer = layer.to(torch.bfloat16)
    for name in ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"):
        assert layer.get_parameter(name).dtype == torch.float32, name
    assert layer.q_proj.weight.dtype == torch.bfloat16
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    H, K, d, P = 2, 8, cfg.hidden_size, 16
    assert shapes == {"q_proj.weight": (P, d), "k_proj.weight": (P, d), "v_proj.weight": (P, d), "g_proj.weight": (P, d),
                      "f_a_proj.weight": (K, d), "f_b_proj.weight": (P, K), "b_proj.weight": (H, d),
                      "q_conv1d.weight": (P, 1, 4), "k_conv1d.weight": (P, 1, 4), "v_conv1d.weight": (P, 1, 4),
                      "A_log": (H,), "dt_bias": (P,), "o_norm.weight": (K,), "o_proj.weight": (d, P)}


def test_unbounded_gate_gradients_finite_with_mixed_decays():
    """`gate_lower_bound: null` in fp32 with A_log and dt_bias set so some channels decay by 20-40 nats per token
    and others barely: the gate parameters' gradients (A_log, dt_bias, f_a_proj, f_b_proj) are finite and match
    the same layer in float64 (they were NaN: docs issue 17, `_diag_tiles`)."""
    cfg, layer = kda_layer(5, gate_lower_bound=None)
    H, K = layer.num_heads, layer.head_dim
    with torch.no_grad():
        layer.A_log.copy_(torch.linspace(0.0, 3.5, H, dtype=torch.float64))
        layer.dt_bias.copy_(torch.linspace(-4.0, 4.0, H * K, dtype=torch.float64)[torch.randperm(H * K)])
    x = torch.randn(1, 80, cfg.hidden_size, dtype=torch.float64) * 2
    grads = {}
    for dtype in (torch.float64, torch.float32):
        m = layer.to(dtype)
        m.zero_grad()
        m(x.to(dtype), make_step((1, 80), "cpu", None, None, 10**6)).double().pow(2).sum().backward()
        grads[dtype] = {n: p.grad.double().clone() for n, p in m.named_parameters()}
    for name in ("A_log", "dt_bias", "f_a_proj.weight", "f_b_proj.weight"):
        got, ref = grads[torch.float32][name], grads[torch.float64][name]
        assert torch.isfinite(got).all(), name
        assert (got - ref).norm() / ref.norm() < 1e-3, name


@pytest.mark.parametrize("lac", [dict(gate_lower_bound=-5.0), dict(gate_lower_bound=None),
                                 dict(use_full_rank_gate=False, short_conv_kernel_size=2)])
def test_fused_decode_step_equals_the_layer_path_and_follows_weight_updates(lac):
    """A no-grad one-token step (`_decode_step`: one GEMM for the six input projections, one window product for the
    three convolutions) gives the general path's output and cache (float64, a left-padded row included), and
    after a weight written in place (a weight sync) it uses the new weight."""
    cfg, layer = kda_layer(3, **lac)
    x = torch.randn(3, 12, cfg.hidden_size, dtype=torch.float64)
    pad = torch.tensor([[True] * 12, [False] * 4 + [True] * 8, [True] * 12])

    def decode(fused: bool, steps=range(9, 12)):
        cache = K3Cache.create(cfg, 3, capacity=0, dtype=torch.float64)
        outs = []
        with torch.no_grad():
            layer(x[:, :9], make_step((3, 9), "cpu", cache, pad[:, :9].long(), 10**6))
        cache.commit(9)
        for t in steps:
            with torch.set_grad_enabled(not fused):  # grad on: the general path
                outs.append(layer(x[:, t:t + 1], make_step((3, 1), "cpu", cache, pad[:, :t + 1].long(), 10**6)).detach())
            cache.commit(1)
        return torch.cat(outs, 1), cache

    (fused, c1), (plain, c2) = decode(True), decode(False)
    torch.testing.assert_close(fused, plain, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(c1.conv[0], c2.conv[0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(c1.recurrent[0], c2.recurrent[0], atol=1e-12, rtol=1e-10)
    with torch.no_grad():
        for w in (layer.v_proj.weight, layer.k_conv1d.weight, layer.b_proj.weight):
            w.mul_(1.5)
    (fused, _), (plain, _) = decode(True), decode(False)
    torch.testing.assert_close(fused, plain, atol=1e-12, rtol=1e-10)
