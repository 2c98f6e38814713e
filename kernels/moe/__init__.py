"""Routed experts: `routed_experts(z, ids, weights, w1, w3, w2, act, impl)` runs every token through the
k experts the router chose and sums their outputs with the router weights.

Three implementations of the same operation, selected by `impl` (`auto`, the default, picks `triton` for
CUDA tensors (kernels/dispatch.py: unless K3RL_DISABLE_TRITON=1) when the activation is a `SituGLU` and the
dtype is one the kernels take; `grouped` otherwise):
- `triton` (triton.py, gate_up.py, grouped_gemm.py): tokens sorted by expert, a Triton grouped GEMM per
  projection with SiTU-GLU fused into the gate/up GEMM; on CPU tensors only under TRITON_INTERPRET=1.
- `grouped` (grouped.py): tokens sorted by expert, then one grouped matmul per projection
  for all experts at once (PyTorch); what the CPU runs for decode and training.
- `naive` (naive.py): the same sort, then one small matmul per expert in a Python loop; the reference
  the grouped path is tested against (tests/kernels/test_moe_experts.py) and the baseline of bench/rollout.py.

Expert weights are stacked, one tensor per projection in `nn.Linear` layout: w1 (gate) and w3 (up)
[E, I, d], w2 (down) [E, d, I] (model/moe.py `Experts`).
"""

from k3rl.kernels.dispatch import use_triton
from k3rl.kernels.moe.grouped import grouped_experts, grouped_linear
from k3rl.kernels.moe.grouped_gemm import grouped_linear_triton
from k3rl.kernels.moe.naive import naive_experts
from k3rl.kernels.moe.permute import Dispatch, dispatch
from k3rl.kernels.moe.triton import SituGLU, supports, triton_experts

IMPLEMENTATIONS = {"grouped": grouped_experts, "naive": naive_experts, "triton": triton_experts}


def routed_experts(z, ids, weights, w1, w3, w2, act, impl: str = "auto"):
    """Σ_k weights[:, k] · expert_{ids[:, k]}(z) [N, d] for z [N, d], ids/weights [N, k]; see module docstring."""
    if impl == "auto":
        impl = "triton" if use_triton(z) and isinstance(act, SituGLU) and supports(z, w1, w3, w2) else "grouped"
    try:
        fn = IMPLEMENTATIONS[impl]
    except KeyError:
        raise ValueError(f"moe impl must be one of {sorted(IMPLEMENTATIONS)}, got {impl!r}") from None
    return fn(z, ids, weights, w1, w3, w2, act)


__all__ = ["Dispatch", "IMPLEMENTATIONS", "SituGLU", "dispatch", "grouped_experts", "grouped_linear",
           "grouped_linear_triton", "naive_experts", "routed_experts", "triton_experts"]
