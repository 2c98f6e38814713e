"""Routed experts: `routed_experts(z, ids, weights, w1, w3, w2, act, impl)` runs every token through the
k experts the router chose and sums their outputs with the router weights.

Two implementations of the same operation, selected by `impl`:
- `grouped` (grouped.py, the default): tokens sorted by expert, then one grouped matmul per projection
  for all experts at once; what decode and training use.
- `naive` (naive.py): the same sort, then one small matmul per expert in a Python loop; the reference
  the grouped path is tested against (tests/kernels/test_moe_experts.py) and the baseline of bench/rollout.py.

Expert weights are stacked, one tensor per projection in `nn.Linear` layout: w1 (gate) and w3 (up)
[E, I, d], w2 (down) [E, d, I] (model/moe.py `Experts`).
"""

from kernels.moe.grouped import grouped_experts, grouped_linear
from kernels.moe.naive import naive_experts
from kernels.moe.permute import Dispatch, dispatch

IMPLEMENTATIONS = {"grouped": grouped_experts, "naive": naive_experts}


def routed_experts(z, ids, weights, w1, w3, w2, act, impl: str = "grouped"):
    """Σ_k weights[:, k] · expert_{ids[:, k]}(z) [N, d] for z [N, d], ids/weights [N, k]; see module docstring."""
    try:
        fn = IMPLEMENTATIONS[impl]
    except KeyError:
        raise ValueError(f"moe impl must be one of {sorted(IMPLEMENTATIONS)}, got {impl!r}") from None
    return fn(z, ids, weights, w1, w3, w2, act)


__all__ = ["Dispatch", "IMPLEMENTATIONS", "dispatch", "grouped_experts", "grouped_linear", "naive_experts",
           "routed_experts"]
