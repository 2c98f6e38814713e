"""`k3rl params` and `k3rl init`: parameter counts of a model recipe, and a fresh HF model directory.

`params CONFIG [--json]` counts total and active-per-token parameters by component without
allocating them: one decoder layer of each distinct kind (KDA or MLA mixer × MoE or dense FFN)
is built on the meta device, counted, and multiplied by how many layers of that kind the
config has; the top-level modules are counted the same way. Active = everything except the
routed experts, plus top-k of E routed experts per MoE layer (embedding and lm_head are counted
in full, as DeepSeek-V3/Kimi-K2 report "activated parameters"). The routing bias is a buffer,
not a parameter, and is not counted.

`init CONFIG OUT_DIR` writes a randomly initialised `K3ForCausalLM` as a Hugging Face directory
(written to a temporary sibling and renamed, so a crash never leaves half a directory), plus,
for vocabularies up to 65,536, a byte-level BPE tokenizer trained on the built-in wiki text and
the environments' tool protocol (`envs.registry.protocol_texts`).
Both commands parse their arguments before importing torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections import Counter

TOKENIZER_MAX_VOCAB = 65536
PROTOCOL_REPEATS = 100


def _component(name: str) -> str:
    """Component of a parameter name of a decoder layer or of the top level."""
    for key, comp in (("block_sparse_moe.experts.", "moe.routed_experts"),
                      ("block_sparse_moe.shared_experts.", "moe.shared_experts"),
                      ("block_sparse_moe.gate.", "moe.router"),
                      ("block_sparse_moe.routed_expert_", "moe.latent_projections"),
                      ("mlp.", "dense_mlp"), ("embed_tokens.", "embedding"), ("lm_head.", "lm_head"),
                      ("patch_embed.", "image_patch_embed")):
        if key in name:
            return comp
    return "norms_and_attn_res"


def count_parameters(config) -> dict:
    """Total and active parameter counts of `config`, by component (meta device, nothing allocated)."""
    import torch
    from torch import nn

    from model.attn_res import RMSNorm
    from model.modeling import AttnResProj, K3DecoderLayer
    from model.moe import is_moe_layer
    from model.vision import PatchEmbed

    def kind(i: int) -> tuple[bool, bool]:
        return config.is_kda_layer(i), is_moe_layer(config, i)

    # (is_kda, is_moe) → number of layers of that kind
    kinds = Counter(kind(i) for i in range(config.num_hidden_layers))
    total, routed = Counter(), Counter()
    with torch.device("meta"):
        for (is_kda, is_moe), n_layers in kinds.items():
            layer = K3DecoderLayer(config, next(i for i in range(config.num_hidden_layers) if kind(i) == (is_kda, is_moe)))
            for name, p in layer.named_parameters():
                comp = ("attention.kda" if is_kda else "attention.mla") if name.startswith("self_attn.") else _component(name)
                total[comp] += n_layers * p.numel()
            if is_moe:
                routed["moe.routed_experts"] += n_layers * sum(p.numel() for p in layer.block_sparse_moe.experts.parameters())
        top = nn.ModuleDict({"embed_tokens": nn.Embedding(config.vocab_size, config.hidden_size),
                             "lm_head": nn.Linear(config.hidden_size, config.vocab_size, bias=False),
                             "norm": RMSNorm(config.hidden_size)})
        if config.attn_res_block_size is not None:
            top["output_attn_res_norm"] = RMSNorm(config.hidden_size)
            top["output_attn_res_proj"] = AttnResProj(config.hidden_size)
        if config.media_placeholder_token_id is not None:
            top["patch_embed"] = PatchEmbed(config)
        for name, p in top.named_parameters():
            total[_component(name)] += p.numel()
    active = Counter(total)
    if config.num_experts is not None:
        active["moe.routed_experts"] = routed["moe.routed_experts"] * config.num_experts_per_token // config.num_experts
    n_moe = sum(n for (_, moe), n in kinds.items() if moe)
    n_kda = sum(n for (kda, _), n in kinds.items() if kda)
    return {
        "total": sum(total.values()), "active": sum(active.values()),
        "num_experts": config.num_experts, "num_experts_per_token": config.num_experts_per_token,
        "layers": {"total": config.num_hidden_layers, "kda": n_kda, "mla": config.num_hidden_layers - n_kda,
                   "moe": n_moe, "dense": config.num_hidden_layers - n_moe},
        "components": {c: {"total": total[c], "active": active[c]} for c in sorted(total)},
    }


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f}{unit}"
    return str(n)


def params_main(argv: list[str]) -> int:
    """k3rl params CONFIG [key=value ...] [--json]: total and active-per-token parameters by component."""
    parser = argparse.ArgumentParser(prog="k3rl params", description=params_main.__doc__)
    parser.add_argument("config", help="YAML recipe with a `model:` section")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_hidden_layers=8")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    from model.config import load_model_yaml

    counts = count_parameters(load_model_yaml(args.config, args.overrides))
    if args.json:
        print(json.dumps(counts, indent=2))
        return 0
    print(f"{'component':<26}{'total':>14}{'active/token':>16}")
    for comp, c in counts["components"].items():
        print(f"{comp:<26}{_human(c['total']):>14}{_human(c['active']):>16}")
    print(f"{'all':<26}{_human(counts['total']):>14}{_human(counts['active']):>16}")
    lay = counts["layers"]
    print(f"layers: {lay['total']} ({lay['kda']} KDA, {lay['mla']} MLA; {lay['moe']} MoE, {lay['dense']} dense); "
          f"routed experts: {counts['num_experts']}, top-{counts['num_experts_per_token']}")
    return 0


def init_main(argv: list[str]) -> int:
    """k3rl init CONFIG OUT_DIR [key=value ...]: a randomly initialised K3 model as an HF directory."""
    parser = argparse.ArgumentParser(prog="k3rl init", description=init_main.__doc__)
    parser.add_argument("config", help="YAML recipe with a `model:` section")
    parser.add_argument("out_dir", help="directory to create (must not exist or be empty)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.hidden_size=64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-tokenizer", action="store_true", help="skip training the BPE tokenizer")
    args = parser.parse_args(argv)
    if os.path.exists(args.out_dir) and os.listdir(args.out_dir):
        print(f"k3rl init: {args.out_dir} exists and is not empty", file=sys.stderr)
        return 2
    import torch

    from model.config import load_model_yaml
    from model.modeling import K3ForCausalLM

    config = load_model_yaml(args.config, args.overrides)
    need = count_parameters(config)["total"] * 4
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > 0.8 * have:
        print(f"k3rl init: {need / 2**30:.1f} GiB of fp32 weights do not fit in {have / 2**30:.1f} GiB of memory",
              file=sys.stderr)
        return 2
    tokenizer = None
    if not args.no_tokenizer and config.vocab_size <= TOKENIZER_MAX_VOCAB:
        tokenizer = _train_builtin_tokenizer(config)
    torch.manual_seed(args.seed)
    model = K3ForCausalLM(config)
    tmp = os.path.join(os.path.dirname(os.path.abspath(args.out_dir)), f".{os.path.basename(args.out_dir)}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if os.path.exists(args.out_dir):
        os.rmdir(args.out_dir)
    os.replace(tmp, args.out_dir)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out_dir}: {n:,} parameters" + (f", tokenizer of {len(tokenizer)} tokens" if tokenizer else ""))
    return 0


def _train_builtin_tokenizer(config):
    from envs.corpus import builtin_texts
    from model.tokenizer import MEDIA_PLACEHOLDER_ID, train_tokenizer

    expected = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    for name, value in expected.items():
        if getattr(config, name) != value:
            raise ValueError(f"{name}: the built-in tokenizer uses id {value}, the config says {getattr(config, name)}")
    if config.media_placeholder_token_id not in (None, MEDIA_PLACEHOLDER_ID):
        raise ValueError(f"media_placeholder_token_id: the built-in tokenizer's <|media_pad|> is "
                         f"{MEDIA_PLACEHOLDER_ID}, the config says {config.media_placeholder_token_id}")
    from itertools import chain

    from envs.registry import protocol_texts

    # The tool protocol (schemas, calls, framing) is repeated so that its words become single tokens.
    texts = chain(builtin_texts("wiki"), protocol_texts() * PROTOCOL_REPEATS)
    return train_tokenizer(texts, config.vocab_size, model_max_length=config.max_position_embeddings)
