"""MLA decode attention over the latent cache: the matmul form against SDPA over per-head-expanded latents.

One decode step of the tiny K3's MLA layer (configs/model/tiny.yaml: 4 heads, latent Lkv = 64 + dr = 16) over a
cache of S latents, batch B, float32, inference mode. Timed, the attention core only (queries already absorbed):
  * sdpa-expanded: the form model/mla.py used before issue 31, `F.scaled_dot_product_attention` over the latents
    expanded to [B, H, S, D] (a stride-0 view that the CPU kernels materialise per head);
  * matmul: model/mla.py `_attend_block`, the form decode takes now, two batched matmuls over the one latent the
    heads share;
  * the whole layer's decode step (projections included), for the share attention takes of it.
The floor is the latent read once (B·S·(Lkv + dr)·4 bytes) at this machine's copy bandwidth, measured in the
same run (a copy of a 256 MiB tensor: bytes read + written over time). Outputs of the two forms are compared
(max relative error) before anything is timed.

    python bench/mla_decode.py                 # S ∈ {2K, 16K, 64K}, B ∈ {1, 8}
    python bench/mla_decode.py --quick         # S ∈ {2K, 16K}, B = 1
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from timing import median_ms  # noqa: E402  (bench/timing.py)

from k3rl.model.cache import K3Cache, make_step  # noqa: E402
from k3rl.model.config import K3Config  # noqa: E402
from k3rl.model.mla import MultiheadLatentAttention  # noqa: E402

TINY = dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=1, num_attention_heads=4,
            q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            mla_use_nope=True, mla_use_output_gate=True, max_position_embeddings=1 << 20,
            linear_attn_config=dict(kda_layers=[], full_attn_layers=[1], num_heads=4, head_dim=32))


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 256 MiB tensor copy (median of 5)."""
    src = torch.randn(64 << 20)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 5, warmup=3)
    return 2 * src.numel() * 4 / (ms / 1e3)


def sdpa_expanded(layer: MultiheadLatentAttention, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """The former decode form: q [B, 1, H, D] (absorbed, unscaled) over latents expanded per head → [B, 1, H, Lkv]."""
    B, S, D = latent.shape
    H = layer.num_heads
    keys = latent[:, None].expand(B, H, S, D)
    values = latent[:, None, :, : layer.kv_rank].expand(B, H, S, layer.kv_rank)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, scale=layer.scale)  # [B, H, 1, Lkv]
    return out.transpose(1, 2)


def measure(layer, B: int, S: int, bandwidth: float, reps: int) -> dict:
    D = layer.kv_rank + layer.rope_dim
    gen = torch.Generator().manual_seed(S + B)
    latent = torch.randn(B, S, D, generator=gen)
    q = torch.randn(B, 1, layer.num_heads, D, generator=gen)
    cache = K3Cache.create(layer.config, B, capacity=S + 1)
    cache.latent[0][:, :S] = latent
    cache.commit(S)
    step = make_step((B, 1), "cpu", cache, None, layer.config.max_position_embeddings)
    full = torch.cat([latent, torch.randn(B, 1, D, generator=gen)], dim=1)  # what the step sees: S + 1 keys
    with torch.inference_mode():
        old = sdpa_expanded(layer, q, full)
        new = layer._attend_block(q * layer.scale, full, step, 0)
        err = ((old - new).norm() / old.norm()).item()
        t_old = median_ms(lambda: sdpa_expanded(layer, q, full), reps, warmup=3)
        t_new = median_ms(lambda: layer._attend_block(q * layer.scale, full, step, 0), reps, warmup=3)
        x = torch.randn(B, 1, layer.config.hidden_size, generator=gen)

        def layer_step():
            layer(x, step)
            cache.seq_len = S  # the step appended one latent; keep the cache at S for the next rep

        t_layer = median_ms(layer_step, reps, warmup=3)
    floor = B * (S + 1) * D * 4 / bandwidth * 1e3
    return dict(B=B, S=S, err=err, sdpa_ms=t_old, matmul_ms=t_new, layer_ms=t_layer, floor_ms=floor)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    layer = MultiheadLatentAttention(K3Config(**TINY), 0).eval()
    bandwidth = copy_bandwidth()
    cases = [(1, 2048), (1, 16384)] if args.quick else [(b, s) for b in (1, 8) for s in (2048, 16384, 65536)]
    print(f"threads {torch.get_num_threads()}, copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write), "
          f"load {os.getloadavg()[0]:.2f}")
    print("| B | S | rel. err | SDPA expanded ms | matmul ms | speed-up | floor ms | matmul ÷ floor | layer step ms | "
          "attention share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B, S in cases:
        r = measure(layer, B, S, bandwidth, args.reps)
        print(f"| {B} | {S} | {r['err']:.1e} | {r['sdpa_ms']:.3f} | {r['matmul_ms']:.3f} | "
              f"{r['sdpa_ms'] / r['matmul_ms']:.1f}× | {r['floor_ms']:.3f} | {r['matmul_ms'] / r['floor_ms']:.1f}× | "
              f"{r['layer_ms']:.3f} | {r['matmul_ms'] / r['layer_ms']:.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
