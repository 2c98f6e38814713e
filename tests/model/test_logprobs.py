"""Chunked selected log-probabilities: values and gradients against the full-logits reference
(float64, odd sizes, with and without entropy), gradcheck, bf16, and that no [N, V] tensor is
kept for backward."""

import pytest
import torch

from k3rl.model.logprobs import naive_selected_logprobs, selected_logprobs


def _data(n, v, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_(True)
    weight = torch.randn(v, d, generator=g, dtype=dtype).mul(0.5).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("n,v,d", [(1, 11, 4), (37, 50, 16), (64, 129, 8)])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunk(n, v, d, chunk_size, with_entropy):
    hidden, weight, targets = _data(n, v, d)
    g = torch.Generator().manual_seed(1)
    g_lp = torch.randn(n, generator=g, dtype=torch.float64)
    g_ent = torch.randn(n, generator=g, dtype=torch.float64)

    ref_lp, ref_ent = naive_selected_logprobs(hidden, weight, targets, scale=0.7)
    ref_obj = (ref_lp * g_lp).sum() + ((ref_ent * g_ent).sum() if with_entropy else 0)
    ref_gh, ref_gw = torch.autograd.grad(ref_obj, (hidden, weight))

    out = selected_logprobs(hidden, weight, targets, chunk_size=chunk_size, scale=0.7, return_entropy=with_entropy)
    lp, ent = out if with_entropy else (out, None)
    obj = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0)
    gh, gw = torch.autograd.grad(obj, (hidden, weight))

    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    hidden, weight, targets = _data(5, 7, 3)
    torch.autograd.gradcheck(lambda h, w: selected_logprobs(h, w, targets, chunk_size=2, scale=1.3,
                                                            return_entropy=True), (hidden, weight))


def test_bf16_matches_fp32_reference():
    hidden, weight, targets = _data(33, 300, 32, dtype=torch.float32)
    ref, _ = naive_selected_logprobs(hidden, weight, targets)
    lp = selected_logprobs(hidden.bfloat16(), weight.bfloat16(), targets, chunk_size=8)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref, rtol=0.05, atol=0.1)


def test_no_full_logits_saved_for_backward():
    n, v, d = 64, 100, 8
    hidden, weight, targets = _data(n, v, d)

    def largest_saved(fn):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn().sum().backward()
        return max(sizes)

    # the reference keeps [N, V] logits (this is what the chunked path avoids)
    assert largest_saved(lambda: naive_selected_logprobs(hidden, weight, targets)[0]) >= n * v
    assert largest_saved(lambda: selected_logprobs(hidden, weight, targets, chunk_size=16)) <= v * d


def test_bad_shapes():
    hidden, weight, targets = _data(4, 5, 3)
    with pytest.raises(ValueError, match="targets"):
        selected_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="chunk_size"):
        selected_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="weight"):
        selected_logprobs(hidden, weight.T, targets)
