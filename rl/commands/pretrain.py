"""`k3rl pretrain CONFIG [key=value …] [--plan]`: staged pretraining, the context climb (rl/pretrain/climb.py), or
with `--plan` its cost on the cluster of `pretrain.plan` without running (rl/pretrain/plan.py)."""

from __future__ import annotations

import os
import sys

from k3rl.rl.config import PretrainJob


def main(argv: list[str]) -> int:
    """`k3rl pretrain CONFIG [key=value …] [--plan]`."""
    from k3rl.rl.commands.cli import config_parser
    from k3rl.rl.config import load_config

    parser = config_parser("k3rl pretrain", "staged pretraining: the context climb on the RL learner")
    parser.add_argument("--plan", action="store_true", help="print tokens, steps, FLOPs, memory per rank and time on "
                        "the cluster of `pretrain.plan` for every stage, and exit without running")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides, PretrainJob)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    if args.plan:
        from k3rl.rl.pretrain.climb import check
        from k3rl.rl.pretrain.plan import plan_from_job

        check(cfg)
        text, _ = plan_from_job(cfg)
        print(text, flush=True)
        return 0
    from k3rl.rl.pretrain.climb import Climb

    Climb(cfg).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
