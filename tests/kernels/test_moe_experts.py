"""Tests of kernels/moe: the grouped routed experts — each of its three ways (padded bmm, grouped_mm, loop)
and the automatic choice — against the per-expert loop (naive.py) and a float64 per-token reference
written from the definition: outputs and gradients of every input, an expert no token chose, all
tokens on one expert, a single token, widths grouped_mm refuses, both branches of `grouped_linear`,
bf16 within rounding, and the choice itself (decode-sized → padded, training-sized → loop)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from k3rl.kernels.moe import dispatch, grouped_experts, grouped_linear, naive_experts, routed_experts
from k3rl.kernels.moe.grouped import strategy
from k3rl.kernels.situ import naive_situ_glu


def act(g, u):
    return naive_situ_glu(g, u, 4.0, 25.0)


def per_token_reference(z, ids, weights, w1, w3, w2):
    """Σ_k w_k · w2[e](act(w1[e] z, w3[e] z)) token by token, in float64."""
    z, weights, w1, w3, w2 = (t.double() for t in (z, weights, w1, w3, w2))
    rows = []
    for t in range(z.shape[0]):
        rows.append(sum(weights[t, j] * (w2[e] @ act(w1[e] @ z[t], w3[e] @ z[t]))
                        for j, e in enumerate(ids[t].tolist())))
    return torch.stack(rows) if rows else z.new_zeros(0, w2.shape[1])


def make_inputs(n, k, e, d, inter, dtype, seed, skip_expert=None, one_expert=None):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g).to(dtype)
    scores = torch.rand(n, e, generator=g)
    if skip_expert is not None:
        scores[:, skip_expert] = -1.0
    ids = scores.topk(k, dim=-1).indices
    if one_expert is not None:
        ids[:, 0] = one_expert
        ids[:, 1:] = (one_expert + 1 + torch.arange(k - 1)) % e
    weights = torch.rand(n, k, generator=g).to(dtype)
    w1, w3 = (torch.randn(e, inter, d, generator=g).to(dtype) * d ** -0.5 for _ in range(2))
    w2 = (torch.randn(e, d, inter, generator=g) * inter ** -0.5).to(dtype)
    return z, ids, weights, w1, w3, w2


def run_with_grads(fn, inputs):
    z, ids, weights, w1, w3, w2 = (t.clone().requires_grad_(t.is_floating_point()) for t in inputs)
    out = fn(z, ids, weights, w1, w3, w2, act)
    g = torch.Generator().manual_seed(99)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    return out.detach(), [t.grad for t in (z, weights, w1, w3, w2)]


CASES = [
    dict(n=37, k=2, e=8, d=16, inter=12, skip_expert=3),  # an expert with no tokens
    dict(n=13, k=3, e=7, d=10, inter=6),  # widths that grouped_mm refuses (padded branch)
    dict(n=1, k=2, e=8, d=16, inter=12),  # one token (decode at batch 1)
    dict(n=20, k=2, e=4, d=16, inter=8, one_expert=2),  # every token on expert 2
]


HOWS = [None, "padded", "grouped_mm", "loop"]


@pytest.mark.parametrize("how", HOWS, ids=["auto", "padded", "grouped_mm", "loop"])
@pytest.mark.parametrize("case", CASES, ids=["empty_expert", "odd_widths", "one_token", "one_expert"])
def test_grouped_equals_naive_and_reference_float64(case, how):
    inputs = make_inputs(**case, dtype=torch.float64, seed=1)
    ref = per_token_reference(*inputs)
    out_g, grads_g = run_with_grads(partial(grouped_experts, how=how), inputs)
    out_n, grads_n = run_with_grads(naive_experts, inputs)
    torch.testing.assert_close(out_g, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_n, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_g, grads_n):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if case.get("skip_expert") is not None:  # the unused expert gets a zero gradient, not garbage
        for w in grads_g[2:]:
            assert torch.count_nonzero(w[case["skip_expert"]]) == 0
            assert torch.count_nonzero(w.sum(dim=(1, 2))) == case["e"] - 1
    unchosen = sorted(set(range(case["e"])) - set(inputs[1].flatten().tolist()))
    for w in grads_g[2:]:  # every expert no token chose (one token: 6 of 8) gets zeros, on every path
        assert torch.count_nonzero(w[unchosen]) == 0


@pytest.mark.parametrize("how", HOWS, ids=["auto", "padded", "grouped_mm", "loop"])
@pytest.mark.parametrize("case", CASES[:1] + CASES[2:], ids=["empty_expert", "one_token", "one_expert"])
def test_float32_paths(case, how):
    """float32 with widths that are multiples of 4: grouped_mm runs as itself (where PyTorch has it)."""
    inputs = make_inputs(**case, dtype=torch.float32, seed=2)
    ref = per_token_reference(*inputs)
    out_g, grads_g = run_with_grads(partial(grouped_experts, how=how), inputs)
    out_n, grads_n = run_with_grads(naive_experts, inputs)
    assert out_g.dtype == torch.float32
    torch.testing.assert_close(out_g.double(), ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_g, grads_n):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bfloat16_within_rounding():
    inputs = make_inputs(n=64, k=2, e=8, d=32, inter=16, dtype=torch.bfloat16, seed=3, skip_expert=0)
    ref = per_token_reference(*inputs)
    out = grouped_experts(*inputs, act)
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, float(err)


def test_grouped_linear_branches_agree():
    g = torch.Generator().manual_seed(4)
    counts = torch.tensor([5, 0, 3, 0, 9])
    x = torch.randn(int(counts.sum()), 16, generator=g)
    w = torch.randn(5, 8, 16, generator=g)
    want = torch.cat([x[s:s + c] @ w[e].T for e, (s, c) in
                      enumerate(zip((counts.cumsum(0) - counts).tolist(), counts.tolist()))])
    torch.testing.assert_close(grouped_linear(x, w, counts), want)  # grouped_mm (aligned float32)
    torch.testing.assert_close(grouped_linear(x.double(), w.double(), counts), want.double(),
                               rtol=1e-6, atol=1e-5)  # padded bmm
    assert grouped_linear(x[:0], w, torch.zeros(5, dtype=torch.long)).shape == (0, 8)


def test_no_tokens_and_unknown_impl():
    z, ids, weights, w1, w3, w2 = make_inputs(n=3, k=2, e=4, d=8, inter=4, dtype=torch.float64, seed=5)
    for impl in ("grouped", "naive"):
        out = routed_experts(z[:0], ids[:0], weights[:0], w1, w3, w2, act, impl)
        assert out.shape == (0, 8)
    with pytest.raises(ValueError, match="moe impl must be one of"):
        routed_experts(z, ids, weights, w1, w3, w2, act, "fused")
    with pytest.raises(ValueError, match="how must be"):
        grouped_experts(z, ids, weights, w1, w3, w2, act, how="fused")


def test_strategy_by_shape():
    """Decoding shapes take the padded buffer (the loop at batch 1–2), a skewed small batch grouped_mm, training
    shapes the loop."""
    w1 = torch.zeros(8, 16, 32)

    def choice(ids):
        plan = dispatch(ids, 8)
        return strategy(plan, torch.zeros(ids.numel(), 32), w1)

    g = torch.Generator().manual_seed(7)
    assert choice(torch.rand(8, 8, generator=g).topk(2, -1).indices) == "padded"  # batch 8, top-2
    assert choice(torch.tensor([[3, 5]])) == "loop"  # batch 1, top-2: two experts' matmuls, no padded buffer
    assert choice(torch.tensor([[3, 5], [5, 0]])) == "loop"  # batch 2 on three experts
    skewed = torch.stack([torch.zeros(150, dtype=torch.long), torch.ones(150, dtype=torch.long)], 1)
    assert choice(skewed) == "grouped_mm"  # 300 pairs on 2 experts: the buffer would be 4× the pairs
    assert choice(torch.rand(4096, 8, generator=g).topk(2, -1).indices) == "loop"
    assert strategy(dispatch(skewed, 8), torch.zeros(300, 10), torch.zeros(8, 6, 10)) == "padded"  # odd widths


def test_silu_activation_path():
    inputs = make_inputs(n=9, k=2, e=4, d=16, inter=8, dtype=torch.float64, seed=6)

    def swiglu(g, u):
        return F.silu(g) * u

    torch.testing.assert_close(grouped_experts(*inputs, swiglu), naive_experts(*inputs, swiglu), rtol=1e-12, atol=1e-12)
