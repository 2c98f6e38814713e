"""Routed experts at decode sizes: each path of kernels/moe/grouped.py and the per-expert reference, by batch.

The tiny K3's MoE (8 experts of 128 → 128, top-2, SiTU-GLU), fp32, 1 thread, inference mode; N tokens of one decode
step. Paths, timed in the same run: the per-expert reference (kernels/moe/naive.py `naive_experts`), the padded
buffer (three bmm over all experts), the loop over the chosen experts, and `auto` (what `grouped_experts` picks,
`strategy`). Every path's output is checked against the reference before timing. Median of 200 calls.

    python bench/moe_decode.py
"""

from __future__ import annotations

import os
import sys
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from timing import median_ms  # noqa: E402  (bench/timing.py)

from k3rl.kernels.moe import SituGLU, dispatch, grouped_experts, naive_experts  # noqa: E402
from k3rl.kernels.moe.grouped import strategy  # noqa: E402

E, D, INTER, TOP_K = 8, 128, 128, 2


def main() -> int:
    torch.set_num_threads(1)
    act = SituGLU(4.0, 25.0)
    g = torch.Generator().manual_seed(0)
    w1, w3 = (torch.randn(E, INTER, D, generator=g) * D ** -0.5 for _ in range(2))
    w2 = torch.randn(E, D, INTER, generator=g) * INTER ** -0.5
    paths = {"per-expert reference": naive_experts, "padded": partial(grouped_experts, how="padded"),
             "loop": partial(grouped_experts, how="loop"), "auto": grouped_experts}
    print(f"load {os.getloadavg()[0]:.2f}; ms per call, median of 200")
    print("| batch | experts chosen | " + " | ".join(paths) + " | auto picks |")
    print("|---|---|" + "---|" * (len(paths) + 1))
    with torch.inference_mode():
        for n in (1, 2, 4, 8, 32):
            z = torch.randn(n, D, generator=g)
            ids = torch.rand(n, E, generator=g).topk(TOP_K, -1).indices
            weights = torch.rand(n, TOP_K, generator=g)
            args = (z, ids, weights, w1, w3, w2, act)
            ref = naive_experts(*args)
            for name, fn in paths.items():
                assert torch.allclose(fn(*args), ref, rtol=1e-5, atol=1e-5), name
            ms = [median_ms(lambda fn=fn: fn(*args), 200, warmup=20) for fn in paths.values()]
            picked = strategy(dispatch(ids, E), z.new_empty(n * TOP_K, D), w1)
            print(f"| {n} | {int(ids.unique().numel())} | " + " | ".join(f"{t:.3f}" for t in ms) + f" | {picked} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
