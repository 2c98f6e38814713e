"""The Triton kernels compiled for a CUDA GPU against the float64 PyTorch references, at GPU-sized tiles.

The other tests of this folder run the same kernels under Triton's interpreter on CPU tensors; on a GPU the
compiled code is another program (real tl.dot units, TF32 or bf16 operands, real block scheduling), so the same
comparisons are repeated here on CUDA tensors, on fresh random inputs with the hard cases of the CPU tests:
mixed strong and weak decays inside one tile, decays at the lower bound, lengths that are not multiples of the
64-token chunk, packed sequences (cu_seqlens), the decode step reading and writing a state pool in place, and
routings with empty experts. References are computed on the CPU in float64 on the same (rounded) inputs.

The chunked KDA backward multiplies fp32 operands for bf16 inputs too (kernels/kda/chunk_bwd_inter.py `dot_args`):
with K3RL_KDA_BWD_BF16_DOTS=1 (bf16 operands) the bf16 cases near the bound and with mixed −30/−0.01 decays fail,
df and dA_log off by 3.6 and 18 (an H200, 2026-12-04).

Tolerances (‖x − ref‖ / ‖ref‖): fp32 1e-3 (the KDA and expert kernels request IEEE fp32 dots for fp32 inputs;
measured far below on the interpreter, so 1e-3 leaves room only for a different summation order and would catch
an unintended TF32 path only where it costs more than that); bf16 2e-2 for outputs and 5e-2 for gradients
(tests/kernels/test_moe_triton.py explains the bf16 budget). NaN never passes.

Marked `gpu`: skipped without CUDA. bench/gpu_check.sh runs them on the GPU machine. K3RL_PARITY_DEVICE=cpu runs
the same code on CPU tensors under TRITON_INTERPRET=1 (tiny shapes) to check the tests themselves here.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_kda_chunk_triton import make_inputs as kda_inputs
from test_moe_triton import BETA
from test_moe_triton import make_inputs as moe_inputs

from k3rl.kernels.kda import FusedGate
from k3rl.kernels.kda.chunk import chunk_kda_torch
from k3rl.kernels.kda.chunk_triton import chunk_kda_triton
from k3rl.kernels.kda.naive import naive_recurrent_kda
from k3rl.kernels.kda.recurrent_triton import fused_recurrent_kda_triton
from k3rl.kernels.moe import SituGLU, grouped_linear_triton, naive_experts, triton_experts
from k3rl.kernels.situ import naive_situ_glu

DEVICE = os.environ.get("K3RL_PARITY_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.triton] if ON_GPU else [pytest.mark.triton]
F64 = torch.float64
TOL = {torch.float32: (1e-3, 1e-3), torch.bfloat16: (2e-2, 5e-2)}  # (outputs, gradients)
# (T, H, K, V) of the chunked op: GPU tiles on CUDA, interpreter-sized on the CPU
KDA_SHAPE = (1000, 4, 64, 64) if ON_GPU else (70, 1, 16, 16)
PACKED = [0, 333, 384, 1000] if ON_GPU else [0, 23, 64, 70]  # a chunk-aligned boundary and two that are not


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(x).all(), "non-finite values"
    if x.numel() == 0 or bool((x == ref).all()):
        return 0.0
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def on_device(x):
    """A tensor or FusedGate moved to DEVICE, as a fresh leaf when it is floating point."""
    if isinstance(x, FusedGate):
        return FusedGate(*(on_device(t) for t in (x.f, x.A_log, x.dt_bias)), x.lower_bound)
    if x is None:
        return None
    y = x.detach().to(DEVICE)
    return y.requires_grad_() if y.is_floating_point() else y


def leaves_of(inputs) -> dict[str, torch.Tensor]:
    q, k, v, g, beta = inputs
    named = dict(q=q, k=k, v=v, beta=beta)
    if isinstance(g, FusedGate):
        named.update(f=g.f, A_log=g.A_log)
        if g.dt_bias is not None:
            named["dt_bias"] = g.dt_bias
    else:
        named["g"] = g
    return named


def kda_case(gate: str, dtype: torch.dtype, seed: int):
    """Kernel inputs on DEVICE and float64 CPU reference inputs (the gate already applied) of the same values."""
    T, H, K, V = KDA_SHAPE
    run, ref = kda_inputs(1, T, H, K, V, gate, seed=seed, dtype=dtype)
    return [on_device(run[n]) for n in ("q", "k", "v", "g", "beta")], [ref[n] for n in ("q", "k", "v", "g", "beta")]


def backward_seeded(o, state, seed):
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=F64)
    ds = torch.randn(state.shape, generator=gen, dtype=F64)
    ((o.double() * do.to(o.device)).sum() + (state.double() * ds.to(state.device)).sum()).backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", ["mixed", "bound_near", "softplus", "mixed_gate"])
def test_chunk_kda_forward_backward(gate, dtype):
    """Output, final state and every input's gradient of the compiled chunked op vs float64 autograd through the
    PyTorch chunked path, with an initial state, T not a multiple of the chunk."""
    run, ref = kda_case(gate, dtype, seed=sum(map(ord, gate)))
    T, H, K, V = KDA_SHAPE
    h0 = torch.randn(1, H, K, V, generator=torch.Generator().manual_seed(5))
    h0_run, h0_ref = on_device(h0), h0.double().requires_grad_()
    o, s = chunk_kda_triton(*run, initial_state=h0_run, output_final_state=True)
    backward_seeded(o, s, seed=1)
    # the reference differentiates through g itself; for a fused gate, through f, A_log, dt_bias as well
    g_run = run[3]
    if isinstance(g_run, FusedGate):
        from k3rl.kernels.kda.gate import kda_gate

        gate_ref = [None if t is None else t.detach().double().cpu().requires_grad_()
                    for t in (g_run.f, g_run.A_log, g_run.dt_bias)]
        g_ref = kda_gate(*gate_ref, g_run.lower_bound)
    else:
        gate_ref = []
        g_ref = ref[3].clone().requires_grad_()
    ref_leaves = [ref[0].clone().requires_grad_(), ref[1].clone().requires_grad_(), ref[2].clone().requires_grad_(),
                  ref[4].clone().requires_grad_()]
    o_ref, s_ref = chunk_kda_torch(*ref_leaves[:3], g_ref, ref_leaves[3], initial_state=h0_ref,
                                   output_final_state=True)
    backward_seeded(o_ref, s_ref, seed=1)
    tol_o, tol_g = TOL[dtype]
    assert rel(o, o_ref) < tol_o, f"o {rel(o, o_ref):.2e}"
    assert rel(s, s_ref) < tol_o, f"state {rel(s, s_ref):.2e}"
    got = leaves_of(run)
    want = dict(q=ref_leaves[0].grad, k=ref_leaves[1].grad, v=ref_leaves[2].grad, beta=ref_leaves[3].grad)
    if gate_ref:
        want.update(f=gate_ref[0].grad, A_log=gate_ref[1].grad)
        if gate_ref[2] is not None:
            want["dt_bias"] = gate_ref[2].grad
    else:
        want["g"] = g_ref.grad
    assert got.keys() == want.keys()
    # A_log and dt_bias sum over every token of a head: cancellation, 5× the budget (bench/kda_gpu.py)
    errs = {n: rel(got[n].grad, want[n]) for n in want}
    limits = {n: tol_g * (5 if n in ("A_log", "dt_bias") else 1) for n in want}
    bad = {n: f"{errs[n]:.2e} (limit {limits[n]:.0e})" for n in errs if not errs[n] < limits[n]}
    assert not bad, f"gradients off: {bad}; all: { {n: f'{e:.1e}' for n, e in errs.items()} }"
    assert rel(h0_run.grad, h0_ref.grad) < tol_g


def test_chunk_kda_packed_sequences():
    """cu_seqlens: three packed sequences (boundaries on and off the chunk grid), each from its own state."""
    run, ref = kda_case("bound_near", torch.float32, seed=7)
    cu = torch.tensor(PACKED, device=DEVICE)
    T, H, K, V = KDA_SHAPE
    h0 = torch.randn(len(PACKED) - 1, H, K, V, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        o, s = chunk_kda_triton(*run, initial_state=h0.to(DEVICE), output_final_state=True, cu_seqlens=cu)
    outs, states = [], []
    for i, (a, b) in enumerate(zip(PACKED[:-1], PACKED[1:])):
        o_i, s_i = naive_recurrent_kda(*[x[:, a:b] for x in ref], initial_state=h0[i:i + 1].double(),
                                       output_final_state=True)
        outs.append(o_i)
        states.append(s_i)
    assert rel(o, torch.cat(outs, dim=1)) < 1e-3 and rel(s, torch.cat(states)) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_step_state_pool(dtype):
    """The decode kernel over 8 steps of 16 sequences reading/writing a [P, H, K, V] pool in place (as the
    engine's decode batch, packed one token per sequence); a padding slot writes nothing."""
    N, steps = 16, 8
    _, H, K, V = KDA_SHAPE
    run, ref = kda_inputs(N, steps, H, K, V, "bound_near", seed=9, dtype=dtype)
    q, k, v, gate, beta = (run[n] for n in ("q", "k", "v", "g", "beta"))
    slots = list(range(1, N)) + [-1]
    pool = torch.randn(N + 2, H, K, V, generator=torch.Generator().manual_seed(10))
    h0 = torch.stack([pool[s] if s >= 0 else torch.zeros(H, K, V) for s in slots]).double()
    o_ref, s_ref = naive_recurrent_kda(*[ref[n] for n in ("q", "k", "v", "g", "beta")], initial_state=h0,
                                       output_final_state=True)
    pool_dev = pool.to(DEVICE)
    idx = torch.tensor(slots, device=DEVICE)
    cu = torch.arange(N + 1, device=DEVICE)
    outs = []
    with torch.no_grad():
        for t in range(steps):
            step_gate = FusedGate(gate.f[:, t:t + 1].transpose(0, 1).to(DEVICE), gate.A_log.to(DEVICE),
                                  gate.dt_bias.to(DEVICE), gate.lower_bound)
            step = [x[:, t:t + 1].transpose(0, 1).to(DEVICE) for x in (q, k, v)]
            o_t, returned = fused_recurrent_kda_triton(*step, step_gate, beta[:, t:t + 1].transpose(0, 1).to(DEVICE),
                                                       initial_state=pool_dev, output_final_state=True,
                                                       cu_seqlens=cu, state_indices=idx)
            assert returned is pool_dev
            outs.append(o_t.transpose(0, 1))
    o = torch.cat(outs, dim=1)
    tol = TOL[dtype][0]
    assert rel(o[:-1], o_ref[:-1]) < tol
    assert rel(pool_dev[1:N], s_ref[:-1]) < tol
    assert torch.equal(pool_dev[0].cpu(), pool[0]) and torch.equal(pool_dev[N:].cpu(), pool[N:])


MOE_CASES = {  # (n tokens, top-k, experts, d, intermediate, experts no token chooses)
    "empty_experts": (300, 2, 16, 96, 80, (3, 5, 11)) if ON_GPU else (13, 2, 8, 20, 12, (3, 5)),
    "ragged_top1": (257, 1, 8, 130, 72, ()) if ON_GPU else (7, 1, 3, 18, 24, ()),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(MOE_CASES), ids=list(MOE_CASES))
def test_routed_experts(case, dtype):
    """The fused SiTU-GLU experts (grouped GEMMs by the tile map): output and the gradients of tokens, routing
    weights and all three expert weights vs the per-expert loop in float64; unchosen experts get zero gradients."""
    n, k, e, d, inter, empty = MOE_CASES[case]
    inputs = moe_inputs(n, k, e, d, inter, dtype, seed=len(case), empty=empty)
    act = SituGLU(BETA, 25.0)
    dev = [on_device(t) for t in inputs]
    out = triton_experts(*dev, act)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    out.backward(dy.to(out))
    ref = [t.double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out_ref = naive_experts(*ref, lambda g, u: naive_situ_glu(g, u, BETA, 25.0))
    out_ref.backward(dy)
    tol_o, tol_g = TOL[dtype]
    assert rel(out, out_ref) < tol_o
    for i, name in [(0, "z"), (2, "weights"), (3, "w1"), (4, "w3"), (5, "w2")]:
        assert rel(dev[i].grad, ref[i].grad) < tol_g, name
    for i in (3, 4, 5):
        assert not dev[i].grad[list(empty)].any(), "unchosen experts' weight gradients must be written zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_linear(dtype):
    counts = torch.tensor([150, 0, 1, 77, 0, 300]) if ON_GPU else torch.tensor([5, 0, 19, 0, 1])
    gen = torch.Generator().manual_seed(4)
    m, d_in, d_out = int(counts.sum()), 200 if ON_GPU else 20, 136 if ON_GPU else 13
    x = torch.randn(m, d_in, generator=gen, dtype=F64).to(dtype)
    w = torch.randn(len(counts), d_out, d_in, generator=gen, dtype=F64).to(dtype)
    xd, wd = on_device(x), on_device(w)
    y = grouped_linear_triton(xd, wd, counts.to(DEVICE))
    dy = torch.randn(y.shape, generator=gen, dtype=F64)
    y.backward(dy.to(y))
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    expert = torch.repeat_interleave(torch.arange(len(counts)), counts)
    y_ref = torch.einsum("mi,moi->mo", xr, wr[expert])
    y_ref.backward(dy)
    tol_o, tol_g = TOL[dtype]
    assert rel(y, y_ref) < tol_o and rel(xd.grad, xr.grad) < tol_g and rel(wd.grad, wr.grad) < tol_g
