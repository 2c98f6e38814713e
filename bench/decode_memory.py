"""Decode-cache bytes per sequence of the hybrid K3 model vs an all-MLA and a plain multi-head-attention
(MHA) model of the same width and depth, at contexts 1K…1M (docs/model_spec.md §5.6, §6, §11; docs/performance.md).

Tiny config (configs/model/tiny.yaml), measured: each model prefills real token sequences of
1K, 2K and 4K tokens in bf16 and the bytes of the cache it returns are summed (K3Cache for the
hybrid and all-MLA models, transformers' DynamicCache of a LlamaForCausalLM with the same
hidden size, depth and heads for MHA). The run fails unless every measurement equals the bytes
computed from the layout: per MLA layer `kv_lora_rank + qk_rope_head_dim` values per token;
per KDA layer a constant conv state `3·H·K·(W−1)` (bf16) and recurrent state `H·K·K` (fp32);
per MHA layer `2·d` values per token. The per-token slope and the constant part are fitted from
the measurements. Contexts beyond 4K, and the reference config (configs/model/k3.yaml),
are computed from the layout only.

    python bench/decode_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3rl.model.cache import K3Cache  # noqa: E402
from k3rl.rl.config import load_model_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MEASURED = [1024, 2048, 4096]
COMPUTED = [2**10, 2**13, 2**16, 2**17, 2**18, 2**19, 2**20]
BF16 = 2


def all_mla(config):
    """The same model with every layer MLA (kda_layers empty)."""
    values = config.model_config_dict()
    values["linear_attn_config"] |= {"kda_layers": [], "full_attn_layers": list(range(1, config.num_hidden_layers + 1))}
    values["max_position_embeddings"] = max(values["max_position_embeddings"], max(MEASURED))
    return type(config)(**values)


def mha_layout_bytes(config, tokens: int) -> int:
    return config.num_hidden_layers * 2 * config.hidden_size * tokens * BF16


def measure_k3(config, tokens: int) -> int:
    from k3rl.model.modeling import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    return cache.nbytes()


def measure_mha(config, tokens: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = config.num_attention_heads
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=config.hidden_size // heads, max_position_embeddings=max(MEASURED))).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    with torch.no_grad():
        cache = llama(ids, use_cache=True).past_key_values
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def human(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def context(n: int) -> str:
    return f"{n // 2**20}M" if n >= 2**20 else f"{n // 2**10}K"


def main() -> int:
    tiny = load_model_config(str(ROOT / "configs/model/tiny.yaml"), [f"max_position_embeddings={max(MEASURED)}"])
    tiny_mla = all_mla(tiny)
    rows, ok = [], True
    for n in MEASURED:
        got = (measure_k3(tiny, n), measure_k3(tiny_mla, n), measure_mha(tiny, n))
        want = (K3Cache.layout_bytes(tiny, 1, n), K3Cache.layout_bytes(tiny_mla, 1, n), mha_layout_bytes(tiny, n))
        ok &= got == want
        rows.append((n, got, want))
    print("## Tiny config, measured on real caches (bf16, batch 1)\n")
    print("| context | hybrid K3 | all-MLA | MHA | measured == layout |")
    print("|---|---|---|---|---|")
    for n, got, want in rows:
        print(f"| {context(n)} | {got[0]:,} B | {got[1]:,} B | {got[2]:,} B | {'yes' if got == want else f'NO {want}'} |")
    (n0, g0, _), (n1, g1, _) = rows[0], rows[-1]
    slopes = [(b - a) / (n1 - n0) for a, b in zip(g0, g1)]
    consts = [a - s * n0 for a, s in zip(g0, slopes)]
    print("\n| model | bytes per token (slope) | constant bytes (KDA conv + recurrent state) |")
    print("|---|---|---|")
    for name, s, c in zip(("hybrid K3", "all-MLA", "MHA"), slopes, consts):
        print(f"| {name} | {s:,.0f} | {c:,.0f} |")
    if not ok:
        print("\nFAILED: a measured cache differs from its layout; no computed table is reported.", file=sys.stderr)
        return 1

    ref = load_model_config(str(ROOT / "configs/model/k3.yaml"))
    for name, cfg in (("Tiny config", tiny), ("Reference config k3", ref)):
        mla = all_mla(cfg)
        lac = cfg.linear_attn_config
        print(f"\n## {name}, computed from the layout (bf16 cache, fp32 KDA state, batch 1): "
              f"{len(lac['kda_layers'])} KDA + {len(lac['full_attn_layers'])} MLA layers, d = {cfg.hidden_size}\n")
        print("| context | hybrid K3 | all-MLA | MHA | hybrid / all-MLA | hybrid / MHA |")
        print("|---|---|---|---|---|---|")
        for n in COMPUTED:
            h, m, a = K3Cache.layout_bytes(cfg, 1, n), K3Cache.layout_bytes(mla, 1, n), mha_layout_bytes(cfg, n)
            print(f"| {context(n)} | {human(h)} | {human(m)} | {human(a)} | {h / m:.3f} | {h / a:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
