"""The Triton chunked KDA (kernels/kda/chunk_fwd*.py, chunk_triton.py `chunk_kda_triton`) against the float64
references of kernels/kda/naive.py: every forward stage against `naive_chunk_kda`'s `ChunkIntermediates`,
the whole op against the per-token recurrence `naive_recurrent_kda`, and forward + backward end to end
(ChunkKDAFunction recomputing w, u, h, v_new, then kernels/kda/chunk_bwd.py) against float64 autograd through
the recurrence: dq, dk, dv, dβ, dh0 and dg, or df, dA_log, ddt_bias for the gate fused in the kernel.

Runs under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py); fresh memory is NaN-poisoned
(tests/kernels/conftest.py), and numpy is set to raise on overflow / invalid / divide-by-zero, so an inf or
NaN formed in any lane of any kernel, masked or not, fails the test (underflow to 0 is allowed: e^{Γ} of
−320 nats is 0 in fp32 and that is the right answer).
Precision: kernels on fp32 inputs (fp32 accumulation, exact-fp32 dots in the interpreter) vs float64
references on the same values. Tolerance FP32_TOL = 1e-5 relative (‖x − ref‖/‖ref‖); observed 1e-7 to 1e-6:
sums of ≤ 64 products and a 64×64 triangular solve in fp32, unit round-off 6e-8. bf16 inputs: BF16_TOL =
3e-2 on o (q, k, v, β rounded to bf16 on the way in, o rounded on the way out: 2^-8 ≈ 4e-3 per element).
The −30/−0.01 mix gets MIXED_TOL = 1e-4: Γ is stored as an fp32 chunk-local cumsum (the contract's layout, as
fla's), and with 30-nat decays |Γ| reaches ~10³ nats inside a chunk, so Γ_t − Γ_j carries an absolute error
of ulp(|Γ|) ≈ 6e-5 (observed 1.4e-5 on the state; the PyTorch chunk_kda_torch, which keeps Γ per 16-token
sub-chunk, sees 3e-6; the per-token fp32 recurrence 1e-7).
Shapes are tiny (one program per chunk and head): T ∈ {1, 20, 64, 100, 130}, H ∈ {1, 2}, K = V = 16 and
K = 32 with V = 48 (not a power of two: masked lanes, and several V blocks: three of 16 in the state pass,
two of 32 in the output),
packed sequences of lengths 5, 70, 33.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import k3rl.kernels.kda.chunk_bwd as bwd_module
import k3rl.kernels.kda.chunk_fwd_intra as intra_module
from k3rl.kernels.kda.chunk_fwd import GateSpec, chunk_fwd
from k3rl.kernels.kda.chunk_triton import chunk_kda_triton
from k3rl.kernels.kda.gate import FusedGate, kda_gate
from k3rl.kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda

pytestmark = pytest.mark.triton

F64 = torch.float64
FP32_TOL = 1e-5
BF16_TOL = 3e-2
MIXED_TOL = 1e-4
STAGES = ("gk", "Aqk", "Ainv", "w", "u", "h", "v_new")


@pytest.fixture(autouse=True)
def strict_float():
    """One torch thread (tiny tensors), and numpy raising on any inf/NaN the interpreter forms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        yield
    torch.set_num_threads(threads)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (0 for empty tensors or an exact match)."""
    x, ref = x.double(), ref.double()
    if x.numel() == 0 or bool((x == ref).all()):
        return 0.0
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def make_inputs(B, T, H, K, V, gate, seed, dtype=torch.float32):
    """Kernel inputs and the float64 reference inputs of the same values, as dicts.

    gate: "g"          a plain log-decay tensor (softplus gate of random f, made in float64);
          "softplus"   FusedGate without bound (f std 3: log decays from ≈ −1e-4 to ≈ −10 nats);
          "bound"      FusedGate with lb = −3;
          "bound_sat"  FusedGate with lb = −5 and σ ≈ 1: every token decays by ≈ e^-5 (Γ reaches −320 per chunk);
          "mixed"      plain g: −30 nats on random (token, channel) pairs next to −0.01 inside every 16-token tile;
          "bound_near" FusedGate with lb = −5 and σ ∈ (0.95, 0.98): decays within 5% of the bound, where the
                       gate's gradients are not yet lost to σ's saturation (at "bound_sat" ∂g/∂z ≈ 1e-12 rounds
                       to 0 in fp32, for PyTorch's fp32 autograd as well);
          "mixed_gate" FusedGate without bound giving the same mix (e^{A_log} = 30, z = 0.55 or −8: g ≈ −30 or
                       −0.01), each with a gradient of f that is not lost to rounding.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=gen, dtype=F64) * std

    q, k, v = randn(B, T, H, K), F.normalize(randn(B, T, H, K), dim=-1), randn(B, T, H, V)
    beta = torch.sigmoid(randn(B, T, H))
    ref = dict(q=q, k=k, v=v, beta=beta)
    f, A_log, dt_bias, lb = randn(B, T, H * K, std=3.0), randn(H) * 0.5, randn(H * K), None
    if gate == "g":
        ref["g"] = kda_gate(f, A_log, dt_bias)
    elif gate == "mixed":
        strong = torch.rand(B, T, H, K, generator=gen) < 0.5
        ref["g"] = torch.where(strong, -30.0, -0.01).to(F64)
    elif gate == "bound_sat":
        f, A_log, dt_bias, lb = f.abs() + 6.0, A_log.abs() + 1.0, dt_bias.abs(), -5.0
    elif gate == "bound":
        lb = -3.0
    elif gate == "bound_near":
        f = 3.0 + torch.rand(B, T, H * K, generator=gen, dtype=F64)
        A_log, dt_bias, lb = A_log * 0, dt_bias * 0.1, -5.0
    elif gate == "mixed_gate":
        f = torch.where(torch.rand(B, T, H * K, generator=gen) < 0.5, 0.55, -8.0).to(F64)
        A_log, dt_bias = torch.full((H,), math.log(30.0), dtype=F64), None
    elif gate != "softplus":
        raise ValueError(gate)
    fused = "g" not in ref
    run = {name: x.to(dtype) for name, x in ref.items()}
    if fused:
        # the gate parameters stay fp32 (as the layer keeps them); f in the input dtype
        run["g"] = FusedGate(f.to(dtype), A_log.float(), None if dt_bias is None else dt_bias.float(), lb)
        ref["g"] = kda_gate(f.to(dtype).double(), A_log.float().double(),
                            None if dt_bias is None else dt_bias.float().double(), lb)
    else:
        run["g"] = ref["g"].float()
    for name in ("q", "k", "v", "beta"):
        ref[name] = run[name].double()
    return run, ref


def check_stages(run, ref, h0, cu_seqlens, tol=FP32_TOL):
    """chunk_fwd's intermediates, output and final state vs naive_chunk_kda (float64), q, k prepared alike."""
    K = run["q"].shape[-1]
    q = run["q"] * K**-0.5
    if isinstance(run["g"], FusedGate):
        fg = run["g"]
        g = fg.f.unflatten(-1, (fg.A_log.shape[0], K))
        gate = GateSpec(fg.A_log, fg.dt_bias, fg.lower_bound)
    else:
        g, gate = run["g"], None
    o, final, inter = chunk_fwd(q, run["k"], run["v"], g, run["beta"], initial_state=h0, output_final_state=True,
                                cu_seqlens=cu_seqlens, gate=gate)
    o_ref, final_ref, inter_ref = naive_chunk_kda(
        ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], initial_state=None if h0 is None else h0.double(),
        cu_seqlens=cu_seqlens,
    )
    for name in STAGES:
        x, x_ref = getattr(inter, name), getattr(inter_ref, name)
        assert x.shape == x_ref.shape and x.dtype == torch.float32, name
        assert torch.isfinite(x).all(), name
        assert rel_err(x, x_ref) < tol, f"{name} rel err {rel_err(x, x_ref):.2e}"
    assert rel_err(o, o_ref) < tol, f"o rel err {rel_err(o, o_ref):.2e}"
    assert rel_err(final, final_ref) < tol, f"final state rel err {rel_err(final, final_ref):.2e}"
    return o, final


@pytest.mark.parametrize(
    "T, H, K, V, gate, with_h0",
    [
        (1, 1, 16, 16, "softplus", True),
        (20, 2, 16, 16, "bound", False),
        (64, 1, 32, 48, "g", True),
        (100, 2, 32, 48, "bound", True),
        (130, 1, 16, 16, "softplus", False),
    ],
)
def test_chunk_fwd_stages(T, H, K, V, gate, with_h0):
    run, ref = make_inputs(1, T, H, K, V, gate, seed=100 + T)
    h0 = torch.randn(1, H, K, V, generator=torch.Generator().manual_seed(T)) if with_h0 else None
    check_stages(run, ref, h0, None)


@pytest.mark.parametrize("gate", ["bound", "softplus"])
def test_chunk_fwd_stages_varlen(gate):
    """Three packed sequences (5, 70, 33 tokens): chunks restart at each start, the last ones are partial."""
    run, ref = make_inputs(1, 108, 2, 32, 48, gate, seed=7)
    cu = torch.tensor([0, 5, 75, 108])
    h0 = torch.randn(3, 2, 32, 48, generator=torch.Generator().manual_seed(8))
    o, final = check_stages(run, ref, h0, cu)
    # and each sequence alone through the recurrence
    for s in range(3):
        sl = slice(int(cu[s]), int(cu[s + 1]))
        part = {n: ref[n][:, sl] for n in ("q", "k", "v", "g", "beta")}
        o_ref, s_ref = naive_recurrent_kda(**part, initial_state=h0[s : s + 1].double(), output_final_state=True)
        assert rel_err(o[:, sl], o_ref) < FP32_TOL and rel_err(final[s : s + 1], s_ref) < FP32_TOL


@pytest.mark.parametrize(
    "T, H, K, V, gate, batch",
    [(100, 1, 16, 16, "bound_sat", 1), (37, 2, 16, 16, "mixed", 2), (40, 1, 32, 48, "mixed_gate", 1)],
)
def test_chunk_kda_triton_hard_decays(T, H, K, V, gate, batch):
    """Decays at the bound −5 everywhere (matmul path, Γ down to −320 in a chunk), and −30 nats next to −0.01
    inside one 16-token tile with an unbounded gate (token-pair path): finite and equal to the recurrence."""
    run, ref = make_inputs(batch, T, H, K, V, gate, seed=11)
    if gate == "bound_sat":
        assert ref["g"].min() < -4.99 and ref["g"].max() > -5.0
    else:
        assert ref["g"].min() < -29.9 and ref["g"].max() > -0.02
    h0 = torch.randn(batch, H, K, V, generator=torch.Generator().manual_seed(12))
    o, final = chunk_kda_triton(**run, initial_state=h0, output_final_state=True)
    o_ref, s_ref = naive_recurrent_kda(**{n: ref[n] for n in ("q", "k", "v", "g", "beta")},
                                       initial_state=h0.double(), output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    tol = MIXED_TOL if gate.startswith("mixed") else FP32_TOL
    assert rel_err(o, o_ref) < tol and rel_err(final, s_ref) < tol, (rel_err(o, o_ref), rel_err(final, s_ref))


def test_chunk_kda_triton_entry_and_bf16():
    """The entry point: L2 norm + scale in PyTorch, FusedGate with f as [B, T, H*K], no initial state, no
    final state requested; then bf16 inputs (o in bf16, state fp32)."""
    run, ref = make_inputs(1, 70, 2, 16, 16, "bound", seed=21)
    o, final = chunk_kda_triton(**run, scale=0.3, use_qk_l2norm_in_kernel=True)
    assert final is None and o.dtype == torch.float32
    o_ref, _ = naive_recurrent_kda(**{n: ref[n] for n in ("q", "k", "v", "g", "beta")}, scale=0.3,
                                   use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o_ref) < FP32_TOL
    run, ref = make_inputs(1, 70, 2, 16, 16, "softplus", seed=22, dtype=torch.bfloat16)
    o, final = chunk_kda_triton(**run, output_final_state=True)
    o_ref, s_ref = naive_recurrent_kda(**{n: ref[n] for n in ("q", "k", "v", "g", "beta")}, output_final_state=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert rel_err(o, o_ref) < BF16_TOL and rel_err(final, s_ref) < BF16_TOL


class _LaunchSpy:
    """Stands in for a @triton.jit kernel: records the SAFE_GATE each launch is given, then launches."""

    def __init__(self, kernel):
        self.kernel, self.safe_gate = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.safe_gate.append(kwargs["SAFE_GATE"])
            return launch(*args, **kwargs)

        return run


@pytest.mark.parametrize("gate, matmul_path", [("bound", True), ("softplus", False), ("g", False)])
def test_lower_bound_takes_matmul_path(gate, matmul_path, monkeypatch):
    """The intra kernel is launched with SAFE_GATE (diagonal tiles by one tl.dot around the midpoint) exactly
    when the gate's lower bound is set; a softplus gate or a plain g gets the token-pair path. The backward
    is handed the same choice (chunk_bwd's safe_gate)."""
    spy = _LaunchSpy(intra_module.chunk_intra_kernel)
    monkeypatch.setattr(intra_module, "chunk_intra_kernel", spy)
    bwd_calls = []

    def chunk_bwd_spy(*args, **kwargs):
        bwd_calls.append(kwargs["safe_gate"])
        return real_chunk_bwd(*args, **kwargs)

    real_chunk_bwd = bwd_module.chunk_bwd
    monkeypatch.setattr(bwd_module, "chunk_bwd", chunk_bwd_spy)
    run, ref = make_inputs(1, 16, 1, 16, 16, gate, seed=31)
    run["v"].requires_grad_()
    o, _ = chunk_kda_triton(**run)
    assert spy.safe_gate == [matmul_path]
    o_ref, _ = naive_recurrent_kda(**{n: ref[n] for n in ("q", "k", "v", "g", "beta")})
    assert rel_err(o, o_ref) < FP32_TOL
    o.sum().backward()
    assert bwd_calls == [matmul_path]


def test_matmul_path_would_overflow_unbounded_decays():
    """Why the dispatch matters: the midpoint matmul on the −30/−0.01 mix forms e^{±240} and overflows fp32
    (numpy raises inside the interpreter), while the token-pair path on the same tile is exact."""
    run, ref = make_inputs(1, 16, 1, 16, 16, "mixed", seed=41)
    q, gk = run["q"] * 0.25, intra_module.chunk_cumsum_gate(run["g"])
    with pytest.raises(Exception, match="overflow"):
        intra_module.chunk_intra(q, run["k"], gk, run["beta"], safe_gate=True)
    Aqk, _ = intra_module.chunk_intra(q, run["k"], gk, run["beta"], safe_gate=False)
    _, _, inter = naive_chunk_kda(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"])
    assert rel_err(Aqk, inter.Aqk) < MIXED_TOL


def _loss_grads(fn, inputs, gate, h0, cu_seqlens, seed, **kwargs):
    """Output, final state and the gradients (q, k, v, β, then g or f/A_log/dt_bias, then h0) of a random linear
    loss of both; `gate` is None for a plain g in inputs["g"], else (f, A_log, dt_bias, lb)."""
    names = ["q", "k", "v", "beta"] + (["g"] if gate is None else [])
    leaves = {n: inputs[n].detach().clone().requires_grad_() for n in names}
    gate_leaves = [] if gate is None else [x.detach().clone().requires_grad_() for x in gate[:3] if x is not None]
    h0 = None if h0 is None else h0.detach().clone().requires_grad_()
    if gate is not None:
        f, A_log = gate_leaves[:2]
        dt_bias = gate_leaves[2] if len(gate_leaves) == 3 else None
    if fn is chunk_kda_triton:
        g = leaves["g"] if gate is None else FusedGate(f, A_log, dt_bias, gate[3])
        o, state = fn(leaves["q"], leaves["k"], leaves["v"], g, leaves["beta"], initial_state=h0,
                      output_final_state=True, cu_seqlens=cu_seqlens, **kwargs)
    else:
        g = leaves["g"] if gate is None else kda_gate(f, A_log, dt_bias, gate[3])
        spans = [(0, inputs["q"].shape[1])] if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(),
                                                                              cu_seqlens[1:].tolist()))
        outs, states = [], []
        for s, (a, b) in enumerate(spans):
            # per sequence (the recurrence has no cu_seqlens); without it the batch rows run together
            h0_s = h0 if cu_seqlens is None or h0 is None else h0[s : s + 1]
            o_s, st = naive_recurrent_kda(leaves["q"][:, a:b], leaves["k"][:, a:b], leaves["v"][:, a:b],
                                          g[:, a:b], leaves["beta"][:, a:b], initial_state=h0_s,
                                          output_final_state=True, **kwargs)
            outs.append(o_s)
            states.append(st)
        o, state = torch.cat(outs, dim=1), torch.cat(states)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=F64)
    dstate = torch.randn(state.shape, generator=gen, dtype=F64)
    ((o.double() * do).sum() + (state.double() * dstate).sum()).backward()
    grads = {f"d{n}": x.grad for n, x in leaves.items()}
    if gate is not None:
        grads.update(zip(["df", "dA_log", "ddt_bias"], [x.grad for x in gate_leaves]))
    if h0 is not None:
        grads["dh0"] = h0.grad
    return o.detach(), state.detach(), grads


def check_grads(run, ref, h0, cu_seqlens, tol, seed, gate_tol=None, **kwargs):
    """chunk_kda_triton forward + backward (fp32) vs float64 autograd through naive_recurrent_kda; the fused
    gate's parameter gradients (df, dA_log, ddt_bias) against gate_tol (default tol), or, when gate_tol is
    ("abs", a), by absolute error ≤ a."""
    fg = run["g"]
    if isinstance(fg, FusedGate):
        gate_run, gate_ref = (fg.f, fg.A_log, fg.dt_bias, fg.lower_bound), tuple(
            None if x is None else (x.double() if isinstance(x, torch.Tensor) else x)
            for x in (fg.f, fg.A_log, fg.dt_bias, fg.lower_bound))
        inputs_run = {n: run[n] for n in ("q", "k", "v", "beta")}
        inputs_ref = {n: ref[n] for n in ("q", "k", "v", "beta")}
    else:
        gate_run = gate_ref = None
        inputs_run, inputs_ref = run, {n: ref[n] for n in ("q", "k", "v", "beta", "g")}
    o, s, grads = _loss_grads(chunk_kda_triton, inputs_run, gate_run, h0, cu_seqlens, seed, **kwargs)
    o_ref, s_ref, grads_ref = _loss_grads(naive_recurrent_kda, inputs_ref, gate_ref,
                                          None if h0 is None else h0.double(), cu_seqlens, seed, **kwargs)
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol, (rel_err(o, o_ref), rel_err(s, s_ref))
    assert grads.keys() == grads_ref.keys()
    errs = {n: rel_err(grads[n], grads_ref[n]) for n in grads}
    for n in grads:
        assert grads[n].dtype == inputs_run.get(n[1:], grads[n]).dtype, n
        assert torch.isfinite(grads[n]).all(), n
    gate_names = ("df", "dA_log", "ddt_bias")
    if isinstance(gate_tol, tuple):
        for n in set(gate_names) & grads.keys():
            errs[n] = (grads[n].double() - grads_ref[n]).abs().max().item()
    limits = {n: (gate_tol[1] if isinstance(gate_tol, tuple) else gate_tol or tol) if n in gate_names else tol
              for n in errs}
    assert all(errs[n] < limits[n] for n in errs), {n: f"{e:.1e}" for n, e in errs.items()}
    return errs


# Gradient tolerances. Ordinary gates: FP32_TOL for every gradient (measured 1e-7 to 2e-6). Deep decays
# (−30 nats, or all at the bound): MIXED_TOL for dq, dk, dv, dβ, dg, dh0 (measured ≤ 1.2e-5: fp32 Γ as above,
# and dg is a reverse cumsum of terms that cancel, kernels/kda/chunk_bwd.py). Their fused-gate parameter
# gradients get GATE_TOL: df = ∂g/∂z ⊙ dg weights the dg of the −30-nat tokens (true value ~e^-30, so fp32
# rounding noise) 1900× more than the weak tokens' in "mixed_gate", and dA_log, ddt_bias are sums over tokens of
# terms of both signs; measured df 2.3e-4, dA_log 5.4e-4, ddt_bias 1e-4 (the fp32 PyTorch chunk_kda_torch on the same
# inputs: 7e-5, 4e-4, 6.5e-5). At the bound itself ("bound_sat", σ(a·z) ≈ 1) ∂g/∂z = lb·a·σ(1 − σ) is below
# fp32's resolution of 1 − σ (6e-8), so the gate gradients are rounding noise in fp32 (PyTorch's fp32 autograd
# returns 0 there; relative error 1): they are checked by absolute error ≤ 1e-7 (measured 6e-9 for dA_log,
# ≤ 6e-10 elementwise for df, ddt_bias; ‖dq‖ ~ 1).
GATE_TOL = 2e-3


@pytest.mark.parametrize(
    "T, H, K, V, gate, with_h0, tol, gate_tol",
    [
        (100, 2, 32, 48, "g", True, FP32_TOL, None),
        (64, 1, 16, 16, "bound", False, FP32_TOL, None),
        (130, 1, 16, 16, "softplus", True, FP32_TOL, None),
        (1, 2, 16, 16, "softplus", True, FP32_TOL, None),
        (100, 1, 16, 16, "bound_near", True, MIXED_TOL, GATE_TOL),
        (70, 1, 16, 16, "bound_sat", True, MIXED_TOL, ("abs", 1e-7)),
        (37, 1, 16, 16, "mixed", True, MIXED_TOL, None),
        (20, 2, 32, 48, "mixed_gate", False, MIXED_TOL, GATE_TOL),
    ],
)
def test_chunk_kda_triton_grads(T, H, K, V, gate, with_h0, tol, gate_tol):
    """Forward + backward through chunk_kda_triton (ChunkKDAFunction: w, u, h, v_new recomputed, then
    chunk_bwd and, for a FusedGate, gate_bwd) against float64 autograd: dq, dk, dv, dβ, dg or df/dA_log/
    ddt_bias, dh0; incl. the −30/−0.01 tile (token-pair path) and decays at the bound −5 (matmul path)."""
    run, ref = make_inputs(1, T, H, K, V, gate, seed=500 + T)
    h0 = torch.randn(1, H, K, V, generator=torch.Generator().manual_seed(T)) if with_h0 else None
    check_grads(run, ref, h0, None, tol, seed=T, gate_tol=gate_tol)


def test_chunk_kda_triton_grads_varlen_l2norm():
    """Packed sequences (5, 70, 33) with a per-sequence initial state, the lower-bound FusedGate, and the L2
    norm + scale done in PyTorch before the kernels (their gradient flows through autograd)."""
    run, ref = make_inputs(1, 108, 2, 16, 16, "bound", seed=600)
    h0 = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(601))
    check_grads(run, ref, h0, torch.tensor([0, 5, 75, 108]), FP32_TOL, seed=602, scale=0.4,
                use_qk_l2norm_in_kernel=True)
