"""`k3rl params` and `k3rl init`: parameter counts of a model recipe, and a fresh HF model directory.

`params CONFIG [--json]` prints `model.params.count_parameters`: total and active-per-token
parameters by component, counted on the meta device.

`init CONFIG OUT_DIR` writes a randomly initialised `K3ForCausalLM` (and its tokenizer) as a
Hugging Face directory with `model.init.init_model`.
CONFIG is any recipe with a `model:` section, read by the job loader (`rl.config.load_model_config`:
`base:` recipes, dotted overrides with or without the `model.` prefix). Both commands parse their
arguments before importing torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from model.params import count_parameters  # noqa: F401  (also `from model.cli import count_parameters`)


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f}{unit}"
    return str(n)


def _load(prog: str, path: str, overrides: list[str]):
    """The recipe's model section as a K3Config, or None after printing the ConfigError."""
    from rl.config import ConfigError, load_model_config

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
    from model.init import init_model

    try:
        result = init_model(config, args.out_dir, seed=args.seed, tokenizer=not args.no_tokenizer)
    except ValueError as e:
        print(f"k3rl init: {e}", file=sys.stderr)
        return 2
    print(result.line())
    return 0
