"""Tests of model/moe.py: router math against hand-checked cases, the sorted dispatch against a
plain per-token loop (float64), checkpoint names, routing replay, and router balancing
(quantile, sign, none; micro-batch accumulation; 2-process gloo equals one process)."""

from __future__ import annotations

import math
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

from model.config import ModelConfig, RouterBalanceConfig
from model.moe import MLP, MoE, Router, _quantile_bias_delta, balance_routers, build_ffn, is_moe_layer


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
        r = sum(wi * (ex.w2.weight @ act(ex.w1.weight @ z, ex.w3.weight @ z))
                for wi, ex in zip(w, (moe.experts[int(i)] for i in ids)))
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
    got = {k: tuple(v.shape) for k, v in MoE(cfg).state_dict().items()}
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


def skewed_router(e=16, k=2, d=16, balance=None, seed=0) -> Router:
    """Router whose logits carry a strong per-expert offset (via a constant input feature)."""
    torch.manual_seed(seed)
    router = Router(make_config(hidden_size=d, num_experts=e, num_experts_per_token=k, balance=balance)).train()
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.weight[:, 0] = torch.randn(e) * 1.5
    return router


def skewed_batch(m=2048, d=16, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g)
    x[:, 0] = 1.0
    return x


def maxvio_of(router: Router, x: torch.Tensor) -> float:
    router.eval()
    load = torch.bincount(router(x)[0].flatten(), minlength=router.num_experts).double()
    router.train()
    t = x.shape[0] * router.top_k / router.num_experts
    return (load.max().item() - t) / t


def test_quantile_one_step_defining_property():
    # Each expert's bias change alone would give it exactly round(T) tokens on that batch (the
    # spec's definition: other biases held fixed). All changes together leave a residual from
    # their interaction, which repeating the update on the same batch removes.
    router = skewed_router(balance=RouterBalanceConfig(method="quantile", step_size=1.0))
    x = skewed_batch()
    before_bias = router.e_score_correction_bias.clone()
    router(x)
    mv = balance_routers(router)[""]
    delta = router.e_score_correction_bias - before_bias
    c = round(x.shape[0] * 2 / 16)
    for j in range(16):
        with torch.no_grad():
            router.e_score_correction_bias.copy_(before_bias)
            router.e_score_correction_bias[j] += delta[j]
        assert int((router.eval()(x)[0] == j).sum()) == c, j
    router.train()
    with torch.no_grad():
        router.e_score_correction_bias.copy_(before_bias + delta)
    one_step = maxvio_of(router, x)
    assert mv > 2.0 and one_step < mv / 10
    for _ in range(3):
        router(x)
        balance_routers(router)
    assert maxvio_of(router, x) < 0.02


def test_quantile_matches_sorted_order_statistics():
    router = skewed_router(e=8, k=3, balance=RouterBalanceConfig(step_size=1.0), seed=3)
    x = skewed_batch(m=301, seed=4)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0, 0.1)
    before = router.e_score_correction_bias.clone()
    router(x)
    margins = torch.cat(router._margins)  # [m, E]
    balance_routers(router)
    c = round(301 * 3 / 8)
    top = margins.sort(0, descending=True).values
    torch.testing.assert_close(router.e_score_correction_bias - before, -(top[c - 1] + top[c]) / 2)


def test_quantile_order_statistics_with_ties():
    # Column 0 ties the 2nd and 3rd largest (2, 2); column 1 has distinct values; a second
    # "layer" of random margins with a different target is solved in the same bisection.
    col = torch.tensor([[3.0, 0.5], [2.0, 0.4], [2.0, -0.1], [2.0, 0.9], [1.0, 0.0]])
    rand = torch.randn(50, 2).round(decimals=1)
    delta = _quantile_bias_delta([col, rand], torch.tensor([2, 7]), None, False)
    torch.testing.assert_close(delta[0], torch.tensor([-2.0, -(0.5 + 0.4) / 2]))
    top = rand.sort(0, descending=True).values
    torch.testing.assert_close(delta[1], -(top[6] + top[7]) / 2)


def test_quantile_damped_steps_balance_a_skewed_router():
    router = skewed_router(balance=RouterBalanceConfig(method="quantile", step_size=0.5))
    history = []
    for step in range(12):
        router(skewed_batch(m=4096, seed=100 + step))
        history.append(balance_routers(router)[""])
    assert history[0] > 2.0 and max(history[-3:]) < 0.15


def test_sign_update_direction_and_none():
    router = skewed_router(balance=RouterBalanceConfig(method="sign", sign_gamma=0.01))
    x = skewed_batch()
    router(x)
    load = router._loads.clone()
    before = router.e_score_correction_bias.clone()
    balance_routers(router)
    t = x.shape[0] * 2 / 16
    torch.testing.assert_close(router.e_score_correction_bias - before, 0.01 * torch.sign(t - load.float()))
    assert (router.e_score_correction_bias - before)[load.argmax()] < 0
    assert (router.e_score_correction_bias - before)[load.argmin()] > 0

    frozen = skewed_router(balance=RouterBalanceConfig(method="none"))
    frozen(x)
    before = frozen.e_score_correction_bias.clone()
    mv = balance_routers(frozen)
    assert torch.equal(frozen.e_score_correction_bias, before) and mv[""] > 2.0
    with pytest.raises(ValueError):
        skewed_router(balance=RouterBalanceConfig(method="aux_loss"))


@pytest.mark.parametrize("reentrant", [False, True])
def test_statistics_only_from_training_forwards(reentrant):
    torch.manual_seed(6)
    moe = MoE(make_config(num_hidden_layers=1))
    x = torch.randn(2, 10, 16, requires_grad=True)
    moe.eval()(x)
    assert moe.gate._tokens == 0 and balance_routers(moe) == {}
    moe.train()
    # The checkpointed forward counts once: not again when recomputed inside backward.
    checkpoint(moe, x, use_reentrant=reentrant).sum().backward()
    assert moe.gate._tokens == 20 and len(moe.gate._margins) == 1
    assert set(balance_routers(moe)) == {""}
    assert moe.gate._tokens == 0 and moe.gate._margins == []
    moe.gate.collect_stats = False
    moe(x)
    assert moe.gate._tokens == 0


def test_micro_batches_equal_one_batch():
    x = skewed_batch(m=600, seed=7)
    a = skewed_router(balance=RouterBalanceConfig(step_size=0.7))
    b = skewed_router(balance=RouterBalanceConfig(step_size=0.7))
    a(x)
    b(x[:250]), b(x[250:400]), b(x[400:])
    assert balance_routers(a) == balance_routers(b)
    assert torch.equal(a.e_score_correction_bias, b.e_score_correction_bias)


class TwoLayers(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = torch.nn.ModuleList(MoE(cfg) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def two_layer_setup():
    torch.manual_seed(8)
    cfg = make_config(num_experts=8, num_experts_per_token=2, balance=RouterBalanceConfig(step_size=0.8))
    model = TwoLayers(cfg).train()
    x = torch.randn(256, 16)
    return model, x


def _dist_worker(rank: int, init_file: str, out_dir: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model, x = two_layer_setup()
    out = []
    # Step 1: uneven shards, rank 1 runs two micro-batches. Step 2: rank 0 sees no tokens.
    if rank == 0:
        model(x[:100])
    else:
        model(x[100:180]), model(x[180:])
    out.append((balance_routers(model), [m.gate.e_score_correction_bias.clone() for m in model.layers]))
    if rank == 1:
        model(x)
    out.append((balance_routers(model), [m.gate.e_score_correction_bias.clone() for m in model.layers]))
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_distributed_matches_single_process():
    model, x = two_layer_setup()
    want = []
    for _ in range(2):
        model(x)
        want.append((balance_routers(model), [m.gate.e_score_correction_bias.clone() for m in model.layers]))
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_dist_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    for res in results:
        for (mv, biases), (want_mv, want_biases) in zip(res, want):
            assert mv == want_mv and set(mv) == {"layers.0", "layers.1"}
            assert all(math.isfinite(v) for v in mv.values())
            for got, ref in zip(biases, want_biases):
                torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert not torch.equal(want[1][1][0], want[0][1][0])
