"""The Triton decode step `fused_recurrent_kda_triton` (kernels/kda/recurrent_triton.py) against the float64
per-token reference `naive_recurrent_kda` (docs/model_spec.md §5.3).

Runs under TRITON_INTERPRET=1 on CPU tensors without a GPU (tests/conftest.py). Precision compared: the kernel
computes in fp32 on fp32 (or bf16) inputs; the reference runs in float64 on the same inputs upcast (for a
`FusedGate`, on the float64 `kda_gate` of the same raw inputs, so the kernel's fp32 gate is part of what is
measured). Tolerances: fp32 outputs and states 1e-5 relative (observed ≈ 1e-7 to 6e-7: a handful of
K-length fp32 dot products per token over ≤ 5 tokens, ≈ 100× fp32's 6e-8 unit round-off in reserve); bf16
outputs 1e-2 (they are rounded to bf16 on the way out, 2^-9 ≈ 2e-3 per element), their fp32 state 1e-5.
Shapes: T ∈ {1, 2, 5}, B ∈ {1, 3}, H ∈ {1, 2}, K and V ∈ {16, 32, 48} (48 is not a power of two: the kernel's
masks, in K and in the second 32-wide V block), packed sequences with an empty one, the state pool in place.
Fresh memory is NaN-poisoned for every test (`nan_poison`), so an output element the kernel skips fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3rl.kernels.kda.chunk import chunk_kda_torch
from k3rl.kernels.kda.gate import FusedGate, kda_gate
from k3rl.kernels.kda.naive import naive_recurrent_kda
from k3rl.kernels.kda.recurrent_triton import fused_recurrent_kda_triton

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("nan_poison")]

F64 = torch.float64
FP32_TOL = 1e-5
BF16_OUT_TOL = 1e-2
GATES = ["tensor", "softplus", "lower_bound"]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (0 for two empty tensors)."""
    x, ref = x.double(), ref.double()
    if x.numel() == 0:
        return 0.0
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def make_inputs(B, T, H, K, V, gate, seed, l2=False, dtype=torch.float32, f_4d=False, dt_bias=True):
    """Kernel inputs (dtype) and the float64 reference inputs of the same values.

    The raw gate input f has std 10, so f + dt_bias crosses softplus's threshold 20 on some channels and is
    below −20 on others (decays of e^-20 and more next to ones of ≈ 1): both branches of the kernel's softplus.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, dtype=F64) * std).to(dtype)

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    if not l2:
        # the recurrence is contractive only for ‖k‖ ≤ 1 (β < 1); the layer normalises in the kernel
        k = F.normalize(k.double(), dim=-1).to(dtype)
    beta = torch.sigmoid(randn(B, T, H).double()).to(dtype)
    f = randn(B, T, H, K, std=10.0) if f_4d else randn(B, T, H * K, std=10.0)
    A_log = torch.randn(H, generator=gen, dtype=F64).mul(0.5).float()
    bias = torch.randn(H * K, generator=gen, dtype=F64).float() if dt_bias else None
    lower_bound = -3.0 if gate == "lower_bound" else None
    g_ref = kda_gate(f.double(), A_log.double(), None if bias is None else bias.double(), lower_bound)
    if gate == "tensor":
        g_in = g_ref.to(dtype)
        g_ref = g_in.double()
    else:
        g_in = FusedGate(f, A_log, bias, lower_bound)
    return (q, k, v, g_in, beta), tuple(x.double() for x in (q, k, v)) + (g_ref, beta.double())


# (B, T, H, K, V, l2 norm in the kernel, f as [B, T, H, K] without dt_bias)
SHAPES = [
    (1, 1, 1, 16, 16, False, False),
    (3, 2, 2, 32, 48, True, False),
    (1, 5, 2, 48, 32, False, True),
    (3, 5, 1, 48, 48, True, False),
]


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("B, T, H, K, V, l2, f_4d", SHAPES)
def test_recurrent(B, T, H, K, V, l2, f_4d, gate, with_h0):
    """Output and final state vs the float64 reference, g as a tensor or computed in the kernel."""
    seed = 100 * B + 10 * T + K + V + H
    inputs, ref_inputs = make_inputs(B, T, H, K, V, gate, seed, l2=l2, f_4d=f_4d, dt_bias=not f_4d)
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(seed + 1)) if with_h0 else None
    with torch.no_grad():
        o, s = fused_recurrent_kda_triton(*inputs, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=l2)
    o_ref, s_ref = naive_recurrent_kda(*ref_inputs, initial_state=None if h0 is None else h0.double(),
                                       output_final_state=True, use_qk_l2norm_in_kernel=l2)
    assert o.shape == (B, T, H, V) and o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(s, s_ref) < FP32_TOL


@pytest.mark.parametrize("l2", [False, True])
def test_recurrent_scale_and_no_state(l2):
    """A given scale (after the L2 norm when it is on), and no final state unless asked for."""
    inputs, ref_inputs = make_inputs(2, 3, 2, 32, 48, "softplus", seed=5, l2=l2)
    o, s = fused_recurrent_kda_triton(*inputs, use_qk_l2norm_in_kernel=l2, scale=0.3)
    o_ref, _ = naive_recurrent_kda(*ref_inputs, use_qk_l2norm_in_kernel=l2, scale=0.3)
    assert s is None and rel_err(o, o_ref) < FP32_TOL


def varlen_reference(ref_inputs, cu, h0, **kwargs):
    outs, states = [], []
    for i in range(len(cu) - 1):
        seg = [x[:, cu[i]:cu[i + 1]] for x in ref_inputs]
        o, s = naive_recurrent_kda(*seg, initial_state=None if h0 is None else h0[i:i + 1],
                                   output_final_state=True, **kwargs)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, dim=1), torch.cat(states, dim=0)


@pytest.mark.parametrize("gate, with_h0", [("lower_bound", True), ("tensor", False), ("softplus", True)])
def test_recurrent_varlen(gate, with_h0):
    """Packed sequences of lengths 2, 0, 5, 1 (cu_seqlens, int32) equal separate reference runs; the empty
    sequence's final state is its initial state."""
    cu = [0, 2, 2, 7, 8]
    H, K, V = 2, 32, 48
    inputs, ref_inputs = make_inputs(1, cu[-1], H, K, V, gate, seed=7, l2=True)
    h0 = torch.randn(len(cu) - 1, H, K, V, generator=torch.Generator().manual_seed(8)) if with_h0 else None
    o, s = fused_recurrent_kda_triton(*inputs, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    o_ref, s_ref = varlen_reference(ref_inputs, cu, None if h0 is None else h0.double(), use_qk_l2norm_in_kernel=True)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(s, s_ref) < FP32_TOL
    if with_h0:
        assert torch.equal(s[1], h0[1])


@pytest.mark.parametrize("gate", ["tensor", "lower_bound"])
def test_recurrent_bf16(gate):
    """bf16 q, k, v, β (and f or g): bf16 output, fp32 state, against float64 on the same rounded inputs."""
    B, T, H, K, V = 3, 2, 2, 32, 32
    inputs, ref_inputs = make_inputs(B, T, H, K, V, gate, seed=9, l2=True, dtype=torch.bfloat16)
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(10))
    o, s = fused_recurrent_kda_triton(*inputs, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = naive_recurrent_kda(*ref_inputs, initial_state=h0.double(), output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < BF16_OUT_TOL and rel_err(s, s_ref) < FP32_TOL


def test_prefill_then_decode():
    """§5.6: `chunk_kda_torch` prefills 37 tokens (fp32, PyTorch), then three one-token Triton steps carry its state,
    the gate computed in the kernel: together they equal one float64 reference pass over the 40 tokens."""
    B, T, H, K, V, split = 2, 40, 2, 32, 32, 37
    (q, k, v, fused, beta), ref_inputs = make_inputs(B, T, H, K, V, "lower_bound", seed=11, l2=True)
    g = fused.log_decay()  # [B, T, H, K] fp32, for the PyTorch prefill
    o_ref, s_ref = naive_recurrent_kda(*ref_inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_pre, state = chunk_kda_torch(q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split],
                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    outs = [o_pre]
    for t in range(split, T):
        step = FusedGate(fused.f[:, t:t + 1], fused.A_log, fused.dt_bias, fused.lower_bound)
        o_t, state = fused_recurrent_kda_triton(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], step, beta[:, t:t + 1],
                                                initial_state=state, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
        outs.append(o_t)
    assert rel_err(torch.cat(outs, dim=1), o_ref) < FP32_TOL and rel_err(state, s_ref) < FP32_TOL


@pytest.mark.parametrize("packed", [False, True])
def test_recurrent_state_pool_in_place(packed):
    """state_indices: each sequence reads and writes its slot of a [P, H, K, V] pool in place over three
    consecutive decode steps; a padding slot (−1) runs from zero and writes nothing; other slots are untouched."""
    P, N, H, K, V, steps = 5, 3, 2, 16, 48, 3
    slots = [3, -1, 0]
    inputs, ref_inputs = make_inputs(N, steps, H, K, V, "softplus", seed=12, l2=True)
    pool = torch.randn(P, H, K, V, generator=torch.Generator().manual_seed(13))
    pool_before = pool.clone()
    h0_ref = torch.stack([pool[s] if s >= 0 else torch.zeros(H, K, V) for s in slots]).double()
    o_ref, s_ref = naive_recurrent_kda(*ref_inputs, initial_state=h0_ref, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
    idx = torch.tensor(slots, dtype=torch.int64 if packed else torch.int32)
    q, k, v, gate, beta = inputs
    for t in range(steps):
        step_gate = FusedGate(gate.f[:, t:t + 1], gate.A_log, gate.dt_bias, gate.lower_bound)
        step = [q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], step_gate, beta[:, t:t + 1]]
        if packed:
            # N one-token sequences packed along T, as the engine's decode batch
            packed_gate = FusedGate(step_gate.f.transpose(0, 1), gate.A_log, gate.dt_bias, gate.lower_bound)
            step = [x.transpose(0, 1) for x in step[:3]] + [packed_gate, step[4].transpose(0, 1)]
            cu = torch.arange(N + 1)
        else:
            cu = None
        o, returned = fused_recurrent_kda_triton(*step, initial_state=pool, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True, cu_seqlens=cu, state_indices=idx)
        assert returned is pool
        o = o.transpose(0, 1) if packed else o  # [N, 1, H, V]
        assert rel_err(o[0::2], o_ref[0::2, t:t + 1]) < FP32_TOL
        # the padding sequence starts from zero at every step: its reference is one token from a zero state
        o_pad, _ = naive_recurrent_kda(*[x[1:2, t:t + 1] for x in ref_inputs], use_qk_l2norm_in_kernel=True)
        assert rel_err(o[1:2], o_pad) < FP32_TOL
    assert rel_err(pool[3], s_ref[0]) < FP32_TOL and rel_err(pool[0], s_ref[2]) < FP32_TOL
    for untouched in (1, 2, 4):
        assert torch.equal(pool[untouched], pool_before[untouched])


def test_recurrent_refuses_grad_and_float64():
    inputs, _ = make_inputs(1, 1, 1, 16, 16, "tensor", seed=14)
    leaves = [x.clone().requires_grad_() for x in inputs]
    with pytest.raises(RuntimeError, match="forward-only"):
        fused_recurrent_kda_triton(*leaves)
    with torch.no_grad():
        o, _ = fused_recurrent_kda_triton(*leaves)
    assert torch.isfinite(o).all()
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        fused_recurrent_kda_triton(*[x.double() for x in inputs])
    with pytest.raises(ValueError, match="state pool"):
        fused_recurrent_kda_triton(*inputs, initial_state=torch.zeros(4, 1, 16, 8),
                                   state_indices=torch.zeros(1, dtype=torch.int64))
