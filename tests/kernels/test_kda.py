"""KDA ops (kernels/kda) against the per-token float64 reference `naive_recurrent_kda` (docs/model_spec.md §5.3).

Outputs, final states and the gradients w.r.t. q, k, v, g, beta and the initial state are compared by
relative error, over odd lengths (T not a multiple of 64 or 16, T < 16), both gate forms of §5.2 made by
`kda_gate` from random inputs, strong decays (near the lower bound, and unbounded ones large enough to
send `chunk_kda_torch` down its pairwise diagonal-tile path), packed variable-length sequences, a prefill that
hands its state to token-by-token decode, bf16 inputs, and NaN-poisoned fresh memory.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import k3rl.kernels.kda.chunk as chunk_module
from k3rl.kernels.kda import kda_gate, naive_recurrent_kda
from k3rl.kernels.kda.chunk import chunk_kda_torch
from k3rl.kernels.kda.recurrent import fused_recurrent_kda_torch

F64 = torch.float64
LENGTHS = [1, 7, 16, 63, 64, 65, 130, 257]
GATES = ["softplus", "bounded", "bounded_strong", "softplus_strong"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: one thread is faster, and immune to other processes on the 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_err(x: torch.Tensor, ref: torch.Tensor, atol: float = 1e-13) -> float:
    """‖x − ref‖ / ‖ref‖ in float64; 0 when every element is within `atol` (a reference that is exactly zero,
    e.g. dg at t = 0 from a zero state, against round-off of 1e-17, is a match)."""
    x, ref = x.double(), ref.double()
    if x.numel() == 0 or (x - ref).abs().max().item() <= atol:
        return 0.0
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def make_inputs(B, T, H, K, V, gate, seed, l2_in_kernel=False):
    """Random float64 KDA inputs; g comes from `kda_gate` on random f so the decays look like a real layer's.

    bounded_strong: lb = -5 with σ ≈ 1, every token decays by ≈ e^-5 (the bound, §5.7: ≈ 40 nats per half tile).
    softplus_strong: exp(A_log) = 30 and large z, ≈ 100+ nats per token, so the 16-token tiles exceed
    SAFE_SPAN even in float64 and take the exact pairwise path.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    if not l2_in_kernel:
        # the recurrence is contractive only for ‖k‖ ≤ 1 (β < 1); the layer normalises in the kernel
        k = F.normalize(k, dim=-1)
    beta = torch.sigmoid(randn(B, T, H))
    f, A_log, dt_bias = randn(B, T, H * K), randn(H) * 0.5, randn(H * K)
    if gate == "softplus":
        g = kda_gate(f, A_log, dt_bias)
    elif gate == "bounded":
        g = kda_gate(f, A_log, dt_bias, lower_bound=-3.0)
    elif gate == "bounded_strong":
        g = kda_gate(f.abs() + 6.0, A_log.abs() + 1.0, dt_bias.abs(), lower_bound=-5.0)
    elif gate == "softplus_strong":
        g = kda_gate(f.abs() + 3.0, torch.full((H,), math.log(30.0), dtype=F64), dt_bias.abs())
    else:
        raise ValueError(gate)
    return q, k, v, g.to(F64), beta


def run_with_grads(fn, inputs, h0, seed, **kwargs):
    """Output, final state and the grads of a random linear loss of both, w.r.t. every input and h0."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    h0 = None if h0 is None else h0.detach().clone().requires_grad_()
    o, state = fn(*leaves, initial_state=h0, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(o.shape, generator=gen, dtype=F64)
    dstate = torch.randn(state.shape, generator=gen, dtype=F64)
    ((o.double() * do).sum() + (state.double() * dstate).sum()).backward()
    grads = [x.grad for x in leaves] + ([] if h0 is None else [h0.grad])
    return o.detach(), state.detach(), grads


def assert_matches_naive(fn, B, T, H, K, V, gate, with_h0, seed, tol=1e-10, **kwargs):
    inputs = make_inputs(B, T, H, K, V, gate, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=F64) if with_h0 else None
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, inputs, h0, seed, **kwargs)
    o, s, grads = run_with_grads(fn, inputs, h0, seed, **kwargs)
    assert o.shape == (B, T, H, V) and o.dtype == F64
    assert s.shape == (B, H, K, V) and s.dtype == F64
    assert rel_err(o, o_ref) < tol, f"output rel err {rel_err(o, o_ref):.2e}"
    assert rel_err(s, s_ref) < tol, f"final state rel err {rel_err(s, s_ref):.2e}"
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for name, grad, ref in zip(names, grads, g_ref):
        assert grad is not None and torch.isfinite(grad).all(), name
        assert rel_err(grad, ref) < tol, f"{name} rel err {rel_err(grad, ref):.2e}"


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T", LENGTHS)
def test_chunk(T, gate, with_h0):
    assert_matches_naive(chunk_kda_torch, 2, T, 3, 16, 32, gate, with_h0, seed=1000 + T)


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T", [1, 7, 64, 130])
def test_recurrent(T, gate, with_h0):
    assert_matches_naive(fused_recurrent_kda_torch, 2, T, 3, 16, 32, gate, with_h0, seed=2000 + T)


@pytest.mark.parametrize("B, H, K, V", [(1, 1, 32, 16), (2, 2, 16, 16), (1, 2, 64, 48)])
@pytest.mark.parametrize("T", [33, 129])
def test_chunk_head_dims(B, H, K, V, T):
    assert_matches_naive(chunk_kda_torch, B, T, H, K, V, "bounded", True, seed=3000 + K + V + T)
    assert_matches_naive(fused_recurrent_kda_torch, B, T, H, K, V, "softplus", True, seed=3100 + K + V + T)


@pytest.mark.parametrize("fn", [chunk_kda_torch, fused_recurrent_kda_torch])
def test_l2norm_in_kernel_and_scale(fn):
    """use_qk_l2norm_in_kernel = the spec's q/sqrt(Σq² + 1e-6) (same for k) before the scale (§5.1)."""
    q, k, v, g, beta = make_inputs(2, 70, 2, 16, 16, "bounded", seed=7, l2_in_kernel=True)
    h0 = torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(8), dtype=F64)
    assert_matches_naive(fn, 2, 70, 2, 16, 16, "bounded", True, seed=9, use_qk_l2norm_in_kernel=True, scale=0.3)
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    o_ref, s_ref = naive_recurrent_kda(qn, kn, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) < 1e-12 and rel_err(s, s_ref) < 1e-12


def test_naive_matches_spec_formula():
    """The reference itself against §5.3 written out: S_t = (I − β k kᵀ) D S_{t−1} + β k vᵀ, o_t = S_tᵀ q K^{-1/2}."""
    q, k, v, g, beta = make_inputs(1, 5, 1, 4, 3, "softplus", seed=11)
    o, s = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    S = torch.zeros(4, 3, dtype=F64)
    for t in range(5):
        kt, qt = k[0, t, 0], q[0, t, 0] * 4**-0.5
        S = (torch.eye(4, dtype=F64) - beta[0, t, 0] * torch.outer(kt, kt)) @ torch.diag(g[0, t, 0].exp()) @ S
        S = S + beta[0, t, 0] * torch.outer(kt, v[0, t, 0])
        torch.testing.assert_close(o[0, t, 0], S.T @ qt, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s[0, 0], S, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("segment_chunks", [1, 2])
def test_chunk_segments(segment_chunks, monkeypatch):
    """Long inputs run in segments carrying the state: force segments of 1 and 2 chunks."""
    B, H = 2, 3
    monkeypatch.setattr(chunk_module, "SEGMENT_TOKENS", segment_chunks * chunk_module.CHUNK_SIZE * B * H)
    assert_matches_naive(chunk_kda_torch, B, 257, H, 16, 32, "bounded", True, seed=30 + segment_chunks)
    assert_matches_naive(chunk_kda_torch, B, 150, H, 16, 16, "softplus_strong", False, seed=40 + segment_chunks)


def test_chunk_pairwise_path_everywhere(monkeypatch):
    """SAFE_SPAN = 0 sends every diagonal tile through the exact pairwise path (the unbounded-gate fallback)."""
    monkeypatch.setitem(chunk_module.SAFE_SPAN, F64, 0.0)
    assert_matches_naive(chunk_kda_torch, 2, 100, 2, 16, 16, "softplus", True, seed=12)
    assert_matches_naive(chunk_kda_torch, 1, 40, 2, 16, 16, "bounded", False, seed=13)


@pytest.mark.parametrize("strong_half", ["first", "second"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_chunk_one_sided_tile_decay(strong_half, dtype):
    """Decay strong only before (or only after) each 16-token tile's midpoint: the span check must catch
    both signs of Γ_t − Γ_n, or the tile's factors overflow."""
    B, T, H, K, V = 1, 80, 2, 16, 16
    q, k, v, _, beta = make_inputs(B, T, H, K, V, "bounded", seed=31)
    pos = torch.arange(T) % 16
    strong = (pos >= 1) & (pos <= 8) if strong_half == "first" else pos >= 9
    g = torch.where(strong, -200.0, -0.01).to(F64).view(1, T, 1, 1).expand(B, T, H, K).contiguous()
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(32), dtype=F64)
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, (q, k, v, g, beta), h0, seed=33)
    leaves = [x.to(dtype) for x in (q, k, v, g, beta)]
    o, s, grads = run_with_grads(chunk_kda_torch, leaves, h0.to(dtype), seed=33)
    tol = 1e-10 if dtype == F64 else 1e-4
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol
    for grad, ref in zip(grads, g_ref):
        assert torch.isfinite(grad).all() and rel_err(grad, ref, atol=1e-6 if dtype != F64 else 1e-13) < tol


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_chunk_bounded_gate_needs_no_safe_path(dtype, monkeypatch):
    """§5.7: with the lower bound at its limit (-5, decays saturated) every diagonal tile is a plain matmul."""

    def refuse(*args, **kwargs):
        raise AssertionError("lower-bound gate took the safe path")

    monkeypatch.setattr(chunk_module, "_intra_chunk_safe", refuse)
    q, k, v, g, beta = make_inputs(1, 192, 2, 32, 32, "bounded_strong", seed=29)
    assert g.min() < -4.99
    o, _ = chunk_kda_torch(q.to(dtype), k.to(dtype), v.to(dtype), g.float(), beta.to(dtype))
    assert torch.isfinite(o).all()


def test_chunk_unsafe_tiles_are_taken():
    """softplus_strong really produces tiles beyond SAFE_SPAN (so test_chunk covers the pairwise path)."""
    _, _, _, g, _ = make_inputs(1, 64, 1, 16, 16, "softplus_strong", seed=14)
    half_tile = g[0, 1:9, 0].sum(0).abs().max().item()
    assert half_tile > chunk_module.SAFE_SPAN[F64]


def varlen_reference(inputs, cu, h0, **kwargs):
    outs, states = [], []
    for i in range(len(cu) - 1):
        seg = [x[:, cu[i] : cu[i + 1]] for x in inputs]
        o, s = naive_recurrent_kda(*seg, initial_state=h0[i : i + 1], output_final_state=True, **kwargs)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, dim=1), torch.cat(states, dim=0)


@pytest.mark.parametrize("fn", [chunk_kda_torch, fused_recurrent_kda_torch])
@pytest.mark.parametrize("gate, l2", [("bounded", False), ("softplus_strong", False), ("softplus", True)])
def test_chunk_varlen(fn, gate, l2):
    """Packed sequences (cu_seqlens) equal separate runs, with per-sequence initial and final states
    (and, with the in-kernel L2 norm, finite gradients through the zero-padded tokens)."""
    cu = [0, 5, 5, 69, 70, 200, 216]  # lengths 5, 0, 64, 1, 130, 16
    H, K, V = 2, 16, 32
    kw = dict(use_qk_l2norm_in_kernel=l2)
    inputs = make_inputs(1, cu[-1], H, K, V, gate, seed=15, l2_in_kernel=l2)
    gen = torch.Generator().manual_seed(16)
    h0 = torch.randn(len(cu) - 1, H, K, V, generator=gen, dtype=F64)
    cu_t = torch.tensor(cu, dtype=torch.int64)
    o_ref, s_ref = varlen_reference(inputs, cu, h0, **kw)
    o, s = fn(*inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu_t, **kw)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert rel_err(o, o_ref) < 1e-10 and rel_err(s, s_ref) < 1e-10
    # gradients: packed vs the per-sequence reference
    leaves = [x.clone().requires_grad_() for x in inputs]
    h0_l = h0.clone().requires_grad_()
    o, s = fn(*leaves, initial_state=h0_l, output_final_state=True, cu_seqlens=cu_t, **kw)
    (o.sum() + (s * s).sum()).backward()
    ref_leaves = [x.clone().requires_grad_() for x in inputs]
    ref_h0 = h0.clone().requires_grad_()
    o_ref, s_ref = varlen_reference(ref_leaves, cu, ref_h0, **kw)
    (o_ref.sum() + (s_ref * s_ref).sum()).backward()
    for x, ref in zip(leaves + [h0_l], ref_leaves + [ref_h0]):
        assert torch.isfinite(x.grad).all() and rel_err(x.grad, ref.grad) < 1e-10


@pytest.mark.parametrize("split", [1, 15, 64, 100])
def test_prefill_then_decode(split):
    """Chunked prefill of the first `split` tokens, then one fused_recurrent step per token carrying the
    state (§5.6), equals one naive pass; chunked prefill in two segments equals one chunked pass."""
    B, T, H, K, V = 2, 140, 2, 16, 16
    q, k, v, g, beta = make_inputs(B, T, H, K, V, "bounded", seed=17 + split)
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(18), dtype=F64)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    def seg(a, b):
        return [x[:, a:b] for x in (q, k, v, g, beta)]

    o_pre, state = chunk_kda_torch(*seg(0, split), initial_state=h0, output_final_state=True)
    outs = [o_pre]
    for t in range(split, T):
        o_t, state = fused_recurrent_kda_torch(*seg(t, t + 1), initial_state=state, output_final_state=True)
        outs.append(o_t)
    assert rel_err(torch.cat(outs, dim=1), o_ref) < 1e-10 and rel_err(state, s_ref) < 1e-10

    o1, s1 = chunk_kda_torch(*seg(0, split), initial_state=h0, output_final_state=True)
    o2, s2 = chunk_kda_torch(*seg(split, T), initial_state=s1, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], dim=1), o_ref) < 1e-10 and rel_err(s2, s_ref) < 1e-10


@pytest.mark.parametrize("fn", [chunk_kda_torch, fused_recurrent_kda_torch])
@pytest.mark.parametrize("gate", ["bounded_strong", "softplus"])
def test_bf16(fn, gate):
    """bf16 inputs: finite, bf16 output, fp32 state, close to float64 on the same (rounded) inputs."""
    q, k, v, g, beta = make_inputs(2, 150, 2, 32, 32, gate, seed=19)
    h0 = torch.randn(2, 2, 32, 32, generator=torch.Generator().manual_seed(20), dtype=F64)
    low = [x.to(torch.bfloat16) for x in (q, k, v, beta)]
    g32 = g.float()
    o, s = fn(low[0], low[1], low[2], g32, low[3], initial_state=h0.float(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    o_ref, s_ref = naive_recurrent_kda(*[x.double() for x in low[:3]], g32.double(), low[3].double(),
                                       initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) < 2e-2 and rel_err(s, s_ref) < 1e-3


@pytest.mark.parametrize("gate", GATES)
def test_chunk_fp32_strong_decays(gate):
    """float32 with decays at the bound and far beyond (pairwise path): accurate, finite gradients."""
    inputs = make_inputs(1, 200, 2, 32, 32, gate, seed=21)
    h0 = torch.randn(1, 2, 32, 32, generator=torch.Generator().manual_seed(22), dtype=F64)
    o_ref, s_ref = naive_recurrent_kda(*inputs, initial_state=h0, output_final_state=True)
    leaves = [x.float().requires_grad_() for x in inputs]
    o, s = chunk_kda_torch(*leaves, initial_state=h0.float(), output_final_state=True)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4
    (o.sum() + s.sum()).backward()
    for x in leaves:
        assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("T", [1, 17, 64, 100])
def test_nan_poison(T):
    """With fresh memory poisoned (tests/kernels/conftest.py), finite inputs give finite outputs equal to the reference: every
    internal buffer (padding included) is written before it is read."""
    for gate in ("bounded", "softplus_strong"):
        inputs = make_inputs(2, T, 2, 16, 16, gate, seed=23 + T)
        h0 = torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(24), dtype=F64)
        o_ref, s_ref = naive_recurrent_kda(*inputs, initial_state=h0, output_final_state=True)
        for fn in (chunk_kda_torch, fused_recurrent_kda_torch):
            for x in [inputs, [t.float() for t in inputs]]:
                o, s = fn(*x, initial_state=h0.to(x[0].dtype), output_final_state=True)
                assert torch.isfinite(o).all() and torch.isfinite(s).all()
                assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4
            o, _ = fn(*inputs)
            assert torch.isfinite(o).all()


def test_empty_sequence():
    q, k, v, g, beta = make_inputs(1, 0, 2, 8, 8, "bounded", seed=25)
    h0 = torch.randn(1, 2, 8, 8, dtype=F64)
    for fn in (chunk_kda_torch, fused_recurrent_kda_torch, naive_recurrent_kda):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert o.shape == (1, 0, 2, 8) and torch.equal(s, h0)


def test_bad_shapes_raise():
    q, k, v, g, beta = make_inputs(1, 10, 2, 8, 8, "bounded", seed=26)
    for fn in (chunk_kda_torch, fused_recurrent_kda_torch, naive_recurrent_kda):
        with pytest.raises(ValueError, match="beta"):
            fn(q, k, v, g, beta[..., :1])
        with pytest.raises(ValueError, match="initial_state"):
            fn(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 8, 4, dtype=F64))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda_torch(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]))


def test_gate_formulas():
    gen = torch.Generator().manual_seed(27)
    B, T, H, K = 2, 5, 3, 4
    f = torch.randn(B, T, H * K, generator=gen, dtype=F64) * 4
    A_log = torch.randn(H, generator=gen, dtype=F64)
    dt_bias = torch.randn(H * K, generator=gen, dtype=F64)
    z = f.view(B, T, H, K) + dt_bias.view(H, K)
    a = A_log.exp().view(H, 1)
    g = kda_gate(f, A_log, dt_bias)
    assert g.shape == (B, T, H, K) and g.dtype == torch.float64  # float64 in, float64 gate (exactness tests)
    torch.testing.assert_close(g, -a * torch.log1p(torch.exp(z)), rtol=1e-12, atol=1e-12)
    gb = kda_gate(f.view(B, T, H, K), A_log, dt_bias, lower_bound=-2.5)
    torch.testing.assert_close(gb, -2.5 * torch.sigmoid(a * z), rtol=1e-12, atol=1e-12)
    g32 = kda_gate(f.float(), A_log.float(), dt_bias.float())
    assert g32.dtype == torch.float32
    torch.testing.assert_close(g32.double(), g, rtol=1e-5, atol=1e-6)
    assert (gb >= -2.5).all() and (gb <= 0).all() and (g <= 0).all()
    # softplus threshold 20: identity above it
    big = kda_gate(torch.full((1, 1, 1, 2), 30.0), torch.zeros(1), None)
    assert torch.equal(big, torch.full((1, 1, 1, 2), -30.0))
    # at least float32: from bf16 inputs too
    assert kda_gate(f.bfloat16(), A_log, dt_bias, lower_bound=-5.0).dtype == torch.float32


@pytest.mark.parametrize("lb", [-5.5, 0.0, 0.5])
def test_gate_lower_bound_range(lb):
    with pytest.raises(ValueError, match="gate_lower_bound"):
        kda_gate(torch.zeros(1, 1, 4), torch.zeros(1), torch.zeros(4), lower_bound=lb)


def test_chunk_varlen_all_empty():
    q, k, v, g, beta = make_inputs(1, 0, 2, 8, 8, "bounded", seed=28)
    h0 = torch.randn(3, 2, 8, 8, dtype=F64)
    for fn in (chunk_kda_torch, fused_recurrent_kda_torch):
        cu = torch.zeros(4, dtype=torch.long)
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        assert o.shape == (1, 0, 2, 8) and torch.equal(s, h0)


@pytest.mark.parametrize("gate", ["softplus", "bounded_strong"])
def test_naive_chunk_matches_recurrence(gate):
    """The chunk-by-chunk reference (the Triton stages' ground truth) = the per-token recurrence in float64,
    for batch rows and for packed sequences (lengths 5, 70, 33: chunks restart at every sequence start)."""
    from k3rl.kernels.kda.naive import naive_chunk_kda

    q, k, v, g, beta = make_inputs(2, 130, 2, 16, 8, gate, seed=50)
    h0 = torch.randn(2, 2, 16, 8, generator=torch.Generator().manual_seed(51), dtype=F64)
    o, s, inter = naive_chunk_kda(q, k, v, g, beta, initial_state=h0)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) < 1e-12 and rel_err(s, s_ref) < 1e-12
    assert inter.h.shape == (2, 3, 2, 16, 8) and torch.equal(inter.h[:, 0], h0)
    cu = torch.tensor([0, 5, 75, 108])
    h0n = torch.randn(3, 2, 16, 8, generator=torch.Generator().manual_seed(52), dtype=F64)
    packed = [x[:1, :108] for x in (q, k, v, g, beta)]
    o, s, inter = naive_chunk_kda(*packed, initial_state=h0n, cu_seqlens=cu)
    assert inter.h.shape == (1, 4, 2, 16, 8)
    for i in range(3):
        part = [x[:, cu[i]:cu[i + 1]] for x in packed]
        o_ref, s_ref = naive_recurrent_kda(*part, initial_state=h0n[i:i + 1], output_final_state=True)
        assert rel_err(o[:, cu[i]:cu[i + 1]], o_ref) < 1e-12 and rel_err(s[i], s_ref[0]) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_mixed_decays_in_one_tile(dtype):
    """Unbounded gate, fresh random tiles holding a few strongly decaying tokens (15 to 60 nats each, at random
    positions) among weak ones (≈ 0.01): the spans around the tile midpoints fall on both sides of SAFE_SPAN,
    so both the midpoint matmul (whose factors reach e^{±44..48}) and the pairwise path run. Every gradient is
    finite and matches the float64 recurrence (dg was NaN when k was divided by e^{x}: its gradient 1/e^{2x}
    overflowed fp32)."""
    B, T, H, K, V = 1, 96, 2, 16, 16
    gen = torch.Generator().manual_seed(71)
    q, k, v, _, beta = make_inputs(B, T, H, K, V, "softplus", seed=72)
    strong = torch.rand(B, T, H, K, generator=gen, dtype=F64) < 0.12
    size = 15.0 + 45.0 * torch.rand(B, T, H, K, generator=gen, dtype=F64)
    g = torch.where(strong, -size, -0.01 * torch.rand(B, T, H, K, generator=gen, dtype=F64))
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=F64)
    inputs = (q, k, v, g, beta)
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, inputs, h0, seed=73)
    o, s, grads = run_with_grads(chunk_kda_torch, [x.to(dtype) for x in inputs], h0.float(), seed=73)
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # fp32 compute; bf16 inputs are rounded (2^-8 relative)
    if dtype == torch.bfloat16:  # the reference sees the rounded inputs too
        o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, [x.to(dtype).double() for x in inputs], h0, seed=73)
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol
    for name, grad, ref in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads, g_ref):
        assert torch.isfinite(grad).all(), f"{name} not finite"
        assert rel_err(grad, ref, atol=1e-6) < tol, f"{name} rel err {rel_err(grad, ref):.2e}"


@pytest.mark.parametrize("strong", [45.0, 47.5])
def test_chunk_tile_span_just_below_safe_span(strong):
    """Two tokens of −strong/2 nats after each tile's midpoint: the tile's span (|Γ_t − Γ_n| up to `strong`) stays
    below SAFE_SPAN, so the fp32 call takes the midpoint matmul with factors up to e^{±strong}; dg stays finite."""
    B, T, H, K, V = 1, 64, 1, 16, 16
    q, k, v, _, beta = make_inputs(B, T, H, K, V, "softplus", seed=74)
    pos = torch.arange(T) % 16
    g = torch.where((pos == 9) | (pos == 10), -strong / 2, -0.01).to(F64).view(1, T, 1, 1).expand(B, T, H, K)
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, (q, k, v, g, beta), None, seed=75)
    o, s, grads = run_with_grads(chunk_kda_torch, [x.float() for x in (q, k, v, g, beta)], None, seed=75)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4
    for grad, ref in zip(grads, g_ref):
        assert torch.isfinite(grad).all() and rel_err(grad, ref, atol=1e-6) < 1e-4
