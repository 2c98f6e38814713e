"""`k3rl params`, `k3rl init` and `k3rl export`: parameter counts of a model recipe, a fresh HF model directory,
and a K3 directory rewritten in a released layout.

`params CONFIG [--json]` prints `model.params.count_parameters`: total and active-per-token
parameters by component, counted on the meta device.

`init CONFIG OUT_DIR` writes a randomly initialised `K3ForCausalLM` (and its tokenizer) as a
Hugging Face directory with `model.init.init_model`, in the layout its config chooses (model/formats/layouts.py).

`export SRC DST [--layout kimi_linear|kimi_k3] [--quantize mxfp4] [--trust-remote-code]` reads a K3 directory
in any layout k3rl reads (the two released ones, k3rl's old `k3rl_k3` one) and writes it in the chosen layout
(default: the one its config chooses), weights in the dtype they were saved in, the tokenizer copied (its own
code, `tokenization_*.py`, only with `--trust-remote-code`: model/formats/trust.py). Every file the source's index names
must lie inside it, and a malformed index is refused by name (exit 2). The source is verified as every load is
(model/formats/integrity.py): its `COMPLETE` manifest when it has one (a learner checkpoint `step-N/`, an SFT `model/`),
shard set, shapes, dtypes, and NaN/inf weights, refused by tensor unless `--allow-nonfinite`. `--quantize mxfp4`
stores the routed experts in MXFP4, which is lossy (4-bit values, one shared power-of-two scale per 32); a NaN/inf
there is refused by tensor (it would make its group of 32 NaN) and a value beyond ≈2.98e38 is a warning (it
decodes to inf).
CONFIG is any recipe with a `model:` section, read by the job loader (`k3rl.rl.config.load_model_config`:
`base:` recipes, dotted overrides with or without the `model.` prefix). Both commands parse their
arguments before importing torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from k3rl.model.params import count_parameters  # noqa: F401  (also `from rl.commands.model_tools import count_parameters`)


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f}{unit}"
    return str(n)


def _load(prog: str, path: str, overrides: list[str]):
    """The recipe's model section as a K3Config, or None after printing the ConfigError."""
    from k3rl.rl.config import ConfigError, load_model_config

    try:
        return load_model_config(path, overrides)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None


def params_main(argv: list[str]) -> int:
    """k3rl params CONFIG [key=value ...] [--json]: total and active-per-token parameters by component."""
    parser = argparse.ArgumentParser(prog="k3rl params", description=params_main.__doc__)
    parser.add_argument("config", help="YAML recipe with a `model:` section (a model file or any job recipe)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_hidden_layers=8")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    config = _load("k3rl params", args.config, args.overrides)
    if config is None:
        return 2
    counts = count_parameters(config)
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
    parser.add_argument("config", help="YAML recipe with a `model:` section (a model file or any job recipe)")
    parser.add_argument("out_dir", help="directory to create (must not exist or be empty)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.hidden_size=64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-tokenizer", action="store_true", help="skip training the BPE tokenizer")
    args = parser.parse_args(argv)
    if os.path.exists(args.out_dir) and os.listdir(args.out_dir):
        print(f"k3rl init: {args.out_dir} exists and is not empty", file=sys.stderr)
        return 2
    config = _load("k3rl init", args.config, args.overrides)
    if config is None:
        return 2
    from k3rl.envs.registry import tokenizer_texts
    from k3rl.model.init import init_model

    try:
        texts = None if args.no_tokenizer else tokenizer_texts()
        result = init_model(config, args.out_dir, seed=args.seed, tokenizer_texts=texts)
    except ValueError as e:
        print(f"k3rl init: {e}", file=sys.stderr)
        return 2
    print(result.line())
    return 0


def export_main(argv: list[str]) -> int:
    """k3rl export SRC DST [--layout kimi_linear|kimi_k3] [--quantize mxfp4] [--merge-lora ADAPTER_DIR]
    [--trust-remote-code] [--allow-nonfinite]: a K3 directory in a released layout."""
    parser = argparse.ArgumentParser(prog="k3rl export", description=export_main.__doc__)
    parser.add_argument("src", help="K3 directory in any layout k3rl reads (kimi_linear, kimi_k3, old k3rl_k3)")
    parser.add_argument("dst", help="directory to create (must not exist or be empty)")
    parser.add_argument("--layout", choices=("kimi_linear", "kimi_k3"), default=None,
                        help="layout to write (default: the config's checkpoint_layout rule)")
    parser.add_argument("--quantize", choices=("mxfp4",), default=None,
                        help="store the routed experts in MXFP4 (compressed-tensors): LOSSY")
    parser.add_argument("--merge-lora", default=None, metavar="ADAPTER_DIR",
                        help="merge LoRA adapters in PEFT's format (a LoRA run's CHECKPOINT/adapter) into SRC, "
                             "their base, before writing")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="copy the source's own tokenizer code (tokenization_*.py named by an auto_map); "
                             "without it such a source is refused")
    parser.add_argument("--allow-nonfinite", action="store_true",
                        help="export weights holding NaN/inf anyway (refused by name without it; with --quantize "
                             "mxfp4 each one's group of 32 is stored as NaN)")
    args = parser.parse_args(argv)
    if os.path.exists(args.dst) and os.listdir(args.dst):
        print(f"k3rl export: {args.dst} exists and is not empty", file=sys.stderr)
        return 2
    from pathlib import Path

    import torch

    from k3rl.model.formats.config_json import raw_config
    from k3rl.model.formats.integrity import CheckpointError
    from k3rl.model.formats.layouts import CONFIG_FILE, MODEL_TYPES, layout_for
    from k3rl.model.formats.load import load_model
    from k3rl.model.formats.save import TOKENIZER_FILES, save_model
    from k3rl.model.formats.trust import check_remote_code
    from k3rl.util.atomic import atomic_dir

    src, dst = Path(args.src), Path(args.dst)
    try:
        raw = raw_config(src)
        if raw.get("model_type") not in MODEL_TYPES:
            raise ValueError(f"{src / CONFIG_FILE}: model_type {raw.get('model_type')!r} is not a K3 "
                             f"layout ({', '.join(MODEL_TYPES)})")
        text = raw.get("text_config", raw)
        if not isinstance(text, dict):
            raise ValueError(f"{src / CONFIG_FILE}: text_config must be an object, got {type(text).__name__}")
        dtype_name = text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or "float32"
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"{src / CONFIG_FILE}: dtype {dtype_name!r} is not a floating-point type")
        tokenizer = src if any(TOKENIZER_FILES.match(p.name) for p in src.iterdir()) else None
        if tokenizer is not None:
            check_remote_code(src, args.trust_remote_code, model=False)
        # verified first (model/formats/integrity.py): its COMPLETE manifest when it has one, shard set, dtypes, finite values
        model = load_model(src, dtype=dtype, allow_nonfinite=args.allow_nonfinite)
        if args.merge_lora is not None:
            from k3rl.rl.train.lora import merge_saved_adapter

            adapter = Path(args.merge_lora)
            if not (adapter / "adapter_config.json").is_file():
                raise ValueError(f"--merge-lora {adapter}: no adapter_config.json (PEFT's format) there")
            merged = merge_saved_adapter(model, adapter)
            model = load_model(src, dtype=dtype, allow_nonfinite=args.allow_nonfinite)
            model.load_state_dict(merged)
        # a refused write (NaN in an MXFP4 tensor) leaves no half-written temporary directory behind
        with atomic_dir(dst) as tmp:
            save_model(model, tmp, layout=args.layout, tokenizer_from=tokenizer, quantize=args.quantize,
                       trust_remote_code=args.trust_remote_code, allow_nonfinite=args.allow_nonfinite)
    except (OSError, ValueError, CheckpointError) as e:
        print(f"k3rl export: {e}", file=sys.stderr)
        return 2
    layout = args.layout or layout_for(model.config)
    lossy = ", routed experts in MXFP4 (lossy)" if args.quantize else ""
    lossy += f", LoRA adapters of {args.merge_lora} merged" if args.merge_lora else ""
    print(f"wrote {dst}: layout {layout}, {str(dtype).removeprefix('torch.')}{lossy}"
          f"{', tokenizer copied' if tokenizer else ''}")
    return 0
