"""The chunked KDA backward in Triton (kernels/kda/chunk_bwd.py `chunk_bwd`, `gate_bwd`) under the interpreter.

Ground truth: torch.autograd through the per-token recurrence `naive_recurrent_kda` in float64 (per sequence for
packed batches). The backward's inputs are what the Triton forward hands it: q/k already normalised and scaled
(so scale = 1 everywhere here), and the fp32 intermediates of the contract, made by `naive_chunk_kda` in float64
and cast to fp32. The kernels run on fp32 CPU tensors (the interpreter gets bf16 `tl.dot` wrong, see
kernels/kda/chunk_bwd_inter.py), and every gradient is compared by relative error ‖x − ref‖ / ‖ref‖:
* TOL = 1e-5 for ordinary gates (both forms, Γ within ~150 nats): fp32 rounding of the inputs and of the
  intermediates, accumulated over 64-token chunks, measures 1e-7 to 1.4e-6;
* TOL_DEEP = 1e-4 for the two extreme gates, for two fp32 effects a float64 rerun of the same formulas shows:
  −30-nat decays (Γ ≈ −1000 over a chunk): Γ is an fp32 intermediate and fp32's spacing at |Γ| = 1000 is 6e-5
  nats, a relative error of every decay e^{Γ_t − Γ_j} (measured 1e-5; the per-token recurrence in fp32 has
  1e-7 because it never forms Γ); decays at the bound −5 (Γ = −5t is exact): ‖dg‖ is ~1e-3 of ‖dq‖ and dg
  is a reverse cumsum of terms that cancel (measured 2.5e-5; the PyTorch chunk_kda_torch has 1.7e-5 there).
The fixture in tests/kernels/conftest.py NaN-poisons fresh memory, so an element a kernel does not write fails.
"""

from __future__ import annotations

import pytest
import torch

import k3rl.kernels.kda.chunk_bwd_inter as inter_module
import k3rl.kernels.kda.chunk_bwd_intra as intra_module
from k3rl.kernels.kda.chunk_bwd import chunk_bwd, gate_bwd
from k3rl.kernels.kda.gate import kda_gate
from k3rl.kernels.kda.naive import ChunkIntermediates, naive_chunk_kda, naive_recurrent_kda
from k3rl.kernels.kda.utils import l2norm

pytestmark = pytest.mark.triton

F64 = torch.float64
TOL = 1e-5
TOL_DEEP = 1e-4
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one torch thread is faster, and steadier on the shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def diag_paths(monkeypatch):
    """Records which diagonal-tile path every launch of the stage-4 kernel took: "matmul" (SAFE_GATE, the
    lower-bound gate's midpoint form) or "pairs" (the exact token-pair form)."""
    kernel = intra_module.chunk_bwd_intra_kernel
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append("matmul" if kwargs["SAFE_GATE"] else "pairs")
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(intra_module, "chunk_bwd_intra_kernel", Recorder())
    return seen


def make_inputs(B, T, H, K, V, gate, seed):
    """float64 q, k, v, g, beta; q/k normalised and q scaled as the autograd wrapper hands them over.

    softplus: kda_gate's unbounded form, ≈ −0.7 nats per token (Γ over a chunk ≈ −45).
    bounded: lower bound −5, decays spread over (−5, 0).
    at_bound: every g = −5 (Γ ≈ −320 over a chunk, ±40 nats around each tile's midpoint, §5.7).
    mixed: the issue's tile: each channel of each token decays by −30 or −0.01 nats at random.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    q, k, v = l2norm(randn(B, T, H, K), K**-0.5), l2norm(randn(B, T, H, K)), randn(B, T, H, V)
    beta = torch.sigmoid(randn(B, T, H))
    f, A_log, dt_bias = randn(B, T, H * K), randn(H) * 0.5, randn(H * K)
    if gate == "softplus":
        g = kda_gate(f, A_log, dt_bias)
    elif gate == "bounded":
        g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    elif gate == "at_bound":
        g = torch.full((B, T, H, K), -5.0, dtype=F64)
    elif gate == "mixed":
        strong = torch.rand(B, T, H, K, generator=gen) < 0.5
        g = torch.where(strong, torch.tensor(-30.0, dtype=F64), torch.tensor(-0.01, dtype=F64))
    else:
        raise ValueError(gate)
    return q, k, v, g, beta


def reference_grads(q, k, v, g, beta, h0, do, dht, cu_seqlens):
    """Gradients of Σ o·do + Σ h_T·dht by autograd through the float64 per-token recurrence."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    h0_leaf = None if h0 is None else h0.clone().requires_grad_()
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    loss = 0.0
    for s in range(len(bounds) - 1):
        span = slice(bounds[s], bounds[s + 1])
        rows = slice(None) if cu_seqlens is None else slice(s, s + 1)
        init = None if h0_leaf is None else h0_leaf[rows]
        o, ht = naive_recurrent_kda(*(x[:, span] for x in leaves), scale=1.0, initial_state=init,
                                    output_final_state=True)
        loss = loss + (o * do[:, span]).sum() + (0.0 if dht is None else (ht * dht[rows]).sum())
    grads = torch.autograd.grad(loss, leaves + ([h0_leaf] if h0 is not None else []))
    return list(grads) + ([None] if h0 is None else [])


def exact_intermediates(q, k, v, g, beta, h0):
    """The contract's intermediates in float64 with every pair decay formed as e^{min(Γ_t − Γ_j, 0)}, masked to
    j ≤ t: `naive_chunk_kda` forms e^{Γ_t − Γ_j} for j > t too, which overflows float64 (then inf·0 = NaN) once
    a chunk decays by more than ~700 nats, as the mixed −30/−0.01 gate does. One batch row, no cu_seqlens."""
    C = 64
    _, T, H, K = q.shape
    V = v.shape[-1]
    NT = -(-T // C)
    gk, Aqk, Ainv = torch.zeros_like(g), q.new_zeros(1, T, H, C), q.new_zeros(1, T, H, C)
    w, u, v_new, hs = torch.zeros_like(q), torch.zeros_like(v), torch.zeros_like(v), q.new_zeros(1, NT, H, K, V)
    S = q.new_zeros(H, K, V) if h0 is None else h0[0].clone()  # [H, K, V]
    for c in range(NT):
        span = slice(c * C, min(T, c * C + C))
        n = span.stop - span.start
        qc, kc, vc, bc = (x[0, span].transpose(0, 1) for x in (q, k, v, beta))  # [H, n, ·]
        G = g[0, span].transpose(0, 1).cumsum(1)  # [H, n, K]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        pair = (G.unsqueeze(2) - G.unsqueeze(1)).clamp_max(0.0).exp() * causal.unsqueeze(-1)  # [H, n, n, K]
        aqk = torch.einsum("htc,hjc,htjc->htj", qc, kc, pair)
        akk = torch.einsum("htc,hjc,htjc->htj", kc, kc, pair) * causal.tril(-1)
        ainv = torch.linalg.inv(torch.eye(n, dtype=F64) + bc.unsqueeze(-1) * akk)  # [H, n, n]
        wc, uc = ainv @ (bc.unsqueeze(-1) * kc * G.exp()), ainv @ (bc.unsqueeze(-1) * vc)
        hs[0, c] = S
        vn = uc - wc @ S
        S = S * G[:, -1].exp().unsqueeze(-1) + (kc * (G[:, -1:] - G).exp()).transpose(1, 2) @ vn
        gk[0, span], Aqk[0, span, :, :n], Ainv[0, span, :, :n] = (
            G.transpose(0, 1), aqk.transpose(0, 1), ainv.transpose(0, 1))
        w[0, span], u[0, span], v_new[0, span] = wc.transpose(0, 1), uc.transpose(0, 1), vn.transpose(0, 1)
    return ChunkIntermediates(gk, Aqk, Ainv, w, u, hs, v_new)


def check_bwd(B, T, H, K, V, gate, *, with_h0, with_dht, safe_gate, cu_seqlens=None, seed=0, tol=TOL,
              exact_inter=False, dtype=torch.float32):
    """chunk_bwd on `dtype` inputs (fp32 intermediates) against the float64 autograd reference at the same,
    rounded, inputs; returns the relative error of each gradient."""
    gen = torch.Generator().manual_seed(seed + 1)

    def rounded(x):
        return x.to(dtype).to(F64)

    q, k, v, g, beta = (rounded(x) for x in make_inputs(B, T, H, K, V, gate, seed))
    n_states = B if cu_seqlens is None else cu_seqlens.numel() - 1
    h0 = torch.randn(n_states, H, K, V, generator=gen, dtype=F64) if with_h0 else None
    do = rounded(torch.randn(B, T, H, V, generator=gen, dtype=F64))
    dht = torch.randn(n_states, H, K, V, generator=gen, dtype=F64) if with_dht else None
    ref = reference_grads(q, k, v, g, beta, h0, do, dht, cu_seqlens)
    if exact_inter:
        inter = exact_intermediates(q, k, v, g, beta, h0)
    else:
        _, _, inter = naive_chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=h0, cu_seqlens=cu_seqlens)
    inter32 = ChunkIntermediates(*(x.float() for x in vars(inter).values()))
    inputs = [x.to(dtype) for x in (q, k, v, beta, do)]
    states = [None if x is None else x.float() for x in (dht, h0)]
    out = chunk_bwd(*inputs[:4], inter32, inputs[4], states[0], initial_state=states[1], cu_seqlens=cu_seqlens,
                    safe_gate=safe_gate)
    errors = {}
    for name, x, r in zip(NAMES, out, ref):
        if r is None:
            assert x is None, name
            continue
        assert x.shape == r.shape and x.dtype == (torch.float32 if name in ("dg", "dh0") else dtype), name
        assert torch.isfinite(x).all(), f"{name} is not finite"
        errors[name] = ((x.double() - r).norm() / r.norm()).item()
        assert errors[name] < tol, f"{name}: relative error {errors[name]:.2e} ≥ {tol:.0e}"
    return errors


@pytest.mark.parametrize(
    "B, T, H, K, V, gate, with_h0, with_dht, safe_gate",
    [
        (2, 20, 1, 16, 16, "softplus", True, True, False),  # B > 1, one partial chunk
        (1, 64, 2, 16, 16, "softplus", False, False, False),  # exactly one chunk, no states
        (1, 100, 1, 32, 48, "bounded", True, False, True),  # K, V not powers of two
        (1, 130, 2, 32, 48, "bounded", True, True, True),  # three chunks, the last of 2 tokens
        (1, 130, 1, 16, 16, "softplus", False, True, False),
    ],
)
def test_chunk_bwd(B, T, H, K, V, gate, with_h0, with_dht, safe_gate, diag_paths):
    check_bwd(B, T, H, K, V, gate, with_h0=with_h0, with_dht=with_dht, safe_gate=safe_gate)
    assert diag_paths == ["matmul" if safe_gate else "pairs"]


@pytest.mark.parametrize("safe_gate", [True, False])
def test_chunk_bwd_varlen(safe_gate, diag_paths):
    """Packed sequences of 5, 0, 70 and 33 tokens (chunks restart at each start; partial last chunks; the empty one
    passes dht through to dh0), each with its own initial state and final-state gradient."""
    cu_seqlens = torch.tensor([0, 5, 5, 75, 108])
    check_bwd(1, 108, 2, 32, 48, "bounded", with_h0=True, with_dht=True, safe_gate=safe_gate,
              cu_seqlens=cu_seqlens)
    assert diag_paths == ["matmul" if safe_gate else "pairs"]


def test_chunk_bwd_strong_and_weak_decays_in_one_tile():
    """The issue's case: unbounded gate, every 16-token tile mixes −30-nat and −0.01-nat decays. The token-pair
    path never forms e^{positive}; dg is finite and right (the PyTorch chunk_kda_torch backward returns NaN here)."""
    check_bwd(1, 100, 1, 16, 16, "mixed", with_h0=True, with_dht=True, safe_gate=False, tol=TOL_DEEP,
              exact_inter=True)


def test_chunk_bwd_decays_at_the_bound_fast_path():
    """g = −5 everywhere: the matmul path's midpoint factors reach e^{±40} and Γ reaches −320 over a chunk."""
    check_bwd(1, 130, 1, 16, 16, "at_bound", with_h0=True, with_dht=True, safe_gate=True, tol=TOL_DEEP)


def test_chunk_bwd_bf16():
    """bf16 q, k, v, β, dO (fp32 intermediates and states): computed in fp32, dq, dk, dv, dβ returned in bf16, so
    their relative error is bf16's rounding (unit roundoff 2^-8 = 3.9e-3; measured 2-3.5e-3); dg and dh0 stay
    fp32 and keep TOL."""
    errors = check_bwd(1, 70, 1, 16, 16, "bounded", with_h0=True, with_dht=True, safe_gate=True, tol=1e-2,
                       dtype=torch.bfloat16)
    assert errors["dg"] < TOL and errors["dh0"] < TOL


def test_chunk_bwd_tiled(monkeypatch):
    """16-wide V-blocks in every stage and 16-wide K-blocks in stage 3: V = 48 in three tiles, K = 32 in two."""
    monkeypatch.setattr(inter_module, "BV_MAX", 16)
    monkeypatch.setattr(inter_module, "BV_STATE_MAX", 16)
    monkeypatch.setattr(intra_module, "BV_WY_MAX", 16)
    monkeypatch.setattr(intra_module, "BK_WY_MAX", 16)
    check_bwd(1, 70, 1, 32, 48, "bounded", with_h0=True, with_dht=True, safe_gate=True)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("flat_f, with_bias", [(True, True), (False, False)])
def test_gate_bwd(lower_bound, flat_f, with_bias):
    """gate_bwd against autograd through kda_gate in float64: fp32 inputs (TOL) and float64 inputs (1e-12). z
    spans the softplus threshold (20) and deep negatives, where softplus ≈ e^z."""
    B, T, H, K = 2, 37, 3, 24
    gen = torch.Generator().manual_seed(7)
    f = torch.randn(B, T, H * K, generator=gen, dtype=F64) * 12.0
    A_log = torch.randn(H, generator=gen, dtype=F64) * 0.5
    dt_bias = torch.randn(H * K, generator=gen, dtype=F64) if with_bias else None
    dg = torch.randn(B, T, H, K, generator=gen, dtype=F64)
    if not flat_f:
        f = f.view(B, T, H, K)
    leaves = [x.clone().requires_grad_() for x in (f, A_log) + ((dt_bias,) if with_bias else ())]
    g = kda_gate(leaves[0], leaves[1], leaves[2] if with_bias else None, lower_bound)
    ref = torch.autograd.grad((g * dg).sum(), leaves)
    for dtype, tol in ((torch.float32, TOL), (F64, 1e-12)):
        cast = [None if x is None else x.to(dtype) for x in (f, A_log, dt_bias)]
        df, dA_log, ddt = gate_bwd(*cast, lower_bound, dg.to(dtype))
        assert df.shape == f.shape and df.dtype == dtype and dA_log.dtype == dtype
        got = [df, dA_log] + ([ddt] if with_bias else [])
        if not with_bias:
            assert ddt is None
        for name, x, r in zip(("df", "dA_log", "ddt_bias"), got, ref):
            err = ((x.double() - r).norm() / r.norm()).item()
            assert err < tol, f"{dtype} {name}: relative error {err:.2e} ≥ {tol:.0e}"
