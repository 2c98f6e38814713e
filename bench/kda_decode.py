"""One KDA layer's decode step: the fused no-grad step (model/kda.py `_decode_step`: one GEMM for the six input
projections, one window product for the three short convolutions) against the layer's general path, by batch.

The general path is what the layer runs with grad enabled; here its parameters do not require grad and neither do
the inputs, so no graph is built and the two paths differ only in their ops. A KDA layer of the recipe's tiny K3
(configs/longctx/model.yaml), fp32, 1 thread, cache state from a 64-token prefill. The outputs are compared first;
then rounds alternate the two paths (30 calls each), and the table shows the median ms per call.

    python bench/kda_decode.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from k3rl.model.cache import K3Cache, make_step  # noqa: E402
from k3rl.model.kda import KimiDeltaAttention  # noqa: E402
from k3rl.rl.config import load_model_config  # noqa: E402

ROUNDS, CALLS = 15, 30


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = load_model_config(str(ROOT / "configs/longctx/model.yaml"))
    layer_idx = next(i for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i))
    layer = KimiDeltaAttention(cfg, layer_idx).eval().requires_grad_(False)
    lac = cfg.linear_attn_config
    print(f"load {os.getloadavg()[0]:.2f}; KDA layer {layer_idx}: hidden {cfg.hidden_size}, {lac['num_heads']} heads "
          f"× {lac['head_dim']}; median of {ROUNDS} rounds × {CALLS} calls, paths alternating")
    print("| batch | general path ms | fused step ms | speed-up |")
    print("|---|---|---|---|")
    for batch in (1, 8, 32):
        caches, x = {}, torch.randn(batch, 1, cfg.hidden_size)
        for fused in (False, True):
            caches[fused] = K3Cache.create(cfg, batch, capacity=0)
            with torch.no_grad():
                layer(torch.randn(batch, 64, cfg.hidden_size, generator=torch.Generator().manual_seed(batch)),
                      make_step((batch, 64), "cpu", caches[fused], None, 10**6))

        def call(fused: bool):
            with torch.set_grad_enabled(not fused):
                return layer(x, make_step((batch, 1), "cpu", caches[fused], None, 10**6))

        torch.testing.assert_close(call(True), call(False), rtol=1e-5, atol=1e-6)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(ROUNDS):
            for fused in (False, True):
                start = time.perf_counter()
                for _ in range(CALLS):
                    call(fused)
                times[fused].append((time.perf_counter() - start) / CALLS * 1e3)
        general, fused = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {batch} | {general:.3f} | {fused:.3f} | {general / fused:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
