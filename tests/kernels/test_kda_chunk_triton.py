"""The Triton chunked KDA (kernels/kda/chunk_fwd*.py, chunk_triton.py `chunk_kda_triton`) against the float64
references of kernels/kda/naive.py: every forward stage against `naive_chunk_kda`'s `ChunkIntermediates`,
the whole op against the per-token recurrence `naive_recurrent_kda`.

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
of ulp(|Γ|) ≈ 6e-5 (observed 1.4e-5 on the state; the PyTorch chunk_kda, which keeps Γ per 16-token
sub-chunk, sees 3e-6; the per-token fp32 recurrence 1e-7).
Shapes are tiny (one program per chunk and head): T ∈ {1, 20, 64, 100, 130}, H ∈ {1, 2}, K = V = 16 and
K = 32 with V = 48 (not a power of two: masked lanes, and two 32-wide V blocks in the state pass),
packed sequences of lengths 5, 70, 33.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels.kda.chunk_fwd_intra as intra_module
from kernels.kda.chunk_fwd import GateSpec, chunk_fwd
from kernels.kda.chunk_triton import chunk_kda_triton
from kernels.kda.gate import FusedGate, kda_gate
from kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda

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
          "softplus"   FusedGate without bound (f std 3: both sides of softplus's threshold regions);
          "bound"      FusedGate with lb = −3;
          "bound_sat"  FusedGate with lb = −5 and σ ≈ 1: every token decays by ≈ e^-5 (Γ reaches −320 per chunk);
          "mixed"      plain g: −30 nats on random (token, channel) pairs next to −0.01 inside every 16-token tile;
          "mixed_gate" FusedGate without bound giving the same mix (z = ±20: softplus 20 or ≈ 2e-9, ·1.5).
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
    elif gate == "mixed_gate":
        f = torch.where(torch.rand(B, T, H * K, generator=gen) < 0.5, 20.0, -20.0).to(F64)
        A_log, dt_bias = torch.full((H,), math.log(1.5), dtype=F64), None
    elif gate != "softplus":
        raise ValueError(gate)
    if "g" not in ref:
        ref["g"] = kda_gate(f, A_log, dt_bias, lb)
        ref["gate"] = (f, A_log, dt_bias, lb)
    run = {name: x.to(dtype) for name, x in ref.items() if name in ("q", "k", "v", "beta")}
    if "gate" in ref:
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
    tol = MIXED_TOL if gate == "mixed" else FP32_TOL
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
    when the gate's lower bound is set; a softplus gate or a plain g gets the token-pair path."""
    spy = _LaunchSpy(intra_module.chunk_intra_kernel)
    monkeypatch.setattr(intra_module, "chunk_intra_kernel", spy)
    run, ref = make_inputs(1, 16, 1, 16, 16, gate, seed=31)
    o, _ = chunk_kda_triton(**run)
    assert spy.safe_gate == [matmul_path]
    o_ref, _ = naive_recurrent_kda(**{n: ref[n] for n in ("q", "k", "v", "g", "beta")})
    assert rel_err(o, o_ref) < FP32_TOL


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
