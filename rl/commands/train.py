"""`k3rl train CONFIG [key=value…]`: RL post-training on Ray, the trainer loop of rl/orchestrator/trainer.py.

Loads the job config, builds the `Trainer` (every config and model check runs before Ray starts; a
ConfigError is exit 2) and trains to `rl.steps`; `rl.resume=true` continues a run from its last checkpoint.
"""

from __future__ import annotations

import sys
from typing import Optional

from k3rl.rl.commands.cli import config_parser


def main(argv: Optional[list[str]] = None) -> int:
    """`k3rl train CONFIG [key=value…]`."""
    argv = sys.argv[1:] if argv is None else argv
    args = config_parser("k3rl train", "RL post-training: rollout workers, learner, weight sync, "
                                       "checkpoints (rl.resume=true continues a run)").parse_args(argv)
    from k3rl.rl.config import ConfigError, TrainJob, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    try:
        cfg = load_config(args.config, args.overrides, schema=TrainJob)
        trainer = Trainer(cfg)
    except ConfigError as e:
        print(f"k3rl train: {e}", file=sys.stderr)
        return 2
    print(f"run directory: {trainer.run_dir.resolve()}", flush=True)
    run_dir = trainer.train()
    print(f"finished: {run_dir.resolve()} (metrics.jsonl, tb/, plots/, checkpoints/)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
