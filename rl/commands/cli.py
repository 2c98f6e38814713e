"""The `k3rl` command line.

Each subcommand is a `main(argv) -> int` function in its launcher module under rl/commands/, imported
only when that subcommand runs: `k3rl --help` and argument errors answer without importing
torch, Ray or vLLM. Every command that takes a config reads `CONFIG.yaml` followed by dotted
`key=value` overrides (see `rl/config/`, one schema per command).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> ("module:function", one line of help). Adding a command is a deliberate act: one line here.
COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("k3rl.rl.commands.cli:config_main", "print the fully resolved config of CONFIG [overrides…] as YAML"),
    "selfcheck": ("k3rl.rl.commands.selfcheck:main", "check the stack end to end: Ray actors, Triton kernels, vLLM vs transformers"),
    "quickstart": ("k3rl.rl.commands.quickstart:main", "quickstart [CONFIG] [key=value…]: the main job — tiny K3 from scratch, SFT, "
                   "GRPO on Ray, held-out success before/after RL"),
    "train": ("k3rl.rl.commands.train:main", "train CONFIG [key=value…]: RL post-training on Ray (rl.resume=true continues a run)"),
    "eval": ("k3rl.rl.commands.eval:main", "eval CONFIG [key=value…]: long-context evidence retrieval, families × lengths × "
                                     "servings, with oracle and closed-book baselines"),
    "pretrain": ("k3rl.rl.commands.pretrain:main", "pretrain CONFIG [key=value…] [--plan]: staged pretraining, the context climb "
                 "(e.g. 512 → 32K on CPU, 8K → 1M in the reference recipe) on the RL learner"),
    "sft": ("k3rl.rl.commands.sft:main",
            "sft CONFIG [key=value…]: supervised warm start on oracle demonstrations (the learner, nll objective)"),
    "params": ("k3rl.rl.commands.model_tools:params_main", "params CONFIG [key=value…] [--json]: total and active parameters by component"),
    "init": ("k3rl.rl.commands.model_tools:init_main", "init CONFIG OUT_DIR [key=value…]: random-init K3 model (+ tokenizer) as an HF dir"),
    "export": ("k3rl.rl.commands.model_tools:export_main", "export SRC DST [--layout kimi_linear|kimi_k3] [--quantize mxfp4]: a K3 dir "
               "(any layout) rewritten in a released layout"),
    "envs": ("k3rl.rl.commands.envs:main", "list the registered environments, one line each"),
    "corpus": ("k3rl.rl.commands.corpus:main", "corpus build CONFIG|NAME [key=value…] [--rebuild]: build and cache a corpus index"),
}


def config_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser for `k3rl <command> CONFIG [key=value …]`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("config", metavar="CONFIG", help="a YAML recipe, e.g. configs/rl/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. learner.lr=1e-5; ~key resets a key (a dict to empty)")
    return parser


def config_main(argv: list[str]) -> int:
    args = config_parser("k3rl config", COMMANDS["config"][1]).parse_args(argv)
    from k3rl.rl.config import load_config, to_yaml

    print(to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    width = max(len(name) for name in COMMANDS)
    listing = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="k3rl", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Agentic RL post-training for Kimi-K3-style models.",
        epilog=f"commands:\n{listing}\n\n`k3rl COMMAND --help` describes a command.")
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    if not argv:
        parser.print_help()
        return 2
    ns = parser.parse_args(argv[:1])
    module, func = COMMANDS[ns.command][0].split(":")
    from k3rl.rl.config import ConfigError

    try:
        return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)
    except ConfigError as e:
        print(f"k3rl {ns.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
