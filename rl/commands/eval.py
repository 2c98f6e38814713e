"""`k3rl eval CONFIG [key=value …]`: the long-context evidence-retrieval grid of rl/eval/grid.py (families ×
lengths × servings, with the oracle and closed-book baselines) on the model or endpoint the config names."""

from __future__ import annotations

import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    """`k3rl eval`: 0 when the grid ran, 2 for a config that cannot run (the error on stderr)."""
    from k3rl.rl.commands.cli import config_parser
    from k3rl.rl.config import ConfigError, EvalJob, load_config
    from k3rl.rl.eval.grid import run_grid

    argv = sys.argv[1:] if argv is None else argv
    args = config_parser("k3rl eval", "long-context evidence-retrieval evaluation: families × lengths × "
                                      "servings, with oracle and closed-book baselines").parse_args(argv)
    try:
        run_grid(load_config(args.config, args.overrides, EvalJob))
    except ConfigError as e:
        print(f"k3rl eval: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
