"""Tests of model/moe.py: router math against hand-checked cases, the MoE block against a plain per-token
loop (float64), checkpoint names, routing replay with unrecorded rows and the padding mask. The expert
kernels are tested in tests/kernels/test_moe_experts.py, the bias update in tests/rl/test_router_balance.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3rl.model.config import ModelConfig
from k3rl.model.formats.names import split_experts
from k3rl.model.moe import MLP, MoE, Router, build_ffn, is_moe_layer


def make_config(**kw) -> ModelConfig:
    base = dict(hidden_size=16, intermediate_size=24, num_experts=8, num_experts_per_token=2,
                num_shared_experts=1, moe_intermediate_size=12, routed_scaling_factor=1.0)
    balance = kw.pop("balance", None)
    cfg = ModelConfig(**{**base, **kw})
    if balance is not None:
        cfg.router_balance = balance
    return cfg


def with_fields(cfg: ModelConfig, **extra) -> SimpleNamespace:
    """The config as a plain attribute bag plus fields ModelConfig lacks (grouped top-k)."""
    return SimpleNamespace(**{**vars(cfg), **extra})


def logit(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p) - torch.log1p(-p)


def identity_router(cfg, scores: list[float], bias: list[float]) -> tuple[Router, torch.Tensor]:
    """A router whose weight is I, fed x = logit(scores), so its sigmoid scores are `scores`."""
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(len(scores)))
        router.e_score_correction_bias.copy_(torch.tensor(bias))
    return router, logit(torch.tensor([scores], dtype=torch.float64))


def test_is_moe_layer():
    cfg = make_config(first_k_dense_replace=2, moe_layer_freq=2, num_hidden_layers=8)
    assert [is_moe_layer(cfg, i) for i in range(8)] == [False, False, True, False, True, False, True, False]
    assert isinstance(build_ffn(cfg, 4), MoE) and isinstance(build_ffn(cfg, 1), MLP)
    assert not any(is_moe_layer(make_config(num_experts=None, first_k_dense_replace=0), i) for i in range(4))


def test_router_biased_selection_unbiased_weights():
    # s = [.9, .8, .3, .2], b = [-.5, 0, .6, 0] → s + b = [.4, .8, .9, .2]: picks 2 then 1,
    # weighted by the unbiased .3 and .8.
    cfg = make_config(hidden_size=4, num_experts=4, num_experts_per_token=2, routed_scaling_factor=2.5)
    router, x = identity_router(cfg, [0.9, 0.8, 0.3, 0.2], [-0.5, 0.0, 0.6, 0.0])
    ids, w = router(x)
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(w, torch.tensor([[0.3 / 1.1 * 2.5, 0.8 / 1.1 * 2.5]], dtype=torch.float64))
    router.renormalize = False
    torch.testing.assert_close(router(x)[1], torch.tensor([[0.3 * 2.5, 0.8 * 2.5]], dtype=torch.float64))


def test_router_softmax_scores():
    cfg = make_config(hidden_size=4, num_experts=4, num_experts_per_token=2, moe_renormalize=False,
                      moe_router_activation_func="softmax")
    router, x = identity_router(cfg, [0.9, 0.8, 0.3, 0.2], [0.0, 0.0, 1.0, 0.0])
    s = x.softmax(-1)[0]
    ids, w = router(x)
    assert ids.tolist() == [[2, 0]]
    torch.testing.assert_close(w[0], s[[2, 0]])


def test_grouped_topk_hand_checked():
    # Groups of 2: {0,1} sums .96, {2,3} 1.2, {4,5} 1.0, {6,7} .2. Keeping 2 groups drops the
    # single best expert 0; a plain top-2 would take it.
    scores = [0.95, 0.01, 0.6, 0.6, 0.5, 0.5, 0.1, 0.1]
    cfg = with_fields(make_config(num_experts=8, hidden_size=8), num_expert_group=4, topk_group=2)
    router, x = identity_router(cfg, scores, [0.0] * 8)
    assert sorted(router(x)[0][0].tolist()) == [2, 3]
    plain, _ = identity_router(with_fields(cfg, num_expert_group=1, topk_group=1), scores, [0.0] * 8)
    assert sorted(plain(x)[0][0].tolist()) == [0, 2] or sorted(plain(x)[0][0].tolist()) == [0, 3]


def test_grouped_topk_one_group_is_plain_topk():
    torch.manual_seed(0)
    cfg = with_fields(make_config(num_experts=16, num_experts_per_token=4), num_expert_group=1, topk_group=1)
    router = Router(cfg)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(64, 16)
    ids, _ = router(x)
    biased = torch.sigmoid(x @ router.weight.T) + router.e_score_correction_bias
    assert torch.equal(ids, biased.topk(4, dim=-1).indices)


def reference_moe(moe: MoE, cfg, x: torch.Tensor) -> torch.Tensor:
    """Per-token loop over the chosen experts, written from docs/model_spec.md §8 independently of MoE."""
    beta, lin = cfg.activation_situ_beta or 1.0, cfg.activation_situ_linear_beta

    def act(g, u):
        if cfg.hidden_act == "silu":
            return g * torch.sigmoid(g) * u
        return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (u if lin is None else lin * torch.tanh(u / lin))

    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = moe.gate.weight @ x[t]
        s = torch.sigmoid(logits) if cfg.moe_router_activation_func == "sigmoid" else logits.softmax(-1)
        ids = (s + moe.gate.e_score_correction_bias).topk(cfg.num_experts_per_token).indices
        w = s[ids] / s[ids].sum() if cfg.moe_renormalize else s[ids]
        w = w * cfg.routed_scaling_factor
        z = moe.routed_expert_down_proj.weight @ x[t] if cfg.routed_expert_hidden_size else x[t]
        experts = moe.experts.per_expert()  # (w1, w2, w3) of each expert
        r = sum(wi * (w2 @ act(w1 @ z, w3 @ z)) for wi, (w1, w2, w3) in zip(w, (experts[int(i)] for i in ids)))
        if cfg.latent_moe_use_norm:
            r = moe.routed_expert_norm.weight * r / torch.sqrt((r * r).mean() + cfg.rms_norm_eps)
        if cfg.routed_expert_hidden_size:
            r = moe.routed_expert_up_proj.weight @ r
        if cfg.num_shared_experts:
            sh = moe.shared_experts
            r = r + sh.down_proj.weight @ act(sh.gate_proj.weight @ x[t], sh.up_proj.weight @ x[t])
        out[t] = r
    return out


@pytest.mark.parametrize("kw", [
    dict(),
    dict(hidden_act="silu", routed_scaling_factor=2.5),
    dict(routed_expert_hidden_size=10),
    dict(routed_expert_hidden_size=10, latent_moe_use_norm=True, num_shared_experts=2),
    dict(moe_router_activation_func="softmax", moe_renormalize=False, num_shared_experts=0),
    dict(activation_situ_linear_beta=None, num_experts=7, num_experts_per_token=3),
], ids=["situ", "silu", "latent", "latent_norm", "softmax_noshared", "odd"])
def test_dispatch_matches_dense_loop(kw):
    torch.manual_seed(1)
    cfg = make_config(**kw)
    moe = MoE(cfg).double()
    with torch.no_grad():
        moe.gate.e_score_correction_bias.normal_(0, 0.2)
        if cfg.latent_moe_use_norm:
            moe.routed_expert_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, cfg.hidden_size, dtype=torch.float64)  # [B, T, d]
    y = moe(x)
    assert y.shape == x.shape and moe.last_expert_ids.shape == (3, 7, cfg.num_experts_per_token)
    torch.testing.assert_close(y.reshape(-1, cfg.hidden_size), reference_moe(moe, cfg, x.reshape(-1, cfg.hidden_size)),
                               rtol=1e-10, atol=1e-12)


def test_situ_vs_silu_mlp():
    torch.manual_seed(2)
    x = torch.randn(5, 16, dtype=torch.float64)
    outs = {}
    for act, beta in [("silu", 4.0), ("situ", 4.0), ("situ", None)]:
        cfg = make_config(hidden_act=act, activation_situ_beta=beta, activation_situ_linear_beta=3.0)
        torch.manual_seed(3)
        mlp = MLP(cfg).double()
        g, u = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
        b = beta or 1.0
        h = (g * torch.sigmoid(g) * u if act == "silu"
             else b * torch.tanh(g / b) * torch.sigmoid(g) * 3.0 * torch.tanh(u / 3.0))
        outs[(act, beta)] = mlp(x)
        torch.testing.assert_close(outs[(act, beta)], h @ mlp.down_proj.weight.T)
    assert not torch.allclose(outs[("silu", 4.0)], outs[("situ", 4.0)])
    with pytest.raises(ValueError):
        MLP(make_config(hidden_act="gelu"))


def test_replay_reproduces_output():
    torch.manual_seed(4)
    cfg = make_config()
    moe = MoE(cfg)
    x = torch.randn(2, 9, 16)
    y = moe(x)
    ids = moe.last_expert_ids.clone()
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.linspace(1.0, -1.0, 8))
    y_free = moe(x)
    assert not torch.equal(moe.last_expert_ids, ids)
    assert not torch.allclose(y_free, y)
    y_replay = moe(x, routed_expert_ids=ids)
    assert torch.equal(moe.last_expert_ids, ids)
    torch.testing.assert_close(y_replay, y, rtol=0, atol=0)


def test_gradients_reach_all_parameters_but_not_bias():
    torch.manual_seed(5)
    cfg = make_config(routed_expert_hidden_size=10, latent_moe_use_norm=True)
    moe = MoE(cfg)
    moe(torch.randn(4, 32, 16)).square().sum().backward()
    assert torch.bincount(moe.last_expert_ids.flatten(), minlength=8).min() > 0
    names = dict(moe.named_parameters())
    assert "gate.e_score_correction_bias" not in names
    for name, p in names.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert moe.gate.e_score_correction_bias.grad is None
    assert not moe.gate.e_score_correction_bias.requires_grad


def test_state_dict_matches_spec():
    cfg = make_config(hidden_size=32, num_experts=4, moe_intermediate_size=16, num_shared_experts=3,
                      routed_expert_hidden_size=24, latent_moe_use_norm=True, intermediate_size=40)
    want = {"gate.weight": (4, 32), "gate.e_score_correction_bias": (4,),
            "shared_experts.gate_proj.weight": (48, 32), "shared_experts.up_proj.weight": (48, 32),
            "shared_experts.down_proj.weight": (32, 48), "routed_expert_down_proj.weight": (24, 32),
            "routed_expert_norm.weight": (24,), "routed_expert_up_proj.weight": (32, 24)}
    for e in range(4):
        want |= {f"experts.{e}.w1.weight": (16, 24), f"experts.{e}.w3.weight": (16, 24),
                 f"experts.{e}.w2.weight": (24, 16)}
    stacked = {k: tuple(v.shape) for k, v in MoE(cfg).state_dict().items() if k.startswith("experts.")}
    assert stacked == {"experts.w1": (4, 16, 24), "experts.w3": (4, 16, 24), "experts.w2": (4, 24, 16)}
    got = {k: tuple(v.shape) for k, v in split_experts(MoE(cfg).state_dict().items())}
    assert got == want
    assert {k: tuple(v.shape) for k, v in MLP(cfg).state_dict().items()} == {
        "gate_proj.weight": (40, 32), "up_proj.weight": (40, 32), "down_proj.weight": (32, 40)}
    plain = {k for k in MoE(make_config(num_experts=2)).state_dict()}
    assert not any(k.startswith("routed_expert_") for k in plain)


def test_bias_stays_fp32():
    moe = MoE(make_config())
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.tensor([1e-4 + 1.0] * 8))
    before = moe.gate.e_score_correction_bias.clone()
    moe.to(torch.bfloat16)
    assert moe.gate.weight.dtype == torch.bfloat16
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(moe.gate.e_score_correction_bias, before)
    assert moe(torch.randn(3, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_replay_rows_with_unrecorded_ids_and_padding_mask():
    """Rows with a -1 are routed by the router, padding rows are routed and never replayed; only the
    masked-in tokens enter the balancing statistics."""
    torch.manual_seed(8)
    cfg = make_config()
    router = Router(cfg).train()
    x = torch.randn(6, 16)
    own, _ = router(x)
    router.clear_stats()
    recorded = (own + 1) % 8  # a routing that differs from the router's own on every row
    recorded[1, 0] = -1  # not recorded: routed by the router
    mask = torch.tensor([True, True, True, True, False, False])  # the last two rows are padding
    ids, weights = router(x, recorded, mask)
    assert torch.equal(ids[[0, 2, 3]], recorded[[0, 2, 3]])
    assert torch.equal(ids[[1, 4, 5]], own[[1, 4, 5]])
    torch.testing.assert_close(weights, router(x, ids)[1])
    assert router._tokens == 4 + 6  # 4 counted rows, then the 6 of the unmasked call
    router.clear_stats()
    router(x, recorded, mask)
    assert router._tokens == 4 and int(router._loads.sum()) == 4 * cfg.num_experts_per_token
    assert torch.equal(router._loads, torch.bincount(ids[:4].flatten(), minlength=8))
    assert torch.cat(router._margins).shape == (4, 8)
    with pytest.raises(ValueError, match="router mask has 5 entries for 6 tokens"):
        router(x, None, mask[:5])
    with pytest.raises(ValueError, match="must be < num_experts = 8"):
        router(x, torch.full((6, 2), 8))


def test_moe_impls_agree_in_the_block():
    torch.manual_seed(9)
    cfg = make_config(routed_expert_hidden_size=12)
    moe = MoE(cfg)
    x = torch.randn(2, 11, 16, requires_grad=True)
    outs = []
    for impl in ("grouped", "naive"):
        moe.experts.impl = impl
        moe.zero_grad()
        y = moe(x)
        y.square().sum().backward()
        outs.append((y.detach(), moe.experts.w1.grad.clone(), moe.experts.w2.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_experts_init_is_per_expert_linear_init():
    """Stacked experts draw what E×3 nn.Linear modules would have, in the same order."""
    cfg = make_config()
    torch.manual_seed(10)
    stacked = MoE(cfg).experts
    torch.manual_seed(10)
    Router(cfg)  # the gate is built first in MoE
    for w1, w2, w3 in stacked.per_expert():
        for w, shape in ((w1, (12, 16)), (w2, (16, 12)), (w3, (12, 16))):
            lin = torch.nn.Linear(shape[1], shape[0], bias=False)
            assert torch.equal(lin.weight, w)
